"""Every field of ``DispatchSpec`` and ``QuantHints`` refuses a value of the wrong kind (a tensor, a float, a torch
dtype, a list, a tensor on another device, a numpy bool, ...) with an ``InvalidSpecError`` naming the field, never
another exception. The fields come from ``dataclasses.fields``: a new field fails here until it has its strategy."""

from __future__ import annotations

import dataclasses
import fractions

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_dispatch as md

VALID = {"hidden_size": 128, "num_experts": 8, "top_k": 2}
_TINY, _MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _tensor(value: int, dtype: torch.dtype, shape: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=device)  # "meta": a device whose values cannot be read


TENSORS = st.builds(_tensor, st.sampled_from([0, 1, 2, 128, -1]),
                    st.sampled_from([torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16,
                                     torch.float16, torch.complex64]),
                    st.sampled_from([(), (1,), (2,)]), st.sampled_from(["cpu", "meta"]))
NUMPY = st.one_of(st.booleans().map(np.bool_), st.floats(width=32).map(np.float32),
                  st.lists(st.integers(0, 9), min_size=1, max_size=3).map(np.array), st.text(max_size=3).map(np.array))
# Kinds no field takes.
ANYTHING_ELSE = st.one_of(
    st.complex_numbers(), st.binary(max_size=3), st.lists(st.integers(), max_size=3),
    st.tuples(st.integers()), st.dictionaries(st.integers(), st.integers(), max_size=2),
    st.sampled_from([torch.float16, torch.bfloat16, torch.int8, torch.device("cpu"), int, float, str, md.Mode,
                     md.DispatchDtype]),
    st.builds(object), st.decimals(allow_nan=False))
NOT_AN_INT = st.one_of(st.floats(), st.booleans(), st.text(max_size=4), st.none(), TENSORS, NUMPY, ANYTHING_ELSE,
                       st.fractions().filter(lambda f: f.denominator != 1))
NOT_A_POSITIVE_INT = st.one_of(NOT_AN_INT, st.integers(max_value=0))


def _not_named(kind: type, *extra: str) -> st.SearchStrategy[str]:
    names = {m.value for m in kind} | set(extra)
    return st.text(max_size=8).filter(lambda t: t.strip().lower().replace("-", "_") not in names)


OTHER_ENUMS = st.sampled_from([md.Mode.NORMAL, md.DispatchDtype.BF16, md.Layout.PACKED])  # str enums, other kinds
NOT_A_DTYPE = st.one_of(_not_named(md.DispatchDtype, "auto"), st.integers(), st.floats(), st.booleans(), TENSORS,
                        NUMPY, ANYTHING_ELSE, OTHER_ENUMS.filter(lambda e: not isinstance(e, md.DispatchDtype)))

HINTS = [f.name for f in dataclasses.fields(md.QuantHints)]
WRONG_SCALE = st.one_of(
    st.floats().filter(lambda f: not _TINY <= f <= _MAX), st.integers(max_value=0), st.just(10**400),
    st.text(max_size=4), st.booleans(), st.sampled_from([np.bool_(True), np.array([1, 2]), np.array(["a"])]),
    TENSORS.filter(lambda t: not (t.device.type == "cpu" and t.is_floating_point() and t.numel() == 1
                                  and float(t) > 0)),
    ANYTHING_ELSE)

