"""The independent audit of 2026-11 (VENDOR.md, "Independent audit"): one test per non-OK row.

Names: ``test_ep<row>_...`` for the DeepEP audit, ``test_dg<row>_...`` for the DeepGEMM audit. Each CRASH and
WRONG row's test failed on the code before its fix (the failing output is in the report of that change).
"""

import importlib
import inspect
import subprocess
import types

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import make_codec
from moe_dispatch.backend import restored_environ
from moe_dispatch_testing.routing import random_expert_weights
from moe_dispatch_cuda_deepep import hardware, vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts, quantize_block_fp8, quantize_per_token_group

H = 2048
LL, NORMAL = md.Mode.LOW_LATENCY, md.Mode.NORMAL
SM90, SM100 = vendor.DEEP_GEMM_EMULATOR, vendor.DEEP_GEMM_EMULATOR_SM100


def _fake(name=vendor.EMULATOR):
    return importlib.import_module(name)


def _native():
    return importlib.import_module("moe_dispatch_cuda_deepep.fakes._native")


# =====================================================================================================
# DeepEP
# =====================================================================================================


def test_ep05_internode_normal_qps_cover_the_configs_sms():
    """Row 5: internode dispatch device-asserts ``num_rc_per_pe == num_channels or >= num_sms``; the adapter
    passed 24 QPs whatever the configs' SMs."""
    fields = vendor.ConfigFields(32, 6, 288, 12, 128)
    spec = md.DispatchSpec(7168, 16 * 8, 8, output_dtype="bf16")
    request = DeepEPBackend(vendor.EMULATOR).buffer_request(spec, 16, {"dispatch_config": fields,
                                                                      "combine_config": fields})
    assert request.num_sms == 32 and vendor.internode_qps_ok(request.num_qps_per_rank, 32)
    assert not vendor.internode_qps_ok(24, 32) and vendor.internode_qps_ok(16, 32)
    with pytest.raises(RuntimeError, match="num_rc_per_pe"):  # the fake's internode checks say the same
        _fake().internode_dispatch_checks(16, 24, fields, 7168 * 2, 0, 8)


def test_ep06_low_latency_ep_sizes_are_below_8_or_multiples_of_8():
    """Row 6: ``EP_HOST_ASSERT(num_ranks < 8 or num_ranks % 8 == 0)`` holds in every mode."""
    backend = DeepEPBackend(vendor.EMULATOR)
    for world in (1, 6, 16, 24):
        backend.check_spec(md.DispatchSpec(7168, 48 * 8, 8, mode="low_latency"), world)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 12 * 8, 8, mode="low_latency"), 12)
    assert info.value.parameter == "world_size" and "multiple of 8" in info.value.allowed


def _two_layers(rank, world, tokens_first, tokens_second, options_first=None):
    backend = DeepEPBackend(vendor.EMULATOR)
    specs = [md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=t, mode="low_latency",
                             output_dtype="bf16") for t in (tokens_first, tokens_second)]
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        first = md.create_dispatcher(backend, specs[0], env={}, options=options_first)
        try:
            second = md.create_dispatcher(backend, specs[1], env={})
        except md.MoEDispatchError as exc:
            backend.close()
            return type(exc).__name__, exc.parameter, str(exc)
    same = first.backend_dispatcher.buffer is second.backend_dispatcher.buffer
    x = torch.randn(4, H).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1]] * 4), torch.ones(4, 2)
    for d in (first, second, first):  # both layers, interleaved, on the one Buffer
        out = d.dispatch(x, ids, w)
        d.combine(out.hidden_states, out)
    backend.close()  # the Buffer is the process's: closed, the next call starts from none
    return same


def test_ep07_layers_share_one_buffer_per_group_and_mode(moe_rank_pools):
    """Row 7: every dispatcher made its own ``deep_ep.Buffer`` (NVSHMEM started per layer; with more than 8
    ranks the second LL Buffer fails DeepEP's team assert, and a collected one finalizes NVSHMEM under the
    others). Layers now share the process's Buffer (round two: per process, not per backend object); a later,
    larger layer is a typed error that says how to pre-size, and ``options["buffer_bytes"]`` does."""
    pool = moe_rank_pools.get(2)
    assert pool.map(_two_layers, 8, 8) == [True, True]
    errors = pool.map(_two_layers, 8, 64)
    assert all(e[:2] == ("CapacityError", "options.buffer_bytes") and "largest layer first" in e[2] for e in errors)
    planned = vendor.ported_low_latency_rdma_size_hint(64, H, 2, 8)
    assert pool.map(_two_layers, 8, 64, {"buffer_bytes": planned}) == [True, True]


