"""Bad input everywhere: a table of bad inputs through the public API.

Every case is one public call (``DispatchSpec``, ``QuantHints``, ``create_dispatcher``,
``Backend.check_spec``, ``Dispatcher.dispatch``, ``Dispatcher.combine``, ``Dispatcher.forward``) with
one thing wrong. Each must raise its typed ``MoEDispatchError`` subclass whose ``parameter``
names what is wrong and whose message shows the value seen and what is allowed; no input
tensor may change (bit for bit), and no collective may be entered (``traffic.collectives``).
The checks are local, so world size 1 covers them; the multi-rank tests at the end show the
error is raised on the rank that has the bad input, before its first collective.

``docs/evidence/design-notes.md`` lists the same cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.routing import random_routing

H, E, K, T, CAP = 256, 8, 2, 6, 8
GLOBAL_SCALE = 448.0 * 6.0 / 4.0


# -- building blocks ------------------------------------------------------------------------


def make(mode: str = "normal", dtype: str = "fp8", **kw: Any) -> md.Dispatcher:
    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=CAP, mode=mode, output_dtype=dtype, **kw)
    return md.create_dispatcher("torch", spec, env={})


def inputs(t: int = T, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids, w = random_routing(t, E, K, generator=g)
    return [torch.randn(t, H, generator=g).to(torch.bfloat16), ids, w]


@dataclass
class Call:
    """What one case runs: the call, the tensors it hands over (checked for in-place
    changes) and the dispatcher whose collectives are counted (None: no dispatcher yet)."""

    run: Callable[[], Any]
    tensors: list[Any]
    dispatcher: md.Dispatcher | None = None
    #: collectives the call may legitimately enter before the bad input is reached
    #: (forward: the dispatch of a good batch, before the experts' bad rows reach combine).
    collectives_allowed: int = 0


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Call]
    error: type
    parameter: str
    value: str  # a piece of the message that shows the value seen
    allowed: str  # a piece of the message that says what is allowed


def call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Callable[[], Call]:
    """A case that makes no dispatcher (spec, hints, creation)."""
    tensors = [a for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
    return lambda: Call(lambda: fn(*args, **kw), tensors)


def dispatch(change: Callable[[list[torch.Tensor]], None], mode: str = "normal", t: int = T) -> Callable[[], Call]:
    """A dispatch whose inputs ``change`` edits (in the list, on clones) before the call."""

    def build() -> Call:
        d = make(mode)
        args = inputs(t)
        change(args)
        return Call(lambda: d.dispatch(*args), [a for a in args if isinstance(a, torch.Tensor)], d)

    return build


def combine(change: Callable[[torch.Tensor, md.DispatchOutput, md.Dispatcher], tuple], mode: str = "normal"
            ) -> Callable[[], Call]:
    """A combine after a good dispatch; ``change(rows, output, dispatcher)`` returns the bad
    ``(expert_output, dispatch_output)`` pair."""

    def build() -> Call:
        d = make(mode)
        out = d.dispatch(*inputs())
        rows = torch.ones(out.hidden_states.shape[:-1] + (H,), dtype=torch.bfloat16)
        expert_output, dispatch_output = change(rows, out, d)
        tensors = [t for t in (expert_output, *_output_tensors(out)) if isinstance(t, torch.Tensor)]
        return Call(lambda: d.combine(expert_output, dispatch_output), tensors, d)

    return build


def _output_tensors(out: md.DispatchOutput) -> list[torch.Tensor]:
    return [t for t in (out.hidden_states, out.hidden_states_scale, out.topk_ids, out.topk_weights, out.group_list)
            if t is not None]


def put(i: int, value: Callable[[torch.Tensor], Any]) -> Callable[[list[torch.Tensor]], None]:
    def change(args: list[torch.Tensor]) -> None:
        args[i] = value(args[i])
    return change


def poke(i: int, index: tuple[int, int], value: float | int) -> Callable[[list[torch.Tensor]], None]:
    def change(args: list[torch.Tensor]) -> None:
        args[i] = args[i].clone()
        args[i][index] = value
    return change


def duplicate_expert(args: list[torch.Tensor]) -> None:
    ids = args[1].clone()
    ids[2, 1] = ids[2, 0]
    args[1] = ids


class Float32Experts(md.TorchExperts):
    """An expert kernel that ignores ``output_dtype`` and returns fp32 rows."""

    def apply_without_routing_weights(self, layer, hidden_states, hidden_states_scale, group_list_type, group_list,
                                      output_dtype, *, global_scale=None):  # type: ignore[no-untyped-def]
        return super().apply_without_routing_weights(layer, hidden_states, hidden_states_scale, group_list_type,
                                                     group_list, torch.float32, global_scale=global_scale)


class ShortExperts(md.TorchExperts):
    """An expert kernel that drops its last row."""

    def apply_without_routing_weights(self, *args, **kw):  # type: ignore[no-untyped-def]
        return super().apply_without_routing_weights(*args, **kw)[:-1]


def _weights() -> md.ExpertWeights:
    g = torch.Generator().manual_seed(3)
    return md.ExpertWeights(torch.randn(E, 64, H, generator=g) * 0.05, torch.randn(E, H, 32, generator=g) * 0.05)


def forward(experts: md.ExpertKernel, change: Callable[[list[torch.Tensor]], None] | None = None,
            bad_rows: bool = False) -> Callable[[], Call]:
    """``Dispatcher.forward`` with a bad input (``change``) or an expert kernel that returns bad rows."""

    def build() -> Call:
        d = make()
        args = inputs()
        if change is not None:
            change(args)
        allowed = 0
        if bad_rows:  # the dispatch is good and enters its collectives; combine must not
            twin = make()
            twin.dispatch(*inputs())
            allowed = twin.traffic.collectives
        layer = _weights()
        tensors = [a for a in (*args, layer.w13_weight, layer.w2_weight) if isinstance(a, torch.Tensor)]
        return Call(lambda: d.forward(experts, layer, *args), tensors, d, allowed)

    return build


def _other_dispatch_rows(rows: torch.Tensor, out: md.DispatchOutput, d: md.Dispatcher) -> tuple:
    """The expert rows of one dispatch handed to combine with another dispatch's output."""
    x, ids, w = inputs()
    ids = ids.clone()
    ids[:, 1] = -1  # fewer rows than the first dispatch
    second = d.dispatch(x, ids, w)
    assert second.hidden_states.shape[0] != rows.shape[0]
    return rows, second


