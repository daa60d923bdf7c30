"""What normal mode's token-major rows (``DispatchSpec(layout="token_major")``, sglang's and DeepEP's normal format)
cost against DeepEP's own normal path, shape for shape, on local gloo ranks.

DeepEP's intranode normal dispatch sends each token once per destination rank: its row, its FP8 scales, its top-k
ids (int64) and weights (fp32); combine returns one bf16 row per (token, rank) pair, which the sender adds
(DeepEP@dd758ca ``deep_ep/buffers/legacy.py`` ``Buffer.dispatch``/``combine``, kernels in
``csrc/kernels/intranode.cu``). The token-major mapping sends the same pairs (int32 ids) and hands the received rows
over as they arrive. Per rank: the bytes each sends for the same routing; a token-major dispatch + combine, the same
with PACKED rows (every (token, local expert) pair expanded and weighted in combine), each over the transport floor
(bare all-to-alls of the same bytes, same run). Run::

    python benchmarks/token_major.py --tokens 128 --tokens 512 --tokens 4096
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from moe_dispatch import DispatchDtype, Mode
from moe_dispatch.backend import WireFormat
from moe_dispatch_testing.bench.cases import BenchCase, BenchSettings
from moe_dispatch_testing.bench.results import summarize_case
from moe_dispatch_testing.bench.worker import measure_case
from moe_dispatch_testing.local import RankPool


def deepep_bytes(case: BenchCase, pairs: float) -> float:
    """DeepEP normal mode's dispatch + combine bytes for ``pairs`` (token, destination rank) pairs."""
    row = WireFormat(case.dtype, case.hidden).bytes_per_token  # the row and its fp32 scales
    return pairs * (row + case.top_k * (8 + 4) + 2 * case.hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, action="append", help="tokens per rank (repeatable)")
    parser.add_argument("--dtype", action="append", choices=["bf16", "fp8"], help="wire dtype (default both)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args(argv)
    settings = BenchSettings(warmup=2, iterations=args.iters)
    print(f"{args.world_size} gloo ranks, H={args.hidden}, E={args.experts}, top-{args.top_k}; per rank, medians")
    print(f"{'dtype':>5} {'T':>5} {'MB':>7} {'DeepEP MB':>9} {'token-major ms':>14} {'floor x':>7} "
          f"{'packed ms':>9} {'floor x':>7}")
    with RankPool(args.world_size) as pool:
        for dtype in args.dtype or ["bf16", "fp8"]:
            for tokens in args.tokens or [128, 512, 4096]:
                case = BenchCase("torch", DispatchDtype(dtype), Mode.NORMAL, args.world_size, tokens, args.hidden,
                                 args.experts, args.top_k, layout="token_major")
                samples = pool.map(measure_case, case, settings)
                major = summarize_case(case, samples)
                packed = summarize_case(replace(case, layout=None), pool.map(measure_case, replace(case, layout=None),
                                                                             settings))
                pairs = sum(s.rank_pairs for s in samples) / len(samples)
                ours = major.dispatch_bytes + major.combine_bytes
                print(f"{dtype:>5} {tokens:>5} {ours / 1e6:>7.2f} {deepep_bytes(case, pairs) / 1e6:>9.2f} "
                      f"{major.total_ms:>14.1f} {major.floor_ratio:>7.2f} {packed.total_ms:>9.1f} "
                      f"{packed.floor_ratio:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
