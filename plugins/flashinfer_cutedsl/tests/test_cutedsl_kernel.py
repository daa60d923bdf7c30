"""FlashInfer's CuTe-DSL MoE and ``fp4_quantize`` as each version behaves, on fakes as strict as FlashInfer's
source (rows without a local expert, fp4_quantize's checks and shapes, the routing step's limits, raw-pointer
reads, one signature per release), and what the runner does about it (zeroed padding, no call for zero rows,
expert ranges refused when the weights load, everything on the rows' device)."""

import importlib

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch_flashinfer_cutedsl import CuteDslExperts, vendor
from moe_dispatch_flashinfer_cutedsl_testing import (
    EMULATOR,
    FAKE_0_6_6,
    FAKE_0_6_7,
    FAKE_0_6_13,
    FAKE_0_6_14,
    FAKE_0_6_15,
    FAKE_0_7_0,
    FAKE_0_7_2,
    fake_for,
)

H, I, E = 256, 128, 8
GS = nvfp4_global_scale(4.0)


def _weights(experts: int = E) -> md.ExpertWeights:
    g = torch.Generator().manual_seed(1)
    return md.ExpertWeights(torch.randn(experts, 2 * I, H, generator=g) / H**0.5,
                            torch.randn(experts, H, I, generator=g) / I**0.5)


def _layer(fake: str, first: int = 0, count: int = 4, experts: int = E):  # noqa: ANN202
    return CuteDslExperts(fake).process_weights(_weights(experts).slice(first, count), first_expert=first,
                                                num_experts=experts, input_global_scale=GS, fc2_input_scale=GS)


def _run(layer, x_q, x_sf, ids, scales=None, **replace):  # noqa: ANN001, ANN202
    """``CuteDslMoEWrapper.run`` with the layer's tensors, some of them replaced."""
    args = dict(w1_weight=layer.w1_weight, w1_weight_sf=layer.w1_weight_sf,
                w1_alpha=1.0 / (GS * layer.w1_global_scale),
                fc2_input_scale=torch.tensor([GS]), w2_weight=layer.w2_weight, w2_weight_sf=layer.w2_weight_sf,
                w2_alpha=1.0 / (GS * layer.w2_global_scale))
    args.update(replace)
    scales = torch.ones(ids.shape, dtype=torch.float32) if scales is None else scales
    return layer.wrapper.run(x_q, x_sf, ids, scales, args["w1_weight"], args["w1_weight_sf"], args["w1_alpha"],
                             args["fc2_input_scale"], args["w2_weight"], args["w2_weight_sf"], args["w2_alpha"])


def _rows(fake: str, n: int = 6):  # noqa: ANN202
    mod = importlib.import_module(fake)
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    return mod.fp4_quantize(x, torch.tensor([GS]), is_sf_swizzled_layout=False)


# -- rows of tokens with no local expert -------------------------------------------


@pytest.mark.parametrize("fake,garbage", [(FAKE_0_6_6, True), (FAKE_0_6_7, False)])
def test_flashinfer_leaves_rows_without_a_local_expert_uninitialised_until_0_6_7(fake, garbage):
    layer = _layer(fake)
    x_q, x_sf = _rows(fake)
    ids = torch.tensor([[0], [-1], [1], [-1], [2], [3]], dtype=torch.int32)
    out = _run(layer, x_q, x_sf, ids)
    assert bool(out[[1, 3]].isnan().all()) == garbage and not out[[0, 2, 4, 5]].isnan().any()
    if not garbage:
        assert not out[[1, 3]].any()


@pytest.mark.parametrize("fake", [FAKE_0_6_6, FAKE_0_7_2])
def test_the_runner_zeroes_masked_padding_on_every_version(fake):
    layer = _layer(fake)
    counts = torch.tensor([2, 0, 3, 1])
    hidden = torch.randn(4, 5, H).to(torch.bfloat16)
    out = CuteDslExperts(fake).apply_without_routing_weights(layer, hidden, None, 1, counts, torch.bfloat16)
    valid = torch.arange(5).unsqueeze(0) < counts.unsqueeze(1)
    assert not out[~valid].isnan().any() and not out[~valid].any() and out[valid].abs().sum() > 0


# -- fp4_quantize as each version checks and shapes -----------------------------------------


