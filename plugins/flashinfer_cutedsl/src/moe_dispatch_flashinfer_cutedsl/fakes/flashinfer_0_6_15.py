"""Fake of FlashInfer 0.6.15.

Models v0.6.15: _MnnvlAllocationRecord and the "MNNVL handles are unmapped" check;
CuteDslMoEWrapper(activation_type=, swiglu_*=).
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.6.15"
_RELEASE = build(__name__, (0, 6, 15), a2a.MoeAlltoAll_0_6_14, cute_dsl.Wrapper_0_6_15)
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