def _foreign_output(rows: torch.Tensor, out: md.DispatchOutput, d: md.Dispatcher) -> tuple:
    other = make()
    return rows, other.dispatch(*inputs())


spec = md.DispatchSpec
hints = md.QuantHints
invalid_spec, invalid_input = md.InvalidSpecError, md.InvalidInputError

CASES = [
    # DispatchSpec
    Case("spec hidden_size 0", call(spec, 0, E, K), invalid_spec, "hidden_size", "=0", "1, 2, 3"),
    Case("spec hidden_size float", call(spec, 256.0, E, K), invalid_spec, "hidden_size", "256.0", "1, 2, 3"),
    Case("spec num_experts negative", call(spec, H, -8, K), invalid_spec, "num_experts", "-8", "1, 2, 3"),
    Case("spec top_k 0", call(spec, H, E, 0), invalid_spec, "top_k", "=0", "1, 2, 3"),
    Case("spec top_k larger than num_experts", call(spec, H, 4, 5), invalid_spec, "top_k", "=5", "1..num_experts (4)"),
    Case("spec capacity 0", call(spec, H, E, K, num_max_dispatch_tokens_per_rank=0), invalid_spec,
         "num_max_dispatch_tokens_per_rank", "=0", "1, 2, 3"),
    Case("spec capacity bool", call(spec, H, E, K, num_max_dispatch_tokens_per_rank=True), invalid_spec,
         "num_max_dispatch_tokens_per_rank", "True", "1, 2, 3"),
    Case("spec unknown mode", call(spec, H, E, K, mode="fast"), invalid_spec, "mode", "'fast'", "normal, low_latency"),
    Case("spec unknown output_dtype", call(spec, H, E, K, output_dtype="fp16"), invalid_spec, "output_dtype",
         "'fp16'", "bf16, fp8, int8, nvfp4"),
    Case("spec group_list_type 2", call(spec, H, E, K, group_list_type=2), invalid_spec, "group_list_type", "=2",
         "0 (cumulative offsets), 1 (per-expert counts)"),
    Case("spec empty runner", call(spec, H, E, K, runner=""), invalid_spec, "runner", "''", "None"),
    Case("spec quant not hints", call(spec, H, E, K, quant=5), invalid_spec, "quant", "=5", "QuantHints"),
    Case("spec quant dict with misspelt key", call(spec, H, E, K, quant={"dispather_output_dtype": "int8"}),
         invalid_spec, "quant", "did you mean dispatcher_output_dtype", "dispatcher_output_dtype, input_global_scale"),
    # QuantHints
    Case("hints global scale 0", call(hints, input_global_scale=0.0), invalid_spec, "quant.input_global_scale",
         "0.0", "positive finite"),
    Case("hints global scale negative", call(hints, input_global_scale=-1.0), invalid_spec,
         "quant.input_global_scale", "-1.0", "positive finite"),
    Case("hints global scale NaN", call(hints, input_global_scale=math.nan), invalid_spec, "quant.input_global_scale",
         "nan", "positive finite"),
    Case("hints global scale Inf", call(hints, input_global_scale=math.inf), invalid_spec, "quant.input_global_scale",
         "inf", "positive finite"),
    Case("hints global scale tensor of two", call(hints, input_global_scale=torch.tensor([1.0, 2.0])), invalid_spec,
         "quant.input_global_scale", "shape=(2,)", "positive finite"),
    Case("hints global scale negative tensor", call(hints, input_global_scale=torch.tensor(-3.0)), invalid_spec,
         "quant.input_global_scale", "-3.0", "positive finite"),
    Case("hints global scale str", call(hints, input_global_scale="448"), invalid_spec, "quant.input_global_scale",
         "'448'", "positive finite"),
    Case("hints ue8m0 not bool", call(hints, fp8_ue8m0_scales="yes"), invalid_spec, "quant.fp8_ue8m0_scales",
         "'yes'", "True, False"),
    Case("hints unknown dispatcher_output_dtype", call(hints, dispatcher_output_dtype="fp4"), invalid_spec,
         "quant.dispatcher_output_dtype", "'fp4'", "bf16, fp8, int8, nvfp4"),
    Case("hints from_dict misspelt key", call(hints.from_dict, {"input_global_scal": 1.0}), invalid_spec, "quant",
         "did you mean input_global_scale", "fp8_ue8m0_scales"),
    # create_dispatcher (and Backend.check_spec, what create_dispatcher runs for the group's size)
    Case("create unknown backend", call(md.create_dispatcher, "no-such-backend", spec(H, E, K)),
         md.BackendUnavailableError, "backend", "'no-such-backend'", "torch"),
    Case("create nvfp4 without global scale", call(md.create_dispatcher, "torch", spec(H, E, K, output_dtype="nvfp4"),
                                                   env={}),
         invalid_spec, "quant.input_global_scale", "None", "positive finite"),
    Case("create fp8 hidden not a multiple of 128", call(md.create_dispatcher, "torch", spec(200, E, K, output_dtype="fp8"),
                                                         env={}),
         invalid_spec, "hidden_size", "=200", "multiples of 128"),
    Case("create auto resolving to fp8 with hidden 200", call(md.create_dispatcher, "torch", spec(200, E, K), env={}),
         invalid_spec, "hidden_size", "=200", "multiples of 128"),
    Case("create nvfp4 hidden not a multiple of 16",
         call(md.create_dispatcher, "torch", spec(40, E, K, output_dtype="nvfp4",
                                                  quant=hints(input_global_scale=GLOBAL_SCALE)), env={}),
         invalid_spec, "hidden_size", "=40", "multiples of 16"),
    Case("create env dtype unknown", call(md.create_dispatcher, "torch", spec(H, E, K),
                                          env={"MOE_DISPATCH_OUTPUT_DTYPE": "fp6"}),
         invalid_spec, "MOE_DISPATCH_OUTPUT_DTYPE", "'fp6'", "bf16, fp8, int8, nvfp4"),
    Case("create unknown runner", call(md.create_dispatcher, "torch", spec(H, E, K, runner="no-such-runner"), env={}),
         invalid_spec, "runner", "'no-such-runner'", "torch"),
    Case("create group without torch.distributed", call(md.create_dispatcher, "torch", spec(H, E, K), object(),
                                                        env={}),
         invalid_spec, "group", "<object object", "None or a dist.ProcessGroup"),
    Case("check_spec experts not divisible by ranks", call(lambda: md.PluginHost.default().get_backend("torch").check_spec(spec(H, E, K), 3)),
         invalid_spec, "num_experts", "=8", "a multiple of the world size (3)"),
    # Dispatcher.dispatch: metadata (always checked)
    Case("dispatch hidden_states a list", dispatch(put(0, lambda x: x.tolist())), invalid_input, "hidden_states",
         "[[", "torch.Tensor"),
    Case("dispatch hidden_states 1-D", dispatch(put(0, lambda x: x[0])), invalid_input, "hidden_states",
         "shape=(256,)", "[num_tokens, 256]"),
    Case("dispatch hidden_states 3-D", dispatch(put(0, lambda x: x.unsqueeze(0))), invalid_input, "hidden_states",
         "shape=(1, 6, 256)", "[num_tokens, 256]"),
    Case("dispatch hidden_states wrong hidden size", dispatch(put(0, lambda x: x[:, :128])), invalid_input,
         "hidden_states", "shape=(6, 128)", "[num_tokens, 256]"),
    Case("dispatch hidden_states float32", dispatch(put(0, lambda x: x.float())), invalid_input, "hidden_states",
         "dtype=torch.float32", "torch.bfloat16"),
    Case("dispatch hidden_states float16", dispatch(put(0, lambda x: x.half())), invalid_input, "hidden_states",
         "dtype=torch.float16", "torch.bfloat16"),
    Case("dispatch hidden_states on another device", dispatch(put(0, lambda x: x.to("meta"))), invalid_input,
         "hidden_states", "device=meta", "cpu"),
    Case("dispatch topk_ids float", dispatch(put(1, lambda i: i.float())), invalid_input, "topk_ids",
         "dtype=torch.float32", "torch.int32, torch.int64"),
    Case("dispatch topk_ids int16", dispatch(put(1, lambda i: i.to(torch.int16))), invalid_input, "topk_ids",
         "dtype=torch.int16", "torch.int32, torch.int64"),
    Case("dispatch topk_ids wrong top_k", dispatch(put(1, lambda i: i[:, :1])), invalid_input, "topk_ids",
         "shape=(6, 1)", "[6, 2]"),
    Case("dispatch topk_ids wrong token count", dispatch(put(1, lambda i: i[:3])), invalid_input, "topk_ids",
         "shape=(3, 2)", "[6, 2]"),
    Case("dispatch topk_ids on another device", dispatch(put(1, lambda i: i.to("meta"))), invalid_input, "topk_ids",
         "device=meta", "cpu"),
    Case("dispatch topk_weights bf16", dispatch(put(2, lambda w: w.bfloat16())), invalid_input, "topk_weights",
         "dtype=torch.bfloat16", "torch.float32"),
    Case("dispatch topk_weights transposed", dispatch(put(2, lambda w: w.t())), invalid_input, "topk_weights",
         "shape=(2, 6)", "[6, 2]"),
    Case("dispatch topk_weights on another device", dispatch(put(2, lambda w: w.to("meta"))), invalid_input,
         "topk_weights", "device=meta", "cpu"),
    Case("dispatch capacity exceeded", dispatch(lambda a: None, t=CAP + 1), md.CapacityError,
         "num_max_dispatch_tokens_per_rank", "=8", ">= 9"),
    Case("dispatch capacity exceeded (low latency)", dispatch(lambda a: None, "low_latency", t=CAP + 1),
         md.CapacityError, "num_max_dispatch_tokens_per_rank", "=8", ">= 9"),
    # Dispatcher.dispatch: values (check_inputs=True, the default)
    Case("dispatch topk_ids equal to num_experts", dispatch(poke(1, (4, 0), E)), invalid_input, "topk_ids", "=8",
         "-1 (no expert) or 0..7"),
    Case("dispatch topk_ids far out of range", dispatch(poke(1, (0, 1), 10**9)), invalid_input, "topk_ids",
         "1000000000", "-1 (no expert) or 0..7"),
    Case("dispatch topk_ids negative other than -1", dispatch(poke(1, (3, 1), -2)), invalid_input, "topk_ids", "=-2",
         "-1 (no expert) or 0..7"),
    Case("dispatch topk_ids duplicate expert", dispatch(duplicate_expert), invalid_input, "topk_ids", "token 2",
         "distinct expert ids per token"),
    Case("dispatch topk_weights NaN", dispatch(poke(2, (0, 1), math.nan)), invalid_input, "topk_weights", "nan",
         "finite"),
    Case("dispatch topk_weights Inf", dispatch(poke(2, (5, 0), math.inf)), invalid_input, "topk_weights", "inf",
         "finite"),
    Case("dispatch hidden_states NaN", dispatch(poke(0, (1, 7), math.nan)), invalid_input, "hidden_states", "nan",
         "finite"),
    Case("dispatch hidden_states -Inf (low latency)", dispatch(poke(0, (5, 255), -math.inf), "low_latency"),
         invalid_input, "hidden_states", "-inf", "finite"),
    # Dispatcher.combine
    Case("combine expert_output float32", combine(lambda r, o, d: (r.float(), o)), invalid_input, "expert_output",
         "dtype=torch.float32", "torch.bfloat16"),
    Case("combine expert_output one row short", combine(lambda r, o, d: (r[:-1], o)), invalid_input, "expert_output",
         "shape=(", "256]"),
    Case("combine expert_output wrong hidden size", combine(lambda r, o, d: (r[:, :128], o)), invalid_input,
         "expert_output", ", 128)", ", 256]"),
    Case("combine expert_output wrong capacity (low latency)", combine(lambda r, o, d: (r[:, :-1], o), "low_latency"),
         invalid_input, "expert_output", f"shape=({E}, {CAP - 1}, {H})", f"[{E}, {CAP}, {H}]"),
    Case("combine expert_output on another device", combine(lambda r, o, d: (r.to("meta"), o)), invalid_input,
         "expert_output", "device=meta", "cpu"),
    Case("combine expert_output not a tensor", combine(lambda r, o, d: (r.tolist(), o)),
         invalid_input, "expert_output", "[[", "torch.Tensor"),
    Case("combine dispatch_output not a DispatchOutput", combine(lambda r, o, d: (r, "not an output")),
         invalid_input, "dispatch_output", "'not an output'", "DispatchOutput"),
    Case("combine dispatch_output of another dispatcher", combine(_foreign_output), invalid_input, "dispatch_output",
         "another dispatcher", "a DispatchOutput returned by this dispatcher's dispatch"),
    Case("combine expert rows of another dispatch", combine(_other_dispatch_rows), invalid_input, "expert_output",
         "shape=(", "256]"),
    # forward
    Case("forward hidden_states NaN", forward(md.TorchExperts(), poke(0, (0, 0), math.nan)), invalid_input,
         "hidden_states", "nan", "finite"),
    Case("forward topk_ids out of range", forward(md.TorchExperts(), poke(1, (2, 1), 99)), invalid_input,
         "topk_ids", "=99", "-1 (no expert) or 0..7"),
    Case("forward expert kernel returns float32", forward(Float32Experts(), bad_rows=True), invalid_input,
         "expert_output", "dtype=torch.float32", "torch.bfloat16"),
    Case("forward expert kernel drops a row", forward(ShortExperts(), bad_rows=True), invalid_input,
         "expert_output", "shape=(", "256]"),
]


