"""Every Python block of the README and the engine guide runs as written (a document's blocks in order, in one
namespace, as a reader pastes them); a block that starts with ``# not run`` (a plugin's module, a torchrun script)
is compiled only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/engine-guide.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(doc: str) -> list[str]:
    return _BLOCK.findall((ROOT / doc).read_text())


@pytest.mark.parametrize("doc", DOCS)
def test_the_python_blocks_run_as_written(doc, capsys):
    found = blocks(doc)
    assert found, f"{doc} has no python block"
    namespace: dict = {"__name__": f"doc:{doc}"}
    ran = 0
    for i, code in enumerate(found):
        compiled = compile(code, f"{doc} block {i + 1}", "exec")
        if code.lstrip().startswith("# not run"):
            continue
        exec(compiled, namespace)  # noqa: S102 - the documentation's own code
        ran += 1
    assert ran, f"{doc}: every block is marked not run"
