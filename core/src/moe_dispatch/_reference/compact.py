"""Low-latency mode's expansion on host memory (gloo on CPU), where reading a count blocks nothing: only the (slot,
local expert) entries that exist are written at dispatch and read at combine, each expert's rows by one copy into
place, and only the rows the slot's last call wrote beyond this call's are zeroed again. On an accelerator every entry
of every gathered slot is handled, so that shapes stay static and nothing is read on the host (exchange.py); the rows,
their order and so the bits are the same. The kit leaves this module out of its host-read check, as it leaves out
gloo's call check: it never runs where a read would stall a stream."""

from __future__ import annotations

import torch

from .._codecs import Quantized
from .._output import rows_by_expert
from .slots import Slot
from .sums import TokenTerms, chunk_bytes, token_major


def masked_rows(q: Quantized, local: torch.Tensor, experts: int, weights: torch.Tensor, hidden: int,
                slot: Slot) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, TokenTerms]:
    """From the gathered slots' rows ``q`` and local expert ids ``[S, k]`` (outside ``0..experts-1``: elsewhere):
    the MASKED rows and scales ``[experts, S, ...]`` (each expert's rows in slot order, zero past its count), the
    per-expert counts, and combine's terms (each slot's entries in ascending expert order)."""
    slots, k = local.shape
    own = torch.where(local < experts, local, -1)  # negative: elsewhere too
    flat, counts = rows_by_expert(own, experts)
    source = torch.div(flat, k, rounding_mode="floor")  # the gathered slot of each row, expert-major
    per_expert = counts.tolist()
    rows = _prefixes(q.data, source, per_expert, slots, slot, "rows")
    scale = None if q.scale is None else _prefixes(q.scale, source, per_expert, slots, slot, "row_scales")
    expert = own.reshape(-1)[flat]
    row = expert * slots + torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[expert]
    terms = token_major(source, slots, hidden, chunk_bytes(local.device),
                        weights.reshape(-1)[flat].to(torch.float32), rows=row)
    return rows, scale, counts, terms


def _prefixes(src: torch.Tensor, source: torch.Tensor, counts: list[int], slots: int, slot: Slot,
              name: str) -> torch.Tensor:
    """``src[source]`` laid out as ``[experts, slots, ...]`` in the slot's buffer ``name`` (the static path's, whose
    last row is its trash row): expert e's rows first, zero after."""
    raw = src.view(torch.uint8) if src.element_size() == 1 else src  # float8 has no index_select(out=)
    tail, experts = raw.shape[1:], len(counts)
    shape = (experts * slots + 1, *tail)
    layout = ("prefixes", shape, raw.dtype)
    flat, last = slot.rewritten(name, shape, raw.dtype, raw.device, layout)
    buf = flat[:-1].view(experts, slots, *tail)
    start = 0
    for e, (n, was) in enumerate(zip(counts, last or [0] * experts)):
        if n:
            torch.index_select(raw, 0, source[start : start + n], out=buf[e, :n])
        if was > n:
            buf[e, n:was].zero_()
        start += n
    slot.written[name] = (counts, layout)
    return buf.view(src.dtype)
