"""The examples run as a user runs them, and say what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_two_batch_overlap_gives_the_bits_of_blocking_calls():
    done = subprocess.run([sys.executable, str(EXAMPLES / "two_batch_overlap.py"), "--mode", "normal"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout
    assert all("split phase True, same bits as blocking calls: True" in line for line in lines), done.stdout


def test_transformers_example_agrees_with_the_model_on_one_process():
    import pytest

    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(EXAMPLES / "transformers_expert_parallel.py"), "--local", "2",
                           "--family", "mixtral", "--dtype", "fp8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("argmax agreement 100%" in line for line in lines), done.stdout
