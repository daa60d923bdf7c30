"""The boundaries of every plugin, checked by reading the source (AST).

A hardware plugin is two distributions (docs/writing-a-backend.md):

- the plugin, ``plugins/<p>/src/<pkg>/``, what an engine installs: the adapter and ``vendor.py``, where every
  vendor name, recorded signature, constant, environment variable and version rule is written once, with its
  citation. ``vendor`` imports no other module of the plugin.
- its testing distribution, ``plugins/<p>/testing/src/<pkg>_testing/``: the CPU fakes of the vendor
  (``fakes.*``) and what only tests and hardware scripts use. Fakes import vendor facts from ``vendor`` (their own
  plugin's or another's) and may build on other fakes, never on an adapter module, so a fake cannot inherit the
  adapter's understanding of the vendor; the adapter never imports its testing distribution.

Every plugin imports the core through its public modules only: the adapter and ``vendor`` through ``moe_dispatch``
and ``moe_dispatch.backend``; fakes, tests and scripts may also use ``moe_dispatch.planning`` and the kit
(``moe_dispatch_testing``). A vendor name written in ``vendor.py`` (a module-level string constant such as a
function name or an environment variable) is not written again as a literal in the adapter or the fakes.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARDWARE_PLUGINS = ("cuda_deepep", "flashinfer_cutedsl", "ascend_deepep", "ascend_fuseep")
PLUGINS = (*HARDWARE_PLUGINS, "_template")
#: What each kind of module may import of the core.
CORE_FOR_ADAPTERS = {"moe_dispatch", "moe_dispatch.backend"}
CORE_FOR_TESTS = {*CORE_FOR_ADAPTERS, "moe_dispatch.planning", "moe_dispatch.cli"}
#: A string worth checking for repetition: identifier-like, with an underscore or dot
#: (function names, module paths, environment variables), not a short word.
VENDOR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*[_.][A-Za-z0-9_.]*$")


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. moe_dispatch_cuda_deepep_testing.fakes.deep_ep
    path: Path
    tree: ast.Module

    @property
    def kind(self) -> str:
        top, *rest = self.name.split(".")
        if top.endswith("_testing"):
            return "fake" if rest[:1] == ["fakes"] else "support"
        return "vendor" if rest == ["vendor"] else "adapter"


def _package_dir(root: Path) -> Path:
    found = sorted(d for d in root.glob("moe_dispatch_*") if (d / "__init__.py").is_file())
    assert len(found) == 1, f"{root} must hold one package, found {found}"
    return found[0]


def _packages(plugin: str) -> list[Path]:
    """The plugin's package, then its testing distribution's (none for the template)."""
    base = ROOT / "plugins" / plugin
    return [_package_dir(base / "src"), *([_package_dir(base / "testing" / "src")] if plugin != "_template" else [])]


def _modules(plugin: str) -> list[Module]:
    out = []
    for pkg in _packages(plugin):
        for path in sorted(pkg.rglob("*.py")):
            parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append(Module(".".join(parts), path, ast.parse(path.read_text(encoding="utf-8"))))
    return out


def _imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """Every module a module imports, relative imports resolved (``from . import x`` gives ``pkg.x`` and ``pkg``,
    since x may be a module or a name)."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
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
    top, *rest = name.split(".")
    if top not in packages:
        return None
    if top.endswith("_testing"):
        return "fake" if rest[:1] == ["fakes"] else "support"
    return "package" if not rest else "vendor" if rest[0] == "vendor" else "adapter"


ALL_PACKAGES = {pkg.name for p in PLUGINS for pkg in _packages(p)}


def _core_imports(tree: ast.Module) -> set[str]:
    """The ``moe_dispatch`` modules (and names of it) a file imports: ``from moe_dispatch import _x`` is ``_x``."""
    found = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "moe_dispatch":
                names += [f"moe_dispatch.{a.name}" for a in node.names if a.name in ("backend", "planning", "cli")
                          or a.name.startswith("_")]
        found |= {n for n in names if n == "moe_dispatch" or n.startswith("moe_dispatch.")}
    return found


def core_problems(path: Path, tree: ast.Module, allowed: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT)} imports {name}: allowed are {', '.join(sorted(allowed))}"
            for name in sorted(_core_imports(tree) - allowed)]


@pytest.mark.parametrize("plugin", HARDWARE_PLUGINS)
def test_each_plugin_has_a_vendor_module_a_vendor_md_and_its_fakes_outside_the_wheel(plugin):
    pkg, testing = _packages(plugin)
    assert (pkg / "vendor.py").is_file(), f"{pkg}/vendor.py: the vendor boundary is missing"
    assert not (pkg / "fakes").exists(), f"{pkg}/fakes: the fakes ship in the wheel an engine installs"
    assert (testing / "fakes" / "__init__.py").is_file(), f"{testing}/fakes/: the fakes are missing"
    assert (ROOT / "plugins" / plugin / "VENDOR.md").is_file(), f"plugins/{plugin}/VENDOR.md is missing"
    assert (ROOT / "plugins" / plugin / "scripts" / "hardware_check.py").is_file() or plugin == "ascend_fuseep", (
        f"plugins/{plugin}/scripts/hardware_check.py is missing")


@pytest.mark.parametrize("plugin", HARDWARE_PLUGINS)
def test_fakes_and_adapters_never_import_each_other(plugin):
    problems = []
    for module in _modules(plugin):
        for imported in sorted(_imports(module.tree, module.name, module.path.name == "__init__.py")):
            kind = _kind_of(imported, ALL_PACKAGES)
            if module.kind == "adapter" and kind in ("fake", "support"):
                problems.append(f"{module.name} (adapter) imports the testing module {imported}")
            if module.kind == "fake" and kind == "adapter":
                problems.append(f"{module.name} (fake) imports the adapter module {imported}")
            if module.kind == "vendor" and kind in ("adapter", "fake", "support"):
                problems.append(f"{module.name} (vendor facts) imports {imported}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugins_import_only_the_public_core(plugin):
    problems = []
    for module in _modules(plugin):
        problems += core_problems(module.path, module.tree,
                                  CORE_FOR_ADAPTERS if module.kind in ("adapter", "vendor") else CORE_FOR_TESTS)
    for path in sorted(p for sub in ("tests", "scripts") for p in (ROOT / "plugins" / plugin / sub).glob("*.py")):
        problems += core_problems(path, ast.parse(path.read_text(encoding="utf-8")), CORE_FOR_TESTS)
    assert not problems, "\n".join(problems)


def test_the_core_import_check_sees_a_private_module_and_a_private_name():
    tree = ast.parse("import moe_dispatch.backend as mdb\nfrom moe_dispatch._codecs import as_bytes\n"
                     "from moe_dispatch import _wire, DispatchSpec\nimport moe_dispatch.planning\n")
    found = core_problems(ROOT / "x.py", tree, CORE_FOR_ADAPTERS)
    assert [p.split(" imports ")[1].split(":")[0] for p in found] == [
        "moe_dispatch._codecs", "moe_dispatch._wire", "moe_dispatch.planning"]


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
    modules = [m for m in _modules(plugin) if m.kind in ("adapter", "vendor", "fake")]
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
