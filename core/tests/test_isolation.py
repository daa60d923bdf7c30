"""Isolation: several dispatchers in one process, and across threads, share nothing.

Dispatchers that differ in dtype (and in how it was chosen), backend, mode, shape, quant
hints, group-list type and process group run alone, then interleaved with several dispatches
in flight at once; threads each run their own dispatchers at once. Every dispatch output,
combine result, byte count and resolved dtype must equal the lone run's, bit for bit, and
``os.environ`` must never change, whatever ``env=`` a dispatcher was created with.

The rank-side scenarios live in ``_lost_helpers.py`` (importable by the pool workers).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import pytest
import torch
import torch.distributed as dist

import moe_dispatch as md
from moe_dispatch._resolution import ENV_OUTPUT_DTYPE, ENV_SGLANG_BF16

import _lost_helpers as lost

#: Batches each thread runs (two in flight at a time).
SEEDS_ONE_PROCESS = list(range(40))
SEEDS_ON_RANKS = list(range(16))


def _env_diff(before: dict[str, str]) -> list[str]:
    """Variables added, removed or changed since ``before`` (pytest's own PYTEST_CURRENT_TEST aside)."""
    after = dict(os.environ)
    return sorted(k for k in before.keys() | after.keys()
                  if before.get(k) != after.get(k) and k != "PYTEST_CURRENT_TEST")


@pytest.fixture(scope="module", autouse=True)
def _environment_untouched_by_the_whole_module():
    """Everything in this module, threads and env= overrides included, leaves os.environ
    as it found it (monkeypatched variables are restored before this runs)."""
    before = dict(os.environ)
    yield
    assert not _env_diff(before), f"os.environ changed during test_isolation: {_env_diff(before)}"


@pytest.fixture
def clean_dtype_env(monkeypatch):
    """Neither dtype variable set in the process environment, whatever the CI sets."""
    monkeypatch.delenv(ENV_OUTPUT_DTYPE, raising=False)
    monkeypatch.delenv(ENV_SGLANG_BF16, raising=False)
    return monkeypatch


def _single_process() -> None:
    assert not (dist.is_available() and dist.is_initialized()), "these tests run without a process group"


# -- several dispatchers, interleaved ---------------------------------------------------------------


@pytest.mark.filterwarnings(f"ignore:{ENV_SGLANG_BF16} is deprecated:DeprecationWarning")
def test_interleaved_dispatchers_in_one_process_match_each_alone(clean_dtype_env):
    """Nine dispatchers (fp8/torch, bf16/allgather low-latency, int8, nvfp4, fp8 UE8M0, dtypes
    chosen through env= overrides and through the library default) at world size 1, with all
    of their dispatches in flight at once in a mixed order and two in flight on one of them.
    A failure names the dispatcher and says whether its dispatch output, its combine result,
    its byte count or its resolved dtype changed because of the others: some state is shared
    between dispatchers (a buffer, a counter, a codec, a resolved env value)."""
    _single_process()
    with lost.one_intra_op_thread():
        problems = lost.interleaved_dispatchers(0, 1, seed=1)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_dispatchers_on_ranks_and_subgroups_match_each_alone(moe_rank_pools, world):
    """The same on local gloo ranks: dispatchers on the default group, on ``dist.new_group``
    pairs and on one-rank groups, their collectives interleaved across groups."""
    results = moe_rank_pools.get(world).map(lost.interleaved_dispatchers, 2)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


# -- threads -----------------------------------------------------------------------------------------


@pytest.mark.filterwarnings(f"ignore:{ENV_SGLANG_BF16} is deprecated:DeprecationWarning")
def test_threads_each_with_their_own_dispatcher_match_a_single_thread(clean_dtype_env):
    """Nine threads at world size 1, each creating its own dispatcher at the same moment
    (env= overrides included) and running 40 batches with two in flight, against the
    same jobs run one by one in one thread. A failure means a dispatcher's result or its
    resolved dtype depends on what another thread does: state shared across dispatchers
    that is not safe under threads (or an env= override that leaked into another one)."""
    _single_process()
    groups = [None] * len(lost.CONFIGS)
    with lost.one_intra_op_thread():
        sequential = lost.run_sequentially(lost.CONFIGS, groups, 0, SEEDS_ONE_PROCESS)
        threaded, errors = lost.run_threads(lost.CONFIGS, groups, 0, SEEDS_ONE_PROCESS)
    assert not errors, "\n".join(errors)
    for c in lost.CONFIGS:
        assert sequential[c.name][0] == c.expect, (c.name, sequential[c.name][0])
    problems = lost.compare_runs(threaded, sequential, "world size 1")
    assert not problems, "\n".join(problems)


def test_threads_on_ranks_each_on_their_own_group_match_a_single_thread(moe_rank_pools):
    """On 4 gloo ranks, three threads per rank, each with a dispatcher on its own process
    group (never sharing one: collectives on a group must be issued in the same order on
    every rank), running at once. A failure means results depend on the other threads."""
    results = moe_rank_pools.get(4).map(lost.threads_on_groups, SEEDS_ON_RANKS)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_deprecated_flag_given_through_env_does_not_reach_other_dispatchers(clean_dtype_env):
    """One thread keeps creating dispatchers with ``env={SGLANG_DEEPEP_BF16_DISPATCH: "1"}``
    (BF16) while others create theirs with ``env={}`` and with the process environment
    (``env=None``); those must resolve to the library default, FP8, every time. A failure
    means the deprecated flag (or the resolution's result) is kept somewhere global."""
    spec = md.DispatchSpec(128, 4, 2)
    seen: dict[str, set[str]] = {"legacy": set(), "empty": set(), "process": set()}
    errors: list[str] = []

    def keep_creating(kind: str, env) -> None:  # type: ignore[no-untyped-def]
        try:
            for _ in range(300):
                seen[kind].add(md.create_dispatcher("torch", spec, env=env).output_dtype.value)
        except BaseException as exc:
            errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        threads = [threading.Thread(target=keep_creating, args=("legacy", {ENV_SGLANG_BF16: "1"})),
                   threading.Thread(target=keep_creating, args=("empty", {})),
                   threading.Thread(target=keep_creating, args=("process", None))]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # interleave the creations finely
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            sys.setswitchinterval(interval)
    assert not errors, errors
    assert seen == {"legacy": {"bf16"}, "empty": {"fp8"}, "process": {"fp8"}}
    assert ENV_SGLANG_BF16 not in os.environ


def test_a_group_this_rank_is_not_in_is_refused_naming_group(moe_rank_pools):
    """``create_dispatcher(group=g)`` on a rank outside ``g``: ``dist.get_rank(g)`` and
    ``dist.get_world_size(g)`` are -1 there. The error must name ``group`` and say that this
    rank is not a member, not blame ``num_experts`` for a world size of -1."""
    results = moe_rank_pools.get(4).map(lost.non_member_group_error)
    assert results[:2] == [None, None]
    for rank, (kind, parameter) in enumerate(results[2:], start=2):
        assert parameter == "group", f"rank {rank}: {kind} naming {parameter!r}"


# -- the process environment -------------------------------------------------------------------------


def test_env_overrides_never_touch_os_environ(clean_dtype_env):
    """``create_dispatcher(env=...)``, the dispatches and combines of those dispatchers, and
    the deprecated flag's warning leave ``os.environ`` exactly as it was, and a later
    dispatcher created from the process environment sees none of the overrides."""
    before = dict(os.environ)
    spec = md.DispatchSpec(128, 4, 2, num_max_dispatch_tokens_per_rank=4)
    x = torch.randn(3, 128).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, -1], [3, 0]])
    w = torch.rand(3, 2)
    made = {}
    for name, env in [("int8 via env", {ENV_OUTPUT_DTYPE: "int8"}), ("auto via env", {ENV_OUTPUT_DTYPE: "auto"}),
                      ("legacy bf16", {ENV_SGLANG_BF16: "1"}), ("legacy off", {ENV_SGLANG_BF16: "0"}),
                      ("empty", {})]:
        if name == "legacy bf16":
            with pytest.warns(DeprecationWarning, match=ENV_OUTPUT_DTYPE):
                d = md.create_dispatcher("torch", spec, env=env)
        else:
            d = md.create_dispatcher("torch", spec, env=env)
        out = d.dispatch(x, ids, w)
        d.combine(torch.zeros(out.hidden_states.shape[0], 128, dtype=torch.bfloat16), out)
        made[name] = d.output_dtype.value
        assert not _env_diff(before), f"{name}: os.environ changed: {_env_diff(before)}"
    assert made == {"int8 via env": "int8", "auto via env": "fp8", "legacy bf16": "bf16", "legacy off": "fp8",
                    "empty": "fp8"}
    later = md.create_dispatcher("torch", spec)  # env=None: the process environment
    assert later.output_dtype is md.DispatchDtype.FP8, str(later.resolution)
    assert not _env_diff(before)


