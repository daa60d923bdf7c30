"""The DeepGEMM expert kernel on the CPU emulator of ``deep_gemm``: results against the core's
reference experts, the contiguous layout's padding, UE8M0 scales, both API generations, typed
errors, the dtype it asks dispatch for, and a whole layer on two gloo ranks.

Tolerances. The kernel rounds gmm1's output to bf16, re-quantizes SwiGLU's output to FP8 (e4m3:
3 mantissa bits, up to 2^-4 relative error per element) and writes bf16. Against
``md.TorchExperts`` (fp32 throughout, same FP8 input, same dequantized weights) the FP8 path is
held to the library's FP8 bound (``TOLERANCES[FP8]`` = 0.06; it measures ~0.02) and the BF16
path to ``TOLERANCES[BF16]`` = 0.01 (three bf16 roundings, ~0.004). The tight check is
``mirror``: a reference written here that takes the same precision steps; only fp32
summation order differs, which flips a rare bf16 rounding (2^-8 of one element), so its
relative error must stay below 1e-3.

The fakes are as strict as DeepGEMM where the runner meets it (pybind conversions, layouts, whole-tile stores, each
version's signatures and scale casts): what the runner refuses, and why, is checked against them.
"""

import importlib
import inspect
import subprocess
import types

import pytest
import torch
import torch.nn.functional as F

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch.backend import dequantize_rows, make_codec, pack_ue8m0, pow2_ceil, row_experts
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import (
    DeepGemmExperts,
    DeepGemmLayer,
    detect,
    quantize_block_fp8,
    quantize_per_token_group,
    runner_probe,
)
from moe_dispatch_cuda_deepep_testing import (
    DEEP_GEMM_EMULATOR,
    DEEP_GEMM_EMULATOR_SM100,
    DEEP_GEMM_V1_EMULATOR,
    DEEP_GEMM_V1_KERNELS,
    DEEP_GEMM_V1_PYPI_EMULATOR,
)
from moe_dispatch_cuda_deepep_testing import EMULATOR as DEEPEP_EMULATOR
from moe_dispatch_cuda_deepep_testing.fakes import _native
from moe_dispatch_cuda_deepep_testing.fakes import deep_gemm as emu
from moe_dispatch_cuda_deepep_testing.fakes import deep_gemm_sm100 as emu100
from moe_dispatch_cuda_deepep_testing.fakes import deep_gemm_v1 as emu_v1
from moe_dispatch_cuda_deepep_testing.fakes.deep_gemm_v1_kernels import run_contiguous
from moe_dispatch_cuda_deepep_testing.selfcheck import run_layer
from moe_dispatch_cuda_deepep_testing.support import fake_module
from moe_dispatch_testing.accuracy import TOLERANCES, relative_error
from moe_dispatch_testing.routing import random_expert_weights

SM90, SM100, V1 = DEEP_GEMM_EMULATOR, DEEP_GEMM_EMULATOR_SM100, DEEP_GEMM_V1_EMULATOR

H, I, E = 256, 128, 4
PACKED_COUNTS = [5, 0, 130, 1]  # uneven, an empty expert, none a multiple of 128
#: A capacity every DeepGEMM's masked BLOCK_M divides (v1 and 2.0.x may pick 256).
MASKED_COUNTS, CAPACITY = [3, 0, 8, 1], 256
LL, NORMAL = md.Mode.LOW_LATENCY, md.Mode.NORMAL


def _weights(seed: int = 0) -> md.ExpertWeights:
    return random_expert_weights(E, H, I, generator=torch.Generator().manual_seed(seed))


def _rows(kind: str, shape: tuple, ue8m0: bool = False, seed: int = 1):
    """Activations as dispatch hands them over: FP8 through the core's codec, or BF16."""
    x = torch.randn(*shape, H, generator=torch.Generator().manual_seed(seed))
    if kind == "bf16":
        return x.to(torch.bfloat16), None
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, H, ue8m0=ue8m0)).quantize(x)
    return q.data, q.scale


def _group_list(counts: list[int], group_list_type: int) -> torch.Tensor:
    c = torch.tensor(counts, dtype=torch.int64)
    return c if group_list_type == 1 else torch.cumsum(c, 0)


def mirror(layer: DeepGemmLayer, x: torch.Tensor, scale, counts: list[int]) -> torch.Tensor:
    """The kernel's precision steps, written independently: fp32 GEMM on dequantized operands →
    bf16 → SwiGLU in fp32 → (FP8 per row and 128 channels, scale max(amax,1e-10)/448, powers of
    two for UE8M0 | bf16) → fp32 GEMM → bf16. Rows past a MASKED count are zero."""
    w = layer.dequantized()
    xf = dequantize_rows(x, scale, H)
    masked = x.dim() == 3
    out = torch.zeros(*xf.shape[:-1], H)
    start = 0
    for e, n in enumerate(counts):
        rows = xf[e, :n] if masked else xf[start : start + n]
        h1 = (rows @ w.w13_weight[e].t()).to(torch.bfloat16).float()
        gate, up = h1.chunk(2, dim=-1)
        act = F.silu(gate) * up
        if layer.weights == "block_fp8":
            blocks = act.unflatten(-1, (-1, 128))
            s = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
            if layer.ue8m0:
                s = pow2_ceil(s)
            act = ((blocks / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2)
        else:
            act = act.to(torch.bfloat16).float()
        y = (act @ w.w2_weight[e].t()).to(torch.bfloat16).float()
        if masked:
            out[e, :n] = y
        else:
            out[start : start + n] = y
        start += n
    return out


def test_rows_past_the_counts_are_padding_and_dense_rows_are_refused_under_capture():
    """Low latency's worst-case rows (``DispatchOutput``): the dense path runs the counts' rows and gives zeros past
    them; under CUDA-graph capture it cannot read the counts (a host read) and says to ask for aligned rows, instead
    of a CUDA error inside the capture."""
    from moe_dispatch_cuda_deepep_testing.fakes.deep_ep import CUDAGraph

    experts = DeepGemmExperts("bf16", "low_latency", SM90)
    layer = experts.process_weights(_weights())
    valid = sum(PACKED_COUNTS)
    x, scale = _rows("bf16", (valid + 5,))
    x[valid:] = float("nan")  # unwritten
    group_list = _group_list(PACKED_COUNTS, 1)
    out = experts.apply_without_routing_weights(layer, x, scale, 1, group_list, torch.bfloat16)
    exact = experts.apply_without_routing_weights(layer, x[:valid], scale, 1, group_list, torch.bfloat16)
    assert torch.equal(out[:valid], exact) and bool(out[valid:].eq(0).all())
    with CUDAGraph().capture(), pytest.raises(md.InvalidInputError) as info:
        experts.apply_without_routing_weights(layer, x, scale, 1, group_list, torch.bfloat16)
    assert info.value.parameter == "expert_alignment" and "capture" in str(info.value)


@pytest.mark.parametrize("kind", ["block_fp8", "bf16"])
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_packed_rows_match_the_reference_experts(kind, group_list_type):
    """PACKED through the contiguous GEMM (padded to 128-row segments, gathered back). If this
    fails only for FP8, check the re-quantization between the GEMMs; if the emulator asserts,
    the padding of each expert's rows is wrong."""
    experts = DeepGemmExperts(kind, NORMAL, SM90)
    layer = experts.process_weights(_weights())
    x, scale = _rows(kind, (sum(PACKED_COUNTS),))
    group_list = _group_list(PACKED_COUNTS, group_list_type)
    out = experts.apply_without_routing_weights(layer, x, scale, group_list_type, group_list, torch.bfloat16)
    assert out.shape == (sum(PACKED_COUNTS), H) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert relative_error(out, mirror(layer, x, scale, PACKED_COUNTS)) < 1e-3
    ref = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), x, scale, group_list_type, group_list,
                                                          torch.float32)
    dtype = md.DispatchDtype.FP8 if kind == "block_fp8" else md.DispatchDtype.BF16
    assert relative_error(out, ref) < TOLERANCES[dtype]


