"""The thread that receives the reference backends' started calls on host memory.

In split phase a started call's collective runs in gloo's threads; what is left when its bytes
are in (the expert layout of a dispatch, the sum of a combine) is host work too. Done in
``wait()`` it would run on the caller's thread after the caller's own work, overlapping only the
transfer. Here one daemon thread per dispatcher runs it as soon as the bytes are in, in the
order the calls started, while the caller computes (an accelerator's expert GEMMs hold no core,
nor does a caller waiting for its device). ``wait()`` then only collects the result, or the
error (a peer's failure under the dispatcher's ``Watch``, raised on the caller's thread).

On an accelerator the layout is kernels queued behind the collective: ``wait()`` runs it inline.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


class Receiver:
    """Runs submitted functions one at a time, in order, on a daemon thread started on first use
    (a daemon: a call that never completes must not keep the process from exiting)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.SimpleQueue[tuple[Callable[[], object], Future]]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        future: Future[T] = Future()
        self._queue.put((fn, future))  # type: ignore[arg-type]
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            fn, future = self._queue.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - raised again by wait() on the caller's thread
                    future.set_exception(exc)


__all__ = ["Receiver"]
