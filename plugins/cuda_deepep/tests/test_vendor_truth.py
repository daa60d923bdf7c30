"""Issue 13: the adapter against the vendors' real behaviour, one test per finding (audit numbers, or NEW).

Each test drives the adapter through a fake as strict as DeepEP/DeepGEMM at the cited commit; each failed
on the adapter before the fix (see VENDOR.md, "Findings fixed").
"""

import os

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts

H = 2048
LL, NORMAL = md.Mode.LOW_LATENCY, md.Mode.NORMAL


def _round_trip(rank, world, vendor_module, mode, dtype="fp8", options=None, tokens=8, top_k=2, env=None):
    """Dispatch and combine once through the adapter; what the vendor's Buffer received."""
    spec = md.DispatchSpec(H, 4 * world, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode,
                           output_dtype=dtype)
    with restored_environ(env or {}):
        d = md.create_dispatcher(DeepEPBackend(vendor_module), spec, env={}, options=options)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4 * world, generator=g)[:top_k] for _ in range(tokens)])
        w = torch.rand(tokens, top_k, generator=g)
        out = d.dispatch(x, ids, w)
        y = d.combine(torch.zeros(out.hidden_states.shape[:-1] + (H,), dtype=torch.bfloat16), out)
    impl = d.backend_dispatcher
    return {"shape": tuple(y.shape), "configs": [type(c).__module__ + "." + type(c).__name__
                                                 for c in (impl.dispatch_config, impl.combine_config) if c is not None],
            "nvl_bytes": impl.buffer.num_nvl_bytes}


# -- audit 1: normal mode hands DeepEP its own Config -----------------------------------------------------------


def test_normal_mode_hands_deepep_its_own_config(moe_rank_pools):
    """Audit #1: a dataclass passed as ``config=`` makes pybind raise TypeError on the first dispatch."""
    for seen in moe_rank_pools.get(2).map(_round_trip, vendor.EMULATOR, "normal"):
        assert seen["shape"] == (8, H)
        assert seen["configs"] == [f"{vendor.EMULATOR}.Config"] * 2


