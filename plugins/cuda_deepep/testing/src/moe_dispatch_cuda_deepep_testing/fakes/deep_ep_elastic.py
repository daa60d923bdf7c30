"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle`` (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/elastic.py,
csrc/elastic/buffer.hpp), emulated on CPU over torch.distributed (gloo); ``fakes.deep_ep`` exports them as the real
``deep_ep`` 2.x does. docs/evidence/vendor-notes/deepep-v2-elasticbuffer.md is the reading behind every rule here.

Emulated: the direct kernels of one NVLink domain (more ranks are refused: the hybrid kernels are not emulated);
``dispatch`` with fresh handles, with ``do_cpu_sync`` (exact shapes) or without (worst-case shapes: the rows past the
real ones, and the handle's metadata rows past the real tokens, are left unwritten, NaN or all bits set here, the
counts list is empty, and combine reads the real token count from the device, combine.cuh:44-46), expanded or not,
with ``expert_alignment`` and ``do_zero_padding``;
``combine`` of either layout with ``allow_multiple_reduction`` and no bias; ``async_with_compute_stream`` on both (the
kernels' outputs, and the handle's tensors a dispatch's kernels write but ``dst_buffer_slot_idx``, are garbage until
the current stream waits on the returned ``EventOverlap``: ``fakes.deep_ep.EventHandle``; a dispatch's inputs written
before that wait are refused, since DeepEP still reads them); ``destroy``; ``get_buffer_size_hint``. The fake's calls
are synchronous and have no streams: its ``combine`` blocks the host on its peers where DeepEP's async combine does
not; a combine on a handle whose async dispatch has not been waited fails on the poisoned metadata (a torch error)
where DeepEP queues it after that dispatch; and ``record_stream`` and ``EP_AVOID_RECORD_STREAM`` change nothing here.
Not emulated, and refused with NotImplementedError rather than approximated: cached handles, ``previous_event``,
``previous_event_before_epilogue`` and ``allocate_on_comm_stream`` (the last refused alone too, though DeepEP allows it), bias, hybrid (multi-node) kernels, CPU buffers, AGRS/Engram/PP. Also not
emulated: PyTorch's lazily created NCCL communicator, which DeepEP must not wrap before the group's first collective
(DeepEP #726): the fake cannot see collectives made outside it, so the adapter's ordering is checked by a test of its
own.

As strict as the vendor where the adapter could go wrong:
- host asserts raise ``RuntimeError("Assertion exception (...): <cond>")`` with the C++ condition text; a JIT limit
  (top-k over 32, a combine hidden size not a multiple of 256) raises the JIT's "NVCC compilation failed";
- a device assert (a row naming one local expert twice, an expert id out of range) traps and loses the context;
- rows within an expert, and received tokens within a source rank, arrive in an order the vendor does not fix
  (``atomicAdd`` slots, dispatch.cuh:344-345, dispatch_copy_epilogue.cuh:120-121): the fake shuffles them per call;
- padding rows of the expanded layout are garbage (NaN here) unless ``do_zero_padding``;
- combine applies no weights: it sums what it is given (combine.cuh; refs.py:177-243), in the vendor's order;
- the constructor runs ``check_nvlink_connections`` (an AssertionError past 2 ranks on a "PCIE" ``deep_ep``
  ``EMULATED_DEVICE_NAME``, elastic.py:320) and writes ``NCCL_SYM_REUSE_SYSMEM_HANDLES`` as DeepEP does
  (elastic.py:279-282); ``num_sms`` is bounded by ``deep_ep.EMULATED_DEVICE_SMS`` (buffer.hpp:979);
- ``get_physical_domain_size(group)`` gives the emulated NVLink domain (``EMULATED_NVLINK_DOMAIN``); with
  ``EP_DISABLE_GIN`` set on a group over several domains the device communicator has no GIN contexts
  (nccl.cu:86-97), and the first dispatch traps (undefined on a GPU).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from moe_dispatch.backend import Comm, as_bytes, from_bytes
from moe_dispatch_cuda_deepep import vendor

from ._native import check_context, device_assert, ep_assert, lose_context
from .deep_ep import (
    EventOverlap,
    _after_event,
    _check_torch_deterministic,
    _poisoned_copy,
    inputs_unchanged_check,
    topk_idx_t,
)

_BUFFER_HPP = "csrc/elastic/buffer.hpp"
_LAYOUT_CUH = "deep_ep/include/deep_ep/common/layout.cuh"
_COMPILER_HPP = "csrc/jit/compiler.hpp"
_COPY_EPILOGUE = "deep_ep/include/deep_ep/impls/dispatch_copy_epilogue.cuh"
#: The emulated node's NVLink (NCCL LSA) domain: the direct kernels' reach.
NVLINK_DOMAIN = vendor.V2_DIRECT_MAX_RANKS
#: The NCCL LSA (NVLink) team the emulated machine gives a group: ranks in domains of this many (2 nodes x 4 GPUs: 4).
EMULATED_NVLINK_DOMAIN = NVLINK_DOMAIN
#: Whether the emulated network offers NCCL GIN; False emulates an NVLink-only node (DeepEP #629).
EMULATED_NETWORK_HAS_GIN = True
_NCCL_CU = "csrc/kernels/backend/nccl.cu"


def _v1() -> Any:
    """``fakes.deep_ep``: its emulated GPU (name, SM count) is this fake's too."""
    return sys.modules[f"{__package__}.deep_ep"]


def _device_sms() -> int:
    """The emulated GPU's SM count, the upper bound of ``num_sms`` (buffer.hpp:979): ``deep_ep``'s
    ``EMULATED_DEVICE_SMS``, read at each call, so that a test changes both fakes' GPU at once."""
    return int(_v1().EMULATED_DEVICE_SMS)


def _nvl_ranks(num_ranks: int) -> int:
    """NCCL's LSA (NVLink) team of a group of ``num_ranks`` on the emulated machine (nccl.cu:49-54)."""
    return min(EMULATED_NVLINK_DOMAIN, NVLINK_DOMAIN, num_ranks)


def get_physical_domain_size(group: Any) -> tuple[int, int]:
    """``deep_ep.get_physical_domain_size(group)`` (deep_ep/utils/envs.py:116-127; nccl.cu:49-54):
    ``(num_rdma_ranks, num_nvlink_ranks)`` of the group's communicator."""
    check_context()
    nvl = _nvl_ranks(group.size())
    ep_assert(group.size() % nvl == 0, "num_ranks % num_nvl_ranks == 0", _NCCL_CU)
    return group.size() // nvl, nvl


def _jit_failure(what: str) -> RuntimeError:
    """A compile-time limit: nvcc fails and the JIT asserts (csrc/jit/compiler.hpp:236-239)."""
    return RuntimeError(f"NVCC compilation failed: {what}\nAssertion exception ({_COMPILER_HPP}): false and "
                        f"\"NVCC compilation failed\"")


class EPHandle:
    """``deep_ep.EPHandle`` (elastic.py:25-98): a plain Python class holding one dispatch's layout for its combine."""

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)