@pytest.mark.parametrize("kind", ["block_fp8", "bf16"])
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_masked_rows_match_the_reference_and_padding_is_zero(kind, group_list_type):
    """MASKED through the masked GEMM; rows past each expert's count must come back exactly 0
    (DeepGEMM leaves them as they were)."""
    experts = DeepGemmExperts(kind, LL, SM90)
    layer = experts.process_weights(_weights())
    x, scale = _rows(kind, (E, CAPACITY))
    if scale is not None:
        scale = scale.transpose(1, 2).contiguous().transpose(1, 2)  # column-major, as DeepEP's LL hands it over
    group_list = _group_list(MASKED_COUNTS, group_list_type)
    out = experts.apply_without_routing_weights(layer, x, scale, group_list_type, group_list, torch.bfloat16)
    assert out.shape == (E, CAPACITY, H)
    for e, n in enumerate(MASKED_COUNTS):
        assert torch.equal(out[e, n:], torch.zeros_like(out[e, n:])), f"expert {e}: rows past {n} are not zero"
    assert relative_error(out, mirror(layer, x, scale, MASKED_COUNTS)) < 1e-3
    ref = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), x, scale, group_list_type, group_list,
                                                          torch.float32)
    dtype = md.DispatchDtype.FP8 if kind == "block_fp8" else md.DispatchDtype.BF16
    assert relative_error(out, ref) < TOLERANCES[dtype]


def test_no_rows_at_all():
    experts = DeepGemmExperts("block_fp8", NORMAL, SM90)
    layer = experts.process_weights(_weights())
    x, scale = _rows("block_fp8", (0,))
    out = experts.apply_without_routing_weights(layer, x, scale, 1, torch.zeros(E, dtype=torch.int64), torch.bfloat16)
    assert out.shape == (0, H)


@pytest.mark.parametrize("layout", ["packed", "masked"])
def test_ue8m0_packed_scales_give_the_fp32_power_of_two_result(layout):
    """SM100 hands scales over as int32 words of four exponent bytes; the same powers of two as
    fp32 must give the identical result (the intermediate is then packed too)."""
    experts = DeepGemmExperts("block_fp8", LL, SM100)
    assert experts.ue8m0  # chosen by the (emulated) device
    layer = experts.process_weights(_weights())
    assert layer.ue8m0 and torch.equal(torch.log2(layer.w13_weight_scale_inv).round(), torch.log2(
        layer.w13_weight_scale_inv))
    shape, counts = ((sum(PACKED_COUNTS),), PACKED_COUNTS) if layout == "packed" else ((E, CAPACITY), MASKED_COUNTS)
    x, scale = _rows("block_fp8", shape, ue8m0=True)
    group_list = _group_list(counts, 1)
    fp32 = experts.apply_without_routing_weights(layer, x, scale, 1, group_list, torch.bfloat16)
    packed = pack_ue8m0(scale)
    if layout == "masked":
        packed = packed.transpose(1, 2).contiguous().transpose(1, 2)
    assert packed.dtype == torch.int32
    ue8m0 = experts.apply_without_routing_weights(layer, x, packed, 1, group_list, torch.bfloat16)
    assert torch.equal(fp32, ue8m0)
    assert relative_error(fp32, mirror(layer, x, scale, counts)) < 1e-3


@pytest.mark.parametrize("layout", ["packed", "masked"])
def test_the_v1_api_gives_the_same_result(layout):
    """The old generation's names (``m_grouped_gemm_fp8_fp8_bf16_nt_*``) are called with their
    own argument lists."""
    mode = NORMAL if layout == "packed" else LL
    v2, v1 = DeepGemmExperts("block_fp8", mode, SM90), DeepGemmExperts("block_fp8", mode, V1)
    assert v1.info.generation == "v1"
    layer = v2.process_weights(_weights())
    shape, counts = ((sum(PACKED_COUNTS),), PACKED_COUNTS) if layout == "packed" else ((E, CAPACITY), MASKED_COUNTS)
    x, scale = _rows("block_fp8", shape)
    args = (layer, x, scale, 1, _group_list(counts, 1), torch.bfloat16)
    assert torch.equal(v2.apply_without_routing_weights(*args), v1.apply_without_routing_weights(*args))


def test_block_fp8_weights_keep_one_scale_per_128x128_block():
    w = _weights().w13_weight.float()
    layer = DeepGemmExperts("block_fp8", NORMAL, SM90).process_weights(_weights())
    assert layer.w13_weight.dtype == torch.float8_e4m3fn and layer.w13_weight.shape == (E, 2 * I, H)
    assert layer.w13_weight_scale_inv.shape == (E, 2 * I // 128, H // 128)
    assert layer.w2_weight.shape == (E, H, I) and layer.w2_weight_scale_inv.shape == (E, H // 128, I // 128)
    block = w[1, 128:256, 128:256]
    assert torch.allclose(layer.w13_weight_scale_inv[1, 1, 1], block.abs().max() / 448.0)
    assert relative_error(layer.dequantized().w13_weight, w) < 0.05
    bf16 = DeepGemmExperts("bf16", LL, SM90).process_weights(_weights())
    assert bf16.w13_weight.dtype == torch.bfloat16 and bf16.w13_weight_scale_inv is None


def _fp8_operands(m: int, g: int = 2, n: int = 128, k: int = 256):
    gen = torch.Generator().manual_seed(3)
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, k)).quantize(torch.randn(m, k, generator=gen))
    a, sa = q.data, q.scale
    b, sb = quantize_block_fp8(torch.randn(g, n, k, generator=gen))
    return a, sa, b, sb


