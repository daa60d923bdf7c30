"""``CuteDslMoEWrapper`` (flashinfer/fused_moe/cute_dsl/fused_moe.py) W4A4 on CPU.

It computes in fp32 what the kernels compute: GEMM1 on the NVFP4 rows and weights times
``w1_alpha``, SwiGLU on w1's rows read as FlashInfer lays them out (``vendor.W1_INTERLEAVE_GROUP``
rows of up, then as many of gate, repeated), the intermediate re-quantized to NVFP4 with
``fc2_input_scale``, GEMM2 times ``w2_alpha``, then the fused finalize (times
``token_final_scales``, summed over top-k). Ids outside ``[local_expert_offset,
local_expert_offset + num_local_experts)`` (-1 included) contribute nothing.

Checks as the vendor makes them: the pointer alignment ``make_ptr`` asserts (flashinfer-ai/flashinfer@f1e6fdc
flashinfer/fused_moe/cute_dsl/blackwell/utils.py: ``pointer must be N bytes aligned``; activations and
weights 32 bytes, scales 16). Checks where the GPU would read out of bounds or garbage instead of
failing (AssertionError here, marked "fake:"): contiguity, shapes, dtypes, and linear activation
scales ``[T, H/16]`` (the kernel reads them by token through a raw pointer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import moe_dispatch as md
from moe_dispatch.codecs import NVFP4Codec, e2m1_unpack
from moe_dispatch.scale_layouts import from_mma_view
from moe_dispatch.wire import WireFormat

from .. import vendor


def _nvfp4_values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e2m1 × block scale, without the global scale (the kernels fold it into alpha)."""
    values = e2m1_unpack(packed).unflatten(-1, (-1, vendor.NVFP4_BLOCK))
    return (values * scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)).flatten(-2)


def _up_gate(gemm1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1's ``2I`` output columns as the kernel pairs them: groups of up and gate rows."""
    g = vendor.W1_INTERLEAVE_GROUP
    pairs = gemm1.unflatten(-1, (gemm1.shape[-1] // (2 * g), 2, g))
    first, second = pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)
    return (first, second) if vendor.W1_UP_FIRST else (second, first)


def _aligned(name: str, t: torch.Tensor, alignment: int) -> None:
    assert t.data_ptr() % alignment == 0, f"pointer must be {alignment} bytes aligned ({name})"


class CuteDslBase:
    """The wrapper's state and ``run``; version modules give ``__init__``/``run`` their signatures."""

    def _init(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
              num_local_experts: int | None, local_expert_offset: int, sf_vec_size: int,
              output_dtype: torch.dtype) -> None:
        if sf_vec_size != vendor.NVFP4_BLOCK:
            raise NotImplementedError("fake CuteDslMoEWrapper implements W4A4 NVFP4 (sf_vec_size 16)")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_local_experts = num_local_experts or num_experts
        self.local_expert_offset, self.output_dtype = local_expert_offset, output_dtype
        self.calls = 0

    def _run(self, x: torch.Tensor, x_sf: torch.Tensor, token_selected_experts: torch.Tensor,
             token_final_scales: torch.Tensor, w1_weight: torch.Tensor, w1_weight_sf: torch.Tensor,
             w1_alpha: torch.Tensor, fc2_input_scale: torch.Tensor, w2_weight: torch.Tensor,
             w2_weight_sf: torch.Tensor, w2_alpha: torch.Tensor, tactic: Any = None) -> torch.Tensor:
        h, i, el = self.hidden_size, self.intermediate_size, self.num_local_experts
        t = token_selected_experts.shape[0]
        for name, tensor, alignment in (("x", x, 32), ("x_sf", x_sf, 16), ("w1_weight", w1_weight, 32),
                                        ("w1_weight_sf", w1_weight_sf, 16), ("w2_weight", w2_weight, 32),
                                        ("w2_weight_sf", w2_weight_sf, 16)):
            _aligned(name, tensor, alignment)
        assert x.dtype == torch.uint8 and tuple(x.shape) == (t, h // 2) and x.is_contiguous(), (
            f"fake: x must be packed NVFP4 [{t}, {h // 2}], contiguous")
        sf = x_sf.squeeze(-1) if x_sf.dim() == 3 else x_sf
        assert tuple(sf.shape) == (t, h // vendor.NVFP4_BLOCK) and sf.element_size() == 1 and sf.is_contiguous(), (
            f"fake: x_sf must be linear [{t}, {h // vendor.NVFP4_BLOCK}] (the kernel reads it by token)")
        assert token_selected_experts.dtype == torch.int32 and token_final_scales.dtype == torch.float32, (
            "fake: token_selected_experts int32, token_final_scales float32")
        assert tuple(token_selected_experts.shape) == tuple(token_final_scales.shape) == (t, self.top_k)
        assert tuple(w1_weight.shape) == (el, 2 * i, h // 2) and tuple(w2_weight.shape) == (el, h, i // 2)
        assert w1_alpha.shape == (el,) and w2_alpha.shape == (el,) and fc2_input_scale.numel() == 1
        self.calls += 1
        xv = _nvfp4_values(x, sf)
        w1 = _nvfp4_values(w1_weight, from_mma_view(w1_weight_sf, 2 * i, h // vendor.NVFP4_BLOCK))
        w2 = _nvfp4_values(w2_weight, from_mma_view(w2_weight_sf, h, i // vendor.NVFP4_BLOCK))
        fc2 = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, i), float(fc2_input_scale.reshape(-1)[0]))
        out = torch.zeros(t, h, dtype=torch.float32)
        local = token_selected_experts.long() - self.local_expert_offset
        for e in range(el):
            tok, slot = (local == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            up, gate = _up_gate((xv[tok] @ w1[e].t()) * w1_alpha[e])
            inter = fc2.quantize(F.silu(gate) * up)
            gemm2 = (_nvfp4_values(inter.data, inter.scale) @ w2[e].t()) * w2_alpha[e]
            out.index_add_(0, tok, gemm2 * token_final_scales[tok, slot].float().unsqueeze(1))
        return out.to(self.output_dtype)


__all__ = ["CuteDslBase"]
