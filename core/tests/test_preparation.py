"""One preparation (``moe_dispatch.preparation.prepare_layer``) behind ``create_dispatcher``,
``plan_buffers`` and ``moe-dispatch explain``: they refuse exactly the same specs, with the same
typed error, and agree on the wire dtype and the buffers of the others."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch.cli import explain

MIB = 1 << 20


class LimitedBackend(TorchBackend):
    """The torch reference with what real backends have: a buffer ceiling and no UE8M0 scales."""

    name = "limited"
    capabilities = dataclasses.replace(
        TorchBackend.capabilities, fp8_ue8m0=False,
        limits={m: mdb.Limits(max_buffer_bytes=4 * MIB, max_top_k=8) for m in md.Mode})


HOST = md.PluginHost(env={})
BACKENDS = (TorchBackend(), LimitedBackend())


def _outcome(fn):
    try:
        return fn()
    except md.MoEDispatchError as exc:
        return type(exc).__name__, exc.parameter


@st.composite
def specs(draw):
    kwargs = dict(
        hidden_size=draw(st.sampled_from([128, 256, 2048, 7168, 100])),
        num_experts=draw(st.sampled_from([4, 8, 64])),
        top_k=draw(st.sampled_from([1, 2, 8, 9])),
        num_max_dispatch_tokens_per_rank=draw(st.sampled_from([1, 16, 256, 4096])),
        mode=draw(st.sampled_from(["normal", "low_latency"])),
        output_dtype=draw(st.sampled_from([None, "bf16", "fp8", "int8", "nvfp4"])),
        runner=draw(st.sampled_from([None, "torch", "no_such_runner"])),
        quant=md.QuantHints(fp8_ue8m0_scales=draw(st.booleans())),
    )
    try:
        return md.DispatchSpec(**kwargs)
    except md.MoEDispatchError:
        return None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), backend=st.sampled_from(BACKENDS))
def test_explain_refuses_exactly_what_create_dispatcher_refuses(spec, backend):
    if spec is None:
        return

    def create():
        d = md.create_dispatcher(backend, spec, host=HOST, env={}, strict=False)
        return d.resolution.dtype, d.buffer_size

    def explained():
        layer = explain(spec, backend, 1, host=HOST, env={})
        return layer.resolution.dtype, layer.buffer_size

    with warnings.catch_warnings():  # create_dispatcher warns of a fallback; explain keeps it on the trail
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        assert _outcome(explained) == _outcome(create)


def test_the_limited_backend_refuses_each_way():
    """The property above meets every refusal the preparation makes (each would be missed alike)."""
    limited = LimitedBackend()
    big = md.DispatchSpec(7168, 64, 8, num_max_dispatch_tokens_per_rank=4096, output_dtype="bf16")
    ue8m0 = md.DispatchSpec(2048, 64, 8, output_dtype="fp8", quant=md.QuantHints(fp8_ue8m0_scales=True))
    top_k = md.DispatchSpec(2048, 64, 9, output_dtype="bf16")
    expected = [("CapacityError", "num_max_dispatch_tokens_per_rank"), ("InvalidSpecError", "quant.fp8_ue8m0_scales"),
                ("InvalidSpecError", "top_k")]
    assert [_outcome(lambda s=s: explain(s, limited, 1, host=HOST, env={})) for s in (big, ue8m0, top_k)] == expected
    assert [_outcome(lambda s=s: md.create_dispatcher(limited, s, host=HOST, env={}))
            for s in (big, ue8m0, top_k)] == expected


def test_plan_buffers_reports_the_limit_create_dispatcher_refuses():
    limited = LimitedBackend()
    big = md.DispatchSpec(7168, 64, 8, num_max_dispatch_tokens_per_rank=4096, output_dtype="bf16")
    plan = mdp.plan_buffers(limited, {"layer": big}, world_size=1, env={}, host=HOST)
    assert [m.parameter for m in plan.misfits] == ["num_max_dispatch_tokens_per_rank"]
    with pytest.raises(md.CapacityError):
        md.create_dispatcher(limited, big, host=HOST, env={})


def test_resolve_output_dtype_takes_a_name_or_a_backend():
    spec = md.DispatchSpec(2048, 64, 8, output_dtype="int8")
    by_name = mdp.resolve_output_dtype(spec, "torch", env={}, host=HOST)
    by_object = mdp.resolve_output_dtype(spec, TorchBackend(), env={}, runners=HOST.runners())
    assert by_name == by_object and by_name.dtype is md.DispatchDtype.INT8
    with pytest.raises(md.InvalidSpecError) as info:
        mdp.resolve_output_dtype(dataclasses.replace(spec, runner="torch"), TorchBackend(), env={}, runners={})
    assert info.value.parameter == "runner"  # the caller's runners, none here: not a global registry's
