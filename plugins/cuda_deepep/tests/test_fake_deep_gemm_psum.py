"""The DeepGEMM fake's contiguous grouped GEMMs with the PSUM layout (``use_psum_layout=True``), against
deepseek-ai/DeepGEMM@54e2261 (2.6.1) and its history (docs/evidence/vendor-notes/deepgemm-psum-layout.md).

One layout throughout: four groups of 100, 0, 130 and 5 rows, starts aligned to 128 (``BLOCK_M`` =
``get_mk_alignment_for_contiguous_layout()``), so ``grouped_layout`` = [100, 128, 258, 389] (the empty group repeats
its aligned start), in M = 640 rows: blocks [0, 128) for group 0, [128, 256) and [256, 384) for group 2, [384, 512)
for group 3; rows 512..639 lie past the last group's aligned end.
"""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import make_codec, pack_ue8m0
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.deep_gemm import quantize_block_fp8
from moe_dispatch_cuda_deepep_testing.fakes import _native
from moe_dispatch_cuda_deepep_testing.fakes import deep_gemm as emu
from moe_dispatch_cuda_deepep_testing.fakes import deep_gemm_sm100 as emu100

K, N, G, M = 256, 128, 4, 640
ENDS = [100, 128, 258, 389]
VALID = {0: (0, 100), 2: (128, 258), 3: (384, 389)}
GAPS = [(100, 128), (258, 384), (389, 512)]
SENTINEL = 7.0
F32, BF16 = torch.float32, torch.bfloat16


def _layout(ends=ENDS) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _d(m: int = M) -> torch.Tensor:
    return torch.full((m, N), SENTINEL, dtype=BF16)


def _gap_mask(m: int = M) -> torch.Tensor:
    mask = torch.zeros(m, dtype=torch.bool)
    for lo, hi in GAPS:
        mask[lo:min(hi, m)] = True
    return mask


def _fp8(m: int = M, ue8m0: bool = False, zero_gaps: bool = False, seed: int = 0):
    """A (FP8, fp32 scale per row and 128 channels) and B (FP8, fp32 per 128x128 block, powers of two so SM100's
    2.6.1 cast takes them)."""
    gen = torch.Generator().manual_seed(seed)
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, K, ue8m0=ue8m0)).quantize(torch.randn(m, K, generator=gen))
    a, sa = q.data.clone(), q.scale.clone()
    if zero_gaps:  # as DeepEP V2's do_zero_padding hands the rows over
        a.view(torch.uint8)[_gap_mask(m)] = 0
    b, sb = quantize_block_fp8(torch.randn(G, N, K, generator=gen))
    return a, sa, b, torch.exp2(torch.floor(torch.log2(sb)))


def _bf16(m: int = M, zero_gaps: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, K, generator=gen).to(BF16)
    if zero_gaps:
        a[_gap_mask(m)] = 0
    return a, torch.randn(G, N, K, generator=gen).to(BF16)


