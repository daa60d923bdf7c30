"""Creation fails like a call does: a rank whose backend raises in ``create``, or that is killed there, is named on
every peer at once; every argument of ``create_dispatcher`` of the wrong kind is a typed error its peers hear of;
and a peer that is alive but elsewhere is not said to have died.

The failure tests run on pools of their own (a failure leaves the group with a collective that never completes).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import moe_dispatch as md
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch_testing import outcome
from moe_dispatch_testing.local import RankPool

SPEC = md.DispatchSpec(128, 12, 2, num_max_dispatch_tokens_per_rank=16)
TIMEOUT_S = 2.0


class _FailsInCreate(TorchBackend):
    """The torch backend, whose ``create`` on rank 1 raises (``ready`` None) or, to be killed there, says it is in
    ``create`` through the file ``ready`` and sleeps."""

    def __init__(self, ready: str | None = None) -> None:
        self.ready = ready

    def create(self, ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 1 and self.ready is None:
            raise RuntimeError("vendor constructor failed")
        if ctx.rank == 1:
            open(self.ready, "w").close()
            time.sleep(60)
        return super().create(ctx)


def _create_and_say_when(rank: int, world: int, ready: str | None, timeout_s: float):
    """How creation ended on this rank, and when (the wall clock: the ranks share the machine's)."""
    ended = outcome(lambda: md.create_dispatcher(_FailsInCreate(ready), SPEC, env={}, timeout_s=timeout_s))
    return ended, time.time()


def test_an_exception_in_one_ranks_create_is_named_on_every_peer_at_once():
    """Before, the peers waited in ``dist.new_group`` (the started calls' gloo group, made in the reference backend's
    create), which never looks at the failure notices: about 5 s (twice the timeout) later they raised
    CommunicationError, blaming no rank."""
    with RankPool(3) as pool:
        outcomes = pool.map(_create_and_say_when, None, TIMEOUT_S)
    (name1, _, _, message1), failed_at = outcomes[1]
    assert name1 == "BackendUnavailableError" and "vendor constructor failed" in message1
    for (name, attrs, _, message), at in (outcomes[0], outcomes[2]):
        assert name == "PeerFailedError" and attrs["rank"] == 1 and "vendor constructor failed" in message, message
        assert at - failed_at < TIMEOUT_S  # heard from the notice, not from a timeout


def _kill_when_in_create(pid: int, ready: str, killed_at: list[float]) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # the peers wait in their create by now
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.time())


def test_a_rank_killed_in_create_is_named_on_every_peer_within_the_grace(tmp_path):
    """SIGKILL rank 1 inside its create: its closed connections fail the peers' wait, and they name it after the
    grace in which a live rank would have said it is there (min(1 s, timeout_s / 10)). Before, they waited in
    ``dist.new_group`` for twice the timeout."""
    timeout_s = 5.0
    ready = str(tmp_path / "rank1-in-create")
    pool = RankPool(3)
    killed_at: list[float] = []
    try:
        killer = threading.Thread(target=_kill_when_in_create, args=(pool.pids[1], ready, killed_at))
        killer.start()
        outcomes = pool.try_map(_create_and_say_when, ready, timeout_s, timeout_s=1.5 * timeout_s)
        killer.join()
    finally:
        pool.close(force=True)
    assert not outcomes[1].ok  # the victim died
    for o in (outcomes[0], outcomes[2]):
        (name, attrs, _, message), at = o.value
        assert name == "PeerFailedError" and attrs["rank"] == 1, message
        assert "died" in message
        assert at - killed_at[0] < timeout_s / 2


# -- arguments of the wrong kind -------------------------------------------------------------------------------------

BAD_ARGUMENTS = [("backend", 3), ("backend", None), ("group", "world"), ("strict", "yes"), ("strict", None),
                 ("check_inputs", 1), ("check_inputs", "no"), ("host", "default"), ("env", ["X=1"]),
                 ("options", 3), ("timeout_s", "30"), ("in_flight", 2.0)]


@pytest.mark.parametrize("name, value", BAD_ARGUMENTS)
def test_every_argument_of_create_dispatcher_is_checked_for_kind(name, value):
    """Before, a wrong ``backend``, ``host`` or ``group`` reached Python's own errors (AttributeError) and a truthy
    ``strict`` or ``check_inputs`` was taken as True."""
    arguments = {"backend": "torch", "spec": SPEC, "env": {}, name: value}
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher(**arguments)
    assert info.value.parameter == name and info.value.value == value


def _bad_argument_on_rank_1(rank: int, world: int) -> list[tuple[str | None, object]]:
    ended = []
    for name, value in (("strict", "yes"), ("check_inputs", 1), ("host", "default"), ("backend", 3)):
        arguments = {"backend": "torch", "spec": SPEC, "env": {}, "timeout_s": 20.0, **({name: value} if rank else {})}
        got = outcome(lambda arguments=arguments: md.create_dispatcher(**arguments))
        ended.append((got.error, got.attrs.get("rank", got.attrs.get("parameter"))))
    return ended


def test_an_argument_of_the_wrong_kind_on_one_rank_is_heard_by_its_peer(moe_rank_pools):
    """The kind checks run inside the agreement: the peer raises PeerFailedError naming the rank, not a timeout."""
    names = ["strict", "check_inputs", "host", "backend"]
    assert moe_rank_pools.get(2).map(_bad_argument_on_rank_1) == [[("PeerFailedError", 1)] * 4,
                                                                   [("InvalidSpecError", n) for n in names]]


# -- a peer that is alive elsewhere ----------------------------------------------------------------------------------


def _one_more_round_trip_on_rank_0(rank: int, world: int):
    d = md.create_dispatcher("torch", md.DispatchSpec(128, 12, 2, num_max_dispatch_tokens_per_rank=16,
                                                      output_dtype="bf16"), env={}, timeout_s=30.0)
    x, ids = torch.randn(4, 128).to(torch.bfloat16), torch.tensor([[0, 7], [1, 6], [2, 11], [3, 4]])
    w = torch.full((4, 2), 0.5)

    def round_trips() -> None:
        for _ in range(2 if rank == 0 else 1):  # rank 1 then returns, alive and idle in the pool
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)

    return outcome(round_trips)


def test_a_peer_that_makes_fewer_calls_is_not_said_to_have_died():
    """Gloo's own timeout (the process group's, 2 s here) ends the wait before the dispatcher's 30 s: rank 1 is
    alive and idle. Before, rank 0 raised PeerFailedError saying rank 1's process died."""
    with RankPool(2, timeout_s=TIMEOUT_S) as pool:
        (name, attrs, seconds, message), idle = pool.map(_one_more_round_trip_on_rank_0)
    assert idle.error is None
    assert name == "CollectiveTimeoutError" and attrs["ranks"] == (1,), message
    assert "did not arrive in time" in message and "died" not in message
    assert seconds < 30.0 / 2
