"""The ``Dispatcher`` of a group with peers (``create_dispatcher`` makes it; at world size 1 this is never loaded):
each call is the only one on its process group in this process at a time (``GroupGuard``). Another thread's call
meanwhile is refused before any collective, and this dispatcher is done (its peers, told, stop waiting for it)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from ._dispatcher import Dispatcher


class SharedGroupDispatcher(Dispatcher):
    __doc__ = Dispatcher.__doc__


def _alone(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def alone(self: Dispatcher, *args: Any, **kwargs: Any) -> Any:
        guard = self._comm.guard
        assert guard is not None
        if not guard.enter():
            error = guard.busy(call.__name__)
            if self._broken is None:
                self._broken = str(error)
                self._comm.announce_failure(call.__name__, error)
            raise error
        try:
            return call(self, *args, **kwargs)
        finally:
            guard.leave()
    return alone


for _call in ("dispatch", "combine", "dispatch_start", "combine_start", "forward"):
    setattr(SharedGroupDispatcher, _call, _alone(getattr(Dispatcher, _call)))
