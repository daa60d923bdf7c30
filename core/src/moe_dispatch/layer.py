"""A MoE layer's forward (``Dispatcher.forward``): dispatch → experts → combine, or the
backend's fused forward."""

from __future__ import annotations

from typing import Any

import torch

from .dispatcher import Dispatcher
from .experts import ExpertKernel


def moe_forward(
    dispatcher: Dispatcher,
    experts: ExpertKernel | None,
    layer: Any,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """``dispatcher.forward(experts, layer, ...)``: one MoE layer over the EP group; bf16 ``[T, H]`` out."""
    return dispatcher.forward(experts, layer, hidden_states, topk_ids, topk_weights)


class MoELayer:
    """A dispatcher, an expert kernel and the local expert weights, called like a module."""

    def __init__(self, dispatcher: Dispatcher, experts: ExpertKernel | None, weights: Any) -> None:
        self.dispatcher = dispatcher
        self.experts = experts
        self.weights = weights

    def __call__(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.dispatcher.forward(self.experts, self.weights, hidden_states, topk_ids, topk_weights)


__all__ = ["MoELayer", "moe_forward"]
