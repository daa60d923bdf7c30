"""Random routings and expert weights for tests, the demo and benchmarks."""

from __future__ import annotations

import torch

from moe_dispatch import ExpertWeights


def random_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    generator: torch.Generator | None = None,
    drop_prob: float = 0.0,
    skew: float = 0.0,
    id_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k experts per token and softmax weights (fp32).

    :param drop_prob: chance that a slot is -1 (no expert).
    :param skew: 0 is uniform; towards 1 the router prefers low expert ids (1 puts every
        token on experts 0..top_k-1, the worst case for one rank).
    """
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if skew > 0:
        bias = torch.linspace(skew * 8.0, 0.0, num_experts)
        scores = scores + bias if skew < 1 else bias.expand(num_tokens, -1) + 0 * scores
    ids = torch.topk(scores, top_k, dim=1).indices
    logits = torch.randn(num_tokens, top_k, generator=generator)
    weights = torch.softmax(logits, dim=1).float()
    if drop_prob > 0:
        drop = torch.rand(num_tokens, top_k, generator=generator) < drop_prob
        ids = torch.where(drop, -1, ids)
        weights = torch.where(drop, 0.0, weights)
    return ids.to(id_dtype), weights


def random_expert_weights(
    num_experts: int, hidden: int, intermediate: int, *, generator: torch.Generator | None = None
) -> ExpertWeights:
    """bf16 weights scaled so activations keep unit size through the layer."""
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate**0.5
    return ExpertWeights(w13.to(torch.bfloat16), w2.to(torch.bfloat16))


__all__ = ["random_expert_weights", "random_routing"]
