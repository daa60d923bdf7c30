"""Check the Ascend plugins on an NPU against the real DeepEP-Ascend and torch_npu.

    # on an Atlas A2/A3 machine with CANN, torch-npu, DeepEP-Ascend, pytest and the testing distributions
    # (pip install -e plugins/ascend_deepep/testing [-e plugins/ascend_fuseep/testing]) installed:
    export HCCL_BUFFSIZE=1024            # the ops check it; the table prints what each mode needs
    torchrun --nproc-per-node 2 plugins/ascend_deepep/scripts/hardware_check.py
    torchrun --nproc-per-node 2 plugins/ascend_deepep/scripts/hardware_check.py --probe-neg-one-unset
    torchrun --nproc-per-node 2 plugins/ascend_deepep/scripts/hardware_check.py --probe-mode2-tokens
    torchrun --nproc-per-node 2 plugins/ascend_deepep/scripts/hardware_check.py --probe-fused-neg-one
    # Atlas A2 beyond one node (the internode kernels; VENDOR.md "Only the hardware can settle"): on each of two
    # 8-NPU nodes
    export HCCL_INTRA_PCIE_ENABLE=1 HCCL_INTRA_ROCE_ENABLE=0 HCCL_BUFFSIZE=1300
    torchrun --nnodes 2 --nproc-per-node 8 ... plugins/ascend_deepep/scripts/hardware_check.py --parts platform,windows,deepep
    # the same checks with the CPU fakes standing in for the vendor (no NPU; 2 local gloo ranks):
    python plugins/ascend_deepep/scripts/hardware_check.py --fake

DeepEP-Ascend takes no single rank (its ops' tiling needs 2, normal mode's config map starts
at 2): at one rank the script prints the vendor's own refusal and runs the rest. What it does,
per rank: the ascend_deepep adapter on the real ``deep_ep.Buffer`` (NPU, HCCL) and on the fake
(CPU, a gloo group beside it) with the same inputs, both modes, BF16 and INT8, with and without
-1 expert ids (the adapter sets MOE_ENABLE_TOPK_NEG_ONE=1 for its calls), two dispatches of
different sizes in flight combined in either order and two dispatchers on one group interleaved
(the Buffer's real_max_bs and the kernels' window halves); the chip, CANN's version and which aclnn
variants it has; the torch_npu expert runners against the fake ops (and the int4 packing against
``npu_convert_weight_to_int4pack`` on the NPU); FuseEP's two fuse modes (with
moe-dispatch-ascend-fuseep-testing installed); the recorded signatures against torch_npu's registered op
schemas (the callables), its documented prototypes (information) and the installed
``deep_ep/buffer.py``; the HCCL window the ops check. The probes run what the adapter never does
(``-1`` ids with no active mask; fuse mode 2 with sglang's bound T; raw ``-1`` ids in the fused
ops) and may fail or corrupt device memory: run them alone, last. Rank 0 prints a table; the exit status is 1 if any check failed.
Record the output in docs/evidence/hardware-runs.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from moe_dispatch_ascend_deepep_testing.hardware import Options, run_rank, summarize


def _fuseep():  # type: ignore[no-untyped-def]
    try:
        from moe_dispatch_ascend_fuseep_testing.hardware import fuseep_rows
    except ImportError:
        return None
    return fuseep_rows


def parse(argv: Sequence[str] | None) -> tuple[Options, int]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true", help="CPU fakes instead of the vendor, on local gloo ranks")
    p.add_argument("--world-size", type=int, default=2, help="local ranks with --fake (default 2)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--experts-per-rank", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--parts", default="platform,signatures,windows,deepep,runners,fuseep")
    p.add_argument("--probe-neg-one-unset", action="store_true")
    p.add_argument("--probe-mode2-tokens", action="store_true")
    p.add_argument("--probe-fused-neg-one", action="store_true", help="FuseEP with raw -1 ids (the adapter never does)")
    a = p.parse_args(argv)
    small = a.fake  # CPU: small shapes by default
    opts = Options(fake=a.fake, hidden=a.hidden or (1024 if small else 7168), tokens=a.tokens or (8 if small else 64),
                   experts_per_rank=a.experts_per_rank or (2 if small else 8), top_k=a.top_k or (2 if small else 8),
                   intermediate=a.intermediate, parts=tuple(a.parts.split(",")),
                   probe_neg_one_unset=a.probe_neg_one_unset, probe_mode2_tokens=a.probe_mode2_tokens,
                   probe_fused_neg_one=a.probe_fused_neg_one)
    return opts, a.world_size


def main(argv: Sequence[str] | None = None) -> int:
    opts, world = parse(argv)
    if opts.fake:
        os.environ.setdefault("HCCL_BUFFSIZE", "1024")  # the fakes check the window as the ops do
        from moe_dispatch_testing import RankPool

        with RankPool(world) as pool:
            per_rank = pool.map(run_rank, opts, _fuseep())
        table, ok = summarize(per_rank)
        print(f"Ascend plugins on the CPU fakes, {world} gloo ranks\n{table}")
        return 0 if ok else 1
    import torch
    import torch.distributed as dist
    import torch_npu  # noqa: F401 - registers the NPU device and HCCL

    torch.npu.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("hccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = run_rank(rank, world, opts, _fuseep())
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows, group=dist.new_group(backend="gloo"))
    dist.destroy_process_group()
    if rank != 0:
        return 0
    table, ok = summarize(gathered)
    print(f"Ascend plugins on {world} NPUs (HCCL_BUFFSIZE={os.environ.get('HCCL_BUFFSIZE', '200 (default)')})\n{table}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
