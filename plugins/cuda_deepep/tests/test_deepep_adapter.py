"""The DeepEP adapter beyond the kit: size formulas against DeepEP's numbers, the dtype that
reaches the vendor call, buffers shared by dispatch and combine, and the plugin as installed."""

import importlib
import io
import os
from contextlib import redirect_stdout

import pytest

import moe_dispatch as md
import moe_dispatch.planning as mdp
from moe_dispatch.backend import restored_environ
from moe_dispatch.cli import main
from moe_dispatch_cuda_deepep import sizes, vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.vendor import detect
from moe_dispatch_cuda_deepep_testing import EMULATOR, EMULATOR_NVFP4
from moe_dispatch_cuda_deepep_testing.fakes.deep_ep import Buffer, Config
from moe_dispatch_cuda_deepep_testing.selfcheck import agree_with_torch, wire_seen

H = 7168


@pytest.mark.parametrize("tokens,experts,expected", [
    (128, 256, 1_908_410_496),  # DeepEP issue #368: 1908.410496 MB
    (128, 288, 2_146_961_792),
    (128, 384, 2_862_615_680),
    (256, 256, 3_816_818_816),
    (512, 256, 7_633_635_456),
])
def test_low_latency_size_hint_reproduces_deepep(tokens, experts, expected):
    assert vendor.ported_low_latency_rdma_size_hint(tokens, H, 8, experts) == expected
    assert sizes.low_latency_rdma_size_hint(tokens, H, 8, experts) == expected  # no DeepEP: the port
    assert Buffer.get_low_latency_rdma_size_hint(tokens, H, 32, experts) == expected  # R does not enter
    spec = md.DispatchSpec(H, experts, 8, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency",
                           output_dtype="fp8")
    size = DeepEPBackend(EMULATOR).buffer_size(spec, 8)
    assert size.total_bytes == expected
    assert size.combine_bytes > size.dispatch_bytes  # combine messages are BF16 plus LogFMT scales


def test_normal_mode_hints_reproduce_deepep():
    fields = vendor.ConfigFields(24, 8, 512, 16, 128)
    assert vendor.ported_nvl_buffer_size_hint(fields, 7168, 16) == 453_380_736  # DeepEP PR #434
    assert Config(*fields.as_tuple()).get_nvl_buffer_size_hint(7168, 16) == 453_380_736  # the fake calls the port
    assert vendor.ported_rdma_buffer_size_hint(fields, 7168, 8) == 0  # intranode: no RDMA buffer
    assert vendor.ConfigFields(20, 6, 256, 6, 100).rdma_recv == 102  # rounded up to the send chunk
    assert vendor.dispatch_config(None, 6) is None and vendor.combine_config(None, 6) is None
    with pytest.raises(md.InvalidSpecError) as info:
        DeepEPBackend(vendor.REAL).check_spec(md.DispatchSpec(H, 60, 8, output_dtype="bf16"), 6)
    assert info.value.parameter == "world_size" and "8" in info.value.allowed
    odd = Config(21, 6, 256, 6, 128)  # DeepEP's Config takes an odd SM count; the hint asserts past 8 ranks
    assert odd.get_nvl_buffer_size_hint(7168, 8) > 0
    with pytest.raises(RuntimeError, match="num_sms % 2 == 0"):
        odd.get_nvl_buffer_size_hint(7168, 16)


def test_the_tuned_configs_come_from_the_installed_deepep():
    """With DeepEP (here its fakes) the configs are its own ``Config`` objects, built with the class-level
    ``Buffer.num_sms``; the EP sizes are those it has a config and a kernel for (hybrid-ep: no 24/48/96)."""
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep as fake

    module = importlib.import_module(EMULATOR)
    cfg = vendor.dispatch_config(module, 8)
    assert isinstance(cfg, fake.Config)
    assert cfg.get_nvl_buffer_size_hint(7168, 8) == vendor.ported_nvl_buffer_size_hint(
        vendor.ConfigFields(20, *vendor.TUNED_DISPATCH[8]), 7168, 8)
    try:
        fake.Buffer.set_num_sms(24)
        want = vendor.ported_nvl_buffer_size_hint(vendor.ConfigFields(24, *vendor.TUNED_DISPATCH[8]), 7168, 8)
        assert vendor.dispatch_config(module, 8).get_nvl_buffer_size_hint(7168, 8) == want
        with pytest.raises(AssertionError, match="even"):
            fake.Buffer.set_num_sms(23)
    finally:
        fake.Buffer.set_num_sms(vendor.DEFAULT_NUM_SMS)
    assert DeepEPBackend(EMULATOR).normal_world_sizes() == frozenset(vendor.TUNED_DISPATCH)
    assert DeepEPBackend(EMULATOR_NVFP4).normal_world_sizes() == {2, 4, 8, 16, 32, 64, 128, 144, 160}


