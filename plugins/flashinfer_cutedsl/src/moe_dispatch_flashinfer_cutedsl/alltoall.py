"""The adapter: FlashInfer's MoE all-to-all converted to the contract: ``MoeAlltoAll`` (0.6.0-0.7.2,
``FlashInferA2ADispatcher``) and, from 0.7.4, the same TRT-LLM kernels as ``flashinfer.moe_ep``'s
``NVLinkOneSidedAlltoAll`` (``OneSidedDispatcher``: only the calls differ).

FlashInfer's dispatch delivers each token once per destination rank, into fixed
``[ep_size, T, ...]`` receive views per payload, and its combine only adds a token's copies.
So, as for DeepEP's normal mode, the adapter sends the top-k ids and weights as payloads,
expands the received slots to one row per (token, local expert) grouped by expert (an
``index_select`` of rows·wire bytes, and a host sync to count rows), and at combine weights
each expert row and sums a slot's rows in fp32 before the vendor's add-only combine.

What the kernel is handed as ``token_selected_experts`` is not the caller's ids:

- The dispatch kernel does not skip -1: it sends to ``id / experts_per_rank`` in C division, so
  -1 goes to rank 0 (an extra copy) or, with one expert per rank, to rank -1 (an out-of-bounds
  store). Each -1 is replaced by a valid id of the same token, which the kernel sends nowhere
  new (it sends a token once per target rank); a token with no valid id goes to this rank's first
  expert, where its id payload (which keeps the -1s) gives it no row, so it combines to zero.
- The kernels are built for a few top-k values; the ids are padded to the next one with copies
  of a valid id, which again add no copy. The id and weight payloads keep the caller's top-k.

Payload order. FlashInfer packs the receive planes back to back (R·T·row bytes each) and, until
0.7.0, stores each row with the widest vector (16/8/4/2/1 bytes) that divides the row size,
without looking at the plane's address: a plane that starts off that width is a misaligned-address
fault. The payloads go in order of that width, widest first (then element size): every plane
starts at a multiple of the widths of all planes before it, so it is aligned for every R·T·k.
E.g. H = 7168: bf16 top-8 ``[weights, ids, data]`` (all 16-byte rows), bf16 top-3 ``[data,
weights, ids]`` (12-byte id/weight rows store 4 bytes at a time); fp8 top-8 ``[weights, ids,
scale, data]``; nvfp4 top-8 ``[weights, ids, data, scale]``. A source payload not aligned to its
width (a view into a larger tensor) is copied first.

One ``MoeAlltoAll`` allows one outstanding dispatch (its workspace holds the send state until
combine), so the dispatcher owns ``in_flight`` instances on distinct workspaces (see backend.py)
and each dispatch takes a free one; the handle says which, and a successful combine gives it
back. FlashInfer resets an instance's state only when its combine returns: after a combine that
raised, the instance stays out of the pool (a retry of that combine with the same handle may
complete it), and one whose dispatch succeeded but whose output could not be built is kept out
for good; a dispatch that finds no free workspace says which ones failed.

``NVLinkOneSidedAlltoAll`` (0.7.4) takes the activation, its scales, the ids and the weights as
named arguments, sends ids only where ``0 <= id < num_experts`` (so -1 needs no replacement and the
kernel's top-k is padded with -1 and weight 0), places each payload plane on a cache line itself
and needs only 16-byte aligned sources, and returns [R·T, ...] views of its workspace.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import group_list_from_counts, rows_by_expert, sum_weighted_rows

from . import vendor


@dataclass(frozen=True)
class A2AHandle:
    owner: object
    instance: int
    round: int  # the instance's dispatch count when this was dispatched: a handle combines once
    row_slot: torch.Tensor  # [rows] received slot (src_rank·T + i) of each expert row
    row_weight: torch.Tensor  # [rows] fp32 routing weight of each expert row


def payload_order(per_token: dict[str, tuple[int, int]]) -> list[str]:
    """Payload names (``{name: (bytes per token, element size)}``) widest store first: each
    receive plane then starts aligned to its own vector width whatever R·T is."""
    return sorted(per_token, key=lambda n: (-vendor.dispatch_vector_width(per_token[n][0]), -per_token[n][1]))


def _aligned_source(t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``t`` contiguous at an address its rows can be loaded from with ``width`` bytes at a time
    (default: their vector width)."""
    t = t.contiguous()
    width = width or vendor.dispatch_vector_width(t.shape[1] * t.element_size())
    return t if t.data_ptr() % width == 0 else t.clone()