def _finalize_under_a_live_buffer(rank, world):
    fake = _fake()
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
        _native().reset_context()
        fake.reset_nvshmem()


def test_ep07_the_fake_models_one_nvshmem_per_process(moe_rank_pools):
    """Row 51/7: ``destroy`` runs ``nvshmem_finalize`` for the process; a Buffer still alive loses its memory."""
    errors = moe_rank_pools.get(2).map(_finalize_under_a_live_buffer)
    assert all(e and "finalize" in e for e in errors), errors
    fake = _fake()
    state = fake.NvshmemState()
    state.init(3, 16, team_split_stride=8)
    with pytest.raises(RuntimeError, match="cpu_rdma_team == NVSHMEM_TEAM_INVALID"):
        state.init(3, 16, team_split_stride=8)  # a second LL Buffer past 8 ranks in one process


def _normal_then_low_latency(rank, world, clean_first=False):
    fake = _fake()
    spec_n = md.DispatchSpec(H, 4 * world, 2, output_dtype="bf16")
    spec_l = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency",
                             output_dtype="bf16")
    backend = DeepEPBackend(vendor.EMULATOR)
    nvl, _ = backend.nvl_rdma_bytes(spec_n, world)
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            shared = fake.Buffer(torch.distributed.group.WORLD, nvl,
                                 vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world),
                                 low_latency_mode=True, num_qps_per_rank=4)
            normal = md.create_dispatcher(backend, spec_n, env={}, options={"buffer": shared})
            low = md.create_dispatcher(backend, spec_l, env={}, options={"buffer": shared})
        x = torch.randn(4, H).to(torch.bfloat16)
        ids, w = torch.tensor([[0, 4]] * 4), torch.ones(4, 2)
        for d in (low, normal, low):
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        return "ok"
    except RuntimeError as exc:
        return str(exc)
    finally:
        _native().reset_context()


def test_ep08_low_latency_after_normal_use_of_a_shared_buffer_is_cleaned(moe_rank_pools):
    """Rows 8, 54: after normal dispatch/combine on a Buffer, DeepEP's LL kernels read stale signalling counts
    unless ``clean_low_latency_buffer`` runs first (legacy.py docstring). Round two (rows 31, 38): only internode
    normal-mode kernels write them, so within 8 ranks this sequence needs no clean and runs; past 8 ranks the
    adapter cleans at once after each normal-mode combine (test_audit2_2026_11.py)."""
    assert moe_rank_pools.get(2).map(_normal_then_low_latency) == ["ok", "ok"]


def test_ep16_user_configs_must_be_readable():
    """Row 16: an opaque ``deep_ep.Config`` hides its SMs, so a tuned config of another SM count passed creation
    and failed at the first combine (``channel_prefix_matrix.size(1) == num_channels``)."""
    spec = md.DispatchSpec(H, 8, 2, output_dtype="fp8")
    with pytest.raises(md.InvalidSpecError) as info:
        DeepEPBackend(vendor.EMULATOR).check_options(spec, 2, {"dispatch_config": _fake().Config(24, 6, 256, 6, 128)})
    assert info.value.parameter == "options.dispatch_config" and "ConfigFields" in info.value.allowed
    with pytest.raises(md.InvalidSpecError, match="num_sms"):  # the other one is tuned: Buffer.num_sms = 20
        DeepEPBackend(vendor.EMULATOR).check_options(spec, 2, {"dispatch_config": vendor.ConfigFields(24, 6, 256, 6,
                                                                                                      128)})


def test_ep17_internode_combine_config_asserts():
    """Row 17: ``internode::combine`` host-asserts on the config past 8 ranks (nvl recv a multiple of the RDMA
    ranks, room for the forwarder warps)."""
    backend = DeepEPBackend(vendor.EMULATOR)
    spec = md.DispatchSpec(7168, 24 * 8, 8, output_dtype="bf16")
    bad = vendor.ConfigFields(20, 6, 256, 6, 128)  # 256 % 3 != 0
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_options(spec, 24, {"dispatch_config": bad, "combine_config": bad})
    assert info.value.parameter == "options.combine_config" and "% num_rdma_ranks" in str(info.value)
    good = vendor.ConfigFields(20, 6, 288, 8, 128)
    backend.check_options(spec, 24, {"dispatch_config": good, "combine_config": good})


