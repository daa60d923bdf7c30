"""Atlas A2: the chip, and the limits beyond the declared capabilities. More than 8 ranks on A2 take
DeepEP-Ascend's internode paths, whose kernels are written for two 8-NPU servers; ``HCCL_OP_EXPANSION_MODE``
must be unset; the layered (two-node) low-latency kernels take no -1 ids. A chip torch_npu cannot name
is taken as A2 at creation (the stricter).

Atlas A2 beyond 8 ranks needs 16 ranks: the adapter's checks are tested here in one process
(``check_spec``, ``env_requirements``, ``check_window``, ``check_environment``: what ``create`` runs),
the fake's internode kernels through their check functions, and the whole path end to end on 16 gloo
ranks only with ``MOE_DISPATCH_WIDE_RANKS=1`` (a 16-process pool costs ~15 s here)."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend, a2_limits
from moe_dispatch_ascend_deepep_testing import FAKE, FAKE_ENV_ONLY, TORCH_NPU_FAKE, ascend_backend
from moe_dispatch_ascend_deepep_testing.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep_testing.fakes import torch_npu as fake_npu
from moe_dispatch_ascend_deepep_testing.support import (
    A2,
    LAYERED,
    H,
    MiB,
    batch,
    identity_reference,
    make_spec,
    normal_spec,
    on_a2,
    on_a3,
)
from moe_dispatch_testing import relative_error

HCCL, EXPANSION = v.HCCL_BUFFSIZE, v.OP_EXPANSION_ENV


# -- the chip ------------------------------------------------------------------------------------------------


def test_the_fake_torch_npu_says_which_chip():
    assert v.current_soc(fake_npu) == "A3"
    with fake_npu.soc_version(A2):
        assert v.current_soc(fake_npu) == "A2"
        assert fake.Buffer.__init__ is not None and importlib.import_module(TORCH_NPU_FAKE).SOC_VERSION == A2


@pytest.mark.parametrize("code,name,want", [
    (256, "Ascend910_9363", "A3"),  # the A3 part appended after 9362 (Ascend/pytorch NpuVariables.h)
    (999, "Ascend910_9399", "A3"), (999, "Ascend910B2C", "A2"), (999, "Ascend910B4-1", "A2"),
    (999, "Ascend950", None), (999, "Ascend910B", None), (222, "whatever", "A2")])
def test_the_chip_is_classified_by_name_where_the_code_is_unknown(code, name, want):
    with fake_npu.soc_version(code, name):
        assert v.current_soc(fake_npu) == want


def test_no_a2_bounds_on_an_a3_9363():
    with fake_npu.soc_version(256, "Ascend910_9363"):
        backend = ascend_backend(FAKE, env={})
        assert backend.soc() == "A3"
        backend.check_spec(make_spec(tokens=8192, experts=128, dtype="int8"), 16)  # no A2 internode limits


# -- more than 8 ranks: the internode paths ---------------------------------------------------------------------


@pytest.mark.parametrize("soc", [A2, None], ids=["a2", "unknown"])
def test_a2_multi_node_limits(soc):
    """More than 8 ranks on A2 take the internode kernels: bs <= 4096 in normal mode, EP a multiple of 8
    up to 256 (and top-k >= 2); where the chip is unknown, the same (safe) bound; A3 is not limited."""
    if soc is None:
        backend = AscendDeepEPBackend(env={})  # the real vendor: torch_npu not imported here, chip unknown
    else:
        backend = ascend_backend(FAKE, env={})
    with fake_npu.soc_version(soc or 250):
        with pytest.raises(md.CapacityError) as info:
            backend.check_spec(normal_spec(tokens=8192), 16)
        assert info.value.parameter == "num_max_dispatch_tokens_per_rank"
        with pytest.raises(md.InvalidSpecError) as info:  # A2 multi-server low latency
            backend.check_spec(md.DispatchSpec(H, 12 * 4, 2, num_max_dispatch_tokens_per_rank=8,
                                               mode="low_latency"), 12)
        assert info.value.parameter == "world_size"
        backend.check_spec(normal_spec(tokens=4096), 16)
    ascend_backend(FAKE, env={}).check_spec(normal_spec(tokens=8192), 16)  # the fake's default chip: A3


@pytest.mark.parametrize("world", [24, 32, 64])
def test_a2_normal_mode_takes_up_to_8_ranks_or_exactly_16(world):
    """notify_dispatch_a2.h exchanges with one peer, ``(1 − serverId)·8 + localRank`` ("2个server的计算方式");
    deep_ep.cpp's offset_inner is [2, 4096, E]; the combine is COMBINE_2SERVER_VERSION. 24..64 ranks pass the
    notify tiling's own limit (64), not the kernels."""
    spec = make_spec(experts=world * 8)
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2().check_spec(spec, world)
    assert info.value.parameter == "world_size" and "16" in str(info.value.allowed)
    with pytest.raises(md.InvalidSpecError) as info:  # creation: a chip torch_npu cannot name counts as A2
        AscendDeepEPBackend(env={**LAYERED, HCCL: "3000"}).check_environment(spec, world, {}, {})
    assert info.value.parameter == "world_size"
    on_a2().check_spec(make_spec("low_latency", experts=world * 8), world)  # low latency has its own kernels
    on_a3(LAYERED).check_spec(spec, world)  # an A3 runs the intranode op at any size of the config map


