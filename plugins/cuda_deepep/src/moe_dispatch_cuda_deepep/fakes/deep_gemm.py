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
  fp32 SFA in any layout and fp32 SFB contiguous (or contiguous transposed); SM100 casts fp32 scales to
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

``emulate(capability, version)`` follows the version: the recorded signatures of 2.0–2.2 (``m_indices``), 2.3–2.5
and 2.6.1; no ``__version__`` before 2.1.1; ``set_mk_alignment_for_contiguous_layout`` from 2.4.2; the SM100 fp32
1D2D path (``disable_ue8m0_cast``) before 2.2.0; the masked BLOCK_M values (``vendor.dg_masked_block_ms``); the
UE8M0 cast per version (above); ``before_f85ec64``: PR #112's names (``fp8_m_grouped_gemm_nt_masked`` only, no BF16).
Computed in fp32, written to ``d`` as bf16. Not emulated: ``recipe_a``/``recipe_b``, PSUM layouts, FP4.
``emulated_stream_capturing`` is the emulated GPU's stream capture, the one ``fakes.deep_ep.CUDAGraph`` opens.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_dispatch.signatures import REQUIRED, VendorSignature
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


def _pack_cast(device: _Device, sf: torch.Tensor) -> torch.Tensor:
    """``get_mn_major_tma_aligned_packed_ue8m0_tensor`` of fp32 scales: the fp32 values it passes on
    (csrc/jit_kernels/impls/smxx_layout.hpp, deep_gemm/include/deep_gemm/impls/smxx_layout.cuh). Batched
    contiguous scales with ``(mn · sf_k) % 4``, or non-contiguous ones with ``mn % 4`` or several groups, take the
    PyTorch fallback, which keeps ``bits >> 23``; the 2.0.0 builds before 6bc75b5 (and d9c363f .. 7b6b556~1) assert
    instead (``before_f85ec64``). The CUDA kernels pack ``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 << 1``: exact for powers
    of two, garbage exponents otherwise before 2.6.1, a device assert from 2.6.1."""
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    groups, mn, sf_k = batched.shape
    where = "csrc/jit_kernels/impls/smxx_layout.hpp"
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
            groups_b: int, recipe: Any, disable_ue8m0_cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 per-(row, 128) values of SFA ``[..., m, ceil(k/128)]`` and SFB ``[G, n, ceil(k/128)]``, after
    DeepGEMM's checks and transformations."""
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
            values.append((sf.float(), "float", gran_mn))  # SFA: get_mn_major_tma_aligned_tensor (any layout)
        elif sf.dtype == torch.float32 and device.arch == vendor.DG_ARCH_SM100:
            dg_assert(not disable_ue8m0_cast, "not disable_ue8m0_cast", _LAYOUT)
            rows = sf if gran_mn == 1 else _gemm.rows_from_blocks(sf, mn)
            values.append((_pack_cast(device, rows), "int", 1))
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
    if use_psum_layout:
        raise NotImplementedError("the fake does not emulate the PSUM layout")
    dg_assert(grouped_layout.dim() == 1 and grouped_layout.numel() == m, "m == m__", _GEMM)
    dg_assert(expected_m_for_psum_layout is None, "not expected_m_for_psum_layout.has_value()", _GEMM)
    _check_d(d)
    if m == 0:
        return
    if device.arch not in (vendor.DG_ARCH_SM90, vendor.DG_ARCH_SM100):
        dg_assert(False, "Unsupported architecture", _GEMM)
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
        return _mn_major_fp32(arg0)

    def get_mn_major_tma_aligned_packed_ue8m0_tensor(sf, psum_layout=None):  # noqa: ANN001, ANN202
        check_args(vendor.DG_MN_MAJOR_PACKED_UE8M0, "(sf: torch.Tensor, psum_layout: Optional[torch.Tensor] = None)",
                   (sf, psum_layout), "tT")
        check_context()
        if psum_layout is not None:
            raise NotImplementedError("the fake does not emulate the PSUM layout")
        return _packed_ue8m0(device, sf)

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


def _mn_major_fp32(sf: torch.Tensor) -> torch.Tensor:
    """``get_mn_major_tma_aligned_tensor`` (csrc/jit_kernels/impls/smxx_layout.hpp): fp32 only; returned as it is
    when already so laid out."""
    dg_assert(sf.dim() in (2, 3), "dim == 2 or dim == 3", "csrc/jit_kernels/impls/smxx_layout.hpp")
    dg_assert(sf.dtype == torch.float32, "sf.scalar_type() == torch::kFloat", "csrc/jit_kernels/impls/smxx_layout.hpp")
    batched = sf.unsqueeze(0) if sf.dim() == 2 else sf
    mn, k = batched.shape[1], batched.shape[2]
    aligned = _aligned(mn, 4)
    if (batched.stride(0) == aligned * k or sf.dim() == 2) and batched.stride(1) == 1 and batched.stride(2) == aligned:
        return sf
    return _mn_major_layout(sf)


def _packed_ue8m0(device: _Device, sf: torch.Tensor) -> torch.Tensor:
    """``get_mn_major_tma_aligned_packed_ue8m0_tensor``: fp32 scales → their exponent bytes (with the 2.6.1 power-of-
    two device assert on the CUDA path), four per int32 (the first in the low byte), MN-major, TMA-aligned."""
    dg_assert(sf.dtype == torch.float32, "sf.scalar_type() == torch::kFloat", "csrc/jit_kernels/impls/smxx_layout.hpp")
    values = _pack_cast(device, sf)
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