def _mn_major_packed(scale: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two [M, K/128] -> packed UE8M0 int32, MN-major with a TMA-aligned stride (DeepEP's form)."""
    packed = pack_ue8m0(scale)
    m = packed.shape[0]
    out = torch.empty_strided(packed.shape, (1, -(-m // 4) * 4), dtype=torch.int32)
    out.copy_(packed)
    return out


def _reference(a_f: torch.Tensor, b_f: torch.Tensor) -> dict[int, torch.Tensor]:
    return {g: (a_f[lo:hi] @ b_f[g].t()).to(BF16) for g, (lo, hi) in VALID.items()}


def _fp8_reference(a, sa, b, sb):
    a_f = a.float() * sa.float().repeat_interleave(128, dim=1)[:, :K]
    b_f = b.float() * sb.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :N, :K]
    return _reference(a_f, b_f)


def _assert_valid_rows(d: torch.Tensor, ref: dict[int, torch.Tensor]) -> None:
    for g, (lo, hi) in VALID.items():
        torch.testing.assert_close(d[lo:hi].float(), ref[g].float(), rtol=2**-7, atol=1e-3)


def _rows(d: torch.Tensor, lo: int, hi: int) -> str:
    """What rows [lo, hi) hold: 'nan', 'zero', 'sentinel' (not written) or 'values'."""
    x = d[lo:hi].float()
    if torch.isnan(x).all():
        return "nan"
    if (x == 0).all():
        return "zero"
    if (x == SENTINEL).all():
        return "sentinel"
    assert not torch.isnan(x).any() and not (x == SENTINEL).all(dim=1).any(), (lo, hi)
    return "values"


# -- results per architecture ---------------------------------------------------------------------------------------


def test_sm90_fp8_valid_rows_padding_rows_and_skipped_warpgroups():
    """SM90 FP8 (1D2D) computes whole 128-row blocks in two 64-row warpgroup slices; a slice starting at or past the
    group's end skips its MMAs and stores zeros (sm90_fp8_gemm_1d2d.cuh:256, 274, 351-357). Other padding rows are
    their own A rows times the group's weights: zero for zeroed rows (NaN in the fake for anything else). Rows past the
    last block are not written."""
    a, sa, b, sb = _fp8()
    d = _d()
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _fp8_reference(a, sa, b, sb))
    assert [_rows(d, *r) for r in [(100, 128), (258, 320), (320, 384), (389, 448), (448, 512), (512, 640)]] == [
        "nan", "nan", "zero", "nan", "zero", "sentinel"]

    a, sa, b, sb = _fp8(zero_gaps=True)
    d = _d()
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _fp8_reference(a, sa, b, sb))
    assert all(_rows(d, lo, hi) == "zero" for lo, hi in GAPS) and _rows(d, 512, 640) == "sentinel"


def test_sm90_fp8_padding_scales_reach_only_their_own_rows():
    """SM90 reads the fp32 SFA of every row the block loads: a NaN scale on a zeroed padding row makes that row NaN
    (0 x NaN) and nothing else; a skipped warpgroup slice stays zero."""
    a, sa, b, sb = _fp8(zero_gaps=True)
    sa[_gap_mask()] = float("nan")
    d = _d()
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _fp8_reference(a, sa, b, sb))
    assert [_rows(d, *r) for r in [(100, 128), (258, 320), (320, 384), (389, 448), (448, 512)]] == [
        "nan", "nan", "zero", "nan", "zero"]


def test_sm90_bf16_computes_every_padding_row_of_a_block():
    """The SM90 BF16 kernel has no warpgroup skip (sm90_bf16_gemm.cuh:225): every padding row of a written block is
    computed from its A row."""
    a, b = _bf16()
    d = _d()
    emu.m_grouped_bf16_gemm_nt_contiguous(a, b, d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _reference(a.float(), b.float()))
    assert all(_rows(d, lo, hi) == "nan" for lo, hi in GAPS) and _rows(d, 512, 640) == "sentinel"
    a, b = _bf16(zero_gaps=True)
    d = _d()
    emu.m_grouped_bf16_gemm_nt_contiguous(a, b, d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _reference(a.float(), b.float()))
    assert all(_rows(d, lo, hi) == "zero" for lo, hi in GAPS)


@pytest.mark.parametrize("fp8", [True, False])
def test_sm100_ensure_zero_padding_writes_whole_blocks_or_trims_the_last_to_16_rows(fp8):
    """SM100 swaps A/B; with ``ensure_zero_padding`` (the default) every block is computed whole, so zeroed padding
    rows come out zero (tests/test_fp8_fp4.py:22-29). Without it a group's last block is computed and stored only up
    to ``align(end - block start, 16)`` rows (scheduler/gemm.cuh:189-195; sm100_store_cd_swap_ab.cuh:50): the rest
    keep what ``d`` held."""
    if fp8:
        a, sa, b, sb = _fp8(ue8m0=True, zero_gaps=True)
        ref = _fp8_reference(a, sa, b, sb)
        call = emu100.m_grouped_fp8_gemm_nt_contiguous
        args = ((a, _mn_major_packed(sa)), (b, sb))
    else:
        a, b = _bf16(zero_gaps=True)
        ref = _reference(a.float(), b.float())
        call = emu100.m_grouped_bf16_gemm_nt_contiguous
        args = (a, b)
    d = _d()
    call(*args, d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, ref)
    assert all(_rows(d, lo, hi) == "zero" for lo, hi in GAPS) and _rows(d, 512, 640) == "sentinel"
    d = _d()
    call(*args, d, _layout(), use_psum_layout=True, ensure_zero_padding=False)
    _assert_valid_rows(d, ref)
    assert [_rows(d, *r) for r in [(100, 112), (112, 128), (258, 272), (272, 384), (389, 400), (400, 640)]] == [
        "zero", "sentinel", "zero", "sentinel", "zero", "sentinel"]


def test_sm100_fp32_sfa_cast_skips_the_padding_rows():
    """2.6.1 casts fp32 SFA with the PSUM layout (csrc/apis/gemm.hpp:213-217): rows outside the groups are loaded as
    0 before the power-of-two assert and packed as 2^-127 (smxx_layout.cuh:84-131), so they may hold any value; a
    valid row's non-power-of-two scale still traps. One contiguous SFA only (smxx_layout.hpp:191)."""
    a, sa, b, sb = _fp8(ue8m0=True, zero_gaps=True)
    ref = _fp8_reference(a, sa, b, sb)
    garbage = sa.clone()
    garbage[_gap_mask()] = 3.0
    garbage[512:] = float("nan")
    d = _d()
    emu100.m_grouped_fp8_gemm_nt_contiguous((a, garbage), (b, sb), d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, ref)
    assert all(_rows(d, lo, hi) == "zero" for lo, hi in GAPS)
    with pytest.raises(RuntimeError, match="Assertion error .*num_sf_batches == 1 and batched_sf.is_contiguous"):
        mn_major = torch.empty_strided(garbage.shape, (1, M)).copy_(garbage)
        emu100.m_grouped_fp8_gemm_nt_contiguous((a, mn_major), (b, sb), d, _layout(), use_psum_layout=True)
    # The same rows as a per-row group id layout: every row's scales are cast, and the padding's trap.
    ids = torch.full((M,), -1, dtype=torch.int32)
    for g, (lo, hi) in VALID.items():
        ids[lo:hi] = g
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        emu100.m_grouped_fp8_gemm_nt_contiguous((a, garbage), (b, sb), d, ids)
    _native.reset_context()  # a new process
    bad = sa.clone()
    bad[5, 0] = 3.0  # a valid row
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        emu100.m_grouped_fp8_gemm_nt_contiguous((a, bad), (b, sb), d, _layout(), use_psum_layout=True)


def test_m_need_not_be_a_multiple_of_the_alignment():
    """No check ties M to the layout; the stores of the last block are clipped at M (TMA bounds)."""
    a, sa, b, sb = _fp8(m=389, zero_gaps=True)
    d = _d(389)
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _fp8_reference(a, sa, b, sb))
    a, b = _bf16(m=389)
    d = _d(389)
    emu100.m_grouped_bf16_gemm_nt_contiguous(a, b, d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _reference(a.float(), b.float()))