def test_a2_normal_mode_at_8_and_16_ranks():
    on_a2().check_spec(make_spec(experts=128), 16)
    on_a2().check_spec(make_spec(experts=64), 8)
    on_a2({**LAYERED, HCCL: "1219"}).check_environment(make_spec(), 16, {}, {})


def test_a2_internode_normal_mode_is_refused_beyond_64_ranks():
    """aclnnNotifyDispatchA2's tiling: rankSize in (0, 64] (ops2/op_host/notify_dispatch_tiling_a2.cc
    MAX_A2_WORLD_SIZE), though the dispatch/combine tiling take 256: 128, 144 and 160 (in the config map) fail.
    The kernels are tighter still: exactly 16 ranks (test_a2_normal_mode_takes_up_to_8_ranks_or_exactly_16)."""
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2().check_spec(make_spec(experts=128), 128)
    assert info.value.parameter == "world_size" and "16" in str(info.value.allowed)
    on_a2().check_spec(make_spec(experts=128), 16)
    on_a2().check_spec(make_spec(mode="low_latency", experts=256), 128)  # low latency: up to 256


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_the_a2_internode_normal_path_refuses_int8(dtype):
    """internode_dispatch passes quant mode 2 when DEEP_NORMAL_MODE_USE_INT8_QUANT=1; the tiling key is then
    2000001002 (2100001002 layered) and dispatch_normal_a2.cpp has kernels for 2000000000, 2000001000 and
    2100001000 only (all bf16). The README: "Normal mode does NOT support quantization" on A2 dual node."""
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2().check_spec(make_spec(dtype=dtype), 16)
    assert info.value.parameter == "output_dtype" and "no INT8 kernel" in str(info.value)
    with pytest.raises(md.InvalidSpecError):  # a resolved INT8 (a runner's hint): what create checks
        on_a2({**LAYERED, v.HCCL_BUFFSIZE: "1300"}).check_environment(make_spec().with_dtype(md.DispatchDtype.INT8), 16,
                                                                      {}, {})
    with pytest.raises(md.InvalidSpecError):  # creation: a chip torch_npu cannot name is taken as A2
        AscendDeepEPBackend(env={**LAYERED, v.HCCL_BUFFSIZE: "1300"}).check_environment(
            make_spec().with_dtype(md.DispatchDtype.INT8), 16, {}, {})
    with pytest.raises(md.InvalidSpecError):
        a2_limits(make_spec().with_dtype(md.DispatchDtype.INT8), 16, "A2")
    on_a2().check_spec(make_spec(dtype="bf16"), 16)
    on_a2().check_spec(make_spec(dtype="int8"), 8)  # one node: the intranode op has INT8
    ascend_backend(FAKE, env=LAYERED, soc="A3").check_spec(make_spec(dtype="int8"), 16)


