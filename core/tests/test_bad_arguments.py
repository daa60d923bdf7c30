"""Arguments that cannot work are typed errors at creation, not accepted silently nor an untyped error later (an
allocator error at the first dispatch, ``AttributeError``, ``OverflowError``, or NVFP4 rows of all zeros or NaN)."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.local import RankPool

SPEC = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=8)


@pytest.mark.parametrize("timeout_s", [True, 10**400, float("nan"), float("inf"), 0, -1, "30", None])
def test_a_bad_timeout_is_refused_by_name(timeout_s):
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher("torch", SPEC, env={}, timeout_s=timeout_s)
    assert info.value.parameter == "timeout_s"


@pytest.mark.parametrize("group_list_type", [True, False, 2, "1"])
def test_group_list_type_must_be_the_int_0_or_1(group_list_type):
    with pytest.raises(md.InvalidSpecError) as info:
        md.DispatchSpec(128, 8, 2, group_list_type=group_list_type)
    assert info.value.parameter == "group_list_type"


@pytest.mark.parametrize("spec", [None, {"hidden_size": 128}, 3])
def test_spec_must_be_a_dispatch_spec(spec):
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher("torch", spec, env={})
    assert info.value.parameter == "spec"


@pytest.mark.parametrize("name", ["env", "options"])
def test_env_and_options_must_be_mappings(name):
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher("torch", SPEC, **{"env": {}, name: ["MOE_DISPATCH_OUTPUT_DTYPE=bf16"]})
    assert info.value.parameter == name


@pytest.mark.parametrize("scale", [1e39, 1e-320, 10**400])
def test_an_nvfp4_global_scale_outside_float32_is_refused(scale):
    with pytest.raises(md.InvalidSpecError) as info:
        md.QuantHints(input_global_scale=scale)
    assert info.value.parameter == "quant.input_global_scale"


def test_the_largest_and_smallest_accepted_nvfp4_scales_give_finite_rows():
    for scale in (torch.finfo(torch.float32).tiny * 4, 1e6, 1e-6):
        spec = md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=8, output_dtype="nvfp4",
                               quant=md.QuantHints(input_global_scale=scale))
        d = md.create_dispatcher("torch", spec, env={})
        x = torch.randn(4, 128).to(torch.bfloat16)
        out = d.dispatch(x, torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5))
        assert torch.isfinite(out.hidden_states_scale.float()).all()


def test_a_capacity_whose_buffers_exceed_the_machine_is_refused_at_creation():
    spec = md.DispatchSpec(7168, 8, 2, num_max_dispatch_tokens_per_rank=2**25, mode="low_latency")
    with pytest.raises(md.CapacityError) as info:
        md.create_dispatcher("torch", spec, env={})
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank" and "whole memory" in str(info.value)


def _bad_timeout_on_rank_1(rank: int, world: int):
    try:
        md.create_dispatcher("torch", SPEC, env={}, timeout_s=True if rank == 1 else 20.0)
    except md.MoEDispatchError as exc:
        return type(exc).__name__
    return None


def test_a_bad_argument_on_one_rank_reaches_the_peers():
    with RankPool(2) as pool:
        assert pool.map(_bad_timeout_on_rank_1) == ["PeerFailedError", "InvalidSpecError"]
