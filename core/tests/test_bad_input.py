"""Every bad input is a typed MoEDispatchError naming the parameter, before data is touched."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_dispatch as md
from moe_dispatch._checks import runs_value_checks
from moe_dispatch_testing.routing import random_routing

H, E, K, T = 256, 8, 2, 6


def make(mode="normal", dtype="fp8", **kw):
    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=8, mode=mode, output_dtype=dtype, **kw)
    return md.create_dispatcher("torch", spec, env={})


def inputs(t=T):
    g = torch.Generator().manual_seed(1)
    ids, w = random_routing(t, E, K, generator=g)
    return torch.randn(t, H, generator=g).to(torch.bfloat16), ids, w


def _with(i, value):
    def build():
        args = list(inputs())
        args[i] = value(args[i])
        return args
    return build


def _nan_weight(w):
    w = w.clone()
    w[0, 0] = float("nan")
    return w


def _inf_x(x):
    x = x.clone()
    x[1, 3] = float("inf")
    return x


def _dup(ids):
    ids = ids.clone()
    ids[2, 1] = ids[2, 0]
    return ids


DISPATCH_CASES = {
    "x not a tensor": (_with(0, lambda x: x.tolist()), "hidden_states"),
    "x 1-D": (_with(0, lambda x: x[0]), "hidden_states"),
    "x wrong hidden": (_with(0, lambda x: x[:, :128]), "hidden_states"),
    "x float32": (_with(0, lambda x: x.float()), "hidden_states"),
    "x float16": (_with(0, lambda x: x.half()), "hidden_states"),
    "x NaN": (_with(0, lambda x: x.clone().fill_(float("nan"))), "hidden_states"),
    "x Inf": (_with(0, _inf_x), "hidden_states"),
    "x on meta device": (_with(0, lambda x: x.to("meta")), "hidden_states"),
    "ids float": (_with(1, lambda i: i.float()), "topk_ids"),
    "ids int16": (_with(1, lambda i: i.to(torch.int16)), "topk_ids"),
    "ids wrong k": (_with(1, lambda i: i[:, :1]), "topk_ids"),
    "ids wrong tokens": (_with(1, lambda i: i[:3]), "topk_ids"),
    "ids out of range": (_with(1, lambda i: torch.full_like(i, E)), "topk_ids"),
    "ids -2": (_with(1, lambda i: torch.full_like(i, -2)), "topk_ids"),
    "ids duplicate expert": (_with(1, _dup), "topk_ids"),
    "weights bf16": (_with(2, lambda w: w.bfloat16()), "topk_weights"),
    "weights wrong shape": (_with(2, lambda w: w.t()), "topk_weights"),
    "weights NaN": (_with(2, _nan_weight), "topk_weights"),
    "weights Inf": (_with(2, lambda w: w / 0), "topk_weights"),
}


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
def test_bad_dispatch_input_is_a_typed_error_and_touches_nothing(case, mode):
    build, parameter = DISPATCH_CASES[case]
    args = build()
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in args]
    d = make(mode)
    with pytest.raises(md.InvalidInputError) as info:
        d.dispatch(*args)
    assert info.value.parameter == parameter
    for a, b in zip(args, before):
        if isinstance(b, torch.Tensor) and b.device.type != "meta":
            assert torch.equal(a, b) or (a.isnan().any() and torch.equal(a.isnan(), b.isnan()))
    assert d.traffic.collectives == 0


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_capacity_exceeded_names_the_flag(mode):
    with pytest.raises(md.CapacityError, match="--num-max-dispatch-tokens-per-rank") as info:
        make(mode).dispatch(*inputs(9))
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank"


def test_combine_rejects_wrong_expert_output_and_foreign_dispatch_output():
    d, other = make(), make()
    out = d.dispatch(*inputs())
    good = torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16)
    for bad, parameter in [
        (good.float(), "expert_output"),
        (good[:-1] if good.shape[0] else good.new_zeros(1, H), "expert_output"),
        (good[:, :128], "expert_output"),
    ]:
        with pytest.raises(md.InvalidInputError) as info:
            d.combine(bad, out)
        assert info.value.parameter == parameter
    with pytest.raises(md.InvalidInputError, match="another dispatcher") as info:
        other.combine(good, out)
    with pytest.raises(md.InvalidInputError):
        d.combine(good, "not an output")
    assert d.combine(good, out).shape == (T, H)


@pytest.mark.parametrize(
    "build,error,parameter",
    [
        (lambda: make(dtype="nvfp4"), md.InvalidSpecError, "quant.input_global_scale"),
        (lambda: make(dtype="nvfp4", quant=md.QuantHints(input_global_scale=-1.0)), md.InvalidSpecError, "quant.input_global_scale"),
        (lambda: md.create_dispatcher("torch", md.DispatchSpec(200, E, K, output_dtype="fp8"), env={}), md.InvalidSpecError, "hidden_size"),
        (lambda: md.create_dispatcher("torch", md.DispatchSpec(H, E, 9), env={}), md.InvalidSpecError, "top_k"),
        (lambda: md.create_dispatcher("no-such-backend", md.DispatchSpec(H, E, K)), md.BackendUnavailableError, "backend"),
    ],
)
def test_bad_configuration_fails_at_creation(build, error, parameter):
    with pytest.raises(error) as info:
        build()
    assert info.value.parameter == parameter


def test_minus_one_ids_and_empty_batches_work():
    d = make("low_latency", dtype="bf16")
    x, ids, w = inputs()
    ids[:] = -1
    out = d.dispatch(x, ids, w)
    assert int(out.expert_counts().sum()) == 0
    y = torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16)
    assert torch.equal(d.combine(y, out), torch.zeros(T, H, dtype=torch.bfloat16))
    empty = make().dispatch(*inputs(0))
    assert empty.hidden_states.shape == (0, H)


def test_value_checks_can_be_switched_off():
    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=8, output_dtype="bf16")
    d = md.create_dispatcher("torch", spec, env={}, check_inputs=False)
    x, ids, w = inputs()
    w[0, 0] = float("nan")
    d.dispatch(x, ids, w)  # no value check: shapes are still checked
    with pytest.raises(md.InvalidInputError):
        d.dispatch(x.float(), ids, w)


def test_os_environ_is_identical_before_and_after():
    before = dict(os.environ)
    for dtype in ("bf16", "fp8", "int8"):
        d = make(dtype=dtype)
        out = d.dispatch(*inputs())
        d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16), out)
    assert dict(os.environ) == before


def test_value_checks_stand_aside_while_a_cuda_graph_is_captured(monkeypatch):
    """A capture forbids host syncs, and the value checks read a flag back: while the current
    stream captures they do not run (the metadata checks still do). Meta tensors stand for
    device tensors here: reading a flag off them raises, so a check that ran would show."""
    import torch

    from moe_dispatch import _checks as validation

    spec = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=4, output_dtype="bf16")
    x = torch.empty(4, 128, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(4, 2, dtype=torch.int64, device="meta")
    w = torch.empty(4, 2, dtype=torch.float32, device="meta")
    with pytest.raises(RuntimeError, match="meta"):  # not capturing: the flag is read back (a meta tensor cannot)
        validation.check_dispatch_values(spec, x, ids, w)
    monkeypatch.setattr(validation, "capturing", lambda t: True)
    validation.check_dispatch_values(spec, x, ids, w)  # capturing: no read, no error


def test_check_inputs_true_stands_aside_while_a_cuda_graph_is_captured(monkeypatch):
    """``check_inputs=True`` also drives the output checks, whose read-back of the counts aborted
    a capture on an H100 (check_core.py, docs/evidence/hardware-runs.md): while capturing, no value check
    of either side runs; before and after, they do."""
    import torch

    from moe_dispatch import _checks as validation_module

    spec = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=4, output_dtype="bf16")
    d = md.create_dispatcher("torch", spec, env={}, check_inputs=True)
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    assert runs_value_checks(d.check_inputs, x)
    monkeypatch.setattr(validation_module, "capturing", lambda t: True)
    assert not runs_value_checks(d.check_inputs, x)


_DTYPES = [torch.bfloat16, torch.float32, torch.int32, torch.int64]


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 6), hidden=st.sampled_from([128, 64]), k=st.sampled_from([1, 2, 3]),
       dtypes=st.tuples(*[st.sampled_from(_DTYPES)] * 3), meta=st.tuples(*[st.booleans()] * 3),
       not_tensor=st.sampled_from([None, 0, 1, 2]), combine_rows=st.integers(0, 6))
def test_the_hot_path_refuses_exactly_what_the_diagnosis_names(tokens, hidden, k, dtypes, meta, not_tensor,
                                                                combine_rows):
    """Each check is one rule serving both paths: the one-expression hot path passes an input exactly when the
    rule-by-rule diagnosis finds nothing wrong (a rule the hot path skips must be implied by the others)."""
    from moe_dispatch._checks import InputChecks

    spec = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=4).with_dtype(md.DispatchDtype.BF16)
    checks = InputChecks(spec, torch.device("cpu"), None)
    args = [torch.zeros(tokens, hidden if i == 0 else k, dtype=dt, device="meta" if m else "cpu")
            for i, (dt, m) in enumerate(zip(dtypes, meta))]
    if not_tensor is not None:
        args[not_tensor] = [[0.0] * k] * tokens
    for rules, values in ((checks._dispatch, args),
                          (checks._combine, (args[0], md.DispatchOutput(
                              torch.zeros(combine_rows, 128, dtype=torch.bfloat16), None, args[1], args[2],
                              torch.zeros(4, dtype=torch.int64), 1, md.Layout.PACKED, md.DispatchDtype.BF16, None)))):
        try:
            fast = bool(rules.all(*values))
        except Exception:  # noqa: BLE001
            fast = False
        try:
            rules.diagnose(*values)
            named = None
        except md.MoEDispatchError as exc:
            named = exc
        assert fast == (named is None), (fast, named)
