"""``scripts/hardware_check.py --fake``: the one-GPU vendor check runs, with the fakes standing in for DeepEP
and DeepGEMM, and every comparison agrees (on a GPU the same checks compare the real libraries); its rows follow the
release installed, and the probes that can end a process run in subprocesses."""

import contextlib
import importlib
import importlib.util
import inspect
import io
import types
from pathlib import Path

from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep_testing import (
    DEEP_GEMM_EMULATOR,
    DEEP_GEMM_EMULATOR_SM100,
    EMULATOR,
    EMULATOR_NVFP4,
    EMULATOR_V1_TOPK9,
    hardware,
)
from moe_dispatch_cuda_deepep_testing.support import fake_module

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
                   "V2 cuda_deepep_v2 vs torch, one rank", "V2 normal one rank, 0 tokens (subprocess)",
                   "scales [130, 2] as laid out: kept, no transpose", "scales [4, 130, 2] as laid out"):
        assert needed in text, needed
    assert "Unsupported ranks" in text and "MISMATCH" not in text


def test_the_one_rank_normal_probe_cannot_kill_the_check():
    """A one-rank normal-mode Buffer throws from its noexcept destructor (``intranode::barrier`` has no case for one
    rank): ``std::terminate``. The fake aborts the same way; the hardware check runs the probe in a subprocess and
    records its exit status and DeepEP's words."""
    probe = hardware.run_probe(hardware.PROBE_NORMAL_ONE_RANK, fake=True)
    assert probe.exit_code != 0 and "Unsupported ranks" in probe.output and "terminate called" in probe.output
    assert "the Buffer was freed" not in probe.output  # the process died in the destructor


def test_the_elastic_buffer_probe_runs_in_a_subprocess():
    """The V2 ``ElasticBuffer`` is built in a subprocess probe like the others, not in the main process beside a live LL
    Buffer, where an abort would lose the whole table."""
    assert hardware.PROBE_ELASTIC in hardware.probe_names()
    assert "ElasticBuffer" not in inspect.getsource(hardware.deep_ep_rows)


def test_a_v2_rank_with_zero_tokens_is_probed_in_a_subprocess_against_the_fake():
    """Item 5 of issue 35: ``cuda_deepep_v2`` in normal mode at one rank with 0 tokens (sglang pads empty batches;
    DeepEP's own tests never send any). The fake gives empty outputs of the right shapes and dtypes, zero counts, and
    16 tokens after them agree with torch; the row compares DeepEP's steps with those, and fails when DeepEP's host wait
    gives up, the process dies, or a shape differs."""
    assert hardware.PROBE_V2_ZERO_TOKENS in hardware.probe_names()
    probe = hardware.run_probe(hardware.PROBE_V2_ZERO_TOKENS, fake=True)
    lines = probe.output.splitlines()
    assert probe.exit_code == 0, probe.output
    assert lines[:2] == [
        "bf16 0 tokens: rows [0, 2048] bfloat16, scales None, counts [0, 0, 0, 0], combined [0, 2048] bfloat16",
        ("fp8 0 tokens: rows [0, 2048] float8_e4m3fn, scales [0, 16] float32, counts [0, 0, 0, 0], combined [0, 2048] "
         "bfloat16")]
    assert lines[2].startswith("then 16 tokens bf16 agree rel "), lines
    assert hardware.zero_tokens_row(probe, probe).ok
    waited = hardware.ProbeResult(probe.name, 0, f"{lines[0]}\nRuntimeError: EPException: Dispatch CPU wait")
    died = hardware.ProbeResult(probe.name, -11, "\n".join(lines[:2]))
    hung = hardware.ProbeResult(probe.name, -1, f"timed out after {hardware.PROBE_TIMEOUT_S} s (a hang)")
    shaped = hardware.ProbeResult(probe.name, 0, probe.output.replace("combined [0, 2048]", "combined [1, 2048]", 1))
    rows = {name: hardware.zero_tokens_row(bad, probe) for name, bad in
            (("waited", waited), ("died", died), ("hung", hung), ("shaped", shaped))}
    assert not any(row.ok for row in rows.values()), rows
    assert rows["waited"].real.startswith("0 after 1 steps: RuntimeError") and rows["died"].real.startswith("-11")
    assert "combined [1, 2048]" in rows["shaped"].real


