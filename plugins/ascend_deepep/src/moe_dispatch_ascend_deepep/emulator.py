"""An emulator of DeepEP-Ascend's ``deep_ep.Buffer`` on torch.distributed (gloo on CPU).

Same method names, arguments, return tuples and layouts as sgl-kernel-npu
``python/deep_ep/deep_ep/buffer.py`` (@f3713b5) and the C++ it calls
(``csrc/deepep/deep_ep.cpp`` @3a9a6118), which differ from CUDA DeepEP:

- normal ``dispatch`` returns one row per (token, local expert), grouped by local expert, then
  source rank, then source token; ``recv_topk_idx`` / ``recv_topk_weights`` are allocated and
  never filled; the per-expert counts are a Python list (a prefix sum when
  ``MOE_EXPERT_TOKEN_NUMS_TYPE=0``); no rows received still gives one (padding) row;
- INT8: ``quant_mode`` (``"int8"`` / ``"bf16"``) wins, else a tuple ``x`` is taken as is, else
  ``DEEP_NORMAL_MODE_USE_INT8_QUANT=1`` in the environment *at the call* selects INT8: per-token
  symmetric, fp32 scale per row that dequantizes (``x ≈ q·scale``), torch_npu
  ``npu_dynamic_quant`` rounding;
- normal ``combine`` multiplies each row by the sender's own top-k weight from the handle (its
  ``topk_weights`` argument is ignored) and sums a token's rows;
- ``low_latency_dispatch`` returns 2-D rows packed expert by expert, ``[T·R·min(k, E_l), H]``,
  with int64 per-expert counts; the default strategy reads only ``quant_mode`` (``use_fp8`` is
  ignored); ``low_latency_combine`` takes the same 2-D layout and applies ``topk_weights``;
- ``get_dispatch_layout`` keeps state for the next ``dispatch`` on the same buffer;
- the size hints are dummies (the HCCL window is ``HCCL_BUFFSIZE``).

It computes real results between real processes and records each call in ``calls``. Not
emulated: events/streams, the small-batch fake tokens (they do not change results), A2's
internode path, MXFP8/MXFP4 (A5).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

import moe_dispatch as md
from moe_dispatch.codecs import INT8Codec, as_bytes, from_bytes
from moe_dispatch.distributed.comm import Comm
from moe_dispatch.wire import WireFormat

INT8_ENV = "DEEP_NORMAL_MODE_USE_INT8_QUANT"
COUNTS_TYPE_ENV = "MOE_EXPERT_TOKEN_NUMS_TYPE"
QUANT_MODES = ("bf16", "int8")


@dataclass(frozen=True)
class VendorCall:
    name: str
    x_dtype: torch.dtype
    int8: bool
    payload_bytes: int


class EventOverlap:
    def current_stream_wait(self) -> None:
        pass


class Config:
    def __init__(self, *args: Any) -> None:
        self.args = args

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes  # a dummy on NPU (csrc/deepep/config.hpp)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = INT8Codec(WireFormat(md.DispatchDtype.INT8, x.shape[-1])).quantize(x)
    assert q.scale is not None
    return q.data, q.scale


class Buffer:
    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 12, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, normal_strategy: str = "default", low_latency_strategy: str = "default"
                 ) -> None:
        self.comm = Comm(group)
        self.rank, self.group_size = self.comm.rank, self.comm.world_size
        self.low_latency_mode = low_latency_mode
        self.calls: list[VendorCall] = []
        self._layout: torch.Tensor | None = None

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return num_max_dispatch_tokens_per_rank  # a dummy on NPU (csrc/deepep/config.cpp)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config()

    # -- normal mode ----------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):  # noqa: ANN201
        R = self.group_size
        local = num_experts // R
        valid = topk_idx >= 0
        in_rank = torch.zeros(topk_idx.shape[0], R, dtype=torch.int32)
        rows = torch.arange(topk_idx.shape[0]).unsqueeze(1).expand_as(topk_idx)
        in_rank[rows[valid], topk_idx[valid].long() // local] = 1
        per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
        self._layout = topk_idx.clone()  # the C++ Buffer keeps it for the next dispatch
        return in_rank.sum(0).to(torch.int32), None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: Any = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Any = None, previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, dispatch_wait_recv_cost_stats: Any = None,
                 quant_mode: str | None = None):  # noqa: ANN201
        return self._dispatch(x, handle, topk_idx, topk_weights, num_tokens_per_expert, quant_mode)

    def _dispatch(self, x: Any, handle: Any, topk_idx: torch.Tensor | None, topk_weights: torch.Tensor | None,
                  num_tokens_per_expert: torch.Tensor | None, quant_mode: str | None):  # noqa: ANN202
        if handle is not None:
            raise NotImplementedError("cached handle dispatch is not supported on NPU")
        assert topk_idx is not None and num_tokens_per_expert is not None
        assert self._layout is not None and torch.equal(self._layout, topk_idx), \
            "get_dispatch_layout must run on this buffer with the same topk_idx first"
        self._layout = None
        assert quant_mode is None or quant_mode in QUANT_MODES, f"quant_mode {quant_mode!r}"
        if isinstance(x, tuple):
            data, scale = x
        elif quant_mode == "int8" or (quant_mode is None and os.environ.get(INT8_ENV) == "1"):
            data, scale = _int8(x)
        else:
            data, scale = x, None
        local = num_tokens_per_expert.numel() // self.group_size
        recv_data, recv_scale, counts, state = self._exchange("dispatch", data, scale, topk_idx, local)
        total = int(counts.sum())
        if total == 0:  # deep_ep.cpp: never an empty output
            recv_data = torch.zeros(1, data.shape[1], dtype=data.dtype)
            recv_scale = torch.zeros(1) if scale is not None else None
        k = topk_idx.shape[1]
        garbage_idx = torch.empty(recv_data.shape[0], k, dtype=torch.int64)  # allocated, never filled
        garbage_w = torch.empty(recv_data.shape[0], k, dtype=torch.float32)
        listed = counts.tolist() if os.environ.get(COUNTS_TYPE_ENV, "1") != "0" else torch.cumsum(counts, 0).tolist()
        weights = torch.ones(topk_idx.shape) if topk_weights is None else topk_weights.float()
        recv_x = (recv_data, recv_scale) if scale is not None else recv_data
        return recv_x, garbage_idx, garbage_w, listed, (state, weights), EventOverlap()

    def _exchange(self, name: str, data: torch.Tensor, scale: torch.Tensor | None, topk_idx: torch.Tensor,
                  local: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, tuple]:
        """Send one row per (token, destination expert); receive them grouped by local expert,
        then source rank, then source token."""
        n, h = data.shape
        R = self.group_size
        tok, j = (topk_idx >= 0).nonzero(as_tuple=True)
        expert = topk_idx[tok, j].long()
        order = torch.argsort(expert // local * (n + 1) + tok, stable=True)  # by destination rank, then token
        tok, j, expert = tok[order], j[order], expert[order]
        dest = expert // local
        columns = [as_bytes(data[tok])] + ([as_bytes(scale[tok].unsqueeze(1))] if scale is not None else [])
        payload = sum(c.shape[1] for c in columns)
        rows = torch.cat(columns + [as_bytes(torch.stack([expert - dest * local, tok], dim=1))], dim=1)
        send = torch.bincount(dest, minlength=R)
        recv = self.comm.exchange_counts(send)
        got = self.comm.all_to_all(rows, send.tolist(), recv.tolist(), (("payload", payload), ("metadata", 16)))
        self.calls.append(VendorCall(name, data.dtype, scale is not None, int(rows.shape[0]) * payload))
        src = torch.repeat_interleave(torch.arange(R), recv)
        meta = from_bytes(got[:, payload:], torch.int64)
        le, src_tok = meta[:, 0], meta[:, 1]
        span = int(src_tok.max()) + 1 if src_tok.numel() else 1
        group = torch.argsort((le * R + src) * span + src_tok, stable=True)
        dw = h * data.element_size()
        recv_data = from_bytes(got[group, :dw], data.dtype)
        recv_scale = from_bytes(got[group, dw:payload], torch.float32).squeeze(1) if scale is not None else None
        return recv_data, recv_scale, torch.bincount(le, minlength=local), (group, recv, send, tok, j, n)

    def _return(self, x: torch.Tensor, state: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each dispatched row back to its sender: fp32 rows and their (token, slot)."""
        group, recv, send, tok, j, n = state
        total = group.numel()
        back = torch.empty(total, x.shape[1], dtype=torch.bfloat16)
        back[group] = x[:total]  # arrival order
        got = self.comm.all_to_all(as_bytes(back), recv.tolist(), send.tolist(), (("combine", 2 * x.shape[1]),))
        return from_bytes(got, torch.bfloat16).float(), tok, j

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights: torch.Tensor | None = None, bias: Any = None,
                config: Any = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, combine_send_cost_stats: Any = None):  # noqa: ANN201
        state, weights = handle  # the sender's own weights; the topk_weights argument is ignored
        assert x.dtype == torch.bfloat16 and x.shape[0] == max(state[0].numel(), 1), "x: the dispatched rows"
        rows, tok, j = self._return(x, state)
        out = torch.zeros(state[5], x.shape[1]).index_add_(0, tok, rows * weights[tok, j].unsqueeze(1))
        return out.to(torch.bfloat16), None, EventOverlap()

    # -- low-latency mode -----------------------------------------------------------------------------

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Any = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, use_mxfp4: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             topk_weights: torch.Tensor | None = None, quant_mode: str | None = None):  # noqa: ANN201
        # The default strategy's C++ ignores use_fp8; only quant_mode selects INT8.
        assert quant_mode is None or quant_mode in QUANT_MODES, f"quant_mode {quant_mode!r}"
        return self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                          quant_mode == "int8")

    def _low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, num_experts: int,
                              int8: bool):  # noqa: ANN202
        assert self.low_latency_mode, "the buffer was not created with low_latency_mode=True"
        assert x.dtype == torch.bfloat16 and x.shape[0] <= T
        R, k = self.group_size, topk_idx.shape[1]
        local = num_experts // R
        data, scale = _int8(x) if int8 else (x, None)
        recv_data, recv_scale, counts, state = self._exchange("low_latency_dispatch", data, scale, topk_idx, local)
        cap = T * R * min(k, local)  # rows packed expert by expert, the rest unused
        packed = torch.zeros(cap, x.shape[1], dtype=data.dtype)
        packed[: recv_data.shape[0]] = recv_data
        recv_x: Any = packed
        if recv_scale is not None:
            scales = torch.zeros(cap)
            scales[: recv_scale.shape[0]] = recv_scale
            recv_x = (packed, scales)
        hook: Callable[[], None] = lambda: None  # noqa: E731
        return recv_x, counts.to(torch.int64), state, EventOverlap(), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None):  # noqa: ANN201
        assert x.dim() == 2 and x.dtype == torch.bfloat16, "x: the 2-D packed rows low_latency_dispatch returned"
        rows, tok, j = self._return(x, handle)
        combined = torch.zeros(handle[5], x.shape[1]).index_add_(0, tok, rows * topk_weights[tok, j].float().unsqueeze(1))
        hook: Callable[[], None] = lambda: None  # noqa: E731
        return combined.to(torch.bfloat16), EventOverlap(), hook


__all__ = ["Buffer", "COUNTS_TYPE_ENV", "Config", "EventOverlap", "INT8_ENV", "VendorCall"]
