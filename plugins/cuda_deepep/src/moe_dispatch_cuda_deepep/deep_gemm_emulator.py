"""A CPU emulator of the subset of DeepGEMM's ``deep_gemm`` module that MoE experts call.

The main surface is DeepGEMM 2.x (deepseek-ai/DeepGEMM ``csrc/apis/gemm.hpp``, registered in
``register_apis`` and re-exported by ``deep_gemm/__init__.py``, since the 2025-07 refactor of
PR #112): ``m_grouped_fp8_gemm_nt_contiguous``, ``m_grouped_fp8_gemm_nt_masked``,
``m_grouped_bf16_gemm_nt_contiguous``, ``m_grouped_bf16_gemm_nt_masked`` and
``get_mk_alignment_for_contiguous_layout``, with the same argument order, shapes, dtypes and
host assertions. ``legacy_v1()`` builds a module with the old generation's names
(``deep_gemm/jit_kernels/m_grouped_gemm.py``: ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs,
rhs, out, m_indices)``, ``..._masked(lhs, rhs, out, masked_m, expected_m)``,
``get_m_alignment_for_contiguous_layout``; fp32 scales only, no BF16 grouped GEMMs).

What it computes, in fp32, written into ``d`` as bf16 in place (DeepGEMM's documented semantics):
``d[m] = dequant(a[m]) @ dequant(b[g])ᵀ`` with ``a`` scaled per (row, 128 channels) and ``b`` per
128×128 block.

- contiguous: ``g = m_indices[m]``; the row count must be a multiple of the alignment (128) and
  every aligned block of rows belongs to one group (padding rows are -1). Rows marked -1 have an
  unspecified output in DeepGEMM; the emulator writes NaN there, so a consumer that reads them
  fails loudly.
- masked: ``a`` is ``[G, M, K]``; only rows ``< masked_m[g]`` are written, the rest of ``d`` is
  left as it was; ``expected_m`` is a tile-size hint and must be > 0.

Scales: fp32 (the SM90 path) or int32 with four UE8M0 exponent bytes per word (the SM100 path,
``moe_dispatch.codecs.pack_ue8m0``), in any strides (DeepGEMM accepts row-major and MN-major
scale tensors and transforms them itself). As on SM100, fp32 weight scales meeting int32
activation scales are cast to UE8M0 by taking their exponent bits (``sf.view(int) >> 23``, i.e.
rounded down to a power of two) unless ``disable_ue8m0_cast``; int32 weight scales are per row,
``[G, N, ceil(K/512)]``. fp32 activation scales with int32 weight scales are an error, as in
DeepGEMM ("Unsupported architecture or scaling factor types").

Not emulated: TMA alignment padding of scale tensors, ``recipe_a``/``recipe_b``, PSUM layouts,
FP4 operands, streams and PDL.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from moe_dispatch.codecs import unpack_ue8m0

__version__ = "2.x-emulated"

#: ``get_mk_alignment_for_contiguous_layout()``: rows per expert segment in the contiguous layout.
MK_ALIGNMENT = 128
BLOCK = 128
_RECIPES = (None, (1, 128, 128), (1, 1, 128))

Pair = tuple[torch.Tensor, torch.Tensor]


def get_mk_alignment_for_contiguous_layout() -> int:
    return MK_ALIGNMENT


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _check_operand(t: torch.Tensor, dtype: torch.dtype, dims: int, name: str) -> None:
    assert t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"
    assert t.dim() == dims, f"{name} must have {dims} dims, got {tuple(t.shape)}"
    assert t.stride(-1) == 1, f"{name} must be K-major (N-major for d)"


def _activation_scales(sf: torch.Tensor, lead: tuple[int, ...], k: int) -> torch.Tensor:
    """fp32 per (row, 128 channels) from fp32 ``[..., ceil(K/128)]`` or int32 ``[..., ceil(K/512)]``."""
    groups = _ceil(k, BLOCK)
    if sf.dtype == torch.int32:
        assert tuple(sf.shape) == (*lead, _ceil(groups, 4)), f"packed UE8M0 SFA must be {(*lead, _ceil(groups, 4))}"
        return unpack_ue8m0(sf, groups)
    assert sf.dtype == torch.float32, f"SFA must be float32 or int32 (packed UE8M0), got {sf.dtype}"
    assert tuple(sf.shape) == (*lead, groups), f"SFA must be {(*lead, groups)}, got {tuple(sf.shape)}"
    return sf.float()


def _weight_scales(sf: torch.Tensor, sfa_is_int: bool, n: int, k: int, disable_ue8m0_cast: bool) -> torch.Tensor:
    """fp32 per (row of b, 128 channels): ``[G, N, ceil(K/128)]``."""
    g, groups = sf.shape[0], _ceil(k, BLOCK)
    if sf.dtype == torch.int32:
        assert sfa_is_int, "Unsupported architecture or scaling factor types (fp32 SFA with UE8M0 SFB)"
        assert tuple(sf.shape) == (g, n, _ceil(groups, 4)), f"packed UE8M0 SFB must be {(g, n, _ceil(groups, 4))}"
        return unpack_ue8m0(sf, groups)
    assert sf.dtype == torch.float32, f"SFB must be float32 or int32, got {sf.dtype}"
    assert tuple(sf.shape) == (g, _ceil(n, BLOCK), groups), f"SFB must be 128x128 blocks {(g, _ceil(n, BLOCK), groups)}"
    sf = sf.float()
    if sfa_is_int:
        # SM100: fp32 SFB is cast to UE8M0 by its exponent bits, unless the caller forbids the cast.
        assert not disable_ue8m0_cast, "Unsupported architecture or scaling factor types (fp32 SFB, UE8M0 SFA)"
        sf = torch.exp2(((sf.contiguous().view(torch.int32) >> 23) & 0xFF).float() - 127.0)
    return sf.repeat_interleave(BLOCK, dim=1)[:, :n]


def _dequant(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data [..., R, K]`` times per-(row, 128) ``scale [..., R, ceil(K/128)]``, in fp32."""
    k = data.shape[-1]
    return data.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def _check_fp8_args(a: Pair, b: Pair, recipe: Any, compiled_dims: str) -> None:
    assert isinstance(a, tuple) and isinstance(b, tuple) and len(a) == 2 and len(b) == 2, "a and b are (data, sf)"
    assert recipe in _RECIPES, f"the emulator covers the 1x128 / 128x128 recipe, got {recipe}"
    assert isinstance(compiled_dims, str)


