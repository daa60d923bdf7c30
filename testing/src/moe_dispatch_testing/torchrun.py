"""The kit's whole-layer check under ``torchrun``: every process is one rank of a real launch,
on one machine or several.

::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST0 --master-port 29500 \\
        -m moe_dispatch_testing.torchrun --backend torch --expect-nodes 2

(the same with ``--node-rank 1`` on the second machine). For every mode and wire dtype the
backend declares, each rank builds the kit's layer shape (``KitShape.for_mode``), creates a
dispatcher through the kit's ``Target`` and runs ``check_layer``: dispatch → the torch
reference experts → combine, against the dense fp32 reference. Each rank prints its own line;
rank 0 prints where every rank runs and the worst error per case. The exit status is 0 only
when every case on every rank is within ``TOLERANCES`` and the ranks are placed as torchrun
says: on every node but the first, ``LOCAL_RANK`` differs from ``RANK``, and the device is
chosen by ``LOCAL_RANK``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from dataclasses import dataclass, fields, replace
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

import moe_dispatch as md
from moe_dispatch import DispatchDtype, DispatchSpec, ExpertWeights, Mode, QuantHints, TorchExperts
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch_testing.routing import random_expert_weights

from .cases import KitShape, Target
from .layers import check_layer

#: The variables torchrun sets in every worker; without them this is not a torchrun launch.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
#: The process-group backend per device type.
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
#: ``check_layer`` draws standard normal activations; none exceeds this in practice
#: (P(|x| > 8) ≈ 1e-15 per value), so an NVFP4 global scale from it never clips, and costs no
#: precision either (the e4m3 block scales stay normal numbers).
ACTIVATION_BOUND = 8.0


class NotUnderTorchrun(Exception):
    """A variable torchrun sets is missing or not an integer."""


@dataclass(frozen=True)
class Placement:
    """Where this process runs: torchrun's global and node-local ranks, and its node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    host: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Placement":
        missing = [name for name in TORCHRUN_VARS if name not in env]
        if missing:
            raise NotUnderTorchrun(f"{', '.join(missing)} not set: run this module under torchrun "
                                   f"(python -m torch.distributed.run ... -m moe_dispatch_testing.torchrun)")
        try:
            values = {name: int(env[name]) for name in TORCHRUN_VARS}
        except ValueError as exc:
            raise NotUnderTorchrun(f"a torchrun variable is not an integer: {exc}") from exc
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"],
                   values["GROUP_RANK"], socket.gethostname())

    def problems(self, group_rank: int, group_size: int) -> list[str]:
        """What contradicts torchrun's contract or the process group (its rank and size)."""
        found = []
        if (self.rank, self.world_size) != (group_rank, group_size):
            found.append(f"RANK/WORLD_SIZE {self.rank}/{self.world_size} but the process group says "
                         f"{group_rank}/{group_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            found.append(f"LOCAL_RANK {self.local_rank} outside 0..{self.local_world_size - 1}")
        if self.node_rank > 0 and self.local_rank == self.rank:
            # Every rank on a later node has a lower-numbered node before it, so RANK is larger;
            # equal values mean something chose devices or slices by the wrong rank.
            found.append(f"on node {self.node_rank}, LOCAL_RANK equals RANK ({self.rank})")
        return found

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size}: node {self.node_rank}, local rank {self.local_rank} of " \
               f"{self.local_world_size}, host {self.host}"


@dataclass(frozen=True)
class CaseResult:
    """One (mode, dtype) on one rank: ``check_layer``'s numbers, or the error it raised."""

    mode: str
    dtype: str
    relative_error: float
    tolerance: float
    decided_by: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.relative_error <= self.tolerance


@dataclass(frozen=True)
class RankReport:
    placement: Placement
    device: str
    cases: tuple[CaseResult, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.cases)

    def line(self) -> str:
        results = ", ".join(f"{c.mode}/{c.dtype} {c.relative_error:.2e} {'ok' if c.ok else 'FAIL'}" for c in self.cases)
        extra = "".join(f"; PROBLEM: {p}" for p in self.problems)
        return f"{self.placement.describe()}, device {self.device}: {results}{extra}"


