"""A DeepEP-Ascend between sgl-project/sgl-kernel-npu @ c4e7608f (2025-10-16, ``quant_mode``
replaced ``use_fp8``) and @ 0ac00159 (2026-03-16, ``fuse_mode`` added): ``fused_deep_moe`` is
fuse mode 1 only and takes no ``fuse_mode`` (a keyword is a TypeError, as in the vendor)."""

from __future__ import annotations

from typing import Tuple

import torch

from . import deep_ep
from .deep_ep import Config, EventOverlap, FuseMode, VendorCall


class Buffer(deep_ep.Buffer):
    def fused_deep_moe(  # type: ignore[override]
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        gmm1_permuted_weight: torch.Tensor,
        gmm1_permuted_weight_scale: torch.Tensor,
        gmm2_weight: torch.Tensor,
        gmm2_weight_scale: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        quant_mode: int = 1,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._fused(x, topk_idx.int(), topk_weights, gmm1_permuted_weight, gmm1_permuted_weight_scale,
                           gmm2_weight, gmm2_weight_scale, num_max_dispatch_tokens_per_rank, num_experts, quant_mode)


__all__ = ["Buffer", "Config", "EventOverlap", "FuseMode", "VendorCall"]
