"""Compare a callable with its recorded signature (``vendor.SIGNATURES``), reading a default the
vendor writes as an expression (``SfLayout.layout_linear``, ``ActivationType.Swiglu.value``) in the
namespace of the module that defines the callable (the fake's or FlashInfer's own)."""

from __future__ import annotations

from typing import Any, Callable

from moe_dispatch.signatures import REQUIRED, Param, VendorSignature, compare, params_of
from moe_dispatch.signatures import _default_from_inspect  # the same normal form  # noqa: PLC2701


def _resolve(p: Param, namespace: dict[str, Any]) -> Param:
    if not isinstance(p.default, str) or p.default == REQUIRED:
        return p
    try:
        value = eval(p.default, dict(namespace))  # noqa: S307 - a recorded default expression
    except Exception:  # noqa: BLE001 - a plain string default
        return p
    return Param(p.name, p.kind, _default_from_inspect(value))


def differences(recorded: VendorSignature, fn: Callable[..., Any]) -> list[str]:
    namespace = getattr(fn, "__globals__", {})
    wanted = tuple(_resolve(p, namespace) for p in recorded.params)
    return compare(wanted, params_of(fn), recorded.qualname)


def differences_from_source(recorded: VendorSignature, actual: tuple[Param, ...]) -> list[str]:
    """Against a signature read by AST: expressions compare as text on both sides."""
    return compare(recorded.params, actual, recorded.qualname)


__all__ = ["differences", "differences_from_source"]
