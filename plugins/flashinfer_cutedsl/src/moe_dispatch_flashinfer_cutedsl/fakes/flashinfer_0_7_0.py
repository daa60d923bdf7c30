"""Fake of FlashInfer 0.7.0.

Models 0.6.18-0.7.0 (flashinfer-python==0.6.18, 0.7.0): the all-to-all of 0.6.16 (still no init
barrier, still vector widths from the row size alone); CuteDslMoEWrapper with SiTU and quant_mode,
run() refusing activations that are not packed uint8.
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.7.0"
_RELEASE = build(__name__, (0, 7, 0), a2a.MoeAlltoAll_0_6_16, cute_dsl.Wrapper_0_6_18)
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
