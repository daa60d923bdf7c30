"""Fake of FlashInfer 0.6.7.

Models v0.6.7: as 0.6.6, with fp4_quantize moved to flashinfer/quantization/fp4_quantization.py and
CuteDslMoEWrapper(enable_pdl=) zeroing its output densely.
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.6.7"
_RELEASE = build(__name__, (0, 6, 7), a2a.MoeAlltoAll_0_6_0, cute_dsl.Wrapper_0_6_7)
VERSION = _RELEASE.VERSION
KERNELS = _RELEASE.KERNELS
MoeAlltoAll = _RELEASE.MoeAlltoAll
Mapping = _RELEASE.Mapping
SfLayout = _RELEASE.SfLayout
comm = _RELEASE.comm
get_moe_alltoall_module = _RELEASE.get_moe_alltoall_module
moe_a2a_get_workspace_size_per_rank = _RELEASE.moe_a2a_get_workspace_size_per_rank
fp4_quantize = _RELEASE.fp4_quantize
CuteDslMoEWrapper = _RELEASE.CuteDslMoEWrapper
MnnvlMemory = _RELEASE.MnnvlMemory
TorchDistBackend = _RELEASE.TorchDistBackend

__all__ = ["CuteDslMoEWrapper", "KERNELS", "Mapping", "MoeAlltoAll", "VERSION", "comm", "fp4_quantize",
           "get_moe_alltoall_module", "moe_a2a_get_workspace_size_per_rank"]
