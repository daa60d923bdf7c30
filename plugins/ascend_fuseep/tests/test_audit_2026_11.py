"""The independent audit (2026-11) of FuseEP against sgl-kernel-npu f425bdf: one test per non-OK row
that concerns this plugin (docs/vendor-audits/2026-11/round1/ascend_deepep_fuseep.md #40, #41, #42; VENDOR.md "Independent
audit (2026-11)"). The CRASH test failed on the adapter before its fix, with the fake as strict as
the vendor."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
import moe_dispatch_testing as mdt
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch_testing.routing import random_expert_weights
from moe_dispatch_ascend_deepep.fakes import torch_npu as fake_npu
from moe_dispatch_ascend_fuseep import FuseEPBackend, process_fuseep_weights
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep.backend import fill_minus_one
from moe_dispatch_ascend_fuseep.fakes import deep_ep as fake

H, I, LOCAL, K, T = 1024, 512, 2, 2, 8
A2 = 220  # torch_npu.npu.get_soc_version() of an Ascend910B1 (Atlas A2)


def _weights(experts: int) -> md.ExpertWeights:
    return quantize_weights_w8a8(random_expert_weights(experts, H, I, generator=torch.Generator().manual_seed(0)))


def _dispatcher(fuse_mode: int) -> md.Dispatcher:
    spec = md.DispatchSpec(H, LOCAL * 2, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    return md.create_dispatcher(FuseEPBackend(v.FAKE), spec, env={}, options={"fuse_mode": fuse_mode})


# -- #41 CRASH: FuseEP on Atlas A2 ------------------------------------------------------------------------


def on_a2(rank: int, world: int) -> str:
    with fake_npu.soc_version(A2):
        reason = FuseEPBackend(v.FAKE).probe()
        try:
            d = _dispatcher(1)
        except md.BackendUnavailableError as exc:
            return f"refused: {exc.parameter}={exc.value}; probe: {reason}"
        layer = d.process_weights(_weights(LOCAL * world).slice(rank * LOCAL, LOCAL))
        x = torch.randn(T, H).to(torch.bfloat16)
        try:
            md.moe_forward(d, None, layer, x, torch.tensor([[0, 1]] * T), torch.ones(T, K))
        except RuntimeError as exc:
            return f"created, then the op failed: {str(exc)[:60]}"
        return "ran"


def test_41_fuseep_is_refused_on_atlas_a2(moe_rank_pools):
    """An A2 wheel builds csrc/deepep/ops2, which has no FusedDeepMoe / DispatchFFNCombine: probe() says
    so and create_dispatcher refuses, instead of the first fused_forward failing in EXEC_NPU_CMD."""
    for seen in moe_rank_pools.get(2).map(on_a2):
        assert seen.startswith("refused: backend=") and "Atlas A2" in seen, seen


# -- #40 RISK: -1 ids in the fused ops: mapped to unused experts with weight 0 ----------------------------------


def minus_one(rank: int, world: int, fuse_mode: int) -> float:
    d = _dispatcher(fuse_mode)
    weights = _weights(LOCAL * world)
    layer = d.process_weights(weights.slice(rank * LOCAL, LOCAL))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(LOCAL * world, generator=g)[:K] for _ in range(T)])
    ids[0, 1] = -1
    ids[1] = -1  # a token without a valid expert
    w = torch.rand(T, K, generator=g)
    y = md.moe_forward(d, None, layer, x, ids, w)
    return relative_error(y, mdt.reference_moe(x, ids, w, weights))


@pytest.mark.parametrize("fuse_mode", [1, 2])
def test_40_minus_one_ids_reach_the_fused_ops_as_zero_weight_experts(moe_rank_pools, fuse_mode):
    """Mode 2 takes no -1 (the vendor's test: "topk=-1 is not supported"); mode 1 none in a token with no
    valid expert. The adapter gives each such slot an expert the token does not use and weight 0 (the
    fake refuses the raw ids, as the device may not answer them cleanly)."""
    assert max(moe_rank_pools.get(2).map(minus_one, fuse_mode)) < 0.05


def test_40_fill_minus_one_picks_unused_experts_with_weight_zero():
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
def test_40_the_fake_refuses_what_the_vendor_does_not_support(moe_rank_pools, fuse_mode):
    for message in moe_rank_pools.get(2).map(raw_minus_one, fuse_mode):
        assert message.startswith("(fake)"), message


# -- #42 FAKE: mode 2 keeps fp16 intermediates -----------------------------------------------------------------


def overflow(rank: int, world: int, fuse_mode: int) -> bool:
    import torch.distributed as dist

    buffer = fake.Buffer(dist.group.WORLD, low_latency_mode=True)
    w = _weights(LOCAL * world).slice(rank * LOCAL, LOCAL)
    w = md.ExpertWeights(w.w13_weight, w.w2_weight, w.w13_weight_scale * 1e4, w.w2_weight_scale)  # acc·s > 65504
    layer = process_fuseep_weights(w, fuse_mode)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    bound = T if fuse_mode == 1 else T * world * K
    out, _ = buffer.fused_deep_moe(x, torch.tensor([[0, 1]] * T), torch.ones(T, K), layer.gmm1_permuted_weight,
                                   layer.gmm1_permuted_weight_scale, layer.gmm2_weight, layer.gmm2_weight_scale, bound,
                                   LOCAL * world, quant_mode=1, fuse_mode=fuse_mode)
    return bool(torch.isfinite(out.float()).all())


def test_42_mode_2_keeps_gemm_outputs_in_fp16(moe_rank_pools):
    """dispatch_ffn_combine.h: CType = float16_t (the uint64 fixpipe writes acc·scale in fp16): past
    65504 it is inf on the device, and in the fake; mode 1 dequantizes to fp32."""
    assert moe_rank_pools.get(2).map(overflow, 2) == [False, False]
    assert moe_rank_pools.get(2).map(overflow, 1) == [True, True]


def test_42_mode_2_quantizes_as_moe_init_routing_quant_v2():
    x = torch.tensor([[1.0, -0.5, 0.25, 3.0]])
    q, s = fake.quant_mode2(x)
    assert torch.allclose(s, torch.tensor([3.0 / 127])) and q.tolist() == [[42, -21, 11, 127]]