def _bits(t: torch.Tensor) -> tuple:
    """Everything that makes a tensor what it is, bit for bit (NaN compares equal to itself)."""
    if t.device.type == "meta":
        return (t.shape, t.dtype, t.stride(), t.storage_offset())
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).clone() if t.numel() else None
    return (t.shape, t.dtype, t.stride(), t.storage_offset(), raw)


def _same(a: tuple, b: tuple) -> bool:
    if a[:-1] != b[:-1] or len(a) != len(b):
        return False
    if len(a) == 4 or a[-1] is None or b[-1] is None:
        return a[-1] is b[-1] or a[-1] == b[-1]
    return torch.equal(a[-1], b[-1])


def test_the_matrix_is_large_and_names_are_unique():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_raises_a_typed_error_naming_the_parameter(case: Case):
    c = case.build()
    before = [_bits(t) for t in c.tensors]
    collectives = c.dispatcher.traffic.collectives if c.dispatcher is not None else 0
    with pytest.raises(md.MoEDispatchError) as info:
        c.run()
    exc = info.value
    assert type(exc) is case.error, f"{case.name}: {type(exc).__name__}: {exc}"
    assert exc.parameter == case.parameter, f"{case.name}: {exc}"
    message = str(exc)
    assert message.startswith(f"{case.parameter}="), message
    assert case.value in message, f"{case.name}: the value {case.value!r} is not in {message!r}"
    assert exc.allowed, f"{case.name}: no 'allowed' in {message!r}"
    assert case.allowed in exc.allowed, f"{case.name}: {case.allowed!r} is not in allowed={exc.allowed!r}"
    for i, (t, b) in enumerate(zip(c.tensors, before)):
        assert _same(_bits(t), b), f"{case.name}: input tensor {i} was modified"
    if c.dispatcher is not None:
        entered = c.dispatcher.traffic.collectives - collectives
        assert entered == c.collectives_allowed, f"{case.name}: entered {entered} collectives before raising"


