"""How the vendors' compiled layers fail, for the fakes: pybind11 argument conversion and the C++
exceptions DeepEP and DeepGEMM throw.

- pybind11 raises ``TypeError: <fn>(): incompatible function arguments. The following argument types
  are supported: ...`` when an argument does not convert: a Python object where a bound class
  (``deep_ep.Config``) is wanted, a float where an ``int`` is, a negative number for ``size_t``.
- ``EP_HOST_ASSERT`` throws ``EPException("Assertion", file, line, cond)`` (deepseek-ai/DeepEP@dd758ca
  deep_ep/include/deep_ep/common/exception.cuh); ``DG_HOST_ASSERT`` throws ``DGException``
  (deepseek-ai/DeepGEMM@54e2261 csrc/utils/exception.hpp). Both derive from ``std::exception``, which
  pybind11 turns into ``RuntimeError`` with the ``what()`` text.
- A device-side assert (``EP_DEVICE_ASSERT``, ``DG_DEVICE_ASSERT``) traps the kernel; PyTorch reports it
  as ``RuntimeError: CUDA error: device-side assert triggered`` at the next synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch


def is_int(value: Any) -> bool:
    """pybind11's integer caster: anything with ``__index__`` except a float."""
    return not isinstance(value, float) and hasattr(type(value), "__index__")


def is_bool(value: Any) -> bool:
    """pybind11's bool caster (with conversion): True/False, or anything with ``__bool__``/``__index__``
    that is not a float... in practice the fakes accept bools and ints."""
    return isinstance(value, bool) or is_int(value)


def is_tensor(value: Any, optional: bool = False) -> bool:
    return isinstance(value, torch.Tensor) or (optional and value is None)


def incompatible(function: str, signature: str, args: tuple[Any, ...]) -> TypeError:
    shown = ", ".join(type(a).__name__ if not isinstance(a, (int, bool, str)) or isinstance(a, bool) else repr(a)
                      for a in args)
    return TypeError(f"{function}(): incompatible function arguments. The following argument types are supported:\n"
                     f"    1. {signature}\n\nInvoked with: {shown}")


def check_args(function: str, signature: str, args: tuple[Any, ...], kinds: str) -> None:
    """``kinds``: one letter per argument: t tensor, T optional tensor, i int, u unsigned int (size_t),
    b bool, s str, c the caller checks (a bound class), x anything."""
    ok = {
        "t": lambda a: is_tensor(a),
        "T": lambda a: is_tensor(a, optional=True),
        "i": is_int,
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


def device_assert(cond: bool, text: str, where: str) -> None:
    """A kernel's device-side assert: the kernel traps; CUDA reports it at the next sync."""
    if not cond:
        raise RuntimeError(f"CUDA error: device-side assert triggered ({where}: {text})")


def scalar_type_check(tensor: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``tensor.data_ptr<T>()`` with the wrong dtype: c10 raises 'expected scalar type ...'."""
    if tensor.dtype != dtype:
        raise RuntimeError(f"expected scalar type {dtype} but found {tensor.dtype} ({what})")


__all__ = ["check_args", "dg_assert", "device_assert", "ep_assert", "incompatible", "is_bool", "is_int", "is_tensor",
           "scalar_type_check"]
