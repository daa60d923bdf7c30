"""The thread that runs the reference backends' started calls on host memory.

On gloo a call is host work from end to end: the wire rows gathered, the counts exchanged, the
payload sent (gloo's threads), the expert layout of a dispatch or the sums of a combine. Done on
the caller's thread, a started call would hold the caller for everything but the transfer (a
combine's weighted partial sums must be made before they are sent). Here one daemon thread per
process group (``receiver_for``: one more torch thread team per group, whatever the number of
layers) runs each started call, in the order the calls started, while the caller computes (an
accelerator's expert GEMMs hold no core, nor does a caller waiting for its device):

- a call's *start* (everything up to and including its collectives) is one job, submitted by
  the caller in program order, so every rank issues the same collectives in the same order;
- they go on the started calls' own process group (``receiver_for``: the same ranks, made by the
  first dispatcher of the group), never on the caller's, where the engine's own collectives and
  the blocking calls run meanwhile in an order the thread does not know;
- when the start is done, its *receive* (waiting for the bytes, the layout or the sums) is queued
  as a job of its own, ahead of the starts still queued (``Receiver.submit_receive``): the engine
  waits for its oldest call first, and a receive issues no collective, so its place orders nothing;
- a blocking call stays on the caller's group, so every rank makes a given call in the same form
  (started or blocking), as it makes the same calls: one rank's blocking call #n and another's
  started call #n meet nowhere, and end in the dispatcher's timeout.

``wait()`` then only collects the result, or the error (a peer's failure under the dispatcher's
``Watch``, raised on the caller's thread). The caller's grad and inference modes go with each job
(they are per thread in torch).

On an accelerator a call's work is kernels queued on the caller's stream: it runs there, and
``wait()`` runs the receive inline.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from .._errors import CommunicationError

T = TypeVar("T")


class Receiver:
    """Runs submitted functions one at a time on a daemon thread started on first use (a daemon: a
    call that never completes must not keep the process from exiting): the receives first, each
    kind in the order submitted. The thread holds nothing of a call once it has run it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs = _Jobs()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # two callers' first jobs must not start two threads
        #: The started calls' own process group (``receiver_for``), made by the first dispatcher of the group.
        self.group: "dist.ProcessGroup | None" = None
        self._making = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        """A call's start: run after every start submitted before it."""
        return self._submit(fn, receive=False)

    def submit_receive(self, fn: Callable[[], T]) -> "Future[T]":
        """A call's receive: run before any start still queued. The engine waits for its calls in the order it
        started them, so the oldest receive is the one it waits for; a start queued meanwhile (the next
        micro-batch's) has the engine's expert compute to hide behind. A receive issues no collective and waits
        only on a transfer that this rank, and so (in the same order) every peer, has issued: never on a start
        still queued here."""
        return self._submit(fn, receive=True)

    def _submit(self, fn: Callable[[], T], *, receive: bool) -> "Future[T]":
        future: Future[T] = Future()
        self._jobs.put((_in_callers_modes(fn), future), receive=receive)  # type: ignore[arg-type]
        if self._thread is None:
            with self._starting:
                if self._thread is None:
                    self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=self._name, daemon=True)
                    self._thread.start()
        return future


class _Jobs:
    """Two FIFO queues, receives served first."""

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._receives: "collections.deque[tuple[Callable[[], object], Future]]" = collections.deque()
        self._starts: "collections.deque[tuple[Callable[[], object], Future]]" = collections.deque()

    def put(self, job: "tuple[Callable[[], object], Future]", *, receive: bool) -> None:
        with self._ready:
            (self._receives if receive else self._starts).append(job)
            self._ready.notify()

    def get(self) -> "tuple[Callable[[], object], Future]":
        with self._ready:
            while not (self._receives or self._starts):
                self._ready.wait()
            return (self._receives or self._starts).popleft()


def _in_callers_modes(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` under the submitting thread's grad and inference modes (engines serve under
    ``torch.inference_mode()``: in-place ops on its tensors outside it are refused)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()

    return run


_BY_GROUP: "dict[object, Receiver]" = {}
_BY_GROUP_LOCK = threading.Lock()


def _forget_groups() -> None:
    """At exit, while the interpreter still runs: the started groups go with their receivers. Left to the
    interpreter's teardown, a gloo group that ``dist.destroy_process_group()`` had already shut down was destroyed
    there, and torchrun's workers aborted ("terminate called without an active exception": tests/test_multinode.py,
    3 of 4 launches)."""
    with _BY_GROUP_LOCK:
        _BY_GROUP.clear()


atexit.register(_forget_groups)


def receiver_for(group: "dist.ProcessGroup", timeout_s: float) -> Receiver:
    """The receiver of ``group``'s started calls in this process, shared by every dispatcher of ``group`` (one
    thread and one set of gloo connections per group, not per layer), with its ``group`` made: a gloo group of the
    same ranks on which only that thread issues collectives, in the order the calls started. One thread per group,
    not per process: a thread's start waits for the peers, and two groups' starts queued in different orders on two
    ranks would wait for each other. Only for a ``group`` of every rank (the reference dispatcher's rule): made by
    the first dispatcher created on it, at creation, where every rank is, with ``dist.new_group``, which keeps that
    call's rule: the first dispatcher of each group in the same order on every rank, not from several threads at
    once. A peer that never comes ends it in a
    ``CommunicationError`` after the group's gloo deadline (``_started_group``)."""
    with _BY_GROUP_LOCK:
        receiver = _BY_GROUP.get(group)
        if receiver is None:
            receiver = _BY_GROUP[group] = Receiver(f"moe-dispatch receiver {len(_BY_GROUP)}")
    with receiver._making:
        if receiver.group is None:
            receiver.group = _started_group(group, timeout_s)
    return receiver


def _started_group(group: "dist.ProcessGroup", timeout_s: float) -> "dist.ProcessGroup":
    ranks = dist.get_process_group_ranks(group)
    # gloo's own deadline on each collective: past the dispatchers' Watch (twice the creating dispatcher's timeout),
    # which names a stalled peer before it; a later dispatcher of the group with a timeout over twice this one's meets
    # gloo's first. It also bounds the creation's wait for the peers.
    collectives = datetime.timedelta(seconds=2 * timeout_s)
    try:
        made = dist.new_group(ranks, backend="gloo", timeout=collectives)  # every rank: named by torch's group count
    except (RuntimeError, ValueError) as exc:
        raise CommunicationError(
            f"the started calls' gloo group beside ranks {ranks} could not be made ({type(exc).__name__}: {exc}): a "
            "peer failed or is not creating its dispatcher at this point; as for dist.new_group, every rank must "
            "create the first dispatcher of a group at the same point, not from several threads at once"
        ) from exc
    return made


def _serve(jobs: _Jobs) -> None:
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
