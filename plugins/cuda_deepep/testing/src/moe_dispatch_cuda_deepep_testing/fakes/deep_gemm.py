"""A fake of DeepGEMM 2.x's ``deep_gemm`` (deepseek-ai/DeepGEMM@54e2261, 2.6.1): the grouped GEMMs MoE
experts call, on an emulated SM90 (this module) or SM100 device (``fakes.deep_gemm_sm100``, or ``emulate()``
for another architecture or version).

The calls are pybind functions (``csrc/apis/gemm.hpp``): the recorded keyword names and defaults, pybind's
``TypeError`` for an argument that does not convert (a float ``expected_m``), and ``DG_HOST_ASSERT``s as
``RuntimeError("Assertion error (...)")``:

- operands: A (and B on SM90) K-major, D N-major, 3-d tensors dense in their two last dims, FP8 e4m3 or
  BF16, D bf16, ``grouped_layout``/``masked_m`` contiguous int32, ``expected_m > 0``;
- scale factors (``csrc/apis/layout.hpp`` ``transform_sf_pair_into_required_layout``): the default recipe
  from their dtypes (SM90: both fp32, else assert; SM100: fp32 128×128 or int32 per-row SFB); SM90 takes
  fp32 SFA in any layout (``get_mn_major_tma_aligned_tensor``: as it is when MN-major and TMA-aligned, else a copy,
  by its JIT ``transpose_fp32`` kernel for a contiguous tensor: each copy recorded in ``sf_transforms``) and fp32 SFB
  contiguous (or contiguous transposed); SM100 casts fp32 scales to
  UE8M0 (``get_mn_major_tma_aligned_packed_ue8m0_tensor``) unless ``disable_ue8m0_cast`` — its CUDA kernels pack
  ``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 << 1``, exact for powers of two, garbage exponents otherwise before 2.6.1
  and a device assert from it; its PyTorch fallback keeps ``bits >> 23``; PR #112's 2.0.0 builds assert
  ``mn % 4 == 0 and num_groups == 1`` for MN-major input instead (``emulate(..., before_f85ec64=True)``) — and
  takes int32 (packed UE8M0) SFA only MN-major and TMA-aligned; fp32 SFA on SM100 with the cast disabled is
  "Unsupported architecture or scaling factor types", as is int32 SFA on SM90. The layout helpers are bound
  without ``py::arg`` (``(arg0, /)``) except the packed one from 2.6.1: a keyword is pybind's ``TypeError``.

The contiguous layout is read as the kernels read it: every ``get_mk_alignment_for_contiguous_layout()``-row
block takes its group from its first row (``max(0, grouped_layout[m_block_idx * BLOCK_M])``,
deep_gemm/include/deep_gemm/scheduler/gemm.cuh); the fake refuses a block whose rows are not that group followed
by -1 padding (DeepGEMM does not check and computes garbage). Padding rows are unspecified (``ensure_zero_padding``
only concerns the PSUM layout): NaN here on both architectures. The masked GEMM stores whole BLOCK_M tiles into
one ``[G·m, n]`` view (csrc/jit_kernels/impls/runtime_utils.hpp make_tma_cd_desc): rows from ``masked_m`` up to
the tile end get garbage (NaN here) and, where that passes ``m``, the next group's first rows do too. The fake
picks, from the BLOCK_M values the version's heuristic may choose, one that does not divide ``m`` when there is
one (the real choice depends on the SM count). TMA descriptors need 16-byte row strides (a "CUDA driver" error).

The PSUM layout (``use_psum_layout=True``, 2.3.0 on): ``grouped_layout`` is int32 ``[num_groups]`` (``get_shape<1>``,
``num_groups == num_groups_``, csrc/apis/gemm.hpp:197-199, BF16 :488-490), group g's inclusive end; its rows start at
``align(grouped_layout[g-1], BLOCK_M)``, BLOCK_M = ``get_mk_alignment_for_contiguous_layout()`` (heuristics/sm90.hpp:
31-33, sm100.hpp:31-37; scheduler/gemm.cuh:217-237). M is free (no check; TMA clips the stores at M);
``expected_m_for_psum_layout`` only feeds the config heuristic. Blocks are written whole from their group's first
row, so a group's padding rows up to its aligned end are computed from their own A rows (its weights): zero when the
caller zeroed them (the ``ensure_zero_padding`` contract, tests/test_fp8_fp4.py:22-29), NaN here otherwise; SM90
FP8 writes exact zeros for a 64-row warpgroup slice starting at or past the end (sm90_fp8_gemm_1d2d.cuh:256, 274);
SM100 with ``ensure_zero_padding=False`` (and 2.4.2–2.5.x, which have no such argument) writes the last block only
up to ``align(end, 16)`` (scheduler/gemm.cuh:189-195). Rows no block writes (past the last group's aligned end, the
trimmed rows) keep what ``d`` held. On SM100 2.6.1 the fp32 SFA cast packs 0 (2^-127) for rows outside the groups
before its power-of-two assert (gemm.hpp:213-217, smxx_layout.cuh:84-131), so padding scales may be anything; it
wants one contiguous SFA (smxx_layout.hpp:191); SM90 reads fp32 SFA of every row (a padding row's scales reach only
that row). Versions: SM90 asserts ``not use_psum_layout`` before 2.4.2; 2.3.x aligns starts to 128 and may pick
BLOCK_M 64 (the fake does: rows past the 64-row block stay unwritten). The fake refuses what DeepGEMM reads unchecked
on the device and turns into garbage: an end outside ``[0, M]``, a decreasing end, an end inside the previous
group's padding, and an empty group whose repeated unaligned end wraps the uint32 block count.

``emulate(capability, version)`` follows the version: the recorded signatures of 2.0–2.2 (``m_indices``), 2.3–2.5
and 2.6.1; no ``__version__`` before 2.1.1; ``set_mk_alignment_for_contiguous_layout`` from 2.4.2; the SM100 fp32
1D2D path (``disable_ue8m0_cast``) before 2.2.0; the masked BLOCK_M values (``vendor.dg_masked_block_ms``); the
UE8M0 cast and the PSUM layout per version (above); ``before_f85ec64``: PR #112's names
(``fp8_m_grouped_gemm_nt_masked`` only, no BF16).
Computed in fp32, written to ``d`` as bf16. Not emulated: ``recipe_a``/``recipe_b``, FP4.
``emulated_stream_capturing`` is the emulated GPU's stream capture, the one ``fakes.deep_ep.CUDAGraph`` opens.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moe_dispatch.backend import REQUIRED, VendorSignature
from moe_dispatch_cuda_deepep import vendor

from . import _gemm
from ._native import check_args, check_context, device_assert, dg_assert, incompatible
from .deep_ep import emulated_stream_capturing

__version__ = "2.6.1"
EMULATED_DEVICE_CAPABILITY = (9, 0)

_GEMM = "csrc/apis/gemm.hpp"
_LAYOUT = "csrc/apis/layout.hpp"
_UTILS = "csrc/utils/layout.hpp"
_SMXX = "deep_gemm/include/deep_gemm/impls/smxx_layout.cuh"
_FP8 = torch.float8_e4m3fn
Pair = Any


@dataclass
class _Device:
    """The emulated GPU and library version, and DeepGEMM's runtime state (``set_mk_alignment_...``)."""

    arch: int
    version: str
    mk_alignment: int = vendor.DG_DEFAULT_MK_ALIGNMENT
    #: A 2.0.0 build from PR #112 (9da4a23) before f85ec64: the strictest of its layout-cast variants (asserts, no
    #: PyTorch fallback: 9da4a23 .. 6bc75b5~1 and d9c363f .. 7b6b556~1).
    before_f85ec64: bool = False
    #: Each fp32 scale tensor ``get_mn_major_tma_aligned_tensor`` had to lay out (the module's ``sf_transforms``):
    #: ``"transpose_fp32"`` (its JIT kernel, compiled at the first such call) or ``"copy_"`` (torch's).
    sf_transforms: list[str] = field(default_factory=list)

    @property
    def strict_pow2(self) -> bool:
        return vendor.version_tuple(self.version) >= vendor.DG_POW2_ASSERT_VERSION

    @property
    def sm100_fp32_kernel(self) -> bool:
        """SM100's 1D2D kernel with fp32 scales (``disable_ue8m0_cast``) existed up to 2.1.x (9da4a23 .. 38f8ef7^)."""
        return self.arch == vendor.DG_ARCH_SM100 and vendor.version_tuple(self.version) < (2, 2)

    def masked_block_m(self, m: int) -> int:
        """A BLOCK_M the heuristic may pick for ``m``: one that does not divide it when there is one."""
        info = vendor.DeepGemmInfo(vendor.DEEP_GEMM, object(), "v2", True, version=self.version)
        choices = sorted(vendor.dg_masked_block_ms(info, self.arch, self.mk_alignment))
        misfits = [bm for bm in choices if m % bm]
        return (misfits or choices)[-1]


