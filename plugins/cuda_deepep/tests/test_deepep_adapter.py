"""The DeepEP adapter beyond the kit: size formulas against DeepEP's numbers, the dtype that
reaches the vendor call, buffers shared by dispatch and combine, and the plugin as installed."""

import io
import os
from contextlib import redirect_stdout

import pytest

import moe_dispatch as md
from moe_dispatch.cli import main
from moe_dispatch.environ import restored_environ
from moe_dispatch_cuda_deepep import sizes
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.emulator import Buffer
from moe_dispatch_cuda_deepep.selfcheck import agree_with_torch, wire_seen
from moe_dispatch_cuda_deepep.vendor import EMULATOR, EMULATOR_NVFP4, detect

H = 7168


@pytest.mark.parametrize("tokens,experts,expected", [
    (128, 256, 1_908_410_496),  # DeepEP issue #368: 1908.410496 MB
    (128, 288, 2_146_961_792),
    (128, 384, 2_862_615_680),
    (256, 256, 3_816_818_816),
    (512, 256, 7_633_635_456),
])
def test_low_latency_size_hint_reproduces_deepep(tokens, experts, expected):
    assert sizes.low_latency_rdma_size_hint(tokens, H, 8, experts) == expected
    assert Buffer.get_low_latency_rdma_size_hint(tokens, H, 32, experts) == expected  # R does not enter
    spec = md.DispatchSpec(H, experts, 8, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency",
                           output_dtype="fp8")
    size = DeepEPBackend(EMULATOR).buffer_size(spec, 8)
    assert size.total_bytes == expected
    assert size.combine_bytes > size.dispatch_bytes  # combine messages are BF16 plus LogFMT scales


def test_normal_mode_hints_reproduce_deepep():
    assert sizes.Config(24, 8, 512, 16, 128).nvl_buffer_size_hint(7168, 16) == 453_380_736  # DeepEP PR #434
    assert sizes.Config(24, 8, 512, 16, 128).rdma_buffer_size_hint(7168, 8) == 0  # intranode: no RDMA buffer
    assert sizes.Config(20, 6, 256, 6, 100).num_max_rdma_chunked_recv_tokens == 102  # rounded up to the send chunk
    with pytest.raises(md.InvalidSpecError) as info:
        sizes.dispatch_config(6)
    assert info.value.parameter == "world_size" and "8" in info.value.allowed
    with pytest.raises(md.InvalidSpecError):
        sizes.Config(21, 6, 256, 6, 128)


def test_dispatch_and_combine_are_sized_separately():
    backend = DeepEPBackend(EMULATOR)
    fp8 = backend.buffer_size(md.DispatchSpec(H, 64, 8, output_dtype="fp8"), 8)
    bf16 = backend.buffer_size(md.DispatchSpec(H, 64, 8, output_dtype="bf16"), 8)
    assert fp8.dispatch_bytes < bf16.dispatch_bytes and fp8.combine_bytes == bf16.combine_bytes
    assert fp8.total_bytes >= fp8.combine_bytes  # the shared buffer holds a BF16 combine


def _fp8_dispatch_only_buffer(rank, world):
    """A buffer sized with one byte per element (FP8 dispatch) must not be handed to a BF16 combine."""
    import torch

    cfg_d, cfg_c = sizes.dispatch_config(world), sizes.combine_config(world)
    buf = Buffer(None, num_nvl_bytes=cfg_d.nvl_buffer_size_hint(256, world))
    ids = torch.tensor([[0, 3]] * 4)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 4 * world)
    x = torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.ones(4, 2)
    recv, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=ids,
                                            topk_weights=torch.ones(4, 2), config=cfg_d)
    try:
        buf.combine(torch.zeros(recv[0].shape, dtype=torch.bfloat16), handle, config=cfg_c)
    except AssertionError as exc:
        return str(exc)
    return None


def test_an_fp8_sized_buffer_refuses_a_bf16_combine(moe_rank_pools):
    errors = moe_rank_pools.get(2).map(_fp8_dispatch_only_buffer)
    assert all(e and "combine" in e for e in errors), errors


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
    assert md.resolve_output_dtype(ll, hybrid, env={}).dtype is md.DispatchDtype.NVFP4
    with pytest.raises(md.UnsupportedDtypeError, match="use_nvfp4"):
        md.resolve_output_dtype(ll, v1, env={})
    with pytest.raises(md.UnsupportedDtypeError, match="normal-mode NVFP4"):
        md.resolve_output_dtype(md.DispatchSpec(H, 64, 8, quant=md.QuantHints(input_global_scale=100.0)), hybrid,
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
def test_the_gpu_script_check_runs_on_the_emulator(moe_rank_pools, mode, ue8m0):
    results = moe_rank_pools.get(2).map(agree_with_torch, mode, "fp8", EMULATOR, 2048, 4, 4, 16, 1, ue8m0)
    assert all(r["relative_difference"] < 1e-2 for r in results), results


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
    before = dict(os.environ)
    with restored_environ({"NVSHMEM_QP_DEPTH": "2048"}):
        os.environ["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
        assert os.environ["NVSHMEM_QP_DEPTH"] == "2048"
    assert dict(os.environ) == before