WRONG: dict[type, dict[str, st.SearchStrategy]] = {
    md.DispatchSpec: {
        "hidden_size": NOT_A_POSITIVE_INT,
        "num_experts": NOT_A_POSITIVE_INT,
        "top_k": NOT_A_POSITIVE_INT,
        "num_max_dispatch_tokens_per_rank": NOT_A_POSITIVE_INT,
        "mode": st.one_of(_not_named(md.Mode), st.none(), st.integers(), st.floats(), TENSORS, NUMPY, ANYTHING_ELSE,
                          OTHER_ENUMS.filter(lambda e: not isinstance(e, md.Mode))),
        "output_dtype": NOT_A_DTYPE,
        "quant": st.one_of(st.integers(), st.text(max_size=4), st.none(), TENSORS, st.lists(st.integers()),
                           st.builds(object),
                           st.dictionaries(st.text(max_size=6), st.integers(), min_size=1).filter(
                               lambda d: not set(d) <= set(HINTS)),
                           st.sampled_from(HINTS).map(lambda k: {k: ["a list"]})),
        "runner": st.one_of(st.just(""), st.integers(), st.floats(), st.booleans(), TENSORS, NUMPY, ANYTHING_ELSE),
        "group_list_type": st.one_of(NOT_AN_INT, st.integers().filter(lambda i: i not in (0, 1))),
        "expert_alignment": st.one_of(NOT_AN_INT, st.integers().filter(lambda i: not 1 <= i <= 1024)),
        "layout": st.one_of(_not_named(md.Layout), st.integers(), st.floats(), TENSORS, ANYTHING_ELSE,
                            OTHER_ENUMS.filter(lambda e: not isinstance(e, md.Layout))),
    },
    md.QuantHints: {
        "dispatcher_output_dtype": NOT_A_DTYPE,
        "input_global_scale": WRONG_SCALE,
        "fp8_ue8m0_scales": st.one_of(st.integers(), st.floats(), st.text(max_size=4), st.none(), TENSORS, NUMPY,
                                      ANYTHING_ELSE),
    },
}
FIELDS = [(cls, f.name) for cls in WRONG for f in dataclasses.fields(cls)]


def _build(cls: type, name: str, value: object) -> object:
    return md.DispatchSpec(**{**VALID, name: value}) if cls is md.DispatchSpec else md.QuantHints(**{name: value})


@pytest.mark.parametrize("cls,name", FIELDS, ids=[f"{c.__name__}.{n}" for c, n in FIELDS])
@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data())
def test_a_value_of_the_wrong_kind_is_an_invalid_spec_error_naming_the_field(cls, name, data):
    assert name in WRONG[cls], f"{cls.__name__}.{name} has no strategy of wrong values here: add one"
    value = data.draw(WRONG[cls][name], label=name)
    with pytest.raises(md.InvalidSpecError) as info:  # any other exception fails the test
        _build(cls, name, value)
    parameter = info.value.parameter
    if cls is md.QuantHints:
        assert parameter == f"quant.{name}"
    elif name == "quant":
        assert parameter == "quant" or parameter.startswith("quant.")
    else:
        assert parameter == name


def test_the_kinds_a_field_takes_are_stored_as_plain_values():
    """numpy integers, names in any case, a one-element float tensor or array: the spec holds Python ints, enums and
    floats, so ranks whose engines pass different kinds agree on one fingerprint."""
    odd = md.DispatchSpec(hidden_size=np.int64(128), num_experts=np.int32(8), top_k=np.uint8(2),
                          num_max_dispatch_tokens_per_rank=np.int16(64), mode=" Low-Latency", output_dtype="BF16",
                          group_list_type=np.int64(0), expert_alignment=np.int8(8),
                          quant={"dispatcher_output_dtype": "INT8", "input_global_scale": torch.tensor([2.0])})
    plain = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=64, mode=md.Mode.LOW_LATENCY,
                            output_dtype=md.DispatchDtype.BF16, group_list_type=0, expert_alignment=8,
                            quant=md.QuantHints(md.DispatchDtype.INT8, 2.0))
    assert odd == plain and odd.to_dict() == plain.to_dict()
    assert all(type(getattr(odd, f)) is int for f in ("hidden_size", "num_experts", "top_k",
                                                      "num_max_dispatch_tokens_per_rank", "group_list_type",
                                                      "expert_alignment"))
    for scale in (np.float32(2.0), np.array([2.0]), torch.tensor(2.0, dtype=torch.bfloat16), 2, fractions.Fraction(2)):
        assert md.QuantHints(input_global_scale=scale).input_global_scale == 2.0
