"""The process-group calls the reference backends make, with the bytes counted at each: ``payload`` (activations
and their scales), ``metadata`` (routing: ids, weights, counts), ``combine`` (the BF16 rows sent back) and ``check``
(the call check). Every tensor crosses as raw bytes (uint8 rows), so the same code runs on gloo, NCCL and HCCL
whatever the wire dtype. A rank counts what it sends, its share to itself included, so totals compare directly with
``WireFormat`` × pairs."""

from __future__ import annotations

import copy
import functools
import pickle
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist

from .._codecs import as_bytes, from_bytes
from .._errors import CommunicationError, InvalidInputError, InvalidSpecError

if TYPE_CHECKING:
    from .watch import CallId, GroupGuard, Watch

_MAX_TIMEOUT_S = 365 * 24 * 3600.0  # beyond a year a deadline is a typo, and timedelta overflows near 1e14 s
#: Seconds a rank waits for its peers in one collective before ``CollectiveTimeoutError``.
DEFAULT_TIMEOUT_S = 300.0


def check_timeout(value: object) -> float:
    """``value`` as a collective deadline in seconds, or an ``InvalidSpecError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSpecError("must be a number of seconds", parameter="timeout_s", value=value,
                               allowed=f"a number in (0, {_MAX_TIMEOUT_S:g}]")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = float("inf")
    if not (0 < seconds <= _MAX_TIMEOUT_S):  # also NaN
        raise InvalidSpecError("must be a positive number of seconds, at most a year", parameter="timeout_s",
                               value=value, allowed=f"a number in (0, {_MAX_TIMEOUT_S:g}]")
    return seconds


#: The Watch of the dispatcher call running on this thread (``Comm.calling``).
_CALLING: ContextVar[Watch | None] = ContextVar("moe_dispatch_calling", default=None)


@dataclass
class Traffic:
    """Bytes this rank has sent, by category, and how many collectives it entered."""

    payload_bytes: int = 0
    metadata_bytes: int = 0
    combine_bytes: int = 0
    #: What the call check (``begin``) adds: 24 bytes per peer beside the counts it rides with, 32 alone.
    check_bytes: int = 0
    collectives: int = 0

    def restore(self, saved: "Traffic") -> None:
        """Back to the counts of ``saved``, in place: the started calls' ``Comm`` counts into this object too."""
        for f in fields(self):
            setattr(self, f.name, getattr(saved, f.name))

    def copy(self) -> "Traffic":
        return Traffic(**self.to_dict())

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


Section = tuple[str, int]  # (category, bytes per row)
_COUNTERS = {"payload": "payload_bytes", "metadata": "metadata_bytes", "combine": "combine_bytes",
             "check": "check_bytes"}
