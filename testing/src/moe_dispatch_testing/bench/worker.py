"""One rank's measurement of one case (runs inside a local rank or under torchrun).

Each iteration times, on every rank, between barriers: the dispatch, the combine, and the
transport floor: the same collectives replayed as bare ``all_to_all_single`` calls of raw
bytes with the same per-peer sizes (what the layout work costs is the difference). The
floor is interleaved with the real calls so both see the same machine load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from moe_dispatch import DispatchDtype, DispatchSpec, Mode, MoEDispatchError, QuantHints, create_dispatcher
from moe_dispatch.backend import Comm, Traffic, nvfp4_global_scale
from moe_dispatch_testing.routing import random_routing

from .cases import BenchCase, BenchSettings

#: Big cases on a loaded CPU take tens of seconds per collective: wait, don't fail.
BENCH_TIMEOUT_S = 1800.0


@dataclass
class RankSamples:
    """Seconds per iteration on this rank, and what it sent in one dispatch + combine."""

    rank: int
    dispatch_s: list[float] = field(default_factory=list)
    combine_s: list[float] = field(default_factory=list)
    floor_dispatch_s: list[float] = field(default_factory=list)
    floor_combine_s: list[float] = field(default_factory=list)
    #: This process's CPU time (every thread: gloo's copies too) per dispatch + combine, and per floor (CPU ranks).
    cpu_s: list[float] = field(default_factory=list)
    floor_cpu_s: list[float] = field(default_factory=list)
    dispatch_traffic: Traffic = field(default_factory=Traffic)
    combine_traffic: Traffic = field(default_factory=Traffic)
    #: (token, destination rank) pairs of this rank's routing: what a sparse dispatch must send.
    rank_pairs: int = 0
    wire_bytes_per_token: int = 0


def case_spec(case: BenchCase, global_scale: float | None) -> DispatchSpec:
    quant = QuantHints(input_global_scale=global_scale) if case.dtype is DispatchDtype.NVFP4 else QuantHints()
    return DispatchSpec(
        case.hidden, case.experts, case.top_k,
        num_max_dispatch_tokens_per_rank=case.tokens_per_rank, mode=case.mode, output_dtype=case.dtype, quant=quant,
        layout=case.layout,
    )


def case_inputs(
    case: BenchCase, rank: int, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(case.tokens_per_rank, case.hidden, generator=g).to(torch.bfloat16)
    ids, weights = random_routing(case.tokens_per_rank, case.experts, case.top_k, generator=g)
    return x.to(device), ids.to(device), weights.to(device)


class _Floor:
    """The recorded collectives as bare all_to_all_single calls, buffers allocated once."""

    def __init__(self, records: list[Any], world_size: int, device: str) -> None:
        self.calls = []
        for r in records:
            if r.carries_data and world_size > 1:
                send = torch.zeros(sum(r.send_bytes), dtype=torch.uint8, device=device)
                recv = torch.empty(sum(r.recv_bytes), dtype=torch.uint8, device=device)
                self.calls.append((recv, send, list(r.recv_bytes), list(r.send_bytes)))

    def run(self) -> None:
        for recv, send, recv_splits, send_splits in self.calls:
            dist.all_to_all_single(recv, send, recv_splits, send_splits)


def _timed(fn, samples: list[float], cpu: list[float], comm: Comm, device: str = "cpu"):  # type: ignore[no-untyped-def]
    """``fn``'s wall time into ``samples``, after a barrier, and its process CPU time into ``cpu``."""
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    comm.barrier("bench barrier")  # watched: a rank that failed is named, not waited for
    start, start_cpu = time.perf_counter(), time.process_time()
    value = fn()
    if cuda:  # kernels are asynchronous: time until they finish
        torch.cuda.synchronize()
    samples.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
    return value