def test_the_runner_hands_deep_gemm_its_sm90_scales_laid_out(monkeypatch):
    """Item 8 of issue 35: on SM90 DeepGEMM's ``get_mn_major_tma_aligned_tensor`` keeps the scales as the runner lays
    them out (no copy, no transpose kernel); the row fails for row-major scales (the runner before, which left the
    layout to DeepGEMM). ``first_only`` is dg_probe's stage: the runner's first call alone."""
    import torch

    setup = hardware.Setup(EMULATOR, DEEP_GEMM_EMULATOR, torch.device("cpu"), None, None, True, gemm_hidden=256)
    rows = hardware.scale_layout_rows(setup)
    assert [r.check for r in rows] == ["scales [130, 2] as laid out: kept, no transpose",
                                       "scales [4, 130, 2] as laid out: kept, no transpose"]
    assert all(r.ok for r in rows) and rows[0].real == "kept True, strides (1, 132)", rows
    first = hardware.deep_gemm_rows(setup, first_only=True)
    assert [r.check for r in first] == ["block_fp8 PACKED real vs fake (relative error)"] and first[0].ok
    monkeypatch.setattr(vendor, "dg_mn_major", lambda module, sf: sf)
    assert not any(r.ok for r in hardware.scale_layout_rows(setup))
    sm100 = hardware.Setup(EMULATOR, DEEP_GEMM_EMULATOR_SM100, torch.device("cpu"), None, None, True, gemm_hidden=256)
    assert [r.real for r in hardware.scale_layout_rows(sm100)] == ["not this DeepGEMM or GPU"]


# -- the rows follow the release installed --------------------------------------------------------------------


def test_a_wrong_signature_is_a_mismatch():
    """The signature rows can fail: the hybrid-ep fake against main's records."""
    rows = hardware.signature_rows(importlib.import_module(EMULATOR_NVFP4), (vendor.BUFFER_LL_DISPATCH,), "s")
    assert [r.ok for r in rows] == [False]


def test_hardware_signatures_follow_the_installed_release():
    """Each DeepEP build is compared with its own release's records (``vendor.deep_ep_signatures``): 1.2.1's constructor
    has no ``enable_shrink``, main's has."""
    for name in (EMULATOR_V1_TOPK9, EMULATOR_NVFP4, EMULATOR):
        rows = hardware.signature_rows(fake_module(name), hardware.signature_records(fake_module(name)), "signature")
        assert all(r.ok for r in rows), [r for r in rows if not r.ok]


def _late_121(version, use_fabric=True):
    base = fake_module(EMULATOR)

    class Buffer(base.Buffer):
        if use_fabric:
            def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                         allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                         explicitly_destroy=False, enable_shrink=False, comm=None):
                super().__init__(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank)

    module = types.ModuleType("deep_ep")
    module.__version__, module.Buffer, module.Config = version, Buffer, base.Config
    return module


def test_late_1_2_1_builds_have_use_fabric():
    """1.2.1 from 9249c25 to 567632d (the last 1.x on main) has ``use_fabric`` in ``Buffer.__init__``: the rows of those
    builds, and of a 1.2.1 of unknown commit (either), agree."""
    for version, fabric in (("1.2.1+567632d", True), ("1.2.1+c475ec6", False), ("1.2.1+0000000", True),
                            ("1.2.1+0000000", False)):
        module = _late_121(version, fabric)
        rows = hardware.signature_rows(module, hardware.signature_records(module), "signature")
        assert all(r.ok for r in rows), (version, [r for r in rows if not r.ok])


