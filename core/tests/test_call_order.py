"""Ranks that make their calls in different orders: every rank gets
``CallOrderError`` naming each rank's call, before any data moves, instead of wrong results,
NaN rows, or a process killed by gloo's ``std::terminate`` on mismatched sizes.

Before the call check, each of these returned wrong data silently or aborted the process. Each
test runs on its own pool: after the error the dispatchers are unusable by design.
"""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.local import RankPool
from moe_dispatch_testing.routing import random_routing

H, E, K, CAP = 128, 8, 2, 16


def _spec(mode: str = "normal", dtype: str = "bf16") -> md.DispatchSpec:
    return md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=CAP, mode=mode, output_dtype=dtype)


def _inputs(rank: int, tokens: int = 6):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(tokens, E, K, generator=g)
    return x, ids, w


def _round_trip(d: md.Dispatcher, x, ids, w) -> torch.Tensor:
    out = d.dispatch(x, ids, w)
    return d.combine(_identity_rows(out), out)


def _identity_rows(out: md.DispatchOutput) -> torch.Tensor:
    rows = out.hidden_states
    return torch.ones(*rows.shape[:-1], H, dtype=torch.bfloat16)


def _caught(call):  # type: ignore[no-untyped-def]
    try:
        call()
    except md.MoEDispatchError as exc:
        return type(exc).__name__, getattr(exc, "calls", None), str(exc)
    return None, None, ""


def _swapped_dispatchers(rank: int, world: int, p: dict):
    d1 = md.create_dispatcher("torch", _spec(p["mode"], p["first"]), env={}, timeout_s=20)
    d2 = md.create_dispatcher("torch", _spec(p["mode"], p["second"]), env={}, timeout_s=20)
    order = (d1, d2) if rank == 0 else (d2, d1)
    x, ids, w = _inputs(rank)
    first = _caught(lambda: _round_trip(order[0], x, ids, w))
    retry = _caught(lambda: order[0].dispatch(x, ids, w))
    return first, retry, order[0].traffic.payload_bytes, (d1.uid, d2.uid)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("first, second", [("bf16", "bf16"), ("bf16", "fp8")])
def test_two_dispatchers_called_in_another_order_on_one_rank(mode, first, second):
    # (bf16, bf16): same sizes, wrong data before; (bf16, fp8): different sizes, SIGABRT before.
    with RankPool(2) as pool:
        results = pool.map(_swapped_dispatchers, {"mode": mode, "first": first, "second": second})
    uids = results[0][3]
    for rank, (first_call, retry, payload, _) in enumerate(results):
        name, calls, message = first_call
        assert name == "CallOrderError", (rank, first_call)
        assert [c[0] for c in calls] == [uids[0][:15], uids[1][:15]]  # each rank's dispatcher, in rank order
        assert [c[1:] for c in calls] == [("dispatch", 1), ("dispatch", 1)]
        assert "rank 0: dispatcher" in message and "rank 1: dispatcher" in message
        assert payload == 0  # nothing moved
        assert retry[0] == "CommunicationError" and "created again" in retry[2]


def _dispatch_twice_before_combine(rank: int, world: int, mode: str):
    d = md.create_dispatcher("torch", _spec(mode), env={}, timeout_s=20)
    x, ids, w = _inputs(rank)
    out = d.dispatch(x, ids, w)
    if rank == 0:
        return _caught(lambda: d.dispatch(x, ids, w))
    return _caught(lambda: d.combine(_identity_rows(out), out))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_one_rank_dispatching_twice_while_the_peer_combines(mode):
    with RankPool(2) as pool:
        results = pool.map(_dispatch_twice_before_combine, mode)
    for name, calls, _ in results:
        assert name == "CallOrderError"
        assert [c[1:] for c in calls] == [("dispatch", 2), ("combine", 1)]


def _combines_swapped(rank: int, world: int):
    d = md.create_dispatcher("torch", _spec(), env={}, timeout_s=20)
    x, ids, w = _inputs(rank)
    outs = [d.dispatch(x, ids, w), d.dispatch(x[:3], ids[:3], w[:3])]
    order = outs if rank == 0 else outs[::-1]
    return _caught(lambda: d.combine(_identity_rows(order[0]), order[0]))


def test_two_outputs_combined_in_another_order_on_one_rank():
    with RankPool(2) as pool:
        results = pool.map(_combines_swapped)
    for name, calls, _ in results:
        assert name == "CallOrderError"
        assert [c[1:] for c in calls] == [("combine", 1), ("combine", 2)]


def _in_order(rank: int, world: int):
    d1 = md.create_dispatcher("torch", _spec(), env={}, timeout_s=20)
    d2 = md.create_dispatcher("torch", _spec("low_latency", "fp8"), env={}, timeout_s=20)
    x, ids, w = _inputs(rank)
    outs = [d1.dispatch(x, ids, w), d2.dispatch(x, ids, w), d1.dispatch(x[:2], ids[:2], w[:2])]
    ys = [d.combine(_identity_rows(o), o) for d, o in zip((d1, d2, d1), outs)]
    return [y.float().sum().item() for y in ys]


def test_the_same_order_everywhere_with_several_in_flight_still_works():
    with RankPool(2) as pool:
        sums = pool.map(_in_order)
    assert all(len(s) == 3 for s in sums)


def _peer_fails_then_retry(rank: int, world: int):
    d = md.create_dispatcher("torch", _spec(), env={}, timeout_s=20)
    x, ids, w = _inputs(rank)
    if rank == 1:
        ids = ids.clone()
        ids[0, 0] = E  # out of range: refused before any collective, announced to rank 0
    first = _caught(lambda: d.dispatch(x, ids, w))
    before = d.traffic.collectives
    retry = _caught(lambda: d.dispatch(x, ids, w)) if rank == 0 else (None, None, "")
    return first[0], retry[0], retry[2], d.traffic.collectives - before


def test_retrying_after_a_peer_failure_is_a_typed_error_not_an_abort():
    with RankPool(2) as pool:
        (first0, retry0, message0, entered0), (first1, *_rest) = pool.map(_peer_fails_then_retry)
    assert first1 == "InvalidInputError" and first0 == "PeerFailedError"
    assert retry0 == "CommunicationError" and "rebuilt" in message0
    assert entered0 == 0  # refused before any collective
