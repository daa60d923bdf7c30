"""What the core API costs per call, apart from the transport and the backend.

Two measurements, world size 1, a tiny payload:

- ``torch``: ``Dispatcher.dispatch/combine`` against the ``torch`` backend object's own
  ``dispatch/combine`` on the same tensors. The backend's work (tens of µs of torch ops)
  dominates both, so the difference is noisy.
- ``replay``: the same ``Dispatcher`` code path around a backend object that hands back
  one recorded dispatch output and combine result. Everything left is the library's own
  work per call (argument checks, the call path), measured to tens of ns.

Rounds alternate between the API and the direct call so both see the same machine load.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from moe_dispatch import Dispatcher, DispatchOutput, DispatchSpec, create_dispatcher
from moe_dispatch._checks import runs_value_checks
from moe_dispatch_testing.routing import random_routing


@dataclass(frozen=True)
class OverheadResult:
    """ns per dispatch+combine pair: medians over rounds of each path, and the median of
    the per-round differences."""

    check_inputs: bool
    backend_ns: float  # the torch backend object called directly
    api_ns: float  # the same through the core API
    replay_direct_ns: float
    replay_api_ns: float
    overhead_ns: float  # replay: API minus direct, median of per-round differences
    rounds: int
    calls_per_round: int
    payload: str
    #: ns per call of each check the overhead is made of (the fastest of a few rounds): where it goes.
    parts: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True, slots=True)
class _ReplayHandle:
    owner: object


class _Replay:
    """A backend object that answers instantly with recorded results."""

    def __init__(self, out: DispatchOutput, combined: torch.Tensor) -> None:
        self.out = replace(out, handle=_ReplayHandle(self), call=0, combined=False)
        self.combined = combined

    def dispatch(self, hidden_states, topk_ids, topk_weights) -> DispatchOutput:  # type: ignore[no-untyped-def]
        return replace(self.out)  # a new output per call, as a backend returns (each is combined once)

    def combine(self, expert_output, dispatch_output) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return self.combined


def _ns_per_pair(dispatch, combine, x, ids, w, y, calls: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter_ns()
    for _ in range(calls):
        combine(y, dispatch(x, ids, w))
    return (time.perf_counter_ns() - start) / calls


def _alternate(api, direct, args, rounds: int, calls: int) -> tuple[list[float], list[float]]:  # type: ignore[no-untyped-def]
    for _ in range(2):  # warm-up
        _ns_per_pair(*direct, *args, max(1, calls // 10))
        _ns_per_pair(*api, *args, max(1, calls // 10))
    a, d = [], []
    for _ in range(rounds):
        d.append(_ns_per_pair(*direct, *args, calls))
        a.append(_ns_per_pair(*api, *args, calls))
    return a, d


class _NoInputChecks:
    def dispatch(self, *args: object) -> bool:
        return False

    def combine(self, *args: object) -> None:
        return None


class _NoOutputChecks:
    def dispatch(self, out: DispatchOutput, check_values: bool) -> DispatchOutput:
        return out

    def combine(self, result: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        return result


def _best_ns(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def _parts(d: Dispatcher, x, ids, w, y, calls: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The pieces of the core's per-pair work, timed alone on the same tensors (the fastest of 5 rounds); the call
    path is a dispatcher whose checks are no-ops, less the backend called directly."""
    out = d.dispatch(x, ids, w)
    impl = d.backend_dispatcher
    result = impl.combine(y, out)
    checks, outputs = d._checks, d._outputs  # noqa: SLF001 - the bench measures them
    values = runs_value_checks(d.check_inputs, x)
    bare = Dispatcher(d.backend, d.spec, d.resolution, impl, d.comm, d.buffer_size, check_inputs=d.check_inputs)
    bare._checks, bare._outputs = _NoInputChecks(), _NoOutputChecks()  # type: ignore[assignment]  # noqa: SLF001
    bare._received = bare._outputs.dispatch  # noqa: SLF001
    pieces = {
        "input checks, dispatch": lambda: checks.dispatch(x, ids, w, values),
        "input checks, combine": lambda: checks.combine(y, out),
        "output checks, dispatch": lambda: outputs.dispatch(out, values),
        "output checks, combine": lambda: outputs.combine(result, out),
    }
    timings = {name: _best_ns(fn, calls) for name, fn in pieces.items()}
    timings["call path without the checks (pair)"] = (_best_ns(lambda: bare.combine(y, bare.dispatch(x, ids, w)), calls)
                                                       - _best_ns(lambda: impl.combine(y, impl.dispatch(x, ids, w)),
                                                                  calls))
    return timings


def measure_overhead(
    *, check_inputs: bool = False, rounds: int = 15, calls_per_round: int = 2000,
    tokens: int = 1, hidden: int = 128, experts: int = 8, top_k: int = 2,
) -> OverheadResult:
    """Must run where ``torch.distributed`` is not initialized (world size 1)."""
    spec = DispatchSpec(hidden, experts, top_k, num_max_dispatch_tokens_per_rank=max(tokens, 1), output_dtype="bf16")
    dispatcher = create_dispatcher("torch", spec, env={}, check_inputs=check_inputs)
    direct = dispatcher.backend_dispatcher
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids, w = random_routing(tokens, experts, top_k, generator=g)
    out = dispatcher.dispatch(x, ids, w)
    y = torch.ones_like(out.hidden_states)
    args = (x, ids, w, y)

    backend_api, backend_direct = _alternate(
        (dispatcher.dispatch, dispatcher.combine), (direct.dispatch, direct.combine), args,
        max(3, rounds // 3), max(1, calls_per_round // 20))

    replay = _Replay(out, dispatcher.combine(y, out))
    wrapped = Dispatcher(dispatcher.backend, dispatcher.spec, dispatcher.resolution, replay, dispatcher.comm,
                         dispatcher.buffer_size, check_inputs=check_inputs)
    replay_api, replay_direct = _alternate(
        (wrapped.dispatch, wrapped.combine), (replay.dispatch, replay.combine), args, rounds, calls_per_round)
    return OverheadResult(
        parts=_parts(wrapped, x, ids, w, y, calls_per_round),
        check_inputs=check_inputs,
        backend_ns=statistics.median(backend_direct),
        api_ns=statistics.median(backend_api),
        replay_direct_ns=statistics.median(replay_direct),
        replay_api_ns=statistics.median(replay_api),
        overhead_ns=statistics.median(a - d for a, d in zip(replay_api, replay_direct)),
        rounds=rounds,
        calls_per_round=calls_per_round,
        payload=f"T={tokens} H={hidden} E={experts} top-{top_k} bf16",
    )


__all__ = ["OverheadResult", "measure_overhead"]
