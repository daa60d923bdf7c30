"""A refused call on gloo: what its peers and its own later calls see (docs/reliability.md, "A rank that fails,
stalls or dies").

A refusal (inputs refused before any collective) stops only the peers waiting in that very call, so:
ranks that all refused a call go on, each in its own time; a call already in flight completes; and a call
one rank alone refused and makes again never pairs silently with its peers' (a typed error on every rank).
A call made blocking on one rank and started on the other is a ``CallOrderError`` within a second, not a
timeout. Ranks are never in lock-step here: the late rank sleeps past the Watch's 50 ms slices.
"""

from __future__ import annotations

import time

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.routing import random_routing
from moe_dispatch_testing import on_a_fresh_pool, outcome

CAPACITY = 16
SPEC = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=CAPACITY, output_dtype="bf16")
LATE_S = 0.3  # six slices of the Watch


def _inputs(rank: int, tokens: int = 8):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, 128, generator=g).to(torch.bfloat16)
    ids, w = random_routing(tokens, 8, 2, generator=g)
    return x, ids, w


def _rows(out: md.DispatchOutput) -> torch.Tensor:
    """The experts' stand-in: twice each BF16 row."""
    return out.hidden_states.float().mul(2).to(torch.bfloat16)


def _round_trip(d: md.Dispatcher, x, ids, w, started: bool) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = d.dispatch_start(x, ids, w).wait() if started else d.dispatch(x, ids, w)
    rows = _rows(out)
    return d.combine_start(rows, out).wait() if started else d.combine(rows, out)


def _every_rank_refuses_then_goes_on(rank: int, world: int, started: bool) -> bool:
    d = md.create_dispatcher("torch", SPEC, env={}, timeout_s=20)
    x, ids, w = _inputs(rank, CAPACITY + 1)
    refused = outcome(lambda: d.dispatch_start(x, ids, w) if started else d.dispatch(x, ids, w))
    assert refused.error == "CapacityError", refused
    if rank == 1:
        time.sleep(LATE_S)  # rank 0 already waits in the call it made again
    got = _round_trip(d, x[:CAPACITY], ids[:CAPACITY], w[:CAPACITY], started)
    again = md.create_dispatcher("torch", SPEC, env={}, timeout_s=20)  # a dispatcher that never refused anything
    return bool(torch.equal(got, _round_trip(again, x[:CAPACITY], ids[:CAPACITY], w[:CAPACITY], started)))


@pytest.mark.parametrize("started", [False, True], ids=["blocking", "started"])
def test_ranks_that_all_refused_a_call_go_on_whenever_each_arrives(moe_rank_pools, started):
    """Both ranks refuse a batch over the capacity and fix it; rank 1 comes 0.3 s later. Before, rank 0's fixed
    call read rank 1's notice of the refused one and raised PeerFailedError (and broke the dispatcher)."""
    assert moe_rank_pools.get(2).map(_every_rank_refuses_then_goes_on, started) == [True, True]


def _refusal_while_a_call_is_in_flight(rank: int, world: int) -> bool:
    d = md.create_dispatcher("torch", SPEC, env={}, timeout_s=20)
    x, ids, w = _inputs(rank)
    if rank == 1:
        time.sleep(LATE_S)  # rank 0's first call waits for this rank while rank 0 refuses its second
    first = d.dispatch_start(x, ids, w)
    bad = ids.clone()
    bad[0, 0] = SPEC.num_experts
    refused = outcome(lambda: d.dispatch_start(x, bad, w))  # every rank refuses call #2
    assert refused.error == "InvalidInputError", refused
    out = first.wait()
    got = d.combine(_rows(out), out)
    alone = md.create_dispatcher("torch", SPEC, env={}, timeout_s=20)
    return bool(torch.equal(got, _round_trip(alone, x, ids, w, started=False)))


def test_a_refusal_does_not_stop_a_call_already_in_flight(moe_rank_pools):
    """Rank 0 starts call #1, then refuses #2 while #1 still waits for rank 1: the notice names #2, so #1
    completes (before, the notice named no call, and #1 raised PeerFailedError on rank 0 itself)."""
    assert moe_rank_pools.get(2).map(_refusal_while_a_call_is_in_flight) == [True, True]