def test_the_fake_checks_the_contiguous_layout():
    """A kernel that forgot to pad the PACKED rows hands DeepGEMM 130 rows: it computes garbage; the fake
    refuses. DeepGEMM's own host asserts raise RuntimeError (pybind's translation of DGException)."""
    a, sa, b, sb = _fp8_operands(130)
    d = torch.empty(130, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="blocks of"):
        emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, torch.zeros(130, dtype=torch.int32))
    a, sa, b, sb = _fp8_operands(256)
    two_groups = torch.cat([torch.zeros(100), torch.ones(156)]).to(torch.int32)  # group 1 starts mid-block
    with pytest.raises(RuntimeError, match="first row"):
        emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), torch.empty(256, 128, dtype=torch.bfloat16), two_groups)
    with pytest.raises(RuntimeError, match="Assertion error"):
        emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, torch.zeros(256, dtype=torch.int32))  # d: 130 rows
    with pytest.raises(RuntimeError, match="grouped_layout.scalar_type"):
        emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), torch.empty(256, 128, dtype=torch.bfloat16),
                                             torch.zeros(256, dtype=torch.int64))


def test_the_fake_computes_the_contiguous_gemm_and_poisons_padding():
    a, sa, b, sb = _fp8_operands(256)
    m_indices = torch.cat([torch.ones(100), -torch.ones(28), torch.zeros(128)]).to(torch.int32)
    d = torch.empty(256, 128, dtype=torch.bfloat16)
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices)
    af = a.float() * sa.repeat_interleave(128, dim=1)
    bf = b.float() * sb.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    assert torch.equal(d[:100], (af[:100] @ bf[1].t()).to(torch.bfloat16))
    assert torch.equal(d[128:], (af[128:] @ bf[0].t()).to(torch.bfloat16))
    assert torch.isnan(d[100:128]).all()  # unspecified on SM90: reading it must show
    # DeepGEMM v1 before #113 read a block's group from its first row: -1 there was an illegal address.
    first_padding = torch.cat([-torch.ones(28), torch.ones(100), torch.zeros(128)]).to(torch.int32)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_contiguous(a, sa, b, sb, d, first_padding, 128, skips_negative=False)


def test_the_fake_masked_gemm_writes_whole_tiles():
    """Rows up to the end of the last BLOCK_M tile are written (garbage past ``masked_m``); another group's rows only
    when the tile passes ``m`` (``test_masked_capacity_is_a_multiple_of_every_block_m``)."""
    a, sa, b, sb = _fp8_operands(2 * 128)
    a, sa = a.view(2, 128, 256), sa.view(2, 128, 2)
    d = torch.full((2, 128, 128), 7.0, dtype=torch.bfloat16)
    emu.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0], dtype=torch.int32), 2)
    assert torch.isnan(d[0, 3:]).all() and (d[1] == 7).all() and not torch.isnan(d[0, :3]).any()
    with pytest.raises(RuntimeError, match="expected_m > 0"):
        emu.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0], dtype=torch.int32), 0)
    with pytest.raises(TypeError, match="incompatible"):  # pybind: expected_m is an int
        emu.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0], dtype=torch.int32), 2.0)
    with pytest.raises(TypeError):  # a keyword DeepGEMM does not have
        emu.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0], dtype=torch.int32), 2, m_indices=1)
    with pytest.raises(AssertionError):  # v1: a Python assert on masked_m's dtype
        emu_v1.m_grouped_gemm_fp8_fp8_bf16_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0]), 2)


def test_the_fake_scale_formats_per_architecture():
    """SM90 takes fp32 only. SM100 takes packed UE8M0 (MN-major, TMA-aligned) and casts fp32 to UE8M0: DeepGEMM 2.6.1
    device-asserts powers of two; before it the CUDA cast ORs the later values' mantissa bits into the packed bytes
    (garbage exponents); only its PyTorch fallback keeps the exponent."""
    a, _, b, sb = _fp8_operands(128)
    x = torch.randn(128, 256, generator=torch.Generator().manual_seed(5))
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, 256, ue8m0=True)).quantize(x)
    ids = torch.zeros(128, dtype=torch.int32)
    d_ref, d_int = (torch.empty(128, 128, dtype=torch.bfloat16) for _ in range(2))
    assert emu100.get_tma_aligned_size(128, 4) == 128 and emu100.get_tma_aligned_size(130, 4) == 132
    packed = torch.zeros(1, 128, dtype=torch.int32).t()  # MN-major: what DeepEP and the runner hand over
    packed.copy_(pack_ue8m0(q.scale))
    with pytest.raises(RuntimeError, match="Unknown SF transformation|kFloat"):  # SM90: no UE8M0
        emu.m_grouped_fp8_gemm_nt_contiguous((q.data, packed), (b, sb), d_int, ids)
    pow2_sb = torch.exp2(torch.floor(torch.log2(sb)))
    emu.m_grouped_fp8_gemm_nt_contiguous((q.data, q.scale), (b, pow2_sb), d_ref, ids)
    emu100.m_grouped_fp8_gemm_nt_contiguous((q.data, packed), (b, pow2_sb), d_int, ids)
    assert torch.equal(d_ref, d_int)
    with pytest.raises(RuntimeError, match="unspecified launch failure"):  # 2.6.1: non-power-of-two fp32 SFB traps
        emu100.m_grouped_fp8_gemm_nt_contiguous((q.data, packed), (b, sb), d_int, ids)
    with pytest.raises(RuntimeError, match="context was lost"):  # and the process's CUDA context is gone
        emu100.m_grouped_fp8_gemm_nt_contiguous((q.data, packed), (b, pow2_sb), d_int, ids)
    _native.reset_context()  # a new process
    old = emu.emulate((10, 0), "2.5.0")
    getattr(old, vendor.DG_FP8_CONTIGUOUS)((q.data, packed), (b, pow2_sb), d_int, ids)
    assert torch.equal(d_ref, d_int)  # powers of two: the cast is exact
    getattr(old, vendor.DG_FP8_CONTIGUOUS)((q.data, packed), (b, sb), d_int, ids)  # garbage exponents
    assert not torch.equal(d_ref, d_int)
    with pytest.raises(RuntimeError, match="stride"):  # row-major packed SFA: not TMA-aligned MN-major
        emu100.m_grouped_fp8_gemm_nt_contiguous((q.data, pack_ue8m0(q.scale)), (b, pow2_sb), d_int, ids)
    with pytest.raises(RuntimeError, match="Unsupported architecture or scaling factor types"):
        emu100.m_grouped_fp8_gemm_nt_contiguous((q.data, q.scale), (b, pow2_sb), d_int, ids, disable_ue8m0_cast=True)