def test_user_configs_are_the_vendors_or_converted(moe_rank_pools):
    """Audit #1: ``options`` configs reach DeepEP as its ``Config`` (``ConfigFields`` and dicts are converted);
    anything else is a typed error at creation, not a TypeError at the first dispatch."""
    fields = vendor.ConfigFields(24, 6, 256, 6, 128)
    as_dict = {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 4, "num_max_nvl_chunked_recv_tokens": 256,
               "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128}
    opts = {"dispatch_config": fields, "combine_config": as_dict}
    for seen in moe_rank_pools.get(2).map(_round_trip, vendor.EMULATOR, "normal", "fp8", opts):
        assert seen["configs"] == [f"{vendor.EMULATOR}.Config"] * 2
    spec = md.DispatchSpec(H, 8, 2, output_dtype="fp8")
    with pytest.raises(md.InvalidSpecError) as info:
        DeepEPBackend(vendor.EMULATOR).check_options(spec, 2, {"dispatch_config": (24, 6, 256, 6, 128)})
    assert info.value.parameter == "options.dispatch_config" and "ConfigFields" in info.value.allowed
    with pytest.raises(md.InvalidSpecError, match="num_sms"):  # DeepEP needs the same SM count in both
        DeepEPBackend(vendor.EMULATOR).check_options(
            spec, 2, {"dispatch_config": fields, "combine_config": vendor.ConfigFields(20, 4, 256, 6, 128)})


def test_a_user_config_sizes_the_buffer(moe_rank_pools):
    """NEW: the NVL buffer was sized from the tuned configs even when ``options`` gave larger ones; DeepEP
    then asserts the buffer size at the first dispatch."""
    big = vendor.ConfigFields(24, 6, 512, 6, 128)  # twice the tuned receive chunk, more SMs
    seen = moe_rank_pools.get(2).map(_round_trip, vendor.EMULATOR, "normal", "bf16",
                                     {"dispatch_config": big, "combine_config": big})
    assert seen[0]["nvl_bytes"] >= vendor.ported_nvl_buffer_size_hint(big, 2 * H, 2)


# -- audit 10: version drift ---------------------------------------------------------------------------------------


def test_low_latency_top_k_bound_follows_the_installed_deepep():
    """Audit #10: DeepEP's LL kernels took at most 9 experts per token before 9af0e0d (2025-09-15)."""
    assert DeepEPBackend(vendor.EMULATOR).capabilities.limits_for(LL).max_top_k == 11
    old = DeepEPBackend(vendor.EMULATOR_V1_TOPK9)
    assert old.capabilities.limits_for(LL).max_top_k == 9
    with pytest.raises(md.InvalidSpecError) as info:
        old.check_spec(md.DispatchSpec(7168, 64, 10, mode="low_latency"), 8)
    assert info.value.parameter == "top_k" and info.value.allowed == "1..9"


def test_rdma_hint_has_no_extra_mebibyte():
    """Audit #10: DeepEP's ``get_rdma_buffer_size_hint`` adds no constant (no commit on main has one)."""
    spec = md.DispatchSpec(7168, 256, 8, output_dtype="bf16")
    _, rdma = DeepEPBackend(vendor.REAL).nvl_rdma_bytes(spec, 16)
    # Written out from csrc/legacy/config.hpp for the tuned EP16 configs (10 channels, 2 RDMA ranks).
    def hint(recv: int, send: int) -> int:
        recv = -(-recv // send) * send
        per_token = 2 * 7168 + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16
        total = 10 * 2 * (8 * 2 + 2) * 2 * 4 + 10 * 2 * recv * per_token * 2
        return -(-total // 128) * 128
    assert rdma == max(hint(128, 20), hint(128, 12))


# -- audit 6: DeepGEMM on SM100 ------------------------------------------------------------------------------------


def test_deep_gemm_on_sm100_needs_ue8m0_scales():
    """Audit #6: on compute capability 10.x DeepGEMM casts fp32 scales to UE8M0 (device-asserting powers of
    two from 2.6.1); on 9.x it takes fp32 only. The runner picks the format per device, and refuses the
    other one with a typed error."""
    sm100, sm90 = vendor.DEEP_GEMM_EMULATOR_SM100, vendor.DEEP_GEMM_EMULATOR
    with pytest.raises(md.InvalidSpecError) as info:
        DeepGemmExperts("block_fp8", "low_latency", sm100, ue8m0=False)
    assert (info.value.parameter, info.value.value) == ("ue8m0", False) and "10" in str(info.value)
    with pytest.raises(md.InvalidSpecError) as info:
        DeepGemmExperts("block_fp8", "normal", sm90, ue8m0=True)
    assert (info.value.parameter, info.value.value) == ("ue8m0", True)
    assert DeepGemmExperts("block_fp8", "low_latency", sm100).quant_hints().fp8_ue8m0_scales is True
    assert DeepGemmExperts("block_fp8", "low_latency", sm90).quant_hints().fp8_ue8m0_scales is False


# -- audit 11: emulator details (the fakes) -----------------------------------------------------------------------


def _ll_layout_range(rank, world, module_name):
    import importlib

    fake = importlib.import_module(module_name)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(8, H, world, 8),
                          low_latency_mode=True, num_qps_per_rank=4)
        ids = torch.tensor([[0, 1]] * 3 + [[4, 5]] * 2)  # 3 tokens to rank 0's experts 0, 1; 2 to rank 1's
        _, count, handle, _, _ = buf.low_latency_dispatch(torch.zeros(5, H, dtype=torch.bfloat16), ids, 8, 8,
                                                          use_fp8=False)
    return count.tolist(), handle[1].tolist()


def test_low_latency_layout_range_packs_the_count_in_the_low_word(moe_rank_pools):
    """Audit #11: ``pack2<int, int64_t>(num_recv_tokens, recv_token_begin_idx)`` puts the count in the low
    32 bits (csrc/kernels/legacy/internode_ll.cu dispatch; utils.cuh pack2)."""
    (counts, ranges), _ = moe_rank_pools.get(2).map(_ll_layout_range, vendor.EMULATOR)
    assert counts == [6, 6, 0, 0]  # rank 0's experts 0 and 1: 3 tokens from each of the 2 ranks
    assert ranges[0] == [3, (3 << 32) | 3]  # from rank 0: 3 rows at 0; from rank 1: 3 rows at 3
    assert ranges[2] == [0, 0]


def test_the_fake_config_is_the_vendors_pybind_class():
    """Audit #1/#11: ``deep_ep.Config`` has the hint methods DeepEP binds (positional), no fields, and
    pybind refuses what does not convert."""
    from moe_dispatch_cuda_deepep.fakes import deep_ep as fake

    cfg = fake.Config(24, 8, 512, 16, 128)
    assert cfg.get_nvl_buffer_size_hint(7168, 16) == 453_380_736  # DeepEP PR #434
    assert cfg.get_rdma_buffer_size_hint(7168, 8) == 0
    assert not hasattr(cfg, "num_sms") and not hasattr(cfg, "nvl_buffer_size_hint")
    with pytest.raises(TypeError):  # pybind names them arg0, arg1: positional only
        cfg.get_nvl_buffer_size_hint(hidden_bytes=7168, num_ranks=16)
    with pytest.raises(TypeError, match="incompatible"):
        cfg.get_nvl_buffer_size_hint(-1, 16)  # size_t
    with pytest.raises(TypeError, match="incompatible"):
        fake.Config(24.0, 8, 512, 16, 128)
    with pytest.raises(RuntimeError, match="Assertion exception"):
        fake.Config(24, 8, 8, 16, 128)  # send chunk must be below the receive chunk


def _hybrid_positional(rank, world):
    from moe_dispatch_cuda_deepep.fakes import deep_ep_hybrid as fake

    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(8, H, world, 8),
                          low_latency_mode=True, num_qps_per_rank=4)
        x = torch.randn(4, H).to(torch.bfloat16)
        ids = torch.tensor([[0, 5]] * 4)
        w = torch.full((4, 2), 0.5)
        gs = torch.tensor(448.0 * 6.0 / 5.0)
        # The branch's positional order: topk_weights 5th, x_global_scale 8th, use_nvfp4 12th.
        out = buf.low_latency_dispatch(x, ids, 8, 8, w, None, None, gs, False, False, False, True)
    return len(out), tuple(out[0][0].shape), out[2].dtype


def test_hybrid_ep_positional_order_and_return_tuple(moe_rank_pools):
    """Audit #11: the hybrid-ep branch takes ``topk_weights`` 5th and returns seven values with it."""
    for n, data_shape, weights_dtype in moe_rank_pools.get(2).map(_hybrid_positional):
        assert n == 7 and data_shape == (16, H // 2, 4) and weights_dtype == torch.float32


# -- NEW: limits DeepEP asserts that the adapter did not check ---------------------------------------------------


def test_low_latency_needs_ranks_times_tokens_a_multiple_of_four():
    """NEW: ``(num_ranks * T) % 4 == 0`` ("TMA requires the number of tokens to be multiple of 4") since
    @ebfe47e; the adapter allowed T = 511 (its own ceiling) on 2 ranks."""
    backend = DeepEPBackend(vendor.EMULATOR)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=511, mode="low_latency"), 2)
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank" and "4" in info.value.allowed
    backend.check_spec(md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=510, mode="low_latency"), 2)