def _pair(value: Any, function: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value)):
        raise TypeError(f"{function}(): incompatible function arguments: a and b are (tensor, scale factor) pairs")
    return value[0], value[1]


def _major_check(t: torch.Tensor) -> None:
    dg_assert(t.dim() in (2, 3), "dim == 2 or dim == 3", _UTILS)
    if t.dim() == 3:
        dg_assert(t.stride(0) == t.size(-2) * t.size(-1), "t.stride(0) == t.size(-2) * t.size(-1)", _UTILS)
    dg_assert(t.stride(-2) == 1 or t.stride(-1) == 1, "t.stride(-2) == 1 or t.stride(-1) == 1", _UTILS)


def _k_major(t: torch.Tensor) -> bool:
    _major_check(t)
    return t.stride(-1) == 1


def _check_d(d: torch.Tensor) -> None:
    _major_check(d)
    dg_assert(d.stride(-1) == 1, "t.stride(-1) == 1 (D must be N-major)", _UTILS)


def _shape(t: torch.Tensor, dims: int) -> tuple[int, ...]:
    dg_assert(t.dim() == dims, f"t.dim() == {dims}", _UTILS)
    return tuple(int(s) for s in t.shape)


def _check_sf_shape(sf: torch.Tensor, mn: int, k: int, gran_mn: int, gran_k: int, groups: int | None) -> None:
    dg_assert(sf.dtype in (torch.float32, torch.int32), "sf_dtype == torch::kFloat or sf_dtype == torch::kInt",
              _UTILS)
    dg_assert(sf.dim() == (groups is not None) + 2, "sf.dim() == num_groups.has_value() + 2", _UTILS)
    if groups is not None:
        dg_assert(sf.size(-3) == groups, "sf.size(-3) == num_groups", _UTILS)
    dg_assert(sf.size(-2) == _gemm.ceil_div(mn, gran_mn), "sf.size(-2) == ceil_div(mn, gran_mn)", _UTILS)
    per = gran_k * (1 if sf.dtype == torch.float32 else 4)
    dg_assert(sf.size(-1) == _gemm.ceil_div(k, per), "sf.size(-1) == ceil_div(k, gran_k * (float ? 1 : 4))", _UTILS)


def _check_tma_strides(sf: torch.Tensor, mn: int, groups: int | None) -> None:
    """``check_sf_layout(..., tma_stride_check=true)``: MN-major and the MN axis TMA-aligned."""
    if groups is not None:
        dg_assert(sf.stride(-3) == sf.stride(-1) * sf.size(-1), "sf.stride(-3) == sf.stride(-1) * sf.size(-1)",
                  _UTILS)
    dg_assert(sf.stride(-2) == 1 or mn == 1, "sf.stride(-2) == 1 or mn == 1", _UTILS)
    dg_assert(sf.stride(-1) == vendor.tma_aligned_size(mn, sf.element_size()),
              "sf.stride(-1) == get_tma_aligned_size(mn, sf.element_size())", _UTILS)


def _check_sm90_sfb(sf: torch.Tensor, groups: int | None) -> None:
    if groups is not None:
        dg_assert(sf.stride(-3) == sf.size(-2) * sf.size(-1), "sf.stride(-3) == sf.size(-2) * sf.size(-1)", _UTILS)
    dg_assert((sf.stride(-1) == 1 and sf.stride(-2) == sf.size(-1)) or (sf.stride(-1) == sf.size(-2)
                                                                         and sf.stride(-2) == 1),
              "SM90 SFB must be contiguous, or contiguous after transposing the last two dimensions", _UTILS)


