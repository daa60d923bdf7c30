"""The core's size, as an engine and a backend author meet it: one command prints every number
``docs/design.md`` ("Size") tracks.

    python benchmarks/size.py            # run from a checkout with the Quick start's environment

- lines and modules of ``moe_dispatch`` that ``import moe_dispatch`` loads, and its time on top of torch;
- the same after a first ``create_dispatcher("torch", spec)`` + dispatch + combine at world size 1, with no
  plugin installed but the built-ins (``MOE_DISPATCH_PLUGINS=""``: what ``pip install moe-dispatch`` has);
- lines of source in the core distribution, and the size of ``__all__`` and of the backend toolbox;
- core modules a plugin imports, and fake lines inside the plugins' wheels (their ``src/`` trees);
- words of user docs (README.md and docs/*.md).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src" / "moe_dispatch"

_LOADED = r"""
import os, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import moe_dispatch as md
t2 = time.perf_counter()
def mine():
    mods = [m for m in sys.modules.values() if m.__name__.split('.')[0] == 'moe_dispatch' and getattr(m, '__file__', None)]
    return len(mods), sum(sum(1 for _ in open(m.__file__, encoding='utf-8')) for m in mods)
print(*mine(), round((t2 - t1) * 1e3, 1))
if os.environ.get('FIRST_DISPATCH'):
    spec = md.DispatchSpec(256, 8, 2, num_max_dispatch_tokens_per_rank=4)
    d = md.create_dispatcher('torch', spec, env={})
    x = torch.randn(4, 256).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    out = d.dispatch(x, ids, torch.full((4, 2), 0.5))
    d.combine(md.run_experts(md.TorchExperts(), md.ExpertWeights(torch.zeros(8, 64, 256), torch.zeros(8, 256, 32)), out), out)
    print(*mine())
"""


def _run(first_dispatch: bool) -> list[str]:
    env = {**os.environ, "MOE_DISPATCH_PLUGINS": ""}
    if first_dispatch:
        env["FIRST_DISPATCH"] = "1"
    times = []
    for _ in range(5 if not first_dispatch else 1):  # the import time: the best of five fresh processes
        out = subprocess.run([sys.executable, "-c", _LOADED], env=env, capture_output=True, text=True, check=True)
        lines = out.stdout.split("\n")
        times.append(float(lines[0].split()[2]))
    first = lines[0].split()
    return [first[0], first[1], f"{min(times):g}", *(lines[1].split() if first_dispatch else [])]


def _plugin_core_imports() -> set[str]:
    found = set()
    for path in (ROOT / "plugins").glob("*/src/**/*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found |= {n for n in names if n == "moe_dispatch" or n.startswith("moe_dispatch.")}
    return found


def main() -> None:
    modules, lines, ms = _run(False)
    _, _, _, first_modules, first_lines = _run(True)
    core_lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in CORE.rglob("*.py"))
    import moe_dispatch as md
    import moe_dispatch.backend as mdb

    fakes = sum(len(p.read_text(encoding="utf-8").splitlines())
                for p in (ROOT / "plugins").glob("*/src/**/*.py") if "fakes" in p.parts)
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    words = sum(len(re.findall(r"\S+", p.read_text(encoding="utf-8"))) for p in docs)
    imports = sorted(_plugin_core_imports())
    rows = [
        ("import moe_dispatch: modules / lines / ms on top of torch", f"{modules} / {lines} / {ms}"),
        ("first torch dispatch + combine, world size 1: modules / lines", f"{first_modules} / {first_lines}"),
        ("lines of source in the core distribution", str(core_lines)),
        ("moe_dispatch.__all__ / moe_dispatch.backend.__all__", f"{len(md.__all__)} / {len(mdb.__all__)}"),
        ("core modules the plugins' adapters import", f"{len(imports)} ({', '.join(imports)})"),
        ("fake lines inside the plugins' wheels", str(fakes)),
        ("words of user docs (README.md, docs/*.md)", str(words)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