def test_expected_m_is_a_hint_and_an_empty_group_may_repeat_the_previous_end():
    a, sa, b, sb = _fp8(zero_gaps=True)
    d0, d1, d2 = _d(), _d(), _d()
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d0, _layout(), use_psum_layout=True)
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d1, _layout(), use_psum_layout=True,
                                         expected_m_for_psum_layout=97)
    # [100, 100, ...]: the uint32 block count of the empty group wraps to 0 (scheduler/gemm.cuh:231)
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d2, _layout([100, 100, 258, 389]), use_psum_layout=True)
    assert torch.equal(d0, d1) and torch.equal(d0, d2)
    d = _d(0)
    emu.m_grouped_fp8_gemm_nt_contiguous((a[:0], sa[:0]), (b, sb), d, _layout([5, 6, 7, 8]), use_psum_layout=True)


# -- host asserts and pybind ----------------------------------------------------------------------------------------


def test_host_asserts_of_the_psum_path():
    a, sa, b, sb = _fp8()
    fp8 = emu.m_grouped_fp8_gemm_nt_contiguous
    with pytest.raises(RuntimeError, match=r"Assertion error \(csrc/apis/gemm.hpp\): num_groups == num_groups_"):
        fp8((a, sa), (b, sb), _d(), _layout(ENDS[:3]), use_psum_layout=True)
    with pytest.raises(RuntimeError, match=r"Assertion error \(csrc/utils/layout.hpp\): t.dim\(\) == 1"):
        fp8((a, sa), (b, sb), _d(), _layout().view(2, 2), use_psum_layout=True)
    with pytest.raises(RuntimeError, match="grouped_layout.scalar_type"):
        fp8((a, sa), (b, sb), _d(), _layout().long(), use_psum_layout=True)
    ids = torch.zeros(M, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="not expected_m_for_psum_layout.has_value"):
        fp8((a, sa), (b, sb), _d(), ids, expected_m_for_psum_layout=64)
    with pytest.raises(TypeError, match="incompatible function arguments"):  # std::optional<int>
        fp8((a, sa), (b, sb), _d(), _layout(), use_psum_layout=True, expected_m_for_psum_layout=64.0)
    a16, b16 = _bf16()
    with pytest.raises(RuntimeError, match="num_groups == num_groups_"):
        emu.m_grouped_bf16_gemm_nt_contiguous(a16, b16, _d(), _layout(ENDS + [389]), use_psum_layout=True)
    with pytest.raises(RuntimeError, match="k % 64 == 0"):
        emu.m_grouped_bf16_gemm_nt_contiguous(a16[:, :96].contiguous(), b16[:, :, :96].contiguous(), _d(), _layout(),
                                              use_psum_layout=True)


