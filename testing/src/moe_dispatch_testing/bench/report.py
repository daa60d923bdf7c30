"""The bench's outputs: a table for people, JSON for machines, scaling curves as a PNG."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict

from moe_dispatch import InvalidSpecError

from .overhead import OverheadResult
from .overlap import OverlapResult
from .results import CaseResult

#: Version of ``moe-dispatch bench --json``; bumped only for an incompatible change.
BENCH_JSON_SCHEMA = 1


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}"


def format_table(results: list[CaseResult], ops: dict | None = None) -> str:  # type: ignore[type-arg]
    """The grid; with ``ops`` (case → ops per dispatch + combine, ``--profile``) an ``ops`` column."""
    ops = ops or {}
    head = (f"{'backend':<10} {'dtype':<6} {'mode':<11} {'R':>2} {'T/rank':>6} {'H':>5} "
            f"{'disp ms':>8} {'p90':>8} {'comb ms':>8} {'p90':>8} {'disp MB':>8} {'comb MB':>8} "
            f"{'check B':>7} {'wire':>5} {'GB/s':>6} {'floor x':>7} {'core x':>6} {'vs ag':>6}"
            + (f" {'ops':>5}" if ops else ""))
    lines = [head, "-" * len(head)]
    for r in results:
        c = r.case
        ag = f"{r.vs_allgather:.2f}" if r.vs_allgather is not None else "-"
        lines.append(
            f"{c.backend:<10} {c.dtype.value:<6} {c.mode.value:<11} {c.world_size:>2} {c.tokens_per_rank:>6} "
            f"{c.hidden:>5} {_ms(r.dispatch_ms):>8} {_ms(r.dispatch_p90_ms):>8} {_ms(r.combine_ms):>8} "
            f"{_ms(r.combine_p90_ms):>8} {_mb(r.dispatch_bytes):>8} {_mb(r.combine_bytes):>8} "
            f"{r.check_bytes:>7.0f} {r.wire_ratio:>5.2f} {r.gb_per_s:>6.2f} {r.floor_ratio:>7.2f} "
            f"{_ratio(r.core_ratio):>6} {ag:>6}"
            + (f" {ops[c]:>5.0f}" if c in ops else (" " * 6 if ops else ""))
        )
    lines.append(
        "ms: median (p90) over iterations of the slowest rank; MB: sent per rank; check B: the call "
        "check's bytes per rank per dispatch+combine; wire: payload bytes / "
        "WireFormat rows; floor x: (dispatch+combine) / bare all_to_all_single of the same bytes; core x: the "
        "ranks' CPU time (all threads) / the floor's, which floor x follows where ranks share cores; "
        "vs ag: / the allgather backend" + ("; ops: kernel-launching ATen ops per dispatch+combine on rank 0, on "
                                             "the paths an accelerator runs (torch.profiler: leaf ops, views and "
                                             "allocations left out)" if ops else "")
    )
    return "\n".join(lines)


def format_overhead(results: list[OverheadResult]) -> str:
    lines = [f"{'value checks':<13} {'torch direct':>13} {'via API':>10} {'replay direct':>14} "
             f"{'via API':>10} {'overhead':>10}"]
    for r in results:
        lines.append(
            f"{'on' if r.check_inputs else 'off':<13} {r.backend_ns / 1e3:>10.1f} µs {r.api_ns / 1e3:>7.1f} µs "
            f"{r.replay_direct_ns:>11.0f} ns {r.replay_api_ns:>7.0f} ns {r.overhead_ns:>7.0f} ns"
        )
    if results:
        lines.append(f"ns per dispatch+combine pair at world size 1, {results[0].payload}; overhead: the core "
                     "API over a backend object that answers instantly")
        parts = results[0].parts
        if parts:
            lines.append("where the overhead goes (ns per call, value checks off): " + "; ".join(
                f"{name} {ns:.0f}" for name, ns in parts.items()))
    return "\n".join(lines)


def to_json(results: list[CaseResult], overhead: list[OverheadResult], overlap: list[OverlapResult],
            settings: dict[str, object]) -> str:
    return json.dumps({
        "schema": BENCH_JSON_SCHEMA,
        "settings": settings,
        "cases": [r.to_dict() for r in results],
        "overhead": [o.to_dict() for o in overhead],
        "overlap": [o.to_dict() for o in overlap],
    }, indent=2)


_DTYPE_COLORS = {"bf16": "tab:blue", "fp8": "tab:orange", "int8": "tab:green", "nvfp4": "tab:red"}


def require_matplotlib(path: str):  # type: ignore[no-untyped-def]
    """``matplotlib.pyplot`` (Agg), or the one-line error naming ``--plot``: checked before any case runs, with the
    path (a ``.png`` in a folder that exists and can be written)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path.lower().endswith(".png"):
        raise InvalidSpecError("the plot is written as PNG", parameter="--plot", value=path, allowed="a path ending in .png")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise InvalidSpecError("the plot's folder does not exist or cannot be written", parameter="--plot", value=path,
                               allowed="a .png path in an existing, writable folder")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidSpecError(
            "--plot needs matplotlib, which is not installed", parameter="--plot", value=path,
            allowed='a run after `pip install "moe-dispatch-testing[plot]"` (or matplotlib)',
        ) from None
    return plt


