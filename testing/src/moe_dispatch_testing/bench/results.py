"""From every rank's samples to one row: latencies, bytes, and the ratios."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace

from moe_dispatch import Mode

from .cases import BenchCase
from .worker import RankSamples


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per iteration, the slowest rank: a collective finishes when its last rank does."""
    return [max(column) for column in zip(*per_rank)]


@dataclass(frozen=True)
class CaseResult:
    """One case, all ranks. Times in ms (median and p90 of the per-iteration slowest rank);
    bytes per rank (the mean over ranks of what each sent)."""

    case: BenchCase
    dispatch_ms: float
    dispatch_p90_ms: float
    combine_ms: float
    combine_p90_ms: float
    floor_ms: float
    dispatch_bytes: float
    combine_bytes: float
    payload_bytes: float
    #: what the call check (docs/reliability.md) sent per rank per dispatch+combine, beside the bytes above.
    check_bytes: float
    #: payload bytes over what the wire format says they must be (1.00: no padding, no wrong dtype).
    wire_ratio: float
    #: dispatch + combine over the bare all-to-alls of the same bytes (median of per-iteration ratios).
    floor_ratio: float
    #: the ranks' CPU time in dispatch + combine over theirs in the floor (median of per-iteration ratios): where
    #: the ranks share the cores with the transport (gloo on a CPU), the wall-time ratio follows it.
    core_ratio: float
    iterations: int
    vs_allgather: float | None = None

    @property
    def total_ms(self) -> float:
        return self.dispatch_ms + self.combine_ms

    @property
    def gb_per_s(self) -> float:
        """Bytes this rank sent (dispatch + combine) per second of dispatch + combine."""
        seconds = self.total_ms / 1e3
        return (self.dispatch_bytes + self.combine_bytes) / seconds / 1e9 if seconds > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["case"] = {**asdict(self.case), "dtype": self.case.dtype.value, "mode": self.case.mode.value}
        d["total_ms"] = self.total_ms
        d["gb_per_s"] = self.gb_per_s
        return d


def expected_payload_bytes(case: BenchCase, s: RankSamples) -> int:
    """What one rank's dispatch payload must be: one wire-format row per (token, destination
    rank) pair (``torch``), per token and rank (``allgather``), or per capacity slot and
    rank (low latency, a fixed-size exchange)."""
    if case.mode is Mode.LOW_LATENCY:
        rows = case.tokens_per_rank * case.world_size
    elif case.backend == "allgather":
        rows = case.tokens_per_rank * case.world_size
    else:
        rows = s.rank_pairs
    return rows * s.wire_bytes_per_token


def summarize_case(case: BenchCase, samples: list[RankSamples]) -> CaseResult:
    dispatch = _slowest([s.dispatch_s for s in samples])
    combine = _slowest([s.combine_s for s in samples])
    floor = [a + b for a, b in zip(_slowest([s.floor_dispatch_s for s in samples]),
                                   _slowest([s.floor_combine_s for s in samples]))]
    ratios = [(d + c) / f for d, c, f in zip(dispatch, combine, floor) if f > 0]
    cpu = [sum(column) for column in zip(*[s.cpu_s for s in samples])]
    floor_cpu = [sum(column) for column in zip(*[s.floor_cpu_s for s in samples])]
    core = [a / b for a, b in zip(cpu, floor_cpu) if b > 0]
    n = len(samples)
    sent = sum(s.dispatch_traffic.payload_bytes for s in samples)
    expected = sum(expected_payload_bytes(case, s) for s in samples)
    return CaseResult(
        case=case,
        dispatch_ms=statistics.median(dispatch) * 1e3,
        dispatch_p90_ms=percentile(dispatch, 90) * 1e3,
        combine_ms=statistics.median(combine) * 1e3,
        combine_p90_ms=percentile(combine, 90) * 1e3,
        floor_ms=statistics.median(floor) * 1e3,
        dispatch_bytes=sum(s.dispatch_traffic.payload_bytes + s.dispatch_traffic.metadata_bytes for s in samples) / n,
        combine_bytes=sum(s.combine_traffic.combine_bytes for s in samples) / n,
        payload_bytes=sent / n,
        check_bytes=sum(s.dispatch_traffic.check_bytes + s.combine_traffic.check_bytes for s in samples) / n,
        wire_ratio=sent / expected if expected else float("nan"),
        floor_ratio=statistics.median(ratios) if ratios else float("nan"),
        core_ratio=statistics.median(core) if core else float("nan"),
        iterations=len(dispatch),
    )


def with_baselines(results: list[CaseResult], baseline: str = "allgather") -> list[CaseResult]:
    """Each result with its ratio to the ``baseline`` backend's result for the same point."""
    index = {(r.case.with_backend(baseline)): r for r in results if r.case.backend == baseline}
    out = []
    for r in results:
        base = index.get(r.case.with_backend(baseline))
        out.append(replace(r, vs_allgather=r.total_ms / base.total_ms) if base and base.total_ms > 0 else r)
    return out


__all__ = ["CaseResult", "expected_payload_bytes", "percentile", "summarize_case", "with_baselines"]
