"""The reference backends' buffers, kept per dispatcher in *slots* and reused, never allocated per call: a slot is a
dispatch's own until its combine returns or its output's handle is collected (or, for a started call, until its
collectives are done); a dispatch with every slot held makes one more (docs/design.md)."""

from __future__ import annotations

import math
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
    #: Per buffer: what its last call wrote (its rows, or compact.py's counts per expert), in which layout.
    written: dict[str, tuple[object, tuple]] = field(default_factory=dict)

    @property
    def free(self) -> bool:
        return self.holder == 0

    def hold(self) -> int:
        self.holds += 1
        self.holder = self.holds
        return self.holder

    def release(self, hold: int) -> None:
        """Hold ``hold`` ended (its combine returned, or its output was collected): free unless a later hold has it."""
        if self.holder == hold:
            self.holder = 0

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape``/``dtype`` view of the slot's buffer ``name`` (contents undefined)."""
        nbytes = math.prod(shape) * dtype.itemsize
        raw = self.buffers.get(name)
        if raw is None or raw.numel() < nbytes or raw.device != device:
            raw = self.buffers[name] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return raw[:nbytes].view(dtype).view(shape)

    def scattered(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  rows: torch.Tensor) -> torch.Tensor:
        """A ``shape`` buffer, zero but where this call writes next (``rows`` of dim 0): only the rows the previous
        call wrote are zeroed again (MASKED padding reads zero, never an earlier call's data). The rows are kept in the
        slot's own copy, updated in place while their count stays: a CUDA graph replays the address it captured."""
        buf, last = self.rewritten(name, shape, dtype, device, (shape, dtype))
        if last is not None:
            buf.index_fill_(0, last, 0)
            if last.shape == rows.shape:
                last.copy_(rows)
                return buf
        self.written[name] = (rows.clone(), (shape, dtype))
        return buf

    def rewritten(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  layout: tuple) -> tuple[torch.Tensor, object | None]:
        """The ``shape`` buffer ``name``, and what the last call through it recorded in ``written`` if it wrote this
        memory in ``layout``; else None, with every byte zeroed (new memory, or laid out otherwise last time)."""
        before, previous = self.buffers.get(name), self.written.get(name)
        buf = self.take(name, shape, dtype, device)
        if before is self.buffers[name] and previous is not None and previous[1] == layout:
            return buf, previous[0]
        return buf.zero_(), None


@dataclass(eq=False)
class Lease:
    """One dispatch's hold on a slot: kept in its handle; ends at ``release`` (combine) or when the handle, and with
    it the lease, is collected."""

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
        """Hold ``lease`` at least until ``transfer`` is done, whatever happens to its call's ``Pending`` or output."""
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
