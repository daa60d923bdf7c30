"""What a dispatcher's ranks need of each other beyond the data: the call check (every rank at the same call), and
waiting for a collective without hanging when another rank fails, stalls or dies. Loaded only with peers.

On gloo (CPU) a rank waits in short slices. Between slices it looks in the process group's store for a failure
notice that a peer posts when it raises (bad input on that rank, a bug): the error reaches every rank within a slice
instead of after a timeout. A notice says whether the peer is done with the dispatcher (``announce``) or refused one
call's inputs and goes on (``refused``: only the ranks waiting in that very call stop). Past ``timeout_s`` the waiting
ranks each leave a marker in the store; the ranks without one never arrived, and the error names them. A rank that
died closes its connections: gloo fails the collective at once, and the same markers name the dead rank.

NCCL and HCCL ``wait()`` only orders streams (no host sync, CUDA-graph safe); their own watchdogs enforce the
process group's timeout, so nothing is polled there. After an error the group has a collective that will never
finish, so the process group must be rebuilt (torch.distributed cannot cancel a gloo operation)."""

from __future__ import annotations

import datetime
import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._codecs import as_bytes, from_bytes
from .._errors import CallOrderError, CollectiveTimeoutError, CommunicationError, PeerFailedError

_SLICE = datetime.timedelta(milliseconds=50)
#: A wait this long looks for a peer making the same call in the other form (``Watch._check_form``): a store write
#: and a read a slice from then on, so not for the many waits a busy machine makes a few slices long.
_FORM_AFTER_S = 1.0
#: The calls a dispatcher makes, as they travel in the call check (``Comm.begin``); its creation's agreement too.
PHASES = ("dispatch", "combine", "forward", "create")
_CALL_ROW = 4  # int64 words per peer in the call check: count, dispatcher tag, attempt, number
#: How gloo says a peer's connections closed (its process died, or it destroyed the group); after gloo's own timeout
#: ("Timed out waiting ...ms") the peer may be alive elsewhere.
_CLOSED = ("closed by peer", "reset by peer", "broken pipe")
#: The attempt word: the phase's index in PHASES in its low bits, the calls the rank refused before (the epoch) above.
_PHASE_BITS = 8


