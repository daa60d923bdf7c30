"""A MoE layer's forward: dispatch → experts → combine, or the backend's fused forward."""

from __future__ import annotations

from typing import Any

import torch

from .dispatcher import Dispatcher
from .experts import ExpertKernel


def moe_forward(
    dispatcher: Dispatcher,
    experts: ExpertKernel,
    layer: Any,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Run one MoE layer over the EP group; bf16 ``[T, H]`` out."""
    if dispatcher.backend.capabilities.fused_forward:
        # The fused op skips Dispatcher.dispatch: run its input checks here, for every fused backend.
        dispatcher.input_checks.dispatch(hidden_states, topk_ids, topk_weights, dispatcher.check_inputs)
        return dispatcher.backend.fused_forward(dispatcher, layer, hidden_states, topk_ids, topk_weights)
    out = dispatcher.dispatch(hidden_states, topk_ids, topk_weights)
    rows = experts.apply_without_routing_weights(
        layer,
        out.hidden_states,
        out.hidden_states_scale,
        out.group_list_type,
        out.group_list,
        torch.bfloat16,
        global_scale=out.global_scale,
    )
    return dispatcher.combine(rows, out)


class MoELayer:
    """A dispatcher, an expert kernel and the local expert weights, called like a module."""

    def __init__(self, dispatcher: Dispatcher, experts: ExpertKernel, weights: Any) -> None:
        self.dispatcher = dispatcher
        self.experts = experts
        self.weights = weights

    def __call__(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return moe_forward(self.dispatcher, self.experts, self.weights, hidden_states, topk_ids, topk_weights)


__all__ = ["MoELayer", "moe_forward"]
