"""Combine's per-token reduction in the reference backends, against the plain way, in one process.

Baseline: every expert row cast to fp32 and weighted in 4 MiB chunks, added with ``index_add_``
into a zeroed fp32 ``[tokens, H]`` tensor, then cast to BF16 (what ``reference/exchange.py`` did
before issue 16). Measured: ``sum_terms``, which adds each cache-sized block of tokens into an
accumulator that stays in cache and writes each token's BF16 sum once. Both must give the same
bits (checked before timing). Alternating runs; medians. Run::

    python benchmarks/combine_reduction.py --tokens 512 --tokens 16384
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_dispatch._reference.sums import CPU_CHUNK_BYTES, sum_terms, token_major
from moe_dispatch._reference.slots import Slot

BASELINE_CHUNK_BYTES = 4 << 20  # the baseline's chunks (the docstring)


def baseline(y: torch.Tensor, row_token: torch.Tensor, weight: torch.Tensor, tokens: int) -> torch.Tensor:
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float32)
    step = max(1, BASELINE_CHUNK_BYTES // (4 * y.shape[1]))
    for start in range(0, y.shape[0], step):
        part = slice(start, min(y.shape[0], start + step))
        chunk = y[part].to(torch.float32, copy=True).mul_(weight[part].unsqueeze(1))
        out.index_add_(0, row_token[part], chunk)
    return out.to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, action="append", help="received tokens (repeatable)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rows-per-token", type=int, default=2, help="expert rows per token on this rank")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'tokens':>7} {'rows':>7} {'baseline ms':>12} {'one pass ms':>12} {'ratio':>6} {'table ms':>9}")
    for tokens in args.tokens or [512, 16384]:
        g = torch.Generator().manual_seed(0)
        rows = tokens * args.rows_per_token
        y = torch.randn(rows, args.hidden, generator=g).to(torch.bfloat16)
        row_token = torch.randint(0, tokens, (rows,), generator=g)
        weight = torch.rand(rows, generator=g)
        start = time.perf_counter()
        terms = token_major(row_token, tokens, args.hidden, CPU_CHUNK_BYTES, weight)
        table = time.perf_counter() - start
        out, slot = torch.empty(tokens, args.hidden, dtype=torch.bfloat16), Slot(0)
        sum_terms(out, y, terms, slot)
        if not torch.equal(out.view(torch.int16), baseline(y, row_token, weight, tokens).view(torch.int16)):
            raise SystemExit("the one-pass reduction gave other bits than the baseline")
        base, one = [], []
        for _ in range(args.iters):
            t = time.perf_counter()
            baseline(y, row_token, weight, tokens)
            base.append(time.perf_counter() - t)
            t = time.perf_counter()
            sum_terms(out, y, terms, slot)
            one.append(time.perf_counter() - t)
        b, o = statistics.median(base) * 1e3, statistics.median(one) * 1e3
        print(f"{tokens:>7} {rows:>7} {b:>12.1f} {o:>12.1f} {o / b:>6.2f} {table * 1e3:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
