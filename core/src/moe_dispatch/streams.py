"""Handing a call's tensors from the CUDA stream it started on to the stream its ``wait()`` runs on.

An engine may start a call on one stream and wait for it on another (``Pending``'s promise:
``wait()`` orders the stream current at the wait after the exchange). Two things then need doing
on the waiting stream, and ``hand_over`` does both: wait for the start's stream (what the call
queued there, a backend's copies and casts included), and ``record_stream`` the tensors handed
out, so the caching allocator does not reuse their memory on the start's stream while the waiting
one still reads it. Off CUDA (gloo, the fakes) there are no streams and both are no-ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, TypeVar

import torch

T = TypeVar("T")


def start_stream(t: torch.Tensor) -> Any:
    """The stream a call on ``t`` starts on: the current CUDA stream of its device (None off CUDA)."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


def hand_over(start: Any, tensors: Iterable[torch.Tensor | None]) -> None:
    """On the stream current now, if it is not ``start``: wait for ``start``, and record every tensor."""
    if start is None:
        return
    current = torch.cuda.current_stream(start.device)
    if current == start:
        return
    current.wait_stream(start)
    for t in tensors:
        if t is not None:
            t.record_stream(current)


def handed_over(finish: Callable[[], T], start: Any) -> Callable[[], T]:
    """``finish`` (a split call's receiving half), then its result handed to the stream current at the wait."""
    if start is None:
        return finish

    def run() -> T:
        result = finish()
        hand_over(start, tensors_of(result))
        return result
    return run


def tensors_of(result: Any) -> list[torch.Tensor]:
    """The tensors a call hands out: the tensor itself, or a dataclass's tensor fields (a ``DispatchOutput``'s
    rows, scales, routing and group list; the backend's handle is its own to keep)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if dataclasses.is_dataclass(result):
        values = (getattr(result, f.name) for f in dataclasses.fields(result))
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []


__all__ = ["hand_over", "handed_over", "start_stream", "tensors_of"]