def plot(results: list[CaseResult], path: str) -> list[str]:
    """Latency against tokens per rank and against world size (a panel only for an axis with more
    than one value), one line per dtype (and mode, backend), the median with a band up to the p90
    (dispatch p90 + combine p90), the legend beside the panels. Returns the panels drawn. Needs
    matplotlib (``pip install "moe-dispatch[bench]"``)."""
    plt = require_matplotlib(path)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    panels = [(x_name, fixed_name, xlabel) for x_name, fixed_name, xlabel in (
        ("tokens_per_rank", "world_size", "tokens per rank"),
        ("world_size", "tokens_per_rank", "world size (ranks)"),
    ) if len({getattr(r.case, x_name) for r in results}) > 1]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(6 * max(len(panels), 1) + 3, 4.5), squeeze=False)
    for ax, (x_name, fixed_name, xlabel) in zip(axes[0], panels):
        lines: dict[tuple, list[tuple[int, float, float]]] = defaultdict(list)
        fixed = max(getattr(r.case, fixed_name) for r in results)  # the largest other axis, where the curve says most
        for r in results:
            c = r.case
            if getattr(c, fixed_name) == fixed:
                lines[(c.backend, c.mode.value, c.dtype.value)].append(
                    (getattr(c, x_name), r.total_ms, r.dispatch_p90_ms + r.combine_p90_ms))
        backends = sorted({key[0] for key in lines})
        for (backend, mode, dtype), points in sorted(lines.items()):
            points.sort()
            xs, med, p90 = [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]
            color = _DTYPE_COLORS.get(dtype, "black")  # colour: dtype; line: mode; marker: backend
            ax.plot(xs, med, "-" if mode == "normal" else "--", color=color,
                    marker="os^Dv"[backends.index(backend) % 5], label=f"{backend} {mode} {dtype}")
            ax.fill_between(xs, med, p90, color=color, alpha=0.12, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({x for pts in lines.values() for x, _, _ in pts}))
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not 4×10^0
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("dispatch + combine, ms (median; band to p90)")
        ax.set_title(f"{fixed_name.replace('_', ' ')} = {fixed}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    shape = results[0].case if results else None
    if shape is not None:
        fig.suptitle(f"moe-dispatch bench: H={shape.hidden}, {shape.experts} experts, top-{shape.top_k}")
    fig.tight_layout(rect=(0, 0, 1 - 2.6 / fig.get_figwidth(), 1))  # the legend's column on the right
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [x for x, _, _ in panels]


__all__ = ["BENCH_JSON_SCHEMA", "format_overhead", "format_table", "plot", "to_json"]