def test_dispatch_and_combine_are_sized_separately():
    backend = DeepEPBackend(EMULATOR)
    fp8 = backend.buffer_size(md.DispatchSpec(H, 64, 8, output_dtype="fp8"), 8)
    bf16 = backend.buffer_size(md.DispatchSpec(H, 64, 8, output_dtype="bf16"), 8)
    assert fp8.dispatch_bytes < bf16.dispatch_bytes and fp8.combine_bytes == bf16.combine_bytes
    assert fp8.total_bytes >= fp8.combine_bytes  # the shared buffer holds a BF16 combine


def _undersized_buffer(rank, world):
    """A buffer below what DeepEP's dispatch kernel lays out in it is refused with DeepEP's own error."""
    import torch

    cfg = Buffer.get_dispatch_config(world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        small = cfg.get_nvl_buffer_size_hint(256, world) // 16 // 128 * 128
        buf = Buffer(torch.distributed.group.WORLD, num_nvl_bytes=small)
    ids = torch.tensor([[0, 3]] * 4)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 4 * world)
    x = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    try:
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                     topk_idx=ids, topk_weights=torch.ones(4, 2), config=cfg)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_an_undersized_buffer_fails_as_deepep_does(moe_rank_pools):
    errors = moe_rank_pools.get(2).map(_undersized_buffer)
    assert all(e and e.startswith("Assertion exception") and "num_nvl_bytes" in e for e in errors), errors


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dtype,sent", [("bf16", "torch.bfloat16"), ("fp8", "fp8"), ("int8", "fp8")])
def test_the_resolved_dtype_is_what_reaches_the_vendor(moe_rank_pools, mode, dtype, sent):
    """sglang shipped a BF16 choice one mode ignored (#13787, #23815): check both modes."""
    for seen in moe_rank_pools.get(2).map(wire_seen, mode, dtype, EMULATOR):
        assert seen.resolved == ("fp8" if dtype == "int8" else dtype)
        if mode == "normal":
            assert seen.vendor_x_dtype == ("torch.float8_e4m3fn" if sent == "fp8" else "torch.bfloat16")
        else:  # low-latency takes BF16 in and casts inside the kernel when use_fp8
            assert seen.vendor_x_dtype == "torch.bfloat16" and seen.vendor_use_fp8 is (sent == "fp8")
        assert seen.vendor_payload_bytes == seen.expected_payload_bytes