def test_sm90_activation_scales_reach_deep_gemm_laid_out():
    """On SM90 the runner hands DeepGEMM both GEMMs' fp32 activation scales MN-major and TMA-aligned (torch ops,
    ``vendor.dg_mn_major``), in every layout: DeepGEMM's transform keeps them (deepseek-ai/DeepGEMM@54e2261
    csrc/apis/layout.hpp:41-42, csrc/jit_kernels/impls/smxx_layout.hpp:123-125) and JIT-compiles no ``transpose_fp32``
    kernel, which was the first kernel of the first call that segfaulted on the H100. The fake records each scale
    tensor it had to lay out, and takes both layouts with the same result."""
    from moe_dispatch import DispatchOutput
    from moe_dispatch.backend import align_rows

    a, sa, b, sb = _fp8_operands(128)  # the fake's record: row-major (its JIT kernel), non-contiguous (torch), laid out
    ids = torch.zeros(128, dtype=torch.int32)
    outs = []
    emu.sf_transforms.clear()
    for scale in (sa, torch.cat([sa, sa], 1)[:, :2], vendor.dg_mn_major(emu, sa)):
        outs.append(torch.empty(128, 128, dtype=torch.bfloat16))
        emu.m_grouped_fp8_gemm_nt_contiguous((a, scale), (b, sb), outs[-1], ids)
    assert emu.sf_transforms == ["transpose_fp32", "copy_"] and all(torch.equal(outs[0], o) for o in outs)
    laid = vendor.dg_mn_major(emu, sa)
    assert laid.stride() == (1, 128) and torch.equal(laid, sa) and emu.get_mn_major_tma_aligned_tensor(laid) is laid

    layer_weights = _weights()
    for mode, options, counts, aligned in (("normal", {}, PACKED_COUNTS, False), ("normal", {}, [0, 130, 0, 5], True),
                                           ("normal", {"psum_layout": False}, [0, 130, 0, 5], True),
                                           ("low_latency", {}, MASKED_COUNTS, False)):
        experts = DeepGemmExperts("block_fp8", mode, SM90, **options)
        layer = experts.process_weights(layer_weights)
        x, scale = _rows("block_fp8", (E, CAPACITY) if mode == "low_latency" else (sum(counts),))
        group_list, alignment = torch.tensor(counts), 1
        if aligned:
            none = torch.zeros(0, 1, dtype=torch.int64)
            out = align_rows(DispatchOutput(x, scale, none, none.float(), group_list, 1, md.Layout.PACKED,
                                            md.DispatchDtype.FP8, None), experts.expert_alignment)
            x, scale, alignment = out.hidden_states, out.hidden_states_scale, experts.expert_alignment
        emu.sf_transforms.clear()
        y = experts.apply_without_routing_weights(layer, x, scale, 1, group_list, torch.bfloat16,
                                                  expert_alignment=alignment)
        assert emu.sf_transforms == [], (mode, options, aligned, emu.sf_transforms)
        assert bool(torch.isfinite(y[row_experts(group_list, alignment, y.shape[0]) >= 0] if aligned else y).all())


def test_detect_reads_the_api_generation():
    v2 = detect(SM90)
    assert (v2.generation, v2.has_bf16, v2.error) == ("v2", True, None) and "v2" in v2.describe()
    v1 = detect(V1)
    assert (v1.generation, v1.has_bf16) == ("v1", False) and "without BF16" in v1.describe()
    early = detect(types.SimpleNamespace(fp8_m_grouped_gemm_nt_masked=print, m_grouped_fp8_gemm_nt_contiguous=print))
    assert (early.generation, early.has_bf16) == ("v2", False)
    assert detect(types.SimpleNamespace()).generation is None
    missing = detect("no_such_deep_gemm_module")
    assert missing.module is None and "ModuleNotFoundError" in missing.error and "not importable" in missing.describe()


def test_a_missing_deep_gemm_says_how_to_install_it():
    with pytest.raises(md.BackendUnavailableError) as info:
        DeepGemmExperts("block_fp8", NORMAL, "no_such_deep_gemm_module")
    assert info.value.parameter == "runner" and info.value.value == "deep_gemm"
    assert "https://github.com/deepseek-ai/DeepGEMM" in str(info.value) and "from source" in str(info.value)
    with pytest.raises(md.BackendUnavailableError, match="no known grouped GEMM"):
        DeepGemmExperts("block_fp8", NORMAL, types.SimpleNamespace())


def test_bf16_or_ue8m0_on_deep_gemm_v1_is_refused():
    with pytest.raises(md.BackendUnavailableError) as info:
        DeepGemmExperts("bf16", LL, V1)
    assert info.value.parameter == "weights" and "m_grouped_bf16_gemm_nt" in str(info.value)
    with pytest.raises(md.InvalidSpecError, match="9.x"):  # v1 runs on SM90, which takes fp32 scales
        DeepGemmExperts("block_fp8", LL, V1, ue8m0=True)
    with pytest.raises(md.InvalidSpecError):
        DeepGemmExperts("bf16", LL, SM90, ue8m0=True)
    with pytest.raises(md.InvalidSpecError):
        DeepGemmExperts("fp8", LL, SM90)
    with pytest.raises(md.BackendUnavailableError, match="SM90 and SM100"):
        DeepGemmExperts("block_fp8", LL, emu.emulate((12, 0)))


def test_v1_masked_capacity_and_sm90_bf16_dims_are_checked_before_deep_gemm():
    """DeepGEMM v1's masked GEMM asserts M % block_m when M exceeds it (block_m 64/128/256 by its heuristic); SM90's
    BF16 grouped GEMMs assert K % 64: both typed errors before DeepGEMM."""
    v1 = DeepGemmExperts("block_fp8", LL, V1)
    layer = v1.process_weights(_weights())
    x, scale = _rows("block_fp8", (E, 96))
    with pytest.raises(md.InvalidInputError) as info:
        v1.apply_without_routing_weights(layer, x, scale, 1, torch.tensor([1, 0, 0, 0]), torch.bfloat16)
    assert info.value.parameter == "hidden_states" and "256" in info.value.allowed
    with pytest.raises(md.InvalidInputError) as info:
        DeepGemmExperts("bf16", LL, SM90).process_weights(random_expert_weights(2, 256, 96))
    assert info.value.parameter == "intermediate_size"
    DeepGemmExperts("bf16", LL, SM100).process_weights(random_expert_weights(2, 256, 96))  # SM100: no such rule