class ElasticBuffer:
    """``deep_ep.ElasticBuffer`` (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/elastic.py:228-367), direct kernels."""

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False) -> None:
        check_context()
        if num_cpu_bytes:
            raise NotImplementedError("the fake does not emulate CPU-backed ElasticBuffers (num_cpu_bytes)")
        if deterministic or not allow_multiple_reduction:
            raise NotImplementedError("the fake emulates deterministic=False, allow_multiple_reduction=True")
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        domain = min(EMULATED_NVLINK_DOMAIN, NVLINK_DOMAIN)
        if self.num_ranks > (domain if allow_hybrid_mode else NVLINK_DOMAIN):
            raise NotImplementedError(f"the fake emulates the direct kernels ({domain} ranks to an NVLink domain, at "
                                      f"most {NVLINK_DOMAIN} ranks): past a domain with allow_hybrid_mode DeepEP runs "
                                      "its hybrid kernels (csrc/kernels/backend/nccl.cu:118-124), not emulated")
        self.group = group
        if os.environ.get(vendor.NCCL_GIN_CROSS_NIC) == "0":  # elastic.py:279-282
            os.environ.setdefault(vendor.NCCL_SYM_REUSE_SYSMEM_HANDLES, "1")
        # check_nvlink_connections(group) (elastic.py:320; deep_ep/utils/envs.py:145-156)
        if vendor.pcie_pairs_only(_v1().EMULATED_DEVICE_NAME):
            assert self.num_ranks <= vendor.PCIE_MAX_RANKS, vendor.PCIE_ASSERT_MESSAGE
        # ncclDevCommCreate with GIN requirements when num_ranks > 1 and EP_DISABLE_GIN is 0 (nccl.cu:86-99).
        self._gin = self.num_ranks > 1 and not vendor.gin_disabled(os.environ)
        if self._gin and not EMULATED_NETWORK_HAS_GIN:
            ep_assert(False, f"{vendor.V2_GIN_UNAVAILABLE}. This is usually due to a network configuration issue, such "
                             "as `allow_hybrid_mode=0` (disable direct RDMA kernels) in multi-plane network.", _NCCL_CU)
        if num_bytes is None:  # _C.calculate_elastic_buffer_size (elastic.py:304-309; buffer.hpp:657)
            ep_assert(num_max_tokens_per_rank > 0 and hidden > 0, "num_max_tokens_per_rank > 0 and hidden > 0",
                      _BUFFER_HPP)
            num_bytes = vendor.ported_elastic_buffer_sizes(self.num_ranks, num_max_tokens_per_rank, hidden, num_topk,
                                                           use_fp8_dispatch, min(EMULATED_NVLINK_DOMAIN, self.num_ranks),
                                                           allow_hybrid_mode, allow_multiple_reduction).total
        ep_assert(num_bytes > 0 and num_bytes % vendor.V2_BUFFER_ALIGNMENT == 0,
                  "num_buffer_bytes > 0 and num_buffer_bytes % symmetric::kNumAlignmentBytes == 0", _BUFFER_HPP)
        self.num_bytes = int(num_bytes)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.num_allocated_qps = num_allocated_qps or 17  # non-hybrid default (elastic.py:328-335)
        self.num_nvlink_ranks = _nvl_ranks(self.num_ranks)  # get_physical_domain_size() (elastic.py:362)
        self.num_rdma_ranks = self.num_ranks // self.num_nvlink_ranks
        self.explicitly_destroy = explicitly_destroy
        self._comm = Comm(group)
        self._calls = 0
        self._destroyed = False
        self._comm.barrier("ElasticBuffer")  # torch.cuda.synchronize(); group.barrier() (elastic.py:365-367)

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        ep_assert(num_max_tokens_per_rank > 0 and hidden > 0, "num_max_tokens_per_rank > 0 and hidden > 0",
                  _BUFFER_HPP)
        ep_assert(-(-hidden // 32) * 4 <= hidden, "ceil_div(hidden, 32) * 4 <= hidden", _BUFFER_HPP)
        # The LSA team enters the result (elastic.py:380-406): the emulated machine's NVLink domain
        return vendor.ported_elastic_buffer_sizes(group.size(), num_max_tokens_per_rank, hidden, num_topk,
                                                  use_fp8_dispatch, min(EMULATED_NVLINK_DOMAIN, group.size()),
                                                  allow_hybrid_mode, allow_multiple_reduction).total

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        ep_assert(not self._destroyed, "not destroyed", _BUFFER_HPP)
        self._comm.barrier("ElasticBuffer.destroy")  # barrier(true, true) (buffer.hpp:152-166)
        self._destroyed = True

    # -- dispatch -----------------------------------------------------------------------------------------------

    def dispatch(self, x: Any, topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 cumulative_local_expert_recv_stats: torch.Tensor | None = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None, num_sms: int = 0,
                 num_qps: int = 0, previous_event: Any = None, previous_event_before_epilogue: Any = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: EPHandle | None = None, do_handle_copy: bool = True, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) -> tuple:
        check_context()
        ep_assert(not self._destroyed, "not destroyed", _BUFFER_HPP)
        _check_torch_deterministic()
        if handle is not None:
            raise NotImplementedError("the fake does not emulate cached handles")
        sync = do_cpu_sync is None or do_cpu_sync  # None: True without a handle (elastic.py:938-948)
        _refuse_previous_events(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        if cumulative_local_expert_recv_stats is not None or use_tma_aligned_col_major_sf:
            raise NotImplementedError("the fake does not emulate expert stats or TMA-aligned scale layouts")
        if num_experts is None:
            raise TypeError("dispatch(): incompatible function arguments (num_experts: None)")  # pybind, elastic.py:959
        x, sf = x if isinstance(x, tuple) else (x, None)
        R = self.num_ranks
        n_max = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        align = 1 if expert_alignment is None else expert_alignment
        num_sms = num_sms or _device_sms()
        ep_assert(num_sms > 0, "num_sms > 0", _BUFFER_HPP)
        ep_assert(not do_zero_padding or do_expand, "not do_zero_padding or do_expand", _BUFFER_HPP)
        ep_assert(x.dim() == 2, "t.dim() == 2", "csrc/elastic/utils.hpp")
        ep_assert(x.is_contiguous(), "x.is_cuda() and x.is_contiguous()", _BUFFER_HPP)
        T, H = x.shape
        ep_assert((H * x.element_size()) % vendor.V2_INT4_BYTES == 0,
                  "(x.size(1) * x.element_size()) % sizeof(int4) == 0", _BUFFER_HPP)
        ep_assert(T <= n_max, "num_tokens <= num_max_tokens_per_rank", _BUFFER_HPP)
        if sf is not None:
            ep_assert(sf.dim() == 2, "t.dim() == 2", "csrc/elastic/utils.hpp")
            ep_assert(sf.shape[0] == T, "num_tokens == num_tokens_", _BUFFER_HPP)
            ep_assert(sf.element_size() == 4, "sf->element_size() == sizeof(sf_pack_t)", _BUFFER_HPP)
        ep_assert(topk_idx is not None and topk_idx.dim() == 2 and topk_idx.shape[0] == T, "t.dim() == 2",
                  _BUFFER_HPP)
        ep_assert(topk_idx.dtype == topk_idx_t, "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value",
                  _BUFFER_HPP)
        ep_assert(topk_idx.is_contiguous(), "topk_idx.is_cuda() and topk_idx.is_contiguous()", _BUFFER_HPP)
        K = topk_idx.shape[1]
        if topk_weights is not None:
            ep_assert(topk_weights.dim() == 2 and topk_weights.shape[0] == T, "num_tokens == num_tokens__",
                      _BUFFER_HPP)
            ep_assert(topk_weights.is_contiguous(), "topk_weights.is_cuda() and topk_weights.is_contiguous()",
                      _BUFFER_HPP)
            if topk_weights.dtype != torch.float32:  # data_ptr<float>()
                raise RuntimeError(f"expected scalar type Float but found {topk_weights.dtype}")
        ep_assert(num_experts % R == 0, "num_experts % nccl_context->num_ranks == 0", _BUFFER_HPP)
        sf_packs = 0 if sf is None else sf.shape[1]
        need = _dispatch_bytes(R, n_max, H * x.element_size(), sf_packs, K)
        ep_assert(need <= self.num_bytes, "get_dispatch_buffer_size(...) <= num_buffer_bytes", _BUFFER_HPP)
        ep_assert((H * x.element_size()) % vendor.V2_TMA_ALIGN_BYTES == 0,
                  "num_hidden_bytes % ptx::kNumTMAAlignBytes == 0", _LAYOUT_CUH)
        local = num_experts // R
        ep_assert(num_experts % R == 0 and R <= vendor.V2_MAX_RANKS and num_experts <= vendor.V2_MAX_EXPERTS
                  and local <= vendor.V2_MAX_EXPERTS_PER_RANK,
                  "num_experts % num_ranks == 0 and num_ranks <= kNumMaxRanks and num_experts <= kNumMaxExperts and "
                  "num_experts_per_rank <= kNumMaxExpertsPerRank", _LAYOUT_CUH)
        ep_assert(num_sms <= _device_sms(), vendor.V2_NUM_SMS_ASSERT, _BUFFER_HPP)
        if K > vendor.V2_MAX_TOPK:
            raise _jit_failure(f"kNumTopk <= {vendor.V2_MAX_TOPK} (deep_ep/include/deep_ep/impls/dispatch.cuh:93)")
        if align < 1:
            raise lose_context("dispatch.cuh:215: math::align by expert_alignment < 1")
        ids = topk_idx.long()
        device_assert(bool(((ids >= -1) & (ids < num_experts)).all()), "expert id in [-1, num_experts)",
                      "dispatch.cuh")
        if not self._gin and self.num_nvlink_ranks < R:
            # The direct kernels reach the other NVLink domains through GIN contexts the device communicator was made
            # without (EP_DISABLE_GIN, nccl.cu:86-97): undefined on a GPU, a trap here.
            raise lose_context("dispatch: GIN calls on a device communicator without GIN contexts (EP_DISABLE_GIN "
                               "on a group over several NVLink domains)")
        self._calls += 1
        x_out, out_ids, out_w, handle, _ = self._exchange(x, sf, ids, topk_weights, num_experts, n_max, align, num_sms,
                                                          do_expand, do_zero_padding,
                                                          topk_idx if not do_handle_copy else topk_idx.clone(), sync)
        if not async_with_compute_stream:  # the current stream waits on the comm stream (buffer.hpp:556-584)
            return x_out, out_ids, out_w, handle, EventOverlap()
        (x_out, out_ids, out_w), event = _after_event(True, (x_out, out_ids, out_w))
        # the data warps read them on the comm stream after the host returns (dispatch.cuh:259-350)
        event.event._checks.append(inputs_unchanged_check({"x": x, "sf": sf, "topk_idx": topk_idx,
                                                           "topk_weights": topk_weights}, "dispatch.cuh:259-350"))
        fields = _KERNEL_WRITTEN_HANDLE_FIELDS + (("topk_idx",) if do_handle_copy else ())
        for name in fields:  # written by the same kernels on the comm stream
            written = getattr(handle, name)
            shown = _poisoned_copy(written)
            if name == "topk_idx":  # -1 would read as "no expert": out of range instead
                shown.fill_(num_experts)
            event.event._fills.append((shown, written))
            setattr(handle, name, shown)
        return x_out, out_ids, out_w, handle, event

    def _exchange(self, x: torch.Tensor, sf: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor | None,
                  num_experts: int, n_max: int, align: int, num_sms: int, do_expand: bool, do_zero_padding: bool,
                  handle_ids: torch.Tensor, sync: bool) -> tuple:
        R, rank = self.num_ranks, self.rank_idx
        T, H = x.shape
        K = ids.shape[1]
        local = num_experts // R
        dest_of = torch.where(ids >= 0, torch.div(ids, local, rounding_mode="floor"), R)
        in_rank = torch.zeros(T, R + 1, dtype=torch.bool).scatter_(1, dest_of, True)[:, :R]
        # The sender deduplicates by rank (dispatch.cuh:103-106): one row per (token, destination rank).
        pairs = in_rank.t().nonzero()
        dest, token = pairs[:, 0], pairs[:, 1]
        send_counts = in_rank.sum(0).tolist()
        recv_counts = from_bytes(self._comm.all_to_all(as_bytes(torch.tensor(send_counts, dtype=torch.int64)
                                                               .unsqueeze(1)), None, None, (("metadata", 8),)),
                                 torch.int64).reshape(-1).tolist()
        w = weights if weights is not None else torch.zeros(T, K)
        columns = [as_bytes(x[token])] + ([as_bytes(sf[token].contiguous())] if sf is not None else [])
        payload = sum(c.shape[1] for c in columns)
        mine = (ids[token] >= 0) & (dest_of[token] == dest[:, None])
        local_ids = torch.where(mine, ids[token] - dest[:, None] * local, -1)
        src = (rank * n_max + token).to(torch.int32).unsqueeze(1)
        meta = [as_bytes(local_ids.to(torch.int32)), as_bytes(w[token].float()), as_bytes(src)]
        got = self._comm.all_to_all(torch.cat(columns + meta, dim=1), send_counts, recv_counts,
                                    (("payload", payload), ("metadata", 8 * K + 4)))
        width = H * x.element_size()
        recv_x = from_bytes(got[:, :width], x.dtype)
        recv_sf = from_bytes(got[:, width:payload], sf.dtype) if sf is not None else None
        at = payload
        recv_local = from_bytes(got[:, at:at + 4 * K], torch.int32).long()
        recv_w = from_bytes(got[:, at + 4 * K:at + 8 * K], torch.float32)
        recv_src = from_bytes(got[:, at + 8 * K:at + 8 * K + 4], torch.int32).reshape(-1)
        # A row's dedup per rank must not hide a repeat: one local expert twice in a row traps (dispatch_copy_epilogue
        # .cuh:107 EP_DEVICE_ASSERT(ptx::deduplicate(dst_expert_idx, lane_idx) or dst_expert_idx == -1)).
        if recv_local.numel():
            s = recv_local.sort(dim=1).values
            device_assert(not bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()),
                          "ptx::deduplicate(dst_expert_idx, lane_idx) or dst_expert_idx == -1", _COPY_EPILOGUE)
        # Arrival order within a source rank is the senders' atomicAdd order: not fixed.
        order = self._arrival_order(recv_counts)
        recv_x, recv_local, recv_w, recv_src = recv_x[order], recv_local[order], recv_w[order], recv_src[order]
        recv_sf = recv_sf[order] if recv_sf is not None else None
        n_recv = recv_x.shape[0]
        # Without the host sync the shapes are the worst case (buffer.hpp:1065-1071): R·N received tokens, and the
        # rows past the real ones unwritten (torch.empty).
        n_rows = n_recv if sync else R * n_max
        recv_x, recv_local, recv_w, recv_src = (_tail(recv_x, n_rows), _tail(recv_local, n_rows),
                                                _tail(recv_w, n_rows), _tail(recv_src, n_rows))
        recv_sf = _tail(recv_sf, n_rows) if recv_sf is not None else None
        psum_rank = torch.tensor(recv_counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        counts = torch.bincount(recv_local[:n_recv][recv_local[:n_recv] >= 0], minlength=local)[:local]
        aligned = -(-counts // align) * align
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), aligned.cumsum(0)[:-1]])
        metadata = torch.full((n_rows, K + 2), -1, dtype=torch.int32)
        metadata[:n_recv, 0] = recv_src[:n_recv]
        metadata[:n_recv, 1] = (recv_src[:n_recv] // n_max) * K  # the direct kernels' master lane: recorded, not used
        metadata[n_recv:] = _UNWRITTEN_INT32  # past the real tokens: never written (dispatch_copy_epilogue.cuh:188-207)
        handle_fields = dict(do_expand=do_expand, num_experts=num_experts, expert_alignment=align,
                             num_max_tokens_per_rank=n_max, num_sms=num_sms, topk_idx=handle_ids,
                             num_recv_tokens=n_rows, psum_num_recv_tokens_per_scaleup_rank=psum_rank,
                             num_unaligned_recv_tokens_per_expert=counts.to(torch.int32),
                             num_recv_tokens_per_expert_list=aligned.tolist() if sync else [],
                             recv_src_metadata=metadata,
                             dst_buffer_slot_idx=None, token_metadata_at_forward=None, channel_linked_list=None)
        total = int(aligned.sum())
        rows_out = total if sync else _worst_expanded_rows(R, n_max, K, local, align)  # buffer.hpp:1017-1071
        if not do_expand:
            handle = EPHandle(num_expanded_tokens=rows_out,
                              psum_num_recv_tokens_per_expert=aligned.cumsum(0).to(torch.int32),
                              **handle_fields)
            out_ids = recv_local.to(topk_idx_t)
            x_out = recv_x if sf is None else (recv_x, recv_sf)
            return x_out, out_ids, (recv_w if weights is not None else None), handle, EventOverlap()
        # Expand: one row per (token, local expert), each expert's rows at an aligned start, in atomicAdd order.
        lanes = (recv_local[:n_recv] >= 0).nonzero()
        row_of, lane_of = lanes[:, 0], lanes[:, 1]
        expert = recv_local[row_of, lane_of]
        shuffle = torch.randperm(expert.numel(), generator=self._generator())
        row_of, lane_of, expert = row_of[shuffle], lane_of[shuffle], expert[shuffle]
        by_expert = torch.sort(expert, stable=True).indices
        row_of, lane_of, expert = row_of[by_expert], lane_of[by_expert], expert[by_expert]
        first = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)[:-1]])
        out_row = starts[expert] + torch.arange(expert.numel()) - first[expert]
        metadata[row_of, 2 + lane_of] = out_row.to(torch.int32)
        # do_zero_padding zeroes each expert's gap, the last one's included, never the worst case's tail (:231-322)
        exp_x = _expanded(rows_out, total, recv_x.shape[1], recv_x.dtype, do_zero_padding)
        exp_x[out_row] = recv_x[row_of]
        exp_w = _expanded(rows_out, total, None, torch.float32, do_zero_padding)
        exp_w[out_row] = recv_w[row_of, lane_of]
        exp_sf = None
        if recv_sf is not None:
            exp_sf = _expanded(rows_out, total, recv_sf.shape[1], recv_sf.dtype, do_zero_padding)
            exp_sf[out_row] = recv_sf[row_of]
        handle = EPHandle(num_expanded_tokens=rows_out,
                          psum_num_recv_tokens_per_expert=(starts + counts).to(torch.int32),
                          **handle_fields)
        x_out = exp_x if recv_sf is None else (exp_x, exp_sf)
        return x_out, None, (exp_w if weights is not None else None), handle, EventOverlap()

    def _arrival_order(self, recv_counts: list[int]) -> torch.Tensor:
        """Rows grouped by source rank, in rank order; within a rank in a per-call order (atomicAdd slots)."""
        g, parts, start = self._generator(), [], 0
        for n in recv_counts:
            parts.append(start + torch.randperm(n, generator=g))
            start += n
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def _generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(7919 * self._calls + self.rank_idx)

    # -- combine ------------------------------------------------------------------------------------------------

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: torch.Tensor | None = None, bias: Any = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: Any = None,
                previous_event_before_epilogue: Any = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        check_context()
        ep_assert(not self._destroyed, "not destroyed", _BUFFER_HPP)
        _check_torch_deterministic()
        if bias is not None or topk_weights is not None:
            raise NotImplementedError("the fake does not emulate combine's bias or routed-back weights")
        _refuse_previous_events(previous_event, previous_event_before_epilogue, allocate_on_comm_stream)
        num_sms = num_sms or handle.num_sms
        ep_assert(num_sms > 0, "num_sms > 0", _BUFFER_HPP)
        ep_assert(x.dim() == 2, "t.dim() == 2", "csrc/elastic/utils.hpp")
        ep_assert(x.is_contiguous(), "x.is_cuda() and x.is_contiguous()", _BUFFER_HPP)
        ep_assert(x.dtype == torch.bfloat16, "x.scalar_type() == torch::kBFloat16", _BUFFER_HPP)
        H = x.shape[1]
        ep_assert((H * 2) % vendor.V2_INT4_BYTES == 0, "hidden bytes % sizeof(int4) == 0", _BUFFER_HPP)
        T, K = handle.topk_idx.shape
        ep_assert(T <= handle.num_max_tokens_per_rank, "num_combined_tokens <= num_max_tokens_per_rank", _BUFFER_HPP)
        meta = handle.recv_src_metadata
        if not handle.do_expand:
            ep_assert(x.shape[0] == meta.shape[0], "num_reduced_tokens == num_tokens", _BUFFER_HPP)
        if meta.shape[0] == handle.num_max_tokens_per_rank * self.num_ranks:  # combine.cuh:44-46: the device's count
            meta = meta[: int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])]
        if H % vendor.V2_COMBINE_HIDDEN_MULTIPLE:
            raise _jit_failure(f"kHidden % {vendor.V2_COMBINE_HIDDEN_MULTIPLE} == 0 \"Invalid hidden\" "
                               "(deep_ep/include/deep_ep/impls/combine.cuh:109)")
        if K > vendor.V2_MAX_TOPK:
            raise _jit_failure(f"kNumTopk <= {vendor.V2_MAX_TOPK}")
        ep_assert((2 * H) % vendor.V2_TMA_ALIGN_BYTES == 0, "num_hidden_bytes % ptx::kNumTMAAlignBytes == 0",
                  _LAYOUT_CUH)
        ep_assert(_combine_bytes(self.num_ranks, handle.num_max_tokens_per_rank, H, K) <= self.num_bytes,
                  "get_combine_buffer_size(...) <= num_buffer_bytes", _BUFFER_HPP)
        # Each received row's partial: expanded rows summed in fp32 in ascending lane order, rounded once (a single
        # row as it is); not expanded: the caller's row (combine.cuh:125-176).
        if handle.do_expand:
            lanes = meta[:, 2:].long()
            valid = lanes >= 0
            partial = torch.zeros(meta.shape[0], H, dtype=torch.float32)
            for k in range(K):
                rows = lanes[:, k]
                take = valid[:, k]
                partial[take] += x[rows[take]].float()
            partial = partial.to(torch.bfloat16)
        else:
            partial = x[: meta.shape[0]]
        src = meta[:, 0].long()
        src_rank, src_token = torch.div(src, handle.num_max_tokens_per_rank, rounding_mode="floor"), \
            src % handle.num_max_tokens_per_rank
        R = self.num_ranks
        order = torch.argsort(src_rank, stable=True)
        back_counts = torch.bincount(src_rank, minlength=R).tolist()
        rows = torch.cat([as_bytes(partial[order]), as_bytes(src_token[order].to(torch.int32).unsqueeze(1))], 1)
        mine = from_bytes(self._comm.all_to_all(as_bytes(torch.tensor(back_counts, dtype=torch.int64).unsqueeze(1)),
                                                None, None, (("metadata", 8),)), torch.int64).reshape(-1).tolist()
        got = self._comm.all_to_all(rows, back_counts, mine, (("combine", 2 * H), ("metadata", 4)))
        parts = from_bytes(got[:, :2 * H], torch.bfloat16)
        tokens = from_bytes(got[:, 2 * H:], torch.int32).reshape(-1).long()
        from_rank = torch.repeat_interleave(torch.arange(R), torch.tensor(mine, dtype=torch.long))
        # Home reduction: fp32, one partial per destination rank, ranks in ascending order of the last top-k lane
        # that points at them (ptx::deduplicate keeps the highest lane; combine_utils.cuh:41-53), one rounding.
        ids = handle.topk_idx.long()
        local = handle.num_experts // R
        dest = torch.where(ids >= 0, torch.div(ids, local, rounding_mode="floor"), -1)
        lane = torch.arange(K).expand(T, K)
        last_lane = torch.full((T, R), -1, dtype=torch.long)
        for k in range(K):
            ok = dest[:, k] >= 0
            last_lane[ok, dest[ok, k]] = lane[ok, k]
        key = last_lane[tokens, from_rank]
        order = torch.argsort(key, stable=True)  # CPU index_add_ adds in index order: the vendor's order per token
        out = torch.zeros(T, H, dtype=torch.float32).index_add_(0, tokens[order], parts[order].float())
        (combined,), event = _after_event(async_with_compute_stream, (out.to(torch.bfloat16),))
        return combined, None, event


