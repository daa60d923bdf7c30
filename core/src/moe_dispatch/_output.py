"""``DispatchOutput``: what dispatch hands to the experts, the same for every backend; and the group-list and row
helpers backends build it with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._wire import DispatchDtype, Layout


@dataclass(frozen=True, slots=True)
class DispatchOutput:
    """Rows per (token, local expert), grouped by local expert, not weighted: the same for every backend. Or, with
    ``DispatchSpec(layout="token_major")``, each received token once (below).

    :param hidden_states: PACKED ``[rows, H]`` or MASKED ``[E_local, capacity·world, H]`` in the wire dtype's tensor
        dtype (bf16, float8_e4m3fn, int8, or uint8 packed NVFP4).
    :param hidden_states_scale: FP8 fp32 ``[..., H/128]``, or with ``fp8_ue8m0_scales`` those as powers of two or int32
        ``[..., ceil(H/512)]`` of four exponent bytes (``pack_ue8m0``: DeepEP's SM100 form), possibly column-major; INT8
        fp32 ``[...]`` per row; NVFP4 e4m3 ``[..., H/16]``, linear; None for BF16.
    :param topk_ids: / :param topk_weights: the routing dispatch was given. The engine may overwrite those tensors once
        dispatch (or a started dispatch's ``wait()``) returns; a backend that reads them at combine keeps its own copy
        in ``handle`` (``kept_routing``).
    :param group_list: int64 ``[E_local]``: per-expert counts (type 1) or each expert's end, ``start_e + count_e`` (type
        0). MASKED: expert e's first counts[e] rows are valid.
    :param global_scale: NVFP4's (dequant = e2m1 · block_scale / global_scale).
    :param handle: what combine needs, backend-private: a call's state lives here, never on the dispatcher, so several
        dispatches may be in flight.
    :param call: / :param combined: set by the ``Dispatcher`` (the call's number, checked against the peers at combine;
        a second combine is refused). Backends leave them.
    :param expert_alignment: PACKED only: expert e's rows are ``[start_e, start_e + count_e)`` with
        ``start_{e+1} = align(start_e + count_e, expert_alignment)``; the gaps are zero (data and scales), the expert
        output keeps the same rows and combine ignores the gaps. 1: dense. (DeepEP V2 with ``do_zero_padding``;
        DeepGEMM's contiguous layout, whose ``grouped_layout`` is the type-0 group list.)

    :param row_topk_ids: / :param row_topk_weights: TOKEN_MAJOR only (None otherwise): each received row's top-k as
        int64 local expert ids (-1: an expert elsewhere, or none) and their fp32 weights (0 at -1, as DeepEP's),
        ``[rows, top_k]``; the group list counts each local expert's (row, id) pairs. The expert output is then one
        bf16 row per received row, its local experts' outputs weighted and summed (``run_experts`` does this);
        combine adds the rows from the ranks.

    **Worst-case rows.** In low-latency mode a backend that declares ``Capabilities.worst_case_rows`` (no host sync, so
    the counts stay on the device) returns its worst-case PACKED row count, the same every call (as CUDA graphs need);
    the rows after the last expert's aligned end are unspecified, NaN included. Kernels driven by the group list never
    read them (``row_experts`` marks them -1), nor does combine. Elsewhere PACKED rows end where the last segment ends.

    **Lifetime.** The tensors may live in buffers the backend reuses for a later dispatch: they are valid until this
    output's combine and read-only (a backend may rely on what it wrote, e.g. zero MASKED padding). Copy them to keep or
    change them. Each output in flight keeps its own buffers until its combine, or until dropped.
    """

    hidden_states: torch.Tensor
    hidden_states_scale: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    group_list: torch.Tensor
    group_list_type: int
    layout: Layout
    dtype: DispatchDtype
    handle: Any
    global_scale: float | None = None
    call: int = 0
    combined: bool = False
    expert_alignment: int = 1
    row_topk_ids: torch.Tensor | None = None
    row_topk_weights: torch.Tensor | None = None

    def expert_counts(self) -> torch.Tensor:
        """Per-expert valid row counts, whichever group_list type is in use."""
        return group_counts(self.group_list, self.group_list_type, self.expert_alignment)


def group_counts(group_list: torch.Tensor, group_list_type: int, expert_alignment: int = 1) -> torch.Tensor:
    """Per-group counts from a group list of either type: type 0 holds each group's end, and a group starts at the
    previous end rounded up to ``expert_alignment``."""
    if group_list_type == 1:
        return group_list
    starts = torch.cat([group_list.new_zeros(1), group_list[:-1]])  # the previous group's end
    if expert_alignment > 1:
        starts = align_up(starts, expert_alignment)
    return group_list - starts


def group_starts(counts: torch.Tensor, expert_alignment: int = 1) -> torch.Tensor:
    """Each group's first row: the exclusive prefix sum of the counts, each rounded up to ``expert_alignment``."""
    aligned = align_up(counts, expert_alignment)
    return torch.cumsum(aligned, 0) - aligned


def align_up(rows: torch.Tensor, multiple: int) -> torch.Tensor:
    """``rows`` rounded up to a multiple of ``multiple`` (a segment's length or start)."""
    return (rows + multiple - 1) // multiple * multiple


def rows_by_expert(local_ids: torch.Tensor, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From received rows' local top-k ids ``[N, k]`` (-1 for experts elsewhere): the flat slot ``n·k + j`` of each
    output row (expert-major, row order within an expert; ``row_slot // k`` is its received row) and the per-expert
    counts."""
    flat = local_ids.reshape(-1)
    slots = (flat >= 0).nonzero().squeeze(1)
    experts = flat[slots].to(torch.int64)
    order = torch.sort(experts, stable=True).indices
    return slots[order], torch.bincount(experts, minlength=num_local_experts)


def group_list_from_counts(counts: torch.Tensor, group_list_type: int, expert_alignment: int = 1) -> torch.Tensor:
    """The group list of either type for ``counts``, segments rounded up to ``expert_alignment``."""
    counts = counts.to(torch.int64)
    if group_list_type == 1:
        return counts
    return group_starts(counts, expert_alignment) + counts if expert_alignment > 1 else torch.cumsum(counts, 0)
