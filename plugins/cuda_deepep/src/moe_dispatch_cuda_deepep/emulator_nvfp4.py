"""The emulator of a DeepEP built from the hybrid-ep branch: ``Buffer.low_latency_dispatch``
also takes ``use_nvfp4``, ``use_ue8m0_for_sf``, ``x_global_scale`` and ``topk_weights``.

NVFP4 output, as the branch documents it (DeepEP ``cf78085``, ``deep_ep/buffer.py``
docstring; what sglang's CuTe-DSL path consumes): data ``[R·T, H/2, E_local]`` uint8 with
the expert dimension last, and e4m3 block scales in the 128×4 swizzled MMA layout
``[32, 4, ceil(R·T/128), 4, H/64, E_local]``. The quantization is FlashInfer's NVFP4 (one e4m3
scale per 16 values, ``x_global_scale`` = 448·6/amax), done here with the core codec. The
message crosses as NVFP4 bytes: H/2 + H/16 per token.

Everything else is the V1 emulator's ``Buffer``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import moe_dispatch as md
from moe_dispatch.codecs import NVFP4Codec, as_bytes, from_bytes
from moe_dispatch.scale_layouts import to_mma_view
from moe_dispatch.wire import WireFormat

from . import emulator
from .emulator import LOW_LATENCY_HIDDEN_SIZES, Config, EventOverlap, VendorCall, topk_idx_t


class Buffer(emulator.Buffer):
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, use_nvfp4: bool = False,
                             use_ue8m0_for_sf: bool = False, x_global_scale: torch.Tensor | None = None,
                             topk_weights: torch.Tensor | None = None, async_finish: bool = False,
                             return_recv_hook: bool = False):  # noqa: ANN201
        if not use_nvfp4:
            return super().low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        assert not use_ue8m0_for_sf, "the emulator implements NVFP4 with e4m3 block scales"
        assert x_global_scale is not None and x_global_scale.dim() == 0, "x_global_scale: a 0-d fp32 tensor"
        T, R, h = num_max_dispatch_tokens_per_rank, self.group_size, x.shape[1]
        local = num_experts // R
        q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, h), float(x_global_scale)).quantize(x)
        got, payload = self._gather_slots(x, topk_idx, T, num_experts, [q.data, as_bytes(q.scale)], False)
        slot, expert, position, recv_count = self._place_received(from_bytes(got[:, payload:], torch.int64), local)
        data = torch.zeros(local, R * T, h // 2, dtype=torch.uint8)
        data[expert, position] = got[slot, : h // 2]
        linear = torch.zeros(local, R * T, h // 16, dtype=torch.uint8)
        linear[expert, position] = got[slot, h // 2 : payload]
        scales = to_mma_view(linear.view(torch.float8_e4m3fn))  # [32, 4, R·T/128, 4, H/64, E_l]
        handle = self._low_latency_handle(slot, expert, position, local, T, h, num_experts)
        hook: Callable[[], None] = lambda: None  # noqa: E731
        recv_x: Any = (data.permute(1, 2, 0), scales)  # [R·T, H/2, E_l]: expert dimension last
        return recv_x, recv_count, handle, EventOverlap(), hook


__all__ = ["Buffer", "Config", "EventOverlap", "LOW_LATENCY_HIDDEN_SIZES", "VendorCall", "topk_idx_t"]
