"""A rank that disagrees, fails, stalls or dies: every other rank gets a typed error, fast.

Each test runs on its own pool of real gloo processes (a failure leaves a collective that
never completes in the process group, so a pool is not reused after one). The stall and
kill tests check the error arrives within the timeout, naming the rank.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.routing import random_routing
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch_testing.local import RankPool
from moe_dispatch_testing import outcome

SPEC = dict(hidden_size=128, num_experts=12, top_k=2, num_max_dispatch_tokens_per_rank=16)
TIMEOUT_S = 2.0


def _inputs(rank: int, tokens: int = 8):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, 128, generator=g).to(torch.bfloat16)
    ids, w = random_routing(tokens, 12, 2, generator=g)
    return x, ids, w




def _mismatched_capacity(rank: int, world: int):
    spec = md.DispatchSpec(**{**SPEC, "num_max_dispatch_tokens_per_rank": 16 if rank != 1 else 32})
    return outcome(lambda: md.create_dispatcher("torch", spec, env={}, timeout_s=TIMEOUT_S))


def test_ranks_that_disagree_on_the_spec_all_raise_naming_the_field():
    with RankPool(3) as pool:
        outcomes = pool.map(_mismatched_capacity)
    for name, attrs, seconds, message in outcomes:
        assert name == "ConfigMismatchError"
        assert attrs["parameter"] == "num_max_dispatch_tokens_per_rank" and attrs["value"] == [16, 32, 16]
        assert "rank 1: 32" in message
        assert seconds < TIMEOUT_S  # found at creation, not by a timeout


@dataclasses.dataclass(frozen=True)
class _SpecWithANewField(md.DispatchSpec):
    """What adding a field to ``DispatchSpec`` looks like to the agreement: nothing lists it there."""

    route_salt: int = 0


def _mismatched_new_field(rank: int, world: int, quant: bool):
    spec = (md.DispatchSpec(**SPEC, output_dtype="fp8", quant=md.QuantHints(fp8_ue8m0_scales=rank == 1)) if quant
            else _SpecWithANewField(**SPEC, route_salt=rank))
    return outcome(lambda: md.create_dispatcher("torch", spec, env={}, timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("quant, field, values", [(False, "route_salt", [0, 1]),
                                                  (True, "quant.fp8_ue8m0_scales", [False, True])])
def test_every_field_of_the_spec_is_compared_by_construction(quant, field, values):
    with RankPool(2) as pool:
        outcomes = pool.map(_mismatched_new_field, quant)
    for name, attrs, seconds, message in outcomes:
        assert name == "ConfigMismatchError", message
        assert attrs["parameter"] == field and attrs["value"] == values


class _OptionsDecideTheConstructor(TorchBackend):
    """A backend whose ``create`` would run a collective sized by an option (DeepEP's Buffer)."""

    def agreement(self, ctx):  # type: ignore[no-untyped-def]
        return {"buffer_bytes": ctx.options.get("buffer_bytes")}


def _mismatched_option(rank: int, world: int):
    return outcome(lambda: md.create_dispatcher(_OptionsDecideTheConstructor(), md.DispatchSpec(**SPEC), env={},
                                                 options={"buffer_bytes": 1024 * (2 if rank == 1 else 1)},
                                                 timeout_s=TIMEOUT_S))


def test_ranks_that_disagree_on_what_the_backend_agrees_on_all_raise_before_create():
    with RankPool(2) as pool:
        outcomes = pool.map(_mismatched_option)
    for name, attrs, seconds, message in outcomes:
        assert name == "ConfigMismatchError"
        assert attrs["parameter"] == "torch: buffer_bytes" and attrs["value"] == [1024, 2048]
        assert seconds < TIMEOUT_S


class _FailsOnRank1(TorchBackend):
    """A plugin whose local creation code (``method``) raises an untyped error on rank 1 only
    (a vendor JIT build, a bug)."""

    def __init__(self, method: str) -> None:
        self.method = method

    def _maybe_fail(self, method: str) -> None:
        import torch.distributed as dist

        if method == self.method and dist.get_rank() == 1:
            raise RuntimeError("Ninja build failed")

    def buffer_size(self, spec, world_size):  # type: ignore[no-untyped-def]
        self._maybe_fail("buffer_size")
        return super().buffer_size(spec, world_size)

    def check_spec(self, spec, world_size):  # type: ignore[no-untyped-def]
        self._maybe_fail("check_spec")
        return super().check_spec(spec, world_size)

    def validate_dtype(self, dtype, spec):  # type: ignore[no-untyped-def]
        self._maybe_fail("validate_dtype")
        return super().validate_dtype(dtype, spec)

    def agreement(self, ctx):  # type: ignore[no-untyped-def]
        self._maybe_fail("agreement")
        return super().agreement(ctx)


def _untyped_failure_while_planning(rank: int, world: int, method: str):
    return outcome(lambda: md.create_dispatcher(_FailsOnRank1(method), md.DispatchSpec(**SPEC), env={},
                                                 timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("method", ["buffer_size", "check_spec", "validate_dtype", "agreement"])
def test_an_untyped_error_while_planning_is_typed_and_reaches_the_peers(method):
    with RankPool(2) as pool:
        (name0, attrs0, seconds0, _), (name1, attrs1, _, message1) = pool.map(_untyped_failure_while_planning, method)
    assert name1 == "BackendUnavailableError" and attrs1["parameter"] == "backend" and "Ninja build failed" in message1
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1 and seconds0 < TIMEOUT_S


def _one_rank_cannot_create(rank: int, world: int):
    backend = "no-such-backend" if rank == 2 else "torch"
    return outcome(lambda: md.create_dispatcher(backend, md.DispatchSpec(**SPEC), env={}, timeout_s=TIMEOUT_S))


def test_a_rank_that_cannot_create_the_dispatcher_is_named_on_the_others():
    with RankPool(3) as pool:
        outcomes = pool.map(_one_rank_cannot_create)
    assert outcomes[2][0] == "BackendUnavailableError" and outcomes[2][1]["parameter"] == "backend"
    for name, attrs, seconds, message in outcomes[:2]:
        assert name == "PeerFailedError" and attrs["rank"] == 2 and "no-such-backend" in message
        assert seconds < TIMEOUT_S


def _bad_input_on_rank_1(rank: int, world: int):
    d = md.create_dispatcher("torch", md.DispatchSpec(**SPEC), env={}, timeout_s=30.0)
    x, ids, w = _inputs(rank)
    if rank == 1:
        ids = ids.clone()
        ids[0, 0] = 99  # out of range
    return outcome(lambda: d.dispatch(x, ids, w))


def test_bad_input_on_one_rank_stops_the_others_without_waiting_for_the_timeout():
    """Rank 1 raises before its first collective; the others, already waiting in the
    dispatch, get PeerFailedError naming rank 1 and its error in well under the 30 s timeout."""
    with RankPool(3) as pool:
        outcomes = pool.map(_bad_input_on_rank_1)
    assert outcomes[1][0] == "InvalidInputError" and outcomes[1][1]["parameter"] == "topk_ids"
    for name, attrs, seconds, message in (outcomes[0], outcomes[2]):
        assert name == "PeerFailedError" and attrs["rank"] == 1
        assert "expert id out of range" in message
        assert seconds < 5.0


def _rank_2_never_combines(rank: int, world: int):
    d = md.create_dispatcher("torch", md.DispatchSpec(**SPEC), env={}, timeout_s=TIMEOUT_S)
    out = d.dispatch(*_inputs(rank))
    if rank == 2:
        time.sleep(TIMEOUT_S + 1)  # stalls: never calls combine (returning would not make it combine either)
        return None, {}, 0.0, ""
    y = torch.ones(out.hidden_states.shape, dtype=torch.bfloat16)
    return outcome(lambda: d.combine(y, out))


def test_a_rank_that_never_calls_combine_is_named_after_the_timeout():
    with RankPool(3) as pool:
        outcomes = pool.map(_rank_2_never_combines)
    for name, attrs, seconds, message in outcomes[:2]:
        assert name == "CollectiveTimeoutError", message
        assert attrs["ranks"] == (2,) and attrs["operation"] == "all_to_all"
        assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5


def _wait_to_be_killed(rank: int, world: int, ready_path: str):
    d = md.create_dispatcher("torch", md.DispatchSpec(**SPEC), env={}, timeout_s=60.0)
    out = d.dispatch(*_inputs(rank))
    if rank == 2:
        open(ready_path, "w").close()
        time.sleep(60)  # killed by the test while the others wait in combine
    y = torch.ones(out.hidden_states.shape, dtype=torch.bfloat16)
    return outcome(lambda: d.combine(y, out))


def _kill_when_ready(pid: int, ready_path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(ready_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the others are in combine by now
    os.kill(pid, signal.SIGKILL)


def test_a_rank_killed_during_the_exchange_is_named_on_the_others(tmp_path):
    """SIGKILL a real rank process while the others wait for it in combine (timeout 60 s):
    they get PeerFailedError naming it within seconds."""
    ready = str(tmp_path / "rank2-waiting")
    pool = RankPool(3)
    try:
        killer = threading.Thread(target=_kill_when_ready, args=(pool.pids[2], ready))
        killer.start()
        outcomes = pool.try_map(_wait_to_be_killed, ready, timeout_s=50)
        killer.join()
    finally:
        pool.close(force=True)
    assert not outcomes[2].ok  # the victim died
    for outcome in outcomes[:2]:
        name, attrs, seconds, message = outcome.value
        assert name == "PeerFailedError", message
        assert attrs["rank"] == 2
        assert seconds < 10.0  # the timeout is 60 s: the death was noticed, not waited out


class _SliceWork:
    """A collective as ``torch.distributed.Work`` behaves: ``wait(timeout)`` raises
    "Operation timed out!" while pending; ``wait()`` returns True once done, or raises the
    collective's own error. This one finishes just after its first slice runs out."""

    def __init__(self, error: str | None) -> None:
        self.error = error
        self.done = False

    def wait(self, timeout=None):  # type: ignore[no-untyped-def]
        if not self.done:
            self.done = True  # completes right after the slice expired: the race
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.done


def test_a_collective_that_finishes_just_after_a_wait_slice_is_a_success_not_an_error():
    from moe_dispatch._distributed.watch import Watch

    watch = Watch(rank=0, world_size=2, timeout_s=5.0, poll=True)
    watch.wait(_SliceWork(None), "all_to_all", 1)  # returns: the collective succeeded
    with pytest.raises(md.CommunicationError, match="Connection closed by peer"):
        watch.wait(_SliceWork("Connection closed by peer"), "all_to_all", 2)


def test_a_function_the_spawned_ranks_cannot_import_is_refused_before_they_start():
    """``python -c`` or a notebook: the ranks would only exit with status 1."""
    import subprocess
    import sys

    code = ("from moe_dispatch_testing.local import run_local\n"
            "def job(rank, world):\n    return rank\n"
            "run_local(job, 2)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "InvalidSpecError" in done.stderr and "fn='job'" in done.stderr, done.stderr[-2000:]


def _environment_seen(rank: int, world: int) -> tuple[str | None, str | None]:
    return os.environ.get("MOE_DISPATCH_TEST_MARK"), os.environ.get("GLOO_SOCKET_IFNAME")


def test_the_ranks_take_the_environment_of_the_process_that_made_the_pool(monkeypatch):
    """The ranks are forked from a fork server started with the first pool, whose environment dates from then: each
    rank takes the pool maker's environment at the pool's creation, as a spawned process would, and gloo stays on
    the loopback interface."""
    from moe_dispatch_testing import on_a_fresh_pool

    on_a_fresh_pool(_environment_seen)  # the fork server exists before the variable does
    monkeypatch.setenv("MOE_DISPATCH_TEST_MARK", "set after the server started")
    assert on_a_fresh_pool(_environment_seen) == [("set after the server started", "lo")] * 2


# -- a call that breaks off between its collectives ------------------------------------------------------------------


def _breaks_off_after_the_call_check(rank: int, world: int, ranks_that_break: tuple[int, ...]):
    """``broken``'s dispatch raises on ``ranks_that_break`` after its first collective (the call check with the
    counts), before the payload's; then ``other``, a dispatcher of the same group, makes the group's next call."""
    from moe_dispatch_testing.outcomes import Outcome

    broken, other = (md.create_dispatcher("torch", md.DispatchSpec(**SPEC), env={}, timeout_s=TIMEOUT_S)
                     for _ in range(2))
    if rank in ranks_that_break:
        comm, started = broken.backend_dispatcher.comm, []
        real = comm.all_to_all_start

        def second_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
            started.append(1)
            if len(started) == 2:
                raise RuntimeError("bug between the collectives")
            return real(*args, **kwargs)

        comm.all_to_all_start = second_fails
    x, ids, w = _inputs(rank)
    try:
        first = outcome(lambda: broken.dispatch(x, ids, w))
    except RuntimeError as exc:
        first = Outcome(type(exc).__name__, {}, 0.0, str(exc))
    return first.error, outcome(lambda: other.dispatch(x, ids, w)).error


def test_a_rank_that_breaks_off_between_a_calls_collectives_starts_no_other_on_the_group():
    """Rank 1 leaves a dispatch after its call check; rank 0, waiting in the payload's collective, hears of it and
    stops. Before, rank 1's next call on the group (another dispatcher's) paired its 32-byte call check with the
    payload rank 0 had sent: gloo aborted rank 1. Now neither rank starts another collective on the group."""
    from moe_dispatch_testing import on_a_fresh_pool

    outcomes = on_a_fresh_pool(_breaks_off_after_the_call_check, (1,))
    assert outcomes == [("PeerFailedError", "CommunicationError"), ("RuntimeError", "CommunicationError")], outcomes


def test_ranks_that_all_break_off_at_the_same_point_keep_the_group():
    """Every rank fails after the same collectives (as a vendor's check on sizes the ranks gathered does): nothing
    is left unfinished, so the group's other dispatchers go on."""
    with RankPool(2) as pool:
        assert pool.map(_breaks_off_after_the_call_check, (0, 1)) == [("RuntimeError", None)] * 2