def _default_store():  # type: ignore[no-untyped-def]
    """The store every rank of the default group shares (private in torch, stable since 1.x)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store: no notices, plain timeouts
        return None


class GroupGuard:
    """What the dispatchers of one process group share in this process. Gloo pairs a group's collectives by their
    order on it, so two threads calling at once would interleave them differently on each rank and gloo aborts the
    process on the mismatched sizes: a call, or a creation (``with guard:``), is the group's only one in this process
    at a time (``enter``). And once one of its collectives was left unfinished here (a wait gave up, or a call broke
    off between its collectives: ``abandon``), a later collective would pair with it: none starts (``check``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank  # this process's, in the group
        self._lock = threading.RLock()  # re-entered by forward's dispatch and combine
        self._holder = ""
        #: Why the group can make no more collectives in this process (``abandon``); None while it can.
        self.abandoned: str | None = None
        self.watches: weakref.WeakSet[Watch] = weakref.WeakSet()  # of the group's dispatchers here

    def enter(self) -> bool:
        """Whether this thread may make a call now (then ``leave`` after it): False while another thread is in one."""
        if not self._lock.acquire(blocking=False):
            return False
        self._holder = threading.current_thread().name
        return True

    def leave(self) -> None:
        self._lock.release()

    def __enter__(self) -> None:
        if not self.enter():
            raise self.busy("create")

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def busy(self, operation: str) -> CommunicationError:
        """The error for ``enter`` returning False: found before any collective."""
        return CommunicationError(
            f"{operation} on rank {self.rank} while thread {self._holder!r} is in a call on the same process group: "
            "a group's dispatchers are called by one thread at a time (any thread, one after the other), or each "
            "thread has a group of its own (docs/reliability.md); nothing was sent" + (
                "" if operation == "create" else ", and this dispatcher must be created again"),
            parameter="thread", value=threading.current_thread().name,
            allowed="one thread at a time in the calls of a group")

    def check(self, collective: str) -> None:
        """Before each collective on the group: a ``CommunicationError`` once the group is abandoned."""
        if self.abandoned is not None:
            raise CommunicationError(f"{collective} refused on rank {self.rank}: {self.abandoned}; the process group "
                                     "must be rebuilt and its dispatchers created again")

    def abandon(self, operation: str, error: BaseException) -> None:
        """A collective of the group was left unfinished on this rank: no later one starts, and the peers waiting
        in any of the group's dispatchers stop (they would wait for calls this rank no longer makes)."""
        if self.abandoned is None:
            self.abandoned = (f"a collective of the group was left unfinished on rank {self.rank} when {operation} "
                              f"failed ({type(error).__name__}: {error})")
            for watch in list(self.watches):
                watch.announce(operation, error)


_GUARDS: weakref.WeakKeyDictionary[Any, GroupGuard] = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def guard_of(group: Any, rank: int) -> GroupGuard:
    """The guard of ``group`` (a ``ProcessGroup``, this process its ``rank``) in this process, gone with the group."""
    with _GUARDS_LOCK:
        return _GUARDS.setdefault(group, GroupGuard(rank))


@dataclass(frozen=True, slots=True)
class CallId:
    """Which call of a dispatcher a collective belongs to, the same on every rank that makes it: ``phase`` and
    ``number`` as ``Comm.begin`` numbers them (``number`` None: a refused combine of something that was no dispatch
    output), and ``epoch``, the calls this rank had refused before it. A refused call takes no number (its inputs
    never left the rank), so a call made again after its refusal has the same number: the epoch tells them apart."""

    epoch: int
    phase: str
    number: int | None


class Watch:
    """The call check, deadline and peer-failure notices for one dispatcher's collectives."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, poll: bool,
                 guard: GroupGuard | None = None) -> None:
        self.rank, self.world_size, self.timeout_s, self.poll = rank, world_size, timeout_s, poll
        self.store = _default_store() if poll else None
        self.uid = ""  # the dispatcher's, agreed at creation (``bind``)
        self.tag = 0  # the uid as the call check carries it
        self.prefix: str | None = None  # where this dispatcher's keys live in the store; None before ``bind``
        #: Calls this rank refused so far (``refused``): part of every later call's ``CallId``.
        self.epoch = 0
        # The call this thread is in (``enter``): the caller's, or the receiver thread's started call.
        self._thread = threading.local()
        # Notices read so far (``_notice``), from the caller's thread and the receiver thread alike.
        self._heard: list[dict] = []  # type: ignore[type-arg]
        self._reading = threading.Lock()
        #: Collectives a vendor's Comm (or a fake's) ran under this Watch (``Comm.calling``), numbered apart from the
        #: dispatcher's own so that the markers naming absent ranks never mix the two.
        self.emulated = 0
        #: The group's, abandoned when a wait gives up (``wait``).
        self.guard = guard
        if guard is not None:
            guard.watches.add(self)

    def bind(self, uid: str) -> None:
        """Start posting and reading notices, and checking calls, under the dispatcher's agreed ``uid``."""
        self.uid = uid
        self.tag = int(uid[:15], 16) if uid else 0
        self.prefix = f"moe_dispatch/{uid}" if uid else None

    def check_call(self, comm: Any, counts: torch.Tensor | list[int] | None,
                   device: torch.device | None = None) -> torch.Tensor:  # comm: the Comm that began it
        """The call check ``comm.begin`` left for this call's first collective: one all-to-all of (count, dispatcher,
        attempt, number) per peer; every rank compares every rank's call with its own and raises ``CallOrderError`` on
        any difference, so all raise together. The attempt word holds the phase and the calls the rank refused before: a
        call one rank makes again after refusing it alone never pairs with its peers'. Returns the received counts."""
        assert comm._call is not None
        call, comm._call = comm._call, None
        world, tag = comm.world_size, self.tag
        attempt = PHASES.index(call.phase) | call.epoch << _PHASE_BITS
        on_host = counts if isinstance(counts, list) else [0] * world  # counts the host holds need no copy
        rows = torch.tensor([[n, tag, attempt, call.number] for n in on_host], dtype=torch.int64)
        if isinstance(counts, torch.Tensor):
            rows[:, 0] = counts.to(rows.device)
        device = counts.device if isinstance(counts, torch.Tensor) else device or comm.device or torch.device("cpu")
        if device.type != "cpu":
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        sections = [("check", 8 * _CALL_ROW)] if counts is None else [("metadata", 8), ("check", 8 * (_CALL_ROW - 1))]
        got = from_bytes(comm.all_to_all(as_bytes(rows.to(device)), None, None, sections),
                         torch.int64).view(world, _CALL_ROW)
        calls = [tuple(row) for row in got[:, 1:].tolist()]  # gloo: host memory; NCCL: where counts sync anyway
        if any(c != (tag, attempt, call.number) for c in calls):
            mask = (1 << _PHASE_BITS) - 1
            named = tuple((f"{t:015x}", PHASES[a & mask] if (a & mask) < len(PHASES) else f"phase {a & mask}",
                           int(n)) for t, a, n in calls)
            refused = tuple(a >> _PHASE_BITS for _, a, _ in calls)
            per_rank = "; ".join(f"rank {r}: " + ("creating a dispatcher" if ph == "create" else
                                                  f"dispatcher {u} {ph} #{n}")
                                 + (f" after {e} refused call(s)" if e else "")
                                 for r, ((u, ph, n), e) in enumerate(zip(named, refused)))
            raise CallOrderError(
                f"the ranks reached different calls ({per_rank}); every rank must call the same dispatchers, "
                f"dispatch and combine, in the same order, and a call refused on some ranks only is not made again "
                f"(docs/reliability.md); nothing was exchanged, and this dispatcher must be created again",
                calls=named, refused=refused)
        return got[:, 0]

    @property
    def call(self) -> CallId | None:
        """The call this thread entered last (``enter``); None before any."""
        return getattr(self._thread, "call", None)

    def enter(self, call: CallId) -> None:
        """This thread's collectives from here on belong to ``call`` (``Comm.begin``; a started call's on the
        receiver thread); an emulated vendor collective on the thread takes it too."""
        self._thread.call = call

    def announce(self, operation: str, error: BaseException, after: int | None = None) -> None:
        """Tell the peers this rank failed in ``operation`` and makes no more calls of this dispatcher (it broke,
        or was never made): every rank waiting for it stops. ``after``: the collectives it had started in the
        dispatcher, all of them finished (``left_alike``); None where one may be unfinished."""
        self._post(operation, error, None, after)

    def broke_off(self, operation: str, error: BaseException, begun_at: int, started: int) -> None:
        """``announce`` a call that broke off in ``operation``. Where it had started some of its collectives
        (``started`` moved on from ``begun_at``) and the peers did not all break off after as many, they may wait in
        the next one, with which this rank's next collective on the group would pair: none of the group's follows
        here (``GroupGuard.abandon``). Before any, the peers wait in the call check, which every call (and
        creation) on gloo starts with, of one size everywhere."""
        self.announce(operation, error, after=started)
        if self.guard is not None and started != begun_at and not self.left_alike(started):
            self.guard.abandon(operation, error)

    def left_alike(self, after: int) -> bool:
        """Whether every peer left this dispatcher after the same ``after`` collectives as this rank (a failure
        every rank meets at the same point, e.g. a vendor's check on gathered sizes): then no rank waits in one.
        Each peer has said so, or not, within the grace in which live ranks mark themselves (``_absent``)."""
        if self.store is None or self.prefix is None:
            return False
        end = time.monotonic() + min(1.0, self.timeout_s / 10)
        while True:
            self._notice(None)  # reads what was posted since
            with self._reading:
                left = [(n["rank"], n.get("after")) for n in self._heard
                        if n["call"] is None and n["rank"] != self.rank]
            if any(a != after for _, a in left):
                return False
            if len({r for r, _ in left}) == self.world_size - 1:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.01)

    def refused(self, operation: str, error: BaseException, call: CallId) -> None:
        """Tell the peers this rank refused ``call``'s inputs before any collective and stays usable: the ranks
        waiting in that call stop (the rank will not come), no other call does; and start the next epoch."""
        self._post(operation, error, call)
        self.epoch = call.epoch + 1

    def _post(self, operation: str, error: BaseException, call: CallId | None, after: int | None = None) -> None:
        if self.store is None or self.prefix is None:
            return
        notice = {"rank": self.rank, "operation": operation, "reason": f"{type(error).__name__}: {error}",
                  "call": None if call is None else [call.epoch, call.phase, call.number], "after": after}
        try:  # appended, never overwritten: a later refusal must not hide a rank that broke
            n = self.store.add(f"{self.prefix}/notices", 1)
            self.store.set(f"{self.prefix}/notice/{n}", json.dumps(notice))
        except Exception:  # the store itself is gone: the peers will time out instead
            pass

    def wait(self, work, operation: str, seq: int | str, call: CallId | None = None,  # type: ignore[no-untyped-def]
             started: bool = False) -> None:
        """Wait for ``work``, collective ``seq`` of ``call`` (None: outside any call, e.g. at creation: then only a
        peer that is done with the dispatcher stops the wait), on the started calls' group if ``started``
        (``_reference/receiver.py``): a peer that makes the same call in the other form waits on the other group,
        and after a second both say so in the store and raise ``CallOrderError`` (instead of a timeout)."""
        if not self.poll:
            work.wait()
            return
        begun = time.monotonic()
        form = None
        try:
            while True:
                try:
                    work.wait(timeout=_SLICE)
                    return
                except RuntimeError:
                    if work.is_completed():  # it finished after the slice ran out, well or in an error
                        try:
                            work.wait()
                            return
                        except RuntimeError as exc:  # a peer closed its connections, or gloo's own timeout
                            raise self._broken(operation, seq, exc, call, time.monotonic() - begun) from exc
                notice = self._notice(call)
                if notice is not None:
                    raise self._peer_failed(notice, operation)
                if call is not None and call.number is not None and time.monotonic() - begun >= _FORM_AFTER_S:
                    form = self._check_form(call, started, form)
                if time.monotonic() >= begun + self.timeout_s:
                    raise self._timed_out(operation, seq, self._absent(f"waiting/{seq}"), self.timeout_s)
        except CommunicationError as exc:  # the collective stays pending here: none of the group's may follow it
            if self.guard is not None:
                self.guard.abandon(operation, exc)
            raise

    def _check_form(self, call: CallId, started: bool, key: str | None) -> str:
        """Count this rank in its form of ``call`` (once per wait: ``key``), and raise ``CallOrderError`` if a peer
        has counted itself in the other form. One store call a slice (two the first time), only in a slow wait."""
        if self.store is None or self.prefix is None:
            return ""
        base = f"{self.prefix}/form/{call.epoch}/{call.phase}/{call.number}"
        mine, other = ("started", "blocking") if started else ("blocking", "started")
        try:
            if key is None:
                self.store.add(f"{base}/{mine}", 1)
            elsewhere = self.store.add(f"{base}/{other}", 0)
        except Exception:
            return base
        if elsewhere:
            raise CallOrderError(
                f"{call.phase} #{call.number} is a {mine} call on rank {self.rank} and a {other} call on "
                f"{elsewhere} other rank(s): every rank makes a given call in the same form, started "
                "(dispatch_start/combine_start) or blocking (docs/engine-guide.md); this dispatcher must be created "
                "again", calls=tuple((self.uid[:15], call.phase, call.number) for _ in range(self.world_size)))
        return base

    def _notice(self, call: CallId | None) -> dict | None:  # type: ignore[type-arg]
        """The first notice of a peer that this wait must not outlast: one that is done with the dispatcher, or one
        that refused ``call`` itself. One store read when nothing is new."""
        if self.store is None or self.prefix is None:
            return None
        with self._reading:
            try:
                posted = self.store.add(f"{self.prefix}/notices", 0)
                while len(self._heard) < posted:
                    key = f"{self.prefix}/notice/{len(self._heard) + 1}"
                    if not self.store.check([key]):  # counted, not yet written: the next slice reads it
                        break
                    self._heard.append(json.loads(self.store.get(key)))
            except Exception:
                pass
            heard = list(self._heard)
        return next((n for n in heard if self._stops(n, call)), None)

    def _stops(self, notice: dict, call: CallId | None) -> bool:  # type: ignore[type-arg]
        if notice["rank"] == self.rank:
            return False
        refused = notice["call"]
        if refused is None:
            return True
        epoch, phase, number = refused
        return call is not None and (epoch, phase) == (call.epoch, call.phase) and number in (None, call.number)

    def _peer_failed(self, notice: dict, operation: str) -> PeerFailedError:  # type: ignore[type-arg]
        return PeerFailedError(
            f"rank {notice['rank']} failed in {notice['operation']} while rank {self.rank} waited in {operation}: "
            f"{notice['reason']}; the process group must be rebuilt",
            rank=int(notice["rank"]), reason=str(notice["reason"]), operation=operation)

    def _timed_out(self, operation: str, seq: int | str, missing: tuple[int, ...], seconds: float,
                   gloo: BaseException | None = None) -> CollectiveTimeoutError:
        """Ranks that did not come in time: alive or dead, which is not known (a death closes its connections)."""
        who = (f"rank(s) {list(missing)} did not arrive in time: alive elsewhere (stalled, or making fewer calls than "
               "this rank: every rank must make the same calls, e.g. the same number of forwards) or dead"
               ) if missing else "the ranks that did not arrive could not be determined"
        whose = "" if gloo is None else f" (the process group's own timeout: {gloo})"
        return CollectiveTimeoutError(
            f"{operation} (collective #{seq}) on rank {self.rank} of {self.world_size} did not complete within "
            f"{seconds:g} s{whose}: {who}; the process group must be rebuilt",
            ranks=missing, operation=operation, timeout_s=seconds)

    def _broken(self, operation: str, seq: int | str, exc: BaseException, call: CallId | None,
                waited_s: float) -> CommunicationError:
        notice = self._notice(call)
        if notice is not None:
            return self._peer_failed(notice, operation)
        gone = self._absent(f"broken/{seq}")
        text = str(exc).lower()
        if "timed out" in text:  # gloo's own deadline came before the Watch's: the absent ranks may be alive
            return self._timed_out(operation, seq, gone, round(waited_s, 1), exc)
        if len(gone) == 1 and any(words in text for words in _CLOSED):
            return PeerFailedError(
                f"rank {gone[0]} left {operation} (collective #{seq}) without a word: its process died or "
                f"destroyed the process group ({exc}); the process group must be rebuilt",
                rank=gone[0], reason="no answer: the process died or left the process group", operation=operation)
        absent = f" (rank(s) {list(gone)} did not come)" if gone else ""
        return CommunicationError(
            f"{operation} failed on rank {self.rank} of {self.world_size}: another rank probably failed, stalled or "
            f"disagreed on the call{absent} ({exc})")

    def _absent(self, tag: str) -> tuple[int, ...]:
        """Ranks that do not leave a marker for ``tag`` within a short grace period."""
        if self.store is None or self.prefix is None:
            return ()
        key = f"{self.prefix}/{tag}"
        try:
            self.store.set(f"{key}/{self.rank}", "1")
            end = time.monotonic() + min(1.0, self.timeout_s / 10)  # the grace period
            while True:
                absent = tuple(r for r in range(self.world_size) if not self.store.check([f"{key}/{r}"]))
                if not absent or time.monotonic() >= end:
                    return absent
                time.sleep(0.05)
        except Exception:
            return ()
