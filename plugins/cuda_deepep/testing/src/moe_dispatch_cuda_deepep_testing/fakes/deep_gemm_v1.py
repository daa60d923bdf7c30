"""A fake of DeepGEMM v1's ``deep_gemm`` (main @ 0c88cd0, #113; v1 went on to 03d0be3 before the 2.x rewrite; the same
Python API as PyPI's deep_gemm 1.0.0 @ b05ed2f): SM90 only, FP8 with fp32 scales only, no BF16.

``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out, m_indices)`` and ``..._masked(lhs, rhs, out,
masked_m, expected_m)`` with v1's Python ``assert``s (deep_gemm/jit_kernels/m_grouped_gemm.py): shapes,
fp32 scales, int32 indices, contiguous LHS/RHS/out/indices and RHS scales; LHS scales made TMA-aligned
column-major by ``get_col_major_tma_aligned_tensor``; the masked GEMM's TMA-store rule (``m % block_m == 0``
when ``num_groups > 1 and m > block_m``; the fake asserts it for every block M v1's heuristic may choose,
64/128/256, since the choice depends on the SM count). The assert exempts ``m <= block_m``, where the whole-tile
store still spills into the next group (the kernel fake shows it). ``wgrad_gemm_fp8_fp8_fp32_nt`` exists (04278f6).
The kernels are ``fakes.deep_gemm_v1_kernels``; ``fakes.deep_gemm_v1_pypi`` is PyPI's 1.0.0 (@ b05ed2f).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import torch

from moe_dispatch_cuda_deepep import vendor

from .deep_gemm_v1_kernels import run_contiguous, run_masked

EMULATED_DEVICE_CAPABILITY = (9, 0)
_num_sms = vendor.H100_NUM_SMS


def set_num_sms(num_sms: int) -> None:
    global _num_sms
    assert 0 < num_sms <= vendor.H100_NUM_SMS
    _num_sms = num_sms


def get_num_sms() -> int:
    return _num_sms


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def get_m_alignment_for_contiguous_layout() -> int:
    return vendor.DG_DEFAULT_MK_ALIGNMENT


def _tma_aligned_size(x: int, element_size: int) -> int:
    """``jit_kernels.utils.get_tma_aligned_size`` (not exported by the package)."""
    assert vendor.TMA_ALIGNMENT_BYTES % element_size == 0
    return vendor.tma_aligned_size(x, element_size)


def get_col_major_tma_aligned_tensor(x: torch.Tensor) -> torch.Tensor:
    """The same values, MN axis fastest, padded to 16 bytes (a copy unless already so)."""
    assert x.dim() in (2, 3)
    squeeze = x.dim() == 2
    b = x.unsqueeze(0) if squeeze else x
    groups, m, n = b.shape
    aligned = _tma_aligned_size(m, x.element_size())
    if b.stride(0) == aligned * n and b.stride(1) == 1 and b.stride(2) == aligned:
        return x
    out = torch.empty((groups, n, aligned), dtype=x.dtype, device=x.device).transpose(1, 2)
    out[:, :m, :] = b
    out = out[:, :m, :]
    return out.squeeze(0) if squeeze else out


@dataclass(frozen=True)
class Rules:
    """What differs between v1 builds: the masked M assert (6da94d2), the block Ms ``get_best_configs`` picks
    from, whether a block whose first ``m_indices`` entry is -1 is skipped (0c88cd0, #113) or an illegal address,
    and whether an odd ceil(K/128) compiles (6c5da03)."""

    masked_asserts_block_m: bool
    masked_block_ms: tuple[int, ...]
    skips_negative: bool
    odd_k_blocks_compile: bool


#: main @ 0c88cd0 (#113).
RULES = Rules(True, vendor.DG_V1_MASKED_BLOCK_MS, True, True)


def _compile(rules: Rules, k: int) -> None:
    """The JIT build of the kernel: before 6c5da03 an odd ceil(K/128) fails to compile when the heuristic picks a
    BLOCK_N dividing 128 (the fake assumes it may)."""
    if not rules.odd_k_blocks_compile and ceil_div(k, 128) % 2:
        print("error: static assertion failed with \"Misaligned barriers\"", file=sys.stderr)
        raise subprocess.CalledProcessError(1, ["nvcc", "m_grouped_gemm_fp8_fp8_bf16_nt.cu"])


def contiguous(rules: Rules, lhs, rhs, out, m_indices) -> None:  # noqa: ANN001
    lhs, lhs_scales = lhs
    rhs, rhs_scales = rhs
    m, k = lhs.shape
    num_groups, n, k_ = rhs.shape
    m_, n_ = out.shape
    m__ = m_indices.numel()
    assert m == m_ == m__ and k == k_ and n == n_
    assert lhs_scales.shape == (m, ceil_div(k, 128))
    assert rhs_scales.shape == (num_groups, ceil_div(n, 128), ceil_div(k, 128))
    assert lhs.dtype == torch.float8_e4m3fn and lhs_scales.dtype == torch.float32
    assert rhs.dtype == torch.float8_e4m3fn and rhs_scales.dtype == torch.float32
    assert out.dtype == torch.bfloat16
    assert m_indices.dtype == torch.int32
    assert lhs.is_contiguous() and rhs.is_contiguous()
    assert out.is_contiguous() and m_indices.is_contiguous()
    lhs_scales = get_col_major_tma_aligned_tensor(lhs_scales)
    assert rhs_scales.is_contiguous()
    if m == 0:
        return
    _compile(rules, k)
    run_contiguous(lhs, lhs_scales, rhs, rhs_scales, out, m_indices, get_m_alignment_for_contiguous_layout(),
                   skips_negative=rules.skips_negative)


def masked(rules: Rules, lhs, rhs, out, masked_m, expected_m) -> None:  # noqa: ANN001
    lhs, lhs_scales = lhs
    rhs, rhs_scales = rhs
    num_groups, m, k = lhs.shape
    num_groups_, n, k_ = rhs.shape
    num_groups__, m_, n_ = out.shape
    num_groups___ = masked_m.numel()
    assert num_groups == num_groups_ == num_groups__ == num_groups___
    assert m == m_ and n == n_ and k == k_
    assert expected_m > 0 and m > 0 and n > 0 and k > 0 and num_groups > 0
    assert lhs_scales.shape == (num_groups, m, ceil_div(k, 128))
    assert rhs_scales.shape == (num_groups, ceil_div(n, 128), ceil_div(k, 128))
    assert lhs.dtype == torch.float8_e4m3fn and lhs_scales.dtype == torch.float32
    assert rhs.dtype == torch.float8_e4m3fn and rhs_scales.dtype == torch.float32
    assert out.dtype == torch.bfloat16
    assert masked_m.dtype == torch.int32
    assert lhs.is_contiguous() and rhs.is_contiguous()
    assert out.is_contiguous() and masked_m.is_contiguous()
    lhs_scales = get_col_major_tma_aligned_tensor(lhs_scales)
    assert rhs_scales.is_contiguous()
    if num_groups > 1 and rules.masked_asserts_block_m:
        for block_m in rules.masked_block_ms:
            assert m <= block_m or m % block_m == 0, (
                f"For masked grouped GEMM, shape M should be multiple of the block M (current block M: {block_m})")
    _compile(rules, k)
    misfits = [bm for bm in rules.masked_block_ms if m % bm]  # the choice depends on the SM count: the worst one
    run_masked(lhs, lhs_scales, rhs, rhs_scales, out, masked_m, (misfits or list(rules.masked_block_ms))[-1])


def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out, m_indices) -> None:  # noqa: ANN001
    contiguous(RULES, lhs, rhs, out, m_indices)


def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out, masked_m, expected_m) -> None:  # noqa: ANN001
    masked(RULES, lhs, rhs, out, masked_m, expected_m)


def wgrad_gemm_fp8_fp8_fp32_nt(lhs, rhs, out) -> None:  # noqa: ANN001
    """Present from 04278f6 (2025-05-14); not emulated."""
    raise NotImplementedError("the fake does not emulate DeepGEMM v1's weight-gradient GEMMs")
