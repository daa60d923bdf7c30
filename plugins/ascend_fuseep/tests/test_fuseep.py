"""FuseEP beyond the kit: the fused op against the unfused pipeline, the weight transforms of
both fuse modes, the op's limits, the refusals, and the trails."""

import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch

import moe_dispatch as md
import moe_dispatch_testing as mdt
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.cli import main
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch_testing.routing import random_expert_weights, random_routing
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.experts import EMULATOR as NPU_OPS, NpuExperts
from moe_dispatch_ascend_deepep.vendor import EMULATOR as DEEPEP_ASCEND
from moe_dispatch_ascend_fuseep import FuseEPBackend, FuseEPWeights, process_fuseep_weights
from moe_dispatch_ascend_fuseep.vendor import FAKE as EMULATOR
from moe_dispatch_ascend_fuseep.weights import deinterleave_gate_up, scale_from_int64

H, I = 1024, 512  # fused_deep_moe (mode 1) takes gmm1 N = 2I in 1024..6144


def _w8a8(experts: int, seed: int = 0) -> md.ExpertWeights:
    return quantize_weights_w8a8(random_expert_weights(experts, H, I, generator=torch.Generator().manual_seed(seed)))


def fused_vs_unfused(rank: int, world: int, fuse_mode: int) -> dict:
    """The same W8A8 experts through ``fused_deep_moe`` and through DeepEP-Ascend's INT8
    dispatch → the torch_npu W8A8 kernel → combine."""
    local, k, tokens = 2, 2, 8
    spec = md.DispatchSpec(H, local * world, k, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency")
    weights = _w8a8(local * world)
    mine_w = weights.slice(rank * local, local)
    fused = md.create_dispatcher(FuseEPBackend(EMULATOR), spec, env={}, options={"fuse_mode": fuse_mode})
    layer = fused.process_weights(mine_w)
    kernel = NpuExperts("w8a8", NPU_OPS)
    unfused = md.create_dispatcher(AscendDeepEPBackend(DEEPEP_ASCEND),
                                   md.DispatchSpec(H, local * world, k, num_max_dispatch_tokens_per_rank=tokens,
                                                   mode="low_latency", quant=kernel.quant_hints()), env={})
    g = torch.Generator().manual_seed(7)
    x = torch.randn(world * tokens, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(world * tokens, spec.num_experts, k, generator=g, drop_prob=0.1)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    y_fused = md.moe_forward(fused, kernel, layer, x[mine], ids[mine], w[mine])
    y_unfused = md.moe_forward(unfused, kernel, kernel.process_weights(mine_w), x[mine], ids[mine], w[mine])
    dense = mdt.reference_moe(x[mine], ids[mine], w[mine], weights)
    return {"vs_unfused": relative_error(y_fused, y_unfused), "vs_dense": relative_error(y_fused, dense),
            "wire": fused.output_dtype.value}


@pytest.mark.parametrize("fuse_mode", [1, 2])
def test_the_fused_op_matches_the_unfused_pipeline(moe_rank_pools, fuse_mode):
    for r in moe_rank_pools.get(2).map(fused_vs_unfused, fuse_mode):
        assert r["wire"] == "int8"
        assert r["vs_unfused"] < 1e-2, r  # same int8 steps; bf16 rounding of the w2 scale in the unfused kernel
        assert r["vs_dense"] < 0.05, r  # INT8 rows and requantization; 0.033 measured at I=512


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
        FuseEPBackend(EMULATOR, env={}).check_spec(md.DispatchSpec(**args), 2)
    assert info.value.parameter == parameter


def refusals(rank: int, world: int) -> list[str]:
    spec = md.DispatchSpec(H, 4, 2, num_max_dispatch_tokens_per_rank=4, mode="low_latency")
    d = md.create_dispatcher(FuseEPBackend(EMULATOR), spec, env={}, options={"fuse_mode": 2})
    x, ids, w = torch.zeros(4, H, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 4), torch.ones(4, 2)
    seen = []
    for layer in (_w8a8(4), process_fuseep_weights(_w8a8(4), 1)):
        try:
            d.forward(None, layer, x, ids, w)
        except md.InvalidInputError as exc:
            seen.append(f"{exc.parameter}: {exc.allowed}")
    for options in ({"fuse_mode": "2"}, {"fuse_mode": 2, "max_output_size": 4}, {"fuse_mode": 1, "max_output_size": 64}):
        try:
            md.create_dispatcher(FuseEPBackend(EMULATOR), spec, env={}, options=options)
        except md.InvalidSpecError as exc:
            seen.append(exc.parameter or "")
    assert isinstance(d.process_weights(_w8a8(4)), FuseEPWeights)
    assert d.backend_dispatcher.max_output_size == 4 * 2 * 2  # T·R·k, the vendor's test value
    return seen


def test_fused_forward_and_creation_refuse_what_they_were_not_given(moe_rank_pools):
    for seen in moe_rank_pools.get(2).map(refusals):
        assert seen == ["layer: FuseEPWeights for fuse mode 2"] * 2 + ["fuse_mode", "max_output_size",
                                                                        "max_output_size"]


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