def kernel_ids(ids: torch.Tensor, fallback: int, kernel_top_k: int) -> torch.Tensor:
    """int32 ``[T, kernel_top_k]``: every -1 replaced by a valid id of its token (``fallback``
    for a token with none), padded with the same id to the kernel's top-k."""
    valid = ids >= 0
    first = valid.to(torch.int8).argmax(dim=1, keepdim=True)
    fill = torch.where(valid.any(dim=1, keepdim=True), ids.gather(1, first), torch.full_like(first, fallback))
    out = torch.where(valid, ids, fill)
    if kernel_top_k > ids.shape[1]:
        out = torch.cat([out, fill.expand(-1, kernel_top_k - ids.shape[1])], dim=1)
    return out.to(torch.int32).contiguous()


class FlashInferA2ADispatcher:
    def __init__(self, ctx: mdb.DispatchContext, instances: list[Any], kernel_top_k: int) -> None:
        self.spec, self.codec, self.dtype = ctx.spec, ctx.codec, ctx.dtype
        self.rank, self.world = ctx.rank, ctx.world_size
        self.local_experts = ctx.local_experts
        self.kernel_top_k = kernel_top_k
        self.instances = instances
        self._free = list(range(len(instances)))
        self._rounds = [0] * len(instances)
        #: Instances FlashInfer still holds dispatched after a failure: index -> what failed.
        self.failed: dict[int, str] = {}
        self._lock = threading.Lock()

    def _acquire(self) -> int:
        with self._lock:
            if not self._free:
                n = len(self.instances)
                failed = "; ".join(f"workspace {i}: {why}" for i, why in sorted(self.failed.items()))
                raise md.CapacityError(
                    f"all {n} FlashInfer all-to-all workspaces have a dispatch awaiting combine"
                    + (f" ({failed}; FlashInfer keeps those dispatched until a combine of theirs succeeds)"
                       if failed else ""),
                    parameter="in_flight", value=n, allowed=f"FlashInferA2ABackend(in_flight=N) with N > {n}",
                )
            instance = self._free.pop(0)
            self._rounds[instance] += 1
            return instance

    def _release(self, instance: int) -> None:
        with self._lock:
            self.failed.pop(instance, None)
            self._free.append(instance)
            self._free.sort()

    def _fail(self, instance: int, what: str, exc: BaseException) -> None:
        with self._lock:
            self.failed[instance] = f"{what} raised {type(exc).__name__}: {exc}"

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> md.DispatchOutput:
        q = self.codec.quantize(x)
        ids32 = topk_ids.to(torch.int32).contiguous()
        first = self.rank * self.local_experts
        named = {"weights": topk_weights.float(), "ids": ids32, "data": q.data}
        if q.scale is not None:
            named["scale"] = q.scale
        instance = self._acquire()
        try:
            recv = self._send(self.instances[instance], named, first)
        except BaseException as exc:
            if self._dispatched(self.instances[instance]):
                self._fail(instance, "dispatch", exc)
            else:
                self._release(instance)  # refused before FlashInfer changed its state
            raise
        try:
            return self._output(instance, recv, topk_ids, topk_weights, first)
        except BaseException as exc:
            self._fail(instance, "building the dispatch output", exc)  # no handle reaches the caller
            raise

    # -- the calls: MoeAlltoAll's (OneSidedDispatcher has NVLinkOneSidedAlltoAll's) --------------------

    def _send(self, instance: Any, named: dict[str, torch.Tensor], first: int) -> dict[str, torch.Tensor]:
        """Dispatch ``named`` payloads; the received ``[R·T, ...]`` rows of each."""
        # The kernels require contiguous payloads (CHECK_INPUT) their vector loads can reach.
        named = {n: _aligned_source(t) for n, t in named.items()}
        names = payload_order({n: (t.shape[1] * t.element_size(), t.element_size()) for n, t in named.items()})
        got = instance.dispatch(kernel_ids(named["ids"], first, self.kernel_top_k), [named[n] for n in names],
                                self.spec.num_max_dispatch_tokens_per_rank, invalid_token_expert_id=-1,
                                expert_id_payload_index=names.index("ids"))
        return {n: g.flatten(0, 1) for n, g in zip(names, got)}

    def _dispatched(self, instance: Any) -> bool:
        return vendor.a2a_phase(instance) != "idle"

    def _return(self, instance: Any, partial: torch.Tensor) -> torch.Tensor:
        return instance.combine(partial.view(self.world, self.spec.num_max_dispatch_tokens_per_rank, -1),
                                self.spec.num_max_dispatch_tokens_per_rank)

    def _output(self, instance: int, recv: dict[str, torch.Tensor], topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, first: int) -> md.DispatchOutput:
        ids = recv["ids"].long()
        local = torch.where((ids >= first) & (ids < first + self.local_experts), ids - first, -1)
        row_flat, counts = rows_by_expert(local, self.local_experts)
        row_slot = torch.div(row_flat, ids.shape[1], rounding_mode="floor")
        scale = recv["scale"].index_select(0, row_slot) if recv.get("scale") is not None else None
        handle = A2AHandle(self, instance, self._rounds[instance], row_slot, recv["weights"].reshape(-1)[row_flat])
        return md.DispatchOutput(recv["data"].index_select(0, row_slot), scale, topk_ids, topk_weights,
                                 group_list_from_counts(counts, self.spec.group_list_type), self.spec.group_list_type,
                                 md.Layout.PACKED, self.dtype, handle, self.spec.quant.input_global_scale)

    def combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput) -> torch.Tensor:
        h: A2AHandle = dispatch_output.handle
        with self._lock:
            awaiting = h.instance not in self._free and h.round == self._rounds[h.instance]
        if not awaiting:
            raise md.InvalidInputError("this dispatch output was combined already", parameter="dispatch_output",
                                       value=f"workspace {h.instance}",
                                       allowed="the output of a dispatch not yet combined")
        T = self.spec.num_max_dispatch_tokens_per_rank
        partial = sum_weighted_rows(expert_output, h.row_slot, h.row_weight, self.world * T)
        try:
            out = self._return(self.instances[h.instance], partial.to(torch.bfloat16))
        except BaseException as exc:
            self._fail(h.instance, "combine", exc)  # FlashInfer still holds it dispatched
            raise
        self._release(h.instance)
        return out


