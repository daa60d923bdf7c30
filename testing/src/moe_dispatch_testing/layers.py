"""One MoE layer end to end on one rank, for plugins that ship an expert kernel: dispatch →
the kernel → combine, against the dense fp32 reference. Runs under the kit's rank pools and
under torchrun on real hardware alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_dispatch import Dispatcher, ExpertKernel, ExpertWeights, run_experts
from moe_dispatch_testing import reference_moe
from moe_dispatch_testing.accuracy import TOLERANCES, relative_error
from moe_dispatch_testing.routing import random_routing


@dataclass(frozen=True)
class LayerCheck:
    """One rank's run: the wire dtype, the error against ``reference_moe``, the tolerance for
    that dtype, the resolution step that decided the dtype, and the whole trail."""

    dtype: str
    relative_error: float
    tolerance: float
    decided_by: str
    resolution: str


def check_layer(rank: int, world: int, dispatcher: Dispatcher, experts: ExpertKernel, layer: Any,
                reference_weights: ExpertWeights, *, tokens: int, generator: torch.Generator,
                device: torch.device = torch.device("cpu")) -> LayerCheck:
    """Every rank draws the same global batch from ``generator``, runs its slice through
    ``dispatcher`` and ``experts`` (``layer``: this rank's processed experts) and compares with
    ``reference_moe`` on ``reference_weights`` (all experts, as the kernel computes with them)."""
    spec = dispatcher.spec
    x = torch.randn(world * tokens, spec.hidden_size, generator=generator).to(torch.bfloat16)
    ids, w = random_routing(world * tokens, spec.num_experts, spec.top_k, generator=generator, drop_prob=0.1)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    out = dispatcher.dispatch(x[mine].to(device), ids[mine].to(device), w[mine].to(device))
    rows = run_experts(experts, layer, out)
    combined = dispatcher.combine(rows, out)
    reference = reference_moe(x[mine], ids[mine], w[mine], reference_weights)
    decided = next(s.source for s in dispatcher.resolution.steps if s.decided and not s.source.startswith("validate"))
    return LayerCheck(dispatcher.output_dtype.value, relative_error(combined.cpu(), reference),
                      TOLERANCES[dispatcher.output_dtype], decided, str(dispatcher.resolution))


__all__ = ["LayerCheck", "check_layer"]
