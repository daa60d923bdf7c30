"""``Pending``: a dispatch or combine that has started and not yet been received (split phase)."""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """A started call (``Dispatcher.dispatch_start``/``combine_start``): an engine that overlaps two micro-batches
    (sglang's two-batch overlap, vLLM's ``prepare_async``/``finalize_async``) computes the other one meanwhile, then
    ``wait()`` receives the result, once: later waits return the same object, or raise the same error. On an
    accelerator ``wait()`` orders the stream current at the wait after the exchange, whichever stream the call
    started on, and does not block the host; on gloo it blocks until the bytes are in.

    :param finish: receives and returns the result; run by the first ``wait()``.
    :param overlapped: False when the call already ran to the end at start: the mode has no split phase and the
        core ran it synchronously (``Capabilities.split_phase``), or the backend ran this one call whole (DeepEP 2.x
        under ``EP_AVOID_RECORD_STREAM``; a DeepEP call under CUDA-graph capture). Its ``wait()`` still hands the
        result to the waiting stream.
    """

    __slots__ = ("_finish", "_result", "_error", "_start", "overlapped")

    def __init__(self, finish: Callable[[], T], *, overlapped: bool = True) -> None:
        self._finish: Callable[[], T] | None = finish
        self._result: T | None = None
        self._error: BaseException | None = None
        self._start: Any = None
        self.overlapped = overlapped

    @classmethod
    def completed(cls, result: T, start: Any = None) -> "Pending[T]":
        """A call that ran to the end at start. ``start``: where it ended on its CUDA stream (``start_mark``), which
        a ``wait()`` on another stream waits for."""
        pending: Pending[T] = cls(lambda: result, overlapped=False)
        pending._finish, pending._result, pending._start = None, result, start
        return pending

    @property
    def done(self) -> bool:
        """Whether the result (or its error) is in: ``wait()`` has run, or the call was ``completed`` at start."""
        return self._finish is None

    def wait(self) -> T:
        """The result: the dispatch output, or combine's bf16 ``[T, H]``."""
        if self._start is not None:  # a completed call, waited on another stream than its own
            from ._streams import hand_over, tensors_of  # only a CUDA call has a start mark
            start, self._start = self._start, None
            hand_over(start, tensors_of(self._result))
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                self._result = finish()
            except BaseException as exc:
                self._error = exc
                raise
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<Pending {'received' if self.done else 'in flight'}{'' if self.overlapped else ', ran at start'}>"
