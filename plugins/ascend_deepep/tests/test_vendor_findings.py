"""Issue 13: the adapter against DeepEP-Ascend's real rules, one test per finding (the audit's
numbers, "new" for the ones found beyond it). Each ran and failed on the code before the fix;
the fakes carry the vendor's behaviour (``moe_dispatch_ascend_deepep.fakes``)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import sizes, vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep.fakes import torch_npu as fake_npu

H = 1024


def _dispatcher(vendor_module: str, dtype: str, mode: str, tokens: int = 8, experts: int = 4, top_k: int = 2,
                env: dict | None = None) -> md.Dispatcher:
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode, output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(AscendDeepEPBackend(vendor_module, env=env), spec, env={})


def _batch(rank: int, tokens: int = 8, experts: int = 4, drop: bool = True) -> tuple:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    if drop:
        ids[0, 1] = -1
    return x, ids, torch.rand(tokens, 2, generator=g)


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)  # identity experts


def roundtrip(rank: int, world: int, vendor_module: str, dtype: str, mode: str, env: dict[str, str],
              drop: bool = True) -> dict:
    """One dispatch → identity experts → combine with ``env`` set process-wide (as another
    library or the launcher would), then the environment as it was."""
    with restored_environ(env):
        d = _dispatcher(vendor_module, dtype, mode)
        x, ids, w = _batch(rank, drop=drop)
        out = d.dispatch(x, ids, w)
        call = d.backend_dispatcher.buffer.calls[-1]
        rows = out.hidden_states.float()
        if out.hidden_states_scale is not None:
            rows = rows * out.hidden_states_scale.unsqueeze(1)
        y = d.combine(rows.to(torch.bfloat16), out)
        expected = torch.bincount(ids[ids >= 0], minlength=4)  # this rank's sends, gathered below
        seen = {k: os.environ.get(k) for k in env}
    return {"int8": call.int8, "int8_env_at_call": call.env_at_call(v.INT8_ENV), "dtype": str(out.hidden_states.dtype), "counts": out.expert_counts().tolist(),
            "sent": expected.tolist(), "error": float((y.float() - _reference(x, ids, w)).norm()
                                                      / _reference(x, ids, w).norm()), "env_inside": seen}


def _sum_received(results: list[dict], world: int) -> list[list[int]]:
    local = 4 // world
    total = [sum(r["sent"][e] for r in results) for e in range(4)]
    return [total[rank * local:(rank + 1) * local] for rank in range(world)]


# -- audit #2: low-latency BF16 sent INT8 -------------------------------------------------------------


@pytest.mark.parametrize("vendor_module", [v.FAKE, v.FAKE_ENV_ONLY])
def test_2_low_latency_bf16_sends_bf16_on_every_vendor_version(moe_rank_pools, vendor_module):
    """KN buffer.py low_latency_dispatch (since f451a596): quant_mode None and use_fp8 (default
    True) mean "int8"; a BF16 dispatch must pass use_fp8=False."""
    for r in moe_rank_pools.get(2).map(roundtrip, vendor_module, "bf16", "low_latency", {}, False):
        assert r["int8"] is False and r["dtype"] == "torch.bfloat16", r
        assert r["error"] < 0.01


# -- audit #7: -1 ids in low-latency mode need MOE_ENABLE_TOPK_NEG_ONE=1 -------------------------------


def test_7_low_latency_minus_one_ids_are_enabled_for_the_call_only(moe_rank_pools):
    """deep_ep.cpp reads MOE_ENABLE_TOPK_NEG_ONE at each low_latency_dispatch/combine; without it
    no active mask reaches the op. The adapter sets it around its own calls, and the process
    environment is as it was afterwards."""
    for r in moe_rank_pools.get(2).map(roundtrip, v.FAKE, "int8", "low_latency", {v.NEG_ONE_ENV: "0"}):
        assert r["error"] < 0.03, r
        assert r["env_inside"] == {v.NEG_ONE_ENV: "0"}


def layered_minus_one(rank: int, world: int, with_minus_one: bool) -> str:
    with fake_npu.soc_version(220), restored_environ({v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "0"}):  # an A2
        d = _dispatcher(v.FAKE, "bf16", "low_latency")
        assert d.backend_dispatcher.buffer.soc_version == fake.A2
        x, ids, w = _batch(rank, drop=with_minus_one)
        try:
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        except md.InvalidInputError as exc:
            return f"InvalidInputError {exc.parameter}"
        return "ok"


def test_7_a2_layered_low_latency_refuses_minus_one_ids(moe_rank_pools):
    """On A2 layered (HCCL_INTRA_PCIE_ENABLE=1, HCCL_INTRA_ROCE_ENABLE=0) the C++ asserts when
    MOE_ENABLE_TOPK_NEG_ONE is set, and without it -1 ids reach the op unmasked: a typed error."""
    assert moe_rank_pools.get(2).map(layered_minus_one, True) == ["InvalidInputError topk_ids"] * 2
    assert moe_rank_pools.get(2).map(layered_minus_one, False) == ["ok"] * 2


# -- audit #10 and new: the HCCL window the ops check -----------------------------------------------------


def _window(mode: str, env: dict[str, str], world: int = 8, tokens: int = 128) -> int:
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=tokens, mode=mode)
    (req,) = AscendDeepEPBackend(v.FAKE, env=env).env_requirements(spec, world)
    return req.minimum


def test_new_low_latency_window_is_what_the_op_tiling_checks():
    """MoeLowLatencyCombineV2's tiling refuses HCCL_BUFFSIZE below ((T·tokD·R·E_l) + T·tokC·k)·2,
    which is 956 MB for H=7168, E=256, k=8, T=128, R=8 (the README's formula gives 228)."""
    assert v.window_mb(v.ll_op_window_bytes(128, 7168, 8, 32, 8)) == 956
    assert _window("low_latency", {}) == 956


def test_new_normal_window_is_what_the_op_tiling_checks():
    """CamMoeDispatchNormal's tiling needs (maxBs·k·(tokC + tokD) + 4 MB + 102 MB)·2: at least
    212 MB whatever the shape, so the default 200 MB always fails normal mode."""
    assert v.window_mb(v.normal_op_window_bytes(8, 1024, 2)) == 213
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="normal")
    (req,) = AscendDeepEPBackend(v.FAKE, env={}).env_requirements(spec, 2)
    assert req.minimum == 213
    with pytest.raises(md.CapacityError):  # what create() runs, against HCCL's default 200 MB
        sizes.check_hccl_window(req.minimum, {})


