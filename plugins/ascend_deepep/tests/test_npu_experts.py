"""The torch_npu expert kernels (``NpuExperts``) on the CPU emulator of the torch_npu ops:
results per scheme against a mirror of their precision steps and against the core's reference
experts, the ops' documented semantics and constraints, the dtype each scheme asks dispatch
for, typed errors, and a whole layer on two gloo ranks behind the emulated DeepEP-Ascend.

Tolerances (relative L2 error, ``moe_dispatch_testing.relative_error``):

- ``mirror`` (< 1e-3): written here from the ops' documented formulas, it takes the kernel's
  precision steps (int8/int4 quantization of the activations with the same scale and rounding,
  bf16 where a gmm or ``npu_swiglu`` writes bf16, the dequantized weights) with another
  summation order. What may remain is a rare flip of a bf16 rounding (2^-8 of one element),
  which can move a row's requantization scale when it hits the row's largest element (a
  mirror with fp32 sums measured up to 8.5e-4 that way; this one sums quantized GEMMs in
  float64). Measured over seeds 1-5: 0 for W8A8, W4A8, W4A4; <= 7e-5 for BF16 and W4A16.
- ``md.TorchExperts`` on ``layer.dequantized()`` (same rows in, fp32 throughout): what is left
  is the kernel's own rounding between the GEMMs. BF16/W4A16: bf16 gmm outputs and SwiGLU
  (~0.004) → ``TOLERANCES[BF16]`` (0.01). W8A8/W4A8: the per-token int8 requantization of
  SwiGLU's output (heavy-tailed, ~1.5%) → ``TOLERANCES[INT8]`` (0.03). W4A4 quantizes its
  BF16 rows to int4 per token: step amax/7 with amax ≈ 3.5σ (H = 512..1024) is ~14% rms on
  gmm1's input, and SwiGLU multiplies two such noisy halves (~√2): ≈ 0.2, measured 0.19-0.245;
  ``W4A4_BOUND`` = 0.3.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch.backend import make_codec, quantize_weights_w8a8
from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.experts import (
    SCHEMES,
    NpuExpertLayer,
    NpuExperts,
    fp32_as_uint64,
    pack_int4,
    runner_probe,
    uint64_as_fp32,
    unpack_int4,
)
from moe_dispatch_ascend_deepep_testing import FAKE, TORCH_NPU_FAKE, ascend_backend
from moe_dispatch_ascend_deepep_testing.fakes import torch_npu as emu
from moe_dispatch_ascend_deepep_testing.layers import run_layer
from moe_dispatch_testing import TOLERANCES, random_expert_weights, relative_error

H, I, E = 512, 256, 4
COUNTS = [5, 0, 13, 2]  # uneven, with an empty expert
INT8, BF16 = md.DispatchDtype.INT8, md.DispatchDtype.BF16
NEEDS = {"w8a8": INT8, "w4a8": INT8, "w4a4": BF16, "w4a16": BF16, "bf16": BF16}
W4A4_BOUND = 0.3


def _weights(seed: int = 0, experts: int = E) -> md.ExpertWeights:
    return random_expert_weights(experts, H, I, generator=torch.Generator().manual_seed(seed))


def _rows(scheme: str, shape: tuple, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows as DeepEP-Ascend hands them over: INT8 through the core's codec, or BF16."""
    x = torch.randn(*shape, H, generator=torch.Generator().manual_seed(seed))
    if NEEDS[scheme] is BF16:
        return x.to(torch.bfloat16), None
    q = make_codec(mdb.WireFormat(INT8, H)).quantize(x)
    return q.data, q.scale


