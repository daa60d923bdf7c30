"""Rank-side code of ``test_nothing_lost.py`` and ``test_isolation.py`` (importable by name,
so ``RankPool`` workers can run it): activations every wire dtype carries exactly, tagged
rows, randomized routings, an independent sequential reference of the documented combine
order, and the isolation scenarios (several dispatchers, groups and threads at once).

Why exact activations: with identity experts, combine returns ``Σ_j w_j · dequantize(x)``.
If ``dequantize(quantize(x)) == x`` bit for bit, the expected output is computable from the
bf16 input alone, for every dtype, so the comparison can be ``torch.equal`` instead of a
tolerance that would hide a lost low-weight copy. Each dtype's scale rule (``codecs.py``):

- FP8: scale = amax/448 per 128 channels. A block whose amax is ``448·2^s`` and whose other
  values are e4m3 values times ``2^s`` has scale ``2^s`` and quantizes losslessly (with UE8M0
  scales too: ``2^s`` is already a power of two).
- INT8: scale = amax/127 per token. A row whose amax is ``127·2^s`` and whose values are
  integers times ``2^s`` quantizes losslessly.
- NVFP4: block scale = e4m3(gs·amax/6) per 16 elements. With a power-of-two global scale
  ``gs = 2^g`` and a block amax of ``6·2^b`` (``b + g`` within e4m3's normal exponents), the
  block scale is ``2^(b+g)`` and e2m1 values times ``2^b`` quantize losslessly.
- BF16: anything.

Why tags: channels 0..3 of each row identify its global token (channel 0 is the anchor
``±M·unit``, channels 1..3 are three base-15 digits of the token index, in units), so a
received row can be traced to exactly one (token, expert) pair. All-zero blocks (other than
block 0) are included: they hit the FP8 amax floor and NVFP4's zero block scale.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist

import moe_dispatch as md
from moe_dispatch_testing import IdentityExperts

DTYPES = ("bf16", "fp8", "int8", "nvfp4")
MODES = ("normal", "low_latency")
BACKENDS = ("torch", "allgather")

#: Problems a rank reports in full (the rest are counted).
MAX_PROBLEMS = 12
#: The tag alphabet: 15 values that are exact in every wire dtype's grid (e2m1 values).
DIGITS = (0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0, 6.0, -6.0)
MAX_TAG = len(DIGITS) ** 3
#: |anchor| in grid units: the block (row, for INT8) maximum that sets the scale to 2^exp.
ANCHOR = {"bf16": 6.0, "fp8": 448.0, "int8": 127.0, "nvfp4": 6.0}

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value except -0 (fp32)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    keep = torch.isfinite(v) & ~((v == 0) & torch.signbit(v))
    return v[keep]


_E4M3 = _e4m3_values()
_E2M1_SIGNED = torch.tensor(_E2M1 + tuple(-v for v in _E2M1[1:]))


@dataclass(frozen=True)
class Routing:
    """One routing, rebuilt identically on every rank from its seed.

    :param tokens: tokens per rank (0 and ``capacity`` included on purpose).
    :param kinds: relative frequency of the per-token routing kinds, see ``make_routing``.
    :param nvfp4_exponent: g in the NVFP4 global scale ``2^g``.
    :param int32_ids: hand dispatch int32 ``topk_ids`` instead of int64.
    :param fp8_ue8m0: FP8 runs with UE8M0 (power-of-two, one byte) scales.
    """

    seed: int
    tokens: tuple[int, ...]
    kinds: tuple[int, int, int, int, int] = (3, 2, 1, 2, 1)
    nvfp4_exponent: int = 3
    int32_ids: bool = False
    fp8_ue8m0: bool = False


@dataclass(frozen=True)
class Batch:
    """What one group runs in a hypothesis example: a layer shape and routings, each run
    through every (dtype, mode, backend) combination with its own ids, weights and activations."""

    world: int
    hidden: int
    local_experts: int
    top_k: int
    capacity: int
    group_list_type: int
    routings: tuple[Routing, ...]
    combos: tuple[tuple[str, str, str], ...] = field(
        default_factory=lambda: tuple((d, m, b) for d in DTYPES for m in MODES for b in BACKENDS)
    )

    @property
    def num_experts(self) -> int:
        return self.world * self.local_experts


# -- inputs -------------------------------------------------------------------------------------


def exact_activations(dtype: str, n: int, hidden: int, gen: torch.Generator, nvfp4_exponent: int = 3) -> torch.Tensor:
    """bf16 ``[n, hidden]`` rows that ``dtype`` quantizes losslessly, row i tagged with i."""
    if n > MAX_TAG:
        raise ValueError(f"at most {MAX_TAG} tagged rows")

    def pick(table: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return table[torch.randint(len(table), shape, generator=gen)]

    def signs(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, 2, shape, generator=gen).float() * 2 - 1

    if dtype == "bf16":
        block, body = hidden, (torch.randn(n, hidden, generator=gen) * 2.0).to(torch.bfloat16).float()
        exps = torch.randint(-4, 5, (n, 1), generator=gen)
    elif dtype == "fp8":
        block, body = 128, pick(_E4M3, (n, hidden))
        exps = torch.randint(-10, 9, (n, hidden // 128), generator=gen)
    elif dtype == "int8":
        block, body = hidden, torch.randint(-127, 128, (n, hidden), generator=gen).float()
        exps = torch.randint(-10, 9, (n, 1), generator=gen)
    elif dtype == "nvfp4":
        # block scale exponent b + g must stay within e4m3's normal range [-6, 8]
        lo, hi = max(-6 - nvfp4_exponent, -10), min(8 - nvfp4_exponent, 10)
        block, body = 16, pick(_E2M1_SIGNED, (n, hidden))
        exps = torch.randint(lo, hi + 1, (n, hidden // 16), generator=gen)
    else:
        raise ValueError(dtype)
    blocks = body.view(n, hidden // block, block)
    nb = blocks.shape[1]
    if dtype != "bf16":
        # every block holds its maximum (the anchor) somewhere, so its scale is 2^exp exactly
        where = torch.randint(0, block, (n, nb), generator=gen)
        blocks.scatter_(2, where.unsqueeze(-1), (signs((n, nb)) * ANCHOR[dtype]).unsqueeze(-1))
        if nb > 1:  # some all-zero blocks (never block 0, which carries the tag)
            zero = torch.rand(n, nb, generator=gen) < 0.15
            zero[:, 0] = False
            blocks.masked_fill_(zero.unsqueeze(-1), 0.0)
    # the tag: channel 0 the anchor, channels 1..3 the token's digits, in block 0's unit
    unit_scale = 2.0 if dtype == "int8" else 1.0  # int8 digits doubled: half-digits stay integers
    blocks[:, 0, 0] = signs((n,)) * ANCHOR[dtype]
    index = torch.arange(n)
    digits = torch.tensor(DIGITS)
    for j in range(3):
        blocks[:, 0, 1 + j] = digits[(index // len(DIGITS) ** j) % len(DIGITS)] * unit_scale
    x = blocks * torch.exp2(exps.float()).unsqueeze(-1)
    x = x.reshape(n, hidden) + 0.0  # no -0
    out = x.to(torch.bfloat16)
    if not torch.equal(out.float(), x):
        raise AssertionError(f"the {dtype} generator made a value bf16 cannot hold")
    return out


def row_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 per row from the bits of channels 0..3 (anchor magnitude and the three tag
    digits): distinct for distinct tokens of one batch."""
    bits = x[..., :4].contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits[..., 0] &= 0x7FFF
    return (bits[..., 0] << 48) | (bits[..., 1] << 32) | (bits[..., 2] << 16) | bits[..., 3]


