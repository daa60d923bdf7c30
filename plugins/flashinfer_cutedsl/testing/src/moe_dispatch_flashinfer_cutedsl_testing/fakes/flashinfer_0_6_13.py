"""Fake of FlashInfer 0.6.13.

Models v0.6.8-v0.6.13: kMaxTopK 22 with top-k in {1, 2, 4, 6, 8, 10, 16, 22}, 4 payloads;
fp4_quantize with backend= (v0.6.8), is_global_scale_inversed (v0.6.11), FLASHINFER_NVFP4_4OVER6
(v0.6.12), the global scale cast in Python (v0.6.13); the routing step's 2048-expert tiers (v0.6.8).
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 6, 13), a2a.MoeAlltoAll_0_6_0, cute_dsl.Wrapper_0_6_7)