def test_10_a2_layered_window_follows_the_layered_formula():
    """A2 two-node (layered): E·bs·(2H + 16k) + 4 MB + 800 MB = 1256 MB here."""
    assert v.window_mb(v.layered_window_bytes(128, 7168, 256, 8)) == 1256
    layered = {v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "0"}
    assert _window("low_latency", layered, world=16) == max(1256, v.window_mb(v.ll_op_window_bytes(128, 7168, 16, 16, 8)))


def test_new_deepep_hccl_buffsize_is_the_window_the_ops_check():
    """The ops' tiling reads DEEPEP_HCCL_BUFFSIZE instead of HCCL_BUFFSIZE when it is set, and
    parses either into a uint16: both are checked at creation."""
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")
    (req,) = AscendDeepEPBackend(v.FAKE, env={}).env_requirements(spec, 2)
    sizes.check_hccl_window(req.minimum, {})  # HCCL's default 200 MB is enough for this one
    for env, parameter in (({v.DEEPEP_HCCL_BUFFSIZE: "1"}, v.DEEPEP_HCCL_BUFFSIZE),
                           ({v.HCCL_BUFFSIZE: "70000"}, v.HCCL_BUFFSIZE)):
        with pytest.raises(md.MoEDispatchError) as info:  # what create() runs
            sizes.check_hccl_window(req.minimum, env)
        assert info.value.parameter == parameter


