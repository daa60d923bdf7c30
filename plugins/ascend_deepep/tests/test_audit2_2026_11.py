"""The second independent audit (2026-11, docs/vendor-audits/2026-11/round2/ascend.md): one test per non-OK row, and the
new findings of the fix. ``#N`` is the audit's row. Every CRASH/WRONG/FAKE test failed on the code
before its fix (VENDOR.md "Independent audit (2026-11)", round two).

Atlas A2 beyond 8 ranks (DeepEP-Ascend's internode path) needs 16 ranks: the adapter's checks are
tested here in one process (``check_spec``, ``env_requirements``, ``check_window``: what ``create``
runs), the fake's internode kernels through their check functions, and the whole path end to end on
16 gloo ranks only with ``MOE_DISPATCH_WIDE_RANKS=1`` (a 16-process pool costs ~15 s here)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import sizes, vendor as v
from moe_dispatch_ascend_deepep.backend import WINDOW_OPTION, AscendDeepEPBackend, a2_limits
from moe_dispatch_ascend_deepep.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep.fakes import torch_npu as fake_npu

MiB = 1 << 20
LAYERED = {v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "0"}
A2 = 220  # torch_npu.npu.get_soc_version() of an Ascend910B1


def _spec(mode: str = "normal", tokens: int = 64, experts: int = 128, top_k: int = 8, hidden: int = 7168,
          dtype: str | None = None) -> md.DispatchSpec:
    return md.DispatchSpec(hidden, experts, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode,
                           output_dtype=dtype)


def _a2(env: dict[str, str] | None = None, module: str = v.FAKE) -> AscendDeepEPBackend:
    return AscendDeepEPBackend(module, env={**LAYERED} if env is None else env, soc="A2")


# -- #13 CRASH: the A2 internode kernels' window --------------------------------------------------------------


def test_13_a2_internode_normal_window_is_what_its_kernels_need():
    """DispatchNormalA2 / MoeDistributeCombineA2 keep 800 MB of RDMA area, a 4 MB IPC offset and 400 MB
    for the notify op in the real window; the combine asserts S·bs·(2H + 16k) + 1204 MB on it and writes
    (H + 16) bf16 per (token, expert of the server) into IPC slices of (window − 1204 MB)/R · 8.
    H=7168, k=8, T=64, R=16 (S=2), E_l=8: assert 2·64·14464 B + 1204 MiB (1206 MB); IPC
    16·ceil(64·min(8, 64)·14368/8) B + 1204 MiB = 1219 MB. Before: 242 MB (the A3 op's formula)."""
    (req,) = _a2().env_requirements(_spec(), 16)
    assert req.minimum == 1219
    (a3,) = AscendDeepEPBackend(v.FAKE, env=LAYERED, soc="A3").env_requirements(_spec(), 16)
    assert a3.minimum < 300
    for backend in (_a2({**LAYERED, v.HCCL_BUFFSIZE: "300"}),
                    AscendDeepEPBackend(env={**LAYERED, v.HCCL_BUFFSIZE: "300"})):  # creation: unknown chip = A2
        with pytest.raises(md.CapacityError):
            backend.check_window(_spec(), 16, {}, {})
    _a2({**LAYERED, v.HCCL_BUFFSIZE: "1219"}).check_window(_spec(), 16, {}, {})


# -- #14 CRASH: no INT8 kernel on the A2 internode path -------------------------------------------------------


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_14_a2_internode_normal_refuses_int8(dtype):
    """internode_dispatch passes quant mode 2 when DEEP_NORMAL_MODE_USE_INT8_QUANT=1; the tiling key is then
    2000001002 (2100001002 layered) and dispatch_normal_a2.cpp has kernels for 2000000000, 2000001000 and
    2100001000 only (all bf16). The README: "Normal mode does NOT support quantization" on A2 dual node."""
    with pytest.raises(md.InvalidSpecError) as info:
        _a2().check_spec(_spec(dtype=dtype), 16)
    assert info.value.parameter == "output_dtype" and "no INT8 kernel" in str(info.value)
    with pytest.raises(md.InvalidSpecError):  # a resolved INT8 (a runner's hint): what create checks
        _a2({**LAYERED, v.HCCL_BUFFSIZE: "1300"}).check_environment(_spec().with_dtype(md.DispatchDtype.INT8), 16,
                                                                     {}, {})
    with pytest.raises(md.InvalidSpecError):  # creation: a chip torch_npu cannot name is taken as A2
        AscendDeepEPBackend(env={**LAYERED, v.HCCL_BUFFSIZE: "1300"}).check_environment(
            _spec().with_dtype(md.DispatchDtype.INT8), 16, {}, {})
    with pytest.raises(md.InvalidSpecError):
        a2_limits(_spec().with_dtype(md.DispatchDtype.INT8), 16, "A2")
    _a2().check_spec(_spec(dtype="bf16"), 16)
    _a2().check_spec(_spec(dtype="int8"), 8)  # one node: the intranode op has INT8
    AscendDeepEPBackend(v.FAKE, env=LAYERED, soc="A3").check_spec(_spec(dtype="int8"), 16)


# -- #15 CRASH: the A2 internode combine has a kernel only for the layered variables --------------------------


def test_15_a2_internode_normal_needs_the_layered_variables():
    """MoeDistributeCombineA2's tiling key is 3000 only with HCCL_INTRA_PCIE_ENABLE=1 and
    HCCL_INTRA_ROCE_ENABLE=0 (else 2000, and bs <= 256); moe_distribute_combine_a2.cpp has TILING_KEY_IS(3000)
    only. The README: "A2 Dual Node: Must set HCCL_INTRA_PCIE_ENABLE=1 and HCCL_INTRA_ROCE_ENABLE=0". Checked at
    creation, like the window (``check_environment``: what ``create`` runs before the Buffer exists)."""
    enough = {v.HCCL_BUFFSIZE: "1300"}
    for env in ({}, {v.INTRA_PCIE_ENV: "1"}, {v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "1"}):
        with pytest.raises(md.InvalidSpecError) as info:
            _a2({**env, **enough}).check_environment(_spec(), 16, {}, {})
        assert info.value.parameter == f"{v.INTRA_PCIE_ENV}/{v.INTRA_ROCE_ENV}"
    _a2({**LAYERED, **enough}).check_environment(_spec(), 16, {}, {})
    _a2(enough).check_environment(_spec(mode="low_latency"), 16, {}, {})  # low latency has its own (fullmesh) kernels
    AscendDeepEPBackend(v.FAKE, env=enough, soc="A3").check_environment(_spec(), 16, {}, {})


# -- #27 CRASH: the layered low-latency dispatch pads k to 8 ------------------------------------------------------


def test_27_the_layered_window_pads_top_k_to_8():
    """moe_distribute_dispatch_v2_layered.h asserts winSize >= E·bs·(2H + 4·RoundUp(k, 8)·4) + 804 MB.
    E=256, T=512, H=1024, k=4: 256·512·(2048 + 128) B + 804 MiB = 1076 MB (the unpadded formula: 1068)."""
    assert v.layered_window_bytes(512, 1024, 256, 4) == 256 * 512 * (2 * 1024 + 16 * 8) + 804 * MiB
    assert v.layered_window_bytes(512, 1024, 256, 8) == 256 * 512 * (2 * 1024 + 16 * 8) + 804 * MiB
    (req,) = _a2().env_requirements(_spec("low_latency", tokens=512, experts=256, top_k=4, hidden=1024), 16)
    assert req.minimum == 1076


# -- #19 WRONG / #34 FAKE: the window is the group's ----------------------------------------------------------------


def _batch(seed: int, tokens: int = 8, experts: int = 4, hidden: int = 1024):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, 2, generator=g)