def make_routing(n: int, num_experts: int, local: int, top_k: int, gen: torch.Generator,
                 kinds: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, k]`` ids and fp32 weights. Per token one of five kinds (relative frequencies
    ``kinds``): all k slots routed; some slots -1; every slot -1; every expert on one rank
    (the token has zero experts on the others); the hot experts 0..k-1. Slots are shuffled,
    so ids are not in ascending order; -1 slots carry a nonzero weight that must be ignored."""
    world = num_experts // local
    if n == 0:
        return torch.empty(0, top_k, dtype=torch.int64), torch.empty(0, top_k)
    kind = torch.multinomial(torch.tensor(kinds, dtype=torch.float), n, replacement=True, generator=gen).unsqueeze(1)
    slot = torch.arange(top_k).unsqueeze(0)
    anywhere = torch.rand(n, num_experts, generator=gen).argsort(dim=1)[:, :top_k]  # distinct experts
    keep = torch.randint(0, top_k, (n, 1), generator=gen)  # some -1: 0..k-1 experts kept
    rank = torch.randint(0, world, (n, 1), generator=gen)
    on_rank = rank * local + torch.rand(n, local, generator=gen).argsort(dim=1)
    on_rank = torch.cat([on_rank, on_rank.new_full((n, max(top_k - local, 0)), -1)], dim=1)[:, :top_k]
    ids = torch.where(kind == 0, anywhere, -1)
    ids = torch.where((kind == 1) & (slot < keep), anywhere, ids)
    ids = torch.where(kind == 3, on_rank, ids)
    ids = torch.where(kind == 4, slot, ids)
    ids = ids.gather(1, torch.rand(n, top_k, generator=gen).argsort(dim=1))  # shuffle the slots
    weights = torch.rand(n, top_k, generator=gen) * 0.9 + 0.05
    return ids, weights


def global_batch(batch: Batch, routing: Routing, combo: int):
    """The whole world's inputs of one routing for one (dtype, mode, backend) combination
    (the same on every rank): each combination gets its own ids, weights and activations."""
    dtype = batch.combos[combo][0]
    seed = routing.seed * 64 + combo
    gen = torch.Generator().manual_seed(seed)
    total = sum(routing.tokens)
    ids, w = make_routing(total, batch.num_experts, batch.local_experts, batch.top_k, gen, routing.kinds)
    x = exact_activations(dtype, total, batch.hidden, gen, routing.nvfp4_exponent)
    starts = [sum(routing.tokens[:r]) for r in range(batch.world)]
    return x, ids, w, starts


# -- the reference ------------------------------------------------------------------------------


def sequential_reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, world: int, local: int) -> torch.Tensor:
    """What combine must return when every expert returns its input ``x`` (bf16), written
    from the documented order (``backends/exchange.py``): on each destination rank, the
    token's experts of that rank in ascending expert order, ``w·x`` in fp32 added one by one
    to a zero fp32 accumulator, rounded to bf16; then, at the source, those bf16 partials
    added in ascending rank order to a zero fp32 accumulator, rounded to bf16. Tokens are
    independent, so they are processed side by side; the additions per token are sequential."""
    T, H = x.shape
    xf = x.float()
    order = torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max).argsort(dim=1, stable=True)
    sids, sw = ids.gather(1, order), w.gather(1, order)
    partial = torch.zeros(world + 1, T, H)  # row `world` collects the -1 slots, never read
    tokens = torch.arange(T)
    for j in range(ids.shape[1]):  # ascending expert id; each token in one rank's row per step
        e = sids[:, j]
        r = torch.where(e >= 0, e // local, world)
        partial[r, tokens] = partial[r, tokens] + xf * sw[:, j : j + 1]
    out = torch.zeros(T, H)
    for r in range(world):  # ascending rank
        out = out + partial[r].to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


# -- the check on one rank ----------------------------------------------------------------------


def _spec(batch: Batch, routing: Routing, dtype: str, mode: str) -> md.DispatchSpec:
    if dtype == "nvfp4":
        quant = md.QuantHints(input_global_scale=2.0**routing.nvfp4_exponent)
    else:
        quant = md.QuantHints(fp8_ue8m0_scales=routing.fp8_ue8m0 and dtype == "fp8")
    return md.DispatchSpec(batch.hidden, batch.num_experts, batch.top_k,
                           num_max_dispatch_tokens_per_rank=batch.capacity,
                           mode=mode, output_dtype=dtype, quant=quant, group_list_type=batch.group_list_type)


def _received_rows(out: md.DispatchOutput, rows: torch.Tensor,
                   local: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The valid expert rows (bf16, as the identity experts returned them) and each one's
    local expert; plus contract problems (counts, MASKED padding)."""
    problems = []
    counts = out.expert_counts().to(torch.int64)
    if counts.shape != (local,) or bool((counts < 0).any()):
        return rows.new_zeros(0, rows.shape[-1]), counts.new_zeros(0), [f"group_list gives counts {counts.tolist()}"]
    if out.layout is md.Layout.PACKED:
        if rows.shape[0] != int(counts.sum()):
            problems.append(f"PACKED output has {rows.shape[0]} rows but the counts sum to {int(counts.sum())}")
            return rows.new_zeros(0, rows.shape[-1]), counts.new_zeros(0), problems
        return rows, torch.repeat_interleave(torch.arange(local), counts), problems
    slots = rows.shape[1]
    if bool((counts > slots).any()):
        problems.append(f"MASKED counts {counts.tolist()} exceed {slots} slots")
        return rows.new_zeros(0, rows.shape[-1]), counts.new_zeros(0), problems
    valid = torch.arange(slots).unsqueeze(0) < counts.unsqueeze(1)
    if bool(out.hidden_states.view(torch.uint8).reshape(local, slots, -1)[~valid].any()):
        problems.append("MASKED padding rows are not zero")
    expert = torch.arange(local).unsqueeze(1).expand(local, slots)
    return rows[valid], expert[valid], problems