def _one_rank_refuses_and_makes_the_call_again(rank: int, world: int, retry_after_s: float):
    d = md.create_dispatcher("torch", SPEC, env={}, timeout_s=20)
    x, ids, w = _inputs(rank)
    if rank == 0:
        refused = outcome(lambda: d.dispatch(x.float(), ids, w))  # refused on rank 0 only
        assert refused.error == "InvalidInputError", refused
        time.sleep(retry_after_s)
    return outcome(lambda: _round_trip(d, x, ids, w, started=False))


@pytest.mark.parametrize("retry_after_s", [0.0, LATE_S])
def test_a_call_refused_on_one_rank_only_and_made_again_is_a_typed_error_on_every_rank(retry_after_s):
    """Before, the outcome was a race: made again at once, rank 0's call silently paired with rank 1's (the
    refused call took no number); later, rank 0 raised PeerFailedError naming itself. Now the call made again is
    another attempt (the epoch in the call check): CallOrderError, or PeerFailedError where the refusal's notice
    came first, on every rank, well before the timeout."""
    outcomes = on_a_fresh_pool(_one_rank_refuses_and_makes_the_call_again, retry_after_s)
    for rank, (name, attrs, seconds, message) in enumerate(outcomes):
        assert name in ("CallOrderError", "PeerFailedError"), (rank, name, message)
        assert seconds < 10, (rank, seconds)
        if name == "PeerFailedError":
            assert attrs["rank"] != rank, message  # never its own notice
    assert "CallOrderError" in {o[0] for o in outcomes}  # rank 0's call made again never passes the check


def _blocking_here_started_there(rank: int, world: int):
    d = md.create_dispatcher("torch", SPEC, env={}, timeout_s=30)
    x, ids, w = _inputs(rank)
    return outcome(lambda: d.dispatch_start(x, ids, w).wait() if rank == 0 else d.dispatch(x, ids, w))


def test_a_call_started_on_one_rank_and_blocking_on_the_other_is_a_call_order_error_at_once():
    """The two forms run on two gloo groups (reference/receiver.py), so the call check could not see the
    difference: both ranks waited the whole timeout and blamed each other for never arriving."""
    outcomes = on_a_fresh_pool(_blocking_here_started_there)
    names = [o[0] for o in outcomes]
    assert "CallOrderError" in names and set(names) <= {"CallOrderError", "PeerFailedError"}, outcomes
    assert all(o[2] < 5 for o in outcomes), outcomes
    assert "same form" in next(o[3] for o in outcomes if o[0] == "CallOrderError")


def test_a_pending_handed_over_for_its_output_is_told_to_wait_first():
    """A started dispatch's ``Pending`` given to combine or to the experts: a typed error that says what to do
    (the experts raised AttributeError: 'Pending' object has no attribute 'expert_alignment')."""
    d = md.create_dispatcher("torch", SPEC, env={})
    x, ids, w = _inputs(0)
    started = d.dispatch_start(x, ids, w)
    for call, parameter in ((lambda: d.combine(torch.zeros(8, 128, dtype=torch.bfloat16), started), "dispatch_output"),
                            (lambda: md.run_experts(md.TorchExperts(), None, started), "out")):
        with pytest.raises(md.InvalidInputError, match=r"call \.wait\(\) first") as info:
            call()
        assert info.value.parameter == parameter
    out = started.wait()
    assert d.combine(out.hidden_states, out).shape == (8, 128)  # still usable (BF16 rows: identity experts)


def test_a_refused_tensor_crosses_processes_as_its_description():
    """An error names the refused tensor in ``value``; pickled (a rank's error reported to the test or the engine's
    launcher) it carried the whole tensor. Now the description travels, the other attributes as they were."""
    import pickle

    x = torch.zeros(4096, 128, dtype=torch.float32)
    error = md.InvalidInputError("wrong dtype", parameter="hidden_states", value=x, allowed="torch.bfloat16")
    assert error.value is x  # in the process that raised it, the tensor itself
    data = pickle.dumps(error)
    assert len(data) < 2000  # the tensor's 2 MB are not in it
    back = pickle.loads(data)
    assert type(back) is md.InvalidInputError and str(back) == str(error)
    assert (back.parameter, back.allowed) == ("hidden_states", "torch.bfloat16")
    assert back.value == "Tensor(shape=(4096, 128), dtype=torch.float32, device=cpu)"