def test_nvfp4_reaches_a_hybrid_deepep_in_low_latency_only(moe_rank_pools):
    assert detect(EMULATOR_NVFP4).has_nvfp4 and not detect(EMULATOR).has_nvfp4
    for seen in moe_rank_pools.get(2).map(wire_seen, "low_latency", "nvfp4", EMULATOR_NVFP4, 2048, 8):
        assert seen.resolved == "nvfp4" and seen.output_scale_dtype == "torch.float8_e4m3fn"
        assert seen.vendor_payload_bytes == seen.expected_payload_bytes == 8 * 2 * (1024 + 128)
    hybrid, v1 = DeepEPBackend(EMULATOR_NVFP4), DeepEPBackend(EMULATOR)
    ll = md.DispatchSpec(H, 64, 8, mode="low_latency", quant=md.QuantHints(input_global_scale=100.0))
    assert mdp.resolve_output_dtype(ll, hybrid, env={}).dtype is md.DispatchDtype.NVFP4
    with pytest.raises(md.UnsupportedDtypeError, match="use_nvfp4"):
        mdp.resolve_output_dtype(ll, v1, env={})
    with pytest.raises(md.UnsupportedDtypeError, match="normal-mode NVFP4"):
        mdp.resolve_output_dtype(md.DispatchSpec(H, 64, 8, quant=md.QuantHints(input_global_scale=100.0)), hybrid,
                                env={})


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_ue8m0_scales_reach_the_experts_packed_four_per_word(moe_rank_pools, mode):
    for seen in moe_rank_pools.get(2).map(wire_seen, mode, "fp8", EMULATOR, 2048, 8, True):
        assert seen.vendor_use_fp8 in (True, None) and seen.output_scale_dtype == "torch.int32"
        assert seen.vendor_payload_bytes == seen.expected_payload_bytes
        # Normal mode: one exponent byte per 128 channels on the wire (2048 + 16 per token, not
        # 2048 + 64); LL messages keep fp32 scales and pack on arrival.
        assert seen.expected_payload_bytes % (2048 + (16 if mode == "normal" else 64)) == 0


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_agreement_check_runs_on_the_fake(moe_rank_pools, mode, ue8m0):
    results = moe_rank_pools.get(2).map(agree_with_torch, mode, "fp8", EMULATOR, 2048, 4, 4, 16, 1, ue8m0)
    assert all(r["relative_difference"] < 1e-2 for r in results), results


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_low_latency_on_one_rank(moe_rank_pools, dtype):
    """DeepEP's low-latency mode runs on a group of one (the hardware check's setting); the kit runs 2 and 4."""
    (result,) = moe_rank_pools.get(1).map(agree_with_torch, "low_latency", dtype, EMULATOR, 2048, 4, 4, 16, 1)
    assert result["relative_difference"] < 1e-2, result


def test_installed_plugin_is_listed_unavailable_with_what_to_install():
    host = md.PluginHost(env={})
    info = host.info("cuda_deepep")
    assert info.distribution == "moe-dispatch-cuda-deepep"
    assert info.status == "unavailable" and "deep_ep" in info.reason and "DeepEP" in info.install_hint
    assert host.runners()["deep_gemm"].needs is md.DispatchDtype.FP8


def test_explain_shows_the_int8_fallback_on_cuda():
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["explain", "--backend", "cuda_deepep", "--dtype", "int8", "--mode", "low_latency",
                     "--preset", "deepseek-v3", "--tokens", "128", "--world-size", "8"]) == 0
    text = out.getvalue()
    assert "wire dtype fp8 for backend 'cuda_deepep' (fallback from int8)" in text
    assert "DeepEP has no INT8 dispatch" in text and "total 1,908,410,496 B" in text
    assert "cannot run on this machine" in text


def test_restored_environ_undoes_what_a_vendor_constructor_writes():
    """The variables DeepEP's V1 constructor writes (``vendor.NVSHMEM_WRITTEN``) are named to the block, which
    restores exactly those; a variable it was not told about is not its to restore."""
    before = dict(os.environ)
    with restored_environ({vendor.NVSHMEM_QP_DEPTH: "2048"}, names=vendor.NVSHMEM_WRITTEN):
        os.environ[vendor.NVSHMEM_IB_ENABLE_IBGDA] = "1"
        assert os.environ[vendor.NVSHMEM_QP_DEPTH] == "2048"
    assert dict(os.environ) == before


def _fake_buffer_in_the_adapters_block(rank, world):
    """The adapter's own Buffer construction (``buffers.ProcessBuffers._create``) on the fake, which writes the
    NVSHMEM_* variables: the process environment is as before afterwards."""
    before = {name: os.environ.get(name) for name in vendor.NVSHMEM_WRITTEN}
    spec = md.DispatchSpec(2048, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency",
                           output_dtype="bf16")
    d = md.create_dispatcher(DeepEPBackend(EMULATOR), spec, env={})
    after = {name: os.environ.get(name) for name in vendor.NVSHMEM_WRITTEN}
    return before == after, d.backend_dispatcher.buffer.num_rdma_bytes > 0


def test_the_adapter_restores_what_the_vendor_constructor_writes(moe_rank_pools):
    assert moe_rank_pools.get(2).map(_fake_buffer_in_the_adapters_block) == [(True, True)] * 2
