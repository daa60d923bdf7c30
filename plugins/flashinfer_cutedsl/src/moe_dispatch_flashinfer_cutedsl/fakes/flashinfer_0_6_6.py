"""Fake of FlashInfer 0.6.6.

Models v0.6.0-v0.6.6: kMaxTopK 8 with top-k in {1, 2, 4, 8}, 8 payloads, num_experts divisible by
ep_size, a four-field workspace-cache key, tuple MNNVL allocation records, fp4_quantize in
flashinfer/fp4_quantization.py (swizzled scales reshaped to (-1, K/16)); CuteDslMoEWrapper (v0.6.4+)
without enable_pdl, leaving the rows of tokens with no local expert uninitialised.
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.6.6"
_RELEASE = build(__name__, (0, 6, 6), a2a.MoeAlltoAll_0_6_0, cute_dsl.Wrapper_0_6_4)
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
