"""``moe-dispatch bench``: arguments to a grid of cases, and the outputs."""

from __future__ import annotations

import argparse
import sys

import moe_dispatch as md
from moe_dispatch import DispatchDtype, Mode
from moe_dispatch.cli import flags
from moe_dispatch.cli.presets import PRESETS, model_shapes

from .cases import BenchSettings, Shape, expand_cases


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``moe-dispatch bench``'s options. Method: docs/performance.md."""
    p.add_argument("--backend", action="append", help="backend to measure (repeatable; default torch)")
    p.add_argument("--dtype", action="append", type=flags.dtype,
                   help="wire dtype (repeatable; default bf16 and fp8, with --full every dtype the backend accepts)")
    p.add_argument("--mode", action="append", type=flags.mode, help=f"{flags.MODES} (repeatable; default both)")
    p.add_argument("--world-size", type=flags.positive_int, action="append", help="local ranks (repeatable; default 4)")
    p.add_argument("--tokens", type=flags.positive_int, action="append",
                   help="tokens per rank (repeatable; default 128, with --full 128 and 512)")
    p.add_argument("--preset", action="append", choices=sorted(PRESETS),
                   help="model shape (repeatable; default deepseek-v3); --hidden/--experts/--top-k override its "
                        "fields, all three without --preset are a custom shape")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: the preset's)")
    p.add_argument("--experts", type=int, default=None, help="number of experts (default: the preset's)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: the preset's)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per case (default 8, with --full 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default 2, with --full 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and routing (default 0)")
    p.add_argument("--baseline", default=None,
                   help="backend to compare with, or 'none' (default none, with --full allgather)")
    p.add_argument("--full", action="store_true",
                   help="the full sweep (every dtype, 128 and 512 tokens, 20 iterations, against allgather: minutes); "
                        "the defaults answer in about a minute on two cores")
    p.add_argument("--check-inputs", action="store_true", help="time dispatch with the value checks on")
    p.add_argument("--only", choices=["all", "cases", "overhead", "overlap"], default="all",
                   help="cases: the grid; overhead: the core API's per-call cost; overlap: two micro-batches "
                        "overlapped in split phase against sequential (world size 2 unless --world-size); all: every one")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's op table (rank 0) for each case: the cost of each stage; and "
                        "an ops column: kernel-launching ATen ops per dispatch + combine on the paths an "
                        "accelerator runs")
    p.add_argument("--json", action="store_true", help="print JSON (schema 1) instead of tables")
    p.add_argument("--plot", metavar="PATH", default=None, help="write latency curves to this PNG (needs matplotlib)")


def _shapes(args: argparse.Namespace) -> list[Shape]:
    return [Shape(*shape) for shape in model_shapes(args.preset, ["deepseek-v3"], args.hidden, args.experts,
                                                     args.top_k)]


def run(args: argparse.Namespace) -> int:
    from . import report
    from .overhead import measure_overhead
    from .overlap import format_overlap, run_overlap
    from .runner import profile_cases, progress_bar, run_bench

    host = md.PluginHost.default()
    if args.plot:
        report.require_matplotlib(args.plot)  # before any rank starts, not after every case ran
    backends = args.backend or ["torch"]
    modes = [Mode.parse(m) for m in args.mode] if args.mode else list(Mode)
    quick = [DispatchDtype.BF16, DispatchDtype.FP8]
    wanted = [DispatchDtype.parse(d) for d in args.dtype] if args.dtype else list(DispatchDtype) if args.full else quick
    tokens = args.tokens or ([128, 512] if args.full else [128])
    settings = BenchSettings(warmup=_default(args.warmup, 3 if args.full else 2),
                             iterations=_default(args.iters, 20 if args.full else 8), seed=args.seed,
                             check_inputs=args.check_inputs)
    cases = []
    if args.only in ("all", "cases"):
        for backend in backends:
            caps = host.get_backend(backend).capabilities
            for mode in modes:
                dtypes = [d for d in wanted if d in caps.dtypes.get(mode, ())]
                cases += expand_cases([backend], dtypes, [mode], args.world_size or [4], tokens, _shapes(args))
    cases.sort(key=lambda c: c.world_size)  # one pool per world size
    overlap_cases = []
    if args.only in ("all", "overlap"):
        for backend in backends:
            caps = host.get_backend(backend).capabilities
            for mode in modes:
                dtypes = [d for d in wanted if d in caps.dtypes.get(mode, ())][:1]  # one dtype: the schedule is the point
                overlap_cases += expand_cases([backend], dtypes, [mode], args.world_size or [2], tokens,
                                              _shapes(args))
    chosen = _default(args.baseline, "allgather" if args.full else "none")
    baseline = None if chosen == "none" else chosen
    if baseline:
        host.get_backend(baseline)  # a typo fails before any rank starts
    _check_cases([*cases, *overlap_cases, *([c.with_backend(baseline) for c in cases] if baseline else [])], host)
    results = run_bench(cases, settings, baseline=baseline, progress=progress_bar(sys.stderr)) if cases else []
    profiles = profile_cases(cases, settings) if args.profile and cases else []
    overlap = run_overlap(overlap_cases, settings) if overlap_cases else []
    overhead = []
    if args.only in ("all", "overhead"):
        overhead = [measure_overhead(check_inputs=False), measure_overhead(check_inputs=True)]
    if args.plot and results:
        report.plot(results, args.plot)
    if args.json:
        for profile in profiles:
            print(profile.table, file=sys.stderr)
        print(report.to_json(results, overhead, overlap, {"warmup": settings.warmup, "iterations": settings.iterations,
                                                 "seed": settings.seed, "check_inputs": settings.check_inputs,
                                                 "baseline": baseline}))
        return 0
    if results:
        print(report.format_table(results, {p.case: p.ops for p in profiles}))
    if overlap:
        if results:
            print()
        print(format_overlap(overlap))
    if overhead:
        if results or overlap:
            print()
        print(report.format_overhead(overhead))
    for profile in profiles:
        print(f"\n{profile.table}")
    if args.plot and results:
        print(f"\nplot written to {args.plot}")
    if not args.full:
        print("\nquick defaults; the full sweep (every dtype, 128 and 512 tokens, 20 iterations, against allgather): "
              "moe-dispatch bench --full")
    return 0


def _default(value, default):  # type: ignore[no-untyped-def]
    return default if value is None else value


def _check_cases(cases: list, host) -> None:  # type: ignore[no-untyped-def, type-arg]
    """What ``create_dispatcher`` would refuse on every rank (a hidden size the dtype cannot take, experts that do
    not split over the ranks), as one line before any rank starts."""
    from moe_dispatch.cli import explain

    from .worker import case_spec

    for case in {c for c in cases}:
        explain(case_spec(case, 1.0), case.backend, case.world_size, host=host)


__all__ = ["add_arguments", "run"]