def test_value_checks_off_still_checks_metadata_and_capacity():
    """``check_inputs=False`` skips the data-reading checks only."""
    d = md.create_dispatcher("torch", spec(H, E, K, num_max_dispatch_tokens_per_rank=CAP, output_dtype="bf16"),
                             env={}, check_inputs=False)
    x, ids, w = inputs()
    w = w.clone()
    w[0, 0] = math.nan
    d.dispatch(x, ids, w)  # a NaN weight passes unchecked
    for bad, parameter in [((x.float(), ids, w), "hidden_states"), ((x, ids.float(), w), "topk_ids"),
                           ((x, ids, w.to("meta")), "topk_weights")]:
        with pytest.raises(md.InvalidInputError) as info:
            d.dispatch(*bad)
        assert info.value.parameter == parameter
    with pytest.raises(md.CapacityError):
        d.dispatch(*inputs(CAP + 1))


def test_good_inputs_pass_in_every_layout_and_dtype():
    """The fast path accepts what the slow diagnosis accepts: int32 ids, -1 everywhere,
    empty batches, non-contiguous views, every wire dtype and both modes."""
    for mode in ("normal", "low_latency"):
        for dtype, kw in [("bf16", {}), ("fp8", {}), ("int8", {}),
                          ("nvfp4", {"quant": hints(input_global_scale=GLOBAL_SCALE)})]:
            d = make(mode, dtype, **kw)
            for t in (0, 1, T, CAP):
                x, ids, w = inputs(t)
                for args in ((x, ids, w), (x, ids.to(torch.int32), w), (x, torch.full_like(ids, -1), w)):
                    out = d.dispatch(*args)
                    rows = torch.zeros(out.hidden_states.shape[:-1] + (H,), dtype=torch.bfloat16)
                    assert d.combine(rows, out).shape == (t, H)
            wide = torch.randn(T, 2 * H).to(torch.bfloat16)[:, ::2]  # a strided view
            ids, w = random_routing(T, E, K, generator=torch.Generator().manual_seed(0))
            out = d.dispatch(wide, ids, w)
            d.combine(torch.zeros(out.hidden_states.shape[:-1] + (H,), dtype=torch.bfloat16), out)


