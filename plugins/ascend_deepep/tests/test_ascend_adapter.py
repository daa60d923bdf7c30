"""The DeepEP-Ascend adapter beyond the kit: the dtype each vendor call receives, the INT8
choice isolated per dispatcher (sglang #26389/#26408), the HCCL window, the trails."""

import io
import os
import warnings
from contextlib import redirect_stdout

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.cli import main
from moe_dispatch.backend import dequantize_rows
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import sizes, vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.vendor import EMULATOR, EMULATOR_ENV_ONLY, INT8_ENV

H = 1024


def _dispatcher(vendor: str, dtype: str, mode: str = "normal", tokens: int = 8,
                env: dict[str, str] | None = None) -> md.Dispatcher:
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=tokens, mode=mode, output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(AscendDeepEPBackend(vendor, env=env), spec, env={})


def _batch(seed: int = 0, tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    ids[0, 1] = -1
    return x, ids, torch.rand(tokens, 2, generator=g)


def wire_seen(rank: int, world: int, vendor: str, mode: str, dtype: str) -> dict:
    d = _dispatcher(vendor, dtype, mode)
    x, ids, w = _batch(rank)
    out = d.dispatch(x, ids, w)
    call = d.backend_dispatcher.buffer.calls[-1]
    pairs = int((ids >= 0).sum())  # DeepEP-Ascend sends one row per (token, expert)
    rows = dequantize_rows(out.hidden_states, out.hidden_states_scale, H).to(torch.bfloat16)  # identity experts
    y = d.combine(rows, out)
    ref = (x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True))  # identity experts
    return {"resolved": d.output_dtype.value, "int8": call.int8, "out": str(out.hidden_states.dtype),
            "bytes": call.payload_bytes, "expected": pairs * d.spec.wire_format().bytes_per_token,
            "error": relative_error(y, ref)}


@pytest.mark.parametrize("vendor", [EMULATOR, EMULATOR_ENV_ONLY])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp8"])
def test_the_resolved_dtype_is_what_reaches_the_kernel(moe_rank_pools, vendor, mode, dtype):
    """sglang #23815: the low-latency path ignored a BF16 choice and sent INT8; check both modes."""
    for seen in moe_rank_pools.get(2).map(wire_seen, vendor, mode, dtype):
        assert seen["resolved"] == ("int8" if dtype == "fp8" else dtype)
        assert seen["int8"] is (seen["resolved"] == "int8")
        assert seen["out"] == ("torch.int8" if seen["resolved"] == "int8" else "torch.bfloat16")
        assert seen["bytes"] == seen["expected"]
        assert seen["error"] < (0.03 if seen["resolved"] == "int8" else 0.01)


def interleaved(rank: int, world: int, vendor: str, mode: str, rounds: int) -> list[tuple]:
    """An INT8 and a BF16 dispatcher in one process (a draft and a target model), interleaved,
    with someone's process-wide INT8 switch already set."""
    results = []
    with restored_environ({INT8_ENV: "1"}):
        bf16, int8 = _dispatcher(vendor, "bf16", mode), _dispatcher(vendor, "int8", mode)
        x, ids, w = _batch(rank)
        for _ in range(rounds):
            for d in (int8, bf16):
                out = d.dispatch(x, ids, w)
                results.append((d.output_dtype.value, str(out.hidden_states.dtype),
                                d.backend_dispatcher.buffer.calls[-1].int8))
                d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16), out)
        assert os.environ[INT8_ENV] == "1"  # untouched by the dispatchers
    return results


@pytest.mark.parametrize("vendor", [EMULATOR, EMULATOR_ENV_ONLY])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_an_int8_and_a_bf16_dispatcher_never_see_each_others_choice(moe_rank_pools, vendor, mode):
    """sglang #26389/#26408: each vendor call gets this dispatcher's choice, whatever the process
    environment holds, and the environment is as it was afterwards."""
    for results in moe_rank_pools.get(2).map(interleaved, vendor, mode, 3):
        assert len(results) == 6
        for resolved, tensor_dtype, vendor_int8 in results:
            assert (tensor_dtype == "torch.int8") is (resolved == "int8") and vendor_int8 is (resolved == "int8")