@pytest.mark.parametrize("fake", [FAKE_0_6_6, FAKE_0_6_13, FAKE_0_7_2])
def test_fp4_quantize_checks_contiguity_and_flattens_leading_dims(fake):
    mod = importlib.import_module(fake)
    x = torch.randn(4, 2 * H).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous"):
        mod.fp4_quantize(x[:, :H], torch.tensor([GS]), is_sf_swizzled_layout=False)  # CHECK_CONTIGUOUS
    data, sf = mod.fp4_quantize(x.view(2, 2, 2 * H), torch.tensor([GS]), is_sf_swizzled_layout=False)
    assert tuple(data.shape) == (2, 2, H) and tuple(sf.shape) == (4, 2 * H // 16)


@pytest.mark.parametrize("fake,shape", [(FAKE_0_6_7, None), (FAKE_0_6_13, (128, 8))])
def test_fp4_quantize_swizzled_scales_take_the_shape_of_each_version(fake, shape):
    """K = 96: 6 scale columns, padded to 8 by the swizzle. Up to 0.6.7 FlashInfer reshapes the
    padded buffer to (-1, 6), which torch refuses; from 0.6.8 to (-1, 8)."""
    mod = importlib.import_module(fake)
    x = torch.randn(5, 96).to(torch.bfloat16)
    if shape is None:
        with pytest.raises(RuntimeError, match="invalid for input of size"):
            mod.fp4_quantize(x, torch.tensor([GS]))
    else:
        assert tuple(mod.fp4_quantize(x, torch.tensor([GS]))[1].shape) == shape


def test_before_0_6_13_fp4_quantize_reads_the_global_scale_as_fp32_bytes():
    old, new = importlib.import_module(FAKE_0_6_7), importlib.import_module(FAKE_0_6_13)
    x = torch.randn(2, H).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="fake: .*float32"):
        old.fp4_quantize(x, torch.tensor([GS], dtype=torch.float64))
    new.fp4_quantize(x, torch.tensor([GS], dtype=torch.float64))  # cast in Python from 0.6.13


