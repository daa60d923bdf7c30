"""The adapter: FlashInfer's MoE all-to-all (``MoeAlltoAll``) converted to the contract.

FlashInfer's dispatch delivers each token once per destination rank, into fixed
``[ep_size, T, ...]`` receive views per payload, and its combine only adds a token's copies.
So, as for DeepEP's normal mode, the adapter sends the top-k ids and weights as payloads,
expands the received slots to one row per (token, local expert) grouped by expert (an
``index_select`` of rows·wire bytes, and a host sync to count rows), and at combine weights
each expert row and sums a slot's rows in fp32 before the vendor's add-only combine.

One ``MoeAlltoAll`` allows one outstanding dispatch (its workspace holds the send state until
combine), so the dispatcher owns ``in_flight`` instances (default 2, for two-batch overlap)
and each dispatch takes a free one; the handle says which, and combine gives it back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.output import group_list_from_counts, rows_by_expert, sum_weighted_rows


@dataclass(frozen=True)
class A2AHandle:
    owner: object
    instance: int
    row_slot: torch.Tensor  # [rows] received slot (src_rank·T + i) of each expert row
    row_weight: torch.Tensor  # [rows] fp32 routing weight of each expert row


class FlashInferA2ADispatcher:
    def __init__(self, ctx: md.DispatchContext, instances: list[Any]) -> None:
        self.spec, self.codec, self.dtype = ctx.spec, ctx.codec, ctx.dtype
        self.rank, self.world = ctx.rank, ctx.world_size
        self.local_experts = ctx.local_experts
        self.instances = instances
        self._free = list(range(len(instances)))
        self._lock = threading.Lock()

    def _acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise md.CapacityError(
                    f"all {len(self.instances)} FlashInfer all-to-all workspaces have a dispatch awaiting combine",
                    parameter="options.in_flight", value=len(self.instances), allowed="raise it (more workspaces)",
                )
            return self._free.pop(0)

    def _release(self, instance: int) -> None:
        with self._lock:
            self._free.append(instance)
            self._free.sort()

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> md.DispatchOutput:
        q = self.codec.quantize(x)
        ids32 = topk_ids.to(torch.int32)
        named = {"weights": topk_weights.float(), "ids": ids32, "data": q.data}
        if q.scale is not None:
            named["scale"] = q.scale
        # Largest elements first: FlashInfer packs payloads back to back and checks alignment.
        names = sorted(named, key=lambda n: -named[n].element_size())
        instance = self._acquire()
        try:
            got = self.instances[instance].dispatch(
                ids32, [named[n] for n in names], self.spec.num_max_dispatch_tokens_per_rank,
                invalid_token_expert_id=-1, expert_id_payload_index=names.index("ids"))
        except BaseException:
            self._release(instance)
            raise
        recv = {n: g.flatten(0, 1) for n, g in zip(names, got)}  # [R·T, ...] per payload
        ids = recv["ids"].long()
        first = self.rank * self.local_experts
        local = torch.where((ids >= first) & (ids < first + self.local_experts), ids - first, -1)
        row_flat, counts = rows_by_expert(local, self.local_experts)
        row_slot = torch.div(row_flat, ids.shape[1], rounding_mode="floor")
        scale = recv["scale"].index_select(0, row_slot) if "scale" in recv else None
        handle = A2AHandle(self, instance, row_slot, recv["weights"].reshape(-1)[row_flat])
        return md.DispatchOutput(recv["data"].index_select(0, row_slot), scale, topk_ids, topk_weights,
                                 group_list_from_counts(counts, self.spec.group_list_type), self.spec.group_list_type,
                                 md.Layout.PACKED, self.dtype, handle, self.spec.quant.input_global_scale)

    def combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput) -> torch.Tensor:
        h: A2AHandle = dispatch_output.handle
        T = self.spec.num_max_dispatch_tokens_per_rank
        partial = sum_weighted_rows(expert_output, h.row_slot, h.row_weight, self.world * T)
        try:
            return self.instances[h.instance].combine(partial.to(torch.bfloat16).view(self.world, T, -1), T)
        finally:
            self._release(h.instance)