def _pack_cast(device: _Device, sf: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``get_mn_major_tma_aligned_packed_ue8m0_tensor`` of fp32 scales: the fp32 values it passes on
    (csrc/jit_kernels/impls/smxx_layout.hpp, deep_gemm/include/deep_gemm/impls/smxx_layout.cuh). Batched
    contiguous scales with ``(mn · sf_k) % 4``, or non-contiguous ones with ``mn % 4`` or several groups, take the
    PyTorch fallback, which keeps ``bits >> 23``; the 2.0.0 builds before 6bc75b5 (and d9c363f .. 7b6b556~1) assert
    instead (``before_f85ec64``). The CUDA kernels pack ``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 << 1``: exact for powers
    of two, garbage exponents otherwise before 2.6.1, a device assert from 2.6.1.

    ``valid`` (a PSUM layout's rows, 2.6.1): one contiguous 2-D tensor only (smxx_layout.hpp:191), always the CUDA
    kernel, which loads 0 for every row outside ``[align(psum[g-1]), psum[g])`` before the power-of-two assert and
    packs byte 0 (2^-127) for it (smxx_layout.cuh:84-94, 121-131): those rows may hold anything."""
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    groups, mn, sf_k = batched.shape
    where = "csrc/jit_kernels/impls/smxx_layout.hpp"
    if valid is not None:
        dg_assert(groups == 1 and batched.is_contiguous(), "num_sf_batches == 1 and batched_sf.is_contiguous()", where)
        kept = torch.where(valid.view(-1, 1), batched[0].float(), torch.zeros(()))
        if device.strict_pow2:
            device_assert(_gemm.is_power_of_two(kept), "(values[j] & 0x807fffffu) == 0", _SMXX)
        return _gemm.cuda_cast(kept).view(sf.shape)
    if device.before_f85ec64:
        dg_assert(groups == 1 or (mn * sf_k) % 4 == 0, "num_groups == 1 or (mn * sf_k) % 4 == 0", where)
        if not batched.is_contiguous():
            dg_assert(mn % 4 == 0 and groups == 1, "mn % 4 == 0 and num_groups == 1", where)
        torch_path = False
    else:
        torch_path = ((mn * sf_k) % 4 != 0 and groups > 1) if batched.is_contiguous() else (mn % 4 != 0 or groups > 1)
    if torch_path:
        return _gemm.exponent_only(sf)
    if not batched.is_contiguous():
        dg_assert(batched.stride(1) == 1 and batched.stride(2) == mn,
                  "batched_sf.stride(1) == 1 and batched_sf.stride(2) == mn", where)
    if device.strict_pow2:
        device_assert(_gemm.is_power_of_two(sf), "(values[j] & 0x807fffffu) == 0", _SMXX)
    if batched.is_contiguous():
        return _gemm.cuda_cast(sf)
    return _gemm.cuda_cast(sf.contiguous())  # the values, whatever their layout: the kernel reads MN-major


def _scales(device: _Device, sfa: torch.Tensor, sfb: torch.Tensor, m: int, n: int, k: int, groups_a: int | None,
            groups_b: int, recipe: Any, disable_ue8m0_cast: bool,
            sfa_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-(row, 128) values of SFA ``[..., m, ceil(k/128)]`` and SFB ``[G, n, ceil(k/128)]``, after
    DeepGEMM's checks and transformations. ``sfa_valid``: the PSUM layout's rows, which the SM100 cast of fp32 SFA
    keeps (2.6.1, csrc/apis/gemm.hpp:213-217; ``_pack_cast``)."""
    if recipe is None:
        if device.arch == vendor.DG_ARCH_SM90:
            dg_assert(sfa.dtype == torch.float32 and sfb.dtype == torch.float32,
                      "sfa_dtype == torch::kFloat and sfb_dtype == torch::kFloat", _UTILS)
            recipe = (1, 128, 128)
        elif device.arch == vendor.DG_ARCH_SM100:
            dg_assert(sfb.dtype in (torch.float32, torch.int32), "sfb_dtype == torch::kFloat or torch::kInt", _UTILS)
            recipe = (1, 128, 128) if sfb.dtype == torch.float32 else (1, 1, 128)
        else:
            dg_assert(False, "Unknown recipe", _UTILS)
    check_args("transform_sf_pair_into_required_layout", "recipe: Optional[Tuple[int, int, int]]", tuple(recipe), "iii")
    gran_a, gran_b, gran_k = recipe[0], recipe[1], recipe[2]
    if (gran_a, gran_k) != (1, 128) or gran_b not in (1, 128):
        raise NotImplementedError(f"the fake covers the 1x128 / 128x128 and 1x1x128 recipes, got {recipe}")
    values = []
    for sf, mn, gran_mn, groups, is_a in ((sfa, m, gran_a, groups_a, True), (sfb, n, gran_b, groups_b, False)):
        _check_sf_shape(sf, mn, k, gran_mn, gran_k, groups)
        if sf.dtype == torch.float32 and (device.arch == vendor.DG_ARCH_SM90 or disable_ue8m0_cast):
            if gran_mn == 128:
                _check_sm90_sfb(sf, groups)
            else:  # SFA: get_mn_major_tma_aligned_tensor (csrc/apis/layout.hpp:41-42), any layout
                sf = _mn_major_fp32(device, sf)
            values.append((sf.float(), "float", gran_mn))
        elif sf.dtype == torch.float32 and device.arch == vendor.DG_ARCH_SM100:
            dg_assert(not disable_ue8m0_cast, "not disable_ue8m0_cast", _LAYOUT)
            rows = sf if gran_mn == 1 else _gemm.rows_from_blocks(sf, mn)
            values.append((_pack_cast(device, rows, sfa_valid if is_a else None), "int", 1))
        elif sf.dtype == torch.int32 and gran_mn == 1 and device.arch == vendor.DG_ARCH_SM100:
            _check_tma_strides(sf, mn, groups)
            values.append((_gemm.ue8m0_values(sf, k), "int", 1))
        else:
            dg_assert(False, "Unknown SF transformation", _LAYOUT)
    (a_vals, a_kind, _), (b_vals, _, b_gran) = values
    supported = (device.arch == vendor.DG_ARCH_SM90 and a_kind == "float") or (
        device.arch == vendor.DG_ARCH_SM100 and (a_kind == "int" or device.sm100_fp32_kernel))
    dg_assert(supported, "Unsupported architecture or scaling factor types", _GEMM)
    b_rows = _gemm.rows_from_blocks(b_vals, n) if b_gran == 128 else b_vals
    return a_vals, b_rows


def _block_groups(device: _Device, grouped_layout: torch.Tensor, m: int, num_groups: int) -> torch.Tensor:
    """Each row's group as the kernels use it: its block's first row's (``max(0, ...)``), -1 for padding rows.
    Refuses (as the fake's own check: DeepGEMM computes wrong rows) a layout where that differs from the rows'
    own ids: blocks of ``get_mk_alignment_for_contiguous_layout()`` rows whose first row carries the group and
    whose other rows are that group or, after the last valid row, -1."""
    alignment = device.mk_alignment
    ids = grouped_layout.long()
    ok = m % alignment == 0 and bool(((ids >= -1) & (ids < num_groups)).all())
    if ok and m:
        blocks = ids.view(-1, alignment)
        first = blocks[:, :1]
        valid = blocks >= 0
        trailing = valid.int().cummin(dim=1).values.bool() == valid  # no valid row after a -1
        ok = bool(((blocks == first) | ~valid).all()) and bool(trailing.all())
    if not ok:
        raise RuntimeError(f"(fake) contiguous layout: M={m} rows must come in blocks of "
                           f"get_mk_alignment_for_contiguous_layout() = {alignment} whose first row carries the "
                           f"block's group (ids in [0, {num_groups})) and whose other rows are that group, then -1 "
                           "padding; DeepGEMM reads each block's group from its first row and does not check")
    return ids


def _contiguous(device: _Device, a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor | None,
                d: torch.Tensor, grouped_layout: torch.Tensor, recipe: Any, disable_ue8m0_cast: bool,
                use_psum_layout: bool, ensure_zero_padding: bool, expected_m_for_psum_layout: Any, fp8: bool) -> None:
    dg_assert(_k_major(a), "major_a == cute::UMMA::Major::K", _GEMM)
    b_k_major = _k_major(b)
    if fp8 and device.arch == vendor.DG_ARCH_SM90:
        dg_assert(b_k_major, "major_b == cute::UMMA::Major::K", _GEMM)
    dg_assert(grouped_layout.is_contiguous(), "grouped_layout.is_contiguous()", _GEMM)
    m, k = _shape(a, 2)
    num_groups, n, k_ = _shape(b, 3)
    m_, n_ = _shape(d, 2)
    dg_assert(m == m_ and n == n_ and k == k_, "m == m_ and n == n_ and k == k_", _GEMM)
    dg_assert(n > 0 and k > 0 and num_groups > 0, "n > 0 and k > 0 and num_groups > 0", _GEMM)
    want = _FP8 if fp8 else torch.bfloat16
    dg_assert(a.dtype == want and b.dtype == want,
              "ab.scalar_type() == kPackedFP4 and arch_major == 10" if fp8 else "a/b scalar_type() == torch::kBFloat16",
              _UTILS if fp8 else _GEMM)
    dg_assert(d.dtype == torch.bfloat16, "d.scalar_type() == torch::kBFloat16", _GEMM)
    dg_assert(grouped_layout.dtype == torch.int32, "grouped_layout.scalar_type() == torch::kInt", _GEMM)
    if use_psum_layout:  # csrc/apis/gemm.hpp:197-199 (BF16 :488-490); expected_m_for_psum_layout: a heuristic hint
        (num_groups_,) = _shape(grouped_layout, 1)
        dg_assert(num_groups == num_groups_, "num_groups == num_groups_", _GEMM)
    else:
        dg_assert(grouped_layout.dim() == 1 and grouped_layout.numel() == m, "m == m__", _GEMM)
        dg_assert(expected_m_for_psum_layout is None, "not expected_m_for_psum_layout.has_value()", _GEMM)
    _check_d(d)
    if m == 0:
        return
    if device.arch not in (vendor.DG_ARCH_SM90, vendor.DG_ARCH_SM100):
        dg_assert(False, "Unsupported architecture", _GEMM)
    if use_psum_layout:
        _psum_contiguous(device, a, sfa, b, sfb, d, grouped_layout, recipe, disable_ue8m0_cast, ensure_zero_padding,
                         fp8)
        return
    if not fp8 and device.arch == vendor.DG_ARCH_SM90:
        dg_assert(k % 64 == 0, "k % 64 == 0", "csrc/jit_kernels/impls/sm90_bf16_gemm.hpp")
    if fp8:
        sa, sb = _scales(device, sfa, sfb, m, n, k, None, num_groups, recipe, disable_ue8m0_cast)
        a_f, w_f = _gemm.dequant_rows(a, sa), _gemm.dequant_rows(b, sb)
    else:
        a_f, w_f = a.float(), b.float()
    _check_tma_strides_of(a, b, d)
    groups = _block_groups(device, grouped_layout, m, num_groups)
    d.copy_(_gemm.grouped_contiguous(a_f, w_f, groups, float("nan")).to(torch.bfloat16))


#: PSUM layout facts the fake needs that vendor.py does not record (deepseek-ai/DeepGEMM history):
#: - 2.3.0 (0f5f266) brought it, SM100 only: ``DG_HOST_ASSERT(not use_psum_layout)`` on SM90 (csrc/apis/gemm.hpp:196
#:   FP8, :466 BF16); SM90 runs it from 2.4.2 (7f2a703).
_SM90_PSUM_VERSION = (2, 4, 2)
_GEMM_2_3 = "csrc/apis/gemm.hpp (DeepGEMM 2.3.0, 0f5f266)"
#: - 2.3.x: group starts aligned to 128 whatever the BLOCK_M (deep_gemm/include/deep_gemm/common/scheduler.cuh:192
#:   @0f5f266, ``align(current_psum_m, 128u)``), BLOCK_M from {64, 128} by the wave heuristic
#:   (csrc/jit_kernels/heuristics/common.hpp:171-172 @0f5f266). From 2.4.2 both are
#:   ``get_mk_alignment_for_contiguous_layout()`` (heuristics/sm90.hpp:31-33, sm100.hpp:31-37; scheduler/gemm.cuh:228).
_PSUM_ALIGNMENT_2_3, _PSUM_BLOCK_MS_2_3 = 128, (64, 128)
#: - SM100 (swap A/B) trims a group's last block to ``align(psum - block start, 16)`` rows (UMMA_STEP_N,
#:   scheduler/gemm.cuh:189-195) from 2.4.2 (7f2a703 scheduler/gemm.cuh:163-167); 2.6.1 (54e2261) adds
#:   ``ensure_zero_padding`` (default True: whole blocks) and the SFA cast that skips gap rows (gemm.hpp:213-217).
_PSUM_TRIM_VERSION, _PSUM_ZERO_PADDING_VERSION = (2, 4, 2), (2, 6, 1)
_UMMA_STEP_N = 16
#: SM90 FP8 (1D2D): each math warpgroup owns 64-row slices (WGMMA::M) of the block, two warpgroups when BLOCK_M > 64
#: (heuristics/sm90.hpp:191); a warpgroup whose first row is at or past the group's end skips its MMAs and stores its
#: zero-initialised accumulators (sm90_fp8_gemm_1d2d.cuh:256, 274, 351-357; scheduler/gemm.cuh:318-319).
_WGMMA_M = 64
#: Row kinds of a PSUM call: not written, a group's row, a written padding row computed from its A row, a written zero.
_UNTOUCHED, _VALID, _GAP, _ZERO = 0, 1, 2, 3


def _psum_valid_rows(ends: list[int], m: int, alignment: int) -> torch.Tensor:
    """Rows ``[align(psum[g-1], alignment), psum[g])`` of some group (``is_valid_mn``, smxx_layout.cuh:74-94)."""
    valid = torch.zeros(m, dtype=torch.bool)
    for g, end in enumerate(ends):
        start = 0 if g == 0 else _gemm.align(max(ends[g - 1], 0), alignment)
        valid[max(start, 0):max(min(end, m), 0)] = True
    return valid


def _psum_plan(device: _Device, ends: list[int], m: int, fp8: bool,
               ensure_zero_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's group (-1 when no block writes it) and kind, as the scheduler walks the PSUM layout
    (deep_gemm/include/deep_gemm/scheduler/gemm.cuh:100-103, 217-237): group g's blocks start at
    ``align(psum[g-1], BLOCK_M)`` (0 for g = 0) and cover ``ceil((psum[g] - start) / BLOCK_M)`` blocks, counted in
    uint32; stores are TMA stores clipped at M. Refuses (the fake's check: DeepGEMM reads the layout on the device
    unchecked) the layouts that make it compute or write garbage."""
    v = vendor.version_tuple(device.version)
    alignment, block_m = ((_PSUM_ALIGNMENT_2_3, min(_PSUM_BLOCK_MS_2_3)) if v < _SM90_PSUM_VERSION else
                          (device.mk_alignment, device.mk_alignment))
    trim = device.arch == vendor.DG_ARCH_SM100 and v >= _PSUM_TRIM_VERSION and (
        v < _PSUM_ZERO_PADDING_VERSION or not ensure_zero_padding)
    warpgroups = fp8 and device.arch == vendor.DG_ARCH_SM90 and block_m > _WGMMA_M

    def refuse(why: str) -> RuntimeError:
        return RuntimeError(f"(fake) PSUM grouped_layout {ends} (M={m}, BLOCK_M={block_m}): {why}; DeepGEMM does not "
                            "check (deep_gemm/include/deep_gemm/scheduler/gemm.cuh:217-237)")

    for g, end in enumerate(ends):
        if not 0 <= end <= m:
            raise refuse(f"grouped_layout[{g}] = {end} lies outside [0, M]: the scheduler walks blocks past M (TMA "
                         "drops their rows; a negative or large value is a huge uint32 block count), and on SM100 the "
                         "fp32 SFA cast reads unloaded shared memory for those rows (smxx_layout.cuh:121-131)")
        if g == 0:
            continue
        prev = ends[g - 1]
        start = _gemm.align(prev, alignment)
        if end < prev:
            raise refuse(f"grouped_layout[{g}] = {end} < grouped_layout[{g - 1}] = {prev}: a PSUM is non-decreasing")
        if prev < end < start:
            raise refuse(f"group {g} ends at {end}, inside group {g - 1}'s padding (group {g} starts at "
                         f"align({prev}, {alignment}) = {start}): those rows are computed with group {g - 1}'s weights"
                         f" and group {g} gets no block; an empty group ends at {start}")
        if end < start and start - end >= block_m:  # end == prev: (end - start + BLOCK_M - 1) wraps in uint32
            raise refuse(f"empty group {g} repeats the unaligned end {prev}: with BLOCK_M {block_m} the uint32 block "
                         f"count ceil_div({end} - {start}, {block_m}) wraps to ~2^32/BLOCK_M blocks (2.3.x aligns "
                         f"starts to {alignment} and may pick BLOCK_M 64); use {start}")
    groups = torch.full((m,), -1, dtype=torch.long)
    kinds = torch.full((m,), _UNTOUCHED, dtype=torch.int8)
    for g, end in enumerate(ends):
        start = 0 if g == 0 else _gemm.align(ends[g - 1], alignment)
        num_blocks = _gemm.ceil_div(end - start, block_m) if end > start else 0
        for i in range(num_blocks):
            first = start + i * block_m
            stop = first + (_gemm.align(end - first, _UMMA_STEP_N) if trim and i == num_blocks - 1 else block_m)
            stop = min(stop, m)
            groups[first:stop] = g
            kinds[first:stop] = _GAP
            kinds[first:min(end, stop)] = _VALID
            if warpgroups:
                for wg in (0, 1):
                    if first + wg * _WGMMA_M >= end:
                        rows = torch.arange(first, stop)
                        kinds[rows[((rows - first) % (2 * _WGMMA_M)) // _WGMMA_M == wg]] = _ZERO
    return groups, kinds


def _psum_contiguous(device: _Device, a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor,
                     sfb: torch.Tensor | None, d: torch.Tensor, grouped_layout: torch.Tensor, recipe: Any,
                     disable_ue8m0_cast: bool, ensure_zero_padding: bool, fp8: bool) -> None:
    """``use_psum_layout=True``: ``grouped_layout[g]`` is group g's inclusive end; its rows start at
    ``align(grouped_layout[g-1], BLOCK_M)``. Valid rows are computed; a written padding row is its own A row times
    the group's weights (the kernel computes it: 0 when that row is zero, the ``ensure_zero_padding`` contract,
    tests/test_fp8_fp4.py:22-29; NaN here otherwise, as meaningless); SM90 FP8's skipped warpgroup slices are zero;
    rows no block writes keep what ``d`` held."""
    v = vendor.version_tuple(device.version)
    sm90 = device.arch == vendor.DG_ARCH_SM90
    ends = [int(e) for e in grouped_layout.tolist()]
    if fp8:
        valid = None
        if device.arch == vendor.DG_ARCH_SM100 and v >= _PSUM_ZERO_PADDING_VERSION:
            valid = _psum_valid_rows(ends, a.shape[0], device.mk_alignment)
        sa, sb = _scales(device, sfa, sfb, a.shape[0], b.shape[1], a.shape[1], None, b.shape[0], recipe,
                         disable_ue8m0_cast, sfa_valid=valid)
        if sm90 and v < _SM90_PSUM_VERSION:
            dg_assert(False, "not use_psum_layout", _GEMM_2_3)
        a_f, w_f = _gemm.dequant_rows(a, sa), _gemm.dequant_rows(b, sb)
    else:
        if sm90 and v < _SM90_PSUM_VERSION:
            dg_assert(False, "not use_psum_layout", _GEMM_2_3)
        if sm90:
            dg_assert(a.shape[1] % 64 == 0, "k % 64 == 0", "csrc/jit_kernels/impls/sm90_bf16_gemm.hpp")
        a_f, w_f = a.float(), b.float()
    _check_tma_strides_of(a, b, d)
    groups, kinds = _psum_plan(device, ends, a.shape[0], fp8, ensure_zero_padding)
    out = _gemm.grouped_contiguous(a_f, w_f, groups, float("nan"))
    out[(kinds == _GAP) & ~_gemm.zero_rows(a)] = float("nan")
    out[kinds == _ZERO] = 0.0
    written = kinds != _UNTOUCHED
    d[written] = out[written].to(torch.bfloat16)


def _masked(device: _Device, a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor | None,
            d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe: Any, disable_ue8m0_cast: bool,
            fp8: bool) -> None:
    dg_assert(_k_major(a) and _k_major(b), "major_a == cute::UMMA::Major::K and major_b == cute::UMMA::Major::K", _GEMM)
    dg_assert(masked_m.is_contiguous(), "masked_m.is_contiguous()", _GEMM)
    num_groups, m, k = _shape(a, 3)
    num_groups_, n, k_ = _shape(b, 3)
    num_groups__, m_, n_ = _shape(d, 3)
    dg_assert(num_groups == num_groups_ == num_groups__ == masked_m.numel(), "num_groups == num_groups_ == ...", _GEMM)
    dg_assert(m == m_ and n == n_ and k == k_, "m == m_ and n == n_ and k == k_", _GEMM)
    dg_assert(expected_m > 0 and m > 0 and n > 0 and k > 0 and num_groups > 0,
              "expected_m > 0 and m > 0 and n > 0 and k > 0 and num_groups > 0", _GEMM)
    want = _FP8 if fp8 else torch.bfloat16
    dg_assert(a.dtype == want and b.dtype == want, "a/b scalar types", _UTILS if fp8 else _GEMM)
    dg_assert(d.dtype == torch.bfloat16, "d.scalar_type() == torch::kBFloat16", _GEMM)
    dg_assert(masked_m.dtype == torch.int32, "masked_m.scalar_type() == torch::kInt", _GEMM)
    _check_d(d)
    if device.arch not in (vendor.DG_ARCH_SM90, vendor.DG_ARCH_SM100):
        dg_assert(False, "Unsupported architecture", _GEMM)
    if fp8:
        sa, sb = _scales(device, sfa, sfb, m, n, k, num_groups, num_groups, recipe, disable_ue8m0_cast)
        a_f, w_f = _gemm.dequant_rows(a, sa), _gemm.dequant_rows(b, sb)
    else:
        dg_assert(device.arch != vendor.DG_ARCH_SM90 or k % 64 == 0, "k % 64 == 0",
                  "csrc/jit_kernels/impls/sm90_bf16_gemm.hpp")
        a_f, w_f = a.float(), b.float()
    _check_tma_strides_of(a, b, d)
    counts = masked_m.tolist()
    if not all(0 <= c <= m for c in counts):
        raise RuntimeError(f"(fake) masked_m {counts} must lie in [0, {m}]: DeepGEMM has no such check, it would "
                           "read and write the following groups' rows (or past the tensor)")
    _gemm.grouped_masked(a_f, w_f, d, counts, device.masked_block_m(m))


def _check_tma_strides_of(*operands: torch.Tensor) -> None:
    """``cuTensorMapEncodeTiled`` refuses a global stride that is not a multiple of 16 bytes; DeepGEMM raises its
    ``DG_CUDA_DRIVER_CHECK`` error (csrc/jit_kernels/impls/runtime_utils.hpp make_tma_2d_desc)."""
    for t in operands:
        stride = max(t.stride(-2), t.stride(-1)) * t.element_size()
        if stride % vendor.TMA_STRIDE_BYTES:
            raise RuntimeError("CUDA driver error (csrc/jit_kernels/impls/runtime_utils.hpp): 1 "
                               "(CUDA_ERROR_INVALID_VALUE, invalid argument)")


_PARAMETER_KINDS = {"positional-only": inspect.Parameter.POSITIONAL_ONLY,
                    "positional": inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    "keyword-only": inspect.Parameter.KEYWORD_ONLY}


def _versioned(fn: Callable[..., Any], record: VendorSignature) -> Callable[..., Any]:
    """``fn`` behind a recorded pybind signature: any other call is pybind's ``TypeError`` ("incompatible function
    arguments"), a keyword for a parameter bound without ``py::arg`` included. ``fn`` takes 2.6.1's parameters by
    name (``m_indices`` is what 2.3.0 renamed to ``grouped_layout``), or only positional ones."""
    params = [inspect.Parameter(p.name, _PARAMETER_KINDS[p.kind],
                                default=inspect.Parameter.empty if p.default == REQUIRED else p.default)
              for p in record.params]
    signature = inspect.Signature(params)
    positional_only = all(p.kind == inspect.Parameter.POSITIONAL_ONLY for p in params)

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            raise incompatible(record.qualname, record.text, args + tuple(kwargs.values())) from None
        bound.apply_defaults()
        if positional_only:
            return fn(*bound.args)
        return fn(**{("grouped_layout" if k == "m_indices" else k): v for k, v in bound.arguments.items()})

    call.__signature__ = signature  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = record.qualname
    return call


def emulate(capability: tuple[int, int] = (9, 0), version: str = __version__, name: str = vendor.DEEP_GEMM, *,
            before_f85ec64: bool = False) -> types.ModuleType:
    """A ``deep_gemm`` module on an emulated GPU of ``capability`` at library ``version``. Versions before 2.1.1 carry
    no ``__version__`` (as DeepGEMM's). ``before_f85ec64`` (2.0.0 only): PR #112's API, with the masked GEMM only as
    ``fp8_m_grouped_gemm_nt_masked``, no BF16 grouped GEMMs, and the layout cast's asserts."""
    if before_f85ec64 and vendor.version_tuple(version) >= (2, 1):
        raise ValueError("before_f85ec64 is a 2.0.0 build")
    device = _Device(capability[0], version, before_f85ec64=before_f85ec64)
    sig = "(a: Tuple[torch.Tensor, torch.Tensor], b: ..., d: torch.Tensor, ...)"

    def m_grouped_fp8_fp4_gemm_nt_contiguous(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                             compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                             ensure_zero_padding=True, expected_m_for_psum_layout=None):  # noqa: ANN202
        (a0, a1), (b0, b1) = _pair(a, vendor.DG_FP8_CONTIGUOUS), _pair(b, vendor.DG_FP8_CONTIGUOUS)
        check_args(vendor.DG_FP8_CONTIGUOUS, sig, (d, grouped_layout, compiled_dims, disable_ue8m0_cast,
                                                   use_psum_layout, ensure_zero_padding, expected_m_for_psum_layout),
                   "ttsbbbI")
        check_context()
        _recipe_pair(recipe_a, recipe_b)
        _contiguous(device, a0, a1, b0, b1, d, grouped_layout, recipe, bool(disable_ue8m0_cast), use_psum_layout,
                    ensure_zero_padding, expected_m_for_psum_layout, True)

    def m_grouped_fp8_fp4_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None,
                                         compiled_dims="nk", disable_ue8m0_cast=False):  # noqa: ANN202
        (a0, a1), (b0, b1) = _pair(a, vendor.DG_FP8_MASKED), _pair(b, vendor.DG_FP8_MASKED)
        check_args(vendor.DG_FP8_MASKED, sig, (d, masked_m, expected_m, compiled_dims, disable_ue8m0_cast), "ttisb")
        check_context()
        _recipe_pair(recipe_a, recipe_b)
        _masked(device, a0, a1, b0, b1, d, masked_m, int(expected_m), recipe, bool(disable_ue8m0_cast), True)

    def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False,
                                          ensure_zero_padding=True, expected_m_for_psum_layout=None):  # noqa: ANN202
        check_args(vendor.DG_BF16_CONTIGUOUS, sig, (a, b, d, grouped_layout, compiled_dims, use_psum_layout,
                                                    ensure_zero_padding, expected_m_for_psum_layout), "ttttsbbI")
        check_context()
        _contiguous(device, a, None, b, None, d, grouped_layout, None, False, use_psum_layout, ensure_zero_padding,
                    expected_m_for_psum_layout, False)

    def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims="nk"):  # noqa: ANN202
        check_args(vendor.DG_BF16_MASKED, sig, (a, b, d, masked_m, expected_m, compiled_dims), "ttttis")
        check_context()
        _masked(device, a, None, b, None, d, masked_m, int(expected_m), None, False, False)

    def get_mk_alignment_for_contiguous_layout():  # noqa: ANN202
        return device.mk_alignment

    def set_mk_alignment_for_contiguous_layout(arg0):  # noqa: ANN001, ANN202
        check_args(vendor.DG_SET_MK_ALIGNMENT, "(arg0: int) -> None", (arg0,), "i")
        device.mk_alignment = int(arg0)

    def get_tma_aligned_size(arg0, arg1):  # noqa: ANN001, ANN202
        check_args(vendor.DG_TMA_ALIGNED_SIZE, "(arg0: int, arg1: int) -> int", (arg0, arg1), "ii")
        dg_assert(vendor.TMA_ALIGNMENT_BYTES % int(arg1) == 0, "kNumTMAAlignmentBytes % element_size == 0",
                  "csrc/utils/math.hpp")
        return _aligned(int(arg0), int(arg1))

    def get_mn_major_tma_aligned_tensor(arg0):  # noqa: ANN001, ANN202
        check_args(vendor.DG_MN_MAJOR_TMA_ALIGNED, "(arg0: torch.Tensor) -> torch.Tensor", (arg0,), "t")
        check_context()
        return _mn_major_fp32(device, arg0)

    def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf, psum_layout=None):  # noqa: ANN001, ANN202
        check_args(vendor.DG_MN_MAJOR_PACKED_UE8M0, "(sf: torch.Tensor, psum_layout: Optional[torch.Tensor] = None)",
                   (sf, psum_layout), "tT")
        check_context()
        return _packed_ue8m0(device, sf, psum_layout)

    def get_mn_major_tma_aligned_packed_ue8m0_tensor_before_2_6_1(arg0):  # noqa: ANN001, ANN202
        check_args(vendor.DG_MN_MAJOR_PACKED_UE8M0, "(arg0: torch.Tensor) -> torch.Tensor", (arg0,), "t")
        check_context()
        return _packed_ue8m0(device, arg0)

    module = types.ModuleType(name, f"DeepGEMM {version} on an emulated SM{capability[0]}{capability[1]}")
    v = vendor.version_tuple(version)
    if v >= vendor.DG_FIRST_VERSION_ATTRIBUTE:
        module.__version__ = version  # type: ignore[attr-defined]
    setattr(module, vendor.EMULATED_CAPABILITY_ATTRIBUTE, tuple(capability))
    records = {r.qualname: r for r in vendor.deep_gemm_signatures("v2", version)}
    newest = {r.qualname: r for r in vendor.DEEP_GEMM_SIGNATURES}
    functions = [(vendor.DG_FP8_CONTIGUOUS, m_grouped_fp8_fp4_gemm_nt_contiguous),
                 (vendor.DG_FP8_MASKED, m_grouped_fp8_fp4_gemm_nt_masked)]
    if not before_f85ec64:
        functions += [(vendor.DG_BF16_CONTIGUOUS, m_grouped_bf16_gemm_nt_contiguous),
                      (vendor.DG_BF16_MASKED, m_grouped_bf16_gemm_nt_masked)]
    for attr, fn in functions:
        record = records[attr]
        if record != newest[attr]:
            fn = _versioned(fn, record)  # an older version's parameters
        setattr(module, attr, fn)
    setattr(module, vendor.DG_FP8_MASKED_ALIAS, getattr(module, vendor.DG_FP8_MASKED))
    if before_f85ec64:  # PR #112 registered the masked GEMM under its old name only
        delattr(module, vendor.DG_FP8_MASKED)
    setattr(module, vendor.DG_MK_ALIGNMENT, get_mk_alignment_for_contiguous_layout)
    if v >= vendor.DG_SET_MK_ALIGNMENT_VERSION:
        setattr(module, vendor.DG_SET_MK_ALIGNMENT,
                _versioned(set_mk_alignment_for_contiguous_layout, vendor.DG_SET_MK_ALIGNMENT_SIG))
    packed = (get_mn_major_tma_aligned_packed_ue8m0_tensor if v >= vendor.DG_PACKED_UE8M0_PY_ARGS_VERSION else
              _versioned(get_mn_major_tma_aligned_packed_ue8m0_tensor_before_2_6_1,
                         vendor.DG_MN_MAJOR_PACKED_UE8M0_SIG_BEFORE_2_6_1))
    for attr, fn in ((vendor.DG_TMA_ALIGNED_SIZE, _versioned(get_tma_aligned_size, vendor.DG_TMA_ALIGNED_SIZE_SIG)),
                     (vendor.DG_MN_MAJOR_TMA_ALIGNED,
                      _versioned(get_mn_major_tma_aligned_tensor, vendor.DG_MN_MAJOR_TMA_ALIGNED_SIG)),
                     (vendor.DG_MN_MAJOR_PACKED_UE8M0, packed)):
        setattr(module, attr, fn)
    module.sf_transforms = device.sf_transforms  # type: ignore[attr-defined]  # the fake's record, not DeepGEMM's
    # The device's stream capture is the one DeepEP's fake records (fakes.deep_ep.CUDAGraph): one emulated GPU.
    setattr(module, vendor.EMULATED_STREAM_CAPTURING_ATTRIBUTE, emulated_stream_capturing)
    return module


