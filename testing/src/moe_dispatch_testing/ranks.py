"""The checks the kit runs on every local rank.

Each function runs as ``fn(rank, world_size, ...)`` inside a ``RankPool`` worker and returns
plain data: a list of problems (empty when the rank saw none) or a measurement. Problems are
sentences that name the case, so a failing test prints what went wrong on which rank.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import torch

from moe_dispatch import (
    CapacityError,
    DispatchDtype,
    DispatchOutput,
    InvalidInputError,
    Layout,
    MoEDispatchError,
    TorchExperts,
    run_experts,
)
from moe_dispatch.backend import align_up, dequantize_rows, group_starts, make_codec, row_experts
from moe_dispatch_testing import reference_moe
from moe_dispatch_testing.accuracy import TOLERANCES, relative_error
from moe_dispatch_testing.routing import random_expert_weights

from .cases import Case, GlobalBatch, Routing
from .experts import ScaledIdentityExperts, ScaledLayer, expert_factor
from .host_reads import RecordedOps

#: Per-token relative error allowed between combine and the fp32 sum of the same
#: dequantized rows: the BF16 rounding of partial sums, nothing else.
COMBINE_RTOL = 1e-2
#: The call check gloo alone makes in every call (``Comm.checks_calls_everywhere``): NCCL and HCCL make none in
#: low-latency calls, so its read of the peers' call ids is no accelerator's hot path.
GLOO_CALL_CHECK = "moe_dispatch._distributed.watch"
#: The reference backends' low-latency expansion on host memory, where a read blocks nothing (on an accelerator they
#: take a static path, which the core's own tests check for host reads).
REFERENCE_ON_HOST = "moe_dispatch._reference.compact"


def _expected_counts(ids: torch.Tensor, rank: int, local_experts: int) -> torch.Tensor:
    first = rank * local_experts
    mine = ids[(ids >= first) & (ids < first + local_experts)] - first
    return torch.bincount(mine, minlength=local_experts)


def _valid_rows(out: DispatchOutput, deq: torch.Tensor, expert: int, counts: torch.Tensor) -> torch.Tensor:
    if out.layout is Layout.MASKED:
        return deq[expert, : int(counts[expert])]
    start = int(group_starts(counts, out.expert_alignment)[expert])
    return deq[start : start + int(counts[expert])]


def _check_output_contract(case: Case, rank: int, out: DispatchOutput, dtype: DispatchDtype, codec: Any,
                           expected: torch.Tensor, worst_case: bool = False) -> list[str]:
    """The DispatchOutput means the same for every backend; returns what differs."""
    problems = []
    H, El = case.shape.hidden_size, case.shape.local_experts
    probe = codec.quantize(torch.zeros(1, H))
    if out.dtype is not dtype:
        problems.append(f"DispatchOutput.dtype is {out.dtype}, the dispatcher resolved {dtype}")
    if out.hidden_states.dtype != probe.data.dtype:
        problems.append(f"hidden_states dtype {out.hidden_states.dtype}, {dtype.value} travels as {probe.data.dtype}")
    if out.group_list_type != case.group_list_type:
        problems.append(f"group_list_type {out.group_list_type}, the spec asked for {case.group_list_type}")
    if tuple(out.group_list.shape) != (El,):
        problems.append(f"group_list shape {tuple(out.group_list.shape)}, expected ({El},): one entry per local expert")
    width = tuple(probe.data.shape[1:])
    counts = out.expert_counts().cpu()
    if out.layout is Layout.PACKED:
        if out.hidden_states.dim() != 2 or tuple(out.hidden_states.shape[1:]) != width:
            problems.append(f"PACKED hidden_states shape {tuple(out.hidden_states.shape)}, expected [rows, {width[0]}]")
        elif case.expert_alignment > 1 or worst_case:
            problems += _check_aligned(case, out, expected, worst_case)
        elif out.hidden_states.shape[0] != int(expected.sum()):
            problems.append(f"PACKED has {out.hidden_states.shape[0]} rows for {int(expected.sum())} (token, expert) pairs")
    elif out.layout is Layout.MASKED:
        shape = tuple(out.hidden_states.shape)
        if len(shape) != 3 or shape[0] != El or shape[2:] != width or shape[1] < int(expected.max()):
            problems.append(f"MASKED hidden_states shape {shape}, expected [{El}, >= max count, {width[0]}]")
    if probe.scale is not None:
        lead = tuple(out.hidden_states.shape[:-1])
        want = tuple(codec.scale_shape(lead))
        got = None if out.hidden_states_scale is None else tuple(out.hidden_states_scale.shape)
        if got != want:
            problems.append(f"hidden_states_scale shape {got}, {dtype.value} needs {want}")
    if not torch.equal(counts.to(torch.int64), expected.to(torch.int64)):
        problems.append(f"rank {rank} received per-expert counts {counts.tolist()}, the routing sends {expected.tolist()}")
    return problems


def _check_aligned(case: Case, out: DispatchOutput, expected: torch.Tensor, worst_case: bool = False) -> list[str]:
    """PACKED rows at ``case.expert_alignment``: the output says so, every segment fits, and every row outside
    the experts' valid rows is zero, data and scales, but for the rows after the last segment's end of a backend
    whose rows are its worst case in this mode (``Capabilities.worst_case_rows``: unspecified)."""
    a = case.expert_alignment
    if out.expert_alignment != a:
        return [f"PACKED rows at expert_alignment {out.expert_alignment}, the spec asked for {a}"]
    rows = out.hidden_states.shape[0]
    need = int(align_up(expected.to(torch.int64), a).sum())
    if rows < need:
        return [f"PACKED has {rows} rows; {expected.tolist()} in segments aligned to {a} take {need}"]
    padding = row_experts(expected.to(out.hidden_states.device), a, rows) < 0
    if worst_case:
        padding[need:] = False
    tensors = [out.hidden_states] + ([out.hidden_states_scale] if out.hidden_states_scale is not None else [])
    if any(bool((t[padding].float() != 0).any()) for t in tensors):
        return [f"padding rows of the aligned layout (alignment {a}) are not zero in data or scales"]
    return []


def _scaled_layer(case: Case, rank: int) -> ScaledLayer:
    return ScaledLayer.for_rank(case.shape.hidden_size, case.num_experts, rank, case.shape.local_experts)


def _scaled_rows(layer: ScaledLayer, out: DispatchOutput) -> torch.Tensor:
    """Scaled-identity experts on a dispatch output (NaN in aligned padding rows: combine ignores them)."""
    return run_experts(ScaledIdentityExperts(), layer, out)


def _combine_scaled(dispatcher: Any, layer: ScaledLayer, out: DispatchOutput) -> torch.Tensor:
    """Scaled-identity experts on a dispatch output, then combine."""
    return dispatcher.combine(_scaled_rows(layer, out), out)


def _dispatch_and_combine(case: Case, rank: int, batch: GlobalBatch, dispatcher: Any) -> tuple[DispatchOutput, torch.Tensor]:
    out = dispatcher.dispatch(*batch.local(rank))
    return out, _combine_scaled(dispatcher, _scaled_layer(case, rank), out)


def _combine_reference(case: Case, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, codec: Any) -> torch.Tensor:
    """fp32 ``Σ_j w_j · factor(e_j) · dequantize(x)`` per token."""
    deq = codec.dequantize(codec.quantize(x)).to(torch.bfloat16).float() if x.numel() else x.float()
    factors = torch.tensor([expert_factor(e, case.num_experts) for e in range(case.num_experts)])
    coef = torch.where(ids >= 0, w.float() * factors[ids.clamp(min=0)], 0.0).sum(dim=1)
    return deq * coef[:, None]


def check_conservation(rank: int, world_size: int, cases: list[Case]) -> list[str]:
    """Every (token, expert) pair arrives once at the right expert, and combine returns each
    token's weighted sum; the inputs are left as they were."""
    problems: list[str] = []
    for case in cases:
        batch = case.inputs()
        dispatcher = case.target.create(case.spec(batch))
        dtype = dispatcher.output_dtype
        codec = make_codec(dispatcher.spec.wire_format(), dispatcher.spec.quant.input_global_scale)
        x, ids, w = batch.local(rank)
        before = (x.clone(), ids.clone(), w.clone())
        out, result = _dispatch_and_combine(case, rank, batch, dispatcher)
        label = f"[{case.label()}, rank {rank}]"
        expected = _expected_counts(batch.topk_ids, rank, case.shape.local_experts)
        worst_case = case.mode in dispatcher.backend.capabilities.worst_case_rows
        problems += [f"{label} {p}" for p in _check_output_contract(case, rank, out, dtype, codec, expected,
                                                                    worst_case)]
        if not problems:
            problems += [f"{label} {p}" for p in _check_rows(case, rank, batch, out, codec, expected)]
        if tuple(result.shape) != tuple(x.shape) or result.dtype != torch.bfloat16:
            problems.append(f"{label} combine returned {tuple(result.shape)} {result.dtype}, expected {tuple(x.shape)} bf16")
            continue
        ref = _combine_reference(case, x, ids, w, codec)
        routed = (ids >= 0).any(dim=1)
        if bool((result[~routed] != 0).any()):
            problems.append(f"{label} tokens with every id -1 must come back as exact zeros")
        if bool(routed.any()):
            err = ((result[routed].float() - ref[routed]).norm(dim=1) / ref[routed].norm(dim=1).clamp(min=1e-12))
            worst = int(err.argmax())
            if float(err[worst]) > COMBINE_RTOL:
                problems.append(f"{label} combine differs from the weighted sum by {float(err[worst]):.3g} "
                                f"(relative) on a token routed to {ids[routed][worst].tolist()}; allowed {COMBINE_RTOL}")
        if not all(torch.equal(a, b) for a, b in zip((x, ids, w), before)):
            problems.append(f"{label} dispatch or combine modified its input tensors in place")
    return problems


