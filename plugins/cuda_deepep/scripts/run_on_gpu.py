"""Run the cuda_deepep backend for real on a CUDA machine with DeepEP installed.

    torchrun --nproc-per-node 8 plugins/cuda_deepep/scripts/run_on_gpu.py [--hidden 7168] [--tokens 128]
    torchrun --nnodes 2 --nproc-per-node 8 ... plugins/cuda_deepep/scripts/run_on_gpu.py     # past 8 ranks

On every rank, for each mode and dtype: dispatch → scaled-identity experts → combine on DeepEP and on the core
``torch`` backend (NCCL), their relative difference, and the median round-trip time of each. Rank 0 prints a
table; the exit status is 1 if any case differs by more than 1e-2. (What reaches ``deep_ep.Buffer`` is checked on
the fakes only: ``selfcheck.wire_seen``.)

The layers of one process share its DeepEP Buffers, as an engine's do (``buffers``): within 8 ranks one NVSHMEM
(low-latency) Buffer and one intranode normal-mode Buffer. Past 8 ranks NVSHMEM starts once per process, so one
Buffer serves both modes: the low-latency layers come first, and the first creates an LL-mode Buffer sized and
QP'd for the normal-mode layers too (``DeepEPBackend.both_modes_options``), which they then use (the adapter
cleans its LL signalling after each normal-mode combine). Normal mode there asserts both regions below INT_MAX, so
the experts per rank default to 32 halved until the LL region fits (16 on 16 ranks at H=7168, T=128;
``selfcheck.fitting_experts_per_rank``); an explicit ``--experts-per-rank`` that does not fit is a ``CapacityError``. ``backend.close()`` destroys the Buffers at the end, on
every rank.

This is the multi-GPU agreement and timing run; ``hardware_check.py`` is the one-GPU check of the
adapter against the real DeepEP/DeepGEMM and their fakes. Deterministic algorithms stay off: DeepEP 2.x
asserts that torch does not fill uninitialized memory (``check_torch_deterministic``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing.selfcheck import agree_with_torch, fitting_experts_per_rank, layer_spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts-per-rank", type=int, default=None,
                        help="default 32, halved past 8 ranks until one Buffer serves both modes")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, ok = [], True
    backend = DeepEPBackend()
    per_rank = args.experts_per_rank or fitting_experts_per_rank(backend, world, args.hidden, args.top_k, args.tokens)
    shape = dict(hidden=args.hidden, experts_per_rank=per_rank, top_k=args.top_k, tokens=args.tokens)
    first = None
    if world > vendor.NUM_MAX_NVL_PEERS:  # one LL-mode Buffer for both modes: NVSHMEM starts once per process
        first = backend.both_modes_options(layer_spec(world, "normal", "bf16", **shape),
                                           layer_spec(world, "low_latency", "bf16", **shape), world)
    try:
        for mode in ("low_latency", "normal"):
            for dtype in ("bf16", "fp8"):
                options = first if (mode, dtype) == ("low_latency", "bf16") else None
                r = agree_with_torch(rank, world, mode, dtype, iterations=args.iterations, backend=backend,
                                     options=options, **shape)
                gathered: list = [None] * world
                dist.all_gather_object(gathered, r)
                worst = max(g["relative_difference"] for g in gathered)
                slowest = {k: max(g["seconds"][k] for g in gathered) for k in ("cuda_deepep", "torch")}
                ok &= worst < 1e-2
                rows.append((mode, dtype, worst, slowest["cuda_deepep"], slowest["torch"]))
        backend.close()  # collective: every rank, before the process group goes
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(f"cuda_deepep vs torch on {world} GPUs, H={args.hidden}, T={args.tokens}, top-{args.top_k}, "
              f"{per_rank} experts per rank")
        print(f"{'mode':<12} {'dtype':<6} {'rel diff':>9} {'deepep ms':>10} {'torch ms':>9}")
        for mode, dtype, diff, a, b in rows:
            print(f"{mode:<12} {dtype:<6} {diff:>9.2e} {a * 1e3:>10.3f} {b * 1e3:>9.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
