"""DeepEP-Ascend's ``Buffer`` with ``fused_deep_moe``, emulated on CPU.

sgl-kernel-npu ``python/deep_ep/deep_ep/buffer.py`` (@f3713b5): ``fused_deep_moe(x, topk_idx,
topk_weights, gmm1_permuted_weight, gmm1_permuted_weight_scale, gmm2_weight, gmm2_weight_scale,
num_max_dispatch_tokens_per_rank, num_experts, quant_mode=1, fuse_mode=1, ...) -> (output, aux)``.
Its documented numerics (sgl-kernel-npu docs @a4a7aeb): per-token INT8 quantization, dispatch,
GMM1 (int32 accumulate) dequantized by the weight and token scales, SwiGLU (silu on the gate
half), per-token requantization, GMM2, dequantization, and a combine weighted by
``topk_weights``. Built here from the ascend_deepep emulator's exchange, exact integer GEMMs
and the core INT8 codec (``npu_dynamic_quant`` rounding). ``aux``: ``ep_recv_count``
``[E_local·R]`` in mode 1, per-expert counts ``[E_local]`` in mode 2.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moe_dispatch_ascend_deepep import emulator
from moe_dispatch_ascend_deepep.emulator import Config, EventOverlap, VendorCall, _int8

from .weights import deinterleave_gate_up, scale_from_int64


class Buffer(emulator.Buffer):
    def fused_deep_moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       gmm1_permuted_weight: torch.Tensor, gmm1_permuted_weight_scale: torch.Tensor,
                       gmm2_weight: torch.Tensor, gmm2_weight_scale: torch.Tensor,
                       num_max_dispatch_tokens_per_rank: int, num_experts: int, quant_mode: int = 1,
                       fuse_mode: int = 1, backend: str = "auto", activation: str = "swiglu",
                       activation_clamp: Any = None, beta: float = 1.0, linear_beta: Any = None, l1_bias: Any = None,
                       l2_bias: Any = None, dispatch_quant_mode: Any = None, dispatch_quant_out_dtype: Any = None,
                       max_recv_token_num: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        assert activation == "swiglu" and l1_bias is None and l2_bias is None, "swiglu without biases only"
        assert quant_mode == 1 and fuse_mode in (1, 2), "W8A8 dynamic (quant_mode 1), fuse mode 1 or 2"
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= num_max_dispatch_tokens_per_rank
        assert gmm1_permuted_weight.dtype == torch.int8 and gmm2_weight.dtype == torch.int8
        R = self.group_size
        local = num_experts // R
        h = x.shape[1]
        w1 = gmm1_permuted_weight  # [E_l, H, 2I]
        assert w1.shape[0] == local and w1.shape[1] == h, f"gmm1 weight must be [{local}, {h}, 2I]"
        if fuse_mode == 1:
            s1, s2, w2 = gmm1_permuted_weight_scale.float(), gmm2_weight_scale.float(), gmm2_weight.transpose(1, 2)
        else:  # fp32 bits in int64; w2 is [E, I, H]
            assert gmm1_permuted_weight_scale.dtype == torch.int64 and gmm2_weight_scale.dtype == torch.int64
            s1, s2, w2 = scale_from_int64(gmm1_permuted_weight_scale), scale_from_int64(gmm2_weight_scale), gmm2_weight
        q, s = _int8(x)
        recv_q, recv_s, counts, state = self._exchange("fused_deep_moe", q, s, topk_idx, local)
        assert recv_s is not None
        out_rows = torch.zeros(recv_q.shape[0], h, dtype=torch.bfloat16)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                acc = recv_q[rows].double() @ w1[e].double()  # exact int32 accumulate
                h1 = (acc * s1[e].double() * recv_s[rows].double().unsqueeze(1)).float()
                if fuse_mode == 1:
                    gate, up = deinterleave_gate_up(h1)
                else:
                    gate, up = h1.chunk(2, dim=-1)
                aq, a_s = _int8((F.silu(gate) * up))
                acc2 = aq.double() @ w2[e].double()  # [n, I] @ [I, H]
                out_rows[rows] = (acc2 * s2[e].double() * a_s.double().unsqueeze(1)).to(torch.bfloat16)
            start += n
        back, tok, j = self._return(out_rows, state)
        out = torch.zeros(x.shape[0], h).index_add_(0, tok, back * topk_weights[tok, j].float().unsqueeze(1))
        src = torch.repeat_interleave(torch.arange(R), state[1])
        per_src = torch.zeros(local, R, dtype=torch.int32)
        le = torch.repeat_interleave(torch.arange(local), counts)
        if le.numel():
            per_src.index_put_((le, src[state[0]]), torch.ones_like(le, dtype=torch.int32), accumulate=True)
        aux = per_src.flatten() if fuse_mode == 1 else counts.to(torch.int64)
        return out.to(torch.bfloat16), aux


__all__ = ["Buffer", "Config", "EventOverlap", "VendorCall"]