def _check_rows(case: Case, rank: int, batch: GlobalBatch, out: DispatchOutput, codec: Any,
                expected: torch.Tensor) -> list[str]:
    """Each local expert's rows, summed, equal the sum of the tokens routed to it."""
    if not int(expected.sum()):
        return []
    deq = dequantize_rows(out.hidden_states, out.hidden_states_scale, case.shape.hidden_size, out.global_scale).double()
    source = codec.dequantize(codec.quantize(batch.x)).double()
    first = rank * case.shape.local_experts
    problems = []
    for e in range(case.shape.local_experts):
        tokens = (batch.topk_ids == first + e).any(dim=1)
        want = source[tokens].sum(dim=0)
        got = _valid_rows(out, deq, e, expected).sum(dim=0)
        err = (got - want).norm().item() / max(want.norm().item(), 1e-12)
        if err > COMBINE_RTOL:
            problems.append(f"local expert {e} received rows that are not the tokens routed to it "
                            f"(sums differ by {err:.3g} relative)")
    return problems


def check_forward(rank: int, world_size: int, case: Case, intermediate: int = 128) -> float:
    """Relative error of a whole MoE forward (torch reference experts) against the dense
    fp32 single-process reference on this rank's tokens."""
    batch = case.inputs()
    dispatcher = case.target.create(case.spec(batch))
    g = torch.Generator().manual_seed(case.seed + 1)
    weights = random_expert_weights(case.num_experts, case.shape.hidden_size, intermediate, generator=g)
    if case.target.weights is not None:  # e.g. W8A8 for a fused op that takes nothing else
        weights = case.target.weights(weights)
    local = weights.slice(rank * case.shape.local_experts, case.shape.local_experts)
    x, ids, w = batch.local(rank)
    out = dispatcher.forward(TorchExperts(), dispatcher.process_weights(local), x, ids, w)
    return relative_error(out, reference_moe(x, ids, w, weights))