# -- zero received rows -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_zero_rows_return_before_any_flashinfer_kernel(dtype):
    layer = _layer(EMULATOR)
    kernel = CuteDslExperts(EMULATOR)
    mod = importlib.import_module(EMULATOR)
    with pytest.raises(AssertionError, match="fake: .*0 rows"):
        mod.fp4_quantize(torch.zeros(0, H, dtype=torch.bfloat16), torch.tensor([GS]))
    width = H if dtype == torch.bfloat16 else H // 2
    scale = None if dtype == torch.bfloat16 else torch.zeros(0, H // 16, dtype=torch.float8_e4m3fn)
    calls = layer.wrapper.calls
    out = kernel.apply_without_routing_weights(layer, torch.zeros(0, width, dtype=dtype), scale, 1,
                                               torch.zeros(4, dtype=torch.int64), torch.bfloat16, global_scale=GS)
    assert tuple(out.shape) == (0, H) and out.dtype == torch.bfloat16 and layer.wrapper.calls == calls


# -- the routing step's limits ---------------------------------------------------------------


@pytest.mark.parametrize("fake,experts,message", [
    (FAKE_0_6_7, 12 + 2, "multiple of 4"), (FAKE_0_6_7, 516, "<= #threads"),
    (FAKE_0_6_13, 2052, "Unsupported numExperts"), (FAKE_0_7_2, 2052, "no compiled tier")])
def test_the_fake_routing_step_refuses_what_flashinfers_does(fake, experts, message):
    mod = importlib.import_module(fake)
    wrapper = mod.CuteDslMoEWrapper(num_experts=experts, top_k=1, hidden_size=H, intermediate_size=I,
                                    num_local_experts=4, local_expert_offset=0, device="cpu")
    layer = _layer(fake)
    x_q, x_sf = _rows(fake)
    layer.wrapper = wrapper
    with pytest.raises(RuntimeError, match=message):
        _run(layer, x_q, x_sf, torch.zeros(6, 1, dtype=torch.int32))


def test_the_runner_refuses_expert_ranges_flashinfer_cannot_route_when_weights_load():
    with pytest.raises(md.InvalidSpecError) as info:
        CuteDslExperts(FAKE_0_6_7).process_weights(_weights(6).slice(0, 3), first_expert=0, num_experts=6,
                                                          input_global_scale=GS, fc2_input_scale=GS)
    assert info.value.parameter == "num_experts" and "multiple of 4" in info.value.allowed
    with pytest.raises(md.InvalidSpecError) as info:
        CuteDslExperts(EMULATOR).process_weights(_weights().slice(4, 4), first_expert=6, num_experts=E,
                                                        input_global_scale=GS, fc2_input_scale=GS)
    assert info.value.parameter == "first_expert"
    CuteDslExperts(FAKE_0_6_13).process_weights(_weights(6).slice(0, 3), first_expert=3, num_experts=6,
                                                       input_global_scale=GS, fc2_input_scale=GS)


# -- the kernel reads raw pointers -------------------------------------------------------------


def test_the_fake_reads_weights_scales_and_alphas_from_their_storage():
    layer = _layer(EMULATOR)
    x_q, x_sf = _rows(EMULATOR)
    ids = torch.tensor([[0], [1], [2], [3], [0], [1]], dtype=torch.int32)
    good = _run(layer, x_q, x_sf, ids)
    wide = torch.zeros(2 * layer.num_local_experts)
    wide[::2] = 1.0 / (GS * layer.w2_global_scale)
    strided = _run(layer, x_q, x_sf, ids, w2_alpha=wide[::2])  # right values, every other float in memory
    relaid = _run(layer, x_q, x_sf, ids, w1_weight_sf=layer.w1_weight_sf.contiguous())  # MMA order lost
    w1 = torch.cat([layer.w1_weight, layer.w1_weight], dim=2)[:, :, : layer.w1_weight.shape[2]]  # a strided view
    viewed = _run(layer, x_q, x_sf, ids, w1_weight=w1)
    assert torch.equal(w1, layer.w1_weight) and not w1.is_contiguous()
    for bad in (strided, relaid, viewed):
        assert not torch.allclose(bad.float(), good.float(), atol=1e-3), "the kernel would read other bytes"


# -- token_final_scales dtypes, one device --------------------------------------------------------


def test_token_final_scales_may_be_bf16_or_fp16_and_everything_is_on_one_device():
    layer = _layer(EMULATOR)
    x_q, x_sf = _rows(EMULATOR)
    ids = torch.zeros(6, 1, dtype=torch.int32)
    ref = _run(layer, x_q, x_sf, ids)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(_run(layer, x_q, x_sf, ids, scales=torch.ones(6, 1, dtype=dtype)), ref)
    with pytest.raises(AssertionError, match="device"):
        _run(layer, x_q, x_sf, ids, scales=torch.ones(6, 1, device="meta"))
    kernel = CuteDslExperts(EMULATOR)
    with pytest.raises(md.InvalidInputError) as info:
        kernel.apply_without_routing_weights(layer, torch.empty(3, H, dtype=torch.bfloat16, device="meta"), None, 1,
                                             torch.tensor([3, 0, 0, 0]), torch.bfloat16)
    assert info.value.parameter == "layer"


# -- a fake per wrapper signature -------------------------------------------------------------


def test_each_release_with_its_own_wrapper_signature_has_its_own_fake():
    assert fake_for((0, 6, 14)) == FAKE_0_6_14 and fake_for((0, 6, 15)) == FAKE_0_6_15
    assert fake_for((0, 6, 18)) == FAKE_0_7_0 and fake_for((0, 6, 5)) == FAKE_0_6_6
    m14, m15 = importlib.import_module(FAKE_0_6_14), importlib.import_module(FAKE_0_6_15)
    m70, m66 = importlib.import_module(FAKE_0_7_0), importlib.import_module(FAKE_0_6_6)
    m14.CuteDslMoEWrapper(8, 1, H, I, activation="silu", device="cpu")
    with pytest.raises(TypeError, match="activation_type"):
        m14.CuteDslMoEWrapper(8, 1, H, I, activation_type=3, device="cpu")
    with pytest.raises(TypeError, match="use_fused_finalize"):
        m15.CuteDslMoEWrapper(8, 1, H, I, use_fused_finalize=True, device="cpu")
    with pytest.raises(TypeError, match="enable_pdl"):
        m66.CuteDslMoEWrapper(8, 1, H, I, enable_pdl=True, device="cpu")
    wrapper = m70.CuteDslMoEWrapper(8, 1, H, I, quant_mode="w4a4", device="cpu")
    with pytest.raises(TypeError, match="uint8"):
        wrapper.run(torch.zeros(2, H, dtype=torch.bfloat16), None, torch.zeros(2, 1, dtype=torch.int32),
                    torch.ones(2, 1), None, None, None, None, None, None, None)


# -- facts in vendor.py -----------------------------------------------------------------


def test_fp4_quantize_keywords_source_and_exact_math_variables_per_version():
    assert "is_global_scale_inversed" in vendor.signature("fp4_quantize", (0, 6, 11)).names()
    assert "is_global_scale_inversed" not in vendor.signature("fp4_quantize", (0, 6, 10)).names()
    assert "quantization/fp4_quantization.py" in vendor.signature("fp4_quantize", (0, 6, 7)).source
    assert vendor.fp4_fast_math_env((0, 6, 11)) == ()
    assert vendor.fp4_fast_math_env((0, 6, 12)) == ("TRTLLM_DISABLE_FP4_QUANT_FAST_MATH",)
    assert set(vendor.fp4_fast_math_env((0, 6, 13))) == {"TRTLLM_DISABLE_FP4_QUANT_FAST_MATH",
                                                         "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH"}
