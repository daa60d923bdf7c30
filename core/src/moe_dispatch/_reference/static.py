"""Low-latency mode's expansion on an accelerator: every (slot, k) entry of every gathered slot is placed, with static
shapes and nothing read on the host (so that a CUDA graph can hold it); entries for experts elsewhere all land on one
trash row past the MASKED rows. The rows, their order and so the bits are those of compact.py, which touches only the
entries that exist where reading a count blocks nothing (host memory)."""

from __future__ import annotations

from typing import Callable

import torch

from .._codecs import Quantized
from .slots import Slot
from .sums import TokenTerms, chunk_bytes, even_blocks


def masked_rows(q: Quantized, local: torch.Tensor, experts: int, weights: torch.Tensor, hidden: int, slot: Slot,
                constant: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                                  TokenTerms]:
    """``compact.masked_rows`` with static shapes: from the gathered slots' local experts ``[S, k]`` (outside
    ``0..experts-1``: one elsewhere), the MASKED rows and scales, the per-expert counts and combine's terms (each
    slot's entries in ascending expert order; the trash row's marked as padding). ``constant``: the dispatcher's,
    for what follows from the spec alone."""
    (S, k), El, dev = local.shape, experts, local.device
    key = local.clamp(-1, El).remainder(El + 1).reshape(-1, 1)  # an expert elsewhere, or none: El
    # Expert e's i-th entry (in (slot, k) order) goes to row e·S + i: an inclusive running count per expert plus a
    # per-expert base. Column El never matches (-1), so that an expert elsewhere gets the base El·S: the trash row.
    ids = constant(f"experts {dev}", lambda: torch.cat([torch.arange(El, device=dev), torch.tensor([-1], device=dev)]))
    base = constant(f"bases {dev}", lambda: torch.cat([torch.arange(El, device=dev) * S - 1,
                                                       torch.tensor([El * S], device=dev)]))
    entry_slot = constant(f"entry slot {dev}", lambda: torch.arange(S, device=dev).repeat_interleave(k))
    seen = torch.cumsum(key == ids, 0, out=slot.take("seen", (S * k, El + 1), torch.int64, dev))  # counts: a view
    entry_row = (seen + base).gather(1, key).squeeze(1)
    # MASKED rows ascend with the expert (e·S + i, i < S) and the trash row is last: a slot's rows in ascending order
    # are its entries in expert order.
    rows, order = torch.topk(entry_row.view(S, k), k, dim=1, largest=False)  # one launch, ascending
    rows = rows.reshape(-1)
    terms = TokenTerms(rows.clamp(max=El * S - 1), entry_slot, weights.gather(1, order).reshape(-1), rows == El * S,
                       even_blocks(S, k, hidden, chunk_bytes(dev, False)))
    scale = None if q.scale is None else _scatter_rows(q.scale, entry_slot, entry_row, El, S, slot, "row_scales")
    return _scatter_rows(q.data, entry_slot, entry_row, El, S, slot, "rows"), scale, seen[-1, :El], terms


def _scatter_rows(src: torch.Tensor, src_index: torch.Tensor, dest_row: torch.Tensor, experts: int,
                  rows_per_expert: int, slot: Slot, name: str) -> torch.Tensor:
    """Rows ``src[src_index]`` written at ``dest_row`` of a ``[experts, rows_per_expert, ...]`` slot buffer ``name``
    that is zero elsewhere (``Slot.scattered``); entries of other ranks all land on one extra trash row, cut off."""
    raw = src.view(torch.uint8) if src.element_size() == 1 else src  # float8 has no index_copy_
    tail, trash = raw.shape[1:], experts * rows_per_expert
    buf = slot.scattered(name, (trash + 1, *tail), raw.dtype, raw.device, dest_row)
    buf.index_copy_(0, dest_row, raw.index_select(0, src_index))
    return buf[:trash].view(src.dtype).view(experts, rows_per_expert, *tail)
