"""How close a backend's MoE forward must come to the dense fp32 reference, per wire dtype.

The error is the relative L2 norm ``‖out − ref‖ / ‖ref‖`` of a whole layer's output with the
torch reference experts. BF16 is bounded by the bf16 rounding of the partial sums; the
quantized dtypes by their codecs (NVFP4 keeps 3 bits per value).
"""

from __future__ import annotations

import torch

from moe_dispatch import DispatchDtype, ExpertWeights
from moe_dispatch.backend import dequantized_weights, swiglu, wire_dtype

#: Per wire dtype, from its declaration (``formats.WireDtype.tolerance``).
TOLERANCES: dict[DispatchDtype, float] = {d: wire_dtype(d).tolerance for d in DispatchDtype}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    denom = ref.norm().item()
    diff = (out.float() - ref).norm().item()
    return diff / denom if denom > 0 else diff


__all__ = ["TOLERANCES", "relative_error"]


def reference_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: ExpertWeights
) -> torch.Tensor:
    """The dense fp32 single-process MoE every backend is checked against: for each token,
    the weighted sum over its top-k experts of SwiGLU(x·w13ᵀ)·w2ᵀ. -1 ids are skipped."""
    w13, w2 = dequantized_weights(weights)
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        y = swiglu(xf[tok] @ w13[e].t()) @ w2[e].t()
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out
