"""Fake of FlashInfer 0.6.14.

Models v0.6.14: combine's output_dtype / output_scales arguments, 6 payloads, the warp token policy
removed (TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN no longer read), CuteDslMoEWrapper(activation='silu').
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 6, 14), a2a.MoeAlltoAll_0_6_14, cute_dsl.Wrapper_0_6_14)