def test_wrong_inputs_are_typed_errors():
    fp8 = DeepGemmExperts("block_fp8", NORMAL, SM90)
    bf16 = DeepGemmExperts("bf16", NORMAL, SM90)
    fp8_layer, bf16_layer = fp8.process_weights(_weights()), bf16.process_weights(_weights())
    counts = _group_list(PACKED_COUNTS, 1)
    x8, s8 = _rows("block_fp8", (sum(PACKED_COUNTS),))
    xb, _ = _rows("bf16", (sum(PACKED_COUNTS),))

    def error(kernel, layer, x, scale, group_list=counts) -> md.InvalidInputError:
        with pytest.raises(md.InvalidInputError) as info:
            kernel.apply_without_routing_weights(layer, x, scale, 1, group_list, torch.bfloat16)
        return info.value

    e = error(fp8, fp8_layer, xb, None)
    assert e.parameter == "hidden_states" and "float8_e4m3fn" in e.allowed and "quant_hints" in str(e)
    assert error(bf16, bf16_layer, x8, s8).parameter == "hidden_states"
    assert error(fp8, fp8_layer, x8, None).parameter == "hidden_states_scale"
    assert error(fp8, fp8_layer, x8, s8[:, :1]).parameter == "hidden_states_scale"
    assert error(fp8, fp8_layer, x8, pack_ue8m0(s8)).parameter == "hidden_states_scale"  # UE8M0 needs ue8m0 weights
    assert error(bf16, bf16_layer, xb, s8).parameter == "hidden_states_scale"
    assert error(fp8, fp8_layer, x8, s8, counts[:2]).parameter == "group_list"
    assert error(fp8, fp8_layer, x8, s8, counts + 1).parameter == "group_list"  # counts do not sum to the rows
    assert error(fp8, bf16_layer, x8, s8).parameter == "layer"
    assert error(fp8, _weights(), x8, s8).parameter == "layer"
    short = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, 128)).quantize(torch.randn(3, 128))
    assert error(fp8, fp8_layer, short.data, short.scale, _group_list([3, 0, 0, 0], 1)).parameter == "hidden_states"
    with pytest.raises(md.InvalidInputError) as info:
        fp8.process_weights(random_expert_weights(2, 256, 96))
    assert info.value.parameter == "intermediate_size"


@pytest.mark.parametrize("kind,mode,needs", [
    ("block_fp8", NORMAL, md.DispatchDtype.FP8),
    ("block_fp8", LL, md.DispatchDtype.FP8),
    ("bf16", LL, md.DispatchDtype.BF16),  # sglang PR #25540
    ("bf16", NORMAL, md.DispatchDtype.BF16),  # sglang keeps FP8 here; we use the contiguous BF16 GEMM
])
def test_needs_dispatch_dtype_and_quant_hints(kind, mode, needs):
    experts = DeepGemmExperts(kind, mode.value, SM90)
    assert isinstance(experts, md.ExpertKernel)
    assert experts.needs_dispatch_dtype is needs
    assert experts.quant_hints() == md.QuantHints(dispatcher_output_dtype=needs)


def test_the_registered_runner_takes_both_dtypes_behind_deepep():
    runner = md.PluginHost(env={}).runners()["deep_gemm"]
    assert runner.needs is md.DispatchDtype.FP8 and runner.accepts == {md.DispatchDtype.FP8, md.DispatchDtype.BF16}
    assert runner.backends == {"cuda_deepep": frozenset({NORMAL, LL}), "cuda_deepep_v2": frozenset({NORMAL, LL})}
    assert "github.com/deepseek-ai/DeepGEMM" in runner_probe("no_such_deep_gemm_module")
    assert runner_probe(SM90) is None


def test_the_hint_overrides_the_runner_default_in_resolution():
    """The ``deep_gemm`` runner is registered as needing FP8; a BF16 layer's hint comes first."""
    experts = DeepGemmExperts("bf16", LL, SM90)
    spec = md.DispatchSpec(2048, 8, 2, mode="low_latency", quant=experts.quant_hints(), runner="deep_gemm")
    runners = md.PluginHost(env={}).runners()
    resolution = mdp.resolve_output_dtype(spec, DeepEPBackend(DEEPEP_EMULATOR), env={}, runners=runners)
    assert resolution.dtype is md.DispatchDtype.BF16
    decided = [s for s in resolution.steps if s.decided]
    assert decided[0].source == "quant.dispatcher_output_dtype" and decided[0].value == "bf16"


@pytest.mark.parametrize("kind,mode,kernel", [
    ("block_fp8", "low_latency", SM90),
    ("bf16", "low_latency", SM90),
    ("block_fp8", "low_latency", SM100),  # UE8M0 end to end
    ("block_fp8", "normal", SM90),
    ("bf16", "normal", SM100),
    ("block_fp8", "normal", SM100),
])
def test_dispatch_deep_gemm_combine_agrees_with_the_dense_reference(moe_rank_pools, kind, mode, kernel):
    """DeepEP (its fake) with the spec built from ``quant_hints()``, the kernel on each rank's
    experts, combine: within the wire dtype's tolerance of ``mdt.reference_moe`` on the
    dequantized weights, and the resolution trail shows the dtype came from the hints."""
    results = moe_rank_pools.get(2).map(run_layer, kind, mode, kernel, DEEPEP_EMULATOR, 2048, 256, 2, 2, 128)
    for r in results:
        assert r.dtype == ("fp8" if kind == "block_fp8" else "bf16"), r.resolution
        assert r.decided_by == "quant.dispatcher_output_dtype", r.resolution
        assert "quant.dispatcher_output_dtype" in r.resolution
        assert r.relative_error < r.tolerance, (r.relative_error, r.tolerance)


@pytest.mark.parametrize("kind,kernel,mode,aligned", [
    ("block_fp8", SM90, "normal", False), ("bf16", SM90, "normal", False),
    ("block_fp8", SM100, "normal", False),
    # low latency: DeepEP's worst-case rows, unwritten past the segments, no host sync in the aligned (PSUM) path
    ("block_fp8", SM90, "low_latency", True), ("bf16", SM100, "low_latency", True),
    ("block_fp8", SM90, "low_latency", False),
    # v1: the worst case's tail is whole blocks of -1 indices, an illegal address before #113 (PyPI's 1.0.0)
    ("block_fp8", V1, "low_latency", True), ("block_fp8", DEEP_GEMM_V1_PYPI_EMULATOR, "low_latency", True),
])
def test_deep_gemm_behind_deepep_v2_agrees_with_the_dense_reference(moe_rank_pools, kind, kernel, mode, aligned):
    """DeepEP V2's expanded rows (PACKED; fp32 per-128 scales, or UE8M0 packed four per word for SM100) are what the
    contiguous GEMMs take, exact in normal mode and DeepEP's worst case in low-latency mode; on every DeepGEMM v1
    too, whose blocks of -1 indices the runner clamps as #113 does in the kernel."""
    results = moe_rank_pools.get(2).map(run_layer, kind, mode, kernel, DEEPEP_EMULATOR, 2048, 256, 2, 2, 128,
                                        v2=True, aligned=aligned)
    for r in results:
        assert r.relative_error < r.tolerance, (r.relative_error, r.tolerance)


