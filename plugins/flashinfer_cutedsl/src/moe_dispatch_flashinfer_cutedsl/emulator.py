"""An emulator of the FlashInfer entry points this plugin calls, on CPU.

Same names, arguments, shapes, dtypes and layouts as flashinfer (v0.5–0.7):

- ``fp4_quantize`` (``flashinfer/fp4_quantization.py``): NVFP4 with FlashInfer's rounding (the
  core codec, checked bit for bit against FlashInfer's reference), scales linear or 128×4
  swizzled.
- ``CuteDslMoEWrapper`` (``flashinfer/fused_moe/cute_dsl/fused_moe.py``): W4A4 MoE. It
  computes in fp32 what the kernel computes: GEMM1 on NVFP4 rows and weights times
  ``w1_alpha``, SwiGLU on FlashInfer's up/gate interleave, the intermediate re-quantized to
  NVFP4 with ``fc2_input_scale``, GEMM2 times ``w2_alpha``, then the fused finalize: times
  ``token_final_scales``, summed over top-k. Ids outside ``[local_expert_offset,
  local_expert_offset + num_local_experts)`` contribute nothing.
- ``comm.MoeAlltoAll`` (``flashinfer/comm/trtllm_moe_alltoall.py``; kernels
  ``moeAlltoAllKernels.cu``): dispatch sends each token once to every rank that owns one of
  its experts, into ``[ep_size, runtime_max_tokens_per_rank, ...]`` receive views per payload;
  combine sends each slot back and adds a token's copies (no weights). One dispatch may be
  outstanding per instance, as the real one's state machine enforces.

It exchanges real bytes between real processes (torch.distributed, gloo) and records each
call in ``calls``. Not emulated: MNNVL memory, CUDA graphs, the nondeterministic slot order of
the real kernel's atomics (slots here are in token order), and FP4 atomics in finalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

import moe_dispatch as md
from moe_dispatch.codecs import NVFP4Codec, as_bytes, e2m1_unpack, from_bytes
from moe_dispatch.distributed.comm import Comm
from moe_dispatch.scale_layouts import from_mma_view, swizzle_128x4
from moe_dispatch.wire import WireFormat

from . import sizes
from .weights import deinterleave_up_gate

__version__ = "0.0-emulated"


@dataclass(frozen=True)
class VendorCall:
    name: str
    payload_dtypes: tuple[str, ...]
    payload_bytes: int


def fp4_quantize(input: torch.Tensor, global_scale: torch.Tensor | None = None, sf_vec_size: int = 16,  # noqa: A002
                 sf_use_ue8m0: bool = False, is_sf_swizzled_layout: bool = True, is_sf_8x4_layout: bool = False,
                 enable_pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[M, K]`` bf16 → (uint8 ``[M, K/2]``, uint8 scales ``[M, K/16]`` linear or swizzled)."""
    assert input.dtype in (torch.bfloat16, torch.float16) and input.dim() == 2, "input must be 2-D half/bf16"
    assert sf_vec_size == 16 and not sf_use_ue8m0 and not is_sf_8x4_layout, "the emulator implements NVFP4 (16, e4m3)"
    assert global_scale is not None and global_scale.numel() == 1, "global_scale: a one-element fp32 tensor"
    q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, input.shape[1]), float(global_scale)).quantize(input)
    sf = q.scale.view(torch.uint8)
    if is_sf_swizzled_layout:
        sf = swizzle_128x4(sf)
    return q.data, sf