@dataclass(frozen=True)
class Options:
    """What to run: the backend, optionally fewer modes and dtypes, the kit's shape."""

    backend: str
    modes: tuple[Mode, ...] = ()
    dtypes: tuple[DispatchDtype, ...] = ()
    shape: KitShape = KitShape()
    intermediate: int = 128
    seed: int = 0
    expect_nodes: int | None = None


def layer_cases(options: Options) -> list[tuple[Mode, DispatchDtype]]:
    """Every (mode, dtype) the backend accepts as it is, limited to ``options.modes``/``dtypes``."""
    caps = md.PluginHost.default().get_backend(options.backend).capabilities
    order = list(DispatchDtype)
    return [(mode, dtype) for mode in caps.modes if not options.modes or mode in options.modes
            for dtype in sorted(caps.dtypes[mode], key=order.index) if not options.dtypes or dtype in options.dtypes]


def _to(weights: ExpertWeights, device: torch.device) -> ExpertWeights:
    return replace(weights, **{f.name: getattr(weights, f.name).to(device) for f in fields(weights)
                               if getattr(weights, f.name) is not None})


def run_case(placement: Placement, options: Options, mode: Mode, dtype: DispatchDtype, index: int,
             device: torch.device) -> CaseResult:
    """One ``check_layer`` on this rank; every rank uses the same seed, so the same batch."""
    caps = md.PluginHost.default().get_backend(options.backend).capabilities
    shape = options.shape.for_mode(caps, mode)
    nvfp4 = dtype is DispatchDtype.NVFP4
    spec = DispatchSpec(shape.hidden_size, shape.local_experts * placement.world_size, shape.top_k,
                        num_max_dispatch_tokens_per_rank=shape.tokens_per_rank, mode=mode, output_dtype=dtype,
                        quant=QuantHints(input_global_scale=nvfp4_global_scale(ACTIVATION_BOUND)) if nvfp4 else QuantHints())
    try:
        dispatcher = Target(options.backend).create(spec)
        g = torch.Generator().manual_seed(options.seed + index)
        weights = random_expert_weights(spec.num_experts, shape.hidden_size, options.intermediate, generator=g)
        layer = _to(weights.slice(placement.rank * shape.local_experts, shape.local_experts), device)
        check = check_layer(placement.rank, placement.world_size, dispatcher, TorchExperts(), layer, weights,
                            tokens=shape.tokens_per_rank, generator=g, device=device)
    except Exception as exc:  # noqa: BLE001 - reported with the case; the exit status says it failed
        return CaseResult(mode.value, dtype.value, float("inf"), 0.0, error=f"{type(exc).__name__}: {exc}")
    return CaseResult(mode.value, dtype.value, check.relative_error, check.tolerance, check.decided_by)


def run_rank(placement: Placement, options: Options, device: torch.device) -> RankReport:
    """Every case on this rank, inside an initialised process group."""
    problems = placement.problems(dist.get_rank(), dist.get_world_size())
    cases = tuple(run_case(placement, options, mode, dtype, i, device)
                  for i, (mode, dtype) in enumerate(layer_cases(options)))
    return RankReport(placement, str(device), cases, tuple(problems))


def global_problems(reports: Sequence[RankReport], expect_nodes: int | None) -> list[str]:
    """What only the whole launch shows: the node count, and ranks that agree on the cases."""
    found = []
    nodes = sorted({r.placement.node_rank for r in reports})
    if expect_nodes is not None and len(nodes) != expect_nodes:
        found.append(f"expected ranks on {expect_nodes} nodes, found node ranks {nodes}")
    ranks = sorted(r.placement.rank for r in reports)
    if ranks != list(range(len(reports))):
        found.append(f"RANK values {ranks} are not 0..{len(reports) - 1}, each once")
    labels = {tuple((c.mode, c.dtype) for c in r.cases) for r in reports}
    if len(labels) > 1:
        found.append("ranks ran different cases (different backends or plugins installed per node?)")
    return found


