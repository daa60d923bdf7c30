"""The environment DeepEP-Ascend reads: what the adapter sets for each of its vendor calls (and for the
Buffer's construction) whatever the process holds, the process environment as it was afterwards, other
threads' variables left alone; the strtol the C++ reads integers with; and what every rank must agree on
(the window, the variables that pick the kernels) before the Buffer exists."""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.vendor import INT8_ENV
from moe_dispatch_ascend_deepep_testing import FAKE, FAKE_ENV_ONLY, ascend_backend
from moe_dispatch_ascend_deepep_testing.support import (
    PER_RANK,
    TOKENS,
    TOP_K,
    H,
    batch,
    dispatcher,
    identity_reference,
    routed_inputs,
    timed_dispatcher,
)
from moe_dispatch_testing import on_a_fresh_pool, relative_error

HCCL, EXPANSION = v.HCCL_BUFFSIZE, v.OP_EXPANSION_ENV


# -- the variables each vendor call reads, set for that call ---------------------------------------------------


def interleaved(rank: int, world: int, vendor: str, mode: str, rounds: int) -> list[tuple]:
    """An INT8 and a BF16 dispatcher in one process (a draft and a target model), interleaved,
    with someone's process-wide INT8 switch already set."""
    results = []
    with restored_environ({INT8_ENV: "1"}):
        bf16, int8 = dispatcher(vendor, "bf16", mode, experts=8), dispatcher(vendor, "int8", mode, experts=8)
        x, ids, w = batch(rank, experts=8, drop=True)
        for _ in range(rounds):
            for d in (int8, bf16):
                out = d.dispatch(x, ids, w)
                results.append((d.output_dtype.value, str(out.hidden_states.dtype),
                                d.backend_dispatcher.buffer.calls[-1].int8))
                d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16), out)
        assert os.environ[INT8_ENV] == "1"  # untouched by the dispatchers
    return results


@pytest.mark.parametrize("vendor", [FAKE, FAKE_ENV_ONLY])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_an_int8_and_a_bf16_dispatcher_never_see_each_others_choice(moe_rank_pools, vendor, mode):
    """sglang #26389/#26408: each vendor call gets this dispatcher's choice, whatever the process
    environment holds, and the environment is as it was afterwards."""
    for results in moe_rank_pools.get(2).map(interleaved, vendor, mode, 3):
        assert len(results) == 6
        for resolved, tensor_dtype, vendor_int8 in results:
            assert (tensor_dtype == "torch.int8") is (resolved == "int8") and vendor_int8 is (resolved == "int8")


def roundtrip(rank: int, world: int, vendor_module: str, dtype: str, mode: str, env: dict[str, str],
              drop: bool = True) -> dict:
    """One dispatch → identity experts → combine with ``env`` set process-wide (as another
    library or the launcher would), then the environment as it was."""
    with restored_environ(env):
        d = dispatcher(vendor_module, dtype, mode)
        x, ids, w = batch(rank, drop=drop)
        out = d.dispatch(x, ids, w)
        call = d.backend_dispatcher.buffer.calls[-1]
        rows = out.hidden_states.float()
        if out.hidden_states_scale is not None:
            rows = rows * out.hidden_states_scale.unsqueeze(1)
        y = d.combine(rows.to(torch.bfloat16), out)
        expected = torch.bincount(ids[ids >= 0], minlength=4)  # this rank's sends, gathered below
        seen = {k: os.environ.get(k) for k in env}
    return {"int8": call.int8, "int8_env_at_call": call.env_at_call(v.INT8_ENV), "dtype": str(out.hidden_states.dtype), "counts": out.expert_counts().tolist(),
            "sent": expected.tolist(), "error": float((y.float() - identity_reference(x, ids, w)).norm()
                                                      / identity_reference(x, ids, w).norm()), "env_inside": seen}


def _sum_received(results: list[dict], world: int) -> list[list[int]]:
    local = 4 // world
    total = [sum(r["sent"][e] for r in results) for e in range(4)]
    return [total[rank * local:(rank + 1) * local] for rank in range(world)]