def test_the_a2_internode_normal_path_needs_the_layered_variables():
    """MoeDistributeCombineA2's tiling key is 3000 only with HCCL_INTRA_PCIE_ENABLE=1 and
    HCCL_INTRA_ROCE_ENABLE=0 (else 2000, and bs <= 256); moe_distribute_combine_a2.cpp has TILING_KEY_IS(3000)
    only. The README: "A2 Dual Node: Must set HCCL_INTRA_PCIE_ENABLE=1 and HCCL_INTRA_ROCE_ENABLE=0". Checked at
    creation, like the window (``check_environment``: what ``create`` runs before the Buffer exists)."""
    enough = {v.HCCL_BUFFSIZE: "1300"}
    for env in ({}, {v.INTRA_PCIE_ENV: "1"}, {v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "1"}):
        with pytest.raises(md.InvalidSpecError) as info:
            on_a2({**env, **enough}).check_environment(make_spec(), 16, {}, {})
        assert info.value.parameter == f"{v.INTRA_PCIE_ENV}/{v.INTRA_ROCE_ENV}"
    on_a2({**LAYERED, **enough}).check_environment(make_spec(), 16, {}, {})
    # low latency has its own (fullmesh) kernels
    on_a2(enough).check_environment(make_spec(mode="low_latency"), 16, {}, {})
    ascend_backend(FAKE, env=enough, soc="A3").check_environment(make_spec(), 16, {}, {})


def test_the_a2_internode_top_k_is_10_before_7a396def():
    """dispatch_normal_a2_tiling.cpp MAX_K_VALUE_A2 was 10 until KN@7a396def (2026-07-15); the first
    Python-visible change after it is low_latency_dispatch(quant_mode=) (KN@f451a596)."""
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2(module=FAKE_ENV_ONLY).check_spec(make_spec(top_k=12), 16)
    assert info.value.parameter == "top_k" and info.value.allowed == "2..10"
    on_a2(module=FAKE_ENV_ONLY).check_spec(make_spec(top_k=10), 16)
    on_a2().check_spec(make_spec(top_k=12), 16)


def test_a2_internode_tokens_fit_the_kernels_fixed_rdma_area():
    """The RDMA area is 800 MB whatever the window: the dispatch gives each server floor4K(399 MiB / S) for
    32 B + T·(2H + 16·ceil8(k)), the combine each server 8·floor32(399 MiB / R) for its fixed 4096 rows of 2H
    (countReL = MAX_BS whatever T). At the one size the kernels take (R = 16) the largest spec fits, so the
    tiling's 4096 is the limit (a 64-rank cap of 3615 went when 16 ranks became the only size)."""
    H, k = 7168, 16
    assert 32 + 4096 * (2 * H + 16 * k) <= v.a2_internode_dispatch_server_bytes(16)
    assert v.A2_INTERNODE_COMBINE_ROWS * 2 * H <= v.a2_internode_combine_server_bytes(16)
    on_a2().check_spec(make_spec(tokens=4096, experts=128, top_k=k), 16)
    with pytest.raises(md.CapacityError) as info:
        on_a2().check_spec(make_spec(tokens=4097, experts=128), 16)
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank" and info.value.allowed == "1..4096"


def test_the_fake_carries_the_a2_internode_kernels_rules():
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


def test_the_fake_notify_exchanges_with_one_peer_server():
    for world in (24, 32, 64):
        with pytest.raises(RuntimeError, match=r"\(fake\).*peer server"):
            fake.a2_internode_notify_kernel(world, 1300 * MiB)
    fake.a2_internode_notify_kernel(16, 1300 * MiB)