def test_size_rows_of_deepep_1_0_use_its_tables():
    """DeepEP 1.0 (ebfe47e) returns ``Config(num_sms, 6, 256, 6, 128)`` for any R <= 8 and ``(16, 288, 20, 128)`` for
    EP16 dispatch: the size rows compare it with 1.0's tables, not 1.2.1's."""
    base = fake_module(EMULATOR)
    v10 = {8: ((6, 256, 6, 128), (6, 256, 6, 128)), 16: ((16, 288, 20, 128), (2, 288, 28, 128))}

    class Buffer(base.Buffer):
        pass

    def getter(which):
        def get(num_ranks):
            assert num_ranks in v10, f"Unsupported number of EP ranks: {num_ranks}"
            return base.Config(Buffer.num_sms, *v10[num_ranks][which])
        return staticmethod(get)

    Buffer.get_dispatch_config, Buffer.get_combine_config = getter(0), getter(1)
    module = types.ModuleType("deep_ep")
    module.__version__, module.Buffer, module.Config = "1.0.0+ebfe47e", Buffer, base.Config
    rows = [r for r in hardware.size_rows(module, None) if "config EP" in r.check]
    assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]


def test_deep_gemm_signature_rows_follow_the_build():
    """DeepGEMM 2.0.0 before f85ec64 has only ``fp8_m_grouped_gemm_nt_masked`` and no BF16 grouped GEMMs; 2.3–2.5 bind
    the packed-UE8M0 helper without ``py::arg``: the signature rows follow the build found."""
    fakes = fake_module(DEEP_GEMM_EMULATOR)
    for module in (fakes.emulate((9, 0), "2.0.0", before_f85ec64=True), fakes.emulate((9, 0), "2.0.0"),
                   fakes.emulate((10, 0), "2.3.0"), fakes.emulate((10, 0), "2.5.0"), fakes.emulate((10, 0), "2.6.1")):
        rows = hardware.signature_rows(module, hardware.signature_records(module), "signature")
        assert rows and all(r.ok for r in rows), [r for r in rows if not r.ok]
    pr112 = fakes.emulate((9, 0), "2.0.0", before_f85ec64=True)
    assert not hasattr(pr112, vendor.DG_FP8_MASKED) and not hasattr(pr112, vendor.DG_BF16_MASKED)
    assert not hasattr(pr112, "__version__")


def test_pybind_docstrings_are_read():
    def fn():
        pass

    fn.__doc__ = "m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: " \
                 "torch.Tensor, expected_m: int, compiled_dims: str = 'nk') -> None\n"
    assert hardware.pybind_params(fn)[-2:] == [("expected_m", "<required>"), ("compiled_dims", "nk")]


# -- what the rows check --------------------------------------------------------------------------------------


def test_the_aligned_deepgemm_rows_on_sm100_include_fp32_scales():
    """On SM100 the ALIGNED rows also run fp32 UE8M0 scales, which the runner packs itself; with the SM100 fake standing
    in for the real DeepGEMM, every case runs through the runner without an error."""
    import torch

    setup = hardware.Setup(deep_ep=EMULATOR, deep_gemm=DEEP_GEMM_EMULATOR_SM100,
                           device=torch.device("cpu"), group=None, fake_group=None, fake=True, gemm_hidden=256)
    rows = hardware.deep_gemm_rows(setup)
    checks = [r.check for r in rows]
    for needed in ("block_fp8 ALIGNED real", "block_fp8 ALIGNED tail real", "block_fp8 ALIGNED m_indices real",
                   "block_fp8 ALIGNED fp32 scales real", "bf16 ALIGNED m_indices real"):
        assert any(c.startswith(needed) for c in checks), (needed, checks)
    assert all(r.ok for r in rows), [r.line() for r in rows if not r.ok]


def test_wire_seen_reads_the_fakes_only():
    """``selfcheck.wire_seen`` reads ``Buffer.calls``, which only the fakes record: it defaults to the DeepEP fake."""
    from moe_dispatch_cuda_deepep_testing.selfcheck import wire_seen

    assert inspect.signature(wire_seen).parameters["vendor_module"].default == EMULATOR