def test_low_latency_minus_one_ids_are_enabled_for_the_call_only(moe_rank_pools):
    """deep_ep.cpp reads MOE_ENABLE_TOPK_NEG_ONE at each low_latency_dispatch/combine; without it
    no active mask reaches the op. The adapter sets it around its own calls, and the process
    environment is as it was afterwards."""
    for r in moe_rank_pools.get(2).map(roundtrip, FAKE, "int8", "low_latency", {v.NEG_ONE_ENV: "0"}):
        assert r["error"] < 0.03, r
        assert r["env_inside"] == {v.NEG_ONE_ENV: "0"}


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_prefix_sum_count_type_is_pinned_in_both_modes(moe_rank_pools, mode):
    """MOE_EXPERT_TOKEN_NUMS_TYPE=0 turns the counts into prefix sums in normal dispatch AND in
    low-latency dispatch (deep_ep.cpp since ee7bc7d7): the adapter pins 1 in both."""
    results = moe_rank_pools.get(2).map(roundtrip, FAKE, "bf16", mode, {v.COUNTS_TYPE_ENV: "0"})
    for r, want in zip(results, _sum_received(results, 2)):
        assert r["counts"] == want, r
        assert r["error"] < 0.01


def test_the_int8_variable_is_pinned_even_where_quant_mode_exists(moe_rank_pools):
    """A2's internode path reads only DEEP_NORMAL_MODE_USE_INT8_QUANT, and KN@7c2b9e06..929a00ae
    ignored it: the adapter passes quant_mode AND pins the variable for its call."""
    for r in moe_rank_pools.get(2).map(roundtrip, FAKE, "int8", "normal", {v.INT8_ENV: "0"}):
        assert r["int8"] is True and r["int8_env_at_call"] == "1", r
        assert r["env_inside"] == {v.INT8_ENV: "0"}  # restored after the call


def ccu_set(rank: int, world: int) -> float:
    with restored_environ({v.CCU_ENV: "1"}):
        d = dispatcher(FAKE, "bf16", "low_latency")
        x, ids, w = batch(rank, drop=False)
        out = d.dispatch(x, ids, w)
        y = d.combine(out.hidden_states, out)
        assert os.environ[v.CCU_ENV] == "1"
    return relative_error(y, identity_reference(x, ids, w))


def test_moe_enable_ccu_is_pinned_off_for_the_adapters_calls(moe_rank_pools):
    """MOE_ENABLE_CCU=1 sends A3 low-latency calls to the A5 CCU op; the adapter pins 0 for its calls."""
    assert max(moe_rank_pools.get(2).map(ccu_set)) < 0.01


def constructed(rank: int, world: int, env: dict[str, str]) -> str:
    with restored_environ(env):
        d = dispatcher(FAKE, "bf16", "low_latency")
        x, ids, w = batch(rank, drop=True)
        out = d.dispatch(x, ids, w)
        d.combine(out.hidden_states, out)
        return "ok"


@pytest.mark.parametrize("env", [{v.STRATEGY_ENV: "alltoall"}, {v.SHARED_RANKS_ENV: "1"},
                                 {v.LONG_SEQ_ROUND_ENV: "2"}], ids=["DEEP_USE_MODE", "shared", "long_seq"])
def test_the_construction_time_environment_is_pinned(moe_rank_pools, env):
    """Buffer construction reads DEEP_USE_MODE (strategies with other layouts and quantization
    flags), MOE_SHARED_EXPERT_RANK_NUM (E_local = E/(R-N), shared ranks) and the long-sequence
    rounds (both or neither, else EP_HOST_ASSERT): the adapter constructs with its own values."""
    assert moe_rank_pools.get(2).map(constructed, env) == ["ok", "ok"]


@pytest.mark.parametrize("raw,want", [("1", 1), ("1 ", 7), ("1_0", 7), ("+1", 7), (" 1", 7), ("\u0661", 7),
                                      ("4294967297", 1), ("99999999999999999999", 7)])
def test_env_integers_are_read_as_the_vendors_strtol(raw, want):
    assert v.parse_env_int(raw, 7) == want


# -- other threads' variables --------------------------------------------------------------------------------


