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
from dataclasses import dataclass
from typing import Any

#: The parameter has no default.
REQUIRED = "<required>"



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
