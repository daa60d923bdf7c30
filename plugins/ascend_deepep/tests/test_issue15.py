"""Issue 15 (an adversarial trial of the library), on DeepEP-Ascend's fakes:

- class 6: combine uses the routing given to its dispatch. An engine that reuses its router output buffers
  overwrites ``topk_ids``/``topk_weights`` after dispatch returns; the adapter handed the caller's tensors to
  the vendor, whose normal-mode handle keeps them (``combine`` weights by the handle's ``topk_weights``) and whose
  low-latency combine takes them again.
- class 7: the fake's collectives honour the dispatcher's ``timeout_s`` and its peers' failure notices.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.routing import random_routing
from moe_dispatch_testing import ScaledLayer, combine_unless_stalled, dispatch_with_a_bad_id, on_a_fresh_pool, routing_reuse
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.vendor import EMULATOR, EMULATOR_ENV_ONLY

H, TOKENS, TOP_K, PER_RANK = 1024, 8, 2, 4


def _dispatcher(vendor: str, world: int, mode: str, dtype: str, timeout_s: float = 300.0) -> md.Dispatcher:
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, mode=mode,
                           output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(AscendDeepEPBackend(vendor), spec, env={}, timeout_s=timeout_s)


def _inputs(rank: int, num_experts: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g, drop_prob=0.1)
    other_ids, _ = random_routing(TOKENS, num_experts, TOP_K, generator=g)
    return x, ids, w, other_ids


# -- class 6 -------------------------------------------------------------------------------------------------------


def _combine_after_the_router_buffers_change(rank: int, world: int, vendor: str, mode: str, dtype: str):
    d = _dispatcher(vendor, world, mode, dtype)
    x, ids, w, other_ids = _inputs(rank, d.spec.num_experts)
    layer = ScaledLayer.for_rank(H, d.spec.num_experts, rank, PER_RANK)
    return tuple(routing_reuse(d, layer, x, ids, w, other_ids))


@pytest.mark.parametrize("vendor", [EMULATOR, EMULATOR_ENV_ONLY])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_combine_uses_the_routing_given_to_its_dispatch(moe_rank_pools, vendor, mode, dtype):
    """The caller's ids and weights are overwritten in place after dispatch (the kit's ``routing_reuse``: ids copied
    from another routing, w.mul_(0.5).add_(0.25)): combine's result is bit for bit the one without the overwrite. Before the fix both modes gave another result."""
    for repeatable, same, diff in moe_rank_pools.get(2).map(_combine_after_the_router_buffers_change, vendor, mode,
                                                             dtype):
        assert repeatable, "the round trip itself is not repeatable: the comparison below would mean nothing"
        assert same, f"combine read the overwritten routing (max difference {diff})"


# -- class 7 -------------------------------------------------------------------------------------------------------

TIMEOUT_S = 2.0


def _bad_input_on_rank_1(rank: int, world: int, vendor: str, mode: str):
    d = _dispatcher(vendor, world, mode, "bf16", timeout_s=TIMEOUT_S * 15)
    x, ids, w, _ = _inputs(rank, d.spec.num_experts)
    return dispatch_with_a_bad_id(d, x, ids, w, bad=rank == 1)


def _stalls_before_combine(rank: int, world: int, vendor: str, mode: str):
    d = _dispatcher(vendor, world, mode, "bf16", timeout_s=TIMEOUT_S)
    x, ids, w, _ = _inputs(rank, d.spec.num_experts)
    return combine_unless_stalled(d, x, ids, w, stall_s=TIMEOUT_S + 2 if rank == 1 else None)  # rank 1 never combines


@pytest.mark.parametrize("vendor,mode", [(EMULATOR, "low_latency"), (EMULATOR, "normal"),
                                         (EMULATOR_ENV_ONLY, "normal")])
def test_bad_input_on_one_rank_reaches_the_other_inside_the_fake(vendor, mode):
    """Rank 1's dispatch raises its InvalidInputError (and posts it); rank 0, waiting in the fake's collective, gets
    PeerFailedError naming rank 1 within a few seconds, though the timeout is 30 s. Before the fix the fake waited
    with a Watch of its own (300 s, no notices): rank 0 hung until the process group's own timeout."""
    (name0, attrs0, seconds0, message0), (name1, attrs1, _, _) = on_a_fresh_pool(_bad_input_on_rank_1, vendor, mode)
    assert name1 == "InvalidInputError" and attrs1["parameter"] == "topk_ids"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert "expert id out of range" in message0
    assert seconds0 < 5.0


