"""Two micro-batches overlapped, against the same two run one after the other
(``moe-dispatch bench --only overlap``).

Each iteration, on every rank, between barriers, alternating so both see the same load:

- sequential: per micro-batch, blocking ``dispatch`` → expert compute → ``combine``;
- overlapped: an engine's two-batch overlap on the split-phase calls::

      dispatch_start(A)  dispatch_start(B)
      wait(A) → experts(A) → combine_start(A)      # B's rows travel meanwhile
      wait(B) → experts(B) → combine_start(B)      # A's combine travels meanwhile
      wait(combine A)  wait(combine B)

The expert compute is a stand-in that takes about one micro-batch's dispatch + combine
(calibrated at start; the ranks take the largest), the balance at which overlap helps most.
With exchange X and experts E per micro-batch the schedule cannot beat (X + 2E) / (2X + 2E),
0.75 at E = X: the first dispatch and the last combine have nothing to hide behind.

- ``host``: fp32 matmuls of the valid dispatched rows on the CPU. They share the cores with
  gloo's transfer threads, which copy every byte through the loopback: the ``exchange CPU``
  column says how many cores one rank's exchange keeps busy.
- ``device``: a wait that holds no core, as an accelerator's expert GEMM costs the host
  nothing, as long as the slowest rank's exchange; what is left is the schedule's own overlap.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from moe_dispatch import MoEDispatchError

from .cases import BenchCase, BenchSettings
from .results import _slowest
from .worker import _setup

_CALIBRATION_ROUNDS = 5


@dataclass(frozen=True)
class OverlapSamples:
    rank: int
    sequential_s: list[float]
    overlapped_s: list[float]
    start_s: list[float]  # overlapped: time on the caller's thread inside dispatch_start/combine_start
    wait_s: list[float]  # overlapped: time blocked in wait()
    exchange_s: float  # one micro-batch's blocking dispatch + combine, median
    exchange_cpu: float  # CPU seconds of this process (every thread) per second of the exchange
    compute_s: float  # the stand-in experts on one micro-batch, median
    split_phase: bool


@dataclass(frozen=True)
class OverlapResult:
    """Both schedules, ms: median over iterations of the slowest rank."""

    case: BenchCase
    sequential_ms: float
    overlapped_ms: float
    start_ms: float
    wait_ms: float
    exchange_ms: float
    exchange_cpu: float
    compute_ms: float
    compute: str
    split_phase: bool
    iterations: int

    @property
    def ratio(self) -> float:
        """overlapped / sequential: below 1 is time saved."""
        return self.overlapped_ms / self.sequential_ms if self.sequential_ms > 0 else float("nan")

    @property
    def bound(self) -> float:
        """The schedule's best ratio for this run: (X + 2E) / (2X + 2E) with E the experts' time and X one
        micro-batch's exchange as the sequential run took it ((sequential - 2E) / 2). Read ``ratio`` against it:
        the calibration of E to X moves it from run to run (0.75 at E = X)."""
        if self.sequential_ms <= 0:
            return float("nan")
        return (self.sequential_ms / 2 + self.compute_ms) / self.sequential_ms

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["case"] = {**asdict(self.case), "dtype": self.case.dtype.value, "mode": self.case.mode.value}
        d["ratio"] = self.ratio
        d["bound"] = self.bound
        return d


class _StandInExperts:
    """``repeats`` fp32 matmuls ``[rows, H] @ [H, 128]`` over a micro-batch's valid rows (what an
    expert GEMM scales with), then bf16 rows of the dispatched shape for combine (made once per
    shape: the bench times the schedule, not the allocator)."""

    def __init__(self, hidden: int, repeats: int, device: str, *, wait_s: float | None = None) -> None:
        #: Device experts: a wait of this long instead of the matmuls.
        self.wait_s = wait_s
        self.weight = torch.full((hidden, 128), 1.0 / hidden, dtype=torch.float32, device=device)
        self.repeats = repeats
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, out) -> torch.Tensor:  # type: ignore[no-untyped-def]
        valid = int(out.expert_counts().sum())  # MASKED layout: only the valid rows are computed
        x = self._inputs.get(valid)
        if x is None:
            x = self._inputs[valid] = torch.ones(valid, self.weight.shape[0], dtype=torch.float32,
                                                 device=self.weight.device)
        if self.wait_s is None:
            for _ in range(self.repeats):
                torch.mm(x, self.weight)
        else:
            time.sleep(self.wait_s)
        shape = (*out.hidden_states.shape[:-1], self.weight.shape[0])
        rows = self._outputs.get(shape)
        if rows is None:
            rows = self._outputs[shape] = torch.full(shape, 0.5, dtype=torch.bfloat16, device=self.weight.device)
        return rows


def _median_s(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_overlap(rank: int, world_size: int, case: BenchCase, settings: BenchSettings,
                    compute: str = "host") -> OverlapSamples:
    """Run the overlap case on this rank (two micro-batches of ``case.tokens_per_rank`` tokens);
    ``compute``: the stand-in experts, ``host`` or ``device`` (the module's docstring)."""
    dispatcher, x, ids, weights = _setup(rank, case, settings, in_flight=2)
    comm = dispatcher.comm
    batches = [(x, ids, weights), (x.flip(0).contiguous(), ids.flip(0).contiguous(), weights.flip(0).contiguous())]
    try:
        # Calibrate: one micro-batch's exchange, then enough matmuls to take as long.
        one = _StandInExperts(case.hidden, 1, settings.device)
        sample = dispatcher.dispatch(*batches[0])
        rows = one(sample)
        dispatcher.combine(rows, sample)

        def exchange() -> None:
            out = dispatcher.dispatch(*batches[0])
            dispatcher.combine(rows, out)

        comm.barrier("bench barrier")
        cpu = time.process_time()
        wall = time.perf_counter()
        exchange_s = _median_s(exchange, _CALIBRATION_ROUNDS)
        exchange_cpu = (time.process_time() - cpu) / (time.perf_counter() - wall)
        one(sample)  # its input and output made once, outside the timing
        unit_s = _median_s(lambda: one(sample), _CALIBRATION_ROUNDS)  # reads only its shape: no longer valid rows
        wanted = max(1, round(exchange_s / max(unit_s, 1e-9)))
        calibrated = comm.gather_object((wanted, exchange_s), "bench calibration")
        # Host experts: the same matmuls on every rank, as many as the slowest-to-exchange rank needs; device experts:
        # as long as the slowest rank's exchange (a count times this rank's unit would overshoot on a faster rank).
        experts = _StandInExperts(case.hidden, max(w for w, _ in calibrated), settings.device,
                                  wait_s=None if compute == "host" else max(s for _, s in calibrated))
        experts(sample)
        compute_s = _median_s(lambda: experts(sample), _CALIBRATION_ROUNDS)

        def sequential() -> None:
            for batch in batches:
                out = dispatcher.dispatch(*batch)
                dispatcher.combine(experts(out), out)

        stages = {"start": 0.0, "wait": 0.0}
        ran_split: list[bool] = []  # each started call's Pending.overlapped: a backend may run one whole

        def timed(stage: str, fn, *args):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            value = fn(*args)
            stages[stage] += time.perf_counter() - t0
            return value

        def overlapped() -> None:
            started = [timed("start", dispatcher.dispatch_start, *batch) for batch in batches]
            combines = []
            for pending in started:
                out = timed("wait", pending.wait)
                rows = experts(out)
                combines.append(timed("start", dispatcher.combine_start, rows, out))
            for pending in combines:
                timed("wait", pending.wait)
            ran_split.extend(p.overlapped for p in started + combines)

        seq: list[float] = []
        ovl: list[float] = []
        starts: list[float] = []
        waits: list[float] = []
        for i in range(settings.warmup + settings.iterations):
            for fn, into in ((sequential, seq), (overlapped, ovl)):
                comm.barrier("bench barrier")
                stages.update(start=0.0, wait=0.0)
                start = time.perf_counter()
                fn()
                if i >= settings.warmup:
                    into.append(time.perf_counter() - start)
            if i >= settings.warmup:
                starts.append(stages["start"])
                waits.append(stages["wait"])
    except MoEDispatchError:
        raise  # the dispatcher told the other ranks already
    except BaseException as exc:
        comm.announce_failure("bench", exc)
        raise
    return OverlapSamples(rank, seq, ovl, starts, waits, exchange_s, exchange_cpu, compute_s,
                          dispatcher.split_phase and all(ran_split))


def summarize_overlap(case: BenchCase, samples: list[OverlapSamples], compute: str) -> OverlapResult:
    def slowest(per_rank: list[list[float]]) -> float:  # ms: the median over iterations of the slowest rank
        return statistics.median(_slowest(per_rank)) * 1e3

    return OverlapResult(
        case=case,
        sequential_ms=slowest([s.sequential_s for s in samples]),
        overlapped_ms=slowest([s.overlapped_s for s in samples]),
        start_ms=slowest([s.start_s for s in samples]),
        wait_ms=slowest([s.wait_s for s in samples]),
        exchange_ms=max(s.exchange_s for s in samples) * 1e3,
        exchange_cpu=max(s.exchange_cpu for s in samples),
        compute=compute,
        compute_ms=max(s.compute_s for s in samples) * 1e3,
        split_phase=all(s.split_phase for s in samples),
        iterations=len(samples[0].sequential_s),
    )


def run_overlap(cases: list[BenchCase], settings: BenchSettings = BenchSettings(),
                computes: tuple[str, ...] = ("host", "device")) -> list[OverlapResult]:
    """Every overlap case with each stand-in compute on local ranks, one pool per world size."""
    from itertools import groupby

    from moe_dispatch_testing.local import RankPool

    results = []
    for world_size, group in groupby(sorted(cases, key=lambda c: c.world_size), key=lambda c: c.world_size):
        with RankPool(world_size) as pool:
            results += [summarize_overlap(case, pool.map(measure_overlap, case, settings, compute), compute)
                        for case in group for compute in computes]
    return results


def format_overlap(results: list[OverlapResult]) -> str:
    head = (f"{'backend':<10} {'dtype':<6} {'mode':<11} {'R':>2} {'T/mb':>5} {'exchange ms':>11} {'CPU':>4} "
            f"{'experts':>7} {'ms':>7} {'sequential':>10} {'overlapped':>10} {'start':>7} {'wait':>7} {'ratio':>6} "
            f"{'bound':>6} split")
    lines = [head, "-" * len(head)]
    for r in results:
        c = r.case
        lines.append(
            f"{c.backend:<10} {c.dtype.value:<6} {c.mode.value:<11} {c.world_size:>2} {c.tokens_per_rank:>5} "
            f"{r.exchange_ms:>11.2f} {r.exchange_cpu:>4.1f} {r.compute:>7} {r.compute_ms:>7.2f} "
            f"{r.sequential_ms:>10.2f} {r.overlapped_ms:>10.2f} {r.start_ms:>7.1f} {r.wait_ms:>7.1f} "
            f"{r.ratio:>6.2f} {r.bound:>6.2f} {'yes' if r.split_phase else 'no'}")
    lines.append("two micro-batches of T/mb tokens per rank; exchange: one micro-batch's blocking dispatch + combine; "
                 "CPU: cores one rank's exchange keeps busy; experts: the stand-in per micro-batch (host: matmuls on "
                 "the CPU; device: a wait holding no core, as on an accelerator); start / wait: of the overlapped time, "
                 "the caller's time inside dispatch_start + combine_start and blocked in wait() (both micro-batches); "
                 "ratio: overlapped / sequential (ms: median of the slowest rank); bound: the schedule's best "
                 "ratio, (X + 2E) / (2X + 2E) with E the experts and X = (sequential - 2E) / 2; "
                 "split: Dispatcher.split_phase, and every started call's Pending.overlapped")
    return "\n".join(lines)


__all__ = ["OverlapResult", "format_overlap", "measure_overlap", "run_overlap"]
