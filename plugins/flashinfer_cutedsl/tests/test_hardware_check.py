"""scripts/hardware_check.py runs: its --fake mode (the same checks with the fakes standing in for
FlashInfer, on CPU) passes on every fake, so the GPU run finds a working script."""

import importlib.util
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

from moe_dispatch_flashinfer_cutedsl import vendor

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hardware_check.py"


def run_script(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    spec = importlib.util.spec_from_file_location("flashinfer_hardware_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    out = io.StringIO()
    with redirect_stdout(out):
        code = module.main(argv)
    return code, out.getvalue()


def test_the_hardware_check_passes_on_the_fakes(moe_rank_pools):
    (code, text), = moe_rank_pools.get(1).map(run_script, ["--fake", "--fake-module", vendor.EMULATOR, "--hidden",
                                                         "256", "--tokens", "8"])
    assert code == 0, text
    for check in ("signatures", "workspace size ep=8 T=128", "a2a ep=1", "fp4_quantize", "cutedsl"):
        assert any(line.startswith(check) and " PASS " in line for line in text.splitlines()), text