def check_token_major(rank: int, world_size: int, case: Case) -> list[str]:
    """TOKEN_MAJOR rows: each local expert's (row, id) pairs are the tokens routed to it, with their weights (summed
    per expert, checked against the global batch); a whole layer matches the dense reference."""
    batch = case.inputs()
    dispatcher = case.target.create(case.spec(batch))
    out = dispatcher.dispatch(*batch.local(rank))
    label, ids = f"[{case.label()}, token-major, rank {rank}]", out.row_topk_ids
    if out.layout is not Layout.TOKEN_MAJOR or ids is None or out.row_topk_weights is None:
        return [f"{label} dispatch returned {out.layout} rows without their local top-k"]
    problems = []
    if bool((out.row_topk_weights[ids < 0] != 0).any()):
        problems.append(f"{label} weights of experts elsewhere (id -1) must be 0, as DeepEP's")
    expected = _expected_counts(batch.topk_ids, rank, case.shape.local_experts)
    if not torch.equal(out.expert_counts().cpu(), expected):
        problems.append(f"{label} counts {out.expert_counts().tolist()}, expected {expected.tolist()}")
    first = rank * case.shape.local_experts
    deq = dequantize_rows(out.hidden_states, out.hidden_states_scale, case.shape.hidden_size, out.global_scale)
    codec = make_codec(dispatcher.spec.wire_format(), dispatcher.spec.quant.input_global_scale)
    source = codec.dequantize(codec.quantize(batch.x)).double()
    for e in range(case.shape.local_experts):
        here, there = (ids.cpu() == e), (batch.topk_ids == first + e)
        rows, weights = deq.cpu().double()[here.any(dim=1)].sum(dim=0), out.row_topk_weights.cpu()[here].sum()
        want = source[there.any(dim=1)].sum(dim=0)
        if (rows - want).norm() > 1e-2 * max(want.norm().item(), 1e-12) or abs(weights - batch.topk_weights[there].sum()) > 1e-4:
            problems.append(f"{label} local expert {e}'s rows or weights are not those of the tokens routed to it")
    x, topk_ids, w = batch.local(rank)
    want, layer = _combine_reference(case, x, topk_ids, w, codec), _scaled_layer(case, rank)
    started = dispatcher.dispatch_start(x, topk_ids, w).wait()  # and in two halves, as micro-batches use it
    for how, combined in (("", _combine_scaled(dispatcher, layer, out)),
                          (" (started)", dispatcher.combine_start(_scaled_rows(layer, started), started).wait())):
        if (combined.float() - want).norm() > COMBINE_RTOL * max(want.norm().item(), 1e-12):
            problems.append(f"{label} combine{how} is not each token's weighted sum")
    error = check_forward(rank, world_size, case)
    if error > TOLERANCES[case.dtype]:
        problems.append(f"{label} a whole layer is {error:.3g} from the dense reference, allowed {TOLERANCES[case.dtype]}")
    return problems


