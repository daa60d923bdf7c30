"""The thread that runs the reference backends' started calls on host memory (gloo), one per process group: each
call's start (its collectives, on the started calls' own gloo group of the same ranks) in program order, and its
receive ahead of the starts still queued, while the caller computes; ``wait()`` collects the result or the error on
the caller's thread. The rules this imposes on engines are in docs/reliability.md."""

from __future__ import annotations

import atexit
import datetime
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from .._errors import CommunicationError

if TYPE_CHECKING:
    from .._distributed.comm import Comm

T = TypeVar("T")
#: (0 for a receive, 1 for a start; the order submitted; the job and its future): the receives first.
_Jobs: TypeAlias = "queue.PriorityQueue[tuple[int, int, tuple[Callable[[], object], Future]]]"


class Receiver:
    """Runs submitted functions one at a time on a daemon thread started on first use (a call that never completes
    must not keep the process from exiting): the receives first, each kind in the order submitted."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: _Jobs = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # two callers' first jobs must not start two threads
        #: The started calls' own process group (``receiver_for``), made by the first dispatcher of the group.
        self.group: "dist.ProcessGroup | None" = None
        self._making = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        """A call's start: run after every start submitted before it."""
        return self._submit(fn, receive=False)

    def submit_receive(self, fn: Callable[[], T]) -> "Future[T]":
        """A call's receive: run before any start still queued (the engine waits for its oldest call first). A receive
        issues no collective and waits only on a transfer every rank has issued, never on a start still queued."""
        return self._submit(fn, receive=True)

    def _submit(self, fn: Callable[[], T], *, receive: bool) -> "Future[T]":
        future: Future[T] = Future()
        self._jobs.put((0 if receive else 1, next(self._order), (_in_callers_modes(fn), future)))
        if self._thread is None:
            with self._starting:
                if self._thread is None:
                    self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=self._name, daemon=True)
                    self._thread.start()
        return future


def _in_callers_modes(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` under the submitting thread's grad and inference modes (engines serve under ``torch.inference_mode()``:
    in-place ops on its tensors outside it are refused)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run() -> T:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()

    return run


_BY_GROUP: "dict[object, Receiver]" = {}
_BY_GROUP_LOCK = threading.Lock()


def _forget_groups() -> None:
    """At exit, while the interpreter still runs: the started groups go with their receivers (destroyed in the
    interpreter's teardown after ``dist.destroy_process_group()``, a gloo group aborted torchrun's workers)."""
    with _BY_GROUP_LOCK:
        _BY_GROUP.clear()


atexit.register(_forget_groups)


def receiver_for(comm: Comm) -> Receiver:
    """The receiver of the started calls of ``comm``'s group in this process, shared by every dispatcher of the group
    (one thread and one set of gloo connections per group, not per layer: two groups' starts queued in different
    orders on two ranks would wait for each other), with its ``group`` made by the group's first dispatcher: a gloo
    group of the same ranks on which only that thread issues collectives (``dist.new_group``'s rules: a group of every
    rank, made in the same order on every rank). A peer that never comes ends it in a ``CommunicationError``."""
    group = comm.process_group
    with _BY_GROUP_LOCK:
        receiver = _BY_GROUP.get(group)
        if receiver is None:
            receiver = _BY_GROUP[group] = Receiver(f"moe-dispatch receiver {len(_BY_GROUP)}")
    with receiver._making:
        if receiver.group is None:
            # dist.new_group waits for the peers in the store, deaf to the Watch: meet them first in a collective the
            # Watch waits on, so that a peer that failed or died in its create is named at once, not timed out.
            from .._distributed.agreement import check_creation
            check_creation(comm, 1)
            receiver.group = _started_group(group, comm.timeout_s)
    return receiver


def _started_group(group: "dist.ProcessGroup", timeout_s: float) -> "dist.ProcessGroup":
    ranks = dist.get_process_group_ranks(group)
    # gloo's own deadline on each collective, past the dispatchers' Watch (which names a stalled peer first); it also
    # bounds the creation's wait for the peers.
    collectives = datetime.timedelta(seconds=2 * timeout_s)
    try:
        return dist.new_group(ranks, backend="gloo", timeout=collectives)  # every rank: named by torch's group count
    except (RuntimeError, ValueError) as exc:
        raise CommunicationError(
            f"the started calls' gloo group beside ranks {ranks} could not be made ({type(exc).__name__}: {exc}): a "
            "peer failed or is not creating its dispatcher at this point; as for dist.new_group, every rank must "
            "create the first dispatcher of a group at the same point, not from several threads at once") from exc


def _serve(jobs: _Jobs) -> None:
    """The thread, holding only the queue: a job's function, and with it its dispatcher and buffers, goes once run."""
    while True:
        _, _, (fn, future) = jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - raised again by wait() on the caller's thread
                future.set_exception(exc)
        del fn, future  # a finished call's buffers are not the thread's to keep
