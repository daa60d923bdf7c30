"""Waiting for a collective without hanging when another rank fails, stalls or dies.

On gloo (CPU) a rank waits in short slices. Between slices it looks in the process
group's store for a failure notice that a peer posts when it raises (bad input on that
rank, a bug): the error reaches every rank within a slice instead of after a timeout.
Past ``timeout_s`` the waiting ranks each leave a marker in the store; the ranks without
one are the ones that never arrived, and the error names them. A rank that died closes its
connections: gloo fails the collective at once, and the same markers name the dead rank.

NCCL and HCCL ``wait()`` only orders streams (no host sync, CUDA-graph safe); their own
watchdogs enforce the process group's timeout, so nothing is polled there.

Keys live under ``moe_dispatch/<uid>/``, the uid agreed by all ranks when the dispatcher
was created. After an error the group has a collective that will never finish, so the
process group must be rebuilt (torch.distributed cannot cancel a gloo operation).
"""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist

from ..errors import CollectiveTimeoutError, CommunicationError, InvalidSpecError, PeerFailedError

#: Seconds a rank waits for its peers in one collective before ``CollectiveTimeoutError``.
DEFAULT_TIMEOUT_S = 300.0
_SLICE = datetime.timedelta(milliseconds=50)
_MAX_TIMEOUT_S = 365 * 24 * 3600.0  # beyond a year a deadline is a typo, and timedelta overflows near 1e14 s


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


def _default_store():  # type: ignore[no-untyped-def]
    """The store every rank of the default group shares (private in torch, stable since 1.x)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store: no notices, plain timeouts
        return None


class Watch:
    """Deadline and peer-failure notices for one dispatcher's collectives."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, poll: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll = poll
        self.store = _default_store() if poll else None
        self.prefix: str | None = None
        #: Collectives a vendor's emulator ran under this Watch (``emulation.WatchedComm``), numbered apart from the
        #: dispatcher's own so that the markers naming absent ranks never mix the two.
        self.emulated = 0

    def bind(self, uid: str) -> None:
        """Start posting and reading notices under the dispatcher's agreed ``uid``."""
        self.prefix = f"moe_dispatch/{uid}"

    def announce(self, operation: str, error: BaseException) -> None:
        """Tell the peers this rank failed in ``operation`` (they stop waiting for it)."""
        if self.store is None or self.prefix is None:
            return
        notice = {"rank": self.rank, "operation": operation, "reason": f"{type(error).__name__}: {error}"}
        try:
            self.store.set(f"{self.prefix}/failed", json.dumps(notice))
        except Exception:  # the store itself is gone: the peers will time out instead
            pass

    def wait(self, work, operation: str, seq: int | str) -> None:  # type: ignore[no-untyped-def]
        if not self.poll:
            work.wait()
            return
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                work.wait(timeout=_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # it finished after the slice ran out, well or in an error
                    try:
                        work.wait()
                        return
                    except RuntimeError as exc:  # a peer closed its connections (died, or left)
                        raise self._broken(operation, seq, exc) from exc
            notice = self._notice()
            if notice is not None:
                raise self._peer_failed(notice, operation)
            if time.monotonic() >= deadline:
                missing = self._absent(f"waiting/{seq}")
                who = (f"rank(s) {list(missing)} never arrived (stalled, dead, or making fewer calls than this rank: every "
                       "rank must make the same calls, e.g. the same number of forwards)") if missing else \
                    "the ranks that did not arrive could not be determined"
                raise CollectiveTimeoutError(
                    f"{operation} (collective #{seq}) on rank {self.rank} of {self.world_size} did not complete "
                    f"within {self.timeout_s:g} s: {who}; the process group must be rebuilt",
                    ranks=missing, operation=operation, timeout_s=self.timeout_s,
                )

    def _notice(self) -> dict | None:  # type: ignore[type-arg]
        if self.store is None or self.prefix is None:
            return None
        key = f"{self.prefix}/failed"
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:
            return None

    def _peer_failed(self, notice: dict, operation: str) -> PeerFailedError:  # type: ignore[type-arg]
        return PeerFailedError(
            f"rank {notice['rank']} failed in {notice['operation']} while rank {self.rank} waited in {operation}: "
            f"{notice['reason']}; the process group must be rebuilt",
            rank=int(notice["rank"]), reason=str(notice["reason"]), operation=operation,
        )

    def _broken(self, operation: str, seq: int | str, exc: BaseException) -> CommunicationError:
        notice = self._notice()
        if notice is not None:
            return self._peer_failed(notice, operation)
        gone = self._absent(f"broken/{seq}")
        if len(gone) == 1:
            return PeerFailedError(
                f"rank {gone[0]} left {operation} (collective #{seq}) without a word: its process died or "
                f"destroyed the process group ({exc}); the process group must be rebuilt",
                rank=gone[0], reason="no answer: the process died or left the process group", operation=operation,
            )
        return CommunicationError(
            f"{operation} failed on rank {self.rank} of {self.world_size}: another rank probably failed, stalled or "
            f"disagreed on the call ({exc})"
        )

    def _absent(self, tag: str) -> tuple[int, ...]:
        """Ranks that do not leave a marker for ``tag`` within a short grace period."""
        if self.store is None or self.prefix is None:
            return ()
        key = f"{self.prefix}/{tag}"
        try:
            self.store.set(f"{key}/{self.rank}", "1")
            grace = min(1.0, self.timeout_s / 10)
            end = time.monotonic() + grace
            while True:
                absent = tuple(r for r in range(self.world_size) if not self.store.check([f"{key}/{r}"]))
                if not absent or time.monotonic() >= end:
                    return absent
                time.sleep(0.05)
        except Exception:
            return ()


__all__ = ["DEFAULT_TIMEOUT_S", "Watch", "check_timeout"]
