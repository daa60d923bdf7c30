"""What ``DispatchSpec(expert_alignment=128)`` saves DeepGEMM's contiguous GEMM per layer, in one process.

Before issue 18 the DeepGEMM runner copied dense PACKED rows (and their FP8 scales) into a zeroed buffer with each
expert's rows at a multiple of 128, ran both GEMMs there, and gathered the output rows back. With the spec's
alignment, DeepEP V2 receives the rows in that layout itself (``do_zero_padding``), so that work is gone; for other
backends the core does the same copy once (``moe_dispatch.alignment``). This measures that copy (``align_rows`` +
``dense_rows``: the zero-fill, the scatter of rows and scales, the gather of the output) against a plain clone of the
same rows (the floor of moving them once), and counts its bytes. Uniform routing over the rank's local experts;
medians of alternating runs. Run::

    python benchmarks/expert_alignment.py --tokens 128 --tokens 1024 --tokens 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import align_rows
from moe_dispatch._alignment import dense_rows
from moe_dispatch.backend import make_codec
from moe_dispatch import DispatchOutput
from moe_dispatch.backend import align_up


def dense_output(rows_per_expert: torch.Tensor, hidden: int, generator: torch.Generator) -> DispatchOutput:
    rows = int(rows_per_expert.sum())
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, hidden)).quantize(torch.randn(rows, hidden, generator=generator))
    none = torch.zeros(0, 1, dtype=torch.int64)
    return DispatchOutput(q.data, q.scale, none, none.float(), rows_per_expert, 1, md.Layout.PACKED,
                          md.DispatchDtype.FP8, None)


def copy_bytes(out: DispatchOutput, alignment: int) -> int:
    """Bytes the copy writes and reads: the zeroed aligned rows and scales, the scatter (read + write), and the
    gather of bf16 output rows (read + write)."""
    rows, hidden = out.hidden_states.shape
    row_bytes = hidden + out.hidden_states_scale.shape[1] * 4
    padded = int(align_up(out.group_list, alignment).sum())
    return padded * row_bytes + 2 * rows * row_bytes + 2 * rows * hidden * 2


def timed_ms(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, action="append", help="tokens per rank (repeatable)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256, help="routed experts (DeepSeek-V3: 256)")
    parser.add_argument("--ep", type=int, default=8, help="EP size: local experts = experts / ep")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--alignment", type=int, default=128, help="DeepGEMM's mk alignment")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    local = args.experts // args.ep
    print(f"H={args.hidden}, {local} local experts (E={args.experts}, EP {args.ep}), top-{args.top_k}, FP8 rows, "
          f"alignment {args.alignment}; V2 with the spec's alignment: 0 bytes, no copy")
    print(f"{'tokens':>7} {'rows':>7} {'padded':>7} {'copy MB':>8} {'copy ms':>8} {'clone ms':>9} {'ratio':>6}")
    for tokens in args.tokens or [128, 1024, 4096]:
        g = torch.Generator().manual_seed(0)
        # A rank receives about tokens·top_k rows (every rank's tokens, top_k/ep of them here), spread over its experts.
        picks = torch.randint(0, local, (tokens * args.top_k,), generator=g)
        out = dense_output(torch.bincount(picks, minlength=local), args.hidden, g)
        expert_rows = torch.randn(int(align_up(out.group_list, args.alignment).sum()), args.hidden,
                                  generator=g).to(torch.bfloat16)

        def copy() -> None:
            aligned = align_rows(out, args.alignment)
            dense_rows(expert_rows, aligned)

        def clone() -> None:
            out.hidden_states.clone()
            out.hidden_states_scale.clone()

        copy(), clone()  # warm-up
        copies, clones = [], []
        for _ in range(args.iters):
            copies.append(timed_ms(copy))
            clones.append(timed_ms(clone))
        c, b = statistics.median(copies), statistics.median(clones)
        rows = out.hidden_states.shape[0]
        print(f"{tokens:>7} {rows:>7} {expert_rows.shape[0]:>7} {copy_bytes(out, args.alignment) / 1e6:>8.1f} "
              f"{c:>8.2f} {b:>9.2f} {c / b:>6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
