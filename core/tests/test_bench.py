"""``moe-dispatch bench``: the numbers it prints are computed from what really happened."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moe_dispatch_testing.bench.cases import BenchCase, BenchSettings
from moe_dispatch_testing.bench.results import percentile
from moe_dispatch.cli import main
from moe_dispatch import DispatchDtype, Mode
from moe_dispatch import InvalidSpecError
from moe_dispatch.backend import WireFormat

ROOT = Path(__file__).resolve().parents[2]


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == 5.0
    assert percentile(values, 0) == 1.0


def test_a_case_that_cannot_split_its_experts_is_refused_before_any_rank_starts():
    with pytest.raises(InvalidSpecError, match="world_size"):
        BenchCase("torch", DispatchDtype.BF16, Mode.NORMAL, 3, 8, 128, 8, 2)
    with pytest.raises(InvalidSpecError, match="iterations"):
        BenchSettings(iterations=0)


def test_bench_json_counts_exactly_the_wire_format_bytes(capsys):
    """2 ranks, every dtype and both modes, with the allgather baseline (``--full``): the payload per
    rank is exactly WireFormat × (pairs | tokens × ranks | capacity × ranks), times are
    positive and p90 >= median, the floor and baseline ratios are there."""
    code = main(["bench", "--full", "--world-size", "2", "--tokens", "8", "--hidden", "256", "--experts", "8",
                 "--top-k", "3", "--iters", "3", "--warmup", "1", "--only", "cases", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == 1
    cases = doc["cases"]
    assert {(c["case"]["backend"], c["case"]["dtype"], c["case"]["mode"]) for c in cases} == {
        (b, d.value, m.value) for b in ("torch", "allgather") for d in DispatchDtype for m in Mode}
    for c in cases:
        assert c["wire_ratio"] == 1.0, c
        assert 0 < c["dispatch_ms"] <= c["dispatch_p90_ms"] and 0 < c["combine_ms"] <= c["combine_p90_ms"]
        assert c["floor_ms"] > 0 and c["floor_ratio"] > 0 and c["core_ratio"] > 0 and c["iterations"] == 3
        wire = WireFormat(DispatchDtype.parse(c["case"]["dtype"]), 256).bytes_per_token
        if c["case"]["mode"] == "low_latency" or c["case"]["backend"] == "allgather":
            assert c["payload_bytes"] == 8 * 2 * wire  # capacity (or every token) to both ranks
        else:
            assert 0 < c["payload_bytes"] <= 8 * 2 * wire and c["payload_bytes"] % wire == 0
        assert c["vs_allgather"] is not None
    torch_bf16 = next(c for c in cases if c["case"]["backend"] == "torch" and c["case"]["dtype"] == "bf16"
                      and c["case"]["mode"] == "normal")
    allgather_bf16 = next(c for c in cases if c["case"]["backend"] == "allgather" and c["case"]["dtype"] == "bf16"
                          and c["case"]["mode"] == "normal")
    assert torch_bf16["payload_bytes"] <= allgather_bf16["payload_bytes"]


def test_bench_overhead_table(capsys, monkeypatch):
    from moe_dispatch_testing.bench import overhead

    # The table's form, not the measurement's precision: a few short rounds (the full run takes ~6 s).
    measure = overhead.measure_overhead
    monkeypatch.setattr(overhead, "measure_overhead", lambda **kw: measure(**kw, rounds=3, calls_per_round=100))
    assert main(["bench", "--only", "overhead"]) == 0
    out = capsys.readouterr().out
    assert "overhead" in out and out.count(" ns") >= 4
    lines = [line for line in out.splitlines() if line.startswith(("off", "on"))]
    assert [line.split()[0] for line in lines] == ["off", "on"]


def test_bench_overlap_case_json(capsys):
    """Both schedules timed for each stand-in, both modes, with the stage times inside the overlapped one."""
    code = main(["bench", "--tokens", "8", "--hidden", "256", "--experts", "8", "--top-k", "3", "--dtype", "bf16",
                 "--iters", "2", "--warmup", "1", "--only", "overlap", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["overlap"]
    assert {(r["case"]["mode"], r["compute"]) for r in rows} == {
        (m.value, c) for m in Mode for c in ("host", "device")}
    for r in rows:
        assert r["case"]["world_size"] == 2 and r["split_phase"] is True and r["iterations"] == 2
        assert r["sequential_ms"] > 0 and r["overlapped_ms"] > 0 and r["compute_ms"] > 0
        assert 0 < r["start_ms"] + r["wait_ms"] < r["overlapped_ms"]
        assert r["ratio"] == pytest.approx(r["overlapped_ms"] / r["sequential_ms"])
        assert r["bound"] == pytest.approx(0.5 + r["compute_ms"] / r["sequential_ms"])


def test_overhead_of_the_value_checks_is_measured_not_assumed():
    from moe_dispatch_testing.bench.overhead import measure_overhead

    off = measure_overhead(check_inputs=False, rounds=5, calls_per_round=200)
    on = measure_overhead(check_inputs=True, rounds=5, calls_per_round=200)
    assert off.replay_direct_ns > 0 and off.replay_api_ns > off.replay_direct_ns
    assert on.replay_api_ns > off.replay_api_ns  # the value checks read the data: they cost something
    checks = {"input checks, dispatch", "input checks, combine", "output checks, dispatch", "output checks, combine"}
    assert set(off.parts) == checks | {"call path without the checks (pair)"}
    assert all(off.parts[name] > 0 for name in checks)  # the path alone is a difference of two timings: noise may flip it


def test_plot_without_matplotlib_is_a_clear_error_or_a_png(tmp_path, capsys):
    target = tmp_path / "curves.png"
    argv = ["bench", "--world-size", "1", "--tokens", "4", "--tokens", "8", "--hidden", "128", "--experts", "4",
            "--top-k", "2", "--dtype", "bf16", "--iters", "2", "--warmup", "0", "--only", "cases", "--baseline",
            "none", "--plot", str(target)]
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "matplotlib" in err and "bf16" not in err  # refused before any case ran (no progress line)
        return
    assert main(argv) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_gpu_script_runs_under_torchrun_on_gloo(tmp_path):
    """benchmarks/gpu/bench_torchrun.py with --device cpu: the launcher path the CUDA tables use."""
    out = tmp_path / "gpu.json"
    with socket.socket() as sock:  # a free port on loopback for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), str(ROOT / "benchmarks" / "gpu" / "bench_torchrun.py"), "--device", "cpu",
         "--preset", "qwen3-30b-a3b", "--tokens", "8", "--dtype", "fp8", "--iters", "2", "--warmup", "0",
         "--json", str(out)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "moe-dispatch bench under torchrun: 2 ranks" in proc.stdout
    rows = json.loads(out.read_text())
    assert {(r["case"]["backend"], r["case"]["mode"]) for r in rows} == {
        (b, m.value) for b in ("torch", "allgather") for m in Mode}
    assert all(r["wire_ratio"] == 1.0 for r in rows)


def test_the_combine_reduction_benchmark_checks_its_bits_and_runs():
    """benchmarks/combine_reduction.py refuses to time a reduction whose bits differ from the baseline's."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "combine_reduction.py"), "--tokens", "7", "--tokens", "300",
         "--hidden", "256", "--rows-per-token", "3", "--iters", "1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()[1:]] == ["7", "300"]