# -- several ranks ----------------------------------------------------------------------------


def bad_input_on_rank_one(rank: int, world: int) -> list[tuple[str, Any, int]]:
    """Every rank creates the dispatcher; only rank 1 calls dispatch, with bad inputs. Rank 1
    reports each error and the collectives it had entered when it was raised; the other ranks
    never call dispatch, so nothing waits on rank 1."""
    d = md.create_dispatcher("torch", spec(H, 2 * world, K, num_max_dispatch_tokens_per_rank=CAP,
                                           output_dtype="fp8"), env={})
    if rank != 1:
        return []
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, 2 * world, K, generator=g)
    out_of_range = ids.clone()
    out_of_range[0, 0] = 2 * world
    nan_x = x.clone()
    nan_x[1, 1] = math.nan
    seen = []
    for name, args in [("ids out of range", (x, out_of_range, w)), ("NaN activations", (nan_x, ids, w)),
                       ("fp32 activations", (x.float(), ids, w)), ("over capacity", (x.repeat(2, 1),
                                                                                        ids.repeat(2, 1),
                                                                                        w.repeat(2, 1)))]:
        try:
            d.dispatch(*args)
        except md.MoEDispatchError as exc:
            seen.append((name, exc, d.traffic.collectives))
        else:
            seen.append((name, None, d.traffic.collectives))
    return seen


