"""A fake of DeepGEMM v1 as PyPI's ``deep_gemm==1.0.0`` ships it (the v1 Python layer @ b05ed2f, 2025-02-27): what
differs from ``fakes.deep_gemm_v1`` (main @ 0c88cd0).

- No masked ``m % block_m`` assert (6da94d2 came later) and block M from (64, 128) (b05ed2f
  deep_gemm/jit_kernels/gemm.py get_best_configs); the TMA store writes whole tiles either way.
- A block whose first ``m_indices`` entry is -1 is an illegal address (#113, 0c88cd0, made it ``max(0, ...)``).
- An odd ceil(K/128) fails to compile ("Misaligned barriers", deep_gemm/include/deep_gemm/fp8_gemm.cuh, removed
  by 6c5da03) when the heuristic picks a BLOCK_N dividing 128: ``subprocess.CalledProcessError`` from nvcc.
- No ``wgrad_gemm_fp8_fp8_fp32_nt`` (04278f6), which is how the runner tells this build from a later v1.
"""

from __future__ import annotations

from moe_dispatch_cuda_deepep import vendor

from .deep_gemm_v1 import (  # noqa: F401 - the package's names, re-exported
    EMULATED_DEVICE_CAPABILITY,
    Rules,
    ceil_div,
    contiguous,
    get_col_major_tma_aligned_tensor,
    get_m_alignment_for_contiguous_layout,
    get_num_sms,
    masked,
    set_num_sms,
)

RULES = Rules(False, vendor.DG_V1_PYPI_MASKED_BLOCK_MS, False, False)


def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out, m_indices) -> None:  # noqa: ANN001
    contiguous(RULES, lhs, rhs, out, m_indices)


def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out, masked_m, expected_m) -> None:  # noqa: ANN001
    masked(RULES, lhs, rhs, out, masked_m, expected_m)
