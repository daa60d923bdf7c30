"""A layer's experts in the layout FlashInfer's CuTe-DSL MoE reads (W4A4 NVFP4).

From FlashInfer's CuTe-DSL MoE tests and helpers (flashinfer-ai/flashinfer@f1e6fdc, v0.6.4:
tests/moe/test_cute_dsl_fused_moe.py ``interleave_linear_and_gate`` and ``create_moe_tensors``;
flashinfer/cute_dsl/utils.py ``convert_sf_to_mma_layout``; unchanged through 0.7.2.post1):

- ``w1_weight`` uint8 ``[E_l, 2I, H/2]``: the up ("linear") and gate rows interleaved in
  groups of 64 (up[0:64], gate[0:64], up[64:128], ...). The core's ``w13_weight`` is gate
  rows then up rows, so they are reordered here.
- block scales: e4m3 per 16 weights, swizzled 128×4 per expert and viewed as the MMA layout
  ``(32, 4, ceil(M/128), 4, ceil(K/64), E_l)``.
- one fp32 global scale per expert (448·6/amax); the kernel takes ``alpha = 1/(gs_in·gs_w)``
  per expert, so the activations' global scale is folded in per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.backend import (
    NVFP4Codec,
    WireFormat,
    dequantized_weights,
    e2m1_unpack,
    from_mma_view,
    nvfp4_global_scale,
    to_mma_view,
)

#: Rows per up/gate group in ``w1_weight``.
GATE_UP_GROUP = 64


def interleave_up_gate(w13: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` gate-then-up → FlashInfer's up/gate groups of 64 rows."""
    e, two_i = w13.shape[:2]
    gate, up = w13[:, : two_i // 2], w13[:, two_i // 2 :]
    groups = (two_i // 2) // GATE_UP_GROUP
    pair = torch.stack([up.unflatten(1, (groups, GATE_UP_GROUP)), gate.unflatten(1, (groups, GATE_UP_GROUP))], dim=2)
    return pair.reshape(e, two_i, *w13.shape[2:])


def deinterleave_up_gate(w1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``w1`` rows (or GEMM1 output columns, on the last-but-one axis) → (up, gate)."""
    two_i = w1.shape[-2]
    pairs = w1.unflatten(-2, (two_i // (2 * GATE_UP_GROUP), 2, GATE_UP_GROUP))
    up, gate = pairs.select(-3, 0), pairs.select(-3, 1)
    return up.flatten(-3, -2), gate.flatten(-3, -2)


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert NVFP4: packed ``[E, M, K/2]``, linear scales ``[E, M, K/16]``, global scales ``[E]``."""
    packed, scales, gss = [], [], []
    for e in range(w.shape[0]):
        gs = nvfp4_global_scale(max(float(w[e].float().abs().max()), 1e-12))
        q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, w.shape[-1]), gs).quantize(w[e])
        packed.append(q.data)
        scales.append(q.scale)
        gss.append(gs)
    return torch.stack(packed), torch.stack(scales), torch.tensor(gss, dtype=torch.float32)


@dataclass
class CuteDslLayer:
    """One rank's experts, ready for ``CuteDslMoEWrapper.run``.

    :param input_global_scale: the activations' NVFP4 global scale when the kernel quantizes
        BF16 rows itself (448·6/amax of calibration activations).
    :param fc2_input_scale: the intermediate's global scale (GEMM1's epilogue quantizes with it).
    """

    w1_weight: torch.Tensor
    w1_weight_sf: torch.Tensor
    w1_global_scale: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_sf: torch.Tensor
    w2_global_scale: torch.Tensor
    input_global_scale: float
    fc2_input_scale: float
    first_expert: int
    num_experts: int
    wrapper: Any = None

    @property
    def num_local_experts(self) -> int:
        return int(self.w1_weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.w1_weight.device

    def to(self, device: torch.device | str) -> "CuteDslLayer":
        """The weights on ``device`` (the MMA scale views keep their storage order: moved as the
        swizzled bytes they view)."""
        def move_mma(mma: torch.Tensor) -> torch.Tensor:
            storage = mma.permute(5, 2, 4, 0, 1, 3).contiguous()  # (E, m_tiles, k_tiles, 32, 4, 4)
            return storage.to(device).permute(3, 4, 1, 5, 2, 0)

        self.w1_weight, self.w2_weight = self.w1_weight.to(device), self.w2_weight.to(device)
        self.w1_weight_sf, self.w2_weight_sf = move_mma(self.w1_weight_sf), move_mma(self.w2_weight_sf)
        self.w1_global_scale = self.w1_global_scale.to(device)
        self.w2_global_scale = self.w2_global_scale.to(device)
        return self

    @property
    def hidden_size(self) -> int:
        return int(self.w1_weight.shape[2] * 2)

    @property
    def intermediate_size(self) -> int:
        return int(self.w2_weight.shape[2] * 2)

    @classmethod
    def from_weights(cls, weights: md.ExpertWeights, *, first_expert: int, num_experts: int,
                     input_global_scale: float, fc2_input_scale: float) -> "CuteDslLayer":
        """Quantize a rank's bf16/fp32 experts (``w13`` gate-then-up ``[E_l, 2I, H]``,
        ``w2`` ``[E_l, H, I]``) to FlashInfer's W4A4 layout."""
        w13, w2 = dequantized_weights(weights)
        i, h = w2.shape[2], w2.shape[1]
        if h % 128 or i % GATE_UP_GROUP:
            raise md.InvalidSpecError(
                "CuTe-DSL MoE needs H a multiple of 128 and I a multiple of 64",
                parameter="weights", value=f"H={h}, I={i}", allowed="H % 128 == 0, I % 64 == 0",
            )
        w1, w1_sf, w1_gs = _quantize_experts(interleave_up_gate(w13))
        w2q, w2_sf, w2_gs = _quantize_experts(w2)
        return cls(w1, to_mma_view(w1_sf), w1_gs, w2q, to_mma_view(w2_sf), w2_gs,
                   float(input_global_scale), float(fc2_input_scale), first_expert, num_experts)

    def dequantized(self) -> md.ExpertWeights:
        """fp32 weights back in the core's layout (gate then up), what the kernel computes with."""
        two_i, h, i = self.w1_weight.shape[1], self.hidden_size, self.intermediate_size

        def deq(packed: torch.Tensor, mma: torch.Tensor, gs: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
            scales = from_mma_view(mma, rows, cols // 16)
            values = e2m1_unpack(packed).unflatten(-1, (-1, 16))
            return (values * scales.float().unsqueeze(-1)).flatten(-2) / gs.view(-1, 1, 1)

        w1 = deq(self.w1_weight, self.w1_weight_sf, self.w1_global_scale, two_i, h)
        up, gate = deinterleave_up_gate(w1)
        return md.ExpertWeights(torch.cat([gate, up], dim=1), deq(self.w2_weight, self.w2_weight_sf,
                                                                   self.w2_global_scale, h, i))


__all__ = ["CuteDslLayer", "GATE_UP_GROUP", "deinterleave_up_gate", "interleave_up_gate"]
