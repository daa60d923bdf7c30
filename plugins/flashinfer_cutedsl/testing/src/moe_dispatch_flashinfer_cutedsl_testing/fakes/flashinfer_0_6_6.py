"""Fake of FlashInfer 0.6.6.

Models v0.6.0-v0.6.6: kMaxTopK 8 with top-k in {1, 2, 4, 8}, 8 payloads, num_experts divisible by
ep_size, a four-field workspace-cache key, tuple MNNVL allocation records, fp4_quantize in
flashinfer/fp4_quantization.py (swizzled scales reshaped to (-1, K/16)); CuteDslMoEWrapper (v0.6.4+)
without enable_pdl, leaving the rows of tokens with no local expert uninitialised.
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 6, 6), a2a.MoeAlltoAll_0_6_0, cute_dsl.Wrapper_0_6_4)