def _expected(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)


def _dispatcher(backend: AscendDeepEPBackend, mode: str = "normal", experts: int = 4, options=None) -> md.Dispatcher:
    spec = md.DispatchSpec(1024, experts, 2, num_max_dispatch_tokens_per_rank=8, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(backend, spec, env={}, options=options)


def group_window_run(rank: int, world: int, env: dict[str, str], group_mb: int | None, mode: str) -> str:
    import torch.distributed as dist

    config = {} if group_mb is None else {v.HCCL_BUFFER_SIZE_KEY: group_mb}
    with fake_npu.group_hccl_config(dist.group.WORLD, config), \
            restored_environ({v.DEEPEP_HCCL_BUFFSIZE: None, **env}):  # unset unless the case sets it
        try:
            d = _dispatcher(AscendDeepEPBackend(v.FAKE), mode)
        except md.MoEDispatchError as exc:
            return f"{type(exc).__name__} {exc.parameter}"
        x, ids, w = _batch(rank)
        try:
            out = d.dispatch(x, ids, w)
            y = d.combine(out.hidden_states, out)
        except RuntimeError as exc:
            return f"RuntimeError {str(exc)[:70]}"
    return "ran" if relative_error(y, _expected(x, ids, w)) < 0.01 else "wrong"


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_19_the_window_is_the_groups_hccl_buffer_size(moe_rank_pools, mode):
    """A group created with ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": N} has an N MB
    window whatever HCCL_BUFFSIZE says (torch_npu: the option > HCCL_BUFFSIZE > 200). sglang sizes its MoE
    group with DEEPEP_HCCL_BUFFSIZE (sglang parallel_state.py get_torch_distributed_pg_options): that layout
    was refused; a group smaller than HCCL_BUFFSIZE was accepted (the kernels write past its end)."""
    pool = moe_rank_pools.get(2)
    sglang = {v.DEEPEP_HCCL_BUFFSIZE: "2048", v.HCCL_BUFFSIZE: "400"}
    assert pool.map(group_window_run, sglang, 2048, mode) == ["ran"] * 2
    small = {v.HCCL_BUFFSIZE: "1024"}  # the ops lay out 1024 MB in the group's 300
    assert pool.map(group_window_run, small, 300, mode) == [f"InvalidSpecError {v.HCCL_BUFFSIZE}"] * 2
    over = {v.DEEPEP_HCCL_BUFFSIZE: "2048", v.HCCL_BUFFSIZE: "4096"}  # the group's 1024 is the real window
    assert pool.map(group_window_run, over, 1024, mode) == [f"InvalidSpecError {v.DEEPEP_HCCL_BUFFSIZE}"] * 2


def test_19_a_stated_window_for_a_group_whose_options_cannot_be_read():
    backend = AscendDeepEPBackend(v.FAKE, env={v.HCCL_BUFFSIZE: "400", v.DEEPEP_HCCL_BUFFSIZE: "1024"}, soc="A3")
    spec = _spec(tokens=8, experts=16, hidden=1024, top_k=2)
    with pytest.raises(md.InvalidSpecError):  # unreadable: HCCL_BUFFSIZE's 400 is taken, DEEPEP is above it
        backend.check_window(spec, 2, None, {})
    assert backend.check_window(spec, 2, None, {WINDOW_OPTION: 1024}).mb == 1024
    with pytest.raises(md.InvalidSpecError) as info:  # a stated window that contradicts the group's option
        backend.check_window(spec, 2, {v.HCCL_BUFFER_SIZE_KEY: 2048}, {WINDOW_OPTION: 1024})
    assert info.value.parameter == WINDOW_OPTION


def fake_allocated_window(rank: int, world: int) -> tuple[int, str]:
    import torch.distributed as dist

    with fake_npu.group_hccl_config(dist.group.WORLD, {v.HCCL_BUFFER_SIZE_KEY: 300}):
        buffer = fake.Buffer(dist.group.WORLD)
    x, ids, w = _batch(rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
    with restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "512"}):  # the ops' check passes (512 >= 213), the group is 300
        try:
            buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=ids, topk_weights=w, num_worst_tokens=8)
        except RuntimeError as exc:
            return buffer.allocated_window_mb, str(exc)
    return buffer.allocated_window_mb, "dispatched"