class OneSidedDispatcher(FlashInferA2ADispatcher):
    """``flashinfer.moe_ep``'s ``NVLinkOneSidedAlltoAll`` (FlashInfer 0.7.4+)."""

    def _send(self, instance: Any, named: dict[str, torch.Tensor], first: int) -> dict[str, torch.Tensor]:
        k, pad = self.spec.top_k, self.kernel_top_k - self.spec.top_k
        aligned = {n: _aligned_source(t, vendor.EP_PAYLOAD_ALIGNMENT) for n, t in named.items()}
        got = instance.dispatch(
            aligned["data"], _aligned_source(torch.nn.functional.pad(named["ids"], (0, pad), value=-1)),
            _aligned_source(torch.nn.functional.pad(named["weights"], (0, pad))),
            hidden_states_scale=aligned.get("scale"),
            runtime_max_tokens_per_rank=self.spec.num_max_dispatch_tokens_per_rank)
        return {"data": got.hidden_states, "scale": got.hidden_states_scale, "ids": got.topk_ids[:, :k],
                "weights": got.topk_weights[:, :k]}

    def _dispatched(self, instance: Any) -> bool:
        return vendor.ep_round_open(instance)

    def _return(self, instance: Any, partial: torch.Tensor) -> torch.Tensor:
        return instance.combine(partial)