def test_the_fake_combine_writes_4096_rows_per_server():
    """moe_distribute_combine_a2_layered.h: countReL = MAX_BS (4096) whatever the batch; each server's share of
    the 400 MB − 1 MB RDMA half is 8·floor32(399 MB / R): at R = 64 and H = 7168 it is smaller."""
    assert 8 * (399 * MiB // 64 // 32 * 32) < 4096 * 7168 * 2
    with pytest.raises(RuntimeError, match=r"\(fake\).*4096"):
        fake.a2_internode_combine_rdma(64, 7168)
    fake.a2_internode_combine_rdma(16, 7168)


def wide_a2_run(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    results = []
    env = {**LAYERED, v.HCCL_BUFFSIZE: "1300"}
    with fake_npu.soc_version(A2), restored_environ(env):
        for dtype in ("bf16", "int8"):
            spec = md.DispatchSpec(1024, 32, 2, num_max_dispatch_tokens_per_rank=8, mode="normal", output_dtype=dtype)
            try:
                d = md.create_dispatcher(ascend_backend(FAKE), spec, env={})
            except md.MoEDispatchError as exc:
                results.append(f"{dtype}: {type(exc).__name__} {exc.parameter}")
                continue
            x, ids, w = batch(rank, experts=32)
            out = d.dispatch(x, ids, w)
            y = d.combine(out.hidden_states, out)
            results.append(f"{dtype}: {'ok' if relative_error(y, identity_reference(x, ids, w)) < 0.01 else 'wrong'}")
        buffer = fake.Buffer(dist.group.WORLD)
        x, ids, w = batch(rank, experts=32)
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
def test_the_a2_internode_path_end_to_end_on_16_ranks(moe_rank_pools):
    for results in moe_rank_pools.get(16).map(wide_a2_run, timeout_s=300):
        assert results[0] == "bf16: ok" and results[1] == "int8: InvalidSpecError output_dtype", results
        assert "no kernel for tiling key 2100001002" in results[2], results  # INT8, layered


# -- HCCL_OP_EXPANSION_MODE -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_hccl_op_expansion_mode_is_refused_on_a2(mode):
    """The vendor's README: "Must be disabled on A2 when using DeepEP (remove or unset this variable)";
    A2_DEEPEP.md: "otherwise unknown operator errors will occur". torch_npu also takes it per group
    (hccl_config["hccl_op_expansion_mode"])."""
    enough = {**LAYERED, HCCL: "2048"}
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2({**enough, EXPANSION: "AIV"}).check_environment(make_spec(mode), 16, {}, {})
    assert info.value.parameter == EXPANSION
    with pytest.raises(md.InvalidSpecError):  # one node too (the README's "A2 Single Node")
        on_a2({HCCL: "2048", EXPANSION: "AIV"}).check_environment(make_spec(mode, experts=64), 8, {}, {})
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2(enough).check_environment(make_spec(mode), 16, {"hccl_op_expansion_mode": 3}, {})
    assert info.value.parameter == "process_group"
    with pytest.raises(md.InvalidSpecError):  # creation: a chip torch_npu cannot name counts as A2
        AscendDeepEPBackend(env={**enough, EXPANSION: "AIV"}).check_environment(make_spec(mode), 16, {}, {})
    on_a3({**enough, EXPANSION: "AIV"}).check_environment(make_spec(mode), 16, {}, {})
    on_a2(enough).check_environment(make_spec(mode), 16, {}, {})


# -- -1 ids on the layered (two-node) low-latency kernels -------------------------------------------------------


def _ll_dispatcher() -> md.Dispatcher:
    spec = md.DispatchSpec(H, 4, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency", output_dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(ascend_backend(FAKE), spec, env={})


def layered_minus_one(rank: int, world: int, with_minus_one: bool) -> str:
    with fake_npu.soc_version(220), restored_environ({v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "0"}):  # an A2
        d = _ll_dispatcher()
        assert d.backend_dispatcher.buffer.soc_version == fake.A2
        x, ids, w = batch(rank, drop=with_minus_one)
        try:
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        except md.InvalidInputError as exc:
            return f"InvalidInputError {exc.parameter}"
        return "ok"


def test_a2_layered_low_latency_refuses_minus_one_ids(moe_rank_pools):
    """On A2 layered (HCCL_INTRA_PCIE_ENABLE=1, HCCL_INTRA_ROCE_ENABLE=0) the C++ asserts when
    MOE_ENABLE_TOPK_NEG_ONE is set, and without it -1 ids reach the op unmasked: a typed error."""
    assert moe_rank_pools.get(2).map(layered_minus_one, True) == ["InvalidInputError topk_ids"] * 2
    assert moe_rank_pools.get(2).map(layered_minus_one, False) == ["ok"] * 2
