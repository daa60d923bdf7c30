"""Expert-aligned PACKED rows (``DispatchSpec.expert_alignment``) for backends that write dense rows: a backend that
declares ``Capabilities.expert_alignment`` for a mode writes the aligned layout itself (DeepEP V2); for any other, the
``Dispatcher`` moves the dense rows into it after dispatch and back before combine::

    backend dispatch ─► dense [rows, H] ─► align_rows: copy into zeros [aligned_capacity, H] ─► engine
    engine's expert rows [aligned_capacity, H] ─► dense_rows: gather the valid rows ─► backend combine

The aligned rows are exactly the segments (one host read of the counts, as normal mode makes anyway): a bound known
without the counts would have the expert kernel compute up to ``(alignment - 1)·E_local`` padding rows. MASKED
layouts (low latency, CUDA graphs) are never copied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ._output import DispatchOutput, align_up, group_list_from_counts, group_starts


@dataclass(frozen=True)
class AlignedHandle:
    """The handle of a core-aligned output: the backend's own output and where its rows went."""

    dense: DispatchOutput
    rows: torch.Tensor  # int64 [dense rows]: each dense row's row in the aligned layout

    @property
    def owner(self) -> Any:  # the combine checks compare the backend handle's owner
        return getattr(self.dense.handle, "owner", None)


def align_rows(out: DispatchOutput, alignment: int) -> DispatchOutput:
    """``out``'s dense PACKED rows (and scales) copied into zeros at aligned expert starts; the group
    list rebuilt for the aligned layout. One host read: the aligned row count."""
    counts = out.expert_counts().to(torch.int64)
    rows, device = out.hidden_states.shape[0], out.hidden_states.device
    expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts, output_size=rows)
    first = torch.cumsum(counts, 0) - counts  # each expert's first dense row
    dest = group_starts(counts, alignment)[expert] + torch.arange(rows, device=device) - first[expert]
    capacity = int(align_up(counts, alignment).sum())
    scale = out.hidden_states_scale
    return replace(out, hidden_states=_scattered(out.hidden_states, dest, capacity),
                   hidden_states_scale=None if scale is None else _scattered(scale, dest, capacity),
                   group_list=group_list_from_counts(counts, out.group_list_type, alignment),
                   handle=AlignedHandle(out, dest), expert_alignment=alignment)


def dense_rows(expert_output: torch.Tensor, out: DispatchOutput) -> tuple[torch.Tensor, DispatchOutput]:
    """The expert rows of a core-aligned output back in the backend's dense order, and its own output."""
    handle: AlignedHandle = out.handle
    return expert_output.index_select(0, handle.rows), handle.dense


def is_core_aligned(out: DispatchOutput) -> bool:
    return type(out.handle) is AlignedHandle


def _scattered(t: torch.Tensor, dest: torch.Tensor, capacity: int) -> torch.Tensor:
    """Zeros of ``capacity`` rows with ``t``'s rows at ``dest`` (one-byte dtypes moved as bytes: the CPU has no
    float8 index_put). Scales in any layout (DeepEP's TMA column-major ones) come out row-major."""
    target = torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
    if t.element_size() == 1:
        target.view(torch.uint8)[dest] = t.contiguous().view(torch.uint8)
    else:
        target[dest] = t
    return target
