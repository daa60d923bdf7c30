"""How FlashInfer's compiled functions fail, as Python sees them through tvm-ffi.

``TVM_FFI_ICHECK`` throws ``InternalError``, which tvm-ffi raises as ``RuntimeError`` (tvm_ffi
cython/error.pxi: kinds it does not register become RuntimeError); ``TVM_FFI_LOG_AND_THROW(TypeError)``
raises ``TypeError``; ``FLASHINFER_CHECK`` / ``TLLM_CHECK`` (host checks in the kernel launchers)
throw C++ exceptions that reach Python as ``RuntimeError``. An argument of the wrong Python type is
a ``TypeError`` before the function runs (apache-tvm-ffi 0.1.15).
"""

from __future__ import annotations

from typing import Any

import torch


def icheck(ok: bool, condition: str, message: str = "") -> None:
    """``TVM_FFI_ICHECK(condition) << message``."""
    if not ok:
        raise RuntimeError(f"Check failed: ({condition}) is false: {message}")


def launch_check(ok: bool, message: str) -> None:
    """``FLASHINFER_CHECK`` / ``TLLM_CHECK`` in a kernel launcher."""
    if not ok:
        raise RuntimeError(message)


def device_fault(message: str, error: str = "an illegal memory access was encountered") -> None:
    """What a kernel that faults leaves behind (an illegal address, a misaligned address, a trap)."""
    raise RuntimeError(f"CUDA error: {error} ({message})")


def tensor(fn: str, name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"Mismatched type on argument `{name}` when calling: `{fn}`: expected Tensor, "
                        f"got {type(value).__name__}")


def integer(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Mismatched type on argument `{name}` when calling: `{fn}`: expected int, "
                        f"got {type(value).__name__}")


def boolean(fn: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Mismatched type on argument `{name}` when calling: `{fn}`: expected bool, "
                        f"got {type(value).__name__}")


def check_input(name: str, t: torch.Tensor) -> None:
    """``CHECK_INPUT``: a CUDA tensor (CPU stands in for it here) and contiguous."""
    icheck(t.is_contiguous(), f"{name}.IsContiguous()", f"{name} must be contiguous")


def check_cpu(name: str, t: torch.Tensor) -> None:
    icheck(t.device.type == "cpu", f"{name}.device().device_type == kDLCPU", f"{name} must be a host tensor")


def check_type(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    icheck(t.dtype == dtype, f"{name}.dtype() == {dtype}", f"Inconsistency of Tensor type: {name}")
