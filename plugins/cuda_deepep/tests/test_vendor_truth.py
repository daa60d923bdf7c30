"""The adapter against the vendors' real behaviour: what reaches DeepEP is what DeepEP takes (its own ``Config``, the
top-k dtype it was built with, the routing of the dispatch at combine), the limits it asserts, and the fakes as strict
as DeepEP at the cited commit (pybind conversions, return tuples, receive buffers, the FP8 cast, device asserts,
NVSHMEM per process). DeepGEMM's: test_deep_gemm.py.
"""

import importlib
import os

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts
from moe_dispatch_cuda_deepep_testing import (
    DEEP_GEMM_EMULATOR,
    DEEP_GEMM_EMULATOR_SM100,
    EMULATOR,
    EMULATOR_NVFP4,
    EMULATOR_TOPK_INT32,
    EMULATOR_V1_TOPK9,
)
from moe_dispatch_cuda_deepep_testing.fakes import _native
from moe_dispatch_cuda_deepep_testing.support import PER_RANK, H, fake_module, routed_inputs, routed_spec
from moe_dispatch_testing import ScaledLayer, routing_reuse

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


# -- what reaches DeepEP --------------------------------------------------------------------------------------


def test_normal_mode_hands_deepep_its_own_config(moe_rank_pools):
    """Normal mode hands DeepEP its own ``Config`` (pybind raises TypeError for anything else, a dataclass included)."""
    for seen in moe_rank_pools.get(2).map(_round_trip, EMULATOR, "normal"):
        assert seen["shape"] == (8, H)
        assert seen["configs"] == [f"{EMULATOR}.Config"] * 2


