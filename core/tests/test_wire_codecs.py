"""Wire sizes and the reference codecs: exact bytes, round trips, adversarial data."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import FP8_MAX, Quantized, e2m1_unpack, make_codec, nvfp4_global_scale, pack_ue8m0, unpack_ue8m0
from moe_dispatch.backend import WireFormat

D = md.DispatchDtype


def test_bytes_per_token_for_deepseek_hidden():
    h = 7168
    assert WireFormat(D.BF16, h).bytes_per_token == 14336
    assert WireFormat(D.FP8, h).bytes_per_token == 7392
    assert WireFormat(D.FP8, h, ue8m0=True).bytes_per_token == 7224
    assert WireFormat(D.INT8, h).bytes_per_token == 7172
    assert WireFormat(D.NVFP4, h).bytes_per_token == 4032
    assert WireFormat(D.FP8, h).combine_bytes_per_token == 14336


@pytest.mark.parametrize("dtype,hidden,block", [(D.FP8, 200, 128), (D.NVFP4, 40, 16)])
def test_hidden_not_divisible_by_block_is_a_typed_error(dtype, hidden, block):
    with pytest.raises(md.InvalidSpecError, match=f"multiple of {block}") as info:
        WireFormat(dtype, hidden)
    assert info.value.parameter == "hidden_size" and info.value.value == hidden


def _codec(dtype, x, ue8m0=False):
    gs = nvfp4_global_scale(x.float().abs().max().item()) if dtype is D.NVFP4 else None
    return make_codec(WireFormat(dtype, x.shape[-1], ue8m0=ue8m0), gs)


BOUND = {D.BF16: 0.01, D.FP8: 0.07, D.INT8: 0.02, D.NVFP4: 0.2}


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 9),
    blocks=st.integers(1, 4),
    dtype=st.sampled_from(list(D)),
    ue8m0=st.booleans(),
    scale=st.sampled_from([1e-6, 1.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_through_wire_bytes(rows, blocks, dtype, ue8m0, scale, seed):
    ue8m0 = ue8m0 and dtype is D.FP8
    x = (torch.randn(rows, 128 * blocks, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)
    codec = _codec(dtype, x, ue8m0) if rows else make_codec(WireFormat(dtype, 128 * blocks, ue8m0=ue8m0), 1.0)
    q = codec.quantize(x)
    wire = codec.to_bytes(q)
    assert wire.dtype == torch.uint8 and wire.shape == (rows, codec.wire.bytes_per_token)
    back = codec.from_bytes(wire)
    assert torch.equal(codec.dequantize(back), codec.dequantize(q))
    y = codec.dequantize(back)
    assert torch.isfinite(y).all()
    if rows:
        err = (y - x.float()).norm() / x.float().norm()
        assert err <= BOUND[dtype]


@pytest.mark.parametrize("dtype", list(D))
def test_adversarial_inputs_stay_finite_and_exact_where_they_should(dtype):
    h = 256
    zeros = torch.zeros(2, h, dtype=torch.bfloat16)
    huge = torch.full((2, h), 3.0e38, dtype=torch.bfloat16) * torch.sign(torch.randn(2, h)).to(torch.bfloat16)
    outlier = torch.randn(4, h).to(torch.bfloat16) * 0.01
    outlier[:, ::16] = 1000.0  # one outlier in every 16-block and every 128-block
    for x in (zeros, huge, outlier):
        gs = nvfp4_global_scale(x.float().abs().max().item())
        codec = make_codec(WireFormat(dtype, h), gs)
        y = codec.dequantize(codec.from_bytes(codec.encode(x)))
        assert torch.isfinite(y).all(), (dtype, x[0, :4])
    codec = make_codec(WireFormat(dtype, h), 1.0)
    assert torch.equal(codec.dequantize(codec.quantize(zeros)), zeros.float())
    # the outliers themselves survive (they set their block's scale)
    gs = nvfp4_global_scale(1000.0)
    y = make_codec(WireFormat(dtype, h), gs).dequantize(make_codec(WireFormat(dtype, h), gs).quantize(outlier))
    assert torch.allclose(y[:, ::16], outlier[:, ::16].float(), rtol=0.02)


def test_fp8_scale_is_block_amax_over_448_and_ue8m0_is_a_power_of_two():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x[0, 5] = 3.5
    x[0, 200] = -0.75
    q = make_codec(WireFormat(D.FP8, 256)).quantize(x)
    assert q.scale.tolist() == [[pytest.approx(3.5 / FP8_MAX), pytest.approx(0.75 / FP8_MAX)]]
    assert q.data.float()[0, 5] == FP8_MAX
    q8 = make_codec(WireFormat(D.FP8, 256, ue8m0=True)).quantize(x)
    for s, amax in zip(q8.scale.flatten().tolist(), (3.5, 0.75)):
        assert amax / FP8_MAX <= s < 2 * amax / FP8_MAX and math.log2(s) == int(math.log2(s))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(1e-3, 1e3))
def test_fp8_follows_deepeps_arithmetic_bit_for_bit(seed, spread):
    """DeepEP's ``calculate_fp8_scales`` (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/utils.cuh): the sent
    scale is ``amax * (1/448.0f)`` and the values ``x * (448.0f/amax)``, each one fp32 operation, written here
    in numpy float32 (correctly rounded), not torch. A division by 448 differs in the last bit for some amax;
    on an H100 the CPU codec's division and CUDA's product disagreed on 74 of 512 scale bytes."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(8, 512, generator=g) * spread).to(torch.bfloat16)
    q = make_codec(WireFormat(D.FP8, 512)).quantize(x)
    blocks = x.float().numpy().reshape(8, 4, 128)
    amax = np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), np.float32(1e-4))
    scale = amax * np.float32(1 / 448.0)
    values = blocks * (np.float32(448.0) / amax)
    assert np.array_equal(q.scale.numpy(), scale.squeeze(-1))
    expected = torch.from_numpy(np.clip(values, -448.0, 448.0)).to(torch.float8_e4m3fn).reshape(8, 512)
    assert torch.equal(q.data.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("hidden", [256, 2560, 7168])
def test_ue8m0_scales_pack_four_exponents_per_word_low_byte_first(hidden):
    x = torch.randn(5, hidden).to(torch.bfloat16) * torch.logspace(-3, 3, 5).unsqueeze(1)
    codec = make_codec(WireFormat(D.FP8, hidden, ue8m0=True))
    q = codec.quantize(x)
    packed = pack_ue8m0(q.scale)
    groups = hidden // 128
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-groups // 4))
    first = (int(packed[0, 0]) & 0xFF) - 127  # group 0 is the low byte of word 0
    assert 2.0**first == q.scale[0, 0].item()
    assert torch.equal(unpack_ue8m0(packed, groups), q.scale)
    # A column-major view (DeepEP's TMA layout) unpacks the same, and the codec reads it.
    col = packed.t().contiguous().t()
    assert torch.equal(unpack_ue8m0(col, groups), q.scale)
    assert torch.equal(codec.dequantize(Quantized(q.data, col)), codec.dequantize(q))
    with pytest.raises(md.InvalidInputError, match="int32 words"):
        unpack_ue8m0(packed.float(), groups)


def test_ue8m0_on_a_backend_without_it_is_refused_at_creation():
    class NoUE8M0(mdb.Backend):
        name = "no_ue8m0"
        capabilities = mdb.Capabilities(dtypes={md.Mode.NORMAL: frozenset({D.BF16, D.FP8})}, default_dtype=D.FP8)

    spec = md.DispatchSpec(256, 4, 2, output_dtype="fp8", quant=md.QuantHints(fp8_ue8m0_scales=True))
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher(NoUE8M0(), spec, env={})
    assert info.value.parameter == "quant.fp8_ue8m0_scales" and "no_ue8m0" in str(info.value)


def test_int8_is_symmetric_per_token_with_scale_amax_over_127():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    q = make_codec(WireFormat(D.INT8, 4)).quantize(x)
    assert q.data.tolist()[0] == [64, -127, 32, 0]  # round half to even: 63.5 -> 64, 31.75 -> 32
    assert q.scale[0].item() == pytest.approx(2.0 / 127)
    assert q.data.tolist()[1] == [0, 0, 0, 0]


def _flashinfer_reference(x: torch.Tensor, gs: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's pure-torch NVFP4 reference (``tests/test_helpers/utils_fp4.py`` at 014327ab:
    ``ref_fp4_quant`` with ``get_reciprocal`` and ``cast_to_fp4``), written from its
    definition: fp32 ops in its order, thresholds of its e2m1 cast."""

    def reciprocal(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t == 0, torch.zeros_like(t), 1.0 / t)

    g = torch.tensor(gs, dtype=torch.float32)
    blocks = x.float().reshape(x.shape[0], -1, 16)
    vec_max = blocks.abs().amax(dim=-1, keepdim=True)
    scale = (g * (vec_max * reciprocal(torch.tensor(6.0)))).to(torch.float8_e4m3fn).float()
    output_scale = reciprocal(scale * reciprocal(g))
    clipped = torch.clamp(blocks * output_scale, -6.0, 6.0).reshape(x.shape)
    a = clipped.abs()
    # cast_to_fp4: <=0.25→0, <0.75→0.5, <=1.25→1, <1.75→1.5, <=2.5→2, <3.5→3, <=5→4, else 6
    magnitude = torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))
    return torch.sign(clipped) * magnitude, scale.squeeze(-1)


def test_nvfp4_matches_flashinfer_semantics_and_packs_low_nibble_first():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 64, generator=g) * 2).to(torch.bfloat16)
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # exact ties
    gs = nvfp4_global_scale(x.float().abs().max().item())
    codec = make_codec(WireFormat(D.NVFP4, 64), gs)
    q = codec.quantize(x)
    ref_values, ref_scales = _flashinfer_reference(x, gs)
    assert torch.equal(q.scale.float(), ref_scales)
    assert torch.equal(e2m1_unpack(q.data).abs(), ref_values.abs())
    byte = q.data[1, 0].item()
    assert (byte & 0x7) == _code(ref_values[1, 0].item()) and ((byte >> 4) & 0x7) == _code(ref_values[1, 1].item())


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), spread=st.floats(1e-3, 1e3), rows=st.integers(1, 17), blocks=st.integers(1, 24),
       gs_factor=st.sampled_from([1.0, 0.5, 0.01]))
def test_nvfp4_codec_is_bit_equal_to_flashinfers_reference_on_random_data(seed, spread, rows, blocks, gs_factor):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 16 * blocks, generator=g) * spread * torch.rand(rows, 1, generator=g)).to(torch.bfloat16)
    gs = nvfp4_global_scale(max(x.float().abs().max().item(), 1e-6)) * gs_factor
    q = make_codec(WireFormat(D.NVFP4, 16 * blocks), gs).quantize(x)
    ref_values, ref_scales = _flashinfer_reference(x, gs)
    assert torch.equal(q.scale.view(torch.uint8), ref_scales.to(torch.float8_e4m3fn).view(torch.uint8))
    values = e2m1_unpack(q.data)
    assert torch.equal(values.abs(), ref_values.abs())
    assert torch.equal(values[ref_values != 0].sign(), ref_values[ref_values != 0].sign())


def _code(v: float) -> int:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return grid.index(abs(v))  # magnitude bits; bit 3 is the sign


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_nvfp4_global_scale_must_be_positive_finite(bad):
    with pytest.raises(md.InvalidSpecError, match="input_global_scale"):
        md.QuantHints(input_global_scale=bad)


def test_nvfp4_codec_needs_a_global_scale():
    with pytest.raises(md.InvalidSpecError, match="global scale"):
        make_codec(WireFormat(D.NVFP4, 64))


def test_ue8m0_scales_round_up_exactly_even_just_above_a_power_of_two():
    """exp2(ceil(log2(s))) gives 2^16 for the float just above 2^16, and the block's largest
    value then clips at 448; the bit arithmetic DeepGEMM and DeepEP use never rounds down."""
    from moe_dispatch.backend import pow2_ceil

    powers = torch.tensor([2.0**-20, 2.0**-10, 1.0, 2.0**16])
    above = torch.nextafter(powers, torch.tensor(float("inf")))
    assert torch.equal(pow2_ceil(powers), powers)
    assert torch.equal(pow2_ceil(above), powers * 2)
    assert not bool((torch.exp2(torch.ceil(torch.log2(above))) >= above).all())  # why it is bit arithmetic
    x = torch.zeros(1, 128)
    x[0, 0] = float(above[3]) * FP8_MAX  # block amax / 448 is the float just above 2^16
    q = make_codec(WireFormat(D.FP8, 128, ue8m0=True)).quantize(x)
    assert float(q.scale) == 2.0**17 and float(q.data.float().abs().max()) < FP8_MAX


def test_ue8m0_bytes_decode_exactly_from_their_bits():
    """Byte e is 2^(e-127) exactly (0: the subnormal 2^-127; 255: NaN), built from bits rather
    than exp2, which a device need not compute exactly; the decode inverts pack_ue8m0."""
    from moe_dispatch.backend import ue8m0_value

    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = ue8m0_value(e)
    exact = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(v[:255].double(), exact) and bool(torch.isnan(v[255]))
    scales = v[1:255].reshape(2, 127)[:, :124]  # powers of two 2^-126 .. 2^123 (a whole number of words)
    assert torch.equal(unpack_ue8m0(pack_ue8m0(scales), scales.shape[-1]), scales)
