"""How long the fakes' collectives wait, and for whom: the dispatcher's ``Watch``, when the caller names one.

The fakes move their bytes between real rank processes through the core's ``Comm`` on the vendor's process group
(gloo). A ``Comm`` of their own would wait with a ``Watch`` of their own: the default 300 s and no failure notices,
since the notices live under the uid the ranks agreed when the dispatcher was created, which a vendor Buffer
(shared by many dispatchers, made before some of them) never sees. DeepEP-Ascend has no such wait: its ops wait in
HCCL, under the process group's own timeout.

So the waits come from the caller, through a channel that is not part of the vendor's API:
``emulated_watch(watch)`` (``vendor.EMULATED_WATCH_ATTRIBUTE``; every fake DeepEP-Ascend module exports it) sets,
for the current thread or task, the ``moe_dispatch.distributed.watch.Watch`` the fakes' collectives wait with: the
dispatcher's ``timeout_s`` and the failure notices its peers post (``moe_dispatch/<uid>/failed``). The adapter
enters it around its vendor calls when the module has it; outside it (a test driving a fake Buffer by hand) the
fake waits as before. No vendor signature changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from moe_dispatch.distributed.comm import Comm
from moe_dispatch.distributed.watch import Watch

_CALLER_WATCH: ContextVar[Watch | None] = ContextVar("moe_dispatch_ascend_deepep.fakes.caller_watch", default=None)


@contextmanager
def emulated_watch(watch: Watch | None) -> Iterator[None]:
    """The fakes' collectives inside the block wait with ``watch`` (None: their own)."""
    token = _CALLER_WATCH.set(watch)
    try:
        yield
    finally:
        _CALLER_WATCH.reset(token)


class WatchedComm(Comm):
    """The core's ``Comm`` whose collectives wait with the caller's ``Watch`` (``emulated_watch``) when that one is
    for the same ranks of a group of this size, and with its own otherwise."""

    @property  # type: ignore[override]
    def watch(self) -> Watch:
        caller = _CALLER_WATCH.get()
        if caller is not None and caller.rank == self.rank and caller.world_size == self.world_size:
            return caller
        return self._own_watch

    @watch.setter
    def watch(self, value: Watch) -> None:  # Comm.__init__ sets its own
        self._own_watch = value

