"""Fake of FlashInfer 0.6.17.

Models v0.6.16-v0.6.17: EPLB and rank-mask arguments, a five-field workspace-cache key, num_experts
>= ep_size with a ceil/floor expert partition, top-k in {1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22}, the
combine summing in fp32, CuteDslMoEWrapper(use_fused_finalize=) and run(per_token_scale=).
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 6, 17), a2a.MoeAlltoAll_0_6_16, cute_dsl.Wrapper_0_6_16)