def check_repeatable(rank: int, world_size: int, case: Case) -> list[str]:
    """The same inputs give the same bits: twice on one dispatcher, and on a new one."""
    batch = case.inputs()
    first = case.target.create(case.spec(batch))
    results = [_dispatch_and_combine(case, rank, batch, first)[1] for _ in range(2)]
    results.append(_dispatch_and_combine(case, rank, batch, case.target.create(case.spec(batch)))[1])
    problems = []
    if not torch.equal(results[0], results[1]):
        problems.append(f"[{case.label()}, rank {rank}] the same dispatcher gave different bits for the same inputs")
    if not torch.equal(results[0], results[2]):
        problems.append(f"[{case.label()}, rank {rank}] a new dispatcher gave different bits for the same inputs")
    return problems


def check_in_flight(rank: int, world_size: int, case: Case, second: Case) -> list[str]:
    """Two dispatches in flight on one dispatcher, the second with smaller batches (a vendor
    that sizes combine by the last dispatch fails the first combine), and a second dispatcher
    interleaved, combine to what each gives alone."""
    smaller = Routing("smaller batches", tuple(t // 2 for t in case.routing.tokens), drop=case.routing.drop,
                      skew=case.routing.skew)
    a2_case = replace(case, seed=case.seed + 100, routing=smaller)
    a_batch, a2_batch, b_batch = case.inputs(), a2_case.inputs(), second.inputs()
    a = case.target.create(case.spec(a_batch))
    b = second.target.create(second.spec(b_batch))
    layer_a, layer_b = _scaled_layer(case, rank), _scaled_layer(second, rank)
    xa, xa2, xb = a_batch.local(rank), a2_batch.local(rank), b_batch.local(rank)
    alone = [_combine_scaled(a, layer_a, a.dispatch(*xa)), _combine_scaled(a, layer_a, a.dispatch(*xa2)),
             _combine_scaled(b, layer_b, b.dispatch(*xb))]
    first, second_out = a.dispatch(*xa), a.dispatch(*xa2)  # two in flight on one dispatcher
    other = b.dispatch(*xb)  # and one on another dispatcher
    got_b = _combine_scaled(b, layer_b, other)
    got_second = _combine_scaled(a, layer_a, second_out)
    got = [_combine_scaled(a, layer_a, first), got_second, got_b]
    names = ["the first of two in flight", "the second of two in flight", "the interleaved second dispatcher"]
    return [f"[{case.label()}, rank {rank}] {name} differs from running alone"
            for name, x, y in zip(names, alone, got) if not torch.equal(x, y)]


def check_overlap(rank: int, world_size: int, case: Case) -> list[str]:
    """Two micro-batches interleaved in split phase as an engine's two-batch overlap runs them
    (start both dispatches; receive the first, compute, start its combine; receive the second,
    compute, start its combine; receive the combines in the other order) give the bits each gives
    in blocking calls; a second ``wait()`` returns the same result; a combine started twice is refused."""
    smaller = Routing("smaller batches", tuple(t // 2 for t in case.routing.tokens), drop=case.routing.drop,
                      skew=case.routing.skew)
    batches = [case.inputs(), replace(case, seed=case.seed + 1, routing=smaller).inputs()]
    d = case.target.create(case.spec(batches[0]))
    layer = _scaled_layer(case, rank)
    xs = [b.local(rank) for b in batches]
    label = f"[{case.label()}, rank {rank}]"
    alone = [_combine_scaled(d, layer, d.dispatch(*x)) for x in xs]

    started = [d.dispatch_start(*x) for x in xs]
    outs, combines = [], []
    for pending in started:
        outs.append(pending.wait())
        combines.append(d.combine_start(_scaled_rows(layer, outs[-1]), outs[-1]))
    got = [c.wait() for c in reversed(combines)][::-1]
    problems = [f"{label} micro-batch {i} in split phase differs from blocking calls"
                for i, (a, b) in enumerate(zip(alone, got)) if not torch.equal(a, b)]
    if started[0].wait() is not outs[0] or combines[0].wait() is not got[0]:
        problems.append(f"{label} a second wait() gave another result")
    try:
        d.combine_start(_scaled_rows(layer, outs[0]), outs[0])
        problems.append(f"{label} a second combine_start of one output was accepted")
    except InvalidInputError as exc:
        if exc.parameter != "dispatch_output":
            problems.append(f"{label} a second combine_start names {exc.parameter!r}")
    if not torch.equal(_combine_scaled(d, layer, d.dispatch(*xs[0])), alone[0]):
        problems.append(f"{label} blocking calls after split-phase ones gave other bits")
    return problems


def check_split_phase(rank: int, world_size: int, case: Case) -> list[str]:
    """``Dispatcher.split_phase`` is what ``capabilities.split_phase`` declares for the mode; ``dispatch_start`` and
    ``combine_start`` return with the data on its way (``Pending.overlapped``) exactly when it is declared, and
    give the blocking calls' counts and bits."""
    batch = case.inputs()
    d = case.target.create(case.spec(batch))
    declared = case.mode in d.backend.capabilities.split_phase
    layer, x = _scaled_layer(case, rank), batch.local(rank)
    label = f"[{case.label()}, rank {rank}]"
    blocking_out = d.dispatch(*x)
    blocking_counts = blocking_out.expert_counts().clone()
    blocking = _combine_scaled(d, layer, blocking_out)
    dispatching = d.dispatch_start(*x)
    out = dispatching.wait()
    combining = d.combine_start(_scaled_rows(layer, out), out)
    result = combining.wait()
    named = "names" if declared else "does not name"
    problems = []
    if d.split_phase is not declared:
        problems.append(f"{label} Dispatcher.split_phase is {d.split_phase}; capabilities.split_phase {named} the mode")
    for call, pending in (("dispatch_start", dispatching), ("combine_start", combining)):
        if pending.overlapped is not declared:
            problems.append(f"{label} {call} returned Pending.overlapped={pending.overlapped}: "
                            + ("it ran the call to its end at the start, in a mode capabilities.split_phase names"
                               if declared else "overlapped, in a mode capabilities.split_phase does not name"))
    if not torch.equal(out.expert_counts(), blocking_counts):
        problems.append(f"{label} dispatch_start received other per-expert counts than dispatch")
    if not torch.equal(result, blocking):
        problems.append(f"{label} the started calls' combine differs from the blocking calls'")
    return problems


def _packages(d: Any) -> set[str]:
    """The top-level packages of the code under test: the core's and the backend's."""
    return {"moe_dispatch", *(type(o).__module__.partition(".")[0] for o in (d.backend, d.backend_dispatcher))}


def check_no_host_sync(rank: int, world_size: int, cases: list[Case]) -> list[str]:
    """A dispatch and a combine after a first pair (an engine warms up before it captures) read no tensor data on
    the host in the backend's or the core's code, with the value checks off (they read the data by design). The
    kit's own work (inputs, experts, checks) runs outside the recording; the vendor's calls (on CPU, a fake standing
    for its kernels), gloo's call check (``GLOO_CALL_CHECK``) and the reference backends' host-memory expansion
    (``REFERENCE_ON_HOST``) are left out."""
    problems = []
    for case in cases:
        batch = case.inputs()
        d = case.target.create(case.spec(batch), check_inputs=False)
        layer, x = _scaled_layer(case, rank), batch.local(rank)
        _combine_scaled(d, layer, d.dispatch(*x))
        host_only = [REFERENCE_ON_HOST, GLOO_CALL_CHECK] if d.comm.checks_calls_everywhere else [REFERENCE_ON_HOST]
        seen = RecordedOps(_packages(d), leave_out=host_only)
        with seen:
            out = d.dispatch(*x)
        rows = _scaled_rows(layer, out)
        with seen:
            d.combine(rows, out)
        label = f"[{case.label()}, rank {rank}]"
        if not seen.ops:
            problems.append(f"{label} no aten op was recorded on the calling thread: nothing of the calls was seen")
        problems += [f"{label} {r.op} reads data on the host at {r.where}" for r in dict.fromkeys(seen.reads)]
    return problems


def _tensors(out: DispatchOutput) -> list[torch.Tensor]:
    """An output's tensors as bytes (MASKED padding may hold NaN, which ``torch.equal`` never matches)."""
    return [t.contiguous().view(-1).view(torch.uint8) for t in (out.hidden_states, out.hidden_states_scale,
                                                                out.group_list) if t is not None]


def check_lifetime(rank: int, world_size: int, case: Case) -> list[str]:
    """The lifetime rule of ``DispatchOutput``: an output's tensors stay as dispatch left them
    until its combine, whatever else is dispatched meanwhile (buffers reused by the backend
    belong to one output at a time); a second combine of one output is an ``InvalidInputError``
    naming ``dispatch_output`` on every rank, and the dispatcher goes on working after it."""
    batch, other_batch = case.inputs(), replace(case, seed=case.seed + 1).inputs()
    d = case.target.create(case.spec(batch))
    layer = _scaled_layer(case, rank)
    x, x_other = batch.local(rank), other_batch.local(rank)
    problems: list[str] = []
    alone = _combine_scaled(d, layer, d.dispatch(*x))
    first = d.dispatch(*x)
    kept = [t.clone() for t in _tensors(first)]
    for _ in range(2):  # two more in flight, then combined, while the first waits
        _combine_scaled(d, layer, d.dispatch(*x_other))
    later = d.dispatch(*x_other)
    if not all(torch.equal(a, b) for a, b in zip(kept, _tensors(first))):
        problems.append(f"[{case.label()}, rank {rank}] an output's rows changed before its combine "
                        "(a later dispatch wrote its buffers)")
    if not torch.equal(_combine_scaled(d, layer, first), alone):
        problems.append(f"[{case.label()}, rank {rank}] an output combined after later dispatches differs from alone")
    try:
        _combine_scaled(d, layer, first)
        problems.append(f"[{case.label()}, rank {rank}] a second combine of one output was accepted")
    except InvalidInputError as exc:
        if exc.parameter != "dispatch_output":
            problems.append(f"[{case.label()}, rank {rank}] a second combine names {exc.parameter!r}")
    except Exception as exc:  # noqa: BLE001 - an untyped error is the finding
        problems.append(f"[{case.label()}, rank {rank}] a second combine raised {type(exc).__name__}: {exc}")
    _combine_scaled(d, layer, later)
    if not torch.equal(_combine_scaled(d, layer, d.dispatch(*x)), alone):
        problems.append(f"[{case.label()}, rank {rank}] the dispatcher gave other bits after a refused combine")
    return problems


class RoutingReuse(NamedTuple):
    """Three round trips of one batch: plain, with the routing overwritten between dispatch and
    combine, plain again. ``repeatable``: the plain ones agree (else the comparison means nothing);
    ``unchanged``: the overwritten one agrees with them; ``max_diff`` between the two."""

    repeatable: bool
    unchanged: bool
    max_diff: float


def routing_reuse(dispatcher: Any, layer: ScaledLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                  other_ids: torch.Tensor) -> RoutingReuse:
    """Dispatch → scaled-identity experts → combine, with the engine's router buffers overwritten in
    place after dispatch (``other_ids`` copied into the ids, the weights changed) in the middle run."""

    def round_trip(overwrite: bool) -> torch.Tensor:
        router_ids, router_w = ids.clone(), w.clone()  # the engine's router output buffers
        out = dispatcher.dispatch(x, router_ids, router_w)
        if overwrite:  # the next step's router writes into the same buffers before this combine
            rows = min(router_ids.shape[0], other_ids.shape[0])
            router_ids[:rows].copy_(other_ids[:rows])
            router_w.mul_(0.5).add_(0.25)
        return _combine_scaled(dispatcher, layer, out)

    plain, overwritten, again = round_trip(False), round_trip(True), round_trip(False)
    diff = (plain.float() - overwritten.float()).abs()
    return RoutingReuse(torch.equal(plain, again), torch.equal(plain, overwritten),
                        float(diff.max()) if diff.numel() else 0.0)  # a rank may have no tokens


def check_routing_reused(rank: int, world_size: int, case: Case) -> list[str]:
    """Combine uses the routing as it was given to dispatch: an engine that overwrites its
    ``topk_ids``/``topk_weights`` tensors after dispatch (CUDA-graph engines reuse them) gets the
    same result as one that does not."""
    batch, other = case.inputs(), replace(case, seed=case.seed + 1).inputs()
    d = case.target.create(case.spec(batch))
    x, ids, w = batch.local(rank)
    result = routing_reuse(d, _scaled_layer(case, rank), x, ids, w, other.local(rank)[1])
    if not result.repeatable:
        return [f"[{case.label()}, rank {rank}] the same dispatch and combine twice gave different results"]
    if result.unchanged:
        return []
    return [f"[{case.label()}, rank {rank}] combine read topk_ids/topk_weights after dispatch: overwriting them "
            f"between dispatch and combine changed the result (max diff {result.max_diff:.3g})"]


def check_environment(rank: int, world_size: int, cases: list[Case]) -> list[str]:
    """Creating, dispatching and combining leave ``os.environ`` exactly as it was."""
    before = dict(os.environ)
    for case in cases:
        batch = case.inputs()
        _dispatch_and_combine(case, rank, batch, case.target.create(case.spec(batch)))
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return [f"rank {rank}: os.environ changed: {', '.join(changed)}"] if changed else []


# -- bad input ----------------------------------------------------------------------------------


def _bad_dispatch_inputs(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, num_experts: int
                         ) -> list[tuple[str, str, Callable[[], tuple[Any, Any, Any]]]]:
    def nan(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = float("nan")
        return t

    def dup(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[0, 1] = t[0, 0]
        return t

    cases = [
        ("hidden_states float32", "hidden_states", lambda: (x.float(), ids, w)),
        ("hidden_states with the wrong hidden size", "hidden_states", lambda: (x[:, :-16], ids, w)),
        ("hidden_states 1-D", "hidden_states", lambda: (x[0], ids, w)),
        ("hidden_states with NaN", "hidden_states", lambda: (nan(x), ids, w)),
        ("topk_ids float", "topk_ids", lambda: (x, ids.float(), w)),
        ("topk_ids out of range", "topk_ids", lambda: (x, torch.full_like(ids, num_experts), w)),
        ("topk_ids -2", "topk_ids", lambda: (x, torch.full_like(ids, -2), w)),
        ("topk_ids naming one expert twice", "topk_ids", lambda: (x, dup(ids), w)),
        ("topk_ids with fewer tokens", "topk_ids", lambda: (x, ids[:-1], w)),
        ("topk_weights bf16", "topk_weights", lambda: (x, ids, w.bfloat16())),
        ("topk_weights with NaN", "topk_weights", lambda: (x, ids, nan(w))),
        ("topk_weights with a slot missing", "topk_weights", lambda: (x, ids, w[:, :-1])),
    ]
    if ids.shape[1] < 2:  # a duplicate needs two slots
        cases = [c for c in cases if "twice" not in c[0]]
    return cases


def check_bad_inputs(rank: int, world_size: int, case: Case) -> list[str]:
    """Each bad input raises a typed error naming the parameter, before any data is
    touched; then a good call still works (nothing was left half-done)."""
    batch = case.inputs()
    d = case.target.create(case.spec(batch))
    x, ids, w = batch.local(rank)
    problems = []
    snapshot = [t.clone() for t in (x, ids, w)]
    for name, parameter, build in _bad_dispatch_inputs(x, ids, w, case.num_experts):
        try:
            d.dispatch(*build())
        except MoEDispatchError as exc:
            if exc.parameter != parameter:
                problems.append(f"dispatch with {name}: error names {exc.parameter!r}, expected {parameter!r}")
        except Exception as exc:  # noqa: BLE001 - an untyped error is the finding
            problems.append(f"dispatch with {name}: raised untyped {type(exc).__name__}: {exc}")
        else:
            problems.append(f"dispatch with {name}: no error")
    out, _ = _dispatch_and_combine(case, rank, batch, d)  # a good call after the bad ones
    good = torch.zeros(out.hidden_states.shape[:-1] + (case.shape.hidden_size,), dtype=torch.bfloat16)
    other = case.target.create(case.spec(batch))
    for name, parameter, call in [
        ("expert_output float32", "expert_output", lambda: d.combine(good.float(), out)),
        ("expert_output with the wrong hidden size", "expert_output", lambda: d.combine(good[..., :-16], out)),
        ("another dispatcher's DispatchOutput", "dispatch_output", lambda: other.combine(good, out)),
    ]:
        try:
            call()
        except MoEDispatchError as exc:
            if exc.parameter != parameter:
                problems.append(f"combine with {name}: error names {exc.parameter!r}, expected {parameter!r}")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"combine with {name}: raised untyped {type(exc).__name__}: {exc}")
        else:
            problems.append(f"combine with {name}: no error")
    if not all(torch.equal(a, b) for a, b in zip((x, ids, w), snapshot)):
        problems.append("a rejected call modified the caller's tensors")
    return [f"[{case.label()}, rank {rank}] {p}" for p in problems]


def check_capacity(rank: int, world_size: int, case: Case) -> list[str]:
    """A batch above ``num_max_dispatch_tokens_per_rank`` is a ``CapacityError`` naming it."""
    batch = case.inputs()
    d = case.target.create(case.spec(batch))
    x, ids, w = batch.local(rank)
    more = case.shape.tokens_per_rank + 1 - x.shape[0]
    big = (torch.cat([x, x[:1].expand(more, -1)]), torch.cat([ids, ids[:1].expand(more, -1)]),
           torch.cat([w, w[:1].expand(more, -1)]))
    try:
        d.dispatch(*big)
    except CapacityError as exc:
        if exc.parameter != "num_max_dispatch_tokens_per_rank":
            return [f"rank {rank}: CapacityError names {exc.parameter!r}, not num_max_dispatch_tokens_per_rank"]
        return []
    except Exception as exc:  # noqa: BLE001
        return [f"rank {rank}: {more + x.shape[0]} tokens with capacity {case.shape.tokens_per_rank} raised "
                f"{type(exc).__name__}: {exc}, not CapacityError"]
    return [f"rank {rank}: {more + x.shape[0]} tokens with capacity {case.shape.tokens_per_rank} were accepted"]


def measure_traffic(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, int]]:
    """Bytes this rank sent per dispatch and per combine, as the core's ``Comm`` counted
    them (zero for a backend that moves data through its own transport)."""
    sizes = []
    for case in cases:
        batch = case.inputs()
        d = case.target.create(case.spec(batch))
        before = d.traffic.copy()
        x, ids, w = batch.local(rank)
        out = d.dispatch(x, ids, w)
        mid = d.traffic.copy()
        d.combine(torch.zeros(out.hidden_states.shape[:-1] + (case.shape.hidden_size,), dtype=torch.bfloat16), out)
        sent = mid - before
        back = d.traffic - mid
        sizes.append({"dispatch": sent.payload_bytes + sent.metadata_bytes,
                      "combine": back.combine_bytes + back.metadata_bytes})
    return sizes


__all__ = [
    "COMBINE_RTOL",
    "RoutingReuse",
    "routing_reuse",
    "check_bad_inputs",
    "check_capacity",
    "check_conservation",
    "check_environment",
    "check_forward",
    "check_in_flight",
    "check_lifetime",
    "check_no_host_sync",
    "check_repeatable",
    "check_split_phase",
    "measure_traffic",
]
