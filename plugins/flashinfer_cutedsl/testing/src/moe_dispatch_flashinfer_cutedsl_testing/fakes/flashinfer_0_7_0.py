"""Fake of FlashInfer 0.7.0.

Models 0.6.18-0.7.0 (flashinfer-python==0.6.18, 0.7.0): the all-to-all of 0.6.16 (still no init
barrier, still vector widths from the row size alone); CuteDslMoEWrapper with SiTU and quant_mode,
run() refusing activations that are not packed uint8.
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 7, 0), a2a.MoeAlltoAll_0_6_16, cute_dsl.Wrapper_0_6_18)