def _rank_pairs(ids: torch.Tensor, case: BenchCase) -> int:
    local = case.experts // case.world_size
    dest = torch.where(ids >= 0, ids // local, case.world_size)
    seen = torch.zeros(ids.shape[0], case.world_size + 1, dtype=torch.bool, device=ids.device).scatter_(1, dest, True)
    return int(seen[:, : case.world_size].sum())


def _setup(rank: int, case: BenchCase, settings: BenchSettings, in_flight: int = 1):  # type: ignore[no-untyped-def]
    """This rank's dispatcher and inputs for ``case`` (one call in flight at a time, unless ``in_flight``)."""
    x, ids, weights = case_inputs(case, rank, settings.seed, settings.device)
    scale = nvfp4_global_scale(8.0) if case.dtype is DispatchDtype.NVFP4 else None  # the same on every rank
    dispatcher = create_dispatcher(case.backend, case_spec(case, scale), env={}, check_inputs=settings.check_inputs,
                                   timeout_s=BENCH_TIMEOUT_S, in_flight=in_flight)
    return dispatcher, x, ids, weights


def _expert_rows(out, case: BenchCase, device: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What the (untimed) experts hand combine: constant bf16 rows shaped like the dispatched ones."""
    return torch.full((*out.hidden_states.shape[:-1], case.hidden), 0.5, dtype=torch.bfloat16, device=device)


def measure_case(rank: int, world_size: int, case: BenchCase, settings: BenchSettings) -> RankSamples:
    """Run ``case`` on this rank: warm-up, then ``settings.iterations`` timed iterations."""
    dev = settings.device
    dispatcher, x, ids, weights = _setup(rank, case, settings)
    comm = dispatcher.comm

    # One untimed call records the collectives and sizes the expert output.
    with comm.recording() as dispatch_records:
        before = comm.traffic.copy()
        out = dispatcher.dispatch(x, ids, weights)
        dispatch_traffic = comm.traffic - before
    expert_rows = _expert_rows(out, case, dev)
    with comm.recording() as combine_records:
        before = comm.traffic.copy()
        dispatcher.combine(expert_rows, out)
        combine_traffic = comm.traffic - before
    del out
    floor_dispatch, floor_combine = _Floor(dispatch_records, world_size, dev), _Floor(combine_records, world_size, dev)

    samples = RankSamples(rank, dispatch_traffic=dispatch_traffic, combine_traffic=combine_traffic,
                          rank_pairs=_rank_pairs(ids, case),
                          wire_bytes_per_token=dispatcher.spec.wire_format().bytes_per_token)
    scratch = RankSamples(rank)
    try:
        for i in range(settings.warmup + settings.iterations):
            into = samples if i >= settings.warmup else scratch
            cpu: list[float] = []
            floor_cpu: list[float] = []
            out = _timed(partial(dispatcher.dispatch, x, ids, weights), into.dispatch_s, cpu, comm, dev)
            _timed(partial(dispatcher.combine, expert_rows, out), into.combine_s, cpu, comm, dev)
            out = None  # free the rows before the floor runs
            _timed(floor_dispatch.run, into.floor_dispatch_s, floor_cpu, comm, dev)
            _timed(floor_combine.run, into.floor_combine_s, floor_cpu, comm, dev)
            if dev == "cpu":  # on a GPU, process time would count the syncs' spinning and NCCL's threads
                into.cpu_s.append(sum(cpu))
                into.floor_cpu_s.append(sum(floor_cpu))
    except MoEDispatchError:
        raise  # the dispatcher told the other ranks already
    except BaseException as exc:
        comm.announce_failure("bench", exc)
        raise
    return samples


def capacity_pairs(case: BenchCase) -> int:
    """What low-latency mode must move per rank: every capacity slot to every rank."""
    return case.tokens_per_rank * case.world_size if case.mode is Mode.LOW_LATENCY else 0


__all__ = ["CaseProfile", "RankSamples", "capacity_pairs", "case_inputs", "case_spec", "launches", "measure_case"]


#: ATen ops that launch no kernel: views, shape and allocation (a leaf of these moves no data), and the host-side
#: no-ops: a Python number wrapped as a CPU scalar, and conj/neg resolution of a tensor that has neither bit.
_NO_KERNEL = frozenset({
    "aten::view", "aten::as_strided", "aten::as_strided_", "aten::slice", "aten::select", "aten::reshape",
    "aten::_reshape_alias", "aten::unsqueeze", "aten::squeeze", "aten::narrow", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh",
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::unbind", "aten::split",
    "aten::split_with_sizes", "aten::chunk", "aten::flatten", "aten::unflatten", "aten::view_as", "aten::expand_as",
    "aten::set_", "aten::result_type", "aten::is_nonzero", "aten::_unsafe_view", "aten::contiguous", "aten::clone",
    "aten::to", "aten::_to_copy", "aten::new_empty", "aten::scalar_tensor", "aten::resolve_conj", "aten::resolve_neg",
})


def launches(events: Any, within: str | None = None) -> int:
    """What would be kernel launches on an accelerator among ``torch.profiler`` events: the innermost ATen ops (and
    c10d collectives) that move or compute data, i.e. those with no such op below them; views, shapes and
    allocations (``_NO_KERNEL``) move none. ``within``: only those under the ``record_function`` of that name (the
    calling thread's: not the copies gloo's own threads make, which the bare collective pays too)."""
    def moves(event: Any) -> bool:
        return event.name.startswith("c10d::") or (event.name.startswith("aten::") and event.name not in _NO_KERNEL)

    def below(event: Any) -> bool:
        return any(moves(child) or below(child) for child in event.cpu_children)

    def inside(event: Any) -> bool:
        while event is not None and event.name != within:
            event = event.cpu_parent
        return within is None or event is not None

    return sum(1 for event in events if moves(event) and not below(event) and inside(event))


@dataclass(frozen=True)
class CaseProfile:
    case: BenchCase
    table: str  # torch.profiler's op table on rank 0
    ops: float  # ``launches`` per dispatch + combine on rank 0


_CALLS = "moe-dispatch bench: dispatch + combine"


def profile_case(rank: int, world_size: int, case: BenchCase, settings: BenchSettings, rows: int = 12) -> CaseProfile:
    """torch.profiler's table of ops (self CPU time) over a few dispatch + combine iterations on this rank: where the
    time goes, stage by stage; and the ops per call of the paths an accelerator runs (``moe-dispatch bench
    --profile``): on host memory the reference backends take paths of their own (``host_paths``: low-latency
    mode's compact expansion, cache-sized blocks) and gloo checks every call against the peers' (NCCL only the
    calls that read counts anyway), so the count is taken with those set as on an accelerator."""
    from torch.profiler import ProfilerActivity, profile, record_function

    dispatcher, x, ids, weights = _setup(rank, case, settings)
    iterations = max(1, min(settings.iterations, 5))

    def profiled():  # type: ignore[no-untyped-def]
        out = dispatcher.dispatch(x, ids, weights)  # warm: buffers made, constants cached
        expert_rows = _expert_rows(out, case, settings.device)
        dispatcher.combine(expert_rows, out)
        del out
        dispatcher.comm.barrier("bench barrier")
        with profile(activities=[ProfilerActivity.CPU]) as prof, record_function(_CALLS):
            for _ in range(iterations):
                dispatcher.combine(expert_rows, dispatcher.dispatch(x, ids, weights))
        return prof

    table = profiled().key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    if hasattr(dispatcher.backend_dispatcher, "host_paths"):
        dispatcher.backend_dispatcher.host_paths = False
    dispatcher.comm.checks_calls_everywhere = False  # on every rank alike
    return CaseProfile(case, f"rank {rank}, {iterations} iterations of dispatch + combine, {case.label}:\n{table}",
                       launches(profiled().events(), _CALLS) / iterations)
