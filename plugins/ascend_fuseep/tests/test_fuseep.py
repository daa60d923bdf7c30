"""FuseEP beyond the kit: the fused op against the unfused pipeline and the dense reference, the
weight transforms of both fuse modes, the op's limits and numerics (mode 2's row bound, a rank with no
tokens, its fp16 intermediates), the refusals, the unfused path's routing at combine, and the trails."""

import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch.cli import main
from moe_dispatch_ascend_deepep.experts import NpuExperts
from moe_dispatch_ascend_deepep_testing import FAKE as DEEPEP_FAKE, TORCH_NPU_FAKE, ascend_backend
from moe_dispatch_ascend_fuseep import FuseEPWeights, process_fuseep_weights
from moe_dispatch_ascend_fuseep.weights import deinterleave_gate_up, scale_from_int64
from moe_dispatch_ascend_fuseep_testing import FAKE, fuseep_backend
from moe_dispatch_ascend_fuseep_testing.fakes import deep_ep as fake
from moe_dispatch_testing import (
    ScaledLayer, random_expert_weights, random_routing, reference_moe, relative_error, routing_reuse,
)

H, I = 1024, 512  # fused_deep_moe (mode 1) takes gmm1 N = 2I in 1024..6144
LOCAL, K, T = 2, 2, 8
#: Relative error against the dense reference on the dequantized W8A8 weights: INT8 rows and the
#: per-token requantization between the GEMMs (measured 0.033 at I=512, seeds 0-1).
BOUND = 0.05


def _w8a8(experts: int, seed: int = 0, intermediate: int = I) -> md.ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return quantize_weights_w8a8(random_expert_weights(experts, H, intermediate, generator=g))


# -- the fused op ----------------------------------------------------------------------------------------------


