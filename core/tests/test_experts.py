"""The torch reference experts: every wire dtype, both layouts, both group-list types,
BF16 and W8A8 weights, against the dense fp32 reference."""

import pytest
import torch

import moe_dispatch as md
import moe_dispatch_testing as mdt
from moe_dispatch_testing.accuracy import TOLERANCES, relative_error
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch_testing.routing import random_expert_weights, random_routing

H, E, K, I, T = 256, 8, 3, 96, 24


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dtype", list(md.DispatchDtype))
def test_forward_matches_the_dense_reference(dtype, mode, group_list_type, w8a8):
    g = torch.Generator().manual_seed(2)
    weights = random_expert_weights(E, H, I, generator=g)
    if w8a8:
        weights = quantize_weights_w8a8(weights)
        assert weights.w13_weight.dtype == torch.int8 and weights.w13_weight_scale.shape == (E, 2 * I)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, E, K, generator=g, drop_prob=0.1)
    quant = md.QuantHints(input_global_scale=nvfp4_global_scale(x.float().abs().max().item())) \
        if dtype is md.DispatchDtype.NVFP4 else md.QuantHints()
    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode=mode, output_dtype=dtype,
                           quant=quant, group_list_type=group_list_type)
    d = md.create_dispatcher("torch", spec, env={})
    out = d.forward(md.TorchExperts(), weights, x, ids, w)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert relative_error(out, mdt.reference_moe(x, ids, w, weights)) <= TOLERANCES[dtype]


def test_experts_reject_inconsistent_group_lists():
    g = torch.Generator().manual_seed(0)
    weights = random_expert_weights(2, H, I, generator=g)
    rows = torch.randn(5, H).to(torch.bfloat16)
    experts = md.TorchExperts()
    with pytest.raises(md.InvalidInputError, match="counts sum"):
        experts.apply_without_routing_weights(weights, rows, None, 1, torch.tensor([3, 3]), torch.bfloat16)
    # fewer counts than rows: the rows past the segments are padding (low latency's worst-case rows), output zero
    out = experts.apply_without_routing_weights(weights, rows, None, 1, torch.tensor([1, 1]), torch.bfloat16)
    assert out.shape == (5, H) and bool(out[2:].eq(0).all()) and bool(out[:2].ne(0).any())
    with pytest.raises(md.InvalidInputError) as info:
        experts.apply_without_routing_weights(weights, rows, None, 1, torch.tensor([[2, 3]]), torch.bfloat16)
    assert info.value.parameter == "group_list"
    with pytest.raises(md.InvalidInputError, match="scales"):
        experts.apply_without_routing_weights(weights, rows.to(torch.int8), None, 1, torch.tensor([2, 3]), torch.bfloat16)
    with pytest.raises(md.InvalidInputError) as info:
        experts.apply_without_routing_weights(weights, rows.float(), None, 1, torch.tensor([2, 3]), torch.bfloat16)
    assert info.value.parameter == "hidden_states"


def test_weights_not_sliced_to_the_rank_are_named_with_the_slice_to_take():
    """All 8 experts handed to a rank whose dispatch output has 4 local experts: the layer is at fault, not the group
    list, and the error says how to slice it."""
    local = 4
    spec = md.DispatchSpec(H, local, K, num_max_dispatch_tokens_per_rank=T, output_dtype="bf16")
    d = md.create_dispatcher("torch", spec, env={})  # one rank: its 4 experts are the group list's 4 entries
    x = torch.randn(T, H).to(torch.bfloat16)
    out = d.dispatch(x, *random_routing(T, local, K))
    whole = random_expert_weights(2 * local, H, I, generator=torch.Generator().manual_seed(0))
    with pytest.raises(md.InvalidInputError) as info:
        md.run_experts(md.TorchExperts(), whole, out)
    assert (info.value.parameter, info.value.value, info.value.allowed) == ("layer.w13_weight", 8, "4 (E_local)")
    assert "ExpertWeights.slice(rank * 4, 4)" in str(info.value)
    half = md.ExpertWeights(whole.slice(0, local).w13_weight, whole.w2_weight)  # one of the two left whole
    with pytest.raises(md.InvalidInputError) as info:
        md.run_experts(md.TorchExperts(), half, out)
    assert info.value.parameter == "layer.w2_weight"
    assert md.run_experts(md.TorchExperts(), whole.slice(0, local), out).shape == (out.hidden_states.shape[0], H)