def _aligned(mn: int, element_size: int) -> int:
    """``get_tma_aligned_size`` (csrc/utils/math.hpp): ``mn`` rounded up to 16 bytes of elements."""
    per = vendor.TMA_ALIGNMENT_BYTES // element_size
    return -(-mn // per) * per


def _mn_major_layout(values: torch.Tensor) -> torch.Tensor:
    """``[G?, MN, K]`` values in a fresh MN-major tensor with the MN stride TMA-aligned, groups dense."""
    batched = values.unsqueeze(0) if values.dim() == 2 else values
    groups, mn, k = batched.shape
    aligned = _aligned(mn, values.element_size())
    out = torch.empty_strided((groups, mn, k), (aligned * k, 1, aligned), dtype=values.dtype)
    out.copy_(batched)
    return out.squeeze(0) if values.dim() == 2 else out


def _mn_major_fp32(device: _Device, sf: torch.Tensor) -> torch.Tensor:
    """``get_mn_major_tma_aligned_tensor`` (csrc/jit_kernels/impls/smxx_layout.hpp:120-153): fp32 only; returned as it
    is when already so laid out (:123-125), else copied, recorded in ``device.sf_transforms``: by torch's ``copy_`` when
    not contiguous (:131-134), by its ``transpose_fp32`` JIT kernel otherwise (:135-150)."""
    dg_assert(sf.dim() in (2, 3), "dim == 2 or dim == 3", "csrc/jit_kernels/impls/smxx_layout.hpp")
    dg_assert(sf.dtype == torch.float32, "sf.scalar_type() == torch::kFloat", "csrc/jit_kernels/impls/smxx_layout.hpp")
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    mn, k = batched.shape[1], batched.shape[2]
    aligned = _aligned(mn, 4)
    if (batched.stride(0) == aligned * k or sf.dim() == 2) and batched.stride(1) == 1 and batched.stride(2) == aligned:
        return sf
    device.sf_transforms.append("transpose_fp32" if batched.is_contiguous() else "copy_")
    return _mn_major_layout(sf)


def _packed_ue8m0(device: _Device, sf: torch.Tensor, psum_layout: torch.Tensor | None = None) -> torch.Tensor:
    """``get_mn_major_tma_aligned_packed_ue8m0_tensor``: fp32 scales → their exponent bytes (with the 2.6.1 power-of-
    two device assert on the CUDA path), four per int32 (the first in the low byte), MN-major, TMA-aligned. With a
    ``psum_layout`` (2.6.1) rows outside its groups pack as byte 0 whatever they hold (``_pack_cast``)."""
    where = "csrc/jit_kernels/impls/smxx_layout.hpp"
    dg_assert(sf.dim() in (2, 3), "dim == 2 or dim == 3", where)
    dg_assert(sf.dtype == torch.float32, "sf.scalar_type() == torch::kFloat", where)
    valid = None
    if psum_layout is not None:
        dg_assert((sf.dim() == 2 or sf.shape[0] == 1) and sf.is_contiguous(),
                  "num_sf_batches == 1 and batched_sf.is_contiguous()", where)
        dg_assert(psum_layout.dtype == torch.int32 and psum_layout.is_contiguous(),
                  "psum_layout->scalar_type() == torch::kInt and psum_layout->is_contiguous()", where)
        dg_assert(psum_layout.numel() > 0, "psum_layout->numel() > 0", where)
        mn, ends = sf.shape[-2], [int(e) for e in psum_layout.view(-1).tolist()]
        if not all(0 <= e <= mn for e in ends):
            raise RuntimeError(f"(fake) psum_layout {ends}: every end must lie in [0, {mn}]. DeepGEMM does not check; "
                               "its pack kernel takes rows past mn of the last 48-row block as valid and reads them "
                               "from shared memory it never loaded (deep_gemm/include/deep_gemm/impls/"
                               "smxx_layout.cuh:85-94, 121-131), which the power-of-two assert may trap on")
        valid = _psum_valid_rows(ends, mn, device.mk_alignment)
    values = _pack_cast(device, sf, valid)
    k = values.shape[-1]
    exps = (values.contiguous().view(torch.int32) >> 23).to(torch.uint8)
    padded = torch.zeros(*values.shape[:-1], -(-k // 4) * 4, dtype=torch.uint8)
    padded[..., :k] = exps
    return _mn_major_layout(padded.view(torch.int32))


def _recipe_pair(recipe_a: Any, recipe_b: Any) -> None:
    if recipe_a is not None or recipe_b is not None:
        raise NotImplementedError("the fake does not emulate recipe_a/recipe_b")


_SM90 = emulate(EMULATED_DEVICE_CAPABILITY, __version__, __name__)
m_grouped_fp8_gemm_nt_contiguous = getattr(_SM90, vendor.DG_FP8_CONTIGUOUS)
m_grouped_fp8_gemm_nt_masked = getattr(_SM90, vendor.DG_FP8_MASKED)
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
m_grouped_bf16_gemm_nt_contiguous = getattr(_SM90, vendor.DG_BF16_CONTIGUOUS)
m_grouped_bf16_gemm_nt_masked = getattr(_SM90, vendor.DG_BF16_MASKED)
get_mk_alignment_for_contiguous_layout = getattr(_SM90, vendor.DG_MK_ALIGNMENT)
set_mk_alignment_for_contiguous_layout = getattr(_SM90, vendor.DG_SET_MK_ALIGNMENT)
get_tma_aligned_size = getattr(_SM90, vendor.DG_TMA_ALIGNED_SIZE)
get_mn_major_tma_aligned_tensor = getattr(_SM90, vendor.DG_MN_MAJOR_TMA_ALIGNED)
get_mn_major_tma_aligned_packed_ue8m0_tensor = getattr(_SM90, vendor.DG_MN_MAJOR_PACKED_UE8M0)
sf_transforms = _SM90.sf_transforms
