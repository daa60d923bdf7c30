"""The core checks what a backend returns: a plugin's bug is a ``PluginError``
naming the backend at the call that produced it, never an ``AttributeError`` or a wrong shape
reaching the engine. Metadata always; the counts against the rows with ``check_inputs``."""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch._reference.exchange import ReferenceDispatcher
from moe_dispatch_testing.routing import random_routing

H, E, K = 128, 4, 2


class _Mangled(ReferenceDispatcher):
    def __init__(self, ctx, mangle_out: Callable | None, mangle_y: Callable | None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(ctx, send_to_all_ranks=False)
        self.mangle_out, self.mangle_y = mangle_out, mangle_y

    def dispatch(self, x, ids, w):  # type: ignore[no-untyped-def]
        out = super().dispatch(x, ids, w)
        return self.mangle_out(out) if self.mangle_out else out

    def combine(self, y, out):  # type: ignore[no-untyped-def]
        result = super().combine(y, out)
        return self.mangle_y(result) if self.mangle_y else result


class _Buggy(TorchBackend):
    name = "buggy"

    def __init__(self, mangle_out=None, mangle_y=None, create_returns=...) -> None:  # type: ignore[no-untyped-def]
        self.mangle_out, self.mangle_y, self.create_returns = mangle_out, mangle_y, create_returns

    def create(self, ctx):  # type: ignore[no-untyped-def]
        if self.create_returns is not ...:
            return self.create_returns
        return _Mangled(ctx, self.mangle_out, self.mangle_y)


def _run(backend: mdb.Backend, mode: str = "normal", check_inputs: bool = True) -> torch.Tensor:
    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=8, mode=mode, output_dtype="bf16")
    d = md.create_dispatcher(backend, spec, env={}, check_inputs=check_inputs)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(5, E, K, generator=g)
    out = d.dispatch(x, ids, w)
    y = torch.ones(*out.hidden_states.shape[:-1], H, dtype=torch.bfloat16)
    return d.combine(y, out)


def _replace(**fields):  # type: ignore[no-untyped-def]
    return lambda out: dataclasses.replace(out, **{k: v(out) for k, v in fields.items()})


BROKEN_DISPATCH = {
    "not an output": (lambda out: out.hidden_states, "dispatch()"),
    "None": (lambda out: None, "dispatch()"),
    "wrong dtype": (_replace(hidden_states=lambda o: o.hidden_states.float()), "hidden_states"),
    "wrong width": (_replace(hidden_states=lambda o: o.hidden_states[:, :-1]), "hidden_states"),
    "group_list too short": (_replace(group_list=lambda o: o.group_list[:-1]), "group_list"),
    "float group_list": (_replace(group_list=lambda o: o.group_list.float()), "group_list"),
    "rows missing": (_replace(hidden_states=lambda o: o.hidden_states[:-1]), "group_list"),
    "negative count": (_replace(group_list=lambda o: o.group_list - 1), "group_list"),
    "masked rows in packed shape": (_replace(layout=lambda o: md.Layout.MASKED), "layout"),
}


@pytest.mark.parametrize("case", list(BROKEN_DISPATCH))
def test_a_dispatch_output_that_breaks_the_contract_is_a_plugin_error_naming_the_backend(case):
    mangle, parameter = BROKEN_DISPATCH[case]
    with pytest.raises(md.PluginError, match="backend 'buggy' broke the contract") as info:
        _run(_Buggy(mangle_out=mangle))
    assert info.value.parameter == parameter


@pytest.mark.parametrize("mangle", [lambda y: y[:-1], lambda y: y.float(), lambda y: y[:, :-1], lambda y: None],
                         ids=["one token short", "fp32", "narrow", "None"])
def test_a_combine_result_that_breaks_the_contract_is_a_plugin_error(mangle):
    with pytest.raises(md.PluginError, match="backend 'buggy' broke the contract: its result") as info:
        _run(_Buggy(mangle_y=mangle))
    assert info.value.parameter == "combine()"


