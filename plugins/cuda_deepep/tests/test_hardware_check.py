"""``scripts/hardware_check.py --fake``: the one-GPU vendor check runs, with the fakes standing in for DeepEP
and DeepGEMM, and every comparison agrees (on a GPU the same checks compare the real libraries)."""

import contextlib
import importlib.util
import io
from pathlib import Path

from moe_dispatch_cuda_deepep import hardware, vendor

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hardware_check.py"


def _run_script(rank, world):
    spec = importlib.util.spec_from_file_location("cuda_deepep_hardware_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = module.main(["--fake", "--tokens", "8", "--gemm-hidden", "256"])
    return status, out.getvalue()


def test_the_script_runs_on_the_fakes(moe_rank_pools):
    ((status, text),) = moe_rank_pools.get(1).map(_run_script)
    assert status == 0, text
    for needed in ("signature Buffer.low_latency_dispatch", "LL rdma hint T=128 H=7168 E=256", "block_fp8 PACKED",
                   "bf16 MASKED", "LL fp8 one rank: combine", "normal one rank: DeepEP's dispatch (subprocess)",
                   "two LL Buffers in one process (subprocess)",
                   "V2 cuda_deepep_v2 vs torch, one rank"):
        assert needed in text, needed
    assert "Unsupported ranks" in text and "MISMATCH" not in text


def test_a_wrong_signature_is_a_mismatch():
    """The signature rows can fail: the hybrid-ep fake against main's records."""
    import importlib

    rows = hardware.signature_rows(importlib.import_module(vendor.EMULATOR_NVFP4), (vendor.BUFFER_LL_DISPATCH,), "s")
    assert [r.ok for r in rows] == [False]


def test_pybind_docstrings_are_read():
    def fn():
        pass

    fn.__doc__ = "m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: " \
                 "torch.Tensor, expected_m: int, compiled_dims: str = 'nk') -> None\n"
    assert hardware.pybind_params(fn)[-2:] == [("expected_m", "<required>"), ("compiled_dims", "nk")]


def test_the_aligned_deepgemm_rows_on_sm100_include_fp32_scales():
    """On SM100 the ALIGNED rows also run fp32 UE8M0 scales, which the runner packs itself (fixes audit F4); with
    the SM100 fake standing in for the real DeepGEMM, every case runs through the runner without an error."""
    import torch

    setup = hardware.Setup(deep_ep=vendor.EMULATOR, deep_gemm=vendor.DEEP_GEMM_EMULATOR_SM100,
                           device=torch.device("cpu"), group=None, fake_group=None, fake=True, gemm_hidden=256)
    rows = hardware.deep_gemm_rows(setup)
    checks = [r.check for r in rows]
    for needed in ("block_fp8 ALIGNED real", "block_fp8 ALIGNED tail real", "block_fp8 ALIGNED m_indices real",
                   "block_fp8 ALIGNED fp32 scales real", "bf16 ALIGNED m_indices real"):
        assert any(c.startswith(needed) for c in checks), (needed, checks)
    assert all(r.ok for r in rows), [r.line() for r in rows if not r.ok]
