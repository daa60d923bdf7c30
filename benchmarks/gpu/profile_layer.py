"""Where a reference backend's dispatch + combine spends its time on one GPU: torch's profiler.

    python benchmarks/gpu/profile_layer.py [--backend torch] [--tokens 128 --tokens 4096] [--json out.json]

World size 1 (NCCL), DeepSeek-V3's shape (H=7168, 256 experts, top-8), BF16 on the wire (the
rows dispatched are the experts' output, so no expert math is timed). For each mode and token
count: host and device time per dispatch + combine, kernel launches per call, and the operators
with the most device time and the most host time. ``--device cpu`` runs it on gloo (how it is
tested without a GPU). This is the measurement behind reference/exchange.py's block sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import moe_dispatch as md
from moe_dispatch_testing.local import one_rank_group
from moe_dispatch_testing.routing import random_routing


def _step(d: md.Dispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = d.dispatch(x, ids, w)
    return d.combine(out.hidden_states, out)


def profile_case(backend: str, mode: str, tokens: int, device: torch.device, iters: int, top: int) -> dict:
    hidden, experts, k = 7168, 256, 8
    spec = md.DispatchSpec(hidden, experts, k, num_max_dispatch_tokens_per_rank=tokens, mode=mode,
                           output_dtype="bf16")
    d = md.create_dispatcher(backend, spec, env={})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)
    ids, w = (t.to(device) for t in random_routing(tokens, experts, k, generator=g))
    for _ in range(3):
        _step(d, x, ids, w)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        _step(d, x, ids, w)
    sync()
    wall = (time.perf_counter() - start) / iters
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            _step(d, x, ids, w)
        sync()
    events = prof.key_averages()
    on_device = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
    kernels = sum(e.count for e in on_device if e.device_type == torch.autograd.DeviceType.CUDA)

    def rows(key: str) -> list[dict]:
        ranked = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:top]
        return [{"op": e.key[:60], "calls": e.count // iters, "us_per_step": getattr(e, key, 0) / iters}
                for e in ranked if getattr(e, key, 0) > 0]

    return {"backend": backend, "mode": mode, "tokens": tokens, "ms_per_step": wall * 1e3,
            "kernels_per_step": kernels / iters, "device_time": rows("self_device_time_total"),
            "host_time": rows("self_cpu_time_total")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch")
    p.add_argument("--mode", action="append", choices=["normal", "low_latency"])
    p.add_argument("--tokens", type=int, action="append")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    started = one_rank_group("nccl" if device.type == "cuda" else "gloo")
    results = []
    try:
        for mode in args.mode or ["normal", "low_latency"]:
            for tokens in args.tokens or [128, 4096]:
                r = profile_case(args.backend, mode, tokens, device, args.iters, args.top)
                results.append(r)
                print(f"\n{args.backend} {mode} T={tokens}: {r['ms_per_step']:.3f} ms per dispatch+combine, "
                      f"{r['kernels_per_step']:.0f} kernels")
                for label in ("device_time", "host_time"):
                    print(f"  most {label.replace('_', ' ')}:")
                    for row in r[label]:
                        print(f"    {row['us_per_step']:>10.1f} us  {row['calls']:>4}x  {row['op']}")
    finally:
        if started:
            dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
