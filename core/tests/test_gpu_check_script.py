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
    assert groups == {"codecs", "layers", "graph", "nosync", "streams"}
    assert sum(c["group"] == "layers" for c in checks) == 2 * 2 * 4  # backends × modes × dtypes
    assert all(c["ok"] for c in checks)
    assert [c["detail"] for c in checks if c["group"] in ("graph", "nosync", "streams")] == ["skipped: needs CUDA"] * 3


def test_without_a_gpu_the_cuda_default_says_what_to_do():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_core.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--device cpu" in proc.stderr


def test_the_profile_script_runs_on_cpu_and_names_where_the_time_goes(tmp_path):
    """benchmarks/gpu/profile_layer.py on gloo: the per-step time and the operators with the most host
    time are filled in (on the CPU there is no device time to rank)."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "profile_layer.py"), "--device", "cpu",
                           "--tokens", "16", "--iters", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert [(c["mode"], c["tokens"]) for c in cases] == [("normal", 16), ("low_latency", 16)]
    for case in cases:
        assert case["ms_per_step"] > 0 and case["host_time"] and case["host_time"][0]["us_per_step"] > 0


def test_the_one_command_gpu_runner_parses_and_knows_its_steps():
    """benchmarks/gpu/run_all.sh needs a GPU to run; here: bash accepts it, and every step it names in its
    header is one it runs."""
    script = ROOT / "benchmarks" / "gpu" / "run_all.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for name in ("core", "kit", "profile", "hbm", "bench", "dgprobe", "deepep", "deepgemm", "gdb"):
        assert f"step {name} " in text, name


def test_the_deepgemm_probe_runs_its_variants_on_the_fake():
    """benchmarks/gpu/dg_probe.py's plumbing on CPU (the fake DeepGEMM in its place): four fresh processes (NVCC and
    NVRTC, a cold and a warm cache), each through the runner's first call, none named as the first death."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "dg_probe.py"), "2", "--fake", "--variants",
                           "--timeout", "120"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": exit 0") == 4 and "first death" not in done.stdout, done.stdout
    assert done.stdout.count("== 2 the runner's first call") == 4, done.stdout
