"""The kit's pytest plugin, loaded through the core's ``pytest11`` entry point.

Fixtures for backend authors (all prefixed ``moe_``):

- ``moe_rank_pools`` (session): ``.get(world_size)`` → a pool of local gloo ranks;
  ``pool.map(fn, *args)`` runs the module-level ``fn(rank, world_size, *args)`` on each.
- ``moe_dense_reference``: the dense fp32 single-process MoE, ``(x, topk_ids, topk_weights,
  expert_weights) → [T, H] fp32``.
- ``moe_routing``: ``(num_tokens, num_experts, top_k, *, seed=0, drop_prob=0.0, skew=0.0)``
  → ``(topk_ids, topk_weights)``, distinct experts per token, -1 for dropped slots.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest


@pytest.fixture(scope="session")
def moe_rank_pools() -> Iterator[Any]:
    from .pools import RankPools

    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture
def moe_dense_reference() -> Callable[..., Any]:
    from moe_dispatch_testing import reference_moe

    return reference_moe


@pytest.fixture
def moe_routing() -> Callable[..., Any]:
    import torch

    from moe_dispatch_testing.routing import random_routing

    def make(num_tokens: int, num_experts: int, top_k: int, *, seed: int = 0, drop_prob: float = 0.0,
             skew: float = 0.0) -> Any:
        g = torch.Generator().manual_seed(seed)
        return random_routing(num_tokens, num_experts, top_k, generator=g, drop_prob=drop_prob, skew=skew)

    return make