def test_34_the_fake_allocates_the_groups_window(moe_rank_pools):
    """The fake's window is the one HCCL gives the group (its hccl_buffer_size option), not HCCL_BUFFSIZE."""
    for mb, message in moe_rank_pools.get(2).map(fake_allocated_window):
        assert mb == 300 and "write past the window" in message


# -- agreement: what decides the Buffer and the windows, equal on every rank ------------------------------------


def mismatched_env(rank: int, world: int, name: str, values: tuple[str, str]) -> str:
    env = {v.HCCL_BUFFSIZE: "1024", name: values[rank]}
    try:
        _dispatcher(AscendDeepEPBackend(v.FAKE, env=env))
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
    keys = set(AscendDeepEPBackend(v.FAKE, env={}).agreement_values(_spec(tokens=8, experts=4, hidden=1024, top_k=2),
                                                                    2, {}, {}))
    assert {"chip", "vendor build", "group window MB", "ops window MB", "window MB needed", v.HCCL_BUFFSIZE,
            v.DEEPEP_HCCL_BUFFSIZE, v.INTRA_PCIE_ENV, v.INTRA_ROCE_ENV} <= keys


# -- #17 RISK: the chip by name where the code is unknown ---------------------------------------------------------


@pytest.mark.parametrize("code,name,want", [
    (256, "Ascend910_9363", "A3"),  # the A3 part appended after 9362 (Ascend/pytorch NpuVariables.h)
    (999, "Ascend910_9399", "A3"), (999, "Ascend910B2C", "A2"), (999, "Ascend910B4-1", "A2"),
    (999, "Ascend950", None), (999, "Ascend910B", None), (222, "whatever", "A2")])
