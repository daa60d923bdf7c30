"""Fake of FlashInfer 0.7.2.

Models 0.7.1-0.7.2 (flashinfer-python==0.7.1, 0.7.2.post1): backend= ("trtllm" | "cake") on
MoeAlltoAll and the size function, a six-field key, a barrier after initializing a workspace, vector
widths that respect every plane's alignment, MoeAlltoAll deprecated (0.7.2),
fp4_quantize(nvfp4_4over6=).
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.7.2"
_RELEASE = build(__name__, (0, 7, 2), a2a.MoeAlltoAll_0_7_1, cute_dsl.Wrapper_0_6_18)
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
