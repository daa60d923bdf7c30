"""Expert kernels for checking dispatch and combine without real expert weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_dispatch.backend import dequantize_rows, group_counts, row_experts


def expert_factor(global_expert: int, num_experts: int) -> float:
    """The factor ``ScaledIdentityExperts`` applies for one expert: distinct per expert, so
    a row combined under the wrong expert changes the result."""
    return 1.0 + (global_expert + 1) / (2 * num_experts)


@dataclass(frozen=True)
class ScaledLayer:
    """The "weights" of ``ScaledIdentityExperts`` on one rank: a factor per local expert."""

    hidden_size: int
    factors: torch.Tensor  # fp32 [E_local]

    @classmethod
    def for_rank(cls, hidden_size: int, num_experts: int, rank: int, local_experts: int) -> "ScaledLayer":
        first = rank * local_experts
        factors = torch.tensor([expert_factor(first + e, num_experts) for e in range(local_experts)])
        return cls(hidden_size, factors)


class ScaledIdentityExperts:
    """Expert e returns ``factor(e) × dequantize(row)`` in the requested dtype: combine must
    then give ``Σ_j w_j · factor(e_j) · dequantize(x)`` for every token. Aligned PACKED rows'
    padding comes out as ``padding`` (NaN by default: combine must ignore those rows)."""

    needs_dispatch_dtype = None

    def __init__(self, padding: float = float("nan")) -> None:
        self.padding = padding

    def apply_without_routing_weights(
        self,
        layer: ScaledLayer,
        hidden_states: torch.Tensor,
        hidden_states_scale: torch.Tensor | None,
        group_list_type: int,
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
        *,
        global_scale: float | None = None,
        expert_alignment: int = 1,
    ) -> torch.Tensor:
        rows = dequantize_rows(hidden_states, hidden_states_scale, layer.hidden_size, global_scale)
        factors = layer.factors.to(rows.device)
        if rows.dim() == 3:  # MASKED [E_local, capacity, H]
            return (rows * factors[:, None, None]).to(output_dtype)
        counts = group_counts(group_list, group_list_type, expert_alignment).to(rows.device)
        # every alignment: low-latency PACKED rows may run past the segments (the backend's worst case)
        expert = row_experts(counts, expert_alignment, rows.shape[0])
        scaled = rows * factors[expert.clamp(min=0)][:, None]
        return torch.where((expert >= 0)[:, None], scaled, self.padding).to(output_dtype)


class IdentityExperts:
    """Each expert returns its input, dequantized: combine gives the weighted sum of a
    token's copies."""

    needs_dispatch_dtype = None

    def apply_without_routing_weights(
        self,
        layer: Any,
        hidden_states: torch.Tensor,
        hidden_states_scale: torch.Tensor | None,
        group_list_type: int,
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
        *,
        global_scale: float | None = None,
        expert_alignment: int = 1,  # rows keep their places: any layout
    ) -> torch.Tensor:
        hidden = layer.hidden_size if hasattr(layer, "hidden_size") else int(layer)
        return dequantize_rows(hidden_states, hidden_states_scale, hidden, global_scale).to(output_dtype)


__all__ = ["IdentityExperts", "ScaledIdentityExperts", "ScaledLayer", "expert_factor"]