# -- the masked capacity ----------------------------------------------------------------------------------------


def _expert_weights(experts=E, hidden=256, inter=I):
    return random_expert_weights(experts, hidden, inter, generator=torch.Generator().manual_seed(0))


def _masked_rows(capacity, hidden=256):
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, hidden)).quantize(
        torch.randn(E, capacity, hidden, generator=torch.Generator().manual_seed(1)))
    return q.data, q.scale


def test_masked_capacity_is_a_multiple_of_every_block_m():
    """DeepGEMM's masked GEMM stores whole BLOCK_M tiles into a ``[G·m, n]`` view: with ``m`` not a multiple of BLOCK_M
    an expert's last tile overwrites the next expert's first rows. The runner refuses such a capacity (typed), the
    backend refuses the spec at creation (``runner="deep_gemm"``), and the fake writes whole tiles."""
    experts = DeepGemmExperts("block_fp8", LL, SM90)
    assert experts.masked_capacity_multiple == 128  # 2.6.1 on SM90: BLOCK_M 64 or 128
    layer = experts.process_weights(_expert_weights())
    x, scale = _masked_rows(8)
    with pytest.raises(md.InvalidInputError) as info:
        experts.apply_without_routing_weights(layer, x, scale, 1, torch.tensor([3, 0, 8, 1]), torch.bfloat16)
    assert info.value.parameter == "hidden_states" and "128" in info.value.allowed
    backend = DeepEPBackend(DEEPEP_EMULATOR)
    spec = md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=8, mode="low_latency", runner="deep_gemm")
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(spec, 2)
    assert info.value.parameter == "num_max_dispatch_tokens_per_rank"
    backend.check_spec(md.DispatchSpec(7168, 16, 8, num_max_dispatch_tokens_per_rank=128, mode="low_latency",
                                       runner="deep_gemm"), 2)
    # The fake: expert 0's last tile spills NaN into expert 1's rows, as the TMA store does.
    fake = fake_module(SM90)
    a, sa = _masked_rows(8)
    b, sb = quantize_block_fp8(torch.randn(E, 128, 256, generator=torch.Generator().manual_seed(2)))
    d = torch.zeros(E, 8, 128, dtype=torch.bfloat16)
    fake.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), d, torch.tensor([3, 0, 0, 0], dtype=torch.int32), 8)
    assert torch.isnan(d[0, 3:]).all() and torch.isnan(d[1]).all()


def test_the_masked_block_ms_per_version():
    """Which BLOCK_M each DeepGEMM may pick for a masked GEMM, per version and architecture (planning: every
    version's)."""
    def info(version, generation="v2"):
        return vendor.DeepGemmInfo("deep_gemm", object(), generation, True, version=version)

    assert vendor.dg_masked_block_ms(info(None), 9) == {64, 128, 256}  # 2.0.0 (before and after 79f48ee), 2.1.0
    assert vendor.dg_masked_block_ms(info("2.3.0"), 10) == {64, 128}
    assert vendor.dg_masked_block_ms(info("2.6.1"), 10, mk_alignment=128) == {128}
    assert vendor.dg_masked_block_ms(info("2.6.1"), 9) == {64, 128}
    assert vendor.dg_masked_block_ms(info(None, "v1"), 9) == {64, 128, 256}
    assert vendor.dg_masked_block_ms(None, None) == {64, 128, 256}  # planning: every version


# -- what the runner refuses, per architecture and version --------------------------------------------------


