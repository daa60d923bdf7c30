"""A fake of DeepEP built from the hybrid-ep branch (deepseek-ai/DeepEP@94a9f8f, ``deep_ep/buffer.py``,
``csrc/deep_ep.cpp``): what differs from the 2.x fake.

- ``low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=None,
  cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, x_global_scale=None,
  use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False, use_ue8m0_for_sf=False, ...)``: this
  positional order, and a 7-tuple ``(recv_x, recv_count, recv_topk_weights, recv_rank_info, handle, event,
  hook)`` when ``topk_weights`` is given (5-tuple otherwise). ``use_fp8`` defaults to True and
  ``EP_HOST_ASSERT(not (use_fp8 and use_nvfp4))``.
- NVFP4 output: data ``[R·T, H/2, E_local]`` uint8 (expert dimension last, a permuted view of
  ``[E_local, R·T, H/2]``) and e4m3 block scales in the 128×4 swizzled layout ``[32, 4, ⌈R·T/128⌉, 4, H/64,
  E_local]`` (a permuted view of ``[E_l, ⌈m/128⌉, ⌈H/64⌉, 32, 4, 4]``). The kernel's scale is
  ``x_global_scale · amax/6`` per 16 values (``cvt_warp_fp16_to_fp4``): FlashInfer's NVFP4, computed here
  with the core codec. The message crosses as NVFP4 bytes.
- ``low_latency_combine(..., overlap=False, src_signals=None, src_signal_expect_value=0)``; ``overlap=True``
  runs ``combine_overlappable`` with ``kNumMaxTopk = 9``.
- ``Buffer.__init__(..., allow_nvlink_for_normal_mode=True, allow_nvlink_for_low_latency_mode=True,
  allow_mnnvl=False, use_fabric=False, explicitly_destroy=False, comm=None)``: no ``enable_shrink``.
- No ``check_torch_deterministic``, no QP-depth assert, no ``topk_idx_t`` (int64 asserted), tuned configs
  and ``SWITCH_RDMA_RANKS`` of main before c939644, low-latency hidden sizes without 3072.
- ``x_global_scale``: "a float32 tensor with dim() == 0" (buffer.py docstring), read on the device as
  ``x_global_scale->data_ptr<float>()`` (csrc/deep_ep.cpp): pybind refuses a Python float, c10 another dtype, and
  a tensor on another device is an illegal address in the kernel (the context is lost).
- ``HybridEPBuffer`` exists (normal-mode NVFP4); the fake does not emulate it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.backend import NVFP4Codec, WireFormat, as_bytes, from_bytes, to_mma_view
from moe_dispatch_cuda_deepep import vendor

from . import deep_ep
from ._native import check_args, device_assert, ep_assert, lose_context, scalar_type_check

# The emulated device, process and CUDA graphs: every fake DeepEP module has them (vendor.*_ATTRIBUTE).
from .deep_ep import (
    EMULATED_DEVICE_NAME,  # noqa: F401
    EMULATED_DEVICE_SMS,  # noqa: F401
    EMULATED_NVSHMEM,  # noqa: F401
    Config,
    CUDAGraph,  # noqa: F401
    EventHandle,
    EventOverlap,
    VendorCall,
    _combined_with_hook,
    _graph_kernel,
    _nan_like,
    _received,
    emulated_stream_capturing,  # noqa: F401
    install_statics,
)

__version__ = "1.2.1+94a9f8f"  # the distribution version of a git build of the branch (it has no __version__)

_DEEP_EP_CPP = "csrc/deep_ep.cpp"
_LL_CU = "csrc/kernels/internode_ll.cu"


class HybridEPBuffer:
    """``deep_ep.HybridEPBuffer`` (deep_ep/hybrid_ep_buffer.py): present for detection; not emulated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the fake does not emulate the hybrid-ep branch's HybridEPBuffer")