def test_user_configs_are_the_vendors_or_converted(moe_rank_pools):
    """``options`` configs reach DeepEP as its ``Config`` (``ConfigFields`` and dicts are converted); anything else is a
    typed error at creation, not a TypeError at the first dispatch; both directions need the same SMs."""
    fields = vendor.ConfigFields(24, 6, 256, 6, 128)
    as_dict = {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 4, "num_max_nvl_chunked_recv_tokens": 256,
               "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128}
    opts = {"dispatch_config": fields, "combine_config": as_dict}
    for seen in moe_rank_pools.get(2).map(_round_trip, EMULATOR, "normal", "fp8", opts):
        assert seen["configs"] == [f"{EMULATOR}.Config"] * 2
    spec = md.DispatchSpec(H, 8, 2, output_dtype="fp8")
    with pytest.raises(md.InvalidSpecError) as info:
        DeepEPBackend(EMULATOR).check_options(spec, 2, {"dispatch_config": (24, 6, 256, 6, 128)})
    assert info.value.parameter == "options.dispatch_config" and "ConfigFields" in info.value.allowed
    with pytest.raises(md.InvalidSpecError, match="num_sms"):  # DeepEP needs the same SM count in both
        DeepEPBackend(EMULATOR).check_options(
            spec, 2, {"dispatch_config": fields, "combine_config": vendor.ConfigFields(20, 4, 256, 6, 128)})


def test_a_user_config_sizes_the_buffer(moe_rank_pools):
    """The NVL buffer is sized from the configs the layer uses (``options``' larger ones included): DeepEP asserts the
    buffer size at the first dispatch."""
    big = vendor.ConfigFields(24, 6, 512, 6, 128)  # twice the tuned receive chunk, more SMs
    seen = moe_rank_pools.get(2).map(_round_trip, EMULATOR, "normal", "bf16",
                                     {"dispatch_config": big, "combine_config": big})
    assert seen[0]["nvl_bytes"] >= vendor.ported_nvl_buffer_size_hint(big, 2 * H, 2)


def test_topk_index_dtype_follows_deep_ep_topk_idx_t(moe_rank_pools):
    """A DeepEP built with 32-bit top-k indices (``deep_ep.topk_idx_t`` = int32, da6ca24) asserts the dtype of every
    top-k tensor: the adapter sends ``topk_idx_t``."""
    for mode in ("normal", "low_latency"):
        for seen in moe_rank_pools.get(2).map(_round_trip, EMULATOR_TOPK_INT32, mode):
            assert seen["shape"] == (8, H)


def _combine_after_the_router_buffers_change(rank: int, world: int, mode: str, dtype: str):
    d = md.create_dispatcher(DeepEPBackend(EMULATOR), routed_spec(world, mode, dtype), env={})
    x, ids, w, other_ids = routed_inputs(rank, d.spec.num_experts)
    layer = ScaledLayer.for_rank(H, d.spec.num_experts, rank, PER_RANK)
    return tuple(routing_reuse(d, layer, x, ids, w, other_ids))


@pytest.mark.parametrize("mode,dtype", [("low_latency", "bf16"), ("low_latency", "fp8"), ("normal", "bf16"),
                                        ("normal", "fp8")])
def test_combine_uses_the_routing_given_to_its_dispatch(moe_rank_pools, mode, dtype):
    """DeepEP's LL combine reads ``topk_idx``/``topk_weights`` per token at combine (csrc/kernels/legacy/internode_ll.cu
    combine), and an engine may overwrite its router buffers after dispatch (CUDA-graph engines do): with the caller's
    ids and weights overwritten in place after dispatch (the kit's ``routing_reuse``: ids copied from another routing,
    w.mul_(0.5).add_(0.25)), combine's result is bit for bit the one without the overwrite, in both modes."""
    for repeatable, same, diff in moe_rank_pools.get(2).map(_combine_after_the_router_buffers_change, mode, dtype):
        assert repeatable, "the round trip itself is not repeatable: the comparison below would mean nothing"
        assert same, f"combine read the overwritten routing (max difference {diff})"


def _nvfp4_scale(rank, world):
    spec = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency",
                           output_dtype="nvfp4", quant=md.QuantHints(input_global_scale=448.0 * 6.0 / 5.0))
    d = md.create_dispatcher(DeepEPBackend(EMULATOR_NVFP4), spec, env={})
    gs = d.backend_dispatcher.x_global_scale
    x = torch.randn(4, H).to(torch.bfloat16)
    out = d.dispatch(x, torch.tensor([[0, 5]] * 4), torch.ones(4, 2))
    d.combine(torch.zeros(out.hidden_states.shape[:-1] + (H,), dtype=torch.bfloat16), out)
    seen = d.backend_dispatcher.buffer.calls[-1].x_global_scale
    return gs.dtype, gs.dim(), seen is gs


def test_nvfp4_global_scale_is_one_tensor_made_at_creation(moe_rank_pools):
    """hybrid-ep's ``x_global_scale`` is one 0-dim float32 tensor, made at creation on the layer's device and passed at
    every dispatch (a tensor built from the host float per dispatch is a host→device copy, which CUDA-graph capture
    refuses)."""
    assert moe_rank_pools.get(2).map(_nvfp4_scale) == [(torch.float32, 0, True)] * 2


# -- the release installed -----------------------------------------------------------------------------------


def test_low_latency_top_k_bound_follows_the_installed_deepep():
    """DeepEP's LL kernels take at most 9 experts per token before 9af0e0d (2025-09-15), 11 from it: the bound is the
    installed release's."""
    assert DeepEPBackend(EMULATOR).capabilities.limits_for(LL).max_top_k == 11
    old = DeepEPBackend(EMULATOR_V1_TOPK9)
    assert old.capabilities.limits_for(LL).max_top_k == 9
    with pytest.raises(md.InvalidSpecError) as info:
        old.check_spec(md.DispatchSpec(7168, 64, 10, mode="low_latency"), 8)
    assert info.value.parameter == "top_k" and info.value.allowed == "1..9"