#: The ``EPHandle`` tensors a dispatch's kernels write (notify and copy epilogue, on the comm stream: elastic.py:25-98,
#: dispatch.cuh:211-256, dispatch_copy_epilogue.cuh:120-121, 188-207); the Python list is the host's, read after its
#: poll. Also kernel-written: ``topk_idx`` with ``do_handle_copy`` (dispatch.cuh:324-325, poisoned too) and
#: ``dst_buffer_slot_idx`` (dispatch.cuh:349), which the fake does not emulate (None: it has no buffer slots).
_KERNEL_WRITTEN_HANDLE_FIELDS = ("num_unaligned_recv_tokens_per_expert", "psum_num_recv_tokens_per_expert",
                                 "psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata")


def _refuse_previous_events(previous_event: Any, before_epilogue: Any, allocate_on_comm_stream: bool) -> None:
    if previous_event is not None or before_epilogue is not None or allocate_on_comm_stream:
        raise NotImplementedError("the fake does not emulate previous_event, previous_event_before_epilogue or "
                                  "allocate_on_comm_stream (the comm stream waits on the whole current stream)")


def _dispatch_bytes(num_ranks: int, n_max: int, hidden_bytes: int, sf_packs: int, num_topk: int) -> int:
    """``get_dispatch_buffer_size`` of the direct kernels with the call's real arguments (buffer.hpp:963-966)."""
    return vendor.v2_dispatch_token_bytes(hidden_bytes, sf_packs, num_topk) * n_max * num_ranks