def test_17_the_chip_is_classified_by_name_where_the_code_is_unknown(code, name, want):
    with fake_npu.soc_version(code, name):
        assert v.current_soc(fake_npu) == want


def test_17_no_a2_bounds_on_an_a3_9363():
    with fake_npu.soc_version(256, "Ascend910_9363"):
        backend = AscendDeepEPBackend(v.FAKE, env={})
        assert backend.soc() == "A3"
        backend.check_spec(_spec(tokens=8192, experts=128, dtype="int8"), 16)  # no A2 internode limits


# -- #33 FAKE: the fake's A2 internode kernels ------------------------------------------------------------------


def test_33_the_fake_carries_the_a2_internode_kernels_rules():
    dispatch = dict(world_size=16, rank=3, bs=8, hidden=1024, top_k=2, num_experts=32, scales=False, max_top_k=16,
                    ops_window_mb=1300)
    with pytest.raises(RuntimeError, match="2000001002"):
        fake.a2_internode_dispatch_tiling(quant_mode=2, env={}, **dispatch)
    with pytest.raises(RuntimeError, match="2100001002"):
        fake.a2_internode_dispatch_tiling(quant_mode=2, env=LAYERED, **dispatch)
    fake.a2_internode_dispatch_tiling(quant_mode=0, env={}, **dispatch)  # 2000001000 has a kernel
    with pytest.raises(RuntimeError, match="rankSize is invalid"):
        fake.a2_internode_dispatch_tiling(quant_mode=0, env=LAYERED, **{**dispatch, "world_size": 128})
    with pytest.raises(RuntimeError, match=r"k should be in \[2, 10\]"):
        fake.a2_internode_dispatch_tiling(quant_mode=0, env=LAYERED, **{**dispatch, "top_k": 12, "max_top_k": 10})
    combine = dict(world_size=16, bs=8, hidden=1024, top_k=2, num_experts=32)
    with pytest.raises(RuntimeError, match="tiling key 2000"):
        fake.a2_internode_combine_tiling(env={}, **combine)
    with pytest.raises(RuntimeError, match="smaller than 256"):
        fake.a2_internode_combine_tiling(env={}, **{**combine, "bs": 300})
    fake.a2_internode_combine_tiling(env=LAYERED, **{**combine, "bs": 300})
    with pytest.raises(RuntimeError, match="the min value should be 1204MB"):  # the kernel's message floors
        fake.a2_internode_combine_kernel_window(300 * MiB, 16, 8, 1024, 2)
    fake.a2_internode_combine_kernel_window(1205 * MiB, 16, 8, 1024, 2)


def wide_a2_run(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    results = []
    env = {**LAYERED, v.HCCL_BUFFSIZE: "1300"}
    with fake_npu.soc_version(A2), restored_environ(env):
        for dtype in ("bf16", "int8"):
            spec = md.DispatchSpec(1024, 32, 2, num_max_dispatch_tokens_per_rank=8, mode="normal", output_dtype=dtype)
            try:
                d = md.create_dispatcher(AscendDeepEPBackend(v.FAKE), spec, env={})
            except md.MoEDispatchError as exc:
                results.append(f"{dtype}: {type(exc).__name__} {exc.parameter}")
                continue
            x, ids, w = _batch(rank, experts=32)
            out = d.dispatch(x, ids, w)
            y = d.combine(out.hidden_states, out)
            results.append(f"{dtype}: {'ok' if relative_error(y, _expected(x, ids, w)) < 0.01 else 'wrong'}")
        buffer = fake.Buffer(dist.group.WORLD)
        x, ids, w = _batch(rank, experts=32)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 32)
        with restored_environ({v.INT8_ENV: "1"}):
            try:
                buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w)
            except RuntimeError as exc:
                results.append(str(exc)[:60])
    return results


@pytest.mark.skipif(not os.environ.get("MOE_DISPATCH_WIDE_RANKS"),
                    reason="16 gloo ranks (~15 s to start): set MOE_DISPATCH_WIDE_RANKS=1")
