"""Fake of FlashInfer 0.6.7.

Models v0.6.7: as 0.6.6, with fp4_quantize moved to flashinfer/quantization/fp4_quantization.py and
CuteDslMoEWrapper(enable_pdl=) zeroing its output densely.
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 6, 7), a2a.MoeAlltoAll_0_6_0, cute_dsl.Wrapper_0_6_7)
