"""An older DeepEP-Ascend (before ``quant_mode``, sgl-kernel-npu @85d6aca): ``dispatch`` chooses
INT8 only from ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` in the process environment at the call, and
``low_latency_dispatch`` (the ``ops``/``alltoall`` strategies) reads ``use_fp8`` as INT8."""

from __future__ import annotations

from typing import Any

import torch

from . import emulator
from .emulator import COUNTS_TYPE_ENV, INT8_ENV, Config, EventOverlap, VendorCall


class Buffer(emulator.Buffer):
    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: Any = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Any = None, previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, dispatch_wait_recv_cost_stats: Any = None):  # noqa: ANN201
        return self._dispatch(x, handle, topk_idx, topk_weights, num_tokens_per_expert, None)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):  # noqa: ANN201
        return self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8)


__all__ = ["Buffer", "COUNTS_TYPE_ENV", "Config", "EventOverlap", "INT8_ENV", "VendorCall"]
