"""The thread that receives the reference backends' started calls on host memory.

In split phase a started call's collective runs in gloo's threads; what is left when its bytes
are in (the expert layout of a dispatch, the sum of a combine) is host work too. Done in
``wait()`` it would run on the caller's thread after the caller's own work, overlapping only the
transfer. Here one daemon thread per process (``process_receiver``: one more torch thread team,
whatever the number of layers) runs it as soon as the bytes are in, in the order the calls
started, while the caller computes (an accelerator's expert GEMMs hold no core, nor does a
caller waiting for its device). It issues no collective: every collective is started on the
caller's thread, in program order, the same on every rank. ``wait()`` then only collects the
result, or the error (a peer's failure under the dispatcher's ``Watch``, raised on the caller's
thread). The caller's grad and inference modes go with each job (they are per thread in torch).

On an accelerator the layout is kernels queued behind the collective: ``wait()`` runs it inline.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class Receiver:
    """Runs submitted functions one at a time, in order, on a daemon thread started on first use
    (a daemon: a call that never completes must not keep the process from exiting). The thread
    holds nothing of a call once it has run it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.SimpleQueue[tuple[Callable[[], object], Future]]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        future: Future[T] = Future()
        self._queue.put((_in_callers_modes(fn), future))  # type: ignore[arg-type]
        if self._thread is None:
            self._thread = threading.Thread(target=_serve, args=(self._queue,), name=self._name, daemon=True)
            self._thread.start()
        return future


def _in_callers_modes(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` under the submitting thread's grad and inference modes (engines serve under
    ``torch.inference_mode()``: in-place ops on its tensors outside it are refused)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()

    return run


_PROCESS: "Receiver | None" = None
_PROCESS_LOCK = threading.Lock()


def process_receiver() -> Receiver:
    """This process's receiver, made on first use and shared by every dispatcher: jobs of all of
    them in one start order (the order their collectives were issued in)."""
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = Receiver("moe-dispatch receiver")
        return _PROCESS


def _serve(jobs: "queue.SimpleQueue[tuple[Callable[[], object], Future]]") -> None:
    """The thread: holding only the queue (a job's function, and with it its dispatcher and buffers, is
    let go once it has run)."""
    while True:
        fn, future = jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - raised again by wait() on the caller's thread
                future.set_exception(exc)
        del fn, future  # a finished call's buffers are not the thread's to keep


__all__ = ["Receiver", "process_receiver"]