def _intranode_hidden_8192(rank, world):
    fake = _fake()
    cfg = fake.Buffer.get_dispatch_config(world)
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            buf = fake.Buffer(torch.distributed.group.WORLD, cfg.get_nvl_buffer_size_hint(2 * 8192, world))
        ids = torch.tensor([[0, 4]] * 2)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 8)
        buf.dispatch(torch.zeros(2, 8192, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
                     topk_weights=torch.ones(2, 2), config=cfg)
    except RuntimeError as exc:
        return str(exc)
    finally:
        _native().reset_context()
    return None


def test_ep24_ep25_normal_hidden_limits(moe_rank_pools):
    """Rows 24, 25, 50: the normal kernels stage a token in TMA shared memory: within a node half the hidden
    bytes + 8 <= 8192 (BF16 H < 8192), across nodes a whole token + 8 <= 16384 and the BF16 combine's
    ``hidden_int4 % 32`` (H % 256)."""
    backend = DeepEPBackend(vendor.EMULATOR)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.buffer_size(md.DispatchSpec(8192, 64, 8, output_dtype="bf16"), 8)
    assert info.value.parameter == "hidden_size"
    backend.buffer_size(md.DispatchSpec(8192, 64, 8, output_dtype="fp8"), 8)  # FP8 halves the bytes
    with pytest.raises(md.InvalidSpecError):
        backend.buffer_size(md.DispatchSpec(7168 + 128, 16 * 8, 8, output_dtype="fp8"), 16)  # BF16 combine: H % 256
    backend.buffer_size(md.DispatchSpec(7168, 16 * 8, 8, output_dtype="fp8"), 16)
    errors = moe_rank_pools.get(2).map(_intranode_hidden_8192)
    assert all(e and "unspecified launch failure" in e for e in errors), errors


def test_ep26_top_k_past_eight_nodes():
    """Row 26: internode dispatch sends a token to at most 8 RDMA ranks (``num_topk_ranks <= kNumTopkRDMARanks``);
    past 64 ranks a top-k above 8 can span more nodes."""
    backend = DeepEPBackend(vendor.EMULATOR)
    backend.check_spec(md.DispatchSpec(7168, 64 * 8, 9, output_dtype="bf16"), 64)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 128 * 2, 9, output_dtype="bf16"), 128)
    assert info.value.parameter == "top_k" and info.value.allowed == "1..8"


def test_ep28_rdma_ranks_of_deepep_1_1():
    """Row 28: DeepEP 1.1.0 lost RDMA ranks 3, 18 and 20 on 2025-06-24 (bc118b2) and got 18/20 back only on
    2025-08-11 (d9767ce): the safe set for 1.1.x is {2, 4, 8, 16}."""
    v11 = vendor.release_of(types.SimpleNamespace(__version__="1.1.0"))
    assert v11.rdma_ranks == {2, 4, 8, 16} and 24 not in v11.world_sizes
    v10 = vendor.release_of(types.SimpleNamespace(__version__="1.0.0"))
    assert v10.rdma_ranks == {2, 3, 4, 8, 16, 18, 20}


def _nvfp4_scale(rank, world):
    spec = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency",
                           output_dtype="nvfp4", quant=md.QuantHints(input_global_scale=448.0 * 6.0 / 5.0))
    d = md.create_dispatcher(DeepEPBackend(vendor.EMULATOR_NVFP4), spec, env={})
    gs = d.backend_dispatcher.x_global_scale
    x = torch.randn(4, H).to(torch.bfloat16)
    out = d.dispatch(x, torch.tensor([[0, 5]] * 4), torch.ones(4, 2))
    d.combine(torch.zeros(out.hidden_states.shape[:-1] + (H,), dtype=torch.bfloat16), out)
    seen = d.backend_dispatcher.buffer.calls[-1].x_global_scale
    return gs.dtype, gs.dim(), seen is gs