def test_33_the_a2_internode_path_end_to_end_on_16_ranks(moe_rank_pools):
    for results in moe_rank_pools.get(16).map(wide_a2_run, timeout_s=300):
        assert results[0] == "bf16: ok" and results[1] == "int8: InvalidSpecError output_dtype", results
        assert "no kernel for tiling key 2100001002" in results[2], results  # INT8, layered


# -- new findings on the A2 internode path ------------------------------------------------------------------------


def test_new_a2_internode_normal_refused_beyond_64_ranks():
    """aclnnNotifyDispatchA2's tiling: rankSize in (0, 64] (ops2/op_host/notify_dispatch_tiling_a2.cc
    MAX_A2_WORLD_SIZE), though the dispatch/combine tiling take 256: 128, 144 and 160 (in the config map) fail.
    Round three (N1) found the kernels tighter still: exactly 16 ranks (test_audit3_2026_11 test_n1_*)."""
    with pytest.raises(md.InvalidSpecError) as info:
        _a2().check_spec(_spec(experts=128), 128)
    assert info.value.parameter == "world_size" and "16" in str(info.value.allowed)
    _a2().check_spec(_spec(experts=128), 16)
    _a2().check_spec(_spec(mode="low_latency", experts=256), 128)  # low latency: up to 256


def test_new_a2_internode_top_k_is_10_before_7a396def():
    """dispatch_normal_a2_tiling.cpp MAX_K_VALUE_A2 was 10 until KN@7a396def (2026-07-15); the first
    Python-visible change after it is low_latency_dispatch(quant_mode=) (KN@f451a596)."""
    with pytest.raises(md.InvalidSpecError) as info:
        _a2(module=v.FAKE_ENV_ONLY).check_spec(_spec(top_k=12), 16)
    assert info.value.parameter == "top_k" and info.value.allowed == "2..10"
    _a2(module=v.FAKE_ENV_ONLY).check_spec(_spec(top_k=10), 16)
    _a2().check_spec(_spec(top_k=12), 16)


def test_new_a2_internode_tokens_fit_the_kernels_fixed_rdma_area():
    """The RDMA area is 800 MB whatever the window: the dispatch gives each server floor4K(399 MiB / S) for
    32 B + T·(2H + 16·ceil8(k)), the combine each server 8·floor32(399 MiB / R) for its fixed 4096 rows of 2H
    (round three: countReL = MAX_BS whatever T). At the one size the kernels take (R = 16) the largest spec
    fits, so the tiling's 4096 is the limit (round two's 64-rank cap of 3615 went with N1)."""
    H, k = 7168, 16
    assert 32 + 4096 * (2 * H + 16 * k) <= v.a2_internode_dispatch_server_bytes(16)
    assert v.A2_INTERNODE_COMBINE_ROWS * 2 * H <= v.a2_internode_combine_server_bytes(16)
    _a2().check_spec(_spec(tokens=4096, experts=128, top_k=k), 16)
    with pytest.raises(md.CapacityError) as info:
        _a2().check_spec(_spec(tokens=4097, experts=128), 16)
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank" and info.value.allowed == "1..4096"


def test_new_a2_internode_window_above_5299_mb_wraps_the_kernels_ipc_size():
    """MoeDistributeCombineA2 keeps IPC_DATA_SIZE = winSize − 1204 MiB in a uint32: from 5300 MB it wraps.
    Round three (N2): the notify op's uint32 offset wraps earlier, from 4496 MB, which is the bound."""
    with pytest.raises(md.InvalidSpecError) as info:
        _a2({**LAYERED, v.HCCL_BUFFSIZE: "5400"}).check_window(_spec(), 16, {}, {})
    assert info.value.parameter == v.HCCL_BUFFSIZE and info.value.allowed == "1219..4495"
    assert v.A2_INTERNODE_COMBINE_MAX_WINDOW_MB == 5299 > v.A2_INTERNODE_MAX_WINDOW_MB


def test_new_the_a2_internode_ipc_need_counts_every_expert_of_a_server():
    """AlltoAllDispatch (moe_distribute_combine_a2_layered.h) writes one (H + 16) bf16 entry per (token, expert
    of the server): with k=8 experts on one server a token takes 8 entries, more than the kernel's own assert
    (one token row plus 16k bytes of metadata) allows for. The larger is required."""
    T, H, R, k = 4096, 7168, 16, 8
    ipc = R * -(-(T * k * (2 * H + 32)) // 8) + 1204 * MiB
    assert v.normal_internode_window_bytes_a2(T, H, R, 8, k) == ipc
    assert ipc > v.normal_internode_combine_assert_bytes(T, H, R, k)
