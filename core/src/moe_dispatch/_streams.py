"""Handing a call's tensors from the CUDA stream it started on to the stream its ``wait()`` runs on (``Pending``'s
promise). The waiting stream must wait for what the call's start queued on its stream, and ``record_stream`` every
tensor read or handed out there, so the caching allocator does not reuse their memory meanwhile. ``start_mark`` is an
event where the start half ends (waiting for the whole stream would also wait for the other micro-batch's work);
``hand_over`` does both with it. Off CUDA every function here is a no-op::

    start on S: the vendor's calls ── start_mark(S) ──▶ (S goes on: the other micro-batch)
    wait on W:  hand_over: W waits for the mark ── outputs read on W ── recorded on W
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, TypeVar

import torch

from ._errors import InvalidSpecError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class StartMark:
    """Where a call's start half ended: its stream, an event recorded there then, and whether that stream was being
    captured into a CUDA graph (a captured event can only be waited inside the same capture, an eager one outside)."""

    stream: Any  # torch.cuda.Stream
    event: Any  # torch.cuda.Event
    captured: bool = False


def start_mark(t: torch.Tensor) -> StartMark | None:
    """The mark of a start half that has queued all its work on the current stream of ``t``'s device (None off
    CUDA). Take it after the start's last call, not before: a vendor that ran the call whole ends it with a wait
    for its own stream, which the mark must follow."""
    if not t.is_cuda:
        return None
    stream = torch.cuda.current_stream(t.device)
    return StartMark(stream, stream.record_event(), torch.cuda.is_current_stream_capturing())


def hand_over(mark: StartMark | None, tensors: Iterable[torch.Tensor | None] = ()) -> None:
    """On the stream current now, if it is not the mark's: wait for the mark, and record every tensor there.
    Idempotent: a second hand-over of the same mark waits again for an event already passed.

    :raises InvalidSpecError: a call started outside a CUDA-graph capture waited inside one, or the reverse (CUDA
        refuses a captured stream's wait for an eager event with an error that invalidates the capture)."""
    if mark is None:
        return
    current = torch.cuda.current_stream(mark.stream.device)
    if current == mark.stream:
        return
    if torch.cuda.is_current_stream_capturing() != mark.captured:
        started, waited = ("inside", "outside") if mark.captured else ("outside", "inside")
        raise InvalidSpecError(
            f"this call was started {started} a CUDA-graph capture and waited on another stream {waited} it: a "
            "capture can only wait for work captured with it",
            parameter="cuda_graph_capture", value=f"started {started} the capture",
            allowed="start and wait() a call both inside one capture, or both outside any")
    current.wait_event(mark.event)
    for t in tensors:
        if t is not None:
            t.record_stream(current)


def handed_over(finish: Callable[[], T], mark: StartMark | None) -> Callable[[], T]:
    """``finish`` (a split call's receiving half) run on the waiting stream after the mark, and its result recorded
    there. ``finish`` still hands over the vendor tensors it reads and does not return (they are its own)."""
    if mark is None:
        return finish

    def run() -> T:
        hand_over(mark)  # before finish reads anything the start queued (a call the vendor ran whole)
        result = finish()
        hand_over(mark, tensors_of(result))
        return result
    return run


def keep_on_current(tensors: Iterable[torch.Tensor | None]) -> None:
    """Record tensors made earlier (a dispatch's handle) on the current stream, about to read them (a combine on
    another stream than its dispatch), so their memory is not reused first. A no-op on their own stream and off CUDA."""
    current = None
    for t in tensors:
        if t is not None and t.is_cuda:
            if current is None:  # one lookup: a call's tensors share a device
                current = torch.cuda.current_stream(t.device)
            t.record_stream(current)


def tensors_of(result: Any) -> list[torch.Tensor]:
    """The tensors a call hands out: the tensor itself, or a dataclass's tensor fields (a ``DispatchOutput``'s
    rows, scales, routing and group list; the backend's handle is its own to keep)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if dataclasses.is_dataclass(result):
        values = (getattr(result, f.name) for f in dataclasses.fields(result))
        return [v for v in values if isinstance(v, torch.Tensor)]
    return []
