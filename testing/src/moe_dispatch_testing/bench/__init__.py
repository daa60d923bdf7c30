"""``moe-dispatch bench``: dispatch and combine latency, bytes on the wire and the ratios
that make them comparable on a noisy machine (the transport floor and the ``allgather``
baseline, both measured in the same run), plus the core API's per-call overhead."""

from .cases import BenchCase, BenchSettings, expand_cases
from .overhead import OverheadResult, measure_overhead
from .results import CaseResult, summarize_case
from .runner import run_bench

__all__ = [
    "BenchCase",
    "BenchSettings",
    "CaseResult",
    "OverheadResult",
    "expand_cases",
    "measure_overhead",
    "run_bench",
    "summarize_case",
]