def check_rows(batch: Batch, rank: int, x: torch.Tensor, ids: torch.Tensor, out: md.DispatchOutput,
               rows: torch.Tensor) -> list[str]:
    """Each (token, local expert) pair of the whole world's routing arrives exactly once, as
    the token's own row, bit for bit."""
    local = batch.local_experts
    got_rows, got_expert, problems = _received_rows(out, rows, local)
    keys = row_keys(x)
    sorted_keys, perm = keys.sort()
    k = row_keys(got_rows)
    pos = torch.searchsorted(sorted_keys, k).clamp(max=max(len(sorted_keys) - 1, 0))
    found = sorted_keys[pos] == k if len(sorted_keys) else torch.zeros_like(k, dtype=torch.bool)
    if not bool(found.all()):
        problems.append(f"{int((~found).sum())} received rows match no token's tag (corrupted payload or scales)")
        return problems
    token = perm[pos]
    bad = (got_rows.view(torch.int16) != x[token].view(torch.int16)).any(dim=1)
    if bool(bad.any()):
        problems.append(f"{int(bad.sum())} received rows differ from their token's row "
                        f"(first: token {int(token[bad][0])})")
    first = rank * local
    E = batch.num_experts
    got_pairs = (token * E + first + got_expert).sort().values
    mine = (ids >= first) & (ids < first + local)
    want_pairs = (torch.nonzero(mine)[:, 0] * E + ids[mine]).sort().values
    if not torch.equal(got_pairs, want_pairs):
        got_set, want_set = set(got_pairs.tolist()), set(want_pairs.tolist())
        lost = sorted(want_set - got_set)[:3]
        extra = sorted(got_set - want_set)[:3]
        dup = len(got_pairs) - len(got_set)
        problems.append(
            f"(token, expert) pairs: {len(got_pairs)} received, {len(want_pairs)} routed here; "
            f"lost {[(p // E, p % E) for p in lost]}, unrouted {[(p // E, p % E) for p in extra]}, duplicated {dup}"
        )
    return problems