def test_bf16_rows_need_16_byte_strides():
    """TMA descriptors need 16-byte global strides: gmm2's ``[rows, I]`` BF16 rows need I % 8 == 0
    (``cuTensorMapEncodeTiled`` fails otherwise, an untyped CUDA driver error, which the fake raises): the runner
    refuses such weights, naming ``intermediate_size``."""
    with pytest.raises(md.InvalidInputError) as info:
        DeepGemmExperts("bf16", LL, SM100).process_weights(_expert_weights(2, 256, 100))
    assert info.value.parameter == "intermediate_size"
    DeepGemmExperts("bf16", LL, SM100).process_weights(_expert_weights(2, 256, 96))
    fake = fake_module(SM100)
    a = torch.zeros(2, 128, 100, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA driver"):
        fake.m_grouped_bf16_gemm_nt_masked(a, torch.zeros(2, 256, 100, dtype=torch.bfloat16),
                                           torch.empty(2, 128, 256, dtype=torch.bfloat16),
                                           torch.tensor([1, 1], dtype=torch.int32), 1)


def test_pypi_v1_cannot_compile_odd_k_blocks():
    """DeepGEMM v1 at b05ed2f (PyPI 1.0.0) static-asserts "Misaligned barriers" when ceil(K/128) is odd and BLOCK_N
    divides 128 (removed by 6c5da03): without ``wgrad_gemm_fp8_fp8_fp32_nt`` (added after the fix) the runner refuses
    odd ceil(I/128) and ceil(H/128); the fake's CPU JIT fails as nvcc does."""
    old = DeepGemmExperts("block_fp8", LL, DEEP_GEMM_V1_PYPI_EMULATOR)
    with pytest.raises(md.InvalidInputError) as info:
        old.process_weights(_expert_weights(E, 256, 128))
    assert info.value.parameter == "intermediate_size"
    old.process_weights(_expert_weights(E, 256, 256))
    DeepGemmExperts("block_fp8", LL, DEEP_GEMM_V1_EMULATOR).process_weights(_expert_weights(E, 256, 128))
    kernels = importlib.import_module(DEEP_GEMM_V1_KERNELS)
    with pytest.raises(subprocess.CalledProcessError):
        kernels.CpuJitTuner().compile_and_tune("m_grouped_gemm_fp8_fp8_bf16_nt", {
            "N": 256, "K": 128, "BLOCK_M": 64, "BLOCK_N": 16, "NUM_GROUPS": 4, "GEMM_TYPE": "GroupedMasked"},
            (), (), (), "", ())


def test_the_vendors_layout_functions_are_used_when_installed():
    """``get_tma_aligned_size`` and the MN-major packing come from the installed DeepGEMM; the port is the fallback, and
    gives the same."""
    stub = types.SimpleNamespace(get_tma_aligned_size=lambda mn, size: 1000 + mn)
    assert vendor.dg_tma_aligned_size(stub, 5, 4) == 1005
    assert vendor.dg_tma_aligned_size(None, 5, 4) == 8
    fake = fake_module(SM100)
    sf = torch.exp2(torch.randint(-5, 5, (3, 130, 8)).float())
    packed = vendor.dg_packed_ue8m0_mn_major(fake, sf)
    assert packed.dtype == torch.int32 and packed.stride(-1) == 132 and packed.stride(-2) == 1
    assert torch.equal(packed, vendor.dg_packed_ue8m0_mn_major(None, sf))


def test_the_cuda_home_handed_to_deep_gemm_is_the_real_nvccs(tmp_path):
    """DeepGEMM takes ``which nvcc``'s grandparent without ``CUDA_HOME`` (deep_gemm/__init__.py:104-125): for an nvcc
    linked into a bin/ of its own that is no CUDA root. ``vendor.dg_cuda_home`` resolves the link, and never returns a
    root without bin/nvcc and include/cuda.h (a wrapper script's)."""
    root = tmp_path / "cuda-13.0"
    for name in ("bin/nvcc", "include/cuda.h"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    (tmp_path / "local" / "bin").mkdir(parents=True)
    link, wrapper = tmp_path / "local" / "bin" / "nvcc", tmp_path / "wrapper" / "bin" / "nvcc"
    link.symlink_to(root / "bin" / "nvcc")
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f"#!/bin/sh\nexec {root}/bin/nvcc \"$@\"\n")
    assert vendor.dg_cuda_home(str(link)) == str(root)
    assert vendor.dg_cuda_home(str(wrapper)) != str(tmp_path / "wrapper")


def test_power_of_two_scales_by_bits():
    """``exp2(ceil(log2(s)))`` rounds log2 to float first: for s just above 2^16 it gives 2^16 < s. The runner takes
    powers of two by bits with the core's ``pow2_ceil`` (as DeepGEMM's ``ceil_to_ue8m0``), for the activations' and the
    weights' UE8M0 scales, and keeps no copy of its own."""
    s = torch.tensor([65536 * (1 + 2**-23), 3.0, 0.25])
    assert pow2_ceil(s).tolist() == [131072.0, 4.0, 0.25]
    _, scale = quantize_per_token_group(torch.full((1, 128), 448.0 * 65536 * (1 + 2**-23)), ue8m0=True)
    assert scale.item() == 131072.0
    w = torch.randn(1, 128, 128, generator=torch.Generator().manual_seed(5)) * 1000
    _, scale = quantize_block_fp8(w, ue8m0=True)
    amax = w.abs().amax().clamp_min(1e-4) / 448.0
    assert scale.item() == pow2_ceil(amax.reshape(1)).item()
    assert not hasattr(vendor, "ceil_to_ue8m0")


# -- SM100 fp32 activation scales ---------------------------------------------------------------------------


def test_sm100_fp32_scales_are_packed_by_the_runner():
    """DeepGEMM 2.0.0 builds of 2025-07-18 .. 07-29 and 08-02 .. 08-04 assert ``mn % 4 == 0 and num_groups == 1`` when
    they cast non-contiguous (MN-major) fp32 scales to UE8M0, as DeepEP's LL layout has them: on SM100 the runner packs
    fp32 activation scales itself, with DeepGEMM's helper on contiguous scales."""
    module = fake_module(DEEP_GEMM_EMULATOR).emulate((10, 0), "2.0.0", before_f85ec64=True)
    experts = DeepGemmExperts("block_fp8", LL, module)
    weights = random_expert_weights(4, 256, 128, generator=torch.Generator().manual_seed(0))
    layer = experts.process_weights(weights)
    capacity = experts.masked_capacity_multiple
    x = torch.randn(4, capacity, 256, generator=torch.Generator().manual_seed(1))
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, 256, ue8m0=True)).quantize(x)
    mn_major = q.scale.transpose(1, 2).contiguous().transpose(1, 2)  # DeepEP's LL scale layout
    counts = torch.tensor([3, 0, capacity - 1, 1])
    got = experts.apply_without_routing_weights(layer, q.data, mn_major, 1, counts, torch.float32)
    want = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), q.data, q.scale, 1, counts,
                                                           torch.float32)
    assert relative_error(got, want) < TOLERANCES[md.DispatchDtype.FP8]


def _sm100_masked(garbage_past_counts):
    module = fake_module(DEEP_GEMM_EMULATOR).emulate((10, 0), "2.6.1")
    experts = DeepGemmExperts("block_fp8", LL, module)
    layer = experts.process_weights(random_expert_weights(4, 256, 128, generator=torch.Generator().manual_seed(0)))
    capacity = experts.masked_capacity_multiple
    x = torch.randn(4, capacity, 256, generator=torch.Generator().manual_seed(1))
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, 256, ue8m0=True)).quantize(x)
    counts = torch.tensor([3, 0, capacity - 1, 1])
    data, scale = q.data.clone(), q.scale.clone()
    if garbage_past_counts:  # DeepEP's torch::empty past each expert's count
        past = (torch.arange(capacity).unsqueeze(0) >= counts.unsqueeze(1))
        scale[past] = float("nan")
        data.view(torch.uint8)[past] = 0x7F
    mn_major = scale.transpose(1, 2).contiguous().transpose(1, 2)  # DeepEP's LL scale layout
    return experts, layer, q, data, mn_major, counts


def test_sm100_fp32_scales_ignore_the_rows_past_the_counts():
    """DeepEP's masked scales past each expert's count are ``torch::empty``: the runner checks and packs the valid rows
    only (checking them as rows would refuse real power-of-two scales, or on DeepGEMM 2.6.1 trip its device assert)."""
    experts, layer, q, data, scale, counts = _sm100_masked(True)
    got = experts.apply_without_routing_weights(layer, data, scale, 1, counts, torch.float32)
    want = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), q.data, q.scale, 1, counts,
                                                           torch.float32)
    assert relative_error(got, want) < TOLERANCES[md.DispatchDtype.FP8]


def test_sm100_fp32_scales_are_refused_under_capture():
    """Under CUDA-graph capture the power-of-two check (a host read) cannot run, and DeepGEMM 2.6.1 device-asserts (the
    context is lost) where earlier versions pack garbage exponents: fp32 activation scales on SM100 are refused under
    capture, naming ``hidden_states_scale`` (dispatch must send packed UE8M0)."""
    experts, layer, q, data, scale, counts = _sm100_masked(False)
    graph = fake_module().CUDAGraph()
    try:
        with pytest.raises(md.InvalidInputError) as info:
            with graph.capture():
                experts.apply_without_routing_weights(layer, data, scale * 1.5, 1, counts, torch.float32)
        assert info.value.parameter == "hidden_states_scale" and "capture" in str(info.value)
    finally:
        _native.reset_context()


