"""Fake of FlashInfer 0.6.15.

Models v0.6.15: _MnnvlAllocationRecord and the "MNNVL handles are unmapped" check;
CuteDslMoEWrapper(activation_type=, swiglu_*=).
"""

from . import a2a, cute_dsl, release

release.export(globals(), (0, 6, 15), a2a.MoeAlltoAll_0_6_14, cute_dsl.Wrapper_0_6_15)
