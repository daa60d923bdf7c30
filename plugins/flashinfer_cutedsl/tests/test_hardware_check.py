"""scripts/hardware_check.py runs: its --fake mode (the same checks with the fakes standing in for
FlashInfer, on CPU) passes, so the GPU run finds a working script; an exception from the adapter
is a FAIL (exit 1), only FlashInfer's own refusal of the machine is REFUSED."""

import importlib.util
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from moe_dispatch.backend import restored_environ
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl_testing import EMULATOR, FAKE_0_6_13, FAKE_0_7_2

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hardware_check.py"


def _load():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("flashinfer_hardware_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_script(rank: int, world: int, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    module = _load()
    out = io.StringIO()
    with restored_environ(env), redirect_stdout(out):
        code = module.main(argv)
    return code, out.getvalue()


def _rows(text: str, check: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(check)]


@pytest.mark.parametrize("fake_module,size_row", [(FAKE_0_7_2, "workspace size ep=8 T=128"),
                                                  (EMULATOR, "one-sided layout ep=8 T=128 k=8")])
def test_the_hardware_check_passes_on_the_fakes(moe_rank_pools, fake_module, size_row):
    (code, text), = moe_rank_pools.get(1).map(run_script, ["--fake", "--fake-module", fake_module, "--hidden",
                                                         "256", "--tokens", "8"], {})
    assert code == 0, text
    for check in ("signatures", size_row, "a2a ep=1 ", "a2a ep=1 T=17 top-3", "fp4_quantize",
                  "fp4_quantize exact math", "cutedsl packed bf16", "cutedsl masked, -1 slots",
                  "cutedsl masked, no routed row", "cutedsl ep offset", "cutedsl nvfp4 rows", "cutedsl zero rows"):
        assert any(" PASS " in line for line in _rows(text, check)), (check, text)


def test_the_a2a_rows_hand_the_device_rows_8_bytes_into_their_allocation():
    """The view is made on the device (``meta`` stands in for CUDA): ``x.to("cuda")`` of a CPU view
    would be a fresh allocation, aligned, and never exercise the misaligned source."""
    module = _load()
    buf = torch.zeros(5 * 256 + 4, dtype=torch.bfloat16)
    rows = module._source_rows(buf, torch.device("meta"), 5, 256)  # noqa: SLF001
    assert rows.device.type == "meta" and rows.shape == (5, 256) and rows.storage_offset() == 4


def test_an_adapter_exception_fails_the_hardware_check(moe_rank_pools):
    """The adapter refuses TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN=0 on FlashInfer < 0.6.14: a FAIL, not a REFUSED."""
    (code, text), = moe_rank_pools.get(1).map(run_script, ["--fake", "--fake-module", FAKE_0_6_13, "--hidden",
                                                         "256", "--tokens", "8"],
                                              {vendor.ENV_ONE_BLOCK_PER_TOKEN: "0"})
    assert code == 1, text
    assert all(" FAIL " in line and vendor.ENV_ONE_BLOCK_PER_TOKEN in line for line in _rows(text, "a2a ep=1")), text


def test_only_flashinfers_refusal_of_the_machine_is_refused():
    module = _load()
    refused = RuntimeError("pidfd_getfd(pidfd=3, fd=7) failed with errno 1: Operation not permitted.")
    assert module._failure("a2a", refused).status == "REFUSED"  # noqa: SLF001
    try:
        try:
            raise RuntimeError("Ninja build failed. Ninja output: ...")
        except RuntimeError as jit:
            raise ValueError("while loading the all-to-all module") from jit
    except ValueError as chained:
        assert module._failure("workspace", chained).status == "REFUSED"  # noqa: SLF001
    for exc in (RuntimeError("CUDA error: misaligned address"),
                RuntimeError("CUDA error code=1(CUDA_ERROR_INVALID_VALUE)"),
                AssertionError("dispatch called twice without combine")):
        assert module._failure("a2a", exc).status == "FAIL"  # noqa: SLF001
