"""Run a grid of cases on local ranks: one pool per world size, a progress line per case."""

from __future__ import annotations

import sys
import time
from itertools import groupby
from typing import Callable, TextIO

from .cases import BenchCase, BenchSettings
from .results import CaseResult, summarize_case, with_baselines
from .worker import CaseProfile, measure_case, profile_case

Progress = Callable[[int, int, BenchCase, "CaseResult | None"], None]


def progress_bar(out: TextIO = sys.stderr, width: int = 24) -> Progress:
    """A one-line bar on a terminal, one line per case otherwise (CI logs)."""
    tty = out.isatty()
    started = time.perf_counter()

    def show(done: int, total: int, case: BenchCase, result: CaseResult | None) -> None:
        filled = int(width * done / total)
        elapsed = time.perf_counter() - started
        tail = f" {result.total_ms:.2f} ms" if result else " ..."
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:5.0f}s {case.label}{tail}"
        if tty:
            out.write("\r\x1b[2K" + line + ("\n" if done == total and result else ""))
        elif result:
            out.write(line + "\n")
        out.flush()

    return show


def run_bench(
    cases: list[BenchCase],
    settings: BenchSettings = BenchSettings(),
    *,
    baseline: str | None = "allgather",
    progress: Progress | None = None,
) -> list[CaseResult]:
    """Measure every case (and, unless ``baseline`` is None, the same point on the baseline
    backend, in the same pool) and return the results with their ratios."""
    from moe_dispatch_testing.local import RankPool

    planned: list[BenchCase] = []
    for case in cases:
        planned.append(case)
        if baseline and case.backend != baseline and case.with_backend(baseline) not in cases:
            base = case.with_backend(baseline)
            if base not in planned:
                planned.append(base)
    results: list[CaseResult] = []
    done = 0
    for world_size, group in groupby(planned, key=lambda c: c.world_size):
        with RankPool(world_size) as pool:
            for case in group:
                if progress:
                    progress(done, len(planned), case, None)
                result = summarize_case(case, pool.map(measure_case, case, settings))
                results.append(result)
                done += 1
                if progress:
                    progress(done, len(planned), case, result)
    return with_baselines(results, baseline) if baseline else results


def profile_cases(cases: list[BenchCase], settings: BenchSettings = BenchSettings()) -> list[CaseProfile]:
    """Rank 0's profiler table and ops per dispatch + combine for each case."""
    from moe_dispatch_testing.local import RankPool

    tables = []
    for world_size, group in groupby(cases, key=lambda c: c.world_size):
        with RankPool(world_size) as pool:
            tables += [pool.map(profile_case, case, settings)[0] for case in group]
    return tables


__all__ = ["profile_cases", "progress_bar", "run_bench"]
