"""What combine adds for each token, and the adding: in a fixed order, a cache-sized block of tokens at a time, so
that results are bit-identical run to run, across the two reference backends and their modes (docs/design.md)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .slots import Slot


@dataclass(frozen=True, slots=True)
class TokenTerms:
    """What combine adds for each token, in the fixed order: entry e adds ``src[rows[e]]`` (``src[e]`` when ``rows`` is
    None; times ``weight[e]``; nothing where ``padding[e]``) into token ``token[e]``. Within a token, entries come in
    the fixed order; ``blocks`` are ``(t0, t1, e0, e1)``: tokens ``t0..t1`` own entries ``e0..e1``, each cache-sized."""

    rows: torch.Tensor | None  # [entries] int64
    token: torch.Tensor  # [entries] int64
    weight: torch.Tensor | None  # [entries] fp32
    padding: torch.Tensor | None  # [entries] bool: MASKED padding, whose rows may hold anything (NaN included)
    blocks: tuple[tuple[int, int, int, int], ...]


def token_major(token_of_row: torch.Tensor, num_tokens: int, hidden: int, chunk: int,
                weight: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> TokenTerms:
    """Entries grouped by token in blocks of ``chunk`` bytes, keeping their order within a token (rows come
    expert-major to the experts, and pairs rank-major from the sender); entry i is row ``rows[i]`` (default ``i``)
    of what combine adds. In one block they stay as they are (``index_add_`` adds each token's entries in their
    order: the same sums); in several, sorted by token, which takes one host read (the per-token counts)."""
    if max(num_tokens, token_of_row.numel()) * 4 * max(hidden, 1) <= chunk:
        return TokenTerms(rows, token_of_row, weight, None, ((0, num_tokens, 0, token_of_row.numel()),))
    order = torch.sort(token_of_row, stable=True).indices
    counts = torch.bincount(token_of_row, minlength=num_tokens).tolist()
    return TokenTerms(order if rows is None else rows[order], token_of_row[order],
                      None if weight is None else weight[order], None, token_blocks(counts, hidden, chunk))


@functools.lru_cache(maxsize=64)
def even_blocks(tokens: int, per_token: int, hidden: int, chunk: int) -> tuple[tuple[int, int, int, int], ...]:
    return token_blocks([per_token] * tokens, hidden, chunk)


def token_blocks(counts: list[int], hidden: int, chunk: int) -> tuple[tuple[int, int, int, int], ...]:
    """Consecutive tokens grouped while their accumulator and their entries' fp32 rows stay within ``chunk`` bytes
    each (at least one token per block)."""
    row = 4 * max(hidden, 1)
    blocks, t0, e0, tokens, entries = [], 0, 0, 0, 0
    for t, n in enumerate(counts):
        if tokens and ((tokens + 1) * row > chunk or (entries + n) * row > chunk):
            blocks.append((t0, t, e0, e0 + entries))
            t0, e0, tokens, entries = t, e0 + entries, 0, 0
        tokens, entries = tokens + 1, entries + n
    if tokens:
        blocks.append((t0, t0 + tokens, e0, e0 + entries))
    return tuple(blocks)


#: On the CPU, a block's temporaries (an fp32 accumulator, its fp32 terms, the gathered rows) stay in a core's L2
#: (2 MiB on the hosts measured): 512 KiB blocks made combine 20-27% faster than 4 MiB ones.
CPU_CHUNK_BYTES = 512 << 10
#: On an accelerator a block costs a handful of kernel launches and there is no cache to fit: blocks only bound the
#: temporaries (on an H100, 4 MiB blocks made combine 29-38 ms of launches: docs/evidence/hardware-runs.md).
DEVICE_CHUNK_BYTES = 256 << 20


def chunk_bytes(device: torch.device, host_paths: bool = True) -> int:
    return CPU_CHUNK_BYTES if host_paths and device.type == "cpu" else DEVICE_CHUNK_BYTES


def sum_terms(out: torch.Tensor, src: torch.Tensor, terms: TokenTerms, slot: Slot) -> None:
    """``out[t] = bf16(0 + fp32(src[r1])·w1 + fp32(src[r2])·w2 + ...)`` over token t's entries in their order, a
    cache-sized block of tokens at a time: the block's fp32 accumulator stays in cache and each token's BF16 sum is
    written once. The same fp32 operations in the same order as ``index_add_`` of every row into a zeroed fp32
    tensor, cast: the same bits."""
    H = out.shape[1]
    most_tokens = max((t1 - t0 for t0, t1, _, _ in terms.blocks), default=0)
    most_entries = max((e1 - e0 for _, _, e0, e1 in terms.blocks), default=0)
    acc_buf = slot.take("sum", (most_tokens, H), torch.float32, out.device)
    term_buf = slot.take("term", (most_entries, H), torch.float32, out.device)
    picks = None if terms.rows is None else slot.take("gathered", (most_entries, H), src.dtype, out.device)
    for t0, t1, e0, e1 in terms.blocks:
        acc = acc_buf[: t1 - t0].zero_()
        if e1 > e0:
            term = term_buf[: e1 - e0]
            rows = src[e0:e1] if picks is None else torch.index_select(src, 0, terms.rows[e0:e1], out=picks[: e1 - e0])
            weight = None if terms.weight is None else terms.weight[e0:e1].unsqueeze(1)
            if weight is not None and len(terms.blocks) == 1:  # one launch; bf16·fp32 is computed in fp32
                torch.mul(rows, weight, out=term)
            else:  # the host's blocks: a copy, then the product in place (the mixed product is slower on CPU)
                term.copy_(rows)
                if weight is not None:
                    term.mul_(weight)
            if terms.padding is not None:
                term.masked_fill_(terms.padding[e0:e1].unsqueeze(1), 0.0)
            acc.index_add_(0, terms.token[e0:e1] if t0 == 0 else terms.token[e0:e1] - t0, term)
        out[t0:t1].copy_(acc)