def _nvfp4_values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e2m1 × block scale, without the global scale (the kernels fold it into alpha)."""
    values = e2m1_unpack(packed).unflatten(-1, (-1, 16))
    return (values * scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)).flatten(-2)


class CuteDslMoEWrapper:
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 use_cuda_graph: bool = False, max_num_tokens: int | None = None, num_local_experts: int | None = None,
                 local_expert_offset: int = 0, tile_size: int = 128, sf_vec_size: int = 16,
                 output_dtype: torch.dtype = torch.bfloat16, device: str = "cuda", enable_pdl: bool = True,
                 activation: str = "silu") -> None:
        assert sf_vec_size == 16 and activation == "silu", "the emulator implements NVFP4 W4A4 with SwiGLU"
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.local_expert_offset, self.output_dtype = local_expert_offset, output_dtype
        self.calls = 0

    def run(self, x: torch.Tensor, x_sf: torch.Tensor, token_selected_experts: torch.Tensor,
            token_final_scales: torch.Tensor, w1_weight: torch.Tensor, w1_weight_sf: torch.Tensor,
            w1_alpha: torch.Tensor, fc2_input_scale: torch.Tensor, w2_weight: torch.Tensor,
            w2_weight_sf: torch.Tensor, w2_alpha: torch.Tensor, tactic: Any = None) -> torch.Tensor:
        h, i, el = self.hidden_size, self.intermediate_size, self.num_local_experts
        t = x.shape[0]
        assert x.dtype == torch.uint8 and tuple(x.shape) == (t, h // 2), f"x must be packed NVFP4 [{t}, {h // 2}]"
        # Activation scales must be linear: a swizzled [round_up(T,128), ...] tensor makes the
        # real kernel read out of bounds (FlashInfer's own bridge warns of exactly this).
        sf = x_sf.squeeze(-1) if x_sf.dim() == 3 else x_sf
        assert tuple(sf.shape) == (t, h // 16) and sf.element_size() == 1, f"x_sf must be linear [{t}, {h // 16}]"
        assert tuple(token_selected_experts.shape) == tuple(token_final_scales.shape) == (t, self.top_k)
        assert tuple(w1_weight.shape) == (el, 2 * i, h // 2) and tuple(w2_weight.shape) == (el, h, i // 2)
        assert w1_alpha.shape == (el,) and w2_alpha.shape == (el,) and fc2_input_scale.numel() == 1
        self.calls += 1
        xv = _nvfp4_values(x, sf)
        w1 = _nvfp4_values(w1_weight, from_mma_view(w1_weight_sf, 2 * i, h // 16))
        w2 = _nvfp4_values(w2_weight, from_mma_view(w2_weight_sf, h, i // 16))
        fc2 = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, i), float(fc2_input_scale))
        out = torch.zeros(t, h, dtype=torch.float32)
        local = token_selected_experts.long() - self.local_expert_offset
        for e in range(el):
            tok, slot = (local == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gemm1 = (xv[tok] @ w1[e].t()) * w1_alpha[e]
            up, gate = deinterleave_up_gate(gemm1.unsqueeze(-1))
            inter = fc2.quantize((F.silu(gate) * up).squeeze(-1))
            gemm2 = (_nvfp4_values(inter.data, inter.scale) @ w2[e].t()) * w2_alpha[e]
            out.index_add_(0, tok, gemm2 * token_final_scales[tok, slot].float().unsqueeze(1))
        return out.to(self.output_dtype)


# -- the MoE all-to-all ----------------------------------------------------------------------------


class Mapping:
    """``flashinfer.comm.Mapping``, the fields the all-to-all reads."""

    def __init__(self, world_size: int = 1, rank: int = 0, gpus_per_node: int = 8, *, tp_size: int = 1,
                 moe_ep_size: int = 1, **_: Any) -> None:
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.moe_ep_size = tp_size, moe_ep_size
        self.moe_ep_rank = rank % moe_ep_size


class MoeAlltoAll:
    def __init__(self, mapping: Mapping, max_num_tokens: int, top_k: int, num_experts: int,
                 workspace_size_per_rank: int | None = None, hidden_size: int | None = None,
                 mnnvl_config: Any = None, group: Any = None) -> None:
        # ``group`` is the emulator's stand-in for MNNVL memory: the process group it talks over.
        self.comm = Comm(group)
        self.ep_rank, self.ep_size = mapping.moe_ep_rank, mapping.moe_ep_size
        assert self.comm.world_size == self.ep_size and self.comm.rank == self.ep_rank, "mapping vs process group"
        assert 0 < top_k <= sizes.MAX_TOP_K, f"top_k must be in 1..{sizes.MAX_TOP_K}"
        assert num_experts % self.ep_size == 0 and num_experts // self.ep_size <= sizes.MAX_EXPERTS_PER_RANK
        self.max_num_tokens, self.top_k, self.num_experts = max_num_tokens, top_k, num_experts
        if workspace_size_per_rank is None:
            assert hidden_size is not None, "hidden_size is needed to size the workspace"
            workspace_size_per_rank = sizes.workspace_size_per_rank(
                self.ep_size, max_num_tokens, sizes.dispatch_bytes_per_token(2 * hidden_size, top_k), 2 * hidden_size)
        self.workspace_size_per_rank = workspace_size_per_rank
        self.calls: list[VendorCall] = []
        self._phase = "idle"
        self._state: tuple[Any, ...] = ()

    def dispatch(self, token_selected_experts: torch.Tensor, input_payloads: list[torch.Tensor],
                 runtime_max_tokens_per_rank: int, invalid_token_expert_id: int | None = None,
                 expert_id_payload_index: int | None = None) -> list[torch.Tensor]:
        assert self._phase == "idle", "dispatch called twice without combine"
        ids = token_selected_experts
        t, k = ids.shape
        assert ids.dtype == torch.int32 and k == self.top_k, "token_selected_experts: int32 [T, top_k]"
        assert 0 < len(input_payloads) <= sizes.MAX_PAYLOADS and all(p.dim() == 2 and p.shape[0] == t
                                                                      for p in input_payloads)
        assert 0 < runtime_max_tokens_per_rank <= self.max_num_tokens and t <= runtime_max_tokens_per_rank
        R, T = self.ep_size, runtime_max_tokens_per_rank
        per_token = [p.shape[1] * p.element_size() for p in input_payloads]
        need = sizes.aux_bytes(R, self.max_num_tokens) + sum(R * T * b for b in per_token)
        assert need <= self.workspace_size_per_rank, f"workspace size per rank insufficient, need {need} bytes"
        local = self.num_experts // R
        target = torch.zeros(t, R, dtype=torch.bool)
        valid = ids >= 0
        target[torch.arange(t).unsqueeze(1).expand(t, k)[valid], (ids[valid].long() // local)] = True
        dest, token = target.t().nonzero(as_tuple=True)  # rank-major, token order within a rank
        rows = torch.cat([as_bytes(p[token]) for p in input_payloads], dim=1)
        send_counts = torch.bincount(dest, minlength=R)
        recv_counts = self.comm.exchange_counts(send_counts)
        payload = sum(per_token[i] for i in range(len(per_token)) if i != expert_id_payload_index)
        meta = per_token[expert_id_payload_index] if expert_id_payload_index is not None else 0
        got = self.comm.all_to_all(rows, send_counts.tolist(), recv_counts.tolist(),
                                   (("payload", payload), ("metadata", meta)))
        self.calls.append(VendorCall("dispatch", tuple(str(p.dtype) for p in input_payloads),
                                     int(rows.shape[0]) * payload))
        slots = torch.cat([torch.arange(int(n)) for n in recv_counts]) if len(got) else torch.zeros(0, dtype=torch.long)
        src = torch.repeat_interleave(torch.arange(R), recv_counts)
        out, at = [], 0
        for p, width in zip(input_payloads, per_token):
            view = torch.zeros(R, T, width, dtype=torch.uint8)
            view[src, slots] = got[:, at : at + width]
            out.append(from_bytes(view, p.dtype))
            at += width
        if expert_id_payload_index is not None and invalid_token_expert_id is not None:
            filled = torch.zeros(R, T, dtype=torch.bool)
            filled[src, slots] = True
            out[expert_id_payload_index][~filled] = invalid_token_expert_id
        self._phase, self._state = "dispatched", (dest, token, send_counts, recv_counts, src, slots, t, T)
        return out

    def combine(self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, payload_in_workspace: bool = False,
                output_dtype: torch.dtype | None = None) -> torch.Tensor:
        assert self._phase == "dispatched", "combine called before dispatch"
        dest, token, send_counts, recv_counts, src, slots, t, T = self._state
        R, h = self.ep_size, payload.shape[-1]
        assert tuple(payload.shape) == (R, T, h) and runtime_max_tokens_per_rank == T
        assert payload.dtype in (torch.bfloat16, torch.float16, torch.float32), "Unsupported dtype for MoE combine"
        back = self.comm.all_to_all(as_bytes(payload[src, slots]), recv_counts.tolist(), send_counts.tolist(),
                                    (("combine", h * payload.element_size()),))
        rows = from_bytes(back, payload.dtype).float()
        out = torch.zeros(t, h, dtype=torch.float32).index_add_(0, token, rows)  # rank order, deterministic
        self._phase, self._state = "idle", ()
        return out.to(output_dtype or payload.dtype)


comm = SimpleNamespace(MoeAlltoAll=MoeAlltoAll, Mapping=Mapping)

__all__ = ["CuteDslMoEWrapper", "Mapping", "MoeAlltoAll", "VendorCall", "comm", "fp4_quantize"]
