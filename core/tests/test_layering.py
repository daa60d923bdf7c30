"""The core's layering and size (docs/design.md): every import between ``moe_dispatch`` modules,
read from the source by AST (``TYPE_CHECKING`` and function-level imports included), goes to the
importer's own layer or a lower one, and there is no import cycle; ``import moe_dispatch`` loads
none of the wings."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import moe_dispatch

PACKAGE = Path(moe_dispatch.__file__).parent
#: What a first dispatch may load (docs/design.md "Size").
FIRST_DISPATCH_LINES = 4750  # the target is 4,500: docs/design.md "Size" says what the rest is

#: Lowest first. A module not listed here fails ``test_every_module_has_a_layer``.
LAYERS: dict[str, tuple[str, ...]] = {
    # the contract a backend is written against, and the data it carries
    "contract": ("_errors", "_torch_import", "_environ", "_signatures", "_wire", "_spec", "_output", "_streams",
                 "_pending", "_trail", "_codecs", "_scale_layouts", "_contract", "_hookspecs",
                 "_distributed", "_distributed.comm", "_distributed.watch", "_distributed.agreement"),
    # the policies: the wire dtype, the input and output checks, the reference experts, the core's aligned copy
    "policy": ("_resolution", "_checks", "_experts", "_alignment"),
    # where backends and runners come from (the built-ins registered like any plugin)
    "registry": ("_loading", "_registry", "_listing", "_reference", "_reference.builtin", "_reference.exchange",
                 "_reference.receiver", "_reference.slots", "_reference.sums", "_reference.compact", "_reference.static"),
    # what an engine calls, and the toolbox a plugin imports
    "runtime": ("_dispatcher", "_shared_group", "_create", "planning", "backend", ""),
    # the command line: loaded by the console script only
    "wings": ("__main__", "cli", "cli.main", "cli.plan", "cli.presets", "cli.flags", "cli.explain"),
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


_LOADED = ("import sys, moe_dispatch as md\n{code}\n"
           "mods = [m for n, m in sys.modules.items() if n.split('.')[0] == 'moe_dispatch' and getattr(m, '__file__', None)]\n"
           "print(sum(1 for m in mods for _ in open(m.__file__)), ' '.join(m.__name__ for m in mods))")


def _loaded(code: str = "") -> tuple[int, set[str]]:
    """Lines and names of the ``moe_dispatch`` modules a fresh process holds after ``import moe_dispatch`` and
    ``code``, with the built-in backends only (what ``pip install moe-dispatch`` has)."""
    out = subprocess.run([sys.executable, "-c", _LOADED.format(code=code)], capture_output=True, text=True,
                         check=True, env={**os.environ, "MOE_DISPATCH_PLUGINS": ""}).stdout.split()
    return int(out[0]), set(out[1:])


def test_importing_moe_dispatch_loads_the_contract_only():
    """The contract an engine imports: at most 15 modules and 3,000 lines (docs/design.md "Size"), no wing, and
    nothing of creation, the plugin host or the reference backends until first used."""
    lines, loaded = _loaded()
    assert len(loaded) <= 15 and lines <= 3000, (len(loaded), lines)
    later = {f"moe_dispatch.{m}" for m in (*LAYERS["wings"], *LAYERS["registry"], "_create", "_dispatcher",
                                           "backend", "planning")}
    assert sorted(loaded & later) == []
    assert "moe_dispatch._spec" in loaded  # the check reads the real list


def test_a_first_dispatch_loads_what_it_uses():
    """A first torch dispatch and combine at world size 1 stays within its budget and loads nothing for peers (the
    gloo failure detector, the receiver thread, the agreement), streams or the core's aligned copy."""
    lines, loaded = _loaded(
        "import torch\nd = md.create_dispatcher('torch', md.DispatchSpec(128, 4, 2, num_max_dispatch_tokens_per_rank=2), "
        "env={})\nout = d.dispatch(torch.zeros(2, 128, dtype=torch.bfloat16), torch.tensor([[0, 1], [2, 3]]), "
        "torch.ones(2, 2))\nd.combine(torch.zeros(4, 128, dtype=torch.bfloat16), out)")
    assert lines <= FIRST_DISPATCH_LINES, lines
    unused = {f"moe_dispatch.{m}" for m in ("_distributed.watch", "_distributed.agreement", "_reference.receiver",
                                            "_streams", "_alignment", "_environ", "_shared_group",
                                            "backend", "planning")}
    assert sorted(loaded & unused) == []
    assert "moe_dispatch._reference.exchange" in loaded


def test_the_core_imports_nothing_but_the_standard_library_torch_and_pluggy():
    allowed = {"torch", "pluggy"}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            found |= {n.split(".")[0] for n in names}
    assert sorted(found - allowed - {"moe_dispatch"} - set(sys.stdlib_module_names)) == []


def test_the_checks_see_an_upward_import_and_a_cycle():
    """The two checks above on a made-up graph: they would fail on a violation."""
    made_up = {"_errors": {"cli"}, "cli": {"_errors"}}
    assert [(n, d) for n, deps in made_up.items() for d in deps if RANK[d] > RANK[n]] == [("_errors", "cli")]
    assert [sorted(c) for c in _cycles(made_up)] == [["_errors", "cli"]]


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
