"""-1 expert ids in the fused ops: mode 2 takes none (the vendor's test: "topk=-1 is not supported"),
mode 1 none in a token without a valid expert. The adapter gives each such slot an expert the token does
not use, with weight 0; the fake refuses the raw ids, as the device may not answer them cleanly."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch_ascend_fuseep import process_fuseep_weights
from moe_dispatch_ascend_fuseep.backend import fill_minus_one
from moe_dispatch_ascend_fuseep_testing.fakes import deep_ep as fake
from moe_dispatch_ascend_fuseep_testing.support import LOCAL, H, I, K, T, fused_dispatcher
from moe_dispatch_testing import random_expert_weights, reference_moe, relative_error


def _weights(experts: int) -> md.ExpertWeights:
    return quantize_weights_w8a8(random_expert_weights(experts, H, I, generator=torch.Generator().manual_seed(0)))


def minus_one(rank: int, world: int, fuse_mode: int) -> float:
    d = fused_dispatcher(fuse_mode)
    weights = _weights(LOCAL * world)
    layer = d.process_weights(weights.slice(rank * LOCAL, LOCAL))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(LOCAL * world, generator=g)[:K] for _ in range(T)])
    ids[0, 1] = -1
    ids[1] = -1  # a token without a valid expert
    w = torch.rand(T, K, generator=g)
    y = d.forward(None, layer, x, ids, w)
    return relative_error(y, reference_moe(x, ids, w, weights))


@pytest.mark.parametrize("fuse_mode", [1, 2])
def test_minus_one_ids_reach_the_fused_ops_as_zero_weight_experts(moe_rank_pools, fuse_mode):
    """Both modes, with a -1 slot and a token without a valid expert: the dense reference's answer."""
    assert max(moe_rank_pools.get(2).map(minus_one, fuse_mode)) < 0.05


def test_fill_minus_one_picks_unused_experts_with_weight_zero():
    ids = torch.tensor([[3, -1, -1], [-1, -1, -1], [0, 1, 2]])
    w = torch.ones(3, 3)
    filled, fw = fill_minus_one(ids, w, 4, None)
    assert filled.tolist() == [[3, 0, 1], [0, 1, 2], [0, 1, 2]]
    assert fw.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 1]]
    only_empty, _ = fill_minus_one(ids, w, 4, (ids < 0).all(dim=1))
    assert only_empty.tolist() == [[3, -1, -1], [0, 1, 2], [0, 1, 2]]


def raw_minus_one(rank: int, world: int, fuse_mode: int) -> str:
    import torch.distributed as dist

    buffer = fake.Buffer(dist.group.WORLD, low_latency_mode=True)
    layer = process_fuseep_weights(_weights(LOCAL * world).slice(rank * LOCAL, LOCAL), fuse_mode)
    ids = torch.tensor([[0, -1]] * T) if fuse_mode == 2 else torch.tensor([[-1, -1]] * T)
    bound = T if fuse_mode == 1 else T * world * K
    try:
        buffer.fused_deep_moe(torch.zeros(T, H, dtype=torch.bfloat16), ids, torch.ones(T, K), layer.gmm1_permuted_weight,
                              layer.gmm1_permuted_weight_scale, layer.gmm2_weight, layer.gmm2_weight_scale, bound,
                              LOCAL * world, quant_mode=1, fuse_mode=fuse_mode)
    except RuntimeError as exc:
        return str(exc)
    return "ran"


@pytest.mark.parametrize("fuse_mode", [1, 2])
def test_the_fake_refuses_the_minus_one_ids_the_vendor_does_not_support(moe_rank_pools, fuse_mode):
    for message in moe_rank_pools.get(2).map(raw_minus_one, fuse_mode):
        assert message.startswith("(fake)"), message