def test_normal_mode_limits_are_deepeps():
    """NEW: normal-mode kernels device-assert ``num_topk <= 32`` (not 128, which only the size hints reserve);
    intranode notify asserts at most 128 local experts, internode at most 64 (8 · local <= 512)."""
    backend = DeepEPBackend(vendor.EMULATOR)
    assert backend.capabilities.limits_for(NORMAL).max_top_k == 32
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 8 * 129, 8, output_dtype="bf16"), 8)
    assert info.value.parameter == "num_experts" and "128" in info.value.allowed
    with pytest.raises(md.InvalidSpecError):
        backend.check_spec(md.DispatchSpec(7168, 16 * 65, 8, output_dtype="bf16"), 16)
    backend.check_spec(md.DispatchSpec(7168, 16 * 64, 8, output_dtype="bf16"), 16)


def test_low_latency_runs_on_ep_sizes_without_a_normal_mode_config():
    """NEW: the EP sizes of DeepEP's tuned normal-mode configs were applied to low-latency mode too, which
    needs no tuned config: one rank, 6, 24 ... (below 8 or a multiple of 8: audit row 6, ``test_ep06_...``)."""
    backend = DeepEPBackend(vendor.EMULATOR)
    for world in (1, 6, 24):
        backend.check_spec(md.DispatchSpec(7168, 24 * 8, 8, mode="low_latency"), world)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 12 * 8, 8, output_dtype="bf16"), 6)
    assert info.value.parameter == "world_size"