def test_ep42_nvfp4_global_scale_is_one_tensor_made_at_creation(moe_rank_pools):
    """Row 42: the dispatcher built a CUDA tensor from a host float on every dispatch (a host→device copy,
    which CUDA-graph capture refuses). Now one 0-dim float32 tensor, made at creation and passed every call."""
    assert moe_rank_pools.get(2).map(_nvfp4_scale) == [(torch.float32, 0, True)] * 2


def test_ep38_low_latency_needs_two_experts_and_few_warp_groups():
    """Row 38: the LL dispatch kernel device-asserts ``num_sms > 1`` (one expert) and ``num_warp_groups < 15``
    (``ceil(E / device SMs)``)."""
    backend = DeepEPBackend(vendor.EMULATOR)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 1, 1, mode="low_latency"), 1)
    assert info.value.parameter == "num_experts"
    with pytest.raises(md.InvalidSpecError, match="warp groups"):
        backend.check_spec(md.DispatchSpec(7168, 15 * vendor.H100_NUM_SMS, 8, mode="low_latency"), 4)


def test_ep55_the_one_rank_normal_probe_cannot_kill_the_check():
    """Rows 55, 51: a one-rank normal-mode Buffer throws from its noexcept destructor (``intranode::barrier``
    has no case for one rank): ``std::terminate``. The fake aborts the same way; the hardware check runs the probe
    in a subprocess and records its exit status and DeepEP's words."""
    probe = hardware.run_probe(hardware.PROBE_NORMAL_ONE_RANK, fake=True)
    assert probe.exit_code != 0 and "Unsupported ranks" in probe.output and "terminate called" in probe.output
    assert "the Buffer was freed" not in probe.output  # the process died in the destructor


# -- the fakes (rows 46-54) -------------------------------------------------------------------------------


def _trap_then_call(rank, world):
    fake = _fake()
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
        _native().reset_context()


def test_ep46_a_device_assert_poisons_the_context(moe_rank_pools):
    """Row 46: ``EP_DEVICE_ASSERT`` traps (``unspecified launch failure``) and every later CUDA call fails."""
    ((first, second),) = moe_rank_pools.get(1).map(_trap_then_call)
    assert "unspecified launch failure" in first and "num_rc_per_pe" in first
    assert second and "unspecified launch failure" in second


def test_ep47_the_fake_fp8_cast_multiplies_as_the_kernel_does():
    """Row 47: ``scale = 448/amax``, values times scale (SATFINITE), ``scale_inv = amax · (1/448f)``; with
    ``round_scale`` the exponent by bits (``fast_log2_ceil``)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * 3).to(torch.bfloat16)
    data, inv = _fake()._quantize_fp8(x, False)
    amax = x.float().abs().amax(1, keepdim=True).clamp(min=1e-4)
    want = (x.float() * (torch.tensor(448.0) / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(inv, (amax * torch.tensor(1 / 448.0, dtype=torch.float32)).squeeze(1).unsqueeze(1))
    _, rounded = _fake()._quantize_fp8(torch.full((1, 128), 2.0**30).to(torch.bfloat16), True)
    assert rounded.item() == 2.0**22  # 2^fast_log2_ceil(2^30 · (1/448f))


def _ll_receive(rank, world, hook=False):
    fake = _fake()
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


def test_ep48_ep49_receive_rows_are_garbage_past_the_count_in_any_order_and_no_hook(moe_rank_pools):
    """Rows 48, 49: DeepEP allocates the receive tensors with ``torch::empty`` and places rows in atomicAdd
    order; the hook is None unless ``return_recv_hook``, and with it the data is there only after the hook."""
    ((hook, padding_nan, order),) = moe_rank_pools.get(1).map(_ll_receive)
    assert hook is None and padding_nan
    assert sorted(order) == list(range(12)) and order != list(range(12))
    ((before, padding_nan, order),) = moe_rank_pools.get(1).map(_ll_receive, True)
    assert before and padding_nan and sorted(order) == list(range(12))


def _hybrid_scale(rank, world, gs):
    fake = _fake(vendor.EMULATOR_NVFP4)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(torch.distributed.group.WORLD, 0, vendor.ported_low_latency_rdma_size_hint(8, H, 1, 2),
                          low_latency_mode=True, num_qps_per_rank=2)
    try:
        buf.low_latency_dispatch(torch.zeros(2, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 2), 8, 2,
                                 use_fp8=False, use_nvfp4=True, x_global_scale=gs)
    except (TypeError, RuntimeError) as exc:
        return type(exc).__name__
    finally:
        _native().reset_context()
    return None


def test_ep52_x_global_scale_is_a_float32_tensor(moe_rank_pools):
    """Row 52: hybrid-ep reads ``x_global_scale->data_ptr<float>()``: a Python float does not convert (pybind),
    another dtype is c10's 'expected scalar type Float'."""
    pool = moe_rank_pools.get(1)
    assert pool.map(_hybrid_scale, 100.0) == ["TypeError"]
    assert pool.map(_hybrid_scale, torch.tensor(100.0, dtype=torch.float64)) == ["RuntimeError"]
    assert pool.map(_hybrid_scale, torch.tensor(100.0)) == [None]


