"""The vendor boundary of every hardware plugin, checked by reading the source (AST).

Each plugin package has three kinds of module (issue 13, docs/writing-a-backend.md):

- ``vendor``: every vendor name, recorded signature, constant, environment variable and version
  rule, written once, with its citation. It imports no adapter module and no fake.
- ``fakes.*``: the emulators of the vendor. They import vendor facts from ``vendor`` (their own
  plugin's or another's) and may build on other fakes; never on an adapter module, so a fake
  cannot inherit the adapter's understanding of the vendor.
- everything else (the adapter): never imports a fake; it names one by its module path when a
  test asks for it.

A vendor name written in ``vendor.py`` (a module-level string constant such as a function name or
an environment variable) must not be written again as a literal in the adapter or the fakes.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARDWARE_PLUGINS = ("cuda_deepep", "flashinfer_cutedsl", "ascend_deepep", "ascend_fuseep")
#: A string worth checking for repetition: identifier-like, with an underscore or dot
#: (function names, module paths, environment variables), not a short word.
VENDOR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*[_.][A-Za-z0-9_.]*$")


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. moe_dispatch_cuda_deepep.fakes.deep_ep
    path: Path
    tree: ast.Module

    @property
    def kind(self) -> str:
        parts = self.name.split(".")
        if len(parts) > 1 and parts[1] == "fakes":
            return "fake"
        if parts[1:] == ["vendor"]:
            return "vendor"
        return "adapter"

    @property
    def package(self) -> str:
        return self.name.split(".")[0]


def _package_dir(plugin: str) -> Path:
    found = sorted(d for d in (ROOT / "plugins" / plugin / "src").glob("moe_dispatch_*") if (d / "__init__.py").is_file())
    assert len(found) == 1, f"plugins/{plugin}/src must hold one package, found {found}"
    return found[0]


def _modules(plugin: str) -> list[Module]:
    pkg = _package_dir(plugin)
    out = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(Module(".".join(parts), path, ast.parse(path.read_text(encoding="utf-8"))))
    return out


def _imports(module: Module) -> set[str]:
    """Every module a module imports, relative imports resolved (``from . import x`` gives
    ``pkg.x`` and ``pkg``, since x may be a module or a name)."""
    is_package = module.path.name == "__init__.py"
    here = module.name.split(".") if is_package else module.name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _kind_of(name: str, packages: set[str]) -> str | None:
    """The kind of an imported plugin module (None: not a plugin module)."""
    parts = name.split(".")
    if parts[0] not in packages:
        return None
    if len(parts) == 1:
        return "package"
    if parts[1] == "fakes":
        return "fake"
    if parts[1] == "vendor":
        return "vendor"
    return "adapter"


ALL_PACKAGES = {_package_dir(p).name for p in HARDWARE_PLUGINS}


@pytest.mark.parametrize("plugin", HARDWARE_PLUGINS)
def test_each_plugin_has_a_vendor_module_fakes_and_a_vendor_md(plugin):
    pkg = _package_dir(plugin)
    assert (pkg / "vendor.py").is_file(), f"{pkg}/vendor.py: the vendor boundary is missing"
    assert (pkg / "fakes" / "__init__.py").is_file(), f"{pkg}/fakes/: the fakes live apart from the adapter"
    assert (ROOT / "plugins" / plugin / "VENDOR.md").is_file(), f"plugins/{plugin}/VENDOR.md is missing"
    assert (ROOT / "plugins" / plugin / "scripts" / "hardware_check.py").is_file() or plugin == "ascend_fuseep", (
        f"plugins/{plugin}/scripts/hardware_check.py is missing")


@pytest.mark.parametrize("plugin", HARDWARE_PLUGINS)
def test_fakes_and_adapters_never_import_each_other(plugin):
    problems = []
    for module in _modules(plugin):
        for imported in sorted(_imports(module)):
            kind = _kind_of(imported, ALL_PACKAGES)
            if module.kind == "adapter" and kind == "fake":
                problems.append(f"{module.name} (adapter) imports the fake {imported}")
            if module.kind == "fake" and kind == "adapter":
                problems.append(f"{module.name} (fake) imports the adapter module {imported}")
            if module.kind == "vendor" and kind in ("adapter", "fake"):
                problems.append(f"{module.name} (vendor facts) imports {imported}")
    assert not problems, "\n".join(problems)


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments: text → NAME."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            value = node.value.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(value, str) and VENDOR_NAME.match(value):
                for target in targets:
                    if isinstance(target, ast.Name):
                        found[value] = target.id
    return found


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


@pytest.mark.parametrize("plugin", HARDWARE_PLUGINS)
def test_vendor_names_are_written_once(plugin):
    modules = _modules(plugin)
    vendor = next(m for m in modules if m.kind == "vendor")
    names = _string_constants(vendor.tree)
    problems = []
    for module in modules:
        if module.kind == "vendor":
            continue
        skip = _docstrings(module.tree)
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and node.value in names:
                problems.append(f"{module.name}:{node.lineno} writes {node.value!r} again; use "
                                f"vendor.{names[node.value]}")
    assert not problems, "\n".join(problems)