def test_hccl_window_follows_the_vendors_formulas():
    # The README's non-layered minimum 2·(bs·R·min(E_l,k)·H·2 + 2 MB), H=7168, k=8, E=256, bs=128.
    assert [v.window_mb(v.readme_window_bytes(128, 7168, r, 256 // r, 8)) for r in (8, 16, 32)] == [228, 452, 900]
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, mode="low_latency", output_dtype="int8")
    backend = AscendDeepEPBackend(EMULATOR, env={})
    need = max(v.ll_op_window_bytes(128, 7168, 8, 32, 8), v.readme_window_bytes(128, 7168, 8, 32, 8))
    assert backend.buffer_size(spec, 8).allocated_bytes == need
    assert sizes.required_window_mb(spec, 8, {}) == v.window_mb(need) == 956
    with pytest.raises(md.CapacityError) as info:
        sizes.check_hccl_window(956, {"HCCL_BUFFSIZE": "100"})
    assert info.value.parameter == "HCCL_BUFFSIZE" and "HCCL_BUFFSIZE=956" in str(info.value)
    with pytest.raises(md.CapacityError, match="default 200 MB"):
        sizes.check_hccl_window(956, {})
    sizes.check_hccl_window(956, {"HCCL_BUFFSIZE": "956"})
    with pytest.raises(md.InvalidSpecError):
        sizes.check_hccl_window(956, {"HCCL_BUFFSIZE": "lots"})


def small_window(rank: int, world: int) -> str:
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8)
    try:
        md.create_dispatcher(AscendDeepEPBackend(EMULATOR, env={"HCCL_BUFFSIZE": "1"}), spec, env={})
    except md.CapacityError as exc:
        return exc.parameter or ""
    return "created"


def test_creation_refuses_a_small_hccl_window(moe_rank_pools):
    assert moe_rank_pools.get(2).map(small_window) == ["HCCL_BUFFSIZE"] * 2


def _explain(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["explain", "--backend", "ascend_deepep", "--preset", "deepseek-v3", "--tokens", "128",
                     "--world-size", "16", *args])
    return code, out.getvalue()


def test_explain_on_ascend_fp8_falls_back_to_int8_and_nvfp4_is_refused(capsys):
    code, text = _explain("--dtype", "fp8", "--mode", "low_latency")
    assert code == 0 and "wire dtype int8 for backend 'ascend_deepep' (fallback from fp8)" in text
    assert "Atlas A2/A3 have no FP8" in text and "HCCL_BUFFSIZE" in text
    code, _ = _explain("--dtype", "nvfp4", "--quant", '{"input_global_scale": 100.0}')
    assert code == 2 and "no FP4 dispatch" in capsys.readouterr().err
    code, text = _explain()
    assert code == 0 and "backend default (ascend_deepep)" in text and "wire dtype bf16" in text


def test_installed_plugin_is_listed_unavailable_with_what_to_install():
    info = md.PluginHost(env={}).info("ascend_deepep")
    assert info.distribution == "moe-dispatch-ascend-deepep" and info.status == "unavailable"
    assert info.reason and "sgl-kernel-npu" in info.install_hint


@pytest.mark.parametrize("runner,wire,why", [
    ("npu_w8a8", "int8", "W8A8 int8 grouped matmuls take per-token INT8 rows"),
    ("npu_w4a4", "bf16", "W4A4 quantizes BF16 rows to int4 itself"),
])
def test_explain_follows_the_layers_kernel(runner, wire, why):
    code, text = _explain("--runner", runner, "--mode", "low_latency")
    assert code == 0 and f"wire dtype {wire} for backend 'ascend_deepep'" in text
    assert f"runner {runner}" in text and why in text
    assert f"consumes {wire} behind ascend_deepep (low_latency)" in text
