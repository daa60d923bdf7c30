"""What a call did on one rank, as plain data a rank pool can send back: the typed error it raised
(name, attributes, message) and how long it took. For tests of failure behaviour: a peer's
``PeerFailedError`` within a bound, a ``CollectiveTimeoutError`` naming the ranks."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

from ..errors import MoEDispatchError

_ATTRIBUTES = ("parameter", "value", "rank", "ranks", "operation")


class Outcome(NamedTuple):
    """``error``: the ``MoEDispatchError`` subclass's name (None: the call returned); ``attrs``: its
    ``parameter``, ``value``, ``rank``, ``ranks``, ``operation`` where it has them."""

    error: str | None
    attrs: dict[str, Any]
    seconds: float
    message: str


def outcome(call: Callable[[], Any]) -> Outcome:
    """Run ``call`` on this rank and say how it ended (any other exception propagates)."""
    start = time.monotonic()
    try:
        call()
    except MoEDispatchError as exc:
        attrs = {k: getattr(exc, k) for k in _ATTRIBUTES if hasattr(exc, k)}
        return Outcome(type(exc).__name__, attrs, time.monotonic() - start, str(exc))
    return Outcome(None, {}, time.monotonic() - start, "")


__all__ = ["Outcome", "outcome"]
