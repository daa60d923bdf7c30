"""What a call did on one rank, as plain data a rank pool can send back: the typed error it raised
(name, attributes, message) and how long it took. For tests of failure behaviour: a peer's
``PeerFailedError`` within a bound, a ``CollectiveTimeoutError`` naming the ranks."""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch

from moe_dispatch import MoEDispatchError

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


def dispatch_with_a_bad_id(dispatcher: Any, x: Any, ids: Any, w: Any, bad: bool) -> Outcome:
    """How this rank's dispatch ends, where ``bad`` ranks send an expert id out of range (they raise
    ``InvalidInputError`` before their first collective, and post it; the others wait for them)."""
    if bad:
        ids = ids.clone()
        ids[0, 0] = dispatcher.spec.num_experts
    return outcome(lambda: dispatcher.dispatch(x, ids, w))


def combine_unless_stalled(dispatcher: Any, x: Any, ids: Any, w: Any, stall_s: float | None) -> Outcome:
    """Dispatch, then combine zero rows; a rank given ``stall_s`` sleeps that long instead of
    combining (a stalled engine) and returns an empty ``Outcome``. How this rank's combine ends."""
    out = dispatcher.dispatch(x, ids, w)
    if stall_s is not None:
        time.sleep(stall_s)
        return Outcome(None, {}, 0.0, "")
    rows = torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16, device=out.hidden_states.device)
    return outcome(lambda: dispatcher.combine(rows, out))


__all__ = ["Outcome", "combine_unless_stalled", "dispatch_with_a_bad_id", "outcome"]
