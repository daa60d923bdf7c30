"""What the kit runs on every rank: the backend under test, the layer shape, the routing.

Everything here is a small frozen dataclass, pickled to the local ranks. Every rank builds
the same global batch from the case's seed and takes its own slice, so each rank can also
compute what it should receive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from moe_dispatch import DispatchDtype, Dispatcher, DispatchSpec, ExpertWeights, Layout, Mode, QuantHints, create_dispatcher
from moe_dispatch.backend import Backend, Capabilities, nvfp4_global_scale
from moe_dispatch_testing.routing import random_routing


@dataclass(frozen=True)
class Target:
    """The backend under test: a registered name, or a ``Backend`` instance (pickled to the
    ranks, so its class must be importable), and the ``options`` for ``create_dispatcher``."""

    backend: str | Backend
    options: tuple[tuple[str, Any], ...] = ()
    #: Applied to the kit's dense random weights before a whole-layer check (importable).
    weights: Callable[[ExpertWeights], ExpertWeights] | None = None

    def create(self, spec: DispatchSpec, **kwargs: Any) -> Dispatcher:
        return create_dispatcher(self.backend, spec, env={}, options=dict(self.options), **kwargs)


@dataclass(frozen=True)
class KitShape:
    """The layer shape the kit uses; adjusted per mode to the backend's declared limits.

    :param hidden_size: a multiple of 128 so every wire dtype's blocks fit.
    :param local_experts: experts per rank (the expert count is this times the world size).
    :param top_k: experts per token.
    :param tokens_per_rank: ``num_max_dispatch_tokens_per_rank``.
    """

    hidden_size: int = 256
    local_experts: int = 4
    top_k: int = 4
    tokens_per_rank: int = 12

    def for_mode(self, caps: Capabilities, mode: Mode) -> "KitShape":
        """This shape moved inside ``caps``' limits for ``mode``."""
        lim = caps.limits_for(mode)
        hidden = self.hidden_size
        if lim.hidden_sizes is not None:
            hidden = hidden if hidden in lim.hidden_sizes else min(lim.hidden_sizes)
        else:
            step = math.lcm(128, lim.hidden_multiple)
            hidden = -(-max(hidden, lim.min_hidden or 0) // step) * step
        top_k = min(self.top_k, lim.max_top_k or self.top_k)
        tokens = min(self.tokens_per_rank, lim.max_tokens_per_rank or self.tokens_per_rank)
        return replace(self, hidden_size=hidden, top_k=top_k, tokens_per_rank=tokens)


@dataclass(frozen=True)
class Routing:
    """How tokens are routed in one case.

    :param tokens: tokens on each rank (0 is allowed: a rank with nothing to send).
    :param drop: chance that a top-k slot is -1.
    :param skew: 0 uniform; 1 every token on experts 0..k-1 (all on rank 0's experts).
    """

    name: str
    tokens: tuple[int, ...]
    drop: float = 0.0
    skew: float = 0.0


def standard_routings(world_size: int, capacity: int) -> list[Routing]:
    """The routings every conservation test runs: uniform at capacity, -1 ids with an empty
    rank, everything on one rank's experts, and nothing routed at all."""
    full = tuple([capacity] * world_size)
    ragged = tuple(0 if r == world_size - 1 and world_size > 1 else max(1, capacity - 3 * r) for r in range(world_size))
    return [
        Routing("uniform", full),
        Routing("dropped ids, an empty rank", ragged, drop=0.3),
        Routing("all on rank 0's experts", full, skew=1.0),
        Routing("every id -1", ragged, drop=1.0),
    ]


@dataclass(frozen=True)
class Case:
    """One dispatch configuration on ``world_size`` ranks with one routing."""

    target: Target
    mode: Mode
    dtype: DispatchDtype
    shape: KitShape
    routing: Routing
    seed: int = 0
    group_list_type: int = 1
    expert_alignment: int = 1
    layout: Layout | None = None

    @property
    def world_size(self) -> int:
        return len(self.routing.tokens)

    @property
    def num_experts(self) -> int:
        return self.shape.local_experts * self.world_size

    def inputs(self) -> "GlobalBatch":
        return GlobalBatch.build(self)

    def spec(self, batch: "GlobalBatch", **overrides: Any) -> DispatchSpec:
        quant = QuantHints(input_global_scale=batch.global_scale) if self.dtype is DispatchDtype.NVFP4 else QuantHints()
        spec = DispatchSpec(
            self.shape.hidden_size,
            self.num_experts,
            self.shape.top_k,
            num_max_dispatch_tokens_per_rank=self.shape.tokens_per_rank,
            mode=self.mode,
            output_dtype=self.dtype,
            quant=quant,
            group_list_type=self.group_list_type,
            expert_alignment=self.expert_alignment,
            layout=self.layout,
        )
        return replace(spec, **overrides) if overrides else spec

    def label(self) -> str:
        aligned = f", experts aligned to {self.expert_alignment} rows" if self.expert_alignment > 1 else ""
        return f"{self.mode.value}/{self.dtype.value} on {self.world_size} ranks, routing '{self.routing.name}'{aligned}"


@dataclass(frozen=True)
class GlobalBatch:
    """Every rank's tokens and routing, identical on every rank."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    starts: tuple[int, ...]
    tokens: tuple[int, ...]
    global_scale: float

    @classmethod
    def build(cls, case: Case) -> "GlobalBatch":
        g = torch.Generator().manual_seed(case.seed)
        total = sum(case.routing.tokens)
        x = torch.randn(total, case.shape.hidden_size, generator=g).to(torch.bfloat16)
        ids, w = random_routing(
            total, case.num_experts, case.shape.top_k, generator=g, drop_prob=case.routing.drop, skew=case.routing.skew
        )
        starts = tuple(sum(case.routing.tokens[:r]) for r in range(case.world_size))
        amax = x.float().abs().max().item() if total else 1.0
        return cls(x, ids, w, starts, case.routing.tokens, nvfp4_global_scale(amax))

    def rank_slice(self, rank: int) -> slice:
        return slice(self.starts[rank], self.starts[rank] + self.tokens[rank])

    def local(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.rank_slice(rank)
        return self.x[s], self.topk_ids[s], self.topk_weights[s]


__all__ = ["Case", "GlobalBatch", "KitShape", "Routing", "Target", "standard_routings"]