# -- the fakes, as strict as DeepGEMM ------------------------------------------------------------------------


def test_the_fake_sm100_cast_asserts_mn_major_fp32_scales():
    """On the CUDA path ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` asserts MN-major fp32 input: K-major
    non-contiguous scales are refused."""
    fake = fake_module(SM100)
    a = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    sfa = torch.ones(128, 4)[:, :2]  # non-contiguous, K-major (stride(-1) == 1)
    b, sb = quantize_block_fp8(torch.randn(1, 128, 256, generator=torch.Generator().manual_seed(3)), ue8m0=True)
    with pytest.raises(RuntimeError, match="stride"):
        fake.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sb), torch.empty(128, 128, dtype=torch.bfloat16),
                                              torch.zeros(128, dtype=torch.int32))


def test_the_contiguous_block_takes_its_first_rows_group():
    """DeepGEMM reads a block's group from its first row (``max(0, -1) = 0``); -1 may only follow valid rows. Padding
    rows are unspecified on both architectures (NaN in the fakes)."""
    a = torch.ones(256, 256, dtype=torch.float8_e4m3fn)
    b, sb = quantize_block_fp8(torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(4)))
    sa = torch.ones(256, 2)
    leading_padding = torch.cat([-torch.ones(28), torch.ones(100), torch.zeros(128)]).to(torch.int32)
    with pytest.raises(RuntimeError, match="first row"):
        fake_module(SM90).m_grouped_fp8_gemm_nt_contiguous(
            (a, sa), (b, sb), torch.empty(256, 128, dtype=torch.bfloat16), leading_padding)
    ids = torch.cat([torch.ones(100), -torch.ones(28), torch.zeros(128)]).to(torch.int32)
    b1, sb1 = quantize_block_fp8(torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(4)), ue8m0=True)
    d = torch.empty(256, 128, dtype=torch.bfloat16)
    fake_module(SM100).m_grouped_fp8_gemm_nt_contiguous((a, torch.ones(256, 2)), (b1, sb1), d, ids)
    assert torch.isnan(d[100:128]).all() and not torch.isnan(d[:100]).any()


def test_masked_m_past_m_is_the_fakes_refusal():
    """DeepGEMM has no ``masked_m <= m`` check; the fake refuses and says it is its own check ("(fake)")."""
    a, sa = _masked_rows(128)
    b, sb = quantize_block_fp8(torch.randn(E, 128, 256, generator=torch.Generator().manual_seed(2)))
    with pytest.raises(RuntimeError, match=r"^\(fake\)"):
        fake_module(SM90).m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), torch.empty(E, 128, 128, dtype=torch.bfloat16),
                                                       torch.tensor([129, 0, 0, 0], dtype=torch.int32), 8)


def test_emulated_versions_differ_as_deep_gemm_did():
    """The 4th parameter was ``m_indices`` up to 2.2.0 and is ``grouped_layout`` from 2.3.0; ``set_mk_alignment_…``
    arrived in 2.4.2."""
    emulate = fake_module(SM90).emulate
    old, mid, new = emulate((9, 0), "2.2.0"), emulate((9, 0), "2.3.0"), emulate((9, 0), "2.4.2")
    assert list(inspect.signature(getattr(old, vendor.DG_FP8_CONTIGUOUS)).parameters)[3] == "m_indices"
    assert list(inspect.signature(getattr(mid, vendor.DG_FP8_CONTIGUOUS)).parameters)[3] == "grouped_layout"
    assert not hasattr(mid, vendor.DG_SET_MK_ALIGNMENT) and hasattr(new, vendor.DG_SET_MK_ALIGNMENT)


def test_the_fake_converts_arguments_as_pybind():
    """Bool arguments take None (pybind's convert pass); ``expected_m_for_psum_layout`` is an optional int."""
    fake = fake_module(SM90)
    a = torch.zeros(128, 256, dtype=torch.bfloat16)
    b = torch.zeros(1, 128, 256, dtype=torch.bfloat16)
    d, ids = torch.empty(128, 128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.int32)
    fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ids, "nk", None, None)
    with pytest.raises(TypeError, match="incompatible"):
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, ids, expected_m_for_psum_layout=1.5)


def test_the_fake_layout_helpers_take_their_versions_arguments():
    """Before 2.6.1 ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` is bound without ``py::arg`` (``(arg0, /)``), and
    ``set_mk_alignment_for_contiguous_layout`` always is: keywords fail as pybind fails."""
    fakes = fake_module(DEEP_GEMM_EMULATOR)
    sf = torch.ones(128, 4)
    for version in ("2.3.0", "2.5.0"):
        module = fakes.emulate((10, 0), version)
        with pytest.raises(TypeError, match="incompatible"):
            getattr(module, vendor.DG_MN_MAJOR_PACKED_UE8M0)(sf=sf)
        getattr(module, vendor.DG_MN_MAJOR_PACKED_UE8M0)(sf)
    with pytest.raises(TypeError, match="incompatible"):
        getattr(fakes.emulate((9, 0), "2.6.1"), vendor.DG_SET_MK_ALIGNMENT)(new_value=256)
    getattr(fakes.emulate((10, 0), "2.6.1"), vendor.DG_MN_MAJOR_PACKED_UE8M0)(sf=sf, psum_layout=None)


def test_before_2_6_1_the_cuda_cast_packs_garbage_exponents():
    """Before 2.6.1 the CUDA cast ORs each value's bits shifted into place (``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 <<
    1``): a non-power of two brings its mantissa into the lower bytes; 2.6.1 device-asserts powers of two instead. Only
    the PyTorch fallback truncates."""
    fakes = fake_module(DEEP_GEMM_EMULATOR)
    def packed_bytes(sf, version):
        word = int(vendor.dg_packed_ue8m0_mn_major(fakes.emulate((10, 0), version), sf).reshape(-1)[0])
        return list((word & 0xFFFFFFFF).to_bytes(4, "little"))

    assert packed_bytes(torch.tensor([[3.0, 5.0, 0.75, 1.5]]), "2.5.0") == [192, 129, 254, 127]
    assert packed_bytes(torch.tensor([[4.0, 8.0, 0.5, 2.0]]), "2.5.0") == [129, 130, 126, 128]
    with pytest.raises(RuntimeError, match="unspecified launch failure"):  # 2.6.1: the power-of-two device assert
        packed_bytes(torch.tensor([[3.0, 5.0, 0.75, 1.5]]), "2.6.1")
    _native.reset_context()