# -- the fake's refusals --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ends, why", [
    ([100, 50, 258, 389], "non-decreasing"),
    ([100, 110, 258, 389], "padding"),
    ([100, 128, 258, 641], r"outside \[0, M\]"),
    ([-1, 128, 258, 389], r"outside \[0, M\]"),
])
def test_layouts_deepgemm_reads_unchecked_are_refused(ends, why):
    a, sa, b, sb = _fp8()
    a16, b16 = _bf16()
    with pytest.raises(RuntimeError, match=rf"\(fake\) PSUM grouped_layout.*{why}"):
        emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), _d(), _layout(ends), use_psum_layout=True)
    with pytest.raises(RuntimeError, match=rf"\(fake\) PSUM grouped_layout.*{why}"):
        emu100.m_grouped_bf16_gemm_nt_contiguous(a16, b16, _d(), _layout(ends), use_psum_layout=True)


# -- versions -------------------------------------------------------------------------------------------------------


def test_versions_before_2_3_have_no_psum_and_2_3_to_2_5_no_ensure_zero_padding():
    a, sa, b, sb = _fp8(ue8m0=True)
    a16, b16 = _bf16()
    packed = _mn_major_packed(sa)
    old = emu.emulate((10, 0), "2.2.0")
    with pytest.raises(TypeError, match="incompatible function arguments"):
        getattr(old, vendor.DG_FP8_CONTIGUOUS)((a, packed), (b, sb), _d(), _layout(), use_psum_layout=True)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        getattr(old, vendor.DG_BF16_CONTIGUOUS)(a16, b16, _d(), _layout(), use_psum_layout=True)
    for version in ("2.3.0", "2.5.0"):
        dg = emu.emulate((10, 0), version)
        getattr(dg, vendor.DG_FP8_CONTIGUOUS)((a, packed), (b, sb), _d(), _layout(), use_psum_layout=True,
                                               expected_m_for_psum_layout=100)
        getattr(dg, vendor.DG_BF16_CONTIGUOUS)(a16, b16, _d(), _layout(), use_psum_layout=True)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            getattr(dg, vendor.DG_FP8_CONTIGUOUS)((a, packed), (b, sb), _d(), _layout(), use_psum_layout=True,
                                                   ensure_zero_padding=True)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            getattr(dg, vendor.DG_BF16_CONTIGUOUS)(a16, b16, _d(), _layout(), use_psum_layout=True,
                                                   ensure_zero_padding=False)


def test_sm90_runs_the_psum_layout_from_2_4_2():
    """2.3.x: ``DG_HOST_ASSERT(not use_psum_layout)`` on SM90 (csrc/apis/gemm.hpp:196, 466 @0f5f266)."""
    a, sa, b, sb = _fp8()
    a16, b16 = _bf16()
    v23 = emu.emulate((9, 0), "2.3.0")
    with pytest.raises(RuntimeError, match=r"Assertion error \(csrc/apis/gemm.hpp \(DeepGEMM 2.3.0.*: not use_psum"):
        getattr(v23, vendor.DG_FP8_CONTIGUOUS)((a, sa), (b, sb), _d(), _layout(), use_psum_layout=True)
    with pytest.raises(RuntimeError, match="not use_psum_layout"):
        getattr(v23, vendor.DG_BF16_CONTIGUOUS)(a16, b16, _d(), _layout(), use_psum_layout=True)
    d_new, d_242 = _d(), _d()
    emu.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d_new, _layout(), use_psum_layout=True)
    getattr(emu.emulate((9, 0), "2.4.2"), vendor.DG_FP8_CONTIGUOUS)((a, sa), (b, sb), d_242, _layout(),
                                                                    use_psum_layout=True)
    assert torch.equal(d_new.nan_to_num(), d_242.nan_to_num())