def _dispatchers_beside_an_environment_writer(rank: int, world: int, rounds: int) -> list[str]:
    """Two dispatchers on the build without ``quant_mode`` (INT8 and BF16: the vendor takes the choice from
    ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` at the call) and one on the newer build, interleaved ``rounds`` times, while
    another thread of the engine sets and deletes variables of its own. Problems, as sentences."""
    import threading

    problems: list[str] = []
    done = threading.Event()
    kept: dict[str, str] = {}

    def writing() -> None:
        j = 0
        while not done.is_set():
            j += 1
            keep, churn = f"MD_TEST_ENV_KEEP_{j}", f"MD_TEST_ENV_CHURN_{j}"
            os.environ[keep] = kept[keep] = str(j)
            os.environ[churn] = "x"
            time.sleep(0)
            os.environ.pop(churn, None)  # deleted by its thread: must stay deleted
            for name, value in list(kept.items())[-20:]:
                if os.environ.get(name) != value:
                    problems.append(f"{name} was {os.environ.get(name)!r}, set to {value!r} by its thread")
                    kept[name] = os.environ.get(name)  # type: ignore[assignment]

    dispatchers = [(timed_dispatcher(FAKE_ENV_ONLY, world, "normal", "int8"), "1"),
                   (timed_dispatcher(FAKE_ENV_ONLY, world, "normal", "bf16"), "0"),
                   (timed_dispatcher(FAKE, world, "low_latency", "int8"), None)]
    x, ids, w, _ = routed_inputs(rank, dispatchers[0][0].spec.num_experts)
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
    for name in [n for n in os.environ if n.startswith("MD_TEST_ENV_")]:
        del os.environ[name]
    return problems[:10]


def test_dispatches_leave_another_threads_variables_alone(moe_rank_pools):
    """A scoped block that restored the whole environment would delete the variables another thread set while a
    dispatch ran (and one deleted meanwhile could make the restore raise a raw KeyError). Each vendor call reads
    its own dispatcher's INT8 choice and every other variable stays as its thread left it."""
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
        dispatchers = [md.create_dispatcher(ascend_backend(FAKE_ENV_ONLY), md.DispatchSpec(
            H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype="bf16"),
            group, env={}, timeout_s=5.0) for group in groups]
    x, ids, w, _ = routed_inputs(rank, dispatchers[0].spec.num_experts)
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
    """With one process-wide lock around every block, rank 0's thread A would hold it inside A's collective while
    rank 1's thread B held it inside B's: each would wait for a peer waiting for the lock, until the 5 s timeout
    (CollectiveTimeoutError on both ranks). Blocks that set the same values share, so every round completes."""
    for problems in on_a_fresh_pool(_two_threads_per_rank_on_their_own_groups, 30):
        assert not problems, problems


# -- what every rank agrees on ----------------------------------------------------------------------------------


_SPEC = md.DispatchSpec(1024, 4, 2, num_max_dispatch_tokens_per_rank=8, mode="normal")
_SMALL = md.DispatchSpec(1024, 16, 2, num_max_dispatch_tokens_per_rank=8, mode="normal")


def mismatched_env(rank: int, world: int, name: str, values: tuple[str, str]) -> str:
    env = {v.HCCL_BUFFSIZE: "1024", name: values[rank]}
    try:
        dispatcher(FAKE, None, "normal", env=env)
    except md.ConfigMismatchError as exc:
        return f"ConfigMismatchError {'window' in str(exc) or name in str(exc)}"
    return "created"


@pytest.mark.parametrize("name,values", [(v.HCCL_BUFFSIZE, ("1024", "2048")),
                                         (v.INTRA_ROCE_ENV, ("0", "1"))])
def test_ranks_that_differ_in_the_window_or_the_kernels_get_a_config_mismatch(moe_rank_pools, name, values):
    """The window sizes and the variables that pick the kernels (A2 layered) decide collective calls: ranks
    that differ hang in them on the device; the agreement raises ConfigMismatchError on every rank."""
    assert moe_rank_pools.get(2).map(mismatched_env, name, values) == ["ConfigMismatchError True"] * 2


def test_the_agreement_names_what_decides_the_buffer():
    keys = set(ascend_backend(FAKE, env={}).agreement_values(_SPEC,
                                                                    2, {}, {}))
    assert {"chip", "vendor build", "group window MB", "ops window MB", "window MB needed", v.HCCL_BUFFSIZE,
            v.DEEPEP_HCCL_BUFFSIZE, v.INTRA_PCIE_ENV, v.INTRA_ROCE_ENV} <= keys


def test_the_ranks_agree_on_hccl_op_expansion_mode():
    values = ascend_backend(FAKE, env={EXPANSION: "AIV"}).agreement_values(_SMALL, 2, {}, {})
    assert values.get(EXPANSION) == "AIV"