def test_the_ops_column_counts_what_moves_data():
    """``moe-dispatch bench --profile``'s ops: index_select (whose output allocation is not a launch) and the copy
    inside ``.to`` count; views and allocations do not."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moe_dispatch_testing.bench.worker import launches

    x, index = torch.randn(8, 4), torch.tensor([0, 2])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x.view(4, 8).t()
        x.index_select(0, index).to(torch.bfloat16)
        torch.empty(3)
    assert launches(prof.events()) == 2


def test_the_defaults_are_the_quick_sweep(capsys):
    """Without ``--full``: BF16 and FP8, no baseline, 8 iterations after 2 (the tokens given here)."""
    assert main(["bench", "--world-size", "2", "--tokens", "8", "--hidden", "256", "--experts", "8", "--top-k", "3",
                 "--only", "cases", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(c["case"]["backend"], c["case"]["dtype"]) for c in doc["cases"]} == {("torch", "bf16"), ("torch", "fp8")}
    assert doc["settings"]["iterations"] == 8 and doc["settings"]["warmup"] == 2 and doc["settings"]["baseline"] is None


@pytest.mark.parametrize("mode", [Mode.NORMAL, Mode.LOW_LATENCY])
def test_a_dispatch_and_combine_launch_at_most_30_ops(mode):
    """The accelerator's paths of the ``torch`` backend (``--profile``'s ops: 4 ranks, BF16, DeepSeek-V3's routing
    on a small hidden size; counted on CPU, where each leaf op is what an accelerator launches) stay within 30 ops
    per dispatch + combine: the count is deterministic, a launch added anywhere shows here."""
    from moe_dispatch_testing.bench.runner import profile_cases

    case = BenchCase("torch", DispatchDtype.BF16, mode, 4, 32, 256, 256, 8)
    (profiled,) = profile_cases([case], BenchSettings(warmup=1, iterations=2))
    assert profiled.ops <= 30, profiled.table
