"""``scripts/hardware_check.py`` with the fakes standing in for the vendor (``--fake``): every
check runs and passes on CPU, so the script is known to run when an NPU shows up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from moe_dispatch_ascend_deepep_testing.hardware import Options, run_rank, summarize

SCRIPT = Path(__file__).parents[1] / "scripts" / "hardware_check.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("ascend_hardware_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_check_runs_and_passes_on_the_fakes(moe_rank_pools):
    script = _script()
    opts, world = script.parse(["--fake", "--probe-neg-one-unset", "--probe-mode2-tokens", "--probe-fused-neg-one"])
    assert world == 2 and opts.fake and opts.hidden == 1024
    per_rank = moe_rank_pools.get(2).map(run_rank, opts, script._fuseep())
    table, ok = summarize(per_rank)
    assert ok, table
    parts = ("platform", "signatures", "windows", "deepep", "runners") + (("fuseep",) if script._fuseep() else ())
    for part in parts:
        assert any(line.startswith(part) for line in table.splitlines()), table
    assert "low_latency int8 with -1 ids" in table
    # the Buffer's per-call state (real_max_bs, window halves) under interleaving
    assert "normal: two dispatches in flight" in table and "two dispatchers on one group" in table
    # the probes report the fake's refusals as information, not failures
    assert "(fake) expert id -1" in table
    if script._fuseep():  # moe-dispatch-ascend-fuseep-testing installed
        assert "fuse mode 2 (every token to rank 0)" in table and "max_output_size=" in table
        assert "probe: fuse mode 2 with raw -1 ids" in table and "topk=-1 is not supported" in table
    assert len(table.splitlines()) > 30


def test_one_rank_prints_the_vendors_refusal():
    rows = run_rank(0, 1, Options(fake=True, hidden=1024, tokens=8, experts_per_rank=2, top_k=2,
                                  parts=("deepep",)))
    table, ok = summarize([rows])
    assert ok and "Unsupported number of EP ranks: 1" in table
