"""Nothing lost: a long randomized run of dispatch → identity experts → combine.

On the built-in backends ``torch`` and ``allgather``, world sizes 1–4, every wire dtype
(bf16, fp8, int8, nvfp4), both modes (normal, low_latency), both group-list types:

- every (token, expert) pair of the routing arrives exactly once, at the rank and local
  expert that own the expert, as the token's own row bit for bit (rows carry tags);
- combine returns, bit for bit, the sequential reference of the documented summation order
  (``backends/exchange.py``): weighted fp32 sum of a token's experts per destination rank in
  ascending expert order, rounded to bf16, then the ranks in ascending order in fp32, bf16;
- the same inputs give the same bits again, on the same dispatcher and on a new one.

Exactness for every dtype, not only BF16: the activations are built so that each wire
dtype quantizes them losslessly (see ``_lost_helpers.py``), so identity experts return
the input itself and a lost, duplicated, misrouted or double-weighted copy changes bits.
Routings include -1 slots (with nonzero weights that must be ignored), tokens with no expert
at all, tokens with experts on only some ranks, ranks with T = 0 and ranks at capacity.

World size 1 runs in this process (no torch.distributed: the single-process path engines
use) and on a one-rank gloo subgroup; 2 and 3 on ``dist.new_group`` subgroups of the
session's 4-rank gloo pool, side by side; 4 on its default group (see ``LAYOUTS``).
Hypothesis is derandomized with no example database, so CI runs the same routings every time.
The module prints the number of round trips it ran (``ROUTINGS_TOTAL`` is the planned count).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import moe_dispatch as md
from moe_dispatch.backend import make_codec
from moe_dispatch_testing import IdentityExperts

import _lost_helpers as lost
from _lost_helpers import Batch, Routing

#: How the run spreads over ranks. "1" runs in this process without torch.distributed (the
#: single-process path); the others run on the session's 4-rank gloo pool: "4" on the default
#: group, "2+2" and "3+1" on ``dist.new_group`` subgroups running side by side (two batches
#: per example), so world sizes 1, 2 and 3 also go through ``create_dispatcher(group=...)``.
LAYOUTS = {"1": None, "2+2": ((0, 1), (2, 3)), "3+1": ((0, 1, 2), (3,)), "4": ((0, 1, 2, 3),)}
#: Hypothesis examples per layout; each example is one call on the rank pool.
EXAMPLES = {"1": 4, "2+2": 2, "3+1": 2, "4": 3}
#: Routings per batch: two fixed corners (ranks alternately at capacity and empty; every
#: rank empty) and ten drawn by hypothesis.
ROUTINGS_PER_BATCH = 12
COMBOS = len(lost.DTYPES) * len(lost.MODES) * len(lost.BACKENDS)  # 16


def _batches_per_example(layout: str) -> int:
    return len(LAYOUTS[layout] or ((0,),))


#: Dispatch → combine round trips the run makes, each on its own routing and activations
#: (not counting the determinism repeats). Quoted in the docs.
ROUTINGS_TOTAL = sum(EXAMPLES[k] * _batches_per_example(k) for k in LAYOUTS) * ROUTINGS_PER_BATCH * COMBOS

#: Edge cases each layout's run must have exercised (summed over ranks).
COVERAGE = ("minus_one_slots", "tokens_missing_a_rank", "unrouted_tokens", "empty_rank_calls", "full_rank_calls")
#: Filled by the runs: what was exercised, reported at the end of the module.
TALLY: Counter = Counter()

#: Per-token routing kinds (relative frequencies of: all routed, some -1, all -1,
#: every expert on one rank, the hot experts 0..k-1), see ``_lost_helpers.make_routing``.
KINDS = {
    "mixed": (3, 2, 1, 2, 1),
    "all routed": (1, 0, 0, 0, 0),
    "sparse": (1, 3, 3, 1, 0),
    "one rank": (0, 0, 0, 1, 0),
    "hot": (0, 0, 0, 0, 1),
}


@pytest.fixture(scope="module", autouse=True)
def _report_routings(request):
    yield
    if not TALLY:
        return
    worlds = ", ".join(f"{w}: {TALLY[f'world {w}']}" for w in range(1, 5))
    line = (f"nothing lost: {TALLY['round_trips']} dispatch->combine round trips, each its own routing "
            f"(planned {ROUTINGS_TOTAL}; by world size {worlds}), {TALLY['pairs']} (token, expert) pairs checked, "
            f"{TALLY['repeats']} determinism repeats; 4 dtypes x 2 modes x 2 backends")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(line)


def _run(layout: str, batches: tuple[Batch, ...], pools) -> list[dict]:
    """Run the example; the per-rank results of every batch, batch by batch."""
    if LAYOUTS[layout] is None:
        assert not (dist.is_available() and dist.is_initialized()), "world size 1 in-process needs no process group"
        with lost.one_intra_op_thread():
            return [lost.run_batch(0, 1, batches[0])]
    plan = tuple(zip(LAYOUTS[layout], batches))
    return [r for r in pools.get(4).map(lost.run_plan, plan) if r is not None]


@st.composite
def batches(draw, world: int) -> Batch:
    local = draw(st.integers(1, 4 if world < 4 else 3))
    experts = world * local
    top_k = draw(st.integers(1, min(experts, 8)))
    capacity = draw(st.integers(1, 24))
    tokens = st.one_of(st.just(0), st.just(capacity), st.integers(0, capacity))
    seeds = st.integers(0, 2**31 - 1)
    drawn = [
        Routing(
            seed=draw(seeds),
            tokens=tuple(draw(tokens) for _ in range(world)),
            kinds=KINDS[draw(st.sampled_from(sorted(KINDS)))],
            nvfp4_exponent=draw(st.integers(-2, 6)),
            int32_ids=draw(st.booleans()),
            fp8_ue8m0=draw(st.booleans()),
        )
        for _ in range(ROUTINGS_PER_BATCH - 2)
    ]
    corners = [
        Routing(seed=draw(seeds), tokens=tuple(capacity if r % 2 == 0 else 0 for r in range(world))),
        Routing(seed=draw(seeds), tokens=(0,) * world),
    ]
    return Batch(
        world=world,
        hidden=draw(st.sampled_from([128, 256])),
        local_experts=local,
        top_k=top_k,
        capacity=capacity,
        group_list_type=draw(st.sampled_from([0, 1])),
        routings=tuple(corners + drawn),
    )


def examples(layout: str):
    groups = LAYOUTS[layout] or ((0,),)
    return st.tuples(*(batches(len(ranks)) for ranks in groups))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_token_comes_back_once_per_routed_expert_bit_exact(layout, moe_rank_pools, record_property):
    """A failure names the routing (seed, tokens per rank), the dtype/mode/backend and the
    rank in its group, and says what went wrong:

    - "pairs ... lost / unrouted / duplicated": dispatch dropped a (token, expert) pair,
      delivered one that was not routed here (a -1 id or another rank's expert), or
      delivered one twice;
    - "rows match no token's tag" / "differ from their token's row": payload or scales were
      mixed up between rows, or a codec no longer reproduces exactly representable values;
    - "differs from the sequential reference": combine lost or duplicated a copy, applied a
      weight to the wrong copy (or a -1 slot's weight), or changed the summation order;
    - "different bits": the same inputs were not deterministic.
    """
    tally: Counter = Counter()

    # No shrinking: every attempt is a pool call (and a failed one restarts the pool); the
    # problems already name the routing, and derandomize replays the same example.
    @settings(max_examples=EXAMPLES[layout], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(example=examples(layout))
    def run(example: tuple[Batch, ...]) -> None:
        results = _run(layout, example, moe_rank_pools)
        problems = [p for r in results for p in r["problems"]]
        hidden = sum(r["problem_count"] for r in results) - len(problems)
        assert not problems, "\n".join(problems) + (f"\n... and {hidden} more" if hidden else "")
        tally["examples"] += 1
        for key in ("round_trips", "repeats", "pairs"):  # once per batch: counted on its rank 0 only
            tally[key] += sum(r[key] for r in results if r["rank"] == 0)
        for key in COVERAGE:
            tally[key] += sum(r[key] for r in results)
        for r in results:
            if r["rank"] == 0:
                tally[f"world {r['world']}"] += r["round_trips"]

    run()
    for key in ("round_trips", "pairs", "repeats"):
        record_property(key, tally[key])
    TALLY.update({k: v for k, v in tally.items() if k != "examples"})
    assert tally["examples"] == EXAMPLES[layout], "hypothesis ran fewer examples than asked; the routing count is off"
    expected = EXAMPLES[layout] * _batches_per_example(layout) * ROUTINGS_PER_BATCH * COMBOS
    assert tally["round_trips"] == expected
    # the run must keep exercising these edge cases
    for key in ("minus_one_slots", "unrouted_tokens", "empty_rank_calls", "full_rank_calls"):
        assert tally[key] > 0, f"no {key.replace('_', ' ')} in the whole run: the generator lost an edge case"
    if layout != "1":
        assert tally["tokens_missing_a_rank"] > 0, "no token with experts on some ranks but not others"


def test_routings_total_is_what_the_docs_quote():
    """The number quoted in the docs; change both together."""
    assert ROUTINGS_TOTAL == 2880


# -- the premises of the exact comparison --------------------------------------------------------


@pytest.mark.parametrize("dtype", lost.DTYPES)
@pytest.mark.parametrize("hidden", [128, 256])
def test_generated_activations_survive_their_wire_dtype_bit_for_bit(dtype, hidden):
    """The exact comparison assumes ``dequantize(quantize(x)) == x`` for the generated rows.
    If this fails, the codec's scale rule changed (see ``codecs.py``) or the generator no
    longer follows it; the nothing-lost failures are then about the inputs, not the exchange."""
    for exponent in (-2, 0, 3, 6):
        x = lost.exact_activations(dtype, 200, hidden, torch.Generator().manual_seed(exponent + 10), exponent)
        assert len(set(lost.row_keys(x).tolist())) == 200, "row tags must tell every token apart"
        for ue8m0 in (False, True) if dtype == "fp8" else (False,):
            quant = md.QuantHints(fp8_ue8m0_scales=ue8m0)
            wire = md.DispatchSpec(hidden, 4, 2, output_dtype=dtype, quant=quant).wire_format()
            codec = make_codec(wire, 2.0**exponent if dtype == "nvfp4" else None)
            back = codec.from_bytes(codec.encode(x))  # through the wire bytes, as dispatch sends them
            back = codec.dequantize(back).to(torch.bfloat16)
            assert torch.equal(back.view(torch.int16), x.view(torch.int16)), (dtype, hidden, exponent, ue8m0)


def test_reference_is_the_scalar_sequential_sum():
    """The vectorized reference against a plain loop over tokens, ranks and experts."""
    g = torch.Generator().manual_seed(3)
    world, local, k = 3, 3, 5
    ids, w = lost.make_routing(40, world * local, local, k, g, (3, 2, 1, 2, 1))
    x = (torch.randn(40, 32, generator=g) * 3).to(torch.bfloat16)
    want = torch.zeros(40, 32, dtype=torch.bfloat16)
    for t in range(40):
        total = torch.zeros(32)
        for r in range(world):
            acc = torch.zeros(32)
            for e, j in sorted((int(e), j) for j, e in enumerate(ids[t].tolist()) if e >= 0 and e // local == r):
                acc = acc + x[t].float() * w[t, j]
            total = total + acc.to(torch.bfloat16).float()
        want[t] = total.to(torch.bfloat16)
    got = lost.sequential_reference(x, ids, w, world, local)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("backend", lost.BACKENDS)
@pytest.mark.parametrize("mode", lost.MODES)
def test_combine_adds_experts_in_ascending_order(mode, backend):
    """Weights chosen so that only ascending expert order gives bf16 1.0 (0x3F80); another
    order gives 1.0078125 (0x3F81). A failure means the order changed from the documented
    one: update ``exchange.py``'s docstring, docs/design.md and the reference together."""
    assert not (dist.is_available() and dist.is_initialized())
    with lost.one_intra_op_thread():
        got, ref = lost.order_probe(0, 1, mode, backend)
    assert ref == 0x3F80
    assert got == ref, f"combine gave {got:#06x}, the ascending-order reference {ref:#06x}"


@pytest.mark.parametrize("backend", lost.BACKENDS)
@pytest.mark.parametrize("mode", lost.MODES)
def test_combine_adds_ranks_in_ascending_order(moe_rank_pools, mode, backend):
    """Per-rank partials 1, 2^-8, 2^-24, 2^-24: only ascending rank order gives bf16 1.0."""
    for rank, (got, ref) in enumerate(moe_rank_pools.get(4).map(lost.order_probe, mode, backend)):
        assert ref == 0x3F80
        assert got == ref, f"rank {rank}: combine gave {got:#06x}, the ascending-rank reference {ref:#06x}"


#: Wire rows whose width is not a multiple of 4 bytes: the routing metadata (int32 ids, fp32
#: weights) or the INT8 scale then starts at an unaligned byte offset.
UNALIGNED = [
    pytest.param("fp8", 128, True, id="fp8-ue8m0-H128"),  # 128 + 1 scale byte
    pytest.param("bf16", 129, False, id="bf16-H129"),  # 258
    pytest.param("int8", 130, False, id="int8-H130"),  # the fp32 scale at byte 130
    pytest.param("nvfp4", 48, False, id="nvfp4-H48"),  # 24 + 3
]


@pytest.mark.parametrize("mode", lost.MODES)
@pytest.mark.parametrize("dtype, hidden, ue8m0", UNALIGNED)
def test_one_received_row_with_an_unaligned_wire_width(dtype, hidden, ue8m0, mode):
    """One token, one rank: exactly one wire row is exchanged. Dispatch → identity experts →
    combine must give the sequential reference, whatever the wire row's width."""
    assert not (dist.is_available() and dist.is_initialized())
    quant = md.QuantHints(fp8_ue8m0_scales=ue8m0, input_global_scale=8.0 if dtype == "nvfp4" else None)
    spec = md.DispatchSpec(hidden, 4, 2, num_max_dispatch_tokens_per_rank=1, mode=mode, output_dtype=dtype, quant=quant)
    x = lost.exact_activations(dtype, 1, hidden, torch.Generator().manual_seed(0), nvfp4_exponent=3)
    ids, w = torch.tensor([[2, 0]]), torch.tensor([[0.25, 0.75]])
    with lost.one_intra_op_thread():
        d = md.create_dispatcher("torch", spec, env={})
        out = d.dispatch(x, ids, w)
        rows = IdentityExperts().apply_without_routing_weights(
            hidden, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16,
            global_scale=out.global_scale)
        result = d.combine(rows, out)
    assert torch.equal(result, lost.sequential_reference(x, ids, w, 1, 4))


# -- the checks can fail -------------------------------------------------------------------------


def test_row_check_catches_a_lost_a_duplicated_and_a_misfiled_row():
    """The pair check is not vacuous: tampering with a real DispatchOutput is reported."""
    batch = Batch(world=1, hidden=128, local_experts=4, top_k=3, capacity=8, group_list_type=1,
                  routings=(Routing(seed=5, tokens=(8,), kinds=(1, 0, 0, 0, 0)),))
    x, ids, w, _ = lost.global_batch(batch, batch.routings[0], combo=batch.combos.index(("fp8", "normal", "torch")))
    spec = md.DispatchSpec(128, 4, 3, num_max_dispatch_tokens_per_rank=8, output_dtype="fp8")
    out = md.create_dispatcher("torch", spec, env={}).dispatch(x, ids, w)

    def rows_of(o: md.DispatchOutput) -> torch.Tensor:
        return IdentityExperts().apply_without_routing_weights(
            128, o.hidden_states, o.hidden_states_scale, o.group_list_type, o.group_list, torch.bfloat16)

    def tampered(index: torch.Tensor, counts: torch.Tensor) -> md.DispatchOutput:
        """``out`` with its rows (and scales) taken at ``index`` and the given per-expert counts."""
        return dataclasses.replace(out, hidden_states=out.hidden_states[index],
                                   hidden_states_scale=out.hidden_states_scale[index], group_list=counts)

    assert lost.check_rows(batch, 0, x, ids, out, rows_of(out)) == []
    counts = out.expert_counts()
    rows = torch.arange(out.hidden_states.shape[0])
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts)
    last = int(expert_of_row[-1])
    moved = rows.clone()  # the first row of expert 0 and the first of another expert trade places
    a, b = int((expert_of_row == 0).nonzero()[0]), int((expert_of_row != 0).nonzero()[0])
    moved[a], moved[b] = b, a
    one_more = torch.nn.functional.one_hot(torch.tensor(last), 4)  # the last row's expert gets one more
    cases = {
        "lost": tampered(rows[:-1], counts - one_more),
        "duplicated": tampered(torch.cat([rows, rows[-1:]]), counts + one_more),
        "misfiled": tampered(moved, counts),
    }
    for name, bad in cases.items():
        problems = lost.check_rows(batch, 0, x, ids, bad, rows_of(bad))
        assert problems and "pairs" in problems[0], (name, problems)