class Buffer(deep_ep.Buffer):
    num_sms: int = vendor.DEFAULT_NUM_SMS
    _TUNED_DISPATCH = vendor.TUNED_DISPATCH_BEFORE_EP48
    _TUNED_COMBINE = vendor.TUNED_COMBINE_BEFORE_EP48
    _RDMA_RANKS = vendor.RDMA_RANKS_V12_BEFORE_EP48
    _LL_HIDDEN_SIZES = vendor.LOW_LATENCY_HIDDEN_SIZES_V12
    _CHECKS_DETERMINISTIC = False
    _ASSERTS_QP_DEPTH = False

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_normal_mode=True, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                 use_fabric=False, explicitly_destroy=False, comm=None) -> None:
        if not allow_nvlink_for_normal_mode:
            raise NotImplementedError("the fake does not emulate the hybrid-ep branch's PCIe normal mode")
        self._start(group, comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                    allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, False)

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False):  # noqa: ANN201
        if isinstance(x, tuple) and len(x) == 3:
            raise NotImplementedError("the fake does not emulate the hybrid-ep branch's normal-mode NVFP4 dispatch")
        return super().dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                config, previous_event, async_finish, allocate_on_comm_stream)

    @_graph_kernel
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, topk_weights=None,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             x_global_scale=None, use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False,
                             use_ue8m0_for_sf=False, async_finish=False, return_recv_hook=False):  # noqa: ANN201
        args = (x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                x_global_scale, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                use_nvfp4, use_ue8m0_for_sf, async_finish, return_recv_hook)
        check_args("low_latency_dispatch", "(self: deep_ep_cpp.Buffer, arg0: torch.Tensor, arg1: torch.Tensor, arg2: "
                   "Optional[torch.Tensor], ..., arg5: Optional[torch.Tensor], arg6: int, arg7: int, arg8: bool, ...)",
                   args, "ttTTTTiibbbbbbb")
        T = int(num_max_dispatch_tokens_per_rank)
        if topk_weights is not None:
            ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights->dim() == 2",
                      _DEEP_EP_CPP)
            ep_assert(topk_weights.shape == topk_idx.shape, "topk_weights->size(0) == topk_idx.size(0) and "
                      "topk_weights->size(1) == topk_idx.size(1)", _DEEP_EP_CPP)
        ep_assert(not (use_fp8 and use_nvfp4), "not (use_fp8 and use_nvfp4)", _DEEP_EP_CPP)
        self._ll_checks(x, topk_idx, T, num_experts, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
                        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
        extra = None if topk_weights is None else as_bytes(topk_weights.float().contiguous())
        if use_nvfp4:
            if use_ue8m0_for_sf:
                raise NotImplementedError("the fake implements NVFP4 with e4m3 block scales (use_ue8m0_for_sf=False)")
            device_assert(x_global_scale is not None, "x_global_scale != nullptr", _LL_CU)
            scalar_type_check(x_global_scale, torch.float32, "x_global_scale->data_ptr<float>()")
            ep_assert(x_global_scale.dim() == 0, "x_global_scale: a float32 tensor with dim() == 0 (docstring)",
                      "deep_ep/buffer.py")
            if x_global_scale.device != x.device:
                raise lose_context("an illegal memory access: x_global_scale is not on the data's device")
            recv_x, recv_count, handle, placed = self._nvfp4_exchange(x, topk_idx, T, num_experts, x_global_scale,
                                                                      extra)
            self.calls[-1] = dataclasses.replace(self.calls[-1], x_global_scale=x_global_scale)
        else:
            recv_x, recv_count, handle, placed = self._ll_exchange_with(x, topk_idx, T, num_experts, use_fp8,
                                                                        round_scale, use_ue8m0,
                                                                        cumulative_local_expert_recv_stats, extra)
        event = EventOverlap(EventHandle() if async_finish else None)
        if topk_weights is None:
            (recv_x, recv_count), handle, hook = _received(self, (recv_x, recv_count), return_recv_hook, handle,
                                                           recv_count)
            return recv_x, recv_count, handle, event, hook
        (recv_x, recv_count, placed), handle, hook = _received(self, (recv_x, recv_count, placed), return_recv_hook,
                                                               handle, recv_count)
        recv_weights, recv_rank = placed
        return recv_x, recv_count, recv_weights, recv_rank, handle, event, hook

    def _ll_exchange_with(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, num_experts: int, use_fp8: bool,
                          round_scale: bool, use_ue8m0: bool, stats: torch.Tensor | None,
                          extra: torch.Tensor | None) -> tuple[Any, torch.Tensor, tuple, Any]:
        if extra is None:
            recv_x, recv_count, handle = self._ll_exchange(x, topk_idx, T, num_experts, use_fp8, round_scale, use_ue8m0,
                                                           stats)
            return recv_x, recv_count, handle, None
        raise NotImplementedError("the fake returns received top-k weights only with NVFP4 dispatch")

    def _nvfp4_exchange(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, num_experts: int,
                        x_global_scale: torch.Tensor, extra: torch.Tensor | None
                        ) -> tuple[Any, torch.Tensor, tuple, Any]:
        R, h, k = self.group_size, x.shape[1], topk_idx.shape[1]
        local = num_experts // R
        q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, h), float(x_global_scale)).quantize(x)
        got, payload = self._gather_slots(x, topk_idx, T, [q.data, as_bytes(q.scale)], False, extra)
        slot, expert, position, recv_count = self._place_received(
            from_bytes(got[:, payload : payload + 8 * k], torch.int64), local, T)
        data = _nan_like((local, R * T, h // 2), torch.uint8)
        data[expert, position] = got[slot, : h // 2]
        linear = _nan_like((local, R * T, h // 16), torch.uint8)
        linear[expert, position] = got[slot, h // 2 : payload]
        scales = to_mma_view(linear.view(torch.float8_e4m3fn))  # [32, 4, ⌈R·T/128⌉, 4, H/64, E_l]
        handle = self._low_latency_handle(slot, expert, position, local, T, h, num_experts)
        placed = None
        if extra is not None:
            weights = from_bytes(got[:, payload + 8 * k :], torch.float32)
            ids = from_bytes(got[:, payload : payload + 8 * k], torch.int64)
            which = (ids[slot] == (expert + self.rank * local)[:, None]).float().argmax(1)
            recv_weights = _nan_like((local, R * T), torch.float32)
            recv_weights[expert, position] = weights[slot, which]
            recv_rank = _nan_like((local, R * T), torch.int32)
            recv_rank[expert, position] = (slot // T).to(torch.int32)
            placed = (recv_weights, recv_rank)
        return (data.permute(1, 2, 0), scales), recv_count, handle, placed

    @_graph_kernel
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None,
                            overlap=False, src_signals=None, src_signal_expect_value=0):  # noqa: ANN201
        src_info, layout_range, T, hidden, num_experts = handle
        args = (x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, T, num_experts,
                use_logfmt, zero_copy, async_finish, return_recv_hook, out, overlap, src_signals,
                src_signal_expect_value)
        check_args("low_latency_combine", "(self: deep_ep_cpp.Buffer, arg0: torch.Tensor, ..., arg13: bool, arg14: "
                   "Optional[torch.Tensor], arg15: int)", args, "tttttTiibbbbTbTi")
        # combine_overlappable has kNumMaxTopk = 9 (csrc/kernels/internode_ll.cu); plain combine 11.
        max_topk = vendor.LL_MAX_TOPK_BEFORE_9AF0E0D if overlap else self._LL_MAX_TOPK
        if overlap:
            ep_assert(topk_weights.size(1) <= max_topk, "num_topk <= kNumMaxTopk", _LL_CU)
            raise NotImplementedError("the fake does not emulate the overlapped combine (src_signals)")
        combined, event = self._ll_combine_checked(x, topk_idx, topk_weights, src_info, layout_range, int(T),
                                                   int(num_experts), use_logfmt, zero_copy, async_finish,
                                                   return_recv_hook, out, max_topk)
        combined, hook = _combined_with_hook(self, combined, return_recv_hook)
        return combined, event, hook


install_statics(Buffer)

__all__ = ["Buffer", "CUDAGraph", "Config", "EventOverlap", "HybridEPBuffer", "VendorCall"]