def run_batch(rank: int, world: int, batch: Batch, group: "dist.ProcessGroup | None" = None) -> dict:
    """Every routing of ``batch`` through every (dtype, mode, backend) on this rank of
    ``group`` (None: the default group, or no torch.distributed at all).

    Returns problems (sentences naming routing, combo and rank), how many round trips ran,
    and coverage counters the test asserts on, so a generator change cannot silently stop
    exercising -1 ids, empty ranks or full ranks."""
    assert world == batch.world, (world, batch.world)
    started = time.perf_counter()
    problems: list[str] = []
    stats = {"round_trips": 0, "pairs": 0, "repeats": 0, "minus_one_slots": 0, "tokens_missing_a_rank": 0,
             "empty_rank_calls": 0, "full_rank_calls": 0, "unrouted_tokens": 0}
    experts = IdentityExperts()
    local = batch.local_experts
    dispatchers: dict[tuple, md.Dispatcher] = {}

    def round_trip(dispatcher: md.Dispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
        out = dispatcher.dispatch(x, ids, w)
        rows = experts.apply_without_routing_weights(
            batch.hidden, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list,
            torch.bfloat16, global_scale=out.global_scale)
        return out, rows, dispatcher.combine(rows, out)

    for i, routing in enumerate(batch.routings):
        for c, (dtype, mode, backend) in enumerate(batch.combos):
            x, ids, w, starts = global_batch(batch, routing, c)
            mine = slice(starts[rank], starts[rank] + routing.tokens[rank])
            ref = sequential_reference(x[mine], ids[mine], w[mine], world, local)
            label = (f"[routing {i} seed {routing.seed} tokens {list(routing.tokens)}, "
                     f"{dtype}/{mode}/{backend}, rank {rank}/{world}]")
            key = (c, routing.nvfp4_exponent if dtype == "nvfp4" else 0, routing.fp8_ue8m0 and dtype == "fp8")
            if key not in dispatchers:
                dispatchers[key] = md.create_dispatcher(backend, _spec(batch, routing, dtype, mode), group, env={})
            d = dispatchers[key]
            my_ids = ids[mine].to(torch.int32) if routing.int32_ids else ids[mine]
            out, rows, result = round_trip(d, x[mine], my_ids, w[mine])
            stats["round_trips"] += 1
            if rank == 0:
                stats["pairs"] += int((ids >= 0).sum())
            problems += [f"{label} {p}" for p in check_rows(batch, rank, x, ids, out, rows)]
            if result.dtype != torch.bfloat16 or result.shape != ref.shape:
                problems.append(f"{label} combine returned {result.dtype} {tuple(result.shape)}, "
                                f"expected bf16 {tuple(ref.shape)}")
            elif not torch.equal(result.view(torch.int16), ref.view(torch.int16)):
                diff = (result.float() - ref.float()).abs()
                t = int(diff.amax(dim=1).argmax())
                problems.append(f"{label} combine differs from the sequential reference: token {t} "
                                f"(routed to {ids[mine][t].tolist()}), max |diff| {float(diff[t].max()):.4g}")
            if i == 0:  # same inputs, same bits: again on this dispatcher, and on a new one
                again = round_trip(d, x[mine], my_ids, w[mine])[2]
                new = md.create_dispatcher(backend, _spec(batch, routing, dtype, mode), group, env={})
                fresh = round_trip(new, x[mine], my_ids, w[mine])[2]
                stats["repeats"] += 2
                for name, other in (("the same dispatcher", again), ("a new dispatcher", fresh)):
                    if not torch.equal(result.view(torch.int16), other.view(torch.int16)):
                        problems.append(f"{label} the same inputs gave different bits on {name}")
            # coverage of this rank's share
            my_ids = ids[mine]
            stats["minus_one_slots"] += int((my_ids < 0).sum())
            ranks_of = torch.where(my_ids >= 0, my_ids // local, -1)
            has = torch.stack([(ranks_of == r).any(dim=1) for r in range(world)], dim=1)
            stats["tokens_missing_a_rank"] += int((has.any(dim=1) & ~has.all(dim=1)).sum())
            stats["unrouted_tokens"] += int((~has.any(dim=1)).sum())
            stats["empty_rank_calls"] += int(routing.tokens[rank] == 0)
            stats["full_rank_calls"] += int(routing.tokens[rank] == batch.capacity)
    stats["seconds"] = time.perf_counter() - started
    stats["problem_count"] = len(problems)
    return {"problems": problems[:MAX_PROBLEMS], "rank": rank, "world": world, **stats}


# -- several groups at once ------------------------------------------------------------------------

#: Subgroups of a pool worker, by tag and member ranks, created on first use (every rank runs
#: the same code in the same order, so every rank calls ``new_group`` for each in the same order).


_GROUPS: dict[tuple[Any, ...], object] = {}


def _group(ranks: tuple[int, ...], world: int, tag: str = ""):
    """The subgroup of ``ranks`` (the default group, None, when that is every rank and no
    tag asks for a separate one). ``tag`` makes another group with the same members."""
    if ranks == tuple(range(world)) and not tag:
        return None
    key = (tag, *ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def run_plan(rank: int, world: int, plan: tuple[tuple[tuple[int, ...], Batch], ...]) -> dict | None:
    """``plan`` assigns each batch to a set of ranks (disjoint, covering the pool or not):
    each set runs its batch on its own group at the same time as the others."""
    groups = [_group(ranks, world) for ranks, _ in plan]
    for (ranks, batch), group in zip(plan, groups):
        if rank in ranks:
            return run_batch(ranks.index(rank), len(ranks), batch, group)
    return None


# -- the summation order, made visible ----------------------------------------------------------


def order_probe(rank: int, world: int, mode: str, backend: str) -> list[int]:
    """One token per rank whose combine result depends on the order of additions.

    World 1 (three experts, weights ``1+2^-8, 2^-24, 2^-24`` on an all-ones row): in ascending
    expert order the two tiny terms each round away in fp32 and the bf16 rounding of
    ``1+2^-8`` (a tie) gives 1.0; summed in any order that adds the tiny terms first, the fp32
    sum is ``1+2^-8+2^-23`` and bf16 gives ``1+2^-7``.

    World 4 (one expert per rank, weights ``1, 2^-8, 2^-24, 2^-24``): each rank's bf16 partial
    is its weight; ascending rank order gives 1.0, descending gives ``1+2^-7``.

    Returns the bf16 bit patterns of the token's first channel on this rank."""
    if world == 1:
        weights, ids = [1 + 2.0**-8, 2.0**-24, 2.0**-24], [2, 0, 1]  # slots deliberately not ascending
    elif world == 4:
        weights, ids = [1.0, 2.0**-8, 2.0**-24, 2.0**-24], [3, 1, 0, 2]
    else:
        raise ValueError("order_probe runs on 1 or 4 ranks")
    k = len(ids)
    w = torch.tensor([[weights[e] for e in ids]], dtype=torch.float32)
    spec = md.DispatchSpec(128, k, k, num_max_dispatch_tokens_per_rank=1, mode=mode, output_dtype="bf16")
    d = md.create_dispatcher(backend, spec, env={})
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    out = d.dispatch(x, torch.tensor([ids]), w)
    rows = IdentityExperts().apply_without_routing_weights(
        128, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16)
    result = d.combine(rows, out)
    ref = sequential_reference(x, torch.tensor([ids]), w, world, k // world)
    return [int(result.view(torch.int16)[0, 0]), int(ref.view(torch.int16)[0, 0])]


# -- isolation (test_isolation.py) --------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One dispatcher of the isolation scenarios. ``output_dtype`` None is "auto", resolved
    from ``env`` (passed as ``create_dispatcher(env=...)``); ``expect`` is the dtype it must
    resolve to. ``group``: "default", "pair" (ranks 2i, 2i+1), "solo" (this rank alone) or
    "thread<i>" (a group of every rank made for one thread)."""

    name: str
    backend: str
    mode: str
    output_dtype: str | None
    expect: str
    hidden: int = 128
    experts: int = 8  # over the config's group; a multiple of 4 fits every group size used
    top_k: int = 2
    capacity: int = 8
    group: str = "default"
    env: tuple[tuple[str, str], ...] = ()
    global_scale: float | None = None
    ue8m0: bool = False
    group_list_type: int = 1

    def spec(self) -> md.DispatchSpec:
        quant = md.QuantHints(input_global_scale=self.global_scale, fp8_ue8m0_scales=self.ue8m0)
        return md.DispatchSpec(self.hidden, self.experts, self.top_k,
                               num_max_dispatch_tokens_per_rank=self.capacity, mode=self.mode,
                               output_dtype=self.output_dtype, quant=quant, group_list_type=self.group_list_type)


#: Dispatchers that differ in every respect the core keeps per dispatcher: dtype (and how it
#: was chosen), backend, mode, shape, quant hints, group-list type and group.
CONFIGS = (
    Config("fp8/torch/normal", "torch", "normal", "fp8", "fp8", hidden=256, experts=8, top_k=3, capacity=16),
    Config("bf16/allgather/low_latency", "allgather", "low_latency", "bf16", "bf16", experts=12, capacity=6,
           group_list_type=0),
    Config("int8/torch/normal on pairs", "torch", "normal", "int8", "int8", experts=12, capacity=12, group="pair"),
    Config("nvfp4/allgather/low_latency on pairs", "allgather", "low_latency", "nvfp4", "nvfp4", experts=4,
           top_k=2, capacity=5, group="pair", global_scale=448.0 * 6 / 8.0),
    Config("fp8-ue8m0/torch/low_latency", "torch", "low_latency", "fp8", "fp8", hidden=256, top_k=4, ue8m0=True,
           group_list_type=0),
    Config("auto+MOE_DISPATCH_OUTPUT_DTYPE=int8/allgather", "allgather", "normal", None, "int8",
           env=(("MOE_DISPATCH_OUTPUT_DTYPE", "int8"),)),
    Config("auto+SGLANG_DEEPEP_BF16_DISPATCH=1/torch", "torch", "normal", None, "bf16",
           env=(("SGLANG_DEEPEP_BF16_DISPATCH", "1"),)),
    Config("auto, empty env/torch", "torch", "low_latency", None, "fp8"),
    Config("bf16/torch/normal on a one-rank group", "torch", "normal", "bf16", "bf16", group="solo"),
)


def _config_group(config: Config, rank: int, world: int):
    if not (dist.is_available() and dist.is_initialized()):
        return None  # one process: every config runs at world size 1
    pairs = [_group((2 * i, 2 * i + 1), world) for i in range(world // 2)]  # every rank creates every group
    solos = [_group((r,), world) for r in range(world)]
    if config.group == "pair":
        return pairs[rank // 2]
    if config.group == "solo":
        return solos[rank]
    if config.group.startswith("thread"):
        return _group(tuple(range(world)), world, tag=config.group)
    return None


def config_inputs(config: Config, rank: int, world: int, seed: int):
    """This rank's (x, ids, w) for ``config``; ``rank``/``world`` are in the config's group."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    t = int(torch.randint(0, config.capacity + 1, (1,), generator=gen))
    ids, w = make_routing(t, config.experts, config.experts // world, config.top_k, gen, (3, 2, 1, 2, 1))
    x = (torch.randn(t, config.hidden, generator=gen) * 2).to(torch.bfloat16)
    return x, ids, w


def create(config: Config, group: Any = None, env: Mapping[str, str] | None = None) -> md.Dispatcher:
    return md.create_dispatcher(config.backend, config.spec(), group,
                                env=dict(config.env) if env is None else env)


def _size(group: Any) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def _experts(d: md.Dispatcher, out: md.DispatchOutput) -> torch.Tensor:
    """Expert e of the group multiplies its rows by a factor unique to e, so a row combined
    under the wrong expert or the wrong dispatcher's layer changes the result."""
    from moe_dispatch_testing import ScaledIdentityExperts, ScaledLayer

    local = d.spec.num_experts // d.world_size
    layer = ScaledLayer.for_rank(d.spec.hidden_size, d.spec.num_experts, d.rank, local)
    return ScaledIdentityExperts().apply_without_routing_weights(
        layer, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16,
        global_scale=out.global_scale)


def output_bits(out: md.DispatchOutput) -> list[torch.Tensor]:
    """A copy of a DispatchOutput's tensors as raw bytes, for bit comparisons after its combine
    (the output itself is valid only until then: its buffers serve later dispatches)."""
    parts = [out.hidden_states, out.group_list]
    if out.hidden_states_scale is not None:
        parts.append(out.hidden_states_scale)
    return [p.contiguous().view(-1).view(torch.uint8).clone() if p.numel() else p.new_empty(0, dtype=torch.uint8)
            for p in parts]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def interleaved_dispatchers(rank: int, world: int, seed: int) -> list[str]:
    """Every dispatcher of ``CONFIGS`` alone, then all of them again (new objects, created in
    the reverse order) with their dispatches in flight at once, in a mixed order, plus a
    second dispatch in flight on the first one. Each dispatch output, each combine result and
    each dispatcher's byte count must equal the lone run's, bit for bit; the resolved dtype
    must be the config's own; ``os.environ`` must not change. Returns problems."""
    env_before = dict(os.environ)
    problems: list[str] = []
    groups = {c.name: _config_group(c, rank, world) for c in CONFIGS}
    # inputs per config, plus a second batch for the first config (two in flight on one dispatcher)
    inputs = {}
    for i, c in enumerate(CONFIGS):
        g = groups[c.name]
        inputs[c.name] = config_inputs(c, dist.get_rank(g) if g is not None else rank, _size(g), seed + i)
    second = CONFIGS[0]
    inputs["second"] = config_inputs(second, rank, world, seed + 100)

    alone, alone_traffic = {}, {}
    for c in CONFIGS:
        d = create(c, groups[c.name])
        if d.output_dtype.value != c.expect:
            problems.append(f"rank {rank}: {c.name} resolved {d.output_dtype.value}, expected {c.expect}")
        runs = [c.name, "second"] if c is second else [c.name]
        for key in runs:
            out = d.dispatch(*inputs[key])
            alone[key] = (output_bits(out), d.combine(_experts(d, out), out))
        alone_traffic[c.name] = d.traffic.to_dict()

    fresh = {c.name: create(c, groups[c.name]) for c in reversed(CONFIGS)}
    order = ["dispatch 0", "dispatch 1", "dispatch 2", "dispatch second", "dispatch 3", "combine 3", "combine 1",
             "dispatch 4", "dispatch 5", "combine second", "dispatch 6", "combine 2", "dispatch 7", "combine 6",
             "dispatch 8", "combine 4", "combine 0", "combine 8", "combine 7", "combine 5"]
    pending: dict[str, md.DispatchOutput] = {}
    for step in order:
        action, which = step.split()
        key = second.name if which == "second" else CONFIGS[int(which)].name
        name = "second" if which == "second" else key
        d = fresh[key]
        if action == "dispatch":
            pending[name] = d.dispatch(*inputs[name])
            if not _same(output_bits(pending[name]), alone[name][0]):
                problems.append(f"rank {rank}: {name}: dispatch output differs when other dispatches are in flight")
        else:
            out = pending.pop(name)
            got = d.combine(_experts(d, out), out)
            if not torch.equal(got.view(torch.int16), alone[name][1].view(torch.int16)):
                problems.append(f"rank {rank}: {name}: combine differs when other dispatches are in flight")
    assert not pending, pending
    for c in CONFIGS:
        if fresh[c.name].traffic.to_dict() != alone_traffic[c.name]:
            problems.append(f"rank {rank}: {c.name}: counted {fresh[c.name].traffic.to_dict()} interleaved, "
                            f"{alone_traffic[c.name]} alone (byte counts leak between dispatchers)")
    if dict(os.environ) != env_before:
        changed = sorted(k for k in env_before.keys() | os.environ.keys() if env_before.get(k) != os.environ.get(k))
        problems.append(f"rank {rank}: os.environ changed: {changed}")
    return problems


def _thread_job(config: Config, group: Any, rank: int, seeds: list[int], start: threading.Barrier,
                results: dict, errors: list) -> None:
    """One thread: create its own dispatcher (concurrently with the other threads), then
    dispatch/combine each seed's inputs, keeping two dispatches in flight."""
    try:
        start.wait()
        d = create(config, group)
        g_rank, g_world = (dist.get_rank(group), _size(group)) if group is not None else (d.rank, d.world_size)
        out: dict[int, Any] = {}
        for a, b in zip(seeds[0::2], seeds[1::2]):
            oa = d.dispatch(*config_inputs(config, g_rank, g_world, a))
            ob = d.dispatch(*config_inputs(config, g_rank, g_world, b))
            out[b] = d.combine(_experts(d, ob), ob)
            out[a] = d.combine(_experts(d, oa), oa)
        results[config.name] = (d.output_dtype.value, out)
    except BaseException as exc:  # reported by the caller
        errors.append(f"{config.name}: {type(exc).__name__}: {exc}")
        start.abort()


def run_threads(configs: tuple[Config, ...], groups: list[Any], rank: int, seeds: list[int],
                timeout_s: float = 60.0) -> tuple[dict, list[str]]:
    """Each config in its own thread on its own group; every thread starts at once."""
    start = threading.Barrier(len(configs))
    results: dict = {}
    errors: list[str] = []
    threads = [threading.Thread(target=_thread_job, args=(c, g, rank, seeds, start, results, errors), daemon=True)
               for c, g in zip(configs, groups)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so their calls interleave finely
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
            if t.is_alive():
                errors.append(f"thread {t.name} did not finish within {timeout_s:.0f} s")
    finally:
        sys.setswitchinterval(interval)
    return results, errors


def run_sequentially(configs: tuple[Config, ...], groups: list[Any], rank: int, seeds: list[int]) -> dict:
    """The same jobs as ``run_threads``, one after the other in this thread, one dispatch at a time."""
    results = {}
    for c, g in zip(configs, groups):
        d = create(c, g)
        g_rank, g_world = (dist.get_rank(g), _size(g)) if g is not None else (d.rank, d.world_size)
        out = {}
        for s in seeds:
            o = d.dispatch(*config_inputs(c, g_rank, g_world, s))
            out[s] = d.combine(_experts(d, o), o)
        results[c.name] = (d.output_dtype.value, out)
    return results


def compare_runs(threaded: dict, sequential: dict, label: str) -> list[str]:
    problems = []
    for name, (dtype, outs) in sequential.items():
        if name not in threaded:
            problems.append(f"{label}: {name} produced nothing in its thread")
            continue
        t_dtype, t_outs = threaded[name]
        if t_dtype != dtype:
            problems.append(f"{label}: {name} resolved {t_dtype} in a thread, {dtype} alone")
        for s, ref in outs.items():
            if s not in t_outs or not torch.equal(t_outs[s].view(torch.int16), ref.view(torch.int16)):
                problems.append(f"{label}: {name}, seed {s}: the threaded result differs from the lone run")
    return problems


#: Thread scenarios on ranks: each thread a dispatcher on its own group of every rank.
THREAD_CONFIGS = (
    Config("thread fp8/torch/normal", "torch", "normal", "fp8", "fp8", hidden=256, group="thread0"),
    Config("thread bf16/allgather/low_latency", "allgather", "low_latency", None, "bf16", group="thread1",
           env=(("SGLANG_DEEPEP_BF16_DISPATCH", "1"),)),
    Config("thread int8/torch/low_latency", "torch", "low_latency", None, "int8", group="thread2",
           env=(("MOE_DISPATCH_OUTPUT_DTYPE", "int8"),)),
)


def threads_on_groups(rank: int, world: int, seeds: list[int]) -> list[str]:
    """``THREAD_CONFIGS`` one per thread, each on its own process group (collectives on one
    group must be issued in one order on every rank, so threads never share a group), all
    at once; results equal the one-thread run, and ``os.environ`` does not change."""
    env_before = dict(os.environ)
    groups = [_config_group(c, rank, world) for c in THREAD_CONFIGS]
    sequential = run_sequentially(THREAD_CONFIGS, groups, rank, seeds)
    threaded, errors = run_threads(THREAD_CONFIGS, groups, rank, seeds)
    problems = [f"rank {rank}: {e}" for e in errors]
    problems += compare_runs(threaded, sequential, f"rank {rank}")
    if dict(os.environ) != env_before:
        problems.append(f"rank {rank}: os.environ changed")
    return problems


def non_member_group_error(rank: int, world: int) -> tuple[str, str | None] | None:
    """Ranks 2.. create a dispatcher on the group of ranks 0 and 1, which they are not in:
    the error type and the parameter it names (None on the members)."""
    group = _group((0, 1), world)
    try:
        md.create_dispatcher("torch", md.DispatchSpec(128, 4, 2, output_dtype="bf16"), group, env={})
    except md.MoEDispatchError as exc:
        return type(exc).__name__, exc.parameter
    except Exception as exc:  # noqa: BLE001 - an untyped error is the finding
        return type(exc).__name__, None
    return None if rank < 2 else ("no error", None)


@contextmanager
def one_intra_op_thread():
    """One torch intra-op thread, as each pool rank has (CPU ``index_add_`` with 2 intra-op
    threads costs milliseconds per call on a 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
