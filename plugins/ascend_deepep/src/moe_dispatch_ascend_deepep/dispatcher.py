"""The adapter: DeepEP-Ascend's ``Buffer`` calls, converted to the moe-dispatch contract.

Normal mode. DeepEP-Ascend already returns the contract's rows: one per (token, local
expert), grouped by expert, unweighted, and its combine applies the sender's top-k weights.
The adapter passes them through (no copy), turns the count list into the group list, and
drops the padding row the kernel returns when nothing arrived.

Low-latency mode. The 2-D rows come packed expert by expert in a fixed ``[T·R·min(k, E_l), H]``
tensor with int64 counts; the adapter hands over the valid prefix (a view, one host read of
the counts) as PACKED and pads the expert rows back to the fixed size for the vendor combine,
which applies the weights.

The wire dtype belongs to the dispatcher, never the process: where the installed
DeepEP-Ascend takes ``quant_mode``, the adapter passes ``"int8"`` or ``"bf16"`` explicitly (so
a ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` left in the environment by anyone cannot flip it); where
it only reads that variable, the adapter sets it inside ``restored_environ`` (one lock for the
process) around the one call and restores it (sglang #26389/#26408).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.environ import restored_environ
from moe_dispatch.output import group_counts, group_list_from_counts

from .emulator import COUNTS_TYPE_ENV, INT8_ENV


@dataclass(frozen=True)
class AscendHandle:
    owner: object
    vendor_handle: Any
    padded_rows: int  # rows the vendor's combine expects back
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    low_latency: bool


class AscendDeepEPDispatcher:
    def __init__(self, ctx: md.DispatchContext, buffer: Any, has_quant_mode: bool) -> None:
        self.buffer = buffer
        self.spec, self.dtype = ctx.spec, ctx.dtype
        self.local_experts = ctx.local_experts
        self.int8 = ctx.dtype is md.DispatchDtype.INT8
        self.has_quant_mode = has_quant_mode
        self.low_latency = ctx.spec.mode is md.Mode.LOW_LATENCY

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> md.DispatchOutput:
        ids = topk_ids.to(torch.int64)
        weights = topk_weights.float()
        if self.low_latency:
            T, E = self.spec.num_max_dispatch_tokens_per_rank, self.spec.num_experts
            if self.has_quant_mode:
                recv_x, counts, handle, _, _ = self.buffer.low_latency_dispatch(
                    x, ids, T, E, quant_mode="int8" if self.int8 else None)
            else:  # the ops/alltoall strategies read use_fp8 as INT8
                recv_x, counts, handle, _, _ = self.buffer.low_latency_dispatch(x, ids, T, E, use_fp8=self.int8)
            data, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            padded = data.shape[0]
        else:
            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids, self.spec.num_experts)
            call = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=ids, topk_weights=weights)
            if self.has_quant_mode:
                recv_x, _, _, listed, handle, _ = self.buffer.dispatch(
                    x, **call, quant_mode="int8" if self.int8 else "bf16")
            else:
                with restored_environ({INT8_ENV: "1" if self.int8 else "0", COUNTS_TYPE_ENV: "1"}):
                    recv_x, _, _, listed, handle, _ = self.buffer.dispatch(x, **call)
            data, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            padded = data.shape[0]
            # A prefix sum when MOE_EXPERT_TOKEN_NUMS_TYPE=0 is set process-wide (the older build's
            # call above pins it to counts).
            prefix = self.has_quant_mode and os.environ.get(COUNTS_TYPE_ENV, "1") == "0"
            counts = group_counts(torch.tensor(listed, dtype=torch.int64), 0 if prefix else 1)
        rows = int(counts.sum())
        out_handle = AscendHandle(self, handle, padded, ids, weights, self.low_latency)
        return md.DispatchOutput(data[:rows], None if scale is None else scale[:rows], topk_ids, topk_weights,
                                 group_list_from_counts(counts, self.spec.group_list_type), self.spec.group_list_type,
                                 md.Layout.PACKED, self.dtype, out_handle)

    def combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput) -> torch.Tensor:
        h: AscendHandle = dispatch_output.handle
        rows = expert_output.to(torch.bfloat16)
        if rows.shape[0] < h.padded_rows:  # the vendor wants its own row count back
            rows = torch.cat([rows, rows.new_zeros(h.padded_rows - rows.shape[0], rows.shape[1])])
        if h.low_latency:
            combined, _, _ = self.buffer.low_latency_combine(rows, h.topk_ids, h.topk_weights, h.vendor_handle)
        else:
            combined, _, _ = self.buffer.combine(rows, h.vendor_handle)
        return combined
