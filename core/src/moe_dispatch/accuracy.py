"""How close a backend's MoE forward must come to the dense fp32 reference, per wire dtype.

The error is the relative L2 norm ``‖out − ref‖ / ‖ref‖`` of a whole layer's output with the
torch reference experts. BF16 is bounded by the bf16 rounding of the partial sums; the
quantized dtypes by their codecs (NVFP4 keeps 3 bits per value).
"""

from __future__ import annotations

import torch

from .dtypes import DispatchDtype
from .formats import WIRE_DTYPES

#: Per wire dtype, from its declaration (``formats.WireDtype.tolerance``).
TOLERANCES: dict[DispatchDtype, float] = {d: w.tolerance for d, w in WIRE_DTYPES.items()}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    denom = ref.norm().item()
    diff = (out.float() - ref).norm().item()
    return diff / denom if denom > 0 else diff


__all__ = ["TOLERANCES", "relative_error"]