def _grouped_rows(m_indices: torch.Tensor, m: int, num_groups: int, alignment: int, first_row_valid: bool) -> None:
    assert m_indices.dtype == torch.int32 and m_indices.is_contiguous(), "m_indices must be contiguous int32"
    assert tuple(m_indices.shape) == (m,), f"m_indices must be [{m}]"
    assert m % alignment == 0, f"contiguous layout: M={m} must be a multiple of {alignment} (pad each expert's rows)"
    if m == 0:
        return
    ids = m_indices.long()
    assert bool(((ids >= -1) & (ids < num_groups)).all()), "m_indices must be in [-1, num_groups)"
    blocks = ids.view(-1, alignment)
    top = torch.where(blocks >= 0, blocks, -2).amax(dim=1)  # the block's group, -2 for an all-padding block
    assert bool(((blocks == top[:, None]) | (blocks == -1)).all()), (
        f"contiguous layout: each aligned block of {alignment} rows must belong to one group (padding rows -1)")
    if first_row_valid:
        # v1's scheduler reads a block's group from its first row (fp8_gemm.cuh, GroupedContiguous).
        assert bool((blocks[:, 0] >= 0).all()), (
            "v1 contiguous layout: every block's first row must be valid (v1 reads the group from it)")


def _contiguous(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor | None, d: torch.Tensor,
                m_indices: torch.Tensor, disable_ue8m0_cast: bool, first_row_valid: bool = False) -> None:
    m, k = a.shape
    g, n, k_ = b.shape
    assert k == k_ and tuple(d.shape) == (m, n), f"shapes: a {tuple(a.shape)}, b {tuple(b.shape)}, d {tuple(d.shape)}"
    assert n > 0 and k > 0 and g > 0
    _grouped_rows(m_indices, m, g, get_mk_alignment_for_contiguous_layout(), first_row_valid)
    if m == 0:
        return
    if sfa is not None and sfb is not None:
        sa = _activation_scales(sfa, (m,), k)
        sb = _weight_scales(sfb, sfa.dtype == torch.int32, n, k, disable_ue8m0_cast)
        a_f = _dequant(a, sa)
    else:
        a_f, sb = a.float(), None
    ids = m_indices.long()
    out = torch.full((m, n), float("nan"), dtype=torch.float32)  # -1 rows: unspecified in DeepGEMM
    for group in torch.unique(ids[ids >= 0]).tolist():
        rows = (ids == group).nonzero().squeeze(1)
        w = b[group].float() if sb is None else _dequant(b[group], sb[group])
        out[rows] = a_f[rows] @ w.t()
    d.copy_(out.to(torch.bfloat16))


def _masked(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor | None, d: torch.Tensor,
            masked_m: torch.Tensor, expected_m: int, disable_ue8m0_cast: bool) -> None:
    g, m, k = a.shape
    g_, n, k_ = b.shape
    assert masked_m.dtype == torch.int32 and masked_m.is_contiguous(), "masked_m must be contiguous int32"
    assert g == g_ == masked_m.numel() and tuple(d.shape) == (g, m, n) and k == k_, (
        f"shapes: a {tuple(a.shape)}, b {tuple(b.shape)}, d {tuple(d.shape)}, masked_m {tuple(masked_m.shape)}")
    assert isinstance(expected_m, int) and expected_m > 0 and m > 0 and n > 0 and k > 0 and g > 0, (
        f"expected_m must be a positive int (got {expected_m!r}) and every dim > 0")
    counts = masked_m.tolist()
    assert all(0 <= c <= m for c in counts), f"masked_m must be within [0, {m}]: {counts}"
    if sfa is not None and sfb is not None:
        sa = _activation_scales(sfa, (g, m), k)
        sb = _weight_scales(sfb, sfa.dtype == torch.int32, n, k, disable_ue8m0_cast)
    for group, rows in enumerate(counts):
        if rows == 0:
            continue
        if sfa is None or sfb is None:
            x, w = a[group, :rows].float(), b[group].float()
        else:
            x, w = _dequant(a[group, :rows], sa[group, :rows]), _dequant(b[group], sb[group])
        d[group, :rows] = (x @ w.t()).to(torch.bfloat16)