def test_sm100_2_4_2_to_2_5_always_trim_the_last_block():
    """Before 2.6.1 the scheduler always trims (7f2a703 scheduler/gemm.cuh:163-167): ensure_zero_padding=False's
    behaviour, with no way to ask for whole blocks; the fp32 SFA cast reads every row (no power-of-two assert)."""
    a, sa, b, sb = _fp8(ue8m0=True, zero_gaps=True)
    garbage = sa.clone()
    garbage[_gap_mask()] = 3.0
    d = _d()
    getattr(emu.emulate((10, 0), "2.5.0"), vendor.DG_FP8_CONTIGUOUS)((a, garbage), (b, sb), d, _layout(),
                                                                     use_psum_layout=True)
    _assert_valid_rows(d, _fp8_reference(a, sa, b, sb))
    assert [_rows(d, *r) for r in [(100, 112), (112, 128), (258, 272), (272, 384), (389, 400), (400, 640)]] == [
        "zero", "sentinel", "zero", "sentinel", "zero", "sentinel"]


def test_sm100_2_3_aligns_starts_to_128_and_may_pick_block_m_64():
    """2.3.x: starts ``align(end, 128u)`` (scheduler.cuh:192 @0f5f266), BLOCK_M from {64, 128} by the wave heuristic
    (heuristics/common.hpp:171-172): the fake takes 64, so padding rows past a group's last 64-row block stay
    unwritten; an empty group repeating an unaligned end 64 or more rows short of the next start wraps the uint32
    block count."""
    a, b = _bf16(zero_gaps=True)
    v23 = getattr(emu.emulate((10, 0), "2.3.0"), vendor.DG_BF16_CONTIGUOUS)
    d = _d()
    v23(a, b, d, _layout(), use_psum_layout=True)
    _assert_valid_rows(d, _reference(a.float(), b.float()))
    assert [_rows(d, *r) for r in [(100, 128), (258, 320), (320, 384), (389, 448), (448, 640)]] == [
        "zero", "zero", "sentinel", "zero", "sentinel"]
    with pytest.raises(RuntimeError, match=r"\(fake\) PSUM grouped_layout.*wraps"):
        v23(a, b, _d(), _layout([50, 50, 258, 389]), use_psum_layout=True)
    emu100.m_grouped_bf16_gemm_nt_contiguous(a, b, _d(), _layout([50, 50, 258, 389]), use_psum_layout=True)


# -- the layout helper ----------------------------------------------------------------------------------------------


def test_the_packed_ue8m0_helper_takes_a_psum_layout():
    """``get_mn_major_tma_aligned_packed_ue8m0_tensor(sf, psum_layout)`` (2.6.1, csrc/apis/layout.hpp:135-136): rows
    outside the groups pack as byte 0 whatever they hold."""
    _, sa, _, _ = _fp8(ue8m0=True)
    garbage = sa.clone()
    garbage[_gap_mask()] = 3.0
    garbage[512:] = float("nan")
    packed = emu100.get_mn_major_tma_aligned_packed_ue8m0_tensor(garbage, psum_layout=_layout())
    valid = ~_gap_mask()
    valid[512:] = False
    assert packed.stride() == (1, M) and torch.equal(packed[valid], pack_ue8m0(sa)[valid])
    assert (packed[~valid] == 0).all()
    with pytest.raises(RuntimeError, match="psum_layout->scalar_type"):
        emu100.get_mn_major_tma_aligned_packed_ue8m0_tensor(sa, psum_layout=_layout().long())
    with pytest.raises(RuntimeError, match="num_sf_batches == 1"):
        emu100.get_mn_major_tma_aligned_packed_ue8m0_tensor(sa.view(2, M // 2, -1), psum_layout=_layout())
    with pytest.raises(RuntimeError, match=r"\(fake\) psum_layout"):
        emu100.get_mn_major_tma_aligned_packed_ue8m0_tensor(sa, psum_layout=_layout([100, 128, 258, 700]))
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        emu100.get_mn_major_tma_aligned_packed_ue8m0_tensor(garbage, psum_layout=_layout([100, 128, 258, 640]))
