"""How long the fake kernels' exchanges wait, and for whom: the dispatcher's ``Watch``, when the caller names one.

The fake all-to-all kernels stand in for NVLink stores into peers' memory with collectives over the allocation's
communicator (``mnnvl.Segment.exchange``): blocking gloo calls that wait the process group's own timeout and never
hear of a peer's failure. FlashInfer itself has no such wait: its kernels spin on completion flags in the workspace
and trap after their own timeout (``moeAlltoAllKernels.cu``); its ``MoeAlltoAll`` takes no deadline.

So the waits come from the caller, through a channel that is not part of the vendor's API:
``emulated_watch(watch)`` (``vendor.EMULATED_WATCH_ATTRIBUTE``; every fake FlashInfer release exports it) sets, for
the current thread or task, the ``moe_dispatch.distributed.watch.Watch`` the fake kernels' exchanges wait with: the
dispatcher's ``timeout_s`` and the failure notices its peers post (``moe_dispatch/<uid>/failed``). The adapter
enters it around its vendor calls when the release has it; outside it (a test driving a fake by hand) the
exchanges run as before. No vendor signature changes.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
import torch.distributed as dist

from moe_dispatch.distributed.comm import Comm
from moe_dispatch.distributed.watch import Watch

_CALLER_WATCH: ContextVar[Watch | None] = ContextVar("moe_dispatch_flashinfer_cutedsl.fakes.caller_watch",
                                                     default=None)


@contextmanager
def emulated_watch(watch: Watch | None) -> Iterator[None]:
    """The fake kernels' exchanges inside the block wait with ``watch`` (None: as before)."""
    token = _CALLER_WATCH.set(watch)
    try:
        yield
    finally:
        _CALLER_WATCH.reset(token)


class WatchedComm(Comm):
    """The core's ``Comm`` whose collectives wait with the caller's ``Watch``."""

    def __init__(self, group: Any, watch: Watch) -> None:
        super().__init__(group)
        self._caller = watch

    @property  # type: ignore[override]
    def watch(self) -> Watch:
        return self._caller if self._caller is not None else self._own_watch

    @watch.setter
    def watch(self, value: Watch) -> None:  # Comm.__init__ sets its own
        self._own_watch = value


def watched_comm(group: Any) -> WatchedComm | None:
    """A ``Comm`` over ``group`` (None: the default group) waiting with the caller's ``Watch``, when the caller set
    one for the same ranks of a group of this size; None otherwise (the exchange runs as before)."""
    watch = _CALLER_WATCH.get()
    if watch is None or not dist.is_initialized():
        return None
    comm = WatchedComm(group, watch)
    if (watch.rank, watch.world_size) != (comm.rank, comm.world_size):
        return None
    return comm


def allgather_object(comm: WatchedComm, obj: Any, operation: str) -> list[Any]:
    """Every rank's ``obj`` in rank order, through ``comm``'s watched collectives (two gathers: sizes, bytes)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = comm.gather_uncounted(torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8), operation)
    lengths = [int(n) for n in sizes.view(torch.int64).reshape(-1)]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = comm.gather_uncounted(padded, operation)
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]
