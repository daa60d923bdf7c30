"""Vendor signatures as recorded facts, compared with a fake's or the real vendor's callable.

A plugin records, in its ``vendor.py``, the signature of every vendor callable its adapter
calls, as the text of the vendor's ``def`` with a citation. A fake of that callable must have
the same parameters (names, order, kinds, defaults), so a keyword the vendor does not take, or a
positional argument in the wrong place, fails in the fake as it would in the vendor. The same
record is compared with the real callable where the vendor is installed (``inspect``), or with
the vendor's source file read by AST without importing it (a package that cannot be imported
on this machine).

Defaults are compared as Python literals where they are literals (numbers, strings, bytes,
tuples, ``None``/``True``/``False``, negative numbers). A recorded default the vendor writes as an
expression (``ActivationType.Swiglu.value``) is evaluated in the namespace of the module that
defines the callable compared with it (the vendor's own, or a fake's that defines the same
names), and compared by its source text when that fails or when both sides are read from source;
``inspect`` values that are not literals compare by their ``repr``. Annotations are ignored:
pybind and Python wrappers disagree on them without disagreeing on the call.

This module imports nothing but the standard library: a plugin's ``vendor.py`` records its
signatures with it at import, and hardware scripts compare them on machines without pytest.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

#: The parameter has no default.
REQUIRED = "<required>"

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


@dataclass(frozen=True)
class Param:
    """One parameter: its name, kind and default (a literal value, source text, or ``REQUIRED``)."""

    name: str
    kind: str
    default: Any = REQUIRED

    def describe(self) -> str:
        default = "" if self.default == REQUIRED else f"={self.default!r}"
        return f"{self.name}{default} ({self.kind})"


def _default_from_ast(node: ast.expr | None) -> Any:
    if node is None:
        return REQUIRED
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)


def _params_from_ast(args: ast.arguments) -> tuple[Param, ...]:
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [Param(a.arg, "positional-only" if i < len(args.posonlyargs) else "positional", _default_from_ast(d))
              for i, (a, d) in enumerate(zip(positional, defaults))]
    if args.vararg is not None:
        params.append(Param(args.vararg.arg, "*args"))
    params += [Param(a.arg, "keyword-only", _default_from_ast(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        params.append(Param(args.kwarg.arg, "**kwargs"))
    return tuple(params)


def _parse(text: str) -> tuple[Param, ...]:
    """``"(self, x, y=None, *, z=1)"`` (or a whole ``def`` line) → its parameters."""
    body = text.strip().rstrip(":")
    if body.startswith("async "):
        body = body[len("async "):]
    if body.startswith("def "):
        body = body[len("def "):]
        body = body[body.index("("):]
    if "->" in body:  # a return annotation
        body = body[: body.rindex("->")].rstrip()
    tree = ast.parse(f"def _f{body}: pass")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    return _params_from_ast(fn.args)


@dataclass(frozen=True)
class VendorSignature:
    """A vendor callable's recorded signature: its qualified name, the parameter list as the
    vendor's ``def`` writes it (annotations allowed), and where it was read."""

    qualname: str
    text: str
    source: str

    @property
    def params(self) -> tuple[Param, ...]:
        return _parse(self.text)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


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
            return _params_from_ast(node.args)
    raise LookupError(f"{path}: no function {qualname!r}")


__all__ = ["REQUIRED", "Param", "VendorSignature", "compare", "differences", "params_of", "signature_from_source"]
