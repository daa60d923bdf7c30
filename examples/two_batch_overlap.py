"""Two-batch overlap with the split-phase calls, on local gloo ranks (no GPU needed).

    python examples/two_batch_overlap.py [--backend torch] [--world-size 2] [--mode low_latency]

Each rank splits its batch into two micro-batches A and B and runs the schedule an engine's two-batch overlap
uses: while one micro-batch's rows travel, the other's experts compute. It checks the result against blocking
dispatch → experts → combine on the same inputs (the bits must be equal) and prints both times.
"""

from __future__ import annotations

import argparse
import time

import torch

import moe_dispatch as md
from moe_dispatch_testing.local import run_local
from moe_dispatch_testing.routing import random_expert_weights, random_routing

HIDDEN, EXPERTS, TOP_K, TOKENS = 1024, 16, 4, 64


def experts(layer: md.ExpertWeights, out: md.DispatchOutput) -> torch.Tensor:
    """The reference experts (SwiGLU, any wire dtype) on what dispatch handed over: unweighted bf16 rows."""
    return md.TorchExperts().apply_without_routing_weights(
        layer, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16,
        global_scale=out.global_scale)


def overlapped(d: md.Dispatcher, layer: md.ExpertWeights, batches: list[tuple]) -> list[torch.Tensor]:
    started = [d.dispatch_start(*batch) for batch in batches]  # every micro-batch's rows on their way
    combines = []
    for pending in started:
        out = pending.wait()  # this one's rows are in; the next one's still travel
        combines.append(d.combine_start(experts(layer, out), out))  # its combine travels while the next computes
    return [c.wait() for c in combines]


def sequential(d: md.Dispatcher, layer: md.ExpertWeights, batches: list[tuple]) -> list[torch.Tensor]:
    results = []
    for batch in batches:
        out = d.dispatch(*batch)
        results.append(d.combine(experts(layer, out), out))
    return results


def run(rank: int, world: int, backend: str, mode: str) -> dict:
    spec = md.DispatchSpec(HIDDEN, EXPERTS, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS // 2, mode=mode,
                           output_dtype="bf16")
    d = md.create_dispatcher(backend, spec)
    g = torch.Generator().manual_seed(rank)
    local = spec.local_experts(world)
    layer = random_expert_weights(EXPERTS, HIDDEN, 2 * HIDDEN, generator=torch.Generator().manual_seed(0)).slice(
        rank * local, local)  # the same global layer on every rank; this rank's experts
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, EXPERTS, TOP_K, generator=g)
    half = TOKENS // 2
    batches = [(x[:half], ids[:half], w[:half]), (x[half:], ids[half:], w[half:])]
    times = {}
    results = {}
    for name, schedule in (("sequential", sequential), ("overlapped", overlapped)):
        d.comm.barrier()
        start = time.perf_counter()
        results[name] = schedule(d, layer, batches)
        times[name] = time.perf_counter() - start
    same = all(torch.equal(a, b) for a, b in zip(results["sequential"], results["overlapped"]))
    return {"rank": rank, "split_phase": d.split_phase, "same_bits": same, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mode", default="low_latency", choices=[m.value for m in md.Mode])
    args = parser.parse_args()
    for r in run_local(run, args.world_size, args.backend, args.mode):
        print(f"rank {r['rank']}: split phase {r['split_phase']}, same bits as blocking calls: {r['same_bits']}, "
              f"sequential {r['sequential'] * 1e3:.1f} ms, overlapped {r['overlapped'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
