"""The adapter: DeepEP-Ascend's ``Buffer`` calls, converted to the moe-dispatch contract.

Normal mode. DeepEP-Ascend already returns the contract's rows: one per (token, local
expert), grouped by expert, unweighted, and its combine applies the sender's top-k weights.
The adapter passes them through (no copy), turns the count list into the group list, and
drops the padding row the kernel returns when nothing arrived. It passes
``num_worst_tokens=T``: DeepEP-Ascend keeps ``real_max_bs = max(largest batch over the ranks,
num_worst_tokens)`` on the Buffer and the NEXT combine (whichever dispatch it belongs to) hands it
to the combine op, which refuses one below its own batch; with T it is the same on every call, so
dispatches in flight (micro-batches) combine in any order, and an all-idle step (every rank 0
tokens) still has a positive global batch.

Low-latency mode. The 2-D rows come packed expert by expert in a fixed ``[T·R·min(k, E_l), H]``
tensor with int64 counts; the adapter hands over the valid prefix (a view, one host read of
the counts) as PACKED and pads the expert rows back to the fixed size for the vendor combine,
which applies the weights.

Routing at combine. Both combines weight by the dispatch's top-k (normal mode: the ``topk_idx``
and ``topk_weights`` the vendor keeps in its handle; low-latency: the ones passed again), so the
vendor gets copies of the caller's ids and weights, never the caller's tensors: an engine may
overwrite its router buffers between dispatch and combine.

What the vendor reads from the process environment at a call is set for that call only, in
``moe_dispatch.backend.restored_environ`` (blocks that set the same values share; blocks that disagree wait),
whatever the process has:

- normal dispatch: ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` = this dispatcher's choice (``quant_mode``
  is passed too where it exists; A2's internode path reads only the variable) and
  ``MOE_EXPERT_TOKEN_NUMS_TYPE=1`` (plain counts);
- low-latency dispatch and combine: ``MOE_EXPERT_TOKEN_NUMS_TYPE=1``, ``MOE_ENABLE_CCU=0`` (on A3 a
  process-wide ``1`` would send the calls to the A5 CCU op) and
  ``MOE_ENABLE_TOPK_NEG_ONE=1`` (the op gets an active mask, so -1 ids are skipped); on A2 layered
  (``HCCL_INTRA_PCIE_ENABLE=1``, ``HCCL_INTRA_ROCE_ENABLE=0``) the C++ asserts on that variable,
  so it is 0 there and -1 ids are refused with a typed error before any data moves.

The low-latency wire dtype goes as ``use_fp8`` on every build (before KN@f451a596 the C++ reads it;
after, ``quant_mode=None`` with ``use_fp8=True`` means INT8) and as ``quant_mode`` where it exists
(``"int8"`` or None; ``"bf16"`` is a ValueError there) (sglang #23815, #26389/#26408).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import group_list_from_counts, kept_routing, restored_environ

from .vendor import CCU_ENV, COUNTS_TYPE_ENV, INT8_ENV, NEG_ONE_ENV, is_layered


@dataclass(frozen=True)
class AscendHandle:
    owner: object
    vendor_handle: Any
    padded_rows: int  # rows the vendor's combine expects back
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    low_latency: bool


def _low_latency_env(layered: bool) -> dict[str, str]:
    return {COUNTS_TYPE_ENV: "1", CCU_ENV: "0", NEG_ONE_ENV: "0" if layered else "1"}


class AscendDeepEPDispatcher:
    def __init__(self, ctx: mdb.DispatchContext, buffer: Any, has_quant_mode: bool, ll_quant_mode: bool) -> None:
        self.buffer = buffer
        self.spec, self.dtype = ctx.spec, ctx.dtype
        self.local_experts = ctx.local_experts
        self.int8 = ctx.dtype is md.DispatchDtype.INT8
        self.has_quant_mode = has_quant_mode
        self.ll_quant_mode = ll_quant_mode
        self.low_latency = ctx.spec.mode is md.Mode.LOW_LATENCY

    def _ll_scope(self, ids: torch.Tensor) -> dict[str, str]:
        layered = is_layered(os.environ)  # the C++ reads it at each call
        if layered and bool((ids < 0).any()):  # one host read, on A2 layered only
            raise md.InvalidInputError(
                "A2 layered (two-node) low-latency kernels take no -1 expert ids: DeepEP-Ascend asserts when "
                f"{NEG_ONE_ENV}=1 with HCCL_INTRA_PCIE_ENABLE=1/HCCL_INTRA_ROCE_ENABLE=0", parameter="topk_ids",
                value=int((ids < 0).sum()), allowed="expert ids in 0..E-1 (or normal mode, or single-node)")
        return _low_latency_env(layered)

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> md.DispatchOutput:
        x = x.contiguous()  # the C++ EP_HOST_ASSERTs contiguous x, topk_idx and topk_weights
        # Combine uses the routing given to this dispatch, and the engine may overwrite its router buffers once
        # dispatch returns: the vendor keeps topk_idx/topk_weights in its normal-mode handle (combine weights by
        # them) and the LL combine takes them again, so both get copies of our own ([T, k]: small).
        ids = kept_routing(topk_ids.to(torch.int64).contiguous(), topk_ids)
        weights = kept_routing(topk_weights.float().contiguous(), topk_weights)
        if self.low_latency:
            T, E = self.spec.num_max_dispatch_tokens_per_rank, self.spec.num_experts
            quant: dict[str, Any] = {"use_fp8": self.int8}
            if self.ll_quant_mode:
                quant["quant_mode"] = "int8" if self.int8 else None
            with restored_environ(self._ll_scope(ids)):
                recv_x, counts, handle, _, _ = self.buffer.low_latency_dispatch(x, ids, T, E, **quant)
            data, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            counts = counts.to(torch.int64)
        else:
            per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids, self.spec.num_experts)
            call = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=ids, topk_weights=weights,
                        num_worst_tokens=self.spec.num_max_dispatch_tokens_per_rank)
            if self.has_quant_mode:
                call["quant_mode"] = "int8" if self.int8 else "bf16"
            with restored_environ({INT8_ENV: "1" if self.int8 else "0", COUNTS_TYPE_ENV: "1"}):
                recv_x, _, _, listed, handle, _ = self.buffer.dispatch(x, **call)
            data, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            if len(listed) != self.local_experts:  # CUDA DeepEP empties it under num_worst_tokens; DeepEP-Ascend not
                raise md.BackendUnavailableError(
                    "DeepEP-Ascend's dispatch returned no per-expert count list", parameter="num_worst_tokens",
                    value=len(listed), allowed=f"a list of {self.local_experts} counts (DeepEP-Ascend, not CUDA DeepEP)")
            counts = torch.tensor(listed, dtype=torch.int64)
        rows = int(counts.sum())
        out_handle = AscendHandle(self, handle, data.shape[0], ids, weights, self.low_latency)
        return md.DispatchOutput(data[:rows], None if scale is None else scale[:rows], topk_ids, topk_weights,
                                 group_list_from_counts(counts, self.spec.group_list_type), self.spec.group_list_type,
                                 md.Layout.PACKED, self.dtype, out_handle)

    def combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput) -> torch.Tensor:
        h: AscendHandle = dispatch_output.handle
        rows = expert_output.to(torch.bfloat16)
        if rows.shape[0] < h.padded_rows:  # the vendor wants its own row count back
            rows = torch.cat([rows, rows.new_zeros(h.padded_rows - rows.shape[0], rows.shape[1])])
        rows = rows.contiguous()
        if h.low_latency:
            with restored_environ(_low_latency_env(is_layered(os.environ))):
                combined, _, _ = self.buffer.low_latency_combine(rows, h.topk_ids, h.topk_weights, h.vendor_handle)
        else:
            combined, _, _ = self.buffer.combine(rows, h.vendor_handle)
        return combined
