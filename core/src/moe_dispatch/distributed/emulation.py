"""For emulators of vendor libraries: their collectives wait with the dispatcher's ``Watch``.

A plugin's fake of a vendor library moves its bytes between real rank processes through the
core's ``Comm`` on the vendor's process group (gloo). A ``Comm`` of its own would wait with a
``Watch`` of its own: the default 300 s and no failure notices, since the notices live under the
uid the ranks agreed when the dispatcher was created, which a vendor object shared by many
dispatchers never sees. The real libraries have no such wait (their kernels spin on flags and
trap after a compiled-in timeout; HCCL waits under its own), so the waits come from the caller
through a channel that is not part of the vendor's API:

- a fake module exports ``emulated_watch`` (under the attribute its plugin's ``vendor.py``
  names), and builds its communicators as ``WatchedComm``;
- the adapter takes ``emulated_waits(module, attribute, ctx.comm.watch)`` once at creation and
  enters that scope around its vendor calls: an empty scope for the real library.

Inside the scope a ``WatchedComm`` of the same ranks waits with the dispatcher's ``timeout_s``
and hears its peers' failure notices (``moe_dispatch/<uid>/notice/<n>``); outside it (a test driving
a fake by hand) it waits with its own. No vendor signature changes.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from typing import Any, Callable, ContextManager, Iterator

from .comm import Comm
from .watch import Watch

_CALLER_WATCH: ContextVar[Watch | None] = ContextVar("moe_dispatch.distributed.emulation.caller_watch", default=None)


@contextlib.contextmanager
def emulated_watch(watch: Watch | None) -> Iterator[None]:
    """The emulated collectives inside the block wait with ``watch`` (None: their own)."""
    token = _CALLER_WATCH.set(watch)
    try:
        yield
    finally:
        _CALLER_WATCH.reset(token)


def caller_watch() -> Watch | None:
    """The ``Watch`` the innermost ``emulated_watch`` block set on this thread or task, if any."""
    return _CALLER_WATCH.get()


class WatchedComm(Comm):
    """The core's ``Comm`` whose collectives wait with the caller's ``Watch`` (``emulated_watch``)
    when that one is for the same rank of a group of this size, and with its own otherwise."""

    @property  # type: ignore[override]
    def watch(self) -> Watch:
        return self.caller_watch or self._own_watch

    @watch.setter
    def watch(self, value: Watch) -> None:  # Comm.__init__ sets its own
        self._own_watch = value

    def _collective_number(self) -> int | str:
        """Under the caller's Watch, the emulator's collectives are numbered on that Watch, apart from the
        dispatcher's own (a fresh ``WatchedComm`` per exchange starts at 1 on every rank)."""
        caller = self.caller_watch
        if caller is None:
            return super()._collective_number()
        caller.emulated += 1
        return f"emulated-{caller.emulated}"

    @property
    def caller_watch(self) -> Watch | None:
        """The caller's ``Watch`` when it applies to this communicator's ranks, else None."""
        caller = caller_watch()
        if caller is not None and caller.rank == self.rank and caller.world_size == self.world_size:
            return caller
        return None


def emulated_waits(module: Any, attribute: str, watch: Watch) -> Callable[[], ContextManager[Any]]:
    """The scope an adapter makes ``module``'s calls in (a new one per call): a fake's collectives
    then wait with ``watch`` (the dispatcher's); an empty scope for a module without ``attribute``
    (the real library). Decided once, at creation, not per call."""
    scope = getattr(module, attribute, None)
    return contextlib.nullcontext if scope is None else functools.partial(scope, watch)


__all__ = ["WatchedComm", "caller_watch", "emulated_waits", "emulated_watch"]