def _group_list(counts: list[int], group_list_type: int) -> torch.Tensor:
    c = torch.tensor(counts, dtype=torch.int64)
    return c if group_list_type == 1 else torch.cumsum(c, 0)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _int_quant(a: torch.Tensor, lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization: values round(a/s) clamped, s = max(amax, 1e-10)/hi."""
    s = a.abs().amax(-1, keepdim=True).clamp_min(1e-10) / hi
    return torch.round(a / s).clamp(lo, hi), s


def mirror(scheme: str, layer: NpuExpertLayer, x: torch.Tensor, scale: torch.Tensor | None,
           counts: list[int]) -> torch.Tensor:
    """The kernel's precision steps per expert, in the documented formula order (see the module
    docstring): a quantized GEMM sums integer values times the dequantized weights in float64
    (as exact as the NPU's int32 accumulation), rounds to fp32, then applies the per-token
    scale; bf16 where a gmm or ``npu_swiglu`` writes bf16."""
    w = layer.dequantized(torch.float64)
    out = torch.zeros(x.shape[0], H)
    start = 0
    for e, n in enumerate(counts):
        rows = x[start:start + n].float()
        s = None if scale is None else scale[start:start + n].unsqueeze(-1)
        if scheme == "w4a4":  # npu_dynamic_quant(dst_type=quint4x2)
            rows, s = _int_quant(rows, -8.0, 7.0)
        h1 = (rows.double() @ w.w13_weight[e].t()).float()
        if s is not None:
            h1 = h1 * s
        if scheme == "w8a8":  # npu_dequant_swiglu_quant: SwiGLU on the dequantized int32, requant ·127/amax
            gate, up = h1.chunk(2, dim=-1)
            act = F.silu(gate) * up
            amax = act.abs().amax(-1, keepdim=True).clamp_min(1e-10)
            act, s = torch.round(act * (127.0 / amax)), amax / 127.0
        else:  # gmm writes bf16, npu_swiglu writes bf16
            gate, up = _bf16(h1).chunk(2, dim=-1)
            act, s = _bf16(F.silu(gate) * up), None
            if scheme in ("w4a8", "w4a4"):  # npu_dynamic_quant
                act, s = _int_quant(act, -127.0, 127.0)
        y = (act.double() @ w.w2_weight[e].t()).float()
        out[start:start + n] = _bf16(y if s is None else y * s)
        start += n
    return out


def _apply(scheme: str, counts: list[int], group_list_type: int, seed: int = 1):
    experts = NpuExperts(scheme, TORCH_NPU_FAKE)
    layer = experts.process_weights(_weights(experts=len(counts)))
    x, scale = _rows(scheme, (sum(counts),), seed)
    group_list = _group_list(counts, group_list_type)
    out = experts.apply_without_routing_weights(layer, x, scale, group_list_type, group_list, torch.bfloat16)
    return experts, layer, x, scale, group_list, out


# -- results ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_each_scheme_matches_its_mirror_and_the_reference_experts(scheme, group_list_type):
    """PACKED rows with an empty expert, group lists of both types. If only the mirror check
    fails, the op sequence or a scale layout is wrong; if only the reference check fails, the
    kernel loses precision somewhere the mirror does not (see the module docstring)."""
    _, layer, x, scale, group_list, out = _apply(scheme, COUNTS, group_list_type)
    assert out.shape == (sum(COUNTS), H) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert relative_error(out, mirror(scheme, layer, x, scale, COUNTS)) < 1e-3
    ref = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), x, scale, group_list_type,
                                                          group_list, torch.float32)
    bound = W4A4_BOUND if scheme == "w4a4" else TOLERANCES[NEEDS[scheme]]
    assert relative_error(out, ref) < bound


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_local_expert_and_group_list_types_agree(scheme):
    """With one local expert a type-1 group list has length 1, which npu_grouped_matmul
    rejects (its doc); the kernel passes it as cumulative ends. Both types give the same rows."""
    outs = [_apply(scheme, [7], t)[-1] for t in (0, 1)]
    assert torch.equal(outs[0], outs[1])
    gl = torch.tensor([7], dtype=torch.int64)
    x, _ = _rows("bf16", (7,))
    with pytest.raises(AssertionError, match="length 1"):
        emu.npu_grouped_matmul([x], [torch.zeros(1, H, 8, dtype=torch.bfloat16)], split_item=2, group_type=0,
                               group_list=gl, group_list_type=1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_masked_rows_match_the_mirror_and_padding_is_zero(scheme):
    """MASKED ``[E, capacity, H]``: each expert's block runs as a group of ``capacity`` rows and
    the rows past its count come back exactly 0, whatever the padding rows held."""
    capacity, counts = 6, [3, 0, 6, 1]
    experts = NpuExperts(scheme, TORCH_NPU_FAKE)
    layer = experts.process_weights(_weights())
    x, scale = _rows(scheme, (E, capacity))
    out = experts.apply_without_routing_weights(layer, x, scale, 1, _group_list(counts, 1), torch.bfloat16)
    assert out.shape == (E, capacity, H)
    for e, n in enumerate(counts):
        assert (out[e, n:] == 0).all()
        if n:
            want = mirror(scheme, layer, x[e, :n], None if scale is None else scale[e, :n], [0] * e + [n])
            assert relative_error(out[e, :n], want) < 1e-3


@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_rows_give_an_empty_output_without_calling_the_ops(scheme):
    """DeepEP-Ascend hands over zero rows when nothing arrived; ``npu_swiglu`` takes no empty
    tensor, so the kernel must not call the ops."""
    experts = NpuExperts(scheme, TORCH_NPU_FAKE)
    layer = experts.process_weights(_weights())
    x, scale = _rows(scheme, (0,))
    experts.ops = types.SimpleNamespace()  # any op call would fail
    out = experts.apply_without_routing_weights(layer, x, scale, 1, _group_list([0] * E, 1), torch.bfloat16)
    assert out.shape == (0, H) and out.dtype == torch.bfloat16


# -- the weights ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme,w13,w2,s13,s2", [
    ("w8a8", (torch.int8, (E, H, 2 * I)), (torch.int8, (E, I, H)), (torch.float32, (E, 2 * I)),
     (torch.float32, (E, H))),
    ("w4a8", (torch.int32, (E, H, 2 * I // 8)), (torch.int32, (E, I, H // 8)),
     (torch.int64, (E, H // 256, 2 * I)), (torch.int64, (E, I // 256, H))),
    ("w4a4", (torch.int32, (E, H, 2 * I // 8)), (torch.int8, (E, I, H)), (torch.int64, (E, 2 * I)),
     (torch.float32, (E, H))),
    ("w4a16", (torch.int32, (E, H, 2 * I // 8)), (torch.int32, (E, I, H // 8)),
     (torch.bfloat16, (E, H // 128, 2 * I)), (torch.bfloat16, (E, I // 128, H))),
    ("bf16", (torch.bfloat16, (E, H, 2 * I)), (torch.bfloat16, (E, I, H)), None, None),
])
def test_process_weights_gives_the_npu_layouts(scheme, w13, w2, s13, s2):
    """Weights ``[E, K, N]`` (the core's transposed), int4 packed eight per int32 along N,
    uint64 scales as int64 with fp32 bits; ``dequantized()`` is within the scheme's weight
    quantization error of the original (int8 per channel ~1%, int4 ~13%)."""
    original = _weights()
    layer = NpuExperts(scheme, TORCH_NPU_FAKE).process_weights(original)

    def spec(t):
        return None if t is None else (t.dtype, tuple(t.shape))

    assert (spec(layer.w13_weight), spec(layer.w2_weight)) == (w13, w2)
    assert (spec(layer.w13_weight_scale), spec(layer.w2_weight_scale)) == (s13, s2)
    back = layer.dequantized()
    assert back.w13_weight.shape == (E, 2 * I, H) and back.w2_weight.shape == (E, H, I)
    bound = {"w8a8": 0.02, "bf16": 0.005}.get(scheme, 0.15)
    assert relative_error(back.w13_weight, original.w13_weight.float()) < bound
    assert relative_error(back.w2_weight, original.w2_weight.float()) < (0.02 if scheme == "w4a4" else bound)
    if scheme == "w4a8":  # CANN A8W4's required 8·Σ_k(w·s) (test_w4a8_scale_bias_is_8_times_the_k_sum_of_w_times_s)
        assert layer.w13_scale_bias.shape == (E, 2 * I) and layer.w13_scale_bias.dtype == torch.float32
    if scheme == "w4a16":
        assert torch.equal(layer.w13_weight_offset, torch.zeros_like(layer.w13_weight_scale))


def test_w8a8_takes_int8_checkpoint_weights_as_they_are():
    q = quantize_weights_w8a8(_weights())
    layer = NpuExperts("w8a8", TORCH_NPU_FAKE).process_weights(q)
    assert torch.equal(layer.w13_weight, q.w13_weight.transpose(1, 2))
    assert torch.equal(layer.w13_weight_scale, q.w13_weight_scale)


def test_int4_packing_and_uint64_scales():
    """``pack_int4`` (int8 pairs viewed as int32, sglang's W4A8 route) equals op-plugin's golden packer
    (the layout ``npu_convert_weight_to_int4pack`` returns; the op itself runs on NPU tensors only):
    element 8j+m in bits 4m..4m+3 of word j; uint64 scales carry the fp32 bits in the low word."""
    values = torch.randint(-8, 8, (6, 32), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 4)
    assert torch.equal(packed, emu.pack_golden(values))
    golden = torch.zeros(6, 4, dtype=torch.int64)
    for m in range(8):
        golden |= (values[:, m::8].to(torch.int64) & 0xF) << (4 * m)
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, golden)
    assert torch.equal(unpack_int4(packed).to(torch.int32), values)
    s = torch.rand(3, 5) + 0.01
    bits = fp32_as_uint64(s)
    assert bits.dtype == torch.int64 and bool(((bits >> 32) == 0).all()) and torch.equal(uint64_as_fp32(bits), s)
    with pytest.raises(AssertionError, match="int4"):
        emu.pack_golden(values * 2)
    with pytest.raises(AssertionError, match="multiple of 8"):
        emu.pack_golden(values[:, :12].contiguous())


# -- the emulated ops -------------------------------------------------------------------------------


def test_grouped_matmul_int8_accumulates_exactly_in_int32():
    """int8 x int8 with ``output_dtype=torch.int32`` and no scale (sglang's W8A8 gmm1): every
    product summed exactly, as the cube unit does (K·127² > 2^24, past fp32's exact range)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (9, 2048), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (2, 2048, 16), dtype=torch.int8, generator=g)
    out = emu.npu_grouped_matmul([x], [w], split_item=2, group_type=0, group_list=torch.tensor([4, 9]),
                                 group_list_type=0, output_dtype=torch.int32)[0]
    want = torch.cat([x[:4].long() @ w[0].long(), x[4:].long() @ w[1].long()])
    assert out.dtype == torch.int32 and torch.equal(out.long(), want)


def test_grouped_matmul_asserts_its_documented_constraints():
    """What the real op rejects (doc @07557e5, CANN): group lists covering more rows than x has (the
    kernel reads past x; fewer leave the rest unwritten), a decreasing cumulative list, int8 without
    an int32 output or with a scale whose dtype does not give the requested output, a transposed x;
    what is not emulated raises NotImplementedError."""
    x = torch.randint(-5, 5, (6, 32), dtype=torch.int8)
    w = torch.randint(-5, 5, (2, 32, 16), dtype=torch.int8)

    def gmm(group_list, group_list_type=1, **kw):
        kw.setdefault("output_dtype", torch.int32)
        return emu.npu_grouped_matmul([x], [w], split_item=kw.pop("split_item", 2), group_type=kw.pop("group_type", 0),
                                      group_list=group_list, group_list_type=group_list_type, **kw)

    with pytest.raises(RuntimeError, match="reads past x"):
        gmm(torch.tensor([4, 3]))
    with pytest.raises(RuntimeError, match="reads past x"):
        gmm(torch.tensor([2, 7]), 0)
    with pytest.raises(AssertionError, match="non-decreasing"):
        gmm(torch.tensor([4, 2]), 0)
    with pytest.raises(AssertionError, match="int64"):
        gmm(torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(AssertionError, match="int32"):
        gmm(torch.tensor([2, 4]), output_dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="float16"):  # a float32 scale gives float16 output
        gmm(torch.tensor([2, 4]), scale=[torch.ones(2, 16)], per_token_scale=[torch.ones(6)],
            output_dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="transposed"):
        emu.npu_grouped_matmul([x.t().contiguous().t()], [w], split_item=2, group_type=0,
                               group_list=torch.tensor([2, 4]), group_list_type=1, output_dtype=torch.int32)
    with pytest.raises(NotImplementedError):
        gmm(torch.tensor([2, 4]), split_item=0)
    with pytest.raises(NotImplementedError):
        gmm(torch.tensor([2, 4]), group_type=-1)


def test_dynamic_quant_is_the_core_codec_and_packs_int4():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q, s = emu.npu_dynamic_quant(x)
    ref = make_codec(mdb.WireFormat(INT8, 64)).quantize(x.float())
    assert torch.equal(q, ref.data) and torch.equal(s, ref.scale)
    q4, s4 = emu.npu_dynamic_quant(x, dst_type=torch.quint4x2)
    assert q4.dtype == torch.int32 and q4.shape == (5, 8) and s4.shape == (5,)
    assert torch.allclose(s4, x.float().abs().amax(-1) / 7)
    values = unpack_int4(q4).float()
    assert values.abs().max() <= 8 and torch.equal(values, torch.round(x.float() / s4[:, None]).clamp(-8, 7))
    with pytest.raises(AssertionError, match="float16 or bfloat16"):
        emu.npu_dynamic_quant(x.float())
    with pytest.raises(AssertionError, match="multiple of 8"):
        emu.npu_dynamic_quant(x[:, :12].contiguous(), dst_type=torch.quint4x2)


def test_dequant_swiglu_quant_follows_the_golden_with_count_groups():
    """op-plugin's golden: x·weight_scale·activation_scale, silu of the first half times the
    second (``activate_left``), then ·127/rowmax, rounded. ``group_index`` holds counts; rows past
    their sum are garbage (127 and NaN here)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-300, 300, (7, 256), dtype=torch.int32, generator=g)
    ws = torch.rand(2, 256, generator=g) * 0.01
    act = torch.rand(7, generator=g) * 0.02
    y, s = emu.npu_dequant_swiglu_quant(x, weight_scale=ws, activation_scale=act, group_index=torch.tensor([2, 3]),
                                        activate_left=True, quant_mode=1)
    res = x[:5].float() * torch.cat([ws[0].expand(2, -1), ws[1].expand(3, -1)]) * act[:5, None]
    out = F.silu(res[:, :128]) * res[:, 128:]
    amax = out.abs().amax(-1)
    assert torch.equal(y[:5], torch.round(out * (127.0 / amax)[:, None]).to(torch.int8))
    assert torch.allclose(s[:5], amax / 127.0)
    assert (y[5:] == 127).all() and torch.isnan(s[5:]).all()
    right, _ = emu.npu_dequant_swiglu_quant(x, weight_scale=ws, activation_scale=act, group_index=torch.tensor([2, 3]),
                                            activate_left=False, quant_mode=1)
    assert not torch.equal(right[:5], y[:5])
    with pytest.raises(AssertionError, match="weight_scale and activation_scale"):
        emu.npu_dequant_swiglu_quant(x, group_index=torch.tensor([2, 3]), quant_mode=1)
    with pytest.raises(AssertionError, match="multiple of 64"):
        emu.npu_dequant_swiglu_quant(x[:, :192].contiguous(), weight_scale=ws[:, :192].contiguous(),
                                     activation_scale=act, group_index=torch.tensor([2, 3]), quant_mode=1)
    with pytest.raises(AssertionError, match="out-of-bounds"):
        emu.npu_dequant_swiglu_quant(x, weight_scale=ws, activation_scale=act, group_index=torch.tensor([5, 3]),
                                     quant_mode=1)


def test_swiglu_activates_the_first_half_and_refuses_empty_tensors():
    x = torch.randn(3, 8).to(torch.bfloat16)
    assert torch.equal(emu.npu_swiglu(x), (F.silu(x.float()[:, :4]) * x.float()[:, 4:]).to(torch.bfloat16))
    with pytest.raises(AssertionError, match="empty"):
        emu.npu_swiglu(torch.empty(0, 8, dtype=torch.bfloat16))

# -- CANN's A8W4 (W4A8), the NPU-only int4 packer, and what the fake ops refuse as the vendor does --------------

E_, HB, IB = 2, 512, 256


def _w4a8_layer() -> tuple[NpuExperts, object]:
    experts = NpuExperts("w4a8", TORCH_NPU_FAKE)
    weights = random_expert_weights(E_, HB, IB, generator=torch.Generator().manual_seed(0))
    return experts, experts.process_weights(weights)



def test_w4a8_scale_bias_is_8_times_the_k_sum_of_w_times_s():
    """CANN A8W4 computes ((x − 8)@(w·s) + bias)·pts with bias = 8·Σ_k(w·s) required: zeros are wrong
    by 8·pts·Σ_k(w·s) on every output."""
    _, layer = _w4a8_layer()
    for w, s, b in ((layer.w13_weight, layer.w13_weight_scale, layer.w13_scale_bias),
                    (layer.w2_weight, layer.w2_weight_scale, layer.w2_scale_bias)):
        values = unpack_int4(w).double()  # [E, K, N]
        scale = uint64_as_fp32(s).double().repeat_interleave(values.shape[1] // s.shape[1], dim=1)
        assert torch.allclose(b.double(), 8 * (values * scale).sum(1), rtol=1e-6, atol=1e-6)



def test_the_fake_a8w4_gmm_needs_the_bias():
    experts, layer = _w4a8_layer()
    x = torch.randint(-127, 128, (6, HB), dtype=torch.int8)
    pts = torch.rand(6) * 0.01
    gl = torch.tensor([3, 3])

    def gmm(bias):  # type: ignore[no-untyped-def]
        return emu.npu_grouped_matmul([x], [layer.w13_weight], scale=[layer.w13_weight_scale], bias=bias,
                                           per_token_scale=[pts], group_list=gl, split_item=2, group_type=0,
                                           group_list_type=1, output_dtype=torch.bfloat16)[0]

    w = layer.dequantized(torch.float64).w13_weight  # [E, 2I, H]
    want = torch.cat([(x[:3].double() @ w[0].t()) * pts[:3, None].double(),
                      (x[3:].double() @ w[1].t()) * pts[3:, None].double()]).float()
    assert relative_error(gmm([layer.w13_scale_bias]), want) < 1e-2
    assert relative_error(gmm([torch.zeros_like(layer.w13_scale_bias)]), want) > 0.05
    with pytest.raises(AssertionError, match="bias"):
        gmm(None)



@pytest.mark.parametrize("group_list_type", [0, 1])
def test_w4a8_passes_counts_whatever_the_callers_type(group_list_type):
    """CANN's A8W4 reads group_list as counts whatever group_list_type says: cumulative ends read as counts
    multiply the wrong rows and read past x."""
    experts, layer = _w4a8_layer()
    counts = [5, 3]
    q = torch.randint(-127, 128, (8, HB), dtype=torch.int8)
    scale = torch.rand(8) * 0.01
    gl = torch.tensor(counts) if group_list_type else torch.cumsum(torch.tensor(counts), 0)
    out = experts.apply_without_routing_weights(layer, q, scale, group_list_type, gl, torch.bfloat16)
    ref = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), q, scale, group_list_type, gl,
                                                          torch.float32)
    assert relative_error(out, ref) < 0.03



def test_w4a8_group_size_and_k_limits():
    """CANN's A8W4 supports quantGroupSize 256 only, k % 64 == 0 and k <= 18432 (tiling GRAPH_FAILED)."""
    with pytest.raises(md.InvalidSpecError) as info:
        NpuExperts("w4a8", TORCH_NPU_FAKE, group_size=128)
    assert info.value.parameter == "group_size" and info.value.allowed == "256"
    with pytest.raises(md.InvalidInputError) as info:
        NpuExperts("w4a8", TORCH_NPU_FAKE).process_weights(random_expert_weights(1, 18688, 256))
    assert info.value.parameter == "hidden_size"



def test_the_fake_a8w4_tiling_limits():
    w = torch.zeros(1, 192, 8, dtype=torch.int32)  # K = 192: k % 64 == 0 but groups of 64
    x = torch.zeros(2, 192, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="quantGroupSize must be 256"):
        emu.npu_grouped_matmul([x], [w], scale=[torch.zeros(1, 3, 64, dtype=torch.int64)],
                                    bias=[torch.zeros(1, 64)], per_token_scale=[torch.ones(2)],
                                    group_list=torch.tensor([2]), split_item=2, group_type=0, group_list_type=0,
                                    output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 64"):
        emu.npu_grouped_matmul([torch.zeros(2, 96, dtype=torch.int8)], [torch.zeros(1, 96, 8, dtype=torch.int32)],
                                    scale=[torch.zeros(1, 1, 64, dtype=torch.int64)], bias=[torch.zeros(1, 64)],
                                    per_token_scale=[torch.ones(2)], group_list=torch.tensor([2]), split_item=2,
                                    group_type=0, group_list_type=0, output_dtype=torch.bfloat16)



def test_w4a16_never_runs_the_npu_only_op_on_cpu_weights():
    """npu_convert_weight_to_int4pack has an NPU kernel only: process_weights on CPU weights packed with
    it raised "Could not run 'npu::npu_convert_weight_to_int4pack' ... 'CPU' backend"."""
    with pytest.raises(NotImplementedError, match="CPU"):
        emu.npu_convert_weight_to_int4pack(torch.zeros(8, 8, dtype=torch.int32))
    layer = NpuExperts("w4a16", TORCH_NPU_FAKE).process_weights(
        random_expert_weights(2, HB, IB, generator=torch.Generator().manual_seed(0)))
    assert layer.w13_weight.dtype == torch.int32 and layer.w13_weight.device.type == "cpu"



def test_the_fake_ops_take_the_registered_schemas():
    """torch_npu.npu_X is torch.ops.npu.npu_X: `input`, not `self`/`x`, and the schemas' extra keywords."""
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert emu.npu_swiglu(input=x).shape == (2, 4)
    with pytest.raises(TypeError):
        emu.npu_swiglu(self=x)
    with pytest.raises(TypeError):
        emu.npu_dynamic_quant(x=x)
    emu.npu_dynamic_quant(x, quant_mode="pertoken", dst_type_max=0.0)
    with pytest.raises(NotImplementedError, match=r"\(fake\) round_mode"):
        emu.npu_dequant_swiglu_quant(torch.zeros(2, 128, dtype=torch.int32), weight_scale=torch.ones(1, 128),
                                          activation_scale=torch.ones(2), group_index=torch.tensor([2]),
                                          quant_mode=1, round_mode=1)
    assert v.schema_params(v.TORCH_NPU_SCHEMAS["npu_swiglu"]) == "(input, dim=-1)"
    blob = b"junk\x00" + v.TORCH_NPU_SCHEMAS["npu_swiglu"].encode() + b"\x00more"
    assert v.registered_schema(blob, "npu_swiglu") == v.TORCH_NPU_SCHEMAS["npu_swiglu"]



def test_a_group_list_covering_fewer_rows_leaves_the_rest_unwritten():
    x = torch.randn(5, 16).to(torch.bfloat16)
    w = torch.randn(2, 16, 8).to(torch.bfloat16)
    y = emu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 1]), split_item=2, group_type=0,
                                    group_list_type=1)[0]
    assert torch.isfinite(y[:3].float()).all() and torch.isnan(y[3:].float()).all()
    with pytest.raises(RuntimeError, match="reads past x"):
        emu.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 2]), split_item=2, group_type=0,
                                    group_list_type=1)



def test_what_cann_and_the_docs_refuse():
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.zeros(1, 32, 1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="antiquantOffset"):
        emu.npu_grouped_matmul([x], [w], antiquant_scale=[torch.ones(1, 1, 8, dtype=torch.bfloat16)],
                                    group_list=torch.tensor([4]), split_item=2, group_type=0, group_list_type=0)
    with pytest.raises(AssertionError, match="contiguous"):
        emu.npu_swiglu(torch.randn(8, 4).t().to(torch.bfloat16))
    with pytest.raises(AssertionError, match="smooth_scales"):
        emu.npu_dynamic_quant(x, smooth_scales=torch.ones(32, dtype=torch.float16))


# -- the dtype each scheme asks for -----------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_needs_dispatch_dtype_and_quant_hints(scheme):
    experts = NpuExperts(scheme, TORCH_NPU_FAKE)
    assert isinstance(experts, md.ExpertKernel)
    assert experts.needs_dispatch_dtype is NEEDS[scheme]
    assert experts.quant_hints() == md.QuantHints(dispatcher_output_dtype=NEEDS[scheme])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_resolution_sends_what_the_scheme_needs(scheme, mode):
    """The hint decides (resolution step 4) on the emulated DeepEP-Ascend, whose default is
    BF16; with ``runner`` named, the registered runner's combinations are checked too."""
    experts = NpuExperts(scheme, TORCH_NPU_FAKE)
    backend = ascend_backend(FAKE, env={})
    for runner in (None, experts.runner):
        spec = md.DispatchSpec(1024, 8, 2, mode=mode, quant=experts.quant_hints(), runner=runner)
        resolution = mdp.resolve_output_dtype(spec, backend, env={}, runners=md.PluginHost(env={}).runners())
        assert resolution.dtype is NEEDS[scheme]
        decided = [s for s in resolution.steps if s.decided]
        assert decided[0].source == "quant.dispatcher_output_dtype" and decided[0].value == NEEDS[scheme].value
        assert "quant.dispatcher_output_dtype" in str(resolution)


def test_the_registered_runners():
    runners = md.PluginHost(env={}).runners()
    for scheme in SCHEMES:
        runner = runners[f"npu_{scheme}"]
        assert runner.needs is NEEDS[scheme] and runner.accepts == {NEEDS[scheme]}
        assert runner.backends == {"ascend_deepep": frozenset({md.Mode.NORMAL, md.Mode.LOW_LATENCY})}
    assert runner_probe(TORCH_NPU_FAKE) is None
    assert "moe-dispatch-ascend-deepep[npu]" in runner_probe("no_such_torch_npu")
    spec = md.DispatchSpec(1024, 8, 2, output_dtype="bf16", runner="npu_w8a8")
    with pytest.raises(md.InvalidSpecError) as info:  # BF16 rows cannot feed the W8A8 GEMMs
        mdp.resolve_output_dtype(spec, ascend_backend(FAKE, env={}), env={}, runners=runners)
    assert info.value.parameter == "output_dtype"


# -- typed errors -----------------------------------------------------------------------------------


def test_a_missing_torch_npu_says_how_to_install_it():
    with pytest.raises(md.BackendUnavailableError) as info:
        NpuExperts("w8a8", "no_such_torch_npu_module")
    e = info.value
    assert e.parameter == "runner" and e.value == "npu_w8a8"
    assert 'pip install "moe-dispatch-ascend-deepep[npu]" "torch==' in str(e) and "CANN" in str(e)
    with pytest.raises(md.BackendUnavailableError, match="npu_dequant_swiglu_quant") as info:
        NpuExperts("w8a8", types.SimpleNamespace(npu_grouped_matmul=print, __name__="old_torch_npu"))
    assert info.value.value == "npu_w8a8"
    NpuExperts("bf16", types.SimpleNamespace(npu_grouped_matmul=print, npu_swiglu=print))  # has what bf16 calls


def test_wrong_inputs_are_typed_errors():
    w8a8, bf16 = NpuExperts("w8a8", TORCH_NPU_FAKE), NpuExperts("bf16", TORCH_NPU_FAKE)
    l8, lb = w8a8.process_weights(_weights()), bf16.process_weights(_weights())
    counts = _group_list(COUNTS, 1)
    x8, s8 = _rows("w8a8", (sum(COUNTS),))
    xb, _ = _rows("bf16", (sum(COUNTS),))

    def error(kernel, layer, x, scale, group_list=counts, group_list_type=1) -> md.InvalidInputError:
        with pytest.raises(md.InvalidInputError) as info:
            kernel.apply_without_routing_weights(layer, x, scale, group_list_type, group_list, torch.bfloat16)
        return info.value

    e = error(w8a8, l8, xb, None)
    assert e.parameter == "hidden_states" and "torch.int8" in e.allowed and "quant_hints" in str(e)
    e = error(bf16, lb, x8, s8)
    assert e.parameter == "hidden_states" and "torch.bfloat16" in e.allowed
    assert error(w8a8, l8, x8, None).parameter == "hidden_states_scale"  # missing scales
    assert error(w8a8, l8, x8, s8[:3]).parameter == "hidden_states_scale"
    assert error(w8a8, l8, x8, s8.to(torch.bfloat16)).parameter == "hidden_states_scale"
    assert error(bf16, lb, xb, s8).parameter == "hidden_states_scale"
    assert error(w8a8, l8, x8, s8, counts[:2]).parameter == "group_list"
    assert error(w8a8, l8, x8, s8, counts.float()).parameter == "group_list"
    assert error(w8a8, l8, x8, s8, counts + 1).parameter == "group_list"  # does not sum to the rows
    assert error(w8a8, l8, x8, s8, torch.tensor([5, 4, 20, 20]), 0).parameter == "group_list"  # decreasing step
    assert error(w8a8, l8, x8, s8, counts, 2).parameter == "group_list_type"
    assert error(w8a8, lb, x8, s8).parameter == "layer"
    assert error(w8a8, _weights(), x8, s8).parameter == "layer"
    assert error(bf16, lb, xb[:, :256].contiguous(), None).parameter == "hidden_states"
    xm, _ = _rows("bf16", (E, 4))
    assert error(bf16, lb, xm, None, torch.tensor([1, 5, 0, 0])).parameter == "group_list"  # over capacity
    with pytest.raises(md.InvalidInputError) as info:
        w8a8.process_weights(random_expert_weights(2, 256, 96))
    assert info.value.parameter == "intermediate_size"
    with pytest.raises(md.InvalidInputError) as info:
        NpuExperts("w4a16", TORCH_NPU_FAKE, group_size=96).process_weights(_weights())
    assert info.value.parameter == "hidden_size"
    with pytest.raises(md.InvalidSpecError):
        NpuExperts("w8a8", TORCH_NPU_FAKE, group_size=128)
    with pytest.raises(md.InvalidSpecError):
        NpuExperts("w4", TORCH_NPU_FAKE)


# -- a whole layer on two ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dispatch_npu_experts_combine_agrees_with_the_dense_reference(moe_rank_pools, scheme, mode):
    """Emulated DeepEP-Ascend with the spec built from ``quant_hints()``, the kernel on each
    rank's experts, combine: within the wire dtype's tolerance of ``moe_dispatch_testing.reference_moe`` on the
    dequantized weights (W4A4: ``W4A4_BOUND``, its rows are int4). Measured at H=1024, I=256,
    seeds 0-2: W8A8 0.019-0.021 (input int8 + the requantization between the GEMMs, against
    0.03), W4A8 0.018-0.021, BF16 and W4A16 ~0.004 (against 0.01), W4A4 0.20-0.245."""
    results = moe_rank_pools.get(2).map(run_layer, scheme, mode, TORCH_NPU_FAKE, FAKE, 1024, 256, 2, 2, 8)
    for r in results:
        assert r.dtype == NEEDS[scheme].value, r.resolution
        assert r.decided_by == "quant.dispatcher_output_dtype", r.resolution
        bound = W4A4_BOUND if scheme == "w4a4" else r.tolerance
        assert r.relative_error < bound, (r.relative_error, bound)
