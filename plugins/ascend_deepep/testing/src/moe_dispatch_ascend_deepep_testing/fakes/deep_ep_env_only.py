"""A fake of an older DeepEP-Ascend, sgl-project/sgl-kernel-npu @ be6b5e7f (2026-07-13, tag
2026.7.2; the behaviour holds from KN@978c4322 to KN@f451a596 / KN@7c2b9e06): ``dispatch`` has no
``quant_mode`` and chooses INT8 only from ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` in the process
environment at the call; ``low_latency_dispatch`` has no ``quant_mode`` and its C++ takes
``use_fp8`` as INT8 (``quant_mode = use_fp8 ? 2 : 0``, KN@7fe4eeb7 csrc/deepep/deep_ep.cpp), returning
the ``(rows, scales)`` tuple exactly when ``use_fp8``; the A2 internode dispatch takes top-k up to 10 (before
KN@7a396def). Everything else is ``fakes.deep_ep``."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from moe_dispatch_ascend_deepep import vendor as v

from . import deep_ep
from .deep_ep import Config, EventOverlap, FuseMode, VendorCall


class Buffer(deep_ep.Buffer):
    #: dispatch_normal_a2_tiling.cpp MAX_K_VALUE_A2 = 10 until KN@7a396def (not an ancestor of KN@be6b5e7f).
    A2_INTERNODE_MAX_TOP_K = v.A2_INTERNODE_MAX_TOP_K_OLD

    def dispatch(  # type: ignore[override]
        self,
        x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        handle: Optional[Tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
    ) -> Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:  # A2 beyond 8 ranks: the internode path, as in later builds
            return self._internode_dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                            topk_idx, topk_weights, config)
        data, quant = self._quant_from_x(x)
        # KN@be6b5e7f buffer.py Buffer.dispatch hands num_worst_tokens to the C++ (real_max_bs) as later builds do.
        return self._intranode_dispatch(data, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                        topk_idx, topk_weights, config, quant, num_worst_tokens)

    def low_latency_dispatch(  # type: ignore[override]
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        use_mxfp4: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        topk_weights: Optional[torch.Tensor] = None,
    ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Callable]:
        if use_ue8m0 or use_mxfp4:
            deep_ep._ep_assert(False, "MXFP8/MXFP4 are not supported on this device")
        recv_x, scales, counts, vendor_handle = self._ll_dispatch(x, topk_idx.int(), num_max_dispatch_tokens_per_rank,
                                                                  num_experts, "int8" if use_fp8 else None)
        hook: Callable[[], None] = lambda: None  # noqa: E731
        return ((recv_x, scales) if use_fp8 else recv_x), counts, vendor_handle, EventOverlap(), hook

    def fused_deep_moe(  # type: ignore[override]  # KN@be6b5e7f: no profile_enable yet
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, gmm1_permuted_weight: torch.Tensor,
        gmm1_permuted_weight_scale: torch.Tensor, gmm2_weight: torch.Tensor, gmm2_weight_scale: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int, num_experts: int, quant_mode: int = 1,
        fuse_mode: FuseMode = FuseMode.FUSED_DEEP_MOE,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("(fake) fused_deep_moe is faked by moe-dispatch-ascend-fuseep-testing's fakes.deep_ep")


__all__ = ["Buffer", "Config", "EventOverlap", "VendorCall"]
