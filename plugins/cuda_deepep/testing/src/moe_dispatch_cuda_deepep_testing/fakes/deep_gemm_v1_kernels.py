"""DeepGEMM v1's JIT-compiled grouped-GEMM kernels, on CPU: what runs after v1's Python layer has checked
its arguments, so that layer can be driven for real without a GPU (the optional ``vendor_code`` tests).

- ``GroupedContiguous``: the scheduler takes each block's group from the block's first row
  (``__ldg(grouped_layout + m_block_idx * BLOCK_M)``, deepseek-ai/DeepGEMM@b05ed2f
  deep_gemm/include/deep_gemm/scheduler.cuh); before 0c88cd0 (#113, 2025-06-15) a -1 there is an illegal
  address, from then on ``max(0, ...)``. Every row of a block is multiplied with that group's weights.
- ``GroupedMasked``: rows ``< masked_m[g]`` of group g, stored as whole BLOCK_M tiles (a full ``block_m`` TMA
  box since 6db7e18, and at b05ed2f: rows past ``masked_m`` get garbage, spilling into the next group when the
  tile passes M); the rest of ``out`` is left as it was.
- The JIT compile of b05ed2f's template fails ("Misaligned barriers", a static assert) when ceil(K/128) is odd and
  BLOCK_N divides 128 (deep_gemm/include/deep_gemm/fp8_gemm.cuh, removed by 6c5da03); nvcc's failure reaches
  Python as ``subprocess.CalledProcessError`` from ``check_call`` (deep_gemm/jit/compiler.py build).

``installed(deep_gemm)`` swaps these in for v1 1.0.0's ``jit_tuner`` (deep_gemm/jit_kernels/tuner.py), sets
the SM count ``get_num_sms()`` would read from the device, and lets ``torch.cuda.current_stream()`` (an
argument of the kernel) answer without CUDA — in the vendor's ``m_grouped_gemm`` module only.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Iterator

import torch

from moe_dispatch_cuda_deepep import vendor

from . import _gemm


def run_contiguous(lhs: torch.Tensor, lhs_scales: torch.Tensor, rhs: torch.Tensor, rhs_scales: torch.Tensor,
                   out: torch.Tensor, m_indices: torch.Tensor, block_m: int, skips_negative: bool) -> None:
    m, n = out.shape
    first = m_indices.long()[::block_m]
    if not skips_negative and bool((first < 0).any()):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (a block whose first m_indices "
                           "entry is -1; DeepGEMM v1 before #113)")
    groups = first.clamp(min=0).repeat_interleave(block_m)[:m]
    a = _gemm.dequant_rows(lhs, lhs_scales)
    w = _gemm.dequant_rows(rhs, _gemm.rows_from_blocks(rhs_scales, n))
    out.copy_(_gemm.grouped_contiguous(a, w, groups, 0.0).to(torch.bfloat16))


def run_masked(lhs: torch.Tensor, lhs_scales: torch.Tensor, rhs: torch.Tensor, rhs_scales: torch.Tensor,
               out: torch.Tensor, masked_m: torch.Tensor, block_m: int) -> None:
    n = out.shape[-1]
    a = _gemm.dequant_rows(lhs, lhs_scales)
    w = _gemm.dequant_rows(rhs, _gemm.rows_from_blocks(rhs_scales, n))
    _gemm.grouped_masked(a, w, out, masked_m.tolist(), block_m)


def misaligned_barriers(k: int, block_n: int) -> bool:
    """b05ed2f's ``DG_STATIC_ASSERT(not kMustUseUniformedScaleB or SHAPE_K_SCALES % 2 == 0, "Misaligned
    barriers")`` with kMustUseUniformedScaleB = ``BLOCK_K (128) % BLOCK_N == 0``."""
    return 128 % block_n == 0 and _gemm.ceil_div(k, 128) % 2 == 1


class _Kernel:
    """A "compiled" kernel: called with the vendor's argument tuple (its ``arg_defs`` order)."""

    def __init__(self, keys: dict[str, Any], arg_defs: tuple) -> None:
        self.keys, self.names = keys, [name for name, _ in arg_defs]

    def __call__(self, *args: Any) -> int:
        a = dict(zip(self.names, args))
        if self.keys["GEMM_TYPE"] == "GroupedContiguous":
            run_contiguous(a["lhs"], a["lhs_scales"], a["rhs"], a["rhs_scales"], a["out"], a["grouped_layout"],
                           int(self.keys["BLOCK_M"]), skips_negative=False)
        elif self.keys["GEMM_TYPE"] == "GroupedMasked":
            run_masked(a["lhs"], a["lhs_scales"], a["rhs"], a["rhs_scales"], a["out"], a["grouped_layout"],
                       int(self.keys["BLOCK_M"]))
        else:
            raise NotImplementedError(f"no CPU kernel for {self.keys['GEMM_TYPE']}")
        return 0


class CpuJitTuner:
    """Stands in for ``jit_tuner``: ``compile_and_tune`` returns the CPU kernel instead of compiling."""

    def compile_and_tune(self, name: str, keys: dict, space: tuple, includes: tuple, arg_defs: tuple,
                         template: str, args: tuple) -> _Kernel:
        if misaligned_barriers(int(keys["K"]), int(keys["BLOCK_N"])):
            print("error: static assertion failed with \"Misaligned barriers\"", file=sys.stderr)
            raise subprocess.CalledProcessError(1, ["nvcc", f"{name}.cu"])
        return _Kernel(keys, arg_defs)


class _TorchWithoutStreams:
    """``torch`` as the vendor module sees it, with ``torch.cuda.current_stream()`` answering on CPU."""

    class _Cuda:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cuda, name)

        @staticmethod
        def current_stream(device: Any = None) -> None:
            return None

    cuda = _Cuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextmanager
def installed(deep_gemm: ModuleType, num_sms: int = vendor.H100_NUM_SMS) -> Iterator[None]:
    """DeepGEMM v1 1.0.0's Python with these kernels, inside the block."""
    grouped = importlib.import_module(f"{deep_gemm.__name__}.jit_kernels.m_grouped_gemm")
    utils = importlib.import_module(f"{deep_gemm.__name__}.jit_kernels.utils")
    saved = (grouped.jit_tuner, grouped.torch, utils._num_sms)
    grouped.jit_tuner, grouped.torch, utils._num_sms = CpuJitTuner(), _TorchWithoutStreams(), num_sms
    try:
        yield
    finally:
        grouped.jit_tuner, grouped.torch, utils._num_sms = saved


__all__ = ["CpuJitTuner", "installed", "misaligned_barriers", "run_contiguous", "run_masked"]
