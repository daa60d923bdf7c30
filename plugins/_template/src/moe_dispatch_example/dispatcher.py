"""Dispatch by all-gather, combine by all-to-all, on the ``Comm`` the core hands over.

Dispatch: every rank sends its T token slots (payload | k int32 ids | k fp32 weights, one
uint8 row each, padded to the capacity) to every rank; each rank keeps the (slot, expert)
pairs of its own experts, grouped by expert. Combine: the rank weights its expert rows, sums
them per slot, and sends each slot's partial back to the rank it came from, which adds the
partials in rank order (a fixed order, so the same inputs give the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb


@dataclass(frozen=True)
class ExampleHandle:
    """Everything combine needs, carried by the DispatchOutput (never kept on the dispatcher)."""

    owner: object  # the dispatcher that made it: the core rejects another dispatcher's output
    row_slot: torch.Tensor  # [rows] gathered slot (rank·T + token) of each dispatched row
    row_weight: torch.Tensor  # [rows] fp32 routing weight of each row
    num_tokens: int


class ExampleDispatcher:
    def __init__(self, ctx: mdb.DispatchContext) -> None:
        self.comm, self.codec, self.spec = ctx.comm, ctx.codec, ctx.spec
        self.rank, self.world, self.local_experts = ctx.rank, ctx.world_size, ctx.local_experts
        self.dtype = ctx.dtype
        self.payload = ctx.codec.wire.bytes_per_token
        # Tell the core's byte counter which columns are activations and which are routing.
        self.sections = (("payload", self.payload), ("metadata", 8 * ctx.spec.top_k))

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> md.DispatchOutput:
        spec, k, p = self.spec, self.spec.top_k, self.payload
        T, C = x.shape[0], spec.num_max_dispatch_tokens_per_rank
        send = torch.zeros(C, p + 8 * k, dtype=torch.uint8, device=x.device)
        ids = torch.full((C, k), -1, dtype=torch.int32, device=x.device)  # empty slots route nowhere
        ids[:T] = topk_ids.to(torch.int32)
        send[:T, :p] = self.codec.encode(x)
        send[:, p : p + 4 * k] = ids.view(torch.uint8)
        send[:T, p + 4 * k :] = topk_weights.contiguous().view(torch.uint8)
        got = self.comm.all_gather(send, self.sections)  # [R·C, row], rank by rank

        q = self.codec.from_bytes(got[:, :p])
        gids = got[:, p : p + 4 * k].contiguous().view(torch.int32).to(torch.int64)
        gweights = got[:, p + 4 * k :].contiguous().view(torch.float32)
        local = gids - self.rank * self.local_experts
        slot, j = ((local >= 0) & (local < self.local_experts)).nonzero(as_tuple=True)
        expert = local[slot, j]
        order = torch.sort(expert, stable=True).indices  # group by expert, slot order within
        slot, j, expert = slot[order], j[order], expert[order]
        counts = torch.bincount(expert, minlength=self.local_experts)
        group_list = counts if spec.group_list_type == 1 else torch.cumsum(counts, 0)
        handle = ExampleHandle(self, slot, gweights[slot, j], T)
        return md.DispatchOutput(
            hidden_states=q.data.index_select(0, slot),
            hidden_states_scale=None if q.scale is None else q.scale.index_select(0, slot),
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            group_list=group_list,
            group_list_type=spec.group_list_type,
            layout=md.Layout.PACKED,
            dtype=self.dtype,
            handle=handle,
            global_scale=spec.quant.input_global_scale,
        )

    def combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput) -> torch.Tensor:
        h: ExampleHandle = dispatch_output.handle
        H, C = self.spec.hidden_size, self.spec.num_max_dispatch_tokens_per_rank
        weighted = expert_output.float() * h.row_weight.unsqueeze(1)
        partial = torch.zeros(self.world * C, H, dtype=torch.float32, device=expert_output.device)
        # CPU index_add_ adds rows in index order; on CUDA it is ordered only under
        # torch.use_deterministic_algorithms(True), which engines that need repeatable bits set.
        partial.index_add_(0, h.row_slot, weighted)
        rows = partial.to(torch.bfloat16).view(torch.uint8)
        back = self.comm.all_to_all(rows, None, None, (("combine", 2 * H),))  # slot block r goes to rank r
        parts = back.view(torch.bfloat16).float().view(self.world, C, H)
        return parts.sum(dim=0)[: h.num_tokens].to(torch.bfloat16)