def test_ep53_the_fake_bool_caster_converts_as_pybind():
    """Row 53: pybind11's bool caster (convert pass) takes None and anything with ``__bool__`` (numbers)."""
    native = _native()
    assert native.is_bool(None) and native.is_bool(1.5) and native.is_bool(True) and not native.is_bool("yes")


def test_ep57_hardware_signatures_follow_the_installed_release():
    """Row 57: a 1.2.1 build was compared with main's ``Buffer.__init__`` (which has ``enable_shrink``)."""
    for name in (vendor.EMULATOR_V1_TOPK9, vendor.EMULATOR_NVFP4, vendor.EMULATOR):
        rows = hardware.signature_rows(_fake(name), hardware.signature_records(_fake(name)), "signature")
        assert all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_ep58_wire_seen_reads_the_fakes_only():
    """Row 58: ``wire_seen`` read ``Buffer.calls`` (the fakes' record) but defaulted to the real DeepEP."""
    from moe_dispatch_cuda_deepep.selfcheck import wire_seen

    assert inspect.signature(wire_seen).parameters["vendor_module"].default == vendor.EMULATOR


# =====================================================================================================
# DeepGEMM
# =====================================================================================================

E, I = 4, 128


def _weights(experts=E, hidden=256, inter=I):
    return random_expert_weights(experts, hidden, inter, generator=torch.Generator().manual_seed(0))


def _masked_rows(capacity, hidden=256):
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, hidden)).quantize(
        torch.randn(E, capacity, hidden, generator=torch.Generator().manual_seed(1)))
    return q.data, q.scale


def test_dg15_masked_capacity_is_a_multiple_of_every_block_m():
    """Row 15: DeepGEMM's masked GEMM stores whole BLOCK_M tiles into a ``[G·m, n]`` view: with ``m`` not a
    multiple of BLOCK_M an expert's last tile overwrites the next expert's first rows. The runner refuses such
    a capacity (typed), the backend refuses the spec at creation, and the fake writes whole tiles."""
    experts = DeepGemmExperts("block_fp8", LL, SM90)
    assert experts.masked_capacity_multiple == 128  # 2.6.1 on SM90: BLOCK_M 64 or 128
    layer = experts.process_weights(_weights())
    x, scale = _masked_rows(8)
    with pytest.raises(md.InvalidInputError) as info:
        experts.apply_without_routing_weights(layer, x, scale, 1, torch.tensor([3, 0, 8, 1]), torch.bfloat16)
    assert info.value.parameter == "hidden_states" and "128" in info.value.allowed
    backend = DeepEPBackend(vendor.EMULATOR)
    spec = md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=8, mode="low_latency", runner="deep_gemm")
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(spec, 2)
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank"
    backend.check_spec(md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=128, mode="low_latency",
                                       runner="deep_gemm"), 2)
    # The fake: expert 0's last tile spills NaN into expert 1's rows, as the TMA store does.
    fake = _fake(SM90)
    a, sa = _masked_rows(8)
    b, sb = quantize_block_fp8(torch.randn(E, 128, 256, generator=torch.Generator().manual_seed(2)))
    d = torch.zeros(E, 8, 128, dtype=torch.bfloat16)
    fake.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0, 0, 0], dtype=torch.int32), 8)
    assert torch.isnan(d[0, 3:]).all() and torch.isnan(d[1]).all()