def test_qp_depth_in_the_environment_bounds_low_latency_tokens(moe_rank_pools):
    """NEW: DeepEP reads ``NVSHMEM_QP_DEPTH`` (default 1024) in its constructor and the LL calls assert
    depth >= 2·(T+1); a smaller depth in the environment made the adapter's 511 ceiling wrong."""
    errors = moe_rank_pools.get(2).map(_create_error, vendor.EMULATOR, "low_latency", 200,
                                       {vendor.NVSHMEM_QP_DEPTH: "256"})
    assert all(e == ("CapacityError", "num_max_dispatch_tokens_per_rank") for e in errors), errors


def _create_error(rank, world, vendor_module, mode, tokens, env, options=None):
    spec = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=tokens, mode=mode, output_dtype="fp8")
    with restored_environ(env):
        try:
            d = md.create_dispatcher(DeepEPBackend(vendor_module), spec, env={}, options=options)
            x = torch.zeros(2, H, dtype=torch.bfloat16)
            d.dispatch(x, torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2))
        except md.MoEDispatchError as exc:
            return type(exc).__name__, exc.parameter
        except Exception as exc:  # the vendor's own failure: what the test must not see
            return type(exc).__name__, str(exc)[:200]
    return None


def test_topk_index_dtype_follows_deep_ep_topk_idx_t(moe_rank_pools):
    """NEW: a DeepEP built with 32-bit top-k indices (``deep_ep.topk_idx_t`` = int32, da6ca24) asserts the
    dtype of every top-k tensor; the adapter sent int64 always."""
    for mode in ("normal", "low_latency"):
        for seen in moe_rank_pools.get(2).map(_round_trip, vendor.EMULATOR_TOPK_INT32, mode):
            assert seen["shape"] == (8, H)


def test_a_shared_buffer_of_the_wrong_mode_is_a_typed_error(moe_rank_pools):
    """NEW: ``options={"buffer": ...}`` with a Buffer DeepEP would refuse (a normal-mode buffer for
    low-latency dispatch, one too small) failed inside DeepEP at the first dispatch."""
    errors = moe_rank_pools.get(2).map(_shared_buffer_error)
    assert all(e == ("InvalidSpecError", "options.buffer") for e in errors), errors


def _shared_buffer_error(rank, world):
    import importlib

    fake = importlib.import_module(vendor.EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        normal = fake.Buffer(torch.distributed.group.WORLD, 1 << 24, 0)
    return _create_error(rank, world, vendor.EMULATOR, "low_latency", 8, {}, {"buffer": normal})


def test_deepep_needs_a_process_group():
    """NEW: ``deep_ep.Buffer(group=None)`` raises ValueError ("Either 'group' or 'comm' must be provided.");
    without torch.distributed the adapter handed it None. Now a typed error that says what to do."""
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")
    with pytest.raises(md.BackendUnavailableError) as info:
        md.create_dispatcher(DeepEPBackend(vendor.EMULATOR), spec, env={})
    assert "init_process_group" in str(info.value)


def _deterministic_error(rank, world):
    torch.use_deterministic_algorithms(True)
    try:
        return _create_error(rank, world, vendor.EMULATOR, "low_latency", 8, {})
    finally:
        torch.use_deterministic_algorithms(False)


def test_torch_deterministic_mode_is_refused_at_creation(moe_rank_pools):
    """NEW: DeepEP 2.x asserts in every dispatch/combine that torch's deterministic algorithms and
    ``fill_uninitialized_memory`` are not both on (``check_torch_deterministic``); the old GPU script set
    them. Now a typed error at creation."""
    errors = moe_rank_pools.get(1).map(_deterministic_error)
    assert errors == [("InvalidSpecError", "torch.use_deterministic_algorithms")], errors
    assert not torch.are_deterministic_algorithms_enabled()


def test_environment_variables_the_constructor_writes_are_restored(moe_rank_pools):
    """The fake writes the ``NVSHMEM_*`` variables as DeepEP's constructor does; the adapter restores them."""
    leaked = moe_rank_pools.get(2).map(_env_after_create)
    assert leaked == [[], []], leaked


def _env_after_create(rank, world):
    before = dict(os.environ)
    spec = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")
    md.create_dispatcher(DeepEPBackend(vendor.EMULATOR), spec, env={})
    return sorted(k for k in set(os.environ) ^ set(before)) + sorted(
        k for k in before if k in os.environ and os.environ[k] != before[k])
