"""The reference backends' buffers: kept per dispatcher and reused, never allocated per call.

A dispatch writes its send rows, received rows, expanded expert rows and combine accumulators
into one *slot*: a set of named byte buffers that belongs to that dispatch until its combine
(or until its output is dropped without one). The next dispatch takes a free slot, so an
engine that alternates dispatch and combine, or keeps two micro-batches in flight, runs on
two slots in the steady state and allocates nothing large per call: a bare all-to-all into a
fresh 52 MB buffer took 179 ms on this machine's CPU, into a reused one 74 ms (issue 16).

- A buffer grows to the largest size a call has needed (normal mode's sizes follow the
  routing) and never shrinks; low-latency mode's sizes are fixed by the spec, so its
  ``in_flight`` slots are sized at creation (``ReferenceDispatcher._reserve``).
- A slot is free again when its dispatch's combine has returned, or when its output's handle
  is garbage-collected (an engine that drops an output, or a combine that raised). A dispatch with every slot taken
  makes one more slot: more dispatches in flight cost memory, never wrong data.
- What dispatch returns lives in its slot: valid until its combine (the contract's lifetime
  rule, ``DispatchOutput``); the core refuses a second combine of one output.
- A started call (split phase) has collectives writing into its slot: the pool keeps its lease
  until they are done, so an engine that drops a ``Pending`` without waiting costs a slot
  for a while, never a buffer shared with a transfer still in flight.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch


class _InFlight(Protocol):
    @property
    def done(self) -> bool: ...


@dataclass(eq=False)
class Slot:
    """Named byte buffers for one dispatch and its combine."""

    number: int
    #: Which hold of the slot is current (one per dispatch that took it); 0 when free.
    holder: int = 0
    holds: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Per buffer of ``scattered``: the rows the last call wrote, and the layout it had.
    written: dict[str, tuple[torch.Tensor, tuple]] = field(default_factory=dict)

    @property
    def free(self) -> bool:
        return self.holder == 0

    def hold(self) -> int:
        self.holds += 1
        self.holder = self.holds
        return self.holder

    def release(self, hold: int) -> None:
        """Hold ``hold`` has ended (its combine finished, or its output was collected); a later
        hold's end is not this one's."""
        if self.holder == hold:
            self.holder = 0

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape``/``dtype`` view of the slot's buffer ``name`` (contents undefined)."""
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        raw = self.buffers.get(name)
        if raw is None or raw.numel() < nbytes or raw.device != device:
            raw = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self.buffers[name] = raw
        return raw[:nbytes].view(dtype).view(shape)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.take(name, shape, dtype, device).zero_()

    def scattered(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  rows: torch.Tensor) -> torch.Tensor:
        """A ``shape`` buffer that is zero except where this call will write (``rows`` of dim 0):
        only the rows the previous call through ``name`` wrote are zeroed again, not the whole
        buffer (MASKED layout: most rows are padding, which must read as zero, never as an earlier
        call's data). The caller writes ``rows`` next."""
        raw = self.buffers.get(name)
        previous = self.written.get(name)
        buf = self.take(name, shape, dtype, device)
        if raw is not self.buffers[name] or previous is None or previous[1] != (shape, dtype):
            buf.zero_()  # new memory, or laid out otherwise last time: every row
        else:
            buf.index_fill_(0, previous[0], 0)
        self.written[name] = (rows, (shape, dtype))
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


@dataclass(eq=False)
class Lease:
    """One dispatch's hold on a slot: kept in its handle; ends at ``release`` (combine) or when
    the handle, and with it the lease, is collected."""

    slot: Slot
    hold: int

    def release(self) -> None:
        self.slot.release(self.hold)

    @property
    def current(self) -> bool:
        """Whether the slot is still this dispatch's."""
        return self.slot.holder == self.hold


class SlotPool:
    """The slots of one dispatcher."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        #: Leases kept alive while a collective may still read or write their slot.
        self._in_flight: list[tuple[Lease, _InFlight]] = []
        #: Started calls take slots on the receiver thread while blocking calls take them on the caller's.
        self._lock = threading.Lock()

    def keep_until_done(self, lease: Lease, transfer: _InFlight) -> None:
        """Hold ``lease`` at least until ``transfer`` is done, whatever happens to its call's
        ``Pending`` or output (``Comm.all_to_all_start``'s ``Transfer``)."""
        with self._lock:
            self._in_flight.append((lease, transfer))

    def acquire(self) -> Lease:
        """A free slot (a new one when every slot is held), held by the returned lease."""
        with self._lock:
            if self._in_flight:
                self._in_flight = [(lease, t) for lease, t in self._in_flight if not t.done]
            slot = next((s for s in self.slots if s.free), None)
            if slot is None:
                slot = Slot(len(self.slots))
                self.slots.append(slot)
            lease = Lease(slot, slot.hold())
        weakref.finalize(lease, slot.release, lease.hold)
        return lease

    @property
    def nbytes(self) -> int:
        """Bytes held by every slot: what the reuse costs in memory."""
        return sum(s.nbytes for s in self.slots)