# -- new: environment variables that change outputs -------------------------------------------------------


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_new_a_prefix_sum_count_type_is_pinned_in_both_modes(moe_rank_pools, mode):
    """MOE_EXPERT_TOKEN_NUMS_TYPE=0 turns the counts into prefix sums in normal dispatch AND in
    low-latency dispatch (deep_ep.cpp since ee7bc7d7); the adapter handled normal only."""
    results = moe_rank_pools.get(2).map(roundtrip, v.FAKE, "bf16", mode, {v.COUNTS_TYPE_ENV: "0"})
    for r, want in zip(results, _sum_received(results, 2)):
        assert r["counts"] == want, r
        assert r["error"] < 0.01


def test_new_int8_env_is_pinned_even_where_quant_mode_exists(moe_rank_pools):
    """A2's internode path reads only DEEP_NORMAL_MODE_USE_INT8_QUANT, and KN@7c2b9e06..929a00ae
    ignored it: the adapter passes quant_mode AND pins the variable for its call."""
    for r in moe_rank_pools.get(2).map(roundtrip, v.FAKE, "int8", "normal", {v.INT8_ENV: "0"}):
        assert r["int8"] is True and r["int8_env_at_call"] == "1", r
        assert r["env_inside"] == {v.INT8_ENV: "0"}  # restored after the call


def constructed(rank: int, world: int, env: dict[str, str]) -> str:
    with restored_environ(env):
        d = _dispatcher(v.FAKE, "bf16", "low_latency")
        x, ids, w = _batch(rank)
        out = d.dispatch(x, ids, w)
        d.combine(out.hidden_states, out)
        return "ok"


@pytest.mark.parametrize("env", [{v.STRATEGY_ENV: "alltoall"}, {v.SHARED_RANKS_ENV: "1"},
                                 {v.LONG_SEQ_ROUND_ENV: "2"}], ids=["DEEP_USE_MODE", "shared", "long_seq"])
def test_new_construction_time_environment_is_pinned(moe_rank_pools, env):
    """Buffer construction reads DEEP_USE_MODE (strategies with other layouts and quantization
    flags), MOE_SHARED_EXPERT_RANK_NUM (E_local = E/(R-N), shared ranks) and the long-sequence
    rounds (both or neither, else EP_HOST_ASSERT): the adapter constructs with its own values."""
    assert moe_rank_pools.get(2).map(constructed, env) == ["ok", "ok"]


# -- new: limits the vendor asserts ------------------------------------------------------------------


@pytest.mark.parametrize("mode,world", [("normal", 1), ("normal", 3), ("normal", 12), ("low_latency", 1)])
def test_new_world_sizes_the_vendor_refuses_are_typed_errors(mode, world):
    """dispatch/combine with config=None assert num_ranks in get_dispatch_config's map
    (2, 4, 8, 16, 24, 32, 64, 128, 144, 160); the ops' tiling needs at least 2 ranks."""
    spec = md.DispatchSpec(H, 12 * 16, 2, num_max_dispatch_tokens_per_rank=8, mode=mode)
    with pytest.raises(md.InvalidSpecError) as info:
        AscendDeepEPBackend(v.FAKE, env={}).check_spec(spec, world)
    assert info.value.parameter == "world_size"


def non_contiguous(rank: int, world: int, mode: str) -> str:
    d = _dispatcher(v.FAKE, "bf16", mode)
    x, ids, w = _batch(rank)
    ids_t, w_t = ids.t().contiguous().t(), w.t().contiguous().t()  # column-major views
    assert not ids_t.is_contiguous()
    out = d.dispatch(x, ids_t, w_t)
    d.combine(out.hidden_states, out)
    return "ok"


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_new_non_contiguous_routing_reaches_the_vendor_contiguous(moe_rank_pools, mode):
    """get_dispatch_layout and intranode_dispatch EP_HOST_ASSERT contiguous topk_idx/topk_weights."""
    assert moe_rank_pools.get(2).map(non_contiguous, mode) == ["ok", "ok"]
