"""How the vendors' compiled layers fail, for the fakes: pybind11 argument conversion and the C++
exceptions DeepEP and DeepGEMM throw.

- pybind11 raises ``TypeError: <fn>(): incompatible function arguments. The following argument types
  are supported: ...`` when an argument does not convert: a Python object where a bound class
  (``deep_ep.Config``) is wanted, a float where an ``int`` is, a negative number for ``size_t``.
- ``EP_HOST_ASSERT`` throws ``EPException("Assertion", file, line, cond)`` (deepseek-ai/DeepEP@dd758ca
  deep_ep/include/deep_ep/common/exception.cuh); ``DG_HOST_ASSERT`` throws ``DGException``
  (deepseek-ai/DeepGEMM@54e2261 csrc/utils/exception.hpp). Both derive from ``std::exception``, which
  pybind11 turns into ``RuntimeError`` with the ``what()`` text.
- A device-side assert (``EP_DEVICE_ASSERT``, ``DG_DEVICE_ASSERT``) is ``printf`` + ``asm("trap;")``
  (deepseek-ai/DeepEP@dd758ca deep_ep/include/deep_ep/common/exception.cuh; deepseek-ai/DeepGEMM@54e2261
  deep_gemm/include/deep_gemm/common/exception.cuh): CUDA reports ``cudaErrorLaunchFailure`` ("unspecified
  launch failure") at the next synchronisation, and the context is lost: every later CUDA call in the process
  fails the same way. The fakes raise in the call (a CPU has no asynchronous error) and poison a process-wide
  "context" that every fake entry point checks (``check_context``); only a new process clears it on a GPU, the
  tests call ``reset_context``.
"""

from __future__ import annotations

from typing import Any

import torch


def is_int(value: Any) -> bool:
    """pybind11's integer caster: anything with ``__index__`` except a float."""
    return not isinstance(value, float) and hasattr(type(value), "__index__")


def is_bool(value: Any) -> bool:
    """pybind11's ``type_caster<bool>`` in its convert pass (the one a single overload gets): True/False,
    None (as False), and any object whose type fills the number protocol's ``nb_bool`` (``__bool__``: ints,
    floats, tensors); not strings or containers (pybind11 include/pybind11/cast.h)."""
    if value is None or isinstance(value, bool):
        return True
    return not isinstance(value, (str, bytes)) and hasattr(type(value), "__bool__")


def is_tensor(value: Any, optional: bool = False) -> bool:
    return isinstance(value, torch.Tensor) or (optional and value is None)


def incompatible(function: str, signature: str, args: tuple[Any, ...]) -> TypeError:
    shown = ", ".join(type(a).__name__ if not isinstance(a, (int, bool, str)) or isinstance(a, bool) else repr(a)
                      for a in args)
    return TypeError(f"{function}(): incompatible function arguments. The following argument types are supported:\n"
                     f"    1. {signature}\n\nInvoked with: {shown}")


def check_args(function: str, signature: str, args: tuple[Any, ...], kinds: str) -> None:
    """``kinds``: one letter per argument: t tensor, T optional tensor, i int, I optional int, u unsigned int (size_t),
    b bool, s str, c the caller checks (a bound class), x anything."""
    ok = {
        "t": lambda a: is_tensor(a),
        "T": lambda a: is_tensor(a, optional=True),
        "i": is_int,
        "I": lambda a: a is None or is_int(a),
        "u": lambda a: is_int(a) and int(a) >= 0,
        "b": is_bool,
        "s": lambda a: isinstance(a, str),
        "c": lambda a: True,
        "x": lambda a: True,
    }
    if len(args) != len(kinds) or not all(ok[k](a) for k, a in zip(kinds, args)):
        raise incompatible(function, signature, args)


def ep_assert(cond: bool, text: str, where: str) -> None:
    """``EP_HOST_ASSERT(cond)`` in ``where`` (a DeepEP source path)."""
    if not cond:
        raise RuntimeError(f"Assertion exception ({where}): {text}")


def dg_assert(cond: bool, text: str, where: str) -> None:
    """``DG_HOST_ASSERT(cond)`` / ``DG_HOST_UNREACHABLE(text)`` in ``where`` (a DeepGEMM source path)."""
    if not cond:
        raise RuntimeError(f"Assertion error ({where}): {text}")


#: The emulated CUDA context of this process: None while healthy, else why it was lost.
_CONTEXT: dict[str, str | None] = {"lost": None}
LAUNCH_FAILURE = "CUDA error: unspecified launch failure"


def check_context() -> None:
    """Every CUDA call fails once a kernel has trapped in this process."""
    if _CONTEXT["lost"] is not None:
        raise RuntimeError(f"{LAUNCH_FAILURE} (the context was lost earlier: {_CONTEXT['lost']})")


def reset_context() -> None:
    """A fresh process (for the tests; on a GPU only a new process recovers)."""
    _CONTEXT["lost"] = None


def lose_context(why: str) -> RuntimeError:
    """Poison the context (a trap, an illegal address, NVSHMEM gone) and return the error to raise."""
    _CONTEXT["lost"] = why
    return RuntimeError(f"{LAUNCH_FAILURE} ({why})")


def device_assert(cond: bool, text: str, where: str) -> None:
    """A kernel's device-side assert: the kernel traps and the context is lost."""
    if not cond:
        raise lose_context(f"{where}: device assert {text}")


def scalar_type_check(tensor: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``tensor.data_ptr<T>()`` with the wrong dtype: c10 raises 'expected scalar type ...'."""
    if tensor.dtype != dtype:
        raise RuntimeError(f"expected scalar type {dtype} but found {tensor.dtype} ({what})")


__all__ = ["LAUNCH_FAILURE", "check_args", "check_context", "dg_assert", "device_assert", "ep_assert", "incompatible",
           "is_bool", "is_int", "is_tensor", "lose_context", "reset_context", "scalar_type_check"]