def fused_vs_unfused(rank: int, world: int, fuse_mode: int) -> dict:
    """The same W8A8 experts through ``fused_deep_moe`` and through DeepEP-Ascend's INT8
    dispatch → the torch_npu W8A8 kernel → combine."""
    local, k, tokens = 2, 2, 8
    spec = md.DispatchSpec(H, local * world, k, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency")
    weights = _w8a8(local * world)
    mine_w = weights.slice(rank * local, local)
    fused = md.create_dispatcher(fuseep_backend(FAKE), spec, env={}, options={"fuse_mode": fuse_mode})
    layer = fused.process_weights(mine_w)
    kernel = NpuExperts("w8a8", TORCH_NPU_FAKE)
    unfused = md.create_dispatcher(ascend_backend(DEEPEP_FAKE),
                                   md.DispatchSpec(H, local * world, k, num_max_dispatch_tokens_per_rank=tokens,
                                                   mode="low_latency", quant=kernel.quant_hints()), env={})
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world * tokens, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(world * tokens, spec.num_experts, k, generator=g, drop_prob=0.1)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    y_fused = fused.forward(kernel, layer, x[mine], ids[mine], w[mine])
    y_unfused = unfused.forward(kernel, kernel.process_weights(mine_w), x[mine], ids[mine], w[mine])
    dense = reference_moe(x[mine], ids[mine], w[mine], weights)
    return {"vs_unfused": relative_error(y_fused, y_unfused), "vs_dense": relative_error(y_fused, dense),
            "wire": fused.output_dtype.value}


@pytest.mark.parametrize("fuse_mode", [1, 2])
def test_the_fused_op_matches_the_unfused_pipeline(moe_rank_pools, fuse_mode):
    for r in moe_rank_pools.get(2).map(fused_vs_unfused, fuse_mode):
        assert r["wire"] == "int8"
        assert r["vs_unfused"] < 1e-2, r  # same int8 steps; bf16 rounding of the w2 scale in the unfused kernel
        assert r["vs_dense"] < 0.05, r  # INT8 rows and requantization; 0.033 measured at I=512


def forward(rank: int, world: int, vendor_module: str, fuse_mode: int, routing: str, tokens: int = 8) -> dict:
    local, k = 2, 2
    E = local * world
    spec = md.DispatchSpec(H, E, k, num_max_dispatch_tokens_per_rank=8, mode="low_latency")
    d = md.create_dispatcher(fuseep_backend(vendor_module), spec, env={}, options={"fuse_mode": fuse_mode})
    weights = _w8a8(E)
    layer = d.process_weights(weights.slice(rank * local, local))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    if routing == "all_to_rank_0":  # rank 0 receives T·R·k rows, more than T
        ids = torch.tensor([[0, 1]] * tokens)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(tokens, k, generator=g)
    y = d.forward(None, layer, x, ids, w)
    dense = reference_moe(x, ids, w, weights)
    return {"rows": y.shape[0], "error": relative_error(y, dense) if tokens else 0.0}


def test_fuse_mode_2_passes_the_rows_a_rank_can_receive(moe_rank_pools):
    """Mode 2's num_max_dispatch_tokens_per_rank is max_output_size, the rows received (docs:
    max_bs·num_ranks·topk; the vendor's test passes T·k·R; the tiling sizes the workspace by it).
    Every token to rank 0's experts: rank 0 receives T·R·k = 32 rows, four times T."""
    for r in moe_rank_pools.get(2).map(forward, FAKE, 2, "all_to_rank_0"):
        assert r["error"] < BOUND, r


def empty_rank(rank: int, world: int, fuse_mode: int) -> dict:
    return forward(rank, world, FAKE, fuse_mode, "random", tokens=8 if rank == 0 else 0)


@pytest.mark.parametrize("fuse_mode", [1, 2])
def test_a_rank_without_tokens_still_joins_the_fused_op(moe_rank_pools, fuse_mode):
    """The fused op takes bs 1..256 (FUSED_DEEP_MOE.md, fused_deep_moe_tiling.cpp) and is a
    collective: a rank with no tokens sends one zero-weight row and gets [0, H] back."""
    first, second = moe_rank_pools.get(2).map(empty_rank, fuse_mode)
    assert first["error"] < BOUND and second["rows"] == 0


def overflow(rank: int, world: int, fuse_mode: int) -> bool:
    import torch.distributed as dist

    buffer = fake.Buffer(dist.group.WORLD, low_latency_mode=True)
    w = _w8a8(LOCAL * world).slice(rank * LOCAL, LOCAL)
    w = md.ExpertWeights(w.w13_weight, w.w2_weight, w.w13_weight_scale * 1e4, w.w2_weight_scale)  # acc·s > 65504
    layer = process_fuseep_weights(w, fuse_mode)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    bound = T if fuse_mode == 1 else T * world * K
    out, _ = buffer.fused_deep_moe(x, torch.tensor([[0, 1]] * T), torch.ones(T, K), layer.gmm1_permuted_weight,
                                   layer.gmm1_permuted_weight_scale, layer.gmm2_weight, layer.gmm2_weight_scale, bound,
                                   LOCAL * world, quant_mode=1, fuse_mode=fuse_mode)
    return bool(torch.isfinite(out.float()).all())


def test_mode_2_keeps_gemm_outputs_in_fp16(moe_rank_pools):
    """dispatch_ffn_combine.h: CType = float16_t (the uint64 fixpipe writes acc·scale in fp16): past
    65504 it is inf on the device, and in the fake; mode 1 dequantizes to fp32."""
    assert moe_rank_pools.get(2).map(overflow, 2) == [False, False]
    assert moe_rank_pools.get(2).map(overflow, 1) == [True, True]


def test_mode_2_quantizes_as_moe_init_routing_quant_v2():
    x = torch.tensor([[1.0, -0.5, 0.25, 3.0]])
    q, s = fake.quant_mode2(x)
    assert torch.allclose(s, torch.tensor([3.0 / 127])) and q.tolist() == [[42, -21, 11, 127]]


# -- the weights -----------------------------------------------------------------------------------------------


def test_mode_1_interleaves_gate_and_up_in_chunks_of_64():
    w = _w8a8(2)
    p = process_fuseep_weights(w, 1)
    w13_t = w.w13_weight.transpose(1, 2)
    assert p.gmm1_permuted_weight.shape == (2, H, 2 * I) and p.gmm2_weight.shape == (2, H, I)
    assert torch.equal(p.gmm1_permuted_weight[..., :64], w13_t[..., :64])  # gate[0:64]
    assert torch.equal(p.gmm1_permuted_weight[..., 64:128], w13_t[..., I : I + 64])  # up[0:64]
    assert torch.equal(p.gmm1_permuted_weight[..., 128:192], w13_t[..., 64:128])  # gate[64:128]
    gate, up = deinterleave_gate_up(p.gmm1_permuted_weight_scale)
    assert torch.equal(torch.cat([gate, up], -1), w.w13_weight_scale.float())
    assert p.gmm1_permuted_weight_scale.dtype == torch.float32


def test_mode_2_transposes_and_reads_scales_as_int64_bits():
    w = _w8a8(2)
    p = process_fuseep_weights(w, 2)
    assert torch.equal(p.gmm1_permuted_weight, w.w13_weight.transpose(1, 2))
    assert torch.equal(p.gmm2_weight, w.w2_weight.transpose(1, 2)) and p.gmm2_weight.shape == (2, I, H)
    assert p.gmm1_permuted_weight_scale.dtype == torch.int64
    assert torch.equal(scale_from_int64(p.gmm2_weight_scale), w.w2_weight_scale.float())


def test_processing_is_idempotent_and_refuses_other_schemes():
    w = _w8a8(2)
    p = process_fuseep_weights(w, 1)
    assert process_fuseep_weights(p, 1) is p
    with pytest.raises(md.InvalidSpecError) as info:
        process_fuseep_weights(p, 2)
    assert info.value.parameter == "fuse_mode"
    bf16 = random_expert_weights(2, H, I, generator=torch.Generator().manual_seed(0))
    with pytest.raises(md.InvalidSpecError) as info:
        process_fuseep_weights(md.ExpertWeights(bf16.w13_weight.bfloat16(), bf16.w2_weight.bfloat16()), 1)
    assert info.value.parameter == "weights" and info.value.value == "bf16 (unquantized)"
    assert "ascend_deepep with runner npu_bf16" in str(info.value)
    with pytest.raises(md.InvalidSpecError, match="int8 without per-channel scales"):
        process_fuseep_weights(md.ExpertWeights(w.w13_weight, w.w2_weight), 1)
    odd = quantize_weights_w8a8(random_expert_weights(1, H, 544, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(md.InvalidSpecError, match="chunks of 64"):
        process_fuseep_weights(odd, 1)
    with pytest.raises(md.InvalidSpecError) as info:
        process_fuseep_weights(w, 3)
    assert info.value.parameter == "fuse_mode" and "dispatch_ffn_combine" in info.value.allowed


def test_mode_1_refuses_an_intermediate_size_the_op_does_not_take():
    """gmm1 N = 2I must be in 1024..6144 for mode 1 (FUSED_DEEP_MOE.md constraints)."""
    with pytest.raises(md.InvalidSpecError) as info:
        process_fuseep_weights(_w8a8(2, intermediate=128), 1)
    assert info.value.parameter == "intermediate_size"
    process_fuseep_weights(_w8a8(2, intermediate=128), 2)  # mode 2 documents no such limit


# -- limits and refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,parameter", [
    ("num_max_dispatch_tokens_per_rank", 300, "num_max_dispatch_tokens_per_rank"),
    ("hidden_size", 7200, "hidden_size"),
    ("hidden_size", 992, "hidden_size"),
    ("hidden_size", 1040, "hidden_size"),
    ("top_k", 13, "top_k"),
])
def test_the_ops_limits_are_checked_at_creation(field, value, parameter):
    args = {"hidden_size": H, "num_experts": 16, "top_k": 2, "num_max_dispatch_tokens_per_rank": 8,
            "mode": "low_latency", field: value}
    with pytest.raises(md.MoEDispatchError) as info:
        fuseep_backend(FAKE, env={}).check_spec(md.DispatchSpec(**args), 2)
    assert info.value.parameter == parameter


def refusals(rank: int, world: int) -> list[str]:
    spec = md.DispatchSpec(H, 4, 2, num_max_dispatch_tokens_per_rank=4, mode="low_latency")
    d = md.create_dispatcher(fuseep_backend(FAKE), spec, env={}, options={"fuse_mode": 2})
    x, ids, w = torch.zeros(4, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 4), torch.ones(4, 2)
    seen = []
    for layer in (_w8a8(4), process_fuseep_weights(_w8a8(4), 1)):
        try:
            d.forward(None, layer, x, ids, w)
        except md.InvalidInputError as exc:
            seen.append(f"{exc.parameter}: {exc.allowed}")
    for options in ({"fuse_mode": "2"}, {"fuse_mode": 2, "max_output_size": 4}, {"fuse_mode": 1, "max_output_size": 64}):
        try:
            md.create_dispatcher(fuseep_backend(FAKE), spec, env={}, options=options)
        except md.InvalidSpecError as exc:
            seen.append(exc.parameter or "")
    assert isinstance(d.process_weights(_w8a8(4)), FuseEPWeights)
    assert d.backend_dispatcher.max_output_size == 4 * 2 * 2  # T·R·k, the vendor's test value
    return seen


def test_fused_forward_and_creation_refuse_what_they_were_not_given(moe_rank_pools):
    for seen in moe_rank_pools.get(2).map(refusals):
        assert seen == ["layer: FuseEPWeights for fuse mode 2"] * 2 + ["fuse_mode", "max_output_size",
                                                                        "max_output_size"]


# -- the unfused path: combine uses the routing given to its dispatch ------------------------------------------


def _unfused_combine_after_the_router_buffers_change(rank: int, world: int):
    spec = md.DispatchSpec(H, LOCAL * world, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    d = md.create_dispatcher(fuseep_backend(FAKE), spec, env={})
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, d.spec.num_experts, K, generator=g)
    other_ids, _ = random_routing(T, d.spec.num_experts, K, generator=g)
    layer = ScaledLayer.for_rank(H, d.spec.num_experts, rank, LOCAL)
    return tuple(routing_reuse(d, layer, x, ids, w, other_ids))[:2]


def test_the_unfused_combine_uses_the_routing_given_to_its_dispatch(moe_rank_pools):
    """Ids copied from another routing and w.mul_(0.5).add_(0.25) after dispatch (the kit's ``routing_reuse``):
    combine is bit for bit the one without the overwrite (the vendor's low-latency combine takes the routing
    again: the adapter hands it copies of its own)."""
    for repeatable, same in moe_rank_pools.get(2).map(_unfused_combine_after_the_router_buffers_change):
        assert repeatable and same


# -- the trails -----------------------------------------------------------------------------------------------


def _explain(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["explain", "--backend", "ascend_fuseep", "--mode", "low_latency", "--preset", "deepseek-v3",
                     "--tokens", "128", "--world-size", "16", *args])
    return code, out.getvalue()


def test_explain_on_fuseep(capsys):
    code, text = _explain()
    assert code == 0 and "wire dtype int8 for backend 'ascend_fuseep'" in text and "backend default" in text
    code, text = _explain("--runner", "npu_w8a8")
    assert code == 2 and "does not run behind backend 'ascend_fuseep'" in capsys.readouterr().err
    code, _ = _explain("--runner", "npu_w4a4")  # a W4A4 layer asks for BF16, which FuseEP refuses
    err = capsys.readouterr().err
    assert code == 2 and "output_dtype='bf16'" in err and "W8A8 INT8 dynamic only" in err
    code, _ = _explain("--quant", '{"dispatcher_output_dtype": "bf16"}')
    assert code == 2 and "W8A8 INT8 dynamic only" in capsys.readouterr().err


def test_installed_plugin_is_listed_unavailable():
    info = md.PluginHost(env={}).info("ascend_fuseep")
    assert info.distribution == "moe-dispatch-ascend-fuseep" and info.status == "unavailable" and info.reason