def test_dg15_the_masked_block_ms_per_version():
    """Row 15: which BLOCK_M each DeepGEMM may pick for a masked GEMM."""
    def info(version, generation="v2"):
        return vendor.DeepGemmInfo("deep_gemm", object(), generation, True, version=version)

    assert vendor.dg_masked_block_ms(info(None), 9) == {64, 128, 256}  # 2.0.0 (before and after 79f48ee), 2.1.0
    assert vendor.dg_masked_block_ms(info("2.3.0"), 10) == {64, 128}
    assert vendor.dg_masked_block_ms(info("2.6.1"), 10, mk_alignment=128) == {128}
    assert vendor.dg_masked_block_ms(info("2.6.1"), 9) == {64, 128}
    assert vendor.dg_masked_block_ms(info(None, "v1"), 9) == {64, 128, 256}
    assert vendor.dg_masked_block_ms(None, None) == {64, 128, 256}  # planning: every version


def test_dg23_sm100_bf16_needs_16_byte_rows():
    """Row 23: TMA descriptors need 16-byte global strides: gmm2's ``[rows, I]`` BF16 rows need I % 8 == 0
    (``cuTensorMapEncodeTiled`` fails otherwise, an untyped CUDA driver error)."""
    with pytest.raises(md.InvalidInputError) as info:
        DeepGemmExperts("bf16", LL, SM100).process_weights(_weights(2, 256, 100))
    assert info.value.parameter == "intermediate_size"
    DeepGemmExperts("bf16", LL, SM100).process_weights(_weights(2, 256, 96))
    fake = _fake(SM100)
    a = torch.zeros(2, 128, 100, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA driver"):
        fake.m_grouped_bf16_gemm_nt_masked(a, torch.zeros(2, 256, 100, dtype=torch.bfloat16),
                                           torch.empty(2, 128, 256, dtype=torch.bfloat16),
                                           torch.tensor([1, 1], dtype=torch.int32), 1)


def test_dg24_pypi_v1_cannot_compile_odd_k_blocks():
    """Row 24: DeepGEMM v1 at b05ed2f (PyPI 1.0.0) static-asserts "Misaligned barriers" when ceil(K/128) is odd
    and BLOCK_N divides 128 (removed by 6c5da03). Without ``wgrad_gemm_fp8_fp8_fp32_nt`` (added after the fix)
    the runner refuses odd ceil(I/128) and ceil(H/128)."""
    old = DeepGemmExperts("block_fp8", LL, vendor.DEEP_GEMM_V1_PYPI_EMULATOR)
    with pytest.raises(md.InvalidInputError) as info:
        old.process_weights(_weights(E, 256, 128))
    assert info.value.parameter == "intermediate_size"
    old.process_weights(_weights(E, 256, 256))
    DeepGemmExperts("block_fp8", LL, vendor.DEEP_GEMM_V1_EMULATOR).process_weights(_weights(E, 256, 128))
    kernels = importlib.import_module("moe_dispatch_cuda_deepep.fakes.deep_gemm_v1_kernels")
    with pytest.raises(subprocess.CalledProcessError):
        kernels.CpuJitTuner().compile_and_tune("m_grouped_gemm_fp8_fp8_bf16_nt", {
            "N": 256, "K": 128, "BLOCK_M": 64, "BLOCK_N": 16, "NUM_GROUPS": 4, "GEMM_TYPE": "GroupedMasked"},
            (), (), (), "", ())


def test_dg29_sm100_k_major_fp32_scales_assert():
    """Row 29: on the CUDA path ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` asserts MN-major fp32 input."""
    fake = _fake(SM100)
    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    sfa = torch.ones(128, 4)[:, :2]  # non-contiguous, K-major (stride(-1) == 1)
    b, sb = quantize_block_fp8(torch.randn(1, 128, 256, generator=torch.Generator().manual_seed(3)), ue8m0=True)
    with pytest.raises(RuntimeError, match="stride"):
        fake.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sb), torch.empty(128, 128, dtype=torch.bfloat16),
                                              torch.zeros(128, dtype=torch.int32))


