"""Vendor signatures as recorded facts: a plugin records, in its ``vendor.py``, the signature of every vendor
callable its adapter calls, as the text of the vendor's ``def`` with a citation. A fake of that callable must have the
same parameters (names, order, kinds, defaults), and the real callable is compared with the same record where the
vendor is installed (``moe_dispatch_testing.signatures``). Standard library only: ``vendor.py`` records its
signatures at import, and hardware scripts compare them on machines without pytest.
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
    body = text.strip().rstrip(":").removeprefix("async ")
    if body.startswith("def "):
        body = body[body.index("("):]
    if "->" in body:  # a return annotation
        body = body[: body.rindex("->")].rstrip()
    fn = ast.parse(f"def _f{body}: pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    return _params_from_ast(fn.args)


@dataclass(frozen=True)
class VendorSignature:
    """A vendor callable's recorded signature: its qualified name, the parameter list as the vendor's ``def`` writes
    it (annotations allowed, ignored), and where it was read."""

    qualname: str
    text: str
    source: str

    @property
    def params(self) -> tuple[Param, ...]:
        return _parse(self.text)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)
