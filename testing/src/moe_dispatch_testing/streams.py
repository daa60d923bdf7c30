"""A split call started on one CUDA stream and waited on another: what ``moe_dispatch.streams`` must order
and keep alive; and a step captured in a CUDA graph. The hardware checks use them (``benchmarks/gpu/check_core.py``,
the DeepEP plugin's)."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from moe_dispatch import Pending

T = TypeVar("T")

#: GPU clock cycles the side stream spins before a start in ``run_started`` (~10 ms at 2 GHz).
SIDE_STREAM_SPIN_CYCLES = 20_000_000


def run_started(start: Callable[[], Pending[T]], device: torch.device, side_stream: bool = False) -> T:
    """A split call's result: started and waited here, or with ``side_stream`` (CUDA) started on a side stream that
    first waits for the current one (as an engine hands its inputs over) and waited on the current stream. The side
    stream spins ~10 ms before the start, so a wait not ordered after the start's work reads rows not yet written."""
    if not side_stream or device.type != "cuda":
        return start().wait()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(SIDE_STREAM_SPIN_CYCLES)
        pending = start()
    return pending.wait()


def captured(step: Callable[[], T]) -> "tuple[torch.cuda.CUDAGraph, T]":
    """``step`` run twice on a side stream (a warm-up: allocations made, kernels compiled, as torch's CUDA-graph notes
    ask), then captured once: the graph and what the captured call returned (its memory is the graph's, rewritten at
    each replay). Raises what the capture raises: that is the finding."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


__all__ = ["SIDE_STREAM_SPIN_CYCLES", "captured", "run_started"]
