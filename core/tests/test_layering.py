"""The core's layering (docs/design.md "The map"): every import between ``moe_dispatch`` modules,
read from the source by AST (``TYPE_CHECKING`` and function-level imports included), goes to the
importer's own layer or a lower one, and there is no import cycle; ``import moe_dispatch`` loads
none of the wings."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import moe_dispatch

PACKAGE = Path(moe_dispatch.__file__).parent

#: Lowest first. A module not listed here fails ``test_every_module_has_a_layer``.
LAYERS: dict[str, tuple[str, ...]] = {
    # the contract a backend is written against, and the data it carries
    "contract": ("errors", "environ", "_torch_import", "signatures", "dtypes", "formats", "wire", "codecs", "hints", "spec",
                 "capabilities", "output", "streams", "pending", "trail", "scale_layouts", "distributed", "distributed.watch",
                 "distributed.comm", "distributed.emulation", "distributed.agreement", "backend", "commands", "hookspecs"),
    # the policies: the wire dtype, the input checks, the reference experts
    "policy": ("resolution", "validation", "output_checks", "experts", "alignment"),
    # where backends and runners come from (the built-ins registered like any plugin)
    "registry": ("loading", "registry", "probes", "reference", "reference.builtin", "reference.exchange", "reference.receiver", "reference.slots"),
    # what an engine calls
    "runtime": ("preparation", "planning", "dispatcher", "layer", ""),
    # the wings: the command line and its applications, the test kit
    "wings": ("__main__", "cli", "cli.main", "cli.plan", "cli.presets", "cli.demo", "cli.bench", "cli.bench.cases",
              "cli.bench.cli", "cli.bench.overhead", "cli.bench.overlap", "cli.bench.report", "cli.bench.results", "cli.bench.runner",
              "cli.bench.worker", "cli.flags", "cli.preflight", "integrations", "integrations.transformers", "testing", "testing.cases", "testing.conformance", "testing.experts",
              "testing.host_reads", "testing.layers", "testing.outcomes", "testing.plugin", "testing.pools", "testing.ranks", "testing.streams", "testing.torchrun", "routing",
              "accuracy", "distributed.local"),
}
RANK = {module: i for i, (_, modules) in enumerate(LAYERS.items()) for module in modules}
WINGS = LAYERS["wings"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The ``moe_dispatch`` modules ``name`` imports ("" is the package itself)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module == "moe_dispatch" or node.module.startswith("moe_dispatch.")):
                target = node.module.removeprefix("moe_dispatch").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}".lstrip(".")
                out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "moe_dispatch" or alias.name.startswith("moe_dispatch."):
                    out.add(alias.name.removeprefix("moe_dispatch").lstrip("."))
    out.discard(name)
    return {m for m in out if m in MODULES}


GRAPH = {name: _imports(name) for name in MODULES}


def test_every_module_has_a_layer():
    assert sorted(set(MODULES) - set(RANK)) == []
    assert sorted(set(RANK) - set(MODULES)) == []  # the map names no module that is gone


def test_imports_go_to_the_same_layer_or_lower():
    upward = [f"{name or 'moe_dispatch'} ({_layer(name)}) imports {dep or 'moe_dispatch'} ({_layer(dep)})"
              for name, deps in sorted(GRAPH.items()) for dep in sorted(deps) if RANK[dep] > RANK[name]]
    assert upward == []


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_importing_moe_dispatch_loads_no_wing():
    code = "import sys, moe_dispatch; print('\\n'.join(m for m in sys.modules if m.startswith('moe_dispatch')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    wings = {f"moe_dispatch.{w}" for w in WINGS}
    assert sorted(set(loaded) & wings) == []
    assert "moe_dispatch.dispatcher" in loaded  # the check reads the real list


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The two checks above on a made-up graph: they would fail on a violation."""
    made_up = {"errors": {"cli"}, "cli": {"errors"}}
    assert [(n, d) for n, deps in made_up.items() for d in deps if RANK[d] > RANK[n]] == [("errors", "cli")]
    assert [sorted(c) for c in _cycles(made_up)] == [["cli", "errors"]]


def _layer(name: str) -> str:
    return list(LAYERS)[RANK[name]]


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found
