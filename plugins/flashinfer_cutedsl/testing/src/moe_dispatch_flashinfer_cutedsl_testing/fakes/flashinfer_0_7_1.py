"""Fake of FlashInfer 0.7.1.

Models 0.7.1 (flashinfer-python==0.7.1): backend= ("trtllm" | "cake") on MoeAlltoAll and the size
function, a six-field key, a barrier after initializing a workspace, vector widths that respect
every plane's alignment, fp4_quantize(nvfp4_4over6=). No deprecation warning (from 0.7.2).
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 7, 1), a2a.MoeAlltoAll_0_7_1, cute_dsl.Wrapper_0_6_18)
