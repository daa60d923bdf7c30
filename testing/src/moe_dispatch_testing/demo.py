"""``moe-dispatch demo``: a MoE layer on local gloo ranks, once per wire dtype and mode,
checked against the dense fp32 single-process reference."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import torch

import moe_dispatch as md
from moe_dispatch import DispatchDtype, DispatchSpec, Mode, QuantHints, TorchExperts, create_dispatcher
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch.cli import explain
from moe_dispatch.cli.presets import ModelPreset

from .accuracy import TOLERANCES, reference_moe, relative_error
from .routing import random_expert_weights, random_routing


@dataclass(frozen=True)
class DemoCase:
    preset: ModelPreset
    dtype: DispatchDtype
    mode: Mode
    tokens_per_rank: int
    backend: str = "torch"
    iterations: int = 3
    seed: int = 0


@dataclass(frozen=True)
class DemoResult:
    case: DemoCase
    wire_bytes_per_token: int
    relative_error: float
    seconds: float
    payload_bytes: int
    metadata_bytes: int
    combine_bytes: int

    @property
    def ok(self) -> bool:
        return self.relative_error <= TOLERANCES[self.case.dtype]


def layer_inputs(case: DemoCase, rank: int, world_size: int):  # type: ignore[no-untyped-def]
    """The same global weights and tokens on every rank; each rank takes its own slice."""
    p = case.preset
    g = torch.Generator().manual_seed(case.seed)
    weights = random_expert_weights(p.num_experts, p.hidden_size, p.intermediate_size, generator=g)
    total = case.tokens_per_rank * world_size
    x = torch.randn(total, p.hidden_size, generator=g).to(torch.bfloat16)
    ids, w = random_routing(total, p.num_experts, p.top_k, generator=g)
    mine = slice(rank * case.tokens_per_rank, (rank + 1) * case.tokens_per_rank)
    gs = nvfp4_global_scale(x.float().abs().max().item())
    return weights, x, ids, w, mine, gs


def case_spec(case: DemoCase, global_scale: float = 1.0) -> DispatchSpec:
    """The layer's spec for ``case`` (NVFP4 with ``global_scale``, calibrated on the batch in ``run_case``)."""
    p = case.preset
    quant = QuantHints(input_global_scale=global_scale) if case.dtype is DispatchDtype.NVFP4 else QuantHints()
    return DispatchSpec(p.hidden_size, p.num_experts, p.top_k, num_max_dispatch_tokens_per_rank=case.tokens_per_rank,
                        mode=case.mode, output_dtype=case.dtype, quant=quant)


def run_case(rank: int, world_size: int, case: DemoCase) -> DemoResult:
    """One rank's part of one demo case (runs inside a local rank or under torchrun)."""
    weights, x, ids, w, mine, gs = layer_inputs(case, rank, world_size)
    spec = case_spec(case, gs)
    dispatcher = create_dispatcher(case.backend, spec, env={})
    local = weights.slice(rank * spec.local_experts(world_size), spec.local_experts(world_size))
    experts = TorchExperts()
    xs, ids_s, w_s = x[mine], ids[mine], w[mine]
    out = dispatcher.forward(experts, local, xs, ids_s, w_s)
    first = dispatcher.traffic.copy()
    times = []
    for _ in range(case.iterations):
        start = time.perf_counter()
        dispatcher.forward(experts, local, xs, ids_s, w_s)
        times.append(time.perf_counter() - start)
    ref = reference_moe(xs, ids_s, w_s, weights)
    return DemoResult(
        case,
        spec.wire_format().bytes_per_token,
        relative_error(out, ref),
        statistics.median(times) if times else 0.0,
        first.payload_bytes,
        first.metadata_bytes,
        first.combine_bytes,
    )


def summarize(results_per_rank: list[DemoResult]) -> DemoResult:
    """Worst error and slowest rank of one case."""
    worst = max(results_per_rank, key=lambda r: r.relative_error)
    return DemoResult(
        worst.case,
        worst.wire_bytes_per_token,
        worst.relative_error,
        max(r.seconds for r in results_per_rank),
        sum(r.payload_bytes for r in results_per_rank),
        sum(r.metadata_bytes for r in results_per_rank),
        sum(r.combine_bytes for r in results_per_rank),
    )