def _combine_bytes(num_ranks: int, n_max: int, hidden: int, num_topk: int) -> int:
    """``get_combine_buffer_size`` of the direct kernels in one NVLink domain with multiple reduction
    (buffer.hpp:634-649, 1253-1256): ``min(R, K)`` slots of a BF16 row and ``8K`` bytes per token."""
    return vendor.v2_combine_token_bytes(hidden, num_topk) * min(num_ranks, num_topk) * n_max


#: What an unwritten int32 metadata word reads as here: out of every range (a read of it fails, as the vendor's would
#: read garbage).
_UNWRITTEN_INT32 = 0x7FFFFFFF


def _worst_expanded_rows(num_ranks: int, n_max: int, num_topk: int, local: int, align: int) -> int:
    """The expanded rows allocated without the host sync (buffer.hpp:1065-1071)."""
    return -(-(num_ranks * n_max * min(num_topk, local) + (align - 1) * local) // align) * align


def _tail(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t``'s rows, then unwritten ones up to ``rows`` (the worst case without the host sync)."""
    if t.shape[0] == rows:
        return t
    width = t.shape[1] if t.dim() > 1 else None
    # integers out of every range (an unwritten id must not read as -1, "no expert")
    out = (_garbage(rows, width, t.dtype, float("nan")) if t.dtype.is_floating_point
           else torch.full((rows, *t.shape[1:]), torch.iinfo(t.dtype).max, dtype=t.dtype))
    out[: t.shape[0]] = t
    return out


def _expanded(rows: int, total: int, width: int | None, dtype: torch.dtype, zero_padding: bool) -> torch.Tensor:
    """Expanded rows before the copy: unwritten, but for zero padding on the segments' ``total`` rows."""
    out = _garbage(rows, width, dtype, float("nan"))
    if zero_padding:
        out[:total] = _garbage(total, width, dtype, 0)
    return out


def _garbage(rows: int, width: int | None, dtype: torch.dtype, fill: float) -> torch.Tensor:
    """``torch.empty`` rows: NaN where the dtype has it, all bits set in integer words (packed UE8M0 scales), or
    zeros with zero padding."""
    shape = (rows,) if width is None else (rows, width)
    if fill != 0 and not dtype.is_floating_point:
        return torch.full(shape, -1, dtype=dtype)
    if fill == 0 or dtype.itemsize == 1:
        out = torch.zeros(shape, dtype=dtype if dtype.itemsize != 1 else torch.uint8)
        if fill != 0 and dtype.itemsize == 1:
            out.fill_(0x7F)  # e4m3 NaN bits
        return out.view(dtype) if dtype.itemsize == 1 else out
    return torch.full(shape, fill, dtype=dtype)


__all__ = ["EPHandle", "ElasticBuffer"]