def test_process_env_is_read_at_creation_and_only_when_env_is_none(clean_dtype_env):
    """``MOE_DISPATCH_OUTPUT_DTYPE`` in the process environment picks the dtype of a dispatcher
    created with ``env=None``; one created with an explicit mapping ignores it; changing the
    variable later changes no existing dispatcher (its dispatches keep their dtype)."""
    spec = md.DispatchSpec(128, 4, 2, num_max_dispatch_tokens_per_rank=4)
    x, ids, w = torch.randn(2, 128).to(torch.bfloat16), torch.tensor([[0, 3], [1, 2]]), torch.rand(2, 2)
    clean_dtype_env.setenv(ENV_OUTPUT_DTYPE, "bf16")
    from_process = md.create_dispatcher("torch", spec)
    explicit = md.create_dispatcher("torch", spec, env={})
    assert from_process.output_dtype is md.DispatchDtype.BF16, str(from_process.resolution)
    assert explicit.output_dtype is md.DispatchDtype.FP8, str(explicit.resolution)
    clean_dtype_env.setenv(ENV_OUTPUT_DTYPE, "int8")
    assert md.create_dispatcher("torch", spec).output_dtype is md.DispatchDtype.INT8
    assert from_process.output_dtype is md.DispatchDtype.BF16
    assert from_process.dispatch(x, ids, w).hidden_states.dtype == torch.bfloat16
    assert explicit.dispatch(x, ids, w).hidden_states.dtype == torch.float8_e4m3fn
    assert os.environ[ENV_OUTPUT_DTYPE] == "int8"  # only the test changed it