def test_rdma_hint_has_no_extra_mebibyte():
    """DeepEP's ``get_rdma_buffer_size_hint`` adds no constant (no commit on main has one): the port, written out from
    csrc/legacy/config.hpp for the tuned EP16 configs."""
    spec = md.DispatchSpec(7168, 256, 8, output_dtype="bf16")
    _, rdma = DeepEPBackend(vendor.REAL).nvl_rdma_bytes(spec, 16)
    # Written out from csrc/legacy/config.hpp for the tuned EP16 configs (10 channels, 2 RDMA ranks).
    def hint(recv: int, send: int) -> int:
        recv = -(-recv // send) * send
        per_token = 2 * 7168 + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16
        total = 10 * 2 * (8 * 2 + 2) * 2 * 4 + 10 * 2 * recv * per_token * 2
        return -(-total // 128) * 128
    assert rdma == max(hint(128, 20), hint(128, 12))


def test_deep_gemm_on_sm100_needs_ue8m0_scales():
    """On compute capability 10.x DeepGEMM casts fp32 scales to UE8M0 (device-asserting powers of two from 2.6.1); on
    9.x it takes fp32 only. The runner picks the format per device, and refuses the other one with a typed error."""
    sm100, sm90 = DEEP_GEMM_EMULATOR_SM100, DEEP_GEMM_EMULATOR
    with pytest.raises(md.InvalidSpecError) as info:
        DeepGemmExperts("block_fp8", "low_latency", sm100, ue8m0=False)
    assert (info.value.parameter, info.value.value) == ("ue8m0", False) and "10" in str(info.value)
    with pytest.raises(md.InvalidSpecError) as info:
        DeepGemmExperts("block_fp8", "normal", sm90, ue8m0=True)
    assert (info.value.parameter, info.value.value) == ("ue8m0", True)
    assert DeepGemmExperts("block_fp8", "low_latency", sm100).quant_hints().fp8_ue8m0_scales is True
    assert DeepGemmExperts("block_fp8", "low_latency", sm90).quant_hints().fp8_ue8m0_scales is False


# -- limits DeepEP asserts -----------------------------------------------------------------------------------


def test_low_latency_needs_ranks_times_tokens_a_multiple_of_four():
    """``(num_ranks * T) % 4 == 0`` ("TMA requires the number of tokens to be multiple of 4", since @ebfe47e): T = 511
    on 2 ranks is refused, naming ``num_max_dispatch_tokens_per_rank``."""
    backend = DeepEPBackend(EMULATOR)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=511, mode="low_latency"), 2)
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank" and "4" in info.value.allowed
    backend.check_spec(md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=510, mode="low_latency"), 2)


def test_normal_mode_limits_are_deepeps():
    """Normal-mode kernels device-assert ``num_topk <= 32`` (not 128, which only the size hints reserve); intranode
    notify asserts at most 128 local experts, internode at most 64 (8 · local <= 512)."""
    backend = DeepEPBackend(EMULATOR)
    assert backend.capabilities.limits_for(NORMAL).max_top_k == 32
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 8 * 129, 8, output_dtype="bf16"), 8)
    assert info.value.parameter == "num_experts" and "128" in info.value.allowed
    with pytest.raises(md.InvalidSpecError):
        backend.check_spec(md.DispatchSpec(7168, 16 * 65, 8, output_dtype="bf16"), 16)
    backend.check_spec(md.DispatchSpec(7168, 16 * 64, 8, output_dtype="bf16"), 16)


def test_low_latency_runs_on_ep_sizes_without_a_normal_mode_config():
    """Low-latency mode needs no tuned config: it runs on EP sizes normal mode has none for (one rank, 6, 24; below 8 or
    a multiple of 8), which normal mode refuses."""
    backend = DeepEPBackend(EMULATOR)
    for world in (1, 6, 24):
        backend.check_spec(md.DispatchSpec(7168, 24 * 8, 8, mode="low_latency"), world)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 12 * 8, 8, output_dtype="bf16"), 6)
    assert info.value.parameter == "world_size"


