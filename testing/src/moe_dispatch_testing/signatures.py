"""Comparing a plugin's recorded vendor signatures (``moe_dispatch.backend.VendorSignature``) with a
fake's or the real vendor's callable, or with the vendor's source file read by AST without importing it.

Defaults are compared as Python literals where they are literals. A recorded default the vendor writes
as an expression (``ActivationType.Swiglu.value``) is evaluated in the namespace of the module that
defines the compared callable, and compared by its source text when that fails or when both sides are
read from source; ``inspect`` values that are not literals compare by their ``repr``. Annotations are
ignored: pybind and Python wrappers disagree on them without disagreeing on the call. Standard library
only: hardware scripts compare on machines without pytest.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Callable

from moe_dispatch.backend import REQUIRED, Param, VendorSignature

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def _default_from_inspect(value: Any) -> Any:
    if value is inspect.Parameter.empty:
        return REQUIRED
    try:
        return ast.literal_eval(repr(value))
    except (ValueError, SyntaxError, TypeError):
        return repr(value)


def params_of(fn: Callable[..., Any]) -> tuple[Param, ...]:
    """The parameters of a Python callable, as ``inspect`` sees them (``self`` included for a
    function read off a class, as in the vendor's ``def``)."""
    sig = inspect.signature(fn)
    return tuple(Param(p.name, _KINDS[p.kind], _default_from_inspect(p.default)) for p in sig.parameters.values())


def _same_default(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    return type(a) is type(b) and a == b


def compare(recorded: tuple[Param, ...], actual: tuple[Param, ...], what: str = "") -> list[str]:
    """Sentences naming every difference between two parameter lists; empty when they agree."""
    prefix = f"{what}: " if what else ""
    problems: list[str] = []
    want, got = [p.name for p in recorded], [p.name for p in actual]
    if want != got:
        missing = [n for n in want if n not in got]
        extra = [n for n in got if n not in want]
        detail = []
        if missing:
            detail.append(f"missing {missing}")
        if extra:
            detail.append(f"extra {extra}")
        if not missing and not extra:
            detail.append("order differs")
        problems.append(f"{prefix}parameters {got} != recorded {want} ({'; '.join(detail)})")
    by_name = {p.name: p for p in actual}
    for p in recorded:
        q = by_name.get(p.name)
        if q is None:
            continue
        if p.kind != q.kind:
            problems.append(f"{prefix}{p.name} is {q.kind}, recorded {p.kind}")
        if not _same_default(p.default, q.default):
            problems.append(f"{prefix}{p.name} defaults to {q.default!r}, recorded {p.default!r}")
    return problems


def _resolve(p: Param, namespace: dict[str, Any]) -> Param:
    """A recorded default written as an expression, evaluated where the compared callable lives."""
    if not isinstance(p.default, str) or p.default == REQUIRED:
        return p
    try:
        value = eval(p.default, dict(namespace))  # noqa: S307 - a recorded default expression, not input
    except Exception:  # noqa: BLE001 - a plain string default, or a name this module lacks
        return p
    return Param(p.name, p.kind, _default_from_inspect(value))


def differences(recorded: VendorSignature, fn: Callable[..., Any]) -> list[str]:
    """How ``fn`` (a fake, or the real vendor callable) differs from the recorded signature."""
    namespace = getattr(inspect.unwrap(fn), "__globals__", {})
    wanted = tuple(_resolve(p, namespace) for p in recorded.params)
    return compare(wanted, params_of(fn), recorded.qualname)


def signature_from_source(path: str | Path, qualname: str) -> tuple[Param, ...]:
    """Read ``def`` ``qualname`` (``"func"`` or ``"Class.method"``) from a Python file by AST,
    without importing it.

    :raises LookupError: the file has no such function.
    """
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    scope: list[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        found = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if found is None:
            raise LookupError(f"{path}: no class {owner!r} (looking for {qualname})")
        scope = found.body
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return VendorSignature(qualname, f"({ast.unparse(node.args)})", str(path)).params
    raise LookupError(f"{path}: no function {qualname!r}")