def create_with_indivisible_experts(rank: int, world: int) -> md.MoEDispatchError | None:
    try:
        md.create_dispatcher("torch", spec(H, 2 * world + 1, K), env={})
    except md.MoEDispatchError as exc:
        return exc
    return None


def test_bad_input_on_one_rank_raises_there_before_any_collective(moe_rank_pools):
    results = moe_rank_pools.get(2).map(bad_input_on_rank_one)
    assert results[0] == []
    expected = {"ids out of range": (md.InvalidInputError, "topk_ids"),
                "NaN activations": (md.InvalidInputError, "hidden_states"),
                "fp32 activations": (md.InvalidInputError, "hidden_states"),
                "over capacity": (md.CapacityError, "num_max_dispatch_tokens_per_rank")}
    assert [name for name, _, _ in results[1]] == list(expected)
    for name, exc, collectives in results[1]:
        error, parameter = expected[name]
        assert type(exc) is error, (name, exc)
        assert exc.parameter == parameter, (name, exc)
        assert collectives == 0, (name, collectives)


def test_experts_not_divisible_by_ranks_fails_at_creation_on_every_rank(moe_rank_pools):
    for exc in moe_rank_pools.get(2).map(create_with_indivisible_experts):
        assert type(exc) is md.InvalidSpecError
        assert exc.parameter == "num_experts"
        assert exc.value == 5
        assert "a multiple of the world size (2)" in str(exc)