def test_qp_depth_in_the_environment_bounds_low_latency_tokens(moe_rank_pools):
    """DeepEP reads ``NVSHMEM_QP_DEPTH`` (default 1024) in its constructor and the LL calls assert depth >= 2·(T+1): a
    smaller depth in the environment bounds T, a ``CapacityError`` at creation."""
    errors = moe_rank_pools.get(2).map(_create_error, EMULATOR, "low_latency", 200,
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


def test_a_shared_buffer_of_the_wrong_mode_is_a_typed_error(moe_rank_pools):
    """``options={"buffer": ...}`` with a Buffer DeepEP would refuse (a normal-mode buffer for low-latency dispatch, one
    too small) is an ``InvalidSpecError`` naming ``options.buffer`` at creation, not a failure inside DeepEP."""
    errors = moe_rank_pools.get(2).map(_shared_buffer_error)
    assert all(e == ("InvalidSpecError", "options.buffer") for e in errors), errors


def _shared_buffer_error(rank, world):
    fake = importlib.import_module(EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        normal = fake.Buffer(torch.distributed.group.WORLD, 1 << 24, 0)
    return _create_error(rank, world, EMULATOR, "low_latency", 8, {}, {"buffer": normal})


def test_deepep_needs_a_process_group():
    """``deep_ep.Buffer(group=None)`` raises ValueError ("Either 'group' or 'comm' must be provided."): without
    torch.distributed the adapter refuses with a typed error that says what to do."""
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")
    with pytest.raises(md.BackendUnavailableError) as info:
        md.create_dispatcher(DeepEPBackend(EMULATOR), spec, env={})
    assert "init_process_group" in str(info.value)


def _deterministic_error(rank, world):
    torch.use_deterministic_algorithms(True)
    try:
        return _create_error(rank, world, EMULATOR, "low_latency", 8, {})
    finally:
        torch.use_deterministic_algorithms(False)


def test_torch_deterministic_mode_is_refused_at_creation(moe_rank_pools):
    """DeepEP 2.x asserts in every dispatch/combine that torch's deterministic algorithms and
    ``fill_uninitialized_memory`` are not both on (``check_torch_deterministic``): a typed error at creation."""
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
    md.create_dispatcher(DeepEPBackend(EMULATOR), spec, env={})
    return sorted(k for k in set(os.environ) ^ set(before)) + sorted(
        k for k in before if k in os.environ and os.environ[k] != before[k])


# -- the fakes, as strict as DeepEP ---------------------------------------------------------------------------


def _ll_layout_range(rank, world, module_name):
    fake = importlib.import_module(module_name)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(8, H, world, 8),
                          low_latency_mode=True, num_qps_per_rank=4)
        ids = torch.tensor([[0, 1]] * 3 + [[4, 5]] * 2)  # 3 tokens to rank 0's experts 0, 1; 2 to rank 1's
        _, count, handle, _, _ = buf.low_latency_dispatch(torch.zeros(5, H, dtype=torch.bfloat16), ids, 8, 8,
                                                          use_fp8=False)
    return count.tolist(), handle[1].tolist()


def test_low_latency_layout_range_packs_the_count_in_the_low_word(moe_rank_pools):
    """``pack2<int, int64_t>(num_recv_tokens, recv_token_begin_idx)`` puts the count in the low 32 bits
    (csrc/kernels/legacy/internode_ll.cu dispatch; utils.cuh pack2)."""
    (counts, ranges), _ = moe_rank_pools.get(2).map(_ll_layout_range, EMULATOR)
    assert counts == [6, 6, 0, 0]  # rank 0's experts 0 and 1: 3 tokens from each of the 2 ranks
    assert ranges[0] == [3, (3 << 32) | 3]  # from rank 0: 3 rows at 0; from rank 1: 3 rows at 3
    assert ranges[2] == [0, 0]


def test_the_fake_config_is_the_vendors_pybind_class():
    """``deep_ep.Config`` has the hint methods DeepEP binds (positional), no fields, and pybind refuses what does not
    convert."""
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep as fake

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
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_hybrid as fake

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
    """The hybrid-ep branch takes ``topk_weights`` 5th and returns seven values with it."""
    for n, data_shape, weights_dtype in moe_rank_pools.get(2).map(_hybrid_positional):
        assert n == 7 and data_shape == (16, H // 2, 4) and weights_dtype == torch.float32


def _hybrid_scale(rank, world, gs):
    fake = fake_module(EMULATOR_NVFP4)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(8, H, 1, 2),
                          low_latency_mode=True, num_qps_per_rank=2)
    try:
        buf.low_latency_dispatch(torch.zeros(2, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 2), 8, 2,
                                 use_fp8=False, use_nvfp4=True, x_global_scale=gs)
    except (TypeError, RuntimeError) as exc:
        return type(exc).__name__
    finally:
        _native.reset_context()
    return None


def test_x_global_scale_is_a_float32_tensor(moe_rank_pools):
    """hybrid-ep reads ``x_global_scale->data_ptr<float>()``: a Python float does not convert (pybind), another dtype is
    c10's 'expected scalar type Float'."""
    pool = moe_rank_pools.get(1)
    assert pool.map(_hybrid_scale, 100.0) == ["TypeError"]
    assert pool.map(_hybrid_scale, torch.tensor(100.0, dtype=torch.float64)) == ["RuntimeError"]
    assert pool.map(_hybrid_scale, torch.tensor(100.0)) == [None]


def test_the_fake_fp8_cast_multiplies_as_the_kernel_does():
    """The LL kernel's FP8 cast: ``scale = 448/amax``, values times scale (SATFINITE), ``scale_inv = amax · (1/448f)``;
    with ``round_scale`` the exponent by bits (``fast_log2_ceil``)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * 3).to(torch.bfloat16)
    data, inv = fake_module()._quantize_fp8(x, False)
    amax = x.float().abs().amax(1, keepdim=True).clamp(min=1e-4)
    want = (x.float() * (torch.tensor(448.0) / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(inv, (amax * torch.tensor(1 / 448.0, dtype=torch.float32)).squeeze(1).unsqueeze(1))
    _, rounded = fake_module()._quantize_fp8(torch.full((1, 128), 2.0**30).to(torch.bfloat16), True)
    assert rounded.item() == 2.0**22  # 2^fast_log2_ceil(2^30 · (1/448f))


def _ll_receive(rank, world, hook=False):
    fake = fake_module()
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(16, H, 1, 2),
                          low_latency_mode=True, num_qps_per_rank=2)
    x = torch.arange(12, dtype=torch.float32).repeat_interleave(H).view(12, H).to(torch.bfloat16)
    recv, count, handle, _, got_hook = buf.low_latency_dispatch(x, torch.tensor([[0, 1]] * 12), 16, 2,
                                                                use_fp8=False, return_recv_hook=hook)
    if hook:
        before = bool(torch.isnan(recv[0, :12].float()).all())
        got_hook()
        return before, bool(torch.isnan(recv[0, 12:].float()).all()), recv[0, :12, 0].tolist()
    return got_hook, bool(torch.isnan(recv[0, 12:].float()).all()), recv[0, :12, 0].tolist()


def test_receive_rows_are_garbage_past_the_count_in_any_order_and_no_hook(moe_rank_pools):
    """DeepEP allocates the receive tensors with ``torch::empty`` and places rows in atomicAdd order; the hook is None
    unless ``return_recv_hook``, and with it the data is there only after the hook."""
    ((hook, padding_nan, order),) = moe_rank_pools.get(1).map(_ll_receive)
    assert hook is None and padding_nan
    assert sorted(order) == list(range(12)) and order != list(range(12))
    ((before, padding_nan, order),) = moe_rank_pools.get(1).map(_ll_receive, True)
    assert before and padding_nan and sorted(order) == list(range(12))


def _trap_then_call(rank, world):
    fake = fake_module()
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(8, H, 1, 8),
                              low_latency_mode=True, num_qps_per_rank=1)  # fewer QPs than the 8 local experts
        x, ids = torch.zeros(2, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 2)
        first = second = None
        try:
            buf.low_latency_dispatch(x, ids, 8, 8, use_fp8=False)
        except RuntimeError as exc:
            first = str(exc)
        try:
            fake.Buffer.get_low_latency_rdma_size_hint(8, H, 1, 8)
            fake.Buffer(torch.distributed.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=8)
        except RuntimeError as exc:
            second = str(exc)
        return first, second
    finally:
        _native.reset_context()


def test_a_device_assert_poisons_the_context(moe_rank_pools):
    """``EP_DEVICE_ASSERT`` traps (``unspecified launch failure``) and every later CUDA call of the process fails."""
    ((first, second),) = moe_rank_pools.get(1).map(_trap_then_call)
    assert "unspecified launch failure" in first and "num_rc_per_pe" in first
    assert second and "unspecified launch failure" in second


def test_the_fake_bool_caster_converts_as_pybind():
    """pybind11's bool caster (convert pass) takes None and anything with ``__bool__`` (numbers), not a string."""
    native = _native
    assert native.is_bool(None) and native.is_bool(1.5) and native.is_bool(True) and not native.is_bool("yes")


def _finalize_under_a_live_buffer(rank, world):
    fake = fake_module()
    size = vendor.ported_low_latency_rdma_size_hint(8, H, world, 8)
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            kept = fake.Buffer(torch.distributed.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=4)
            dropped = fake.Buffer(torch.distributed.group.WORLD, 0, size, low_latency_mode=True,
                                  num_qps_per_rank=4, explicitly_destroy=True)
        dropped.destroy()  # nvshmem::finalize() for the whole process
        try:
            kept.low_latency_dispatch(torch.zeros(2, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 2), 8, 8,
                                      use_fp8=False)
        except RuntimeError as exc:
            return str(exc)
        return None
    finally:
        _native.reset_context()
        fake.reset_nvshmem()


def test_the_fake_models_one_nvshmem_per_process(moe_rank_pools):
    """NVSHMEM is per process: ``destroy`` runs ``nvshmem_finalize`` for the process, so a Buffer still alive loses its
    memory; a second LL Buffer past 8 ranks fails the team split's assert."""
    errors = moe_rank_pools.get(2).map(_finalize_under_a_live_buffer)
    assert all(e and "finalize" in e for e in errors), errors
    fake = fake_module()
    state = fake.NvshmemState()
    state.init(3, 16, team_split_stride=8)
    with pytest.raises(RuntimeError, match="cpu_rdma_team == NVSHMEM_TEAM_INVALID"):
        state.init(3, 16, team_split_stride=8)  # a second LL Buffer past 8 ranks in one process


def test_the_fake_nvshmem_refuses_another_pe_numbering():
    """DeepEP asserts the PE NVSHMEM reports (``nvshmem_rank == nvshmem::init(...)``): a normal-mode Buffer past 8 ranks
    (PE ``rdma_rank`` of the nodes) then an LL Buffer (PE ``rank``) fail it on every rank but the first of each node;
    the same numbering twice is allowed and counted (hardware settles it)."""
    state = fake_module().NvshmemState()
    state.init(*vendor.nvshmem_pe(13, 16, False), 0)
    with pytest.raises(RuntimeError, match=r"nvshmem_rank == nvshmem::init"):
        state.init(*vendor.nvshmem_pe(13, 16, True), 8)
    again = fake_module().NvshmemState()
    again.init(0, 2, 0)
    again.init(0, 2, 0)  # the same numbering: allowed and counted (hardware settles it)
    assert again.live_inits == 2
