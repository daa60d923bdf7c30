"""Multi-node under torchrun, on one machine: two torchrun agents (``--nnodes 2``),
two processes each, meeting over 127.0.0.1, so node-local and global ranks differ exactly as
on two machines. Runs the kit's whole-layer check (``moe_dispatch_testing.torchrun``; the demo's torchrun
launcher makes the same rendezvous: core/tests/test_cli.py).

What this proves: the static rendezvous and gloo's connections work between agents, every
rank's slice of the batch, its experts and its device follow the global rank or the node-local
rank as they should (a mix-up fails the accuracy check or the placement check), and a failure
on any rank is a non-zero exit of an agent. What it cannot prove: a real network between
machines (the README and docs/multi-node.md say how to run that).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from moe_dispatch_testing.torchrun import CaseResult, Placement, RankReport, global_problems, main

#: Seconds one two-agent launch may take before both agents and their workers are killed.
LAUNCH_TIMEOUT_S = 90.0
NODES, PER_NODE = 2, 2


@dataclass(frozen=True)
class Agent:
    node_rank: int
    returncode: int
    stdout: str
    stderr: str


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    """The agent and its workers: they share the session the agent was started in."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def launch_two_nodes(tmp_path: Path, *program: str) -> list[Agent]:
    """``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N ... program`` for N = 0, 1."""
    port = _free_port()
    # The children's environment only: gloo on loopback, only the built-in backends, one
    # thread per worker (torchrun's default, said here so the output is quiet).
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MOE_DISPATCH_PLUGINS": "", "OMP_NUM_THREADS": "1"}
    procs, files = [], []
    for node in range(NODES):
        out, err = (tmp_path / f"node{node}.out").open("w+"), (tmp_path / f"node{node}.err").open("w+")
        files.append((out, err))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
               str(PER_NODE), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--local-addr", "127.0.0.1", "--max-restarts", "0", *program]
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True))
    end = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.poll() is None for p in procs]
        for proc in procs:
            _kill(proc)
    agents = []
    for node, (proc, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0), err.seek(0)
        agents.append(Agent(node, proc.returncode, out.read(), err.read()))
        out.close(), err.close()
    if any(timed_out):
        pytest.fail(f"the launch did not finish within {LAUNCH_TIMEOUT_S:.0f} s:\n{_dump(agents)}")
    return agents


def _dump(agents: list[Agent]) -> str:
    return "\n".join(f"--- node {a.node_rank}: exit {a.returncode}\n{a.stdout}\n{a.stderr[-4000:]}" for a in agents)


def test_kit_layer_check_on_two_nodes(tmp_path):
    agents = launch_two_nodes(tmp_path, "-m", "moe_dispatch_testing.torchrun", "--backend", "torch",
                              "--expect-nodes", str(NODES), "--timeout-s", "60")
    assert [a.returncode for a in agents] == [0, 0], _dump(agents)
    head, second = agents[0].stdout, agents[1].stdout
    assert "backend torch, 4 ranks on 2 nodes" in head and "all cases within tolerance: True" in head, head
    # Rank 0's placement table: global rank, node, node-local rank.
    table = {int(m[1]): (int(m[2]), int(m[3])) for m in re.finditer(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+cpu\s", head, re.M)}
    assert table == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}, head
    # Node 1's own workers say the same from their side: global ranks 2 and 3, local 0 and 1.
    assert "rank 2 of 4: node 1, local rank 0 of 2" in second and "rank 3 of 4: node 1, local rank 1 of 2" in second
    assert "PROBLEM" not in head + second
    cases = re.findall(r"^(normal|low_latency)\s+(bf16|fp8|int8|nvfp4)\s.*\s(yes|NO)$", head, re.M)
    assert len(cases) == 8 and {ok for *_, ok in cases} == {"yes"}, head


# -- the checks are not vacuous (no launch needed) ---------------------------------------------


def test_equal_local_and_global_rank_on_a_later_node_is_a_problem():
    wrong = Placement(rank=0, world_size=4, local_rank=0, local_world_size=2, node_rank=1, host="h")
    assert any("LOCAL_RANK equals RANK" in p for p in wrong.problems(0, 4))
    right = Placement(rank=2, world_size=4, local_rank=0, local_world_size=2, node_rank=1, host="h")
    assert right.problems(2, 4) == []
    assert any("process group says 3/4" in p for p in right.problems(3, 4))


def test_the_node_count_and_ranks_are_checked_across_the_launch():
    case = (CaseResult("normal", "bf16", 0.003, 0.01),)
    one_node = [RankReport(Placement(r, 2, r, 2, 0, "h"), "cpu", case, ()) for r in range(2)]
    assert global_problems(one_node, expect_nodes=1) == []
    assert "expected ranks on 2 nodes, found node ranks [0]" in global_problems(one_node, expect_nodes=2)


def test_outside_torchrun_it_says_how_to_run_it(capsys):
    assert main(["--backend", "torch"], env={}) == 2
    assert "run this module under torchrun" in capsys.readouterr().err