# Device types by process-group backend; devices are built on use ("npu" exists once torch_npu is imported).
_DEVICE_TYPES = {"local": "cpu", "gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank called it: bytes to and from each peer, in rank order. What
    ``moe-dispatch bench`` replays as bare ``all_to_all_single`` calls (the transport floor)."""

    name: str
    send_bytes: tuple[int, ...]
    recv_bytes: tuple[int, ...]
    categories: tuple[str, ...]

    @property
    def carries_data(self) -> bool:
        """False for routing-only exchanges (the per-rank counts)."""
        return any(c not in ("metadata", "check") for c in self.categories)


class Comm:
    """A process group (or none, for one process) with counted, byte-level collectives (``DispatchContext.comm``). Every
    call takes uint8 rows ``[N, W]`` and ``sections``: ``(category, bytes per row)`` pairs that split each row's W
    columns into the traffic categories. With world size 1 the calls return their input. A ``Comm`` a backend makes
    itself waits with the calling dispatcher's ``Watch`` (``calling``)."""

    def __init__(self, group: "dist.ProcessGroup | None" = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = check_timeout(timeout_s)
        if dist.is_available() and dist.is_initialized():
            self.group, self.rank, self.world_size = group, dist.get_rank(group), dist.get_world_size(group)
            if self.rank < 0:
                raise InvalidSpecError(f"this process (global rank {dist.get_rank()}) is not a member of the group",
                                       parameter="group", value=group,
                                       allowed="a group this rank belongs to (dist.new_group(ranks))")
        elif group is not None:
            raise InvalidSpecError("a process group was given but torch.distributed is not initialized",
                                   parameter="group", value=group,
                                   allowed="None (one process) or a group of an initialized torch.distributed")
        else:
            self.group, self.rank, self.world_size = None, 0, 1
        self.traffic = Traffic()
        self._seq = 0  # collectives entered: the same number names the same call on every rank
        self._numbering = ""  # what prefixes those numbers: "" here, "started-" on the started calls' group
        self._counting = threading.Lock()  # the traffic is counted from the receiver thread too (for_started_calls)
        self.uid = ""  # the dispatcher's uid, agreed at creation (``bind``)
        self._call: CallId | None = None  # begun, not yet checked with the peers
        self.begun_at = 0  # ``started`` when the call began (``begin``)
        #: Whether every call is checked against the peers' (``begin``): on gloo (host memory). NCCL and HCCL check
        #: only the calls that read the counts on the host anyway (normal-mode dispatch): low latency stays sync-free.
        self.checks_calls_everywhere = self.world_size > 1 and self.backend_name == "gloo"
        self._watch: Watch | None = None  # peers' failures and deadlines: only where there are peers
        #: What the dispatchers of this group share in this process (one thread's call at a time); None alone.
        self.guard: GroupGuard | None = None
        if self.world_size > 1:
            from .watch import Watch, guard_of
            self.guard = guard_of(self.process_group, self.rank)
            self._watch = Watch(self.rank, self.world_size, self.timeout_s, self.checks_calls_everywhere, self.guard)
        #: When a list, every collective appends its ``CollectiveRecord`` (see ``recording``).
        self.records: list[CollectiveRecord] | None = None

    def bind(self, uid: str) -> None:
        """Name this dispatcher's calls and failure notices by the ``uid`` its ranks agreed on."""
        self.uid = uid
        if self._watch is not None:
            self._watch.bind(uid)

    @property
    def watch(self) -> Watch | None:
        """This dispatcher's ``Watch`` (None alone); for a ``Comm`` bound to none, the caller's (``calling``)."""
        return self._caller() or self._watch

    def _caller(self) -> Watch | None:
        caller = None if self.uid else _CALLING.get()
        same = caller is not None and caller.rank == self.rank and caller.world_size == self.world_size
        return caller if same else None

    @contextmanager
    def calling(self) -> Iterator[None]:
        """Inside the block, a ``Comm`` bound to no dispatcher (a vendor's, or a fake's) waits with this one's
        ``Watch``. The core enters it around every backend call on gloo; an adapter enters it around a vendor
        collective it makes outside a dispatcher call (a teardown)."""
        token = _CALLING.set(self._watch)
        try:
            yield
        finally:
            _CALLING.reset(token)

    def in_call(self, fn):  # type: ignore[no-untyped-def]
        """``fn`` run inside ``calling`` where this ``Comm`` polls (gloo with peers); ``fn`` itself elsewhere."""
        if self._watch is None or not self._watch.poll:
            return fn

        @functools.wraps(fn)
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            with self.calling():
                return fn(*args, **kwargs)
        return run

    @property
    def started(self) -> int:
        """Collectives started so far under this ``Comm``'s ``Watch`` (a vendor's too, inside ``calling``)."""
        return self._seq + (self._watch.emulated if self._watch is not None else 0)

    def begin(self, phase: str, number: int) -> None:
        """The collectives that follow belong to call ``number`` of ``phase`` of this dispatcher. The first of them (the
        counts exchange, or a 32-byte-per-peer exchange of its own) checks that every rank is at the same call
        (``Watch.check_call``); otherwise ``CallOrderError`` on every rank before any data moves (gloo aborts the
        process on mismatched sizes; NCCL pairs the wrong buffers)."""
        if self.world_size > 1:
            from .watch import CallId
            self._call = call = CallId(self.watch.epoch, phase, number)
            self.watch.enter(call)
            self.begun_at = self.started

    def for_started_calls(self, group: "dist.ProcessGroup") -> "Comm":
        """This dispatcher's collectives on ``group``, the started calls' own group of the same ranks, for the
        receiver thread (``_reference/receiver.py``): the same uid, ``Watch`` and traffic counts, numbered apart,
        with a call check of their own (``take_call``), recording nothing."""
        started = copy.copy(self)
        started.group, started._seq, started._numbering = group, 0, "started-"
        started._call, started.records = None, None
        return started

    def take_call(self) -> CallId | None:
        """The call check ``begin`` left for this call's first collective, taken to go with the call to the started
        calls' group (``resume_call`` there)."""
        call, self._call = self._call, None
        return call

    def resume_call(self, call: CallId | None) -> None:
        self._call = call
        if call is not None:
            self.watch.enter(call)  # on the receiver thread: its waits belong to the started call

    @contextmanager
    def recording(self) -> Iterator[list[CollectiveRecord]]:
        """Record the collectives made inside the block (for the bench; off otherwise)."""
        previous, self.records = self.records, []
        try:
            yield self.records
        finally:
            self.records = previous

    @property
    def process_group(self) -> "dist.ProcessGroup | None":
        """The group to hand a vendor library (which wants an explicit one): the WORLD group when the default group
        is in use, None without torch.distributed."""
        if self.group is None and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return self.group

    @property
    def backend_name(self) -> str:
        if self.world_size == 1 and not (dist.is_available() and dist.is_initialized()):
            return "local"
        return str(dist.get_backend(self.group))

    @property
    def device(self) -> torch.device | None:
        """The device type this group's tensors live on (cpu for gloo and one process, cuda for NCCL, npu for HCCL);
        None for a backend the core does not know."""
        kind = _DEVICE_TYPES.get(self.backend_name)
        return torch.device(kind) if kind else None

    def _count(self, rows: int, sections: Sequence[Section]) -> None:
        with self._counting:
            t = self.traffic
            t.collectives += 1
            for category, width in sections:
                counter = _COUNTERS.get(category)
                if counter is None:
                    raise InvalidInputError("unknown traffic category", parameter="sections", value=category,
                                            allowed="payload, metadata, combine, check")
                setattr(t, counter, getattr(t, counter) + rows * width)

    def all_to_all(self, send: torch.Tensor, send_counts: list[int] | None, recv_counts: list[int] | None,
                   sections: Sequence[Section], out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``send`` go to ranks in ``send_counts`` slices (None: evenly); the received rows come back rank by
        rank, into ``out`` when given (exactly the received shape). With world size 1 ``send`` is returned."""
        return self.all_to_all_start(send, send_counts, recv_counts, sections, out).wait()

    def all_to_all_start(self, send: torch.Tensor, send_counts: list[int] | None, recv_counts: list[int] | None,
                         sections: Sequence[Section], out: torch.Tensor | None = None) -> "Transfer":
        """``all_to_all`` started: ``wait()`` on the ``Transfer`` hands back the received rows; ``send`` and ``out``
        must stay untouched until then. Every rank must start the same collectives in the same order (they are
        numbered when they start); waits may come in any order."""
        if self._call is not None and self.checks_calls_everywhere:
            self._watch.check_call(self, None)  # type: ignore[union-attr]  # before the call's first collective
        send = send.contiguous()  # no-op for the backends' own buffers; collectives need dense memory
        self._count(send.shape[0], sections)
        if self.records is not None:
            self._record("all_to_all", send, send_counts, recv_counts, sections)
        if self.world_size == 1:
            return Transfer(send)
        rows = sum(recv_counts) if recv_counts is not None else send.shape[0]
        out = _receive_into(out, send, (rows, *send.shape[1:]))
        return self._start("all_to_all", out, lambda: dist.all_to_all_single(out, send, recv_counts, send_counts,
                                                                              group=self.group, async_op=True))

    def all_gather(self, send: torch.Tensor, sections: Sequence[Section],
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``send`` (same shape everywhere), stacked rank by rank. Counted as what every destination
        receives from this rank: ``world_size`` copies. ``out`` as for ``all_to_all``."""
        return self.all_gather_start(send, sections, out).wait()

    def all_gather_start(self, send: torch.Tensor, sections: Sequence[Section],
                         out: torch.Tensor | None = None) -> "Transfer":
        """``all_gather`` started (as ``all_to_all_start``)."""
        if self._call is not None and self.checks_calls_everywhere:
            self._watch.check_call(self, None)  # type: ignore[union-attr]
        send = send.contiguous()
        self._count(send.shape[0] * self.world_size, sections)
        if self.records is not None:
            per_peer = [send.shape[0]] * self.world_size
            self._record("all_gather", send, per_peer, per_peer, sections)
        if self.world_size == 1:
            return Transfer(send)
        out = _receive_into(out, send, (self.world_size * send.shape[0], *send.shape[1:]))
        return self._start("all_gather", out, lambda: _gather(out, send, self.group))

    def gather_uncounted(self, send: torch.Tensor, operation: str) -> torch.Tensor:
        """Every rank's uint8 ``send`` stacked rank by rank, outside the traffic counts (the creation's agreement)."""
        if self.world_size == 1:
            return send.unsqueeze(0)
        device = self.device or torch.device("cpu")
        if device.type != "cpu":  # NCCL/HCCL gather tensors on this process's current device only
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        send = send.to(device).contiguous()
        out = send.new_empty((self.world_size * send.shape[0], *send.shape[1:]))
        self._start(operation, None, lambda: _gather(out, send, self.group)).wait()
        return out.view(self.world_size, *send.shape).cpu()

    def gather_object(self, obj: Any, operation: str) -> list[Any]:
        """Every rank's picklable ``obj`` in rank order, outside the traffic counts, with the same failure handling
        as the data collectives (a vendor's start-up exchanges, e.g. FlashInfer's MNNVL handles)."""
        if self.world_size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.gather_uncounted(torch.tensor([data.numel()], dtype=torch.int64).view(torch.uint8), operation)
        lengths = [int(n) for n in sizes.view(torch.int64).reshape(-1)]
        rows = self.gather_uncounted(torch.cat([data, data.new_zeros(max(lengths) - data.numel())]), operation)
        return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]

    def barrier(self, operation: str = "barrier") -> None:
        """Every rank arrives here before any leaves, with the same failure handling as the data collectives (a peer
        that failed or died is named, not waited for)."""
        if self.world_size > 1:
            self.gather_uncounted(torch.zeros(1, dtype=torch.uint8), operation)

    def announce_failure(self, operation: str, error: BaseException) -> None:
        """Tell the other ranks this one raised and makes no more calls of this dispatcher: they stop waiting."""
        if self._watch is not None:
            self.watch.announce(operation, error)

    def abandon(self, operation: str, error: BaseException, begun_at: int) -> None:
        """``announce_failure`` of a call broken off; ``begun_at``: ``started`` when it began (``Watch.broke_off``)."""
        if self._watch is not None:
            self.watch.broke_off(operation, error, begun_at, self.started)

    def announce_refusal(self, operation: str, error: BaseException, phase: str, number: int | None) -> None:
        """Tell the other ranks this one refused call ``number`` of ``phase`` before its collectives and goes on (the
        ranks waiting in that call stop; its next calls are a new epoch)."""
        if self._watch is not None:
            from .watch import CallId
            self.watch.refused(operation, error, CallId(self.watch.epoch, phase, number))

    def exchange_counts(self, counts: torch.Tensor | list[int], device: torch.device | None = None) -> torch.Tensor:
        """int64 ``[world]``: how many rows this rank sends to each rank (a list: held on the host, sent from
        ``device``) → how many it gets. Carries the call check when one is due (``begin``): 32 bytes per peer."""
        if self._call is None:
            if isinstance(counts, list):
                counts = torch.tensor(counts, device=device or self.device)
            raw = as_bytes(counts.to(torch.int64).unsqueeze(1))  # one 8-byte row per rank
            return from_bytes(self.all_to_all(raw, None, None, [("metadata", 8)]), torch.int64).squeeze(1)
        return self._watch.check_call(self, counts, device)  # type: ignore[union-attr]

    def _record(self, name: str, send: torch.Tensor, send_counts: list[int] | None, recv_counts: list[int] | None,
                sections: Sequence[Section]) -> None:
        width = send.shape[1] if send.dim() > 1 else 1
        even = [send.shape[0] // self.world_size] * self.world_size
        assert self.records is not None
        self.records.append(CollectiveRecord(
            name, tuple(c * width for c in (send_counts if send_counts is not None else even)),
            tuple(c * width for c in (recv_counts if recv_counts is not None else even)),
            tuple(category for category, _ in sections)))

    def _collective_number(self) -> int | str:
        """The next collective's number, the same on every rank (it names its markers in the Watch's store); a
        vendor's collectives under a dispatcher's Watch are numbered apart."""
        caller = self._caller()
        if caller is not None:
            caller.emulated += 1
            return f"emulated-{caller.emulated}"
        self._seq += 1
        return f"{self._numbering}{self._seq}" if self._numbering else self._seq

    def _start(self, name: str, out: torch.Tensor | None, start) -> "Transfer":  # type: ignore[no-untyped-def]
        if self.guard is not None:  # with peers: none after one left unfinished (it would pair with it)
            self.guard.check(name)
        number = self._collective_number()
        try:
            work = start()
        except (RuntimeError, dist.DistError) as exc:
            raise CommunicationError(f"{name} could not start on rank {self.rank} of {self.world_size}: another rank "
                                     f"probably failed, stalled or disagreed on the call ({exc})") from exc
        return Transfer(out, work, self.watch, name, number, self.watch.call, bool(self._numbering))


class Transfer:
    """A collective in flight (``Comm.all_to_all_start``): ``wait()`` returns its received rows, under the
    dispatcher's ``Watch`` (a peer that failed or stalled is named, not waited for forever)."""

    __slots__ = ("out", "_work", "_watch", "_name", "_number", "_call", "_started")

    def __init__(self, out, work=None, watch: "Watch | None" = None, name: str = "",  # type: ignore[no-untyped-def]
                 number: int | str = 0, call: CallId | None = None, started: bool = False) -> None:
        self.out, self._work, self._watch, self._name, self._number = out, work, watch, name, number
        self._call = call  # the call it belongs to, when it started: a peer's refusal of that call ends the wait
        self._started = started  # on the started calls' group (Comm.for_started_calls)

    @property
    def done(self) -> bool:
        """Whether the collective has ended (the bytes are in, or it failed): its buffers are free to reuse. A wait
        that gave up (a peer failed, a timeout) leaves it not done while gloo may still write."""
        work = self._work  # read once: a wait() on the other thread may clear it meanwhile
        return work is None or bool(work.is_completed())

    def wait(self):  # type: ignore[no-untyped-def]
        if self._work is not None:
            self._watch.wait(  # type: ignore[union-attr]
                self._work, self._name, self._number, self._call, self._started)
            self._work = None  # only once it has completed
        return self.out


def _receive_into(out: torch.Tensor | None, send: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The receive buffer: a new one, or the caller's, checked to be exactly what arrives (a short buffer would leave
    rows unwritten; a long one would hand back rows of an earlier call)."""
    if out is None:
        return send.new_empty(shape)
    if tuple(out.shape) != shape or out.dtype != send.dtype or out.device != send.device or not out.is_contiguous():
        raise InvalidInputError("the receive buffer does not match what arrives", parameter="out",
                                value=f"{tuple(out.shape)} {out.dtype} {out.device}",
                                allowed=f"contiguous {shape} {send.dtype} {send.device}")
    return out


def _gather(out: torch.Tensor, send: torch.Tensor, group: "dist.ProcessGroup | None"):  # type: ignore[no-untyped-def]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return gather(out, send, group=group, async_op=True)