@pytest.mark.parametrize("returned", [None, 3, object()])
def test_create_returning_something_else_is_a_plugin_error(returned):
    with pytest.raises(md.PluginError, match="create\\(\\) returned this"):
        _run(_Buggy(create_returns=returned))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_the_builtin_backends_pass_their_own_output_checks(mode):
    for backend in ("torch", "allgather"):
        spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=8, mode=mode, output_dtype="bf16")
        d = md.create_dispatcher(backend, spec, env={})
        x = torch.randn(5, H).to(torch.bfloat16)
        ids, w = random_routing(5, E, K)
        out = d.dispatch(x, ids, w)
        assert out.call == 1
        assert d.combine(torch.ones(*out.hidden_states.shape[:-1], H, dtype=torch.bfloat16), out).shape == (5, H)


def test_packed_rows_past_the_segments_are_a_plugin_error_in_normal_mode_and_the_worst_case_in_low_latency():
    """A backend that makes no host sync sizes low-latency PACKED rows for the worst case (DeepEP V2 without
    ``do_cpu_sync``): rows past the experts' segments are allowed where it declares so
    (``Capabilities.worst_case_rows``), and only there."""
    from moe_dispatch._checks import OutputChecks

    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=8, output_dtype="bf16")
    d = md.create_dispatcher("torch", spec, env={})
    x = torch.randn(5, H).to(torch.bfloat16)
    out = d.dispatch(x, *random_routing(5, E, K))
    longer = dataclasses.replace(out, hidden_states=torch.cat([out.hidden_states, torch.full((3, H), float("nan"),
                                                                                             dtype=torch.bfloat16)]))
    low_latency = dataclasses.replace(spec, mode=md.Mode.LOW_LATENCY)
    OutputChecks("worst", low_latency, 1, worst_case=True).dispatch(longer, check_values=True)
    for exact in (OutputChecks("exact", spec, 1), OutputChecks("masked", low_latency, 1)):  # undeclared: exact rows
        with pytest.raises(md.PluginError, match="group_list"):
            exact.dispatch(longer, check_values=True)
    short = dataclasses.replace(out, hidden_states=out.hidden_states[:-1])
    with pytest.raises(md.PluginError, match="group_list"):
        OutputChecks("worst", low_latency, 1, worst_case=True).dispatch(short, check_values=True)


@pytest.mark.parametrize("mode,masked", [("low_latency", frozenset()), ("normal", frozenset(md.Mode))],
                         ids=["masked where packed is declared", "packed where masked is declared"])
def test_an_output_in_another_layout_than_declared_is_a_plugin_error(mode, masked):
    backend = _Buggy()
    backend.capabilities = dataclasses.replace(TorchBackend.capabilities, masked_modes=masked)
    with pytest.raises(md.PluginError, match="backend 'buggy' broke the contract: .*Capabilities.masked_modes") as info:
        _run(backend, mode)
    assert info.value.parameter == "layout"


def test_masked_rows_are_never_aligned_and_explain_says_so(capsys):
    """The torch backend's low-latency rows are MASKED: ``expert_alignment`` does not apply to them, so neither the
    dispatcher nor ``explain`` may say that the core copies them."""
    from moe_dispatch.cli import main

    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=8, mode="low_latency", output_dtype="bf16",
                           expert_alignment=128)
    d = md.create_dispatcher("torch", spec, env={})
    assert (d.alignment.alignment, d.alignment.copies) == (1, False)
    assert "MASKED rows" in d.alignment.note and "does not apply" in d.alignment.note
    out = d.dispatch(torch.randn(5, H).to(torch.bfloat16), *random_routing(5, E, K))
    assert out.layout is md.Layout.MASKED and out.expert_alignment == 1
    assert main(["explain", "--backend", "torch", "--mode", "low_latency", "--expert-alignment", "128"]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("expert rows:"))
    assert "MASKED rows" in line and "copies" not in line
    packed = md.create_dispatcher("torch", dataclasses.replace(spec, mode=md.Mode.NORMAL), env={})
    assert packed.alignment.copies and "copies" in packed.alignment.note  # PACKED rows still get the core's copy