@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_a_rank_that_never_combines_is_named_after_the_dispatchers_timeout(mode):
    """Rank 1 never calls combine; rank 0 waits in the fake's combine collective and raises CollectiveTimeoutError
    naming rank 1 after about ``timeout_s`` (2 s), not after the fake's own 300 s."""
    outcomes = on_a_fresh_pool(_stalls_before_combine, EMULATOR, mode)
    name, attrs, seconds, message = outcomes[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5


# -- class 5 -------------------------------------------------------------------------------------------------------


def _dispatchers_beside_an_environment_writer(rank: int, world: int, rounds: int) -> list[str]:
    """Two dispatchers on the build without ``quant_mode`` (INT8 and BF16: the vendor takes the choice from
    ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` at the call) and one on the newer build, interleaved ``rounds`` times, while
    another thread of the engine sets and deletes variables of its own. Problems, as sentences."""
    import os
    import threading

    from moe_dispatch_ascend_deepep.vendor import INT8_ENV

    problems: list[str] = []
    done = threading.Event()
    kept: dict[str, str] = {}

    def writing() -> None:
        j = 0
        while not done.is_set():
            j += 1
            keep, churn = f"MD_TEST_ISSUE15_KEEP_{j}", f"MD_TEST_ISSUE15_CHURN_{j}"
            os.environ[keep] = kept[keep] = str(j)
            os.environ[churn] = "x"
            time.sleep(0)
            os.environ.pop(churn, None)  # deleted by its thread: must stay deleted
            for name, value in list(kept.items())[-20:]:
                if os.environ.get(name) != value:
                    problems.append(f"{name} was {os.environ.get(name)!r}, set to {value!r} by its thread")
                    kept[name] = os.environ.get(name)  # type: ignore[assignment]

    dispatchers = [(_dispatcher(EMULATOR_ENV_ONLY, world, "normal", "int8"), "1"),
                   (_dispatcher(EMULATOR_ENV_ONLY, world, "normal", "bf16"), "0"),
                   (_dispatcher(EMULATOR, world, "low_latency", "int8"), None)]
    x, ids, w, _ = _inputs(rank, dispatchers[0][0].spec.num_experts)
    writer = threading.Thread(target=writing)
    writer.start()
    try:
        for _ in range(rounds):
            for d, int8 in dispatchers:
                out = d.dispatch(x, ids, w)
                seen = dict(d.backend_dispatcher.buffer.calls[-1].env).get(INT8_ENV)
                if int8 is not None and seen != int8:
                    problems.append(f"{d.output_dtype.value} dispatcher: the vendor read {INT8_ENV}={seen!r}")
                d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16), out)
    except BaseException as exc:  # noqa: BLE001 - the point: nothing may escape
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        done.set()
        writer.join(10)
    problems += [f"{name} vanished" for name, value in kept.items() if os.environ.get(name) != value]
    if INT8_ENV in os.environ:
        problems.append(f"{INT8_ENV}={os.environ[INT8_ENV]!r} left in the environment")
    for name in [n for n in os.environ if n.startswith("MD_TEST_ISSUE15_")]:
        del os.environ[name]
    return problems[:10]


def test_dispatches_leave_another_threads_variables_alone(moe_rank_pools):
    """Before the fix the adapter's scoped block restored the whole environment: variables another thread set while
    a dispatch ran were deleted (and one deleted meanwhile could make the restore raise a raw KeyError). Now each
    vendor call reads its own dispatcher's INT8 choice and every other variable stays as its thread left it."""
    for problems in moe_rank_pools.get(2).map(_dispatchers_beside_an_environment_writer, 40):
        assert not problems, problems


def _two_threads_per_rank_on_their_own_groups(rank: int, world: int, rounds: int) -> list[str]:
    """Two dispatchers of one kind (the build without ``quant_mode``, BF16, normal mode: each dispatch is a block
    setting ``DEEP_NORMAL_MODE_USE_INT8_QUANT=0`` around the vendor's collective), each on a group of its own and
    driven by a thread of its own, as an engine overlapping two micro-batches would. Problems, as sentences."""
    import threading

    import torch.distributed as dist

    groups = [dist.new_group(list(range(world))) for _ in range(2)]  # the same order on every rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        dispatchers = [md.create_dispatcher(AscendDeepEPBackend(EMULATOR_ENV_ONLY), md.DispatchSpec(
            H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype="bf16"),
            group, env={}, timeout_s=5.0) for group in groups]
    x, ids, w, _ = _inputs(rank, dispatchers[0].spec.num_experts)
    problems: list[str] = []

    def drive(d: md.Dispatcher) -> None:
        try:
            for _ in range(rounds):
                out = d.dispatch(x, ids, w)
                d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16), out)
        except BaseException as exc:  # noqa: BLE001 - the point: nothing may escape
            problems.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=drive, args=(d,)) for d in dispatchers]
    for t in threads if rank == 0 else threads[::-1]:  # the ranks start them in opposite orders
        t.start()
    for t in threads:
        t.join(60)
    return problems + [f"thread {i} still running" for i, t in enumerate(threads) if t.is_alive()]


def test_threads_of_one_kind_do_not_wait_for_each_other_across_ranks():
    """With one process-wide lock around every block, rank 0's thread A held it inside A's collective while rank 1's
    thread B held it inside B's: each waited for a peer that waited for the lock, until the 5 s timeout
    (CollectiveTimeoutError on both ranks). Blocks that set the same values now share, so every round completes."""
    for problems in on_a_fresh_pool(_two_threads_per_rank_on_their_own_groups, 30):
        assert not problems, problems
