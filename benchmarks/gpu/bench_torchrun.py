"""The tables of docs/performance.md on a CUDA machine: ``moe-dispatch bench`` under torchrun.

Each process is one rank on one GPU (NCCL); the cases, the transport floor (the same
collectives replayed as bare ``all_to_all_single``), the allgather baseline and the report
are the bench's own (``moe_dispatch.cli.bench``); only the launcher differs. Run on one node::

    torchrun --nproc-per-node 8 benchmarks/gpu/bench_torchrun.py --tokens 128 --tokens 4096 --json out.json

``--device cpu`` runs the same script on gloo (how it is tested without a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from moe_dispatch_testing.bench.cases import BenchSettings, Shape, expand_cases
from moe_dispatch_testing.bench.report import format_table
from moe_dispatch_testing.bench.results import summarize_case, with_baselines
from moe_dispatch_testing.bench.worker import measure_case
from moe_dispatch import DispatchDtype, Mode
from moe_dispatch.cli.presets import PRESETS, get_preset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", action="append", help="default: torch")
    p.add_argument("--dtype", action="append", choices=[d.value for d in DispatchDtype])
    p.add_argument("--mode", action="append", choices=[m.value for m in Mode])
    p.add_argument("--tokens", type=int, action="append", help="tokens per rank (default 128, 4096)")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--baseline", default="allgather")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results here (rank 0)")
    args = p.parse_args(argv)

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    preset = get_preset(args.preset)
    backends = args.backend or ["torch"]
    if args.baseline != "none" and args.baseline not in backends:
        backends.append(args.baseline)
    cases = expand_cases(
        backends, [DispatchDtype.parse(d) for d in args.dtype] if args.dtype else list(DispatchDtype),
        [Mode.parse(m) for m in args.mode] if args.mode else list(Mode), [world], args.tokens or [128, 4096],
        [Shape(preset.name, preset.hidden_size, preset.num_experts, preset.top_k)],
    )
    settings = BenchSettings(warmup=args.warmup, iterations=args.iters, device=args.device)
    results = []
    try:
        for i, case in enumerate(cases, 1):
            mine = measure_case(rank, world, case, settings)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, mine)
            results.append(summarize_case(case, gathered))
            if rank == 0:
                print(f"[{i}/{len(cases)}] {case.label}: {results[-1].total_ms:.3f} ms", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    if args.baseline != "none":
        results = with_baselines(results, args.baseline)
    if rank == 0:
        device = torch.cuda.get_device_name() if cuda else "cpu (gloo)"
        print(f"moe-dispatch bench under torchrun: {world} ranks on {device}, {preset.name}")
        print(format_table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([r.to_dict() for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