def test_dg30_dg31_the_contiguous_block_takes_its_first_rows_group():
    """Rows 30, 31: DeepGEMM reads a block's group from its first row (``max(0, -1) = 0``); -1 may only follow
    valid rows. Padding rows are unspecified on both architectures (NaN in the fakes)."""
    a = torch.ones(256, 256, dtype=torch.float8_e4m3fn)
    b, sb = quantize_block_fp8(torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(4)))
    sa = torch.ones(256, 2)
    leading_padding = torch.cat([-torch.ones(28), torch.ones(100), torch.zeros(128)]).to(torch.int32)
    with pytest.raises(RuntimeError, match="first row"):
        _fake(SM90).m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), torch.empty(256, 128, dtype=torch.bfloat16),
                                                     leading_padding)
    ids = torch.cat([torch.ones(100), -torch.ones(28), torch.zeros(128)]).to(torch.int32)
    b1, sb1 = quantize_block_fp8(torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(4)), ue8m0=True)
    d = torch.empty(256, 128, dtype=torch.bfloat16)
    _fake(SM100).m_grouped_fp8_gemm_nt_contiguous((a, torch.ones(256, 2)), (b1, sb1), d, ids)
    assert torch.isnan(d[100:128]).all() and not torch.isnan(d[:100]).any()


def test_dg33_masked_m_past_m_is_the_fakes_refusal():
    """Row 33: DeepGEMM has no ``masked_m <= m`` check; the fake refuses and says so."""
    a, sa = _masked_rows(128)
    b, sb = quantize_block_fp8(torch.randn(E, 128, 256, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(RuntimeError, match=r"^\(fake\)"):
        _fake(SM90).m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), torch.empty(E, 128, 128, dtype=torch.bfloat16),
                                                 torch.tensor([129, 0, 0, 0], dtype=torch.int32), 8)


def test_dg34_emulated_versions_differ_as_deep_gemm_did():
    """Row 34: the 4th parameter was ``m_indices`` up to 2.2.0; ``set_mk_alignment_…`` arrived in 2.4.2."""
    emulate = _fake(SM90).emulate
    old, mid, new = emulate((9, 0), "2.2.0"), emulate((9, 0), "2.3.0"), emulate((9, 0), "2.4.2")
    assert list(inspect.signature(getattr(old, vendor.DG_FP8_CONTIGUOUS)).parameters)[3] == "m_indices"
    assert list(inspect.signature(getattr(mid, vendor.DG_FP8_CONTIGUOUS)).parameters)[3] == "grouped_layout"
    assert not hasattr(mid, vendor.DG_SET_MK_ALIGNMENT) and hasattr(new, vendor.DG_SET_MK_ALIGNMENT)


def test_dg35_the_fake_converts_arguments_as_pybind():
    """Row 35: bool arguments take None (pybind's convert pass); ``expected_m_for_psum_layout`` is an optional
    int."""
    fake = _fake(SM90)
    a = torch.zeros(128, 256, dtype=torch.bfloat16)
    b = torch.zeros(1, 128, 256, dtype=torch.bfloat16)
    d, ids = torch.empty(128, 128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.int32)
    fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ids, "nk", None, None)
    with pytest.raises(TypeError, match="incompatible"):
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ids, expected_m_for_psum_layout=1.5)


def test_dg40_the_vendors_layout_functions_are_used_when_installed():
    """Row 40: ``get_tma_aligned_size`` (and the MN-major packing) come from the installed DeepGEMM; the port is
    the fallback."""
    stub = types.SimpleNamespace(get_tma_aligned_size=lambda mn, size: 1000 + mn)
    assert vendor.dg_tma_aligned_size(stub, 5, 4) == 1005
    assert vendor.dg_tma_aligned_size(None, 5, 4) == 8
    fake = _fake(SM100)
    sf = torch.exp2(torch.randint(-5, 5, (3, 130, 8)).float())
    packed = vendor.dg_packed_ue8m0_mn_major(fake, sf)
    assert packed.dtype == torch.int32 and packed.stride(-1) == 132 and packed.stride(-2) == 1
    assert torch.equal(packed, vendor.dg_packed_ue8m0_mn_major(None, sf))


def test_dg19_power_of_two_scales_by_bits():
    """Row 19: ``exp2(ceil(log2(s)))`` rounds log2 to float first: for s just above 2^16 it gives 2^16 < s. The
    runner takes them by bits (the core's ``pow2_ceil``, as DeepGEMM's ``ceil_to_ue8m0``)."""
    from moe_dispatch.backend import pow2_ceil

    s = torch.tensor([65536 * (1 + 2**-23), 3.0, 0.25])
    assert pow2_ceil(s).tolist() == [131072.0, 4.0, 0.25]
    _, scale = quantize_per_token_group(torch.full((1, 128), 448.0 * 65536 * (1 + 2**-23)), ue8m0=True)
    assert scale.item() == 131072.0
