"""The cuda_deepep plugin against the real DeepEP and DeepGEMM on one GPU (H100/H200), compared with its fakes.

    python plugins/cuda_deepep/scripts/hardware_check.py            # or: torchrun --nproc-per-node 1 ...
    python plugins/cuda_deepep/scripts/hardware_check.py --fake     # the same checks on the fakes, on CPU

Checks (``moe_dispatch_cuda_deepep_testing.hardware``, in ``plugins/cuda_deepep/testing``): the recorded
signatures against the real callables; DeepEP's size functions (``get_low_latency_rdma_size_hint``, each tuned
``Config``'s NVL/RDMA hints) and DeepGEMM's layout functions against the ports; whether DeepGEMM keeps the SM90
scales as the runner lays them out (no transpose kernel); the ``deep_gemm`` runner on the real DeepGEMM against its
fake (FP8 and BF16, PACKED and MASKED, the masked capacity a multiple of every BLOCK_M the installed DeepGEMM may
pick);
DeepEP's V1 Buffer at one rank in low-latency mode (NVSHMEM, the process's one Buffer shared by both rounds,
closed after them) against the fake; in normal mode the adapter's refusal. Last, in subprocesses (each may end its
process: ``std::terminate`` from DeepEP's destructor, NVSHMEM started twice, V2 beside V1): DeepEP's own
normal-mode dispatch on one rank, two LL Buffers in one process, the V2 ``ElasticBuffer`` on a group of one, and
``cuda_deepep_v2`` in normal mode dispatching 0 tokens (compared with the same probe on the fake); their exit status
and output are recorded. The records compared (signatures, tuned tables) are the installed
release's. Prints a table; exit status 1 on any mismatch.

This is the one-GPU vendor check. ``run_on_gpu.py`` is the multi-GPU agreement and timing run
(``torchrun --nproc-per-node 8``) against the core ``torch`` backend.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep_testing import hardware
from moe_dispatch_testing.local import one_rank_group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="run the checks on the fakes, on CPU")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (a DeepEP low-latency size)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank (a multiple of 4)")
    parser.add_argument("--gemm-hidden", type=int, default=2048, help="hidden size of the DeepGEMM checks")
    args = parser.parse_args(argv)
    if args.fake:
        started = one_rank_group("gloo")
        setup = hardware.fake_setup(args.hidden, args.tokens, args.gemm_hidden)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --fake to check the fakes on CPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        started = one_rank_group("nccl")
        if dist.get_world_size() != 1:
            print("run on one rank (torchrun --nproc-per-node 1)", file=sys.stderr)
            return 2
        setup = hardware.Setup(vendor.REAL, vendor.DEEP_GEMM, torch.device("cuda"), dist.group.WORLD,
                               dist.new_group(backend="gloo"), False, args.hidden, args.tokens, args.gemm_hidden)
    print(f"cuda_deepep hardware check ({'fakes on CPU' if args.fake else torch.cuda.get_device_name()})")
    print(f"{'section':<10} {'check':<52} {'real':<34} {'expected / fake':<34} result", flush=True)

    def emit(rows: list[hardware.Row]) -> None:
        for row in rows:
            print(row.line(), flush=True)

    try:
        rows = hardware.run_checks(setup, emit)
    finally:
        if started:
            dist.destroy_process_group()
    bad = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(bad)} of {len(rows)} agree")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