def format_report(reports: Sequence[RankReport], options: Options, problems: Sequence[str]) -> str:
    """Rank 0's summary: where each rank ran, then the worst rank per case."""
    ordered = sorted(reports, key=lambda r: r.placement.rank)
    nodes = len({r.placement.node_rank for r in ordered})
    lines = [f"moe-dispatch kit layer check under torchrun: backend {options.backend}, {len(ordered)} ranks on "
             f"{nodes} node{'s' if nodes != 1 else ''}",
             f"{'rank':>4} {'node':>4} {'local rank':>10} {'device':<8} host"]
    for r in ordered:
        p = r.placement
        lines.append(f"{p.rank:>4} {p.node_rank:>4} {p.local_rank:>10} {r.device:<8} {p.host}")
    lines.append(f"{'mode':<12} {'dtype':<6} {'rel err':>9} {'worst rank':>10} {'limit':>6}  ok")
    for i, first in enumerate(ordered[0].cases if ordered else ()):
        per_rank = [(r.cases[i], r.placement.rank) for r in ordered if i < len(r.cases)]
        worst, rank = max(per_rank, key=lambda cr: (not cr[0].ok, cr[0].relative_error))
        ok = all(c.ok for c, _ in per_rank)
        lines.append(f"{first.mode:<12} {first.dtype:<6} {worst.relative_error:>9.2e} {rank:>10} "
                     f"{worst.tolerance:>6.2f}  {'yes' if ok else 'NO'}")
        if worst.error:
            lines.append(f"    rank {rank}: {worst.error}")
    lines += [f"PROBLEM: {p}" for p in problems]
    lines.append(f"all cases within tolerance: {all(r.ok for r in ordered) and not problems}")
    return "\n".join(lines)


def _device(placement: Placement, kind: str) -> torch.device:
    """The node-local rank picks the device: RANK would run past the devices of a node."""
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device(kind, placement.local_rank)
    getattr(torch, kind).set_device(device)
    return device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moe_dispatch_testing.torchrun", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", required=True, help="a registered backend name")
    parser.add_argument("--mode", action="append", choices=[m.value for m in Mode], help="only this mode (repeatable)")
    parser.add_argument("--dtype", action="append", choices=[d.value for d in DispatchDtype],
                        help="only this wire dtype (repeatable)")
    parser.add_argument("--tokens", type=int, default=KitShape.tokens_per_rank, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=KitShape.hidden_size)
    parser.add_argument("--local-experts", type=int, default=KitShape.local_experts)
    parser.add_argument("--top-k", type=int, default=KitShape.top_k)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=sorted(DIST_BACKENDS),
                        help="cpu, or cuda/npu with device index LOCAL_RANK")
    parser.add_argument("--dist-backend", default=None, help="process-group backend (default: gloo/nccl/hccl per device)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="seconds a collective may wait for a peer")
    parser.add_argument("--expect-nodes", type=int, default=None,
                        help="fail unless the ranks span exactly this many nodes (torchrun's GROUP_RANK)")
    return parser


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        placement = Placement.from_env(os.environ if env is None else env)
    except NotUnderTorchrun as exc:
        print(f"moe_dispatch_testing.torchrun: error: {exc}", file=sys.stderr)
        return 2
    options = Options(
        args.backend,
        tuple(Mode.parse(m) for m in args.mode or ()),
        tuple(DispatchDtype(d) for d in args.dtype or ()),
        KitShape(args.hidden, args.local_experts, args.top_k, args.tokens),
        seed=args.seed,
        expect_nodes=args.expect_nodes,
    )
    owns_group = not dist.is_initialized()  # an engine's own test may have initialised it already
    if owns_group:
        dist.init_process_group(args.dist_backend or DIST_BACKENDS[args.device],
                                timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        report = run_rank(placement, options, _device(placement, args.device))
        sys.stdout.write(report.line() + "\n")  # one write: lines from several ranks do not interleave
        sys.stdout.flush()
        reports: list[RankReport | None] = [None] * placement.world_size
        dist.all_gather_object(reports, report)
    finally:
        if owns_group:
            dist.destroy_process_group()
    gathered = [r for r in reports if r is not None]
    problems = global_problems(gathered, options.expect_nodes)
    ok = all(r.ok for r in gathered) and not problems
    if placement.rank == 0:
        print(format_report(gathered, options, problems), flush=True)
    return 0 if ok else 1


__all__ = [
    "ACTIVATION_BOUND",
    "CaseResult",
    "NotUnderTorchrun",
    "Options",
    "Placement",
    "RankReport",
    "format_report",
    "global_problems",
    "layer_cases",
    "main",
    "run_case",
    "run_rank",
]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
