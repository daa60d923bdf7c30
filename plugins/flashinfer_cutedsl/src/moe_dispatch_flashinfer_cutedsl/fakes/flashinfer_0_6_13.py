"""Fake of FlashInfer 0.6.13.

Models v0.6.8-v0.6.13: kMaxTopK 22 with top-k in {1, 2, 4, 6, 8, 10, 16, 22}, 4 payloads;
fp4_quantize with backend= (v0.6.8), is_global_scale_inversed (v0.6.11), FLASHINFER_NVFP4_4OVER6
(v0.6.12), the global scale cast in Python (v0.6.13); the routing step's 2048-expert tiers (v0.6.8).
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.6.13"
_RELEASE = build(__name__, (0, 6, 13), a2a.MoeAlltoAll_0_6_0, cute_dsl.Wrapper_0_6_7)
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