# -- DeepGEMM 2.x names -------------------------------------------------------------------------------


def m_grouped_fp8_gemm_nt_contiguous(a: Pair, b: Pair, d: torch.Tensor, m_indices: torch.Tensor,
                                     recipe: Any = None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False) -> None:
    """``[M, K] @ [G, N, K].mT`` with ``m_indices[m]`` the group of row m (the 4th argument is
    named ``grouped_layout`` in the newest DeepGEMM: pass it positionally)."""
    _check_fp8_args(a, b, recipe, compiled_dims)
    _check_operand(a[0], torch.float8_e4m3fn, 2, "a")
    _check_operand(b[0], torch.float8_e4m3fn, 3, "b")
    _check_operand(d, torch.bfloat16, 2, "d")
    _contiguous(a[0], a[1], b[0], b[1], d, m_indices, disable_ue8m0_cast)


def m_grouped_fp8_gemm_nt_masked(a: Pair, b: Pair, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                 recipe: Any = None, compiled_dims: str = "nk",
                                 disable_ue8m0_cast: bool = False) -> None:
    """``[G, M, K] @ [G, N, K].mT``, rows ``< masked_m[g]`` of each group."""
    _check_fp8_args(a, b, recipe, compiled_dims)
    _check_operand(a[0], torch.float8_e4m3fn, 3, "a")
    _check_operand(b[0], torch.float8_e4m3fn, 3, "b")
    _check_operand(d, torch.bfloat16, 3, "d")
    _masked(a[0], a[1], b[0], b[1], d, masked_m, expected_m, disable_ue8m0_cast)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, m_indices: torch.Tensor,
                                      compiled_dims: str = "nk") -> None:
    assert isinstance(compiled_dims, str)
    _check_operand(a, torch.bfloat16, 2, "a")
    _check_operand(b, torch.bfloat16, 3, "b")
    _check_operand(d, torch.bfloat16, 2, "d")
    _contiguous(a, None, b, None, d, m_indices, False)


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
                                  expected_m: int, compiled_dims: str = "nk") -> None:
    assert isinstance(compiled_dims, str)
    _check_operand(a, torch.bfloat16, 3, "a")
    _check_operand(b, torch.bfloat16, 3, "b")
    _check_operand(d, torch.bfloat16, 3, "d")
    _masked(a, None, b, None, d, masked_m, expected_m, False)


# -- DeepGEMM v1 names ------------------------------------------------------------------------------


def _v1_contiguous(lhs: Pair, rhs: Pair, out: torch.Tensor, m_indices: torch.Tensor) -> None:
    """v1 ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``: SM90 only, fp32 scales."""
    assert lhs[1].dtype == torch.float32 and rhs[1].dtype == torch.float32, "DeepGEMM v1 takes fp32 scales"
    _check_operand(lhs[0], torch.float8_e4m3fn, 2, "lhs")
    _check_operand(rhs[0], torch.float8_e4m3fn, 3, "rhs")
    _check_operand(out, torch.bfloat16, 2, "out")
    _contiguous(lhs[0], lhs[1], rhs[0], rhs[1], out, m_indices, False, first_row_valid=True)


def _v1_masked(lhs: Pair, rhs: Pair, out: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    assert lhs[1].dtype == torch.float32 and rhs[1].dtype == torch.float32, "DeepGEMM v1 takes fp32 scales"
    _check_operand(lhs[0], torch.float8_e4m3fn, 3, "lhs")
    _check_operand(rhs[0], torch.float8_e4m3fn, 3, "rhs")
    _check_operand(out, torch.bfloat16, 3, "out")
    _masked(lhs[0], lhs[1], rhs[0], rhs[1], out, masked_m, expected_m, False)


def legacy_v1() -> types.ModuleType:
    """A module object with DeepGEMM v1's grouped-GEMM names (no BF16), computing the same way."""
    module = types.ModuleType("deep_gemm_v1_emulated", "DeepGEMM v1 grouped GEMMs, emulated on CPU")
    module.__version__ = "1.x-emulated"  # type: ignore[attr-defined]
    module.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = _v1_contiguous  # type: ignore[attr-defined]
    module.m_grouped_gemm_fp8_fp8_bf16_nt_masked = _v1_masked  # type: ignore[attr-defined]
    module.get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout  # type: ignore[attr-defined]
    return module


__all__ = [
    "MK_ALIGNMENT",
    "get_mk_alignment_for_contiguous_layout",
    "legacy_v1",
    "m_grouped_bf16_gemm_nt_contiguous",
    "m_grouped_bf16_gemm_nt_masked",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
]