def format_table(results: list[DemoResult], world_size: int) -> str:
    lines = [
        f"{'dtype':<6} {'mode':<12} {'wire B/token':>12} {'vs bf16':>8} {'rel err':>9} {'limit':>6} "
        f"{'ms/layer':>9} {'payload B':>10}  ok",
    ]
    for r in results:
        bf16 = 2 * r.case.preset.hidden_size
        lines.append(
            f"{r.case.dtype.value:<6} {r.case.mode.value:<12} {r.wire_bytes_per_token:>12,} "
            f"{r.wire_bytes_per_token / bf16:>8.3f} {r.relative_error:>9.2e} {TOLERANCES[r.case.dtype]:>6.2f} "
            f"{r.seconds * 1e3:>9.1f} {r.payload_bytes:>10,}  {'yes' if r.ok else 'NO'}"
        )
    return "\n".join(lines)


def _cases(preset: ModelPreset, tokens: int, backend: str, dtypes: list[DispatchDtype] | None,
           modes: list[Mode] | None) -> tuple[list[DemoCase], list[str]]:
    """The (dtype, mode) cases the backend accepts, and those it does not (skipped); none at all is an error. A
    backend that cannot run here is a ``BackendUnavailableError``."""
    caps = md.PluginHost.default().select(backend).backend.capabilities
    cases, skipped = [], []
    for mode in modes or list(Mode):
        for dtype in dtypes or list(DispatchDtype):
            if dtype in caps.dtypes.get(mode, ()):
                cases.append(DemoCase(preset, dtype, mode, tokens, backend))
            else:
                skipped.append(f"{mode.value}/{dtype.value}")
    if not cases:
        raise md.InvalidSpecError(
            f"backend {backend!r} accepts none of the dtypes and modes asked for, so the demo has nothing to run",
            parameter="--dtype/--mode", value=[*(d.value for d in dtypes or []), *(m.value for m in modes or [])],
            allowed="; ".join(f"{m.value}: {', '.join(sorted(d.value for d in ds))}" for m, ds in caps.dtypes.items()))
    return cases, skipped


def run_torchrun(preset: ModelPreset, tokens_per_rank: int, backend: str, dtypes: list[DispatchDtype] | None,
                 modes: list[Mode] | None) -> int:
    """Under torchrun: this process is one rank; rendezvous comes from the environment."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    try:
        for case in _cases(preset, tokens_per_rank, backend, dtypes, modes)[0]:
            gathered: list = [None] * world  # type: ignore[type-arg]
            dist.all_gather_object(gathered, run_case(rank, world, case))
            results.append(summarize(gathered))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"moe-dispatch demo under torchrun: {preset.name}, {world} ranks")
        print(format_table(results, world))
        print(f"all cases within tolerance: {all(r.ok for r in results)}")
    return 0 if all(r.ok for r in results) else 1


def _ready(rank: int, world_size: int) -> int:
    return rank


def run_demo(
    preset: ModelPreset,
    *,
    world_size: int = 4,
    tokens_per_rank: int = 64,
    dtypes: list[DispatchDtype] | None = None,
    modes: list[Mode] | None = None,
    backend: str = "torch",
    out: TextIO = sys.stdout,
) -> list[DemoResult]:
    """Spawn local ranks, run every (dtype, mode) case, print progress and a table."""
    from .local import RankPool

    cases, skipped = _cases(preset, tokens_per_rank, backend, dtypes, modes)
    for case in cases:  # what create_dispatcher would refuse on every rank, as one line before any rank starts
        explain(case_spec(case), backend, world_size)
    print(
        f"moe-dispatch demo: {preset.name} (H={preset.hidden_size}, E={preset.num_experts}, top-{preset.top_k}, "
        f"I={preset.intermediate_size}), {world_size} local gloo ranks, {tokens_per_rank} tokens per rank, "
        f"backend {backend}",
        file=out,
        flush=True,
    )
    if skipped:
        print(f"  skipped (not in the backend's capabilities.dtypes): {', '.join(skipped)}", file=out, flush=True)
    started = time.perf_counter()
    results = []
    with RankPool(world_size) as pool:
        pool.map(_ready)
        print(f"  started {world_size} ranks in {time.perf_counter() - started:.1f} s", file=out, flush=True)
        for i, case in enumerate(cases, 1):
            result = summarize(pool.map(run_case, case))
            results.append(result)
            print(
                f"  [{i}/{len(cases)}] {case.dtype.value:<5} {case.mode.value:<11} rel err {result.relative_error:.2e} "
                f"{'ok' if result.ok else 'ABOVE LIMIT'}",
                file=out,
                flush=True,
            )
    print("", file=out)
    print(format_table(results, world_size), file=out)
    print(f"\nall cases within tolerance: {all(r.ok for r in results)}; total {time.perf_counter() - started:.1f} s",
          file=out, flush=True)
    return results


__all__ = ["DemoCase", "DemoResult", "case_spec", "format_table", "run_case", "run_demo", "run_torchrun", "summarize"]
