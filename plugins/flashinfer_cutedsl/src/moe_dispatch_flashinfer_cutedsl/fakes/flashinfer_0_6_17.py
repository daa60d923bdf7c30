"""Fake of FlashInfer 0.6.17.

Models v0.6.16-v0.6.17: EPLB and rank-mask arguments, a five-field workspace-cache key, num_experts
>= ep_size with a ceil/floor expert partition, top-k in {1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22}, the
combine summing in fp32, CuteDslMoEWrapper(use_fused_finalize=) and run(per_token_scale=).
"""

from __future__ import annotations

from . import a2a, cute_dsl
from .release import build

__version__ = "0.6.17"
_RELEASE = build(__name__, (0, 6, 17), a2a.MoeAlltoAll_0_6_16, cute_dsl.Wrapper_0_6_16)
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
