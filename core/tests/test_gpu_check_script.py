"""benchmarks/gpu/check_core.py, the core's hardware check, run on gloo: the same code path the
next session with a GPU runs (codecs device vs CPU, layers against the dense reference); the
CUDA-graph part says it is skipped."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_core_hardware_check_runs_on_cpu(tmp_path):
    out = tmp_path / "checks.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_core.py"), "--device", "cpu",
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = json.loads(out.read_text())["checks"]
    groups = {c["group"] for c in checks}
    assert groups == {"codecs", "layers", "graph", "nosync"}
    assert sum(c["group"] == "layers" for c in checks) == 2 * 2 * 4  # backends × modes × dtypes
    assert all(c["ok"] for c in checks)
    assert [c["detail"] for c in checks if c["group"] in ("graph", "nosync")] == ["skipped: needs CUDA"] * 2


def test_without_a_gpu_the_cuda_default_says_what_to_do():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_core.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--device cpu" in proc.stderr
