"""The vendor boundary of cuda_deepep: every DeepEP and DeepGEMM fact the adapter and the fakes use.

Each fact carries its source as ``owner/repo@commit path [symbol]`` (read from the local mirrors of
deepseek-ai/DeepEP and deepseek-ai/DeepGEMM). Sizes and layouts the vendor computes itself are called
through the installed module (``dispatch_config``, ``nvl_buffer_size_hint``, ``low_latency_rdma_size_hint``,
``mk_alignment``, ``dg_tma_aligned_size``, ``dg_packed_ue8m0_mn_major``; ``dg_mn_major`` lays scales out with torch
ops, so that DeepGEMM compiles no transpose kernel); the ported formulas
here are the fallback for planning without DeepEP/DeepGEMM and are tested equal to the vendor's published
numbers. Recorded signatures are ``moe_dispatch.backend.VendorSignature``s.

Nothing here imports the adapter or the fakes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import math
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import torch

from moe_dispatch.backend import VendorSignature

# =====================================================================================================
# Module names
# =====================================================================================================

#: The real DeepEP package (``pip install`` from a source checkout; not on the package index).
REAL = "deep_ep"
#: The real DeepGEMM package.
DEEP_GEMM = "deep_gemm"
#: The attribute a fake module sets to stand in for the GPU's compute capability.
EMULATED_CAPABILITY_ATTRIBUTE = "EMULATED_DEVICE_CAPABILITY"

INSTALL_HINT = ("DeepEP builds from source with NVSHMEM: see https://github.com/deepseek-ai/DeepEP "
                "(`pip install --no-build-isolation .` in its checkout), on a CUDA machine")
DEEP_GEMM_INSTALL_HINT = (
    "DeepGEMM is not on the package index: build it from source on a CUDA machine (SM90/SM100), see "
    "https://github.com/deepseek-ai/DeepGEMM (`git clone --recursive`, then `./install.sh` or "
    "`pip install --no-build-isolation .` in the checkout)")

# =====================================================================================================
# DeepEP constants
# =====================================================================================================

# deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/compiled.cuh
NUM_MAX_NVL_PEERS = 8
NUM_MAX_RDMA_PEERS = 20
NUM_WORKSPACE_BYTES = 32 * 1024 * 1024
NUM_MAX_LOCAL_EXPERTS = 1024
NUM_BUFFER_ALIGNMENT_BYTES = 128
FINISHED_SUM_TAG = 1024
#: deepseek-ai/DeepEP@dd758ca deep_ep/buffers/legacy.py Buffer.num_sms (class attribute)
DEFAULT_NUM_SMS = 20
#: deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu get_source_meta_bytes (two ints)
SOURCE_META_BYTES = 8
#: deepseek-ai/DeepEP@dd758ca csrc/legacy/config.hpp Config::get_*_buffer_size_hint kNumMaxTopK / kNumMaxScales
HINT_RESERVED_TOPK = 128
HINT_RESERVED_SCALES = 128
#: int32 ``INT_MAX``: the V1 constructor bounds both buffers by it in several ways
#: (deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp Buffer::Buffer "Common checks").
INT_MAX = 2**31 - 1
#: ``num_bytes / sizeof(int4) < INT_MAX`` for each buffer: at most 16·(2³¹−1)−1 bytes ("32 GiB").
MAX_BUFFER_BYTES = 16 * INT_MAX - 1
#: Normal mode: ``EP_DEVICE_ASSERT(num_topk <= 32)`` in the intranode and internode dispatch and
#: combine kernels (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/intranode.cu dispatch, combine;
#: internode.cu dispatch, combine; the same since @ebfe47e). The size hints reserve 128.
NORMAL_MAX_TOPK = 32
#: Intranode notify: ``num_experts / num_ranks <= kNumThreads (128) and num_ranks <= 128``
#: (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/intranode.cu notify_dispatch).
NORMAL_INTRANODE_MAX_LOCAL_EXPERTS = 128
#: Internode notify: ``EP_DEVICE_ASSERT(num_rdma_experts <= num_threads)`` with ``num_rdma_experts = num_experts /
#: kNumRDMARanks`` (= 8 · local experts) and 512 threads (deepseek-ai/DeepEP@dd758ca
#: csrc/kernels/legacy/internode.cu notify_dispatch): at most 64 local experts past 8 ranks.
NORMAL_INTERNODE_MAX_NVL_EXPERTS = 512
#: ``SWITCH_RANKS``: intranode kernels exist for these world sizes only
#: (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/launch.cuh). ``intranode::barrier`` switches on it too, and
#: ``Buffer::destroy`` calls that barrier whenever it has NVL bytes: a Buffer with NVL bytes on any other
#: ``min(R, 8)`` throws from its ``noexcept(false)`` destructor, which pybind11 runs inside a noexcept
#: ``unique_ptr`` destructor: ``std::terminate`` (csrc/legacy/buffer.hpp ~Buffer, destroy; intranode.cu barrier).
INTRANODE_RANKS = frozenset({2, 4, 8})
#: ``Buffer.__init__(num_qps_per_rank=24)`` (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/legacy.py).
DEFAULT_NUM_QPS_PER_RANK = 24


def world_size_ok(num_ranks: int) -> bool:
    """``EP_HOST_ASSERT(num_ranks < LEGACY_NUM_MAX_NVL_PEERS or num_ranks % LEGACY_NUM_MAX_NVL_PEERS == 0)`` in the
    Buffer constructor, every mode (deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp Buffer::Buffer; the same
    @ebfe47e csrc/deep_ep.cpp); in LL mode NVSHMEM's team split asserts it again (csrc/kernels/backend/nvshmem.cu
    init, ``num_ranks % team_split_stride == 0``)."""
    return num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0


def internode_qps_ok(num_qps_per_rank: int, num_sms: int) -> bool:
    """``EP_DEVICE_ASSERT(num_rc_per_pe == num_channels or num_rc_per_pe >= num_sms)`` in the internode dispatch
    kernel, ``num_rc_per_pe`` being ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` = ``num_qps_per_rank`` and ``num_channels =
    num_sms / 2`` (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu dispatch)."""
    return num_qps_per_rank == num_sms // 2 or num_qps_per_rank >= num_sms


def normal_num_qps_per_rank(num_sms: int) -> int:
    """QPs for a Buffer running internode normal mode with configs of ``num_sms`` SMs: DeepEP's own test uses
    ``max(num_sms, ...)`` (tests/legacy/test_internode.py), sglang ``DeepEPConfig.num_sms``."""
    return max(DEFAULT_NUM_QPS_PER_RANK, num_sms)


#: ``kNumCombineForwarderWarps`` (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu combine).
COMBINE_FORWARDER_WARPS = 24


def internode_combine_config_problems(num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int,
                                      num_ranks: int) -> list[str]:
    """The ``EP_HOST_ASSERT``s of ``internode::combine`` on the config, past 8 ranks (deepseek-ai/DeepEP@dd758ca
    csrc/kernels/legacy/internode.cu combine; csrc/legacy/buffer.hpp internode_combine)."""
    rdma = num_ranks // NUM_MAX_NVL_PEERS
    per_forwarder = max(COMBINE_FORWARDER_WARPS // rdma, 1)
    checks = [(rdma <= COMBINE_FORWARDER_WARPS, "num_rdma_ranks <= kNumCombineForwarderWarps"),
              (nvl_recv % rdma == 0, "num_max_nvl_chunked_recv_tokens % num_rdma_ranks == 0")]
    if checks[-1][0]:
        checks += [(nvl_recv // rdma > max(rdma_send, nvl_send), "num_max_nvl_chunked_recv_tokens / num_rdma_ranks > "
                    "max(num_max_rdma_chunked_send_tokens, num_max_nvl_chunked_send_tokens)"),
                   (nvl_recv // rdma - per_forwarder >= nvl_send, "num_max_nvl_chunked_recv_tokens / num_rdma_ranks - "
                    "num_warps_per_forwarder >= num_max_nvl_chunked_send_tokens")]
    checks.append((rdma_send >= per_forwarder, "num_max_rdma_chunked_send_tokens >= num_warps_per_forwarder "
                   f"({per_forwarder})"))
    return [text for ok, text in checks if not ok]


# -- normal-mode hidden limits: the TMA staging of a token in shared memory ------------------------------------
#: Intranode dispatch stages half a token per warp: ``EP_DEVICE_ASSERT(hidden_int4 % 2 == 0 and half_hidden_bytes
#: + sizeof(uint64_t) <= kNumTMABytesPerWarp)``, kNumTMABytesPerWarp = 8192 (deepseek-ai/DeepEP@dd758ca
#: csrc/kernels/legacy/intranode.cu dispatch; since c8dceba, the same @e9d053c and on hybrid-ep).
INTRANODE_DISPATCH_TMA_BYTES = 8192
#: Internode dispatch (kNumTMABytesPerWarp) and combine senders (kNumTMABytesPerSenderWarp) stage a whole token:
#: ``num_bytes_per_token + sizeof(uint64_t) <= 16384`` (internode.cu dispatch, combine; since a2fa3b7/06f417d).
INTERNODE_TMA_BYTES = 16384
#: The internode combine forwarder's TMA path: ``EP_DEVICE_ASSERT(hidden_int4 % 32 == 0)`` (internode.cu
#: combine_token, since f9c06bb; a fallback for other sizes was proposed in 6e98f65, not merged): BF16 H % 256.
INTERNODE_COMBINE_HIDDEN_INT4_MULTIPLE = 32
TMA_MBARRIER_BYTES = 8


def internode_bytes_per_token(hidden_bytes: int, num_scales: int, num_topk_idx: int, num_topk_weights: int) -> int:
    """``get_num_bytes_per_token``: hidden bytes + SourceMeta (8) + 4 per scale, top-k index (int) and weight,
    rounded up to 16 (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu)."""
    return _align(hidden_bytes + SOURCE_META_BYTES + 4 * (num_scales + num_topk_idx + num_topk_weights), 16)


def normal_hidden_problems(hidden: int, element_size: int, num_scales: int, top_k: int, num_ranks: int) -> list[str]:
    """What the normal-mode kernels device-assert about the hidden size, for a dispatch of ``element_size`` bytes per
    element with ``num_scales`` 4-byte scale columns (and a BF16 combine)."""
    hidden_bytes = hidden * element_size
    if num_ranks <= NUM_MAX_NVL_PEERS:
        half = hidden_bytes // 32 * 16  # half_hidden_int4 · sizeof(int4)
        ok = (hidden_bytes // 16) % 2 == 0 and half + TMA_MBARRIER_BYTES <= INTRANODE_DISPATCH_TMA_BYTES
        return [] if ok else [f"intranode dispatch: hidden_int4 % 2 == 0 and half_hidden_bytes ({half}) + 8 <= "
                              f"{INTRANODE_DISPATCH_TMA_BYTES}"]
    problems = []
    dispatch = internode_bytes_per_token(hidden_bytes, num_scales, top_k, top_k)
    if dispatch + TMA_MBARRIER_BYTES > INTERNODE_TMA_BYTES:
        problems.append(f"internode dispatch: num_bytes_per_token ({dispatch}) + 8 <= {INTERNODE_TMA_BYTES}")
    combine = internode_bytes_per_token(2 * hidden, 0, 0, top_k)
    if combine + TMA_MBARRIER_BYTES > INTERNODE_TMA_BYTES:
        problems.append(f"internode combine: num_bytes_per_token ({combine}) + 8 <= {INTERNODE_TMA_BYTES}")
    if (2 * hidden // 16) % INTERNODE_COMBINE_HIDDEN_INT4_MULTIPLE:
        problems.append("internode combine forwarder (TMA): hidden_int4 % 32 == 0 (BF16 hidden % 256)")
    return problems


#: Internode dispatch sends a token to at most 8 RDMA ranks: ``get_num_topk_rdma_ranks`` = min(RDMA ranks, 8) and
#: ``EP_DEVICE_ASSERT(num_topk_ranks <= kNumTopkRDMARanks)`` (deepseek-ai/DeepEP@dd758ca
#: csrc/kernels/legacy/internode.cu dispatch). With top-k <= 8 no token can span more nodes.
NORMAL_MAX_TOPK_RDMA_RANKS = 8


def normal_max_top_k(num_ranks: int) -> int:
    """The largest top-k whose tokens can never reach more than 8 nodes, whatever the routing."""
    if num_ranks // NUM_MAX_NVL_PEERS > NORMAL_MAX_TOPK_RDMA_RANKS:
        return NORMAL_MAX_TOPK_RDMA_RANKS
    return NORMAL_MAX_TOPK
# -- normal-mode SM counts: what the kernels launched with ``config.num_sms`` assert -------------------------------
#: Intranode ``cached_notify_combine`` launches ``1 + num_channels`` blocks and asserts ``1 + num_channels <=
#: num_channels * 2``: at least one channel, two SMs (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/intranode.cu).
NORMAL_MIN_NUM_SMS = 2
#: Internode ``cached_notify`` asserts ``num_channels * 2 > 3`` (two channels, four SMs) and sets
#: ``8192 · max(4, num_channels)`` bytes of dynamic shared memory through ``SET_SHARED_MEMORY_FOR_TMA`` (an
#: ``EP_HOST_ASSERT`` on ``cudaFuncSetAttribute``), whose limit is 227 KiB on SM90/SM100: at most 28 channels
#: (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu cached_notify; launch.cuh).
INTERNODE_MIN_NUM_SMS = 4
INTERNODE_CACHED_NOTIFY_TMA_BYTES_PER_WARP = 8192
MAX_DYNAMIC_SHARED_MEMORY_BYTES = 227 * 1024
INTERNODE_MAX_NUM_SMS = 2 * (MAX_DYNAMIC_SHARED_MEMORY_BYTES // INTERNODE_CACHED_NOTIFY_TMA_BYTES_PER_WARP)


def normal_num_sms_problems(num_sms: int, num_ranks: int, device_sms: int | None) -> list[str]:
    """What DeepEP's normal-mode kernels assert of a config's ``num_sms`` beyond its constructor (which takes any
    ``num_sms >= 0``): an even count (two SMs per channel), the notify kernels' channel bounds, and a cooperative
    launch of at most the GPU's SMs (launch.cuh ``cudaLaunchAttributeCooperative``)."""
    problems = []
    if num_sms % 2:
        problems.append("num_sms % 2 == 0 (two SMs per channel)")
    if num_sms < NORMAL_MIN_NUM_SMS:
        problems.append("1 + num_channels <= num_channels * 2 (intranode cached_notify_combine: at least 2 SMs)")
    if num_ranks > NUM_MAX_NVL_PEERS:
        if num_sms < INTERNODE_MIN_NUM_SMS:
            problems.append("num_channels * 2 > 3 (internode cached_notify: at least 4 SMs)")
        if num_sms > INTERNODE_MAX_NUM_SMS:
            problems.append(f"8192 · num_channels bytes of shared memory <= 227 KiB (internode cached_notify: at most "
                            f"{INTERNODE_MAX_NUM_SMS} SMs)")
    if device_sms is not None and num_sms > device_sms:
        problems.append(f"a cooperative launch of num_sms blocks on a GPU of {device_sms} SMs")
    return problems


#: Internode ``notify_dispatch`` and ``cached_notify`` assert ``num_rdma_bytes < INT_MAX`` and ``num_nvl_bytes <
#: INT_MAX`` (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu), which the constructor does not for an LL
#: Buffer (``low_latency_mode or num_rdma_bytes <= INT_MAX``): a Buffer serving internode normal mode needs both.
def internode_bytes_ok(num_nvl_bytes: int, num_rdma_bytes: int) -> bool:
    return num_nvl_bytes < INT_MAX and num_rdma_bytes < INT_MAX


def constructor_bytes_problems(num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool) -> list[str]:
    """The byte bounds of ``Buffer::Buffer``'s common checks (deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp):
    NVL bytes at most INT_MAX on a Buffer with RDMA bytes and RDMA bytes at most INT_MAX outside LL mode (the same
    @ebfe47e csrc/deep_ep.cpp), each region ``/ sizeof(int4) < INT_MAX``, below 32 GiB (from 4623c67; checked on
    every version: stricter than older builds, never looser). Alignment is the caller's."""
    problems = []
    if num_nvl_bytes > INT_MAX and num_rdma_bytes != 0:
        problems.append("num_nvl_bytes <= std::numeric_limits<int>::max() or num_rdma_bytes == 0")
    if num_rdma_bytes > INT_MAX and not low_latency_mode:
        problems.append("low_latency_mode or num_rdma_bytes <= std::numeric_limits<int>::max()")
    for name, n in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
        if n // 16 >= INT_MAX:
            problems.append(f"{name} / sizeof(int4) < std::numeric_limits<int>::max()")
    return problems


# -- NVSHMEM, one per process ----------------------------------------------------------------------------------
#: ``Buffer::sync`` starts NVSHMEM whenever the Buffer has RDMA bytes (LL mode, or normal mode past 8 ranks), as
#: PE ``rank`` of ``num_ranks`` in LL mode and PE ``rdma_rank`` of ``num_rdma_ranks`` in normal mode, and asserts
#: the PE it gets back (deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp sync; csrc/kernels/backend/nvshmem.cu
#: init: ``nvshmemx_init_attr`` then, in LL mode past 8 ranks, the team split asserting no team exists). A second
#: live init in the process gets the first's PE numbering back (or fails the team assert); ``destroy`` finalizes
#: NVSHMEM for the whole process. Intranode normal-mode Buffers (NVL bytes only) never start it.
NVSHMEM_INIT_ASSERT = ("nvshmem_rank == nvshmem::init(root_unique_id, nvshmem_rank, num_nvshmem_ranks, "
                       "low_latency_mode ? LEGACY_NUM_MAX_NVL_PEERS : 0)")


def nvshmem_pe(rank: int, num_ranks: int, low_latency_mode: bool) -> tuple[int, int]:
    """(PE, PE count) a Buffer starts NVSHMEM with (``Buffer::sync``)."""
    if low_latency_mode:
        return rank, num_ranks
    return rank // NUM_MAX_NVL_PEERS, max(1, num_ranks // NUM_MAX_NVL_PEERS)


#: ``explicitly_destroy`` (0c984e2, 2025-07-11 "Explicitly destroy the C++ runtime and release resources. (#292)";
#: 1.0 and early 1.1 builds lack it): with it, ``~Buffer`` runs no teardown and only prints this warning when
#: ``destroy()`` was not called; without it, ``~Buffer`` runs ``destroy()``: ``cudaDeviceSynchronize``, the
#: intranode barrier and ``nvshmem_barrier_all``, collectives a dead peer never joins (csrc/legacy/buffer.hpp
#: ~Buffer, destroy; legacy.py: "Releasing resources in the destructor may cause Python's exception handling
#: process to hang").
COMMIT_EXPLICITLY_DESTROY = "0c984e2"
BUFFER_DESTROY_WARNING = "WARNING: destroy() was not called before DeepEP buffer destruction, which can leak resources."


def takes_explicitly_destroy(module: Any) -> bool:
    """Whether the installed ``Buffer.__init__`` has ``explicitly_destroy``."""
    buffer = getattr(module, "Buffer", None)
    try:
        return buffer is not None and "explicitly_destroy" in inspect.signature(buffer.__init__).parameters
    except (TypeError, ValueError):
        return False


# -- the low-latency signalling counts -------------------------------------------------------------------------
#: Each LL kernel zeroes the *other* half's signalling counts for its own E (``next_clean``), so nothing else may
#: write them between LL kernels: internode normal-mode kernels do (they use the RDMA region; intranode ones use
#: the NVL region only), and ``clean_low_latency_buffer(T, hidden, E)`` (barrier, zero both halves, barrier) must
#: run first (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/legacy.py clean_low_latency_buffer; csrc/kernels/legacy/
#: internode_ll.cu dispatch/combine ``next_clean``, clean_low_latency_buffer). Since 42253d0 (2025-07-29, "Fix the
#: address of dispatch_rdma_recv_count_buffer to avoid cleaning after each change in hidden_size/token_num", #313)
#: the counts sit at the front of the RDMA region, half i at ``align_up(4E, 128)·i``, ``4E`` bytes each (csrc/legacy/
#: config.hpp LowLatencyLayout; ``ll_signalling_halves``): only E decides where they are. Before it (1.0, and 1.1 builds before 2025-07-29) they sat
#: after the send/receive buffers, whose sizes depend on T and hidden (DeepEP issue #93: graphs of several T on one
#: Buffer read corrupted counts).
COMMIT_LL_SIGNALLING_AT_FRONT = "42253d0"


def ll_signalling_halves(num_experts: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The byte ranges of E's two signalling halves (from 42253d0): half i at ``align_up(4E, 128)·i``, ``4E`` bytes
    (E ints: the dispatch counts ``[local expert · R + source rank]`` and the combine flags ``[expert]`` share them).
    ``clean_low_latency_buffer(T, hidden, E)`` zeroes exactly these two ranges (``clean_meta()``), an LL kernel on
    half b reads half b's and zeroes the other's (``next_clean``) (deepseek-ai/DeepEP@dd758ca csrc/legacy/config.hpp
    LowLatencyLayout, LowLatencyBuffer::clean_meta; csrc/legacy/buffer.hpp clean_low_latency_buffer,
    low_latency_dispatch/combine; the same @94a9f8f csrc/config.hpp). A smaller E's halves do not sit inside a
    larger E's when ``4·E_max`` is not a multiple of 128: one clean for the largest E does not cover the others."""
    aligned = _align(4 * int(num_experts), NUM_BUFFER_ALIGNMENT_BYTES)
    return (0, 4 * int(num_experts)), (aligned, aligned + 4 * int(num_experts))


def ll_data_offset(num_experts: int) -> int:
    """Where E's send and receive buffers start: ``2·align_up(4E, 128)``, right after its signalling halves (same
    source). An LL kernel of a smaller E writes data over a larger E's signalling counts."""
    return 2 * _align(4 * int(num_experts), NUM_BUFFER_ALIGNMENT_BYTES)


def ll_clean_key(by_experts: bool, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
    """What decides where a layer's LL signalling counts are: E (from 42253d0), or (T, hidden, E) before."""
    if by_experts:
        return int(num_experts)
    return int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts)


#: Low-latency calls per Buffer that may have sent and not yet received (``return_recv_hook=True``, the hook not yet
#: run): one. Every LL dispatch and combine toggles ``low_latency_buffer_idx`` on the host and its send phase zeroes
#: the other half's signalling counts (``next_clean``), the half the pending call's receive waits on: it would spin
#: until the ~100 s trap (deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp:1504-1505,1644-1645 and
#: csrc/kernels/legacy/internode_ll.cu:286-289,776-780; the same since @ebfe47e; DeepEP issue #513). The docstring's
#: "cannot hold more than 2 low-latency kernels' result tensors" (legacy.py low_latency_dispatch) is about result
#: tensors before 6cc3497, not pending receives. The hook must run exactly once (a second run atomically adds the
#: dispatch's counts again: internode_ll.cu:408). ``async_finish`` and ``return_recv_hook`` exclude each other
#: (buffer.hpp ``EP_HOST_ASSERT(not(async and return_recv_hook))``).
LL_CALLS_AWAITING_RECEIVE = 1

#: Low-latency: ``(num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0`` ("TMA requires the number
#: of tokens to be multiple of 4"; deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp low_latency_dispatch,
#: present since @ebfe47e csrc/deep_ep.cpp).
LOW_LATENCY_TOKEN_MULTIPLE = 4
#: Low-latency FP8: ``hidden % 512 == 0`` (same function).
LOW_LATENCY_FP8_HIDDEN_MULTIPLE = 512
#: The LL dispatch kernel's warp groups: ``ceil(E / num_device_sms) < 15`` and 32/groups > 1 (device
#: asserts; deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode_ll.cu dispatch). An H100/H200 has 132.
LOW_LATENCY_MAX_WARP_GROUPS = 14
H100_NUM_SMS = 132
#: The attribute a fake module sets for the GPU's SM count (``cudaDeviceProp::multiProcessorCount``).
EMULATED_DEVICE_SMS_ATTRIBUTE = "EMULATED_DEVICE_SMS"
#: The attribute a fake module sets for ``torch.cuda.get_device_name()`` (DeepEP reads it in every V1 constructor).
EMULATED_DEVICE_NAME_ATTRIBUTE = "EMULATED_DEVICE_NAME"
#: The attribute a fake module sets to name the process whose NVSHMEM it emulates (the fakes share one; the real
#: DeepEP has the process's own): the adapter keeps one NVSHMEM Buffer per value. A module that sets it is a fake
#: (``VendorInfo.emulated``: it runs on CPU).
EMULATED_NVSHMEM_ATTRIBUTE = "EMULATED_NVSHMEM"
#: The function a fake module exports for ``torch.cuda.is_current_stream_capturing()`` of its emulated device.
EMULATED_STREAM_CAPTURING_ATTRIBUTE = "emulated_stream_capturing"
#: ``check_nvlink_connections(group)``, first in every V1 constructor: ``if 'PCIE' in torch.cuda.get_device_name():
#: assert group.size() <= 2, 'PCIe GPUs only have pairwise NVLink connections'`` (case-sensitive: A100-PCIE names
#: match, "H100 PCIe" does not) (deepseek-ai/DeepEP@dd758ca deep_ep/utils/envs.py check_nvlink_connections; the
#: message since 9ec0612, 2025-06-11, "No NVLink connection between all GPUs" before).
PCIE_DEVICE_MARKER = "PCIE"
PCIE_MAX_RANKS = 2
PCIE_ASSERT_MESSAGE = "PCIe GPUs only have pairwise NVLink connections"


def device_name(module: Any) -> str | None:
    """``torch.cuda.get_device_name()`` as DeepEP's constructor reads it: a fake's stand-in, else the current CUDA
    device's; None without a GPU (planning)."""
    emulated = getattr(module, EMULATED_DEVICE_NAME_ATTRIBUTE, None)
    if emulated is not None:
        return str(emulated)
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return None


def pcie_pairs_only(name: str | None) -> bool:
    """Whether DeepEP's constructor asserts ``group.size() <= 2`` on this GPU."""
    return name is not None and PCIE_DEVICE_MARKER in name


def nvshmem_domain(module: Any) -> str:
    """Whose NVSHMEM a Buffer of ``module`` starts: the process's (the real DeepEP), or the fakes' emulated one."""
    return str(getattr(module, EMULATED_NVSHMEM_ATTRIBUTE, "process"))



def stream_capturing(module: Any) -> bool:
    """``torch.cuda.is_current_stream_capturing()`` on the device ``module``'s kernels run on (a fake's stand-in)."""
    emulated = getattr(module, EMULATED_STREAM_CAPTURING_ATTRIBUTE, None)
    if emulated is not None:
        return bool(emulated())
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def low_latency_launch_problem(num_experts: int, num_device_sms: int | None) -> str | None:
    """The LL dispatch kernel's launch shape: ``num_warp_groups = ceil(E / device SMs)``, ``num_sms = ceil(E /
    num_warp_groups)``; device asserts ``num_sms > 1`` and ``num_warps_per_group > 1 and num_warp_groups < 15``
    (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode_ll.cu dispatch). Without the SM count only the
    first is checked."""
    if num_experts < 2:
        return "num_sms > 1 (device assert): one expert gives the kernel one SM"
    if num_device_sms is None:
        return None
    groups = -(-num_experts // num_device_sms)
    if not (32 // groups > 1 and groups <= LOW_LATENCY_MAX_WARP_GROUPS):
        return (f"num_warp_groups = ceil({num_experts} / {num_device_sms} SMs) = {groups} warp groups; the kernel "
                f"device-asserts < 15")
    return None


def device_num_sms(module: Any) -> int | None:
    """The SM count DeepEP's LL kernels divide the experts by: a fake's stand-in, else the current CUDA device's."""
    emulated = getattr(module, EMULATED_DEVICE_SMS_ATTRIBUTE, None)
    if emulated is not None:
        return int(emulated)
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    return None

# -- environment variables ------------------------------------------------------------------------------
# The V1 Buffer constructor writes these into os.environ before NVSHMEM starts, whenever it uses NVSHMEM
# (low-latency mode, or more than 8 ranks) (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/legacy.py Buffer.__init__).
NVSHMEM_DISABLE_P2P = "NVSHMEM_DISABLE_P2P"  # '0' if allow_nvlink_for_low_latency_mode else '1'
NVSHMEM_IB_ENABLE_IBGDA = "NVSHMEM_IB_ENABLE_IBGDA"  # '1'
NVSHMEM_IBGDA_NUM_RC_PER_PE = "NVSHMEM_IBGDA_NUM_RC_PER_PE"  # num_qps_per_rank
NVSHMEM_QP_DEPTH = "NVSHMEM_QP_DEPTH"  # read (default '1024') and written back; LL asserts depth >= 2·(T+1)
NVSHMEM_MAX_TEAMS = "NVSHMEM_MAX_TEAMS"  # '7'
NVSHMEM_DISABLE_NVLS = "NVSHMEM_DISABLE_NVLS"  # '1'
NVSHMEM_CUMEM_GRANULARITY = "NVSHMEM_CUMEM_GRANULARITY"  # str(2**29)
NVSHMEM_DISABLE_MNNVL = "NVSHMEM_DISABLE_MNNVL"  # '1' unless allow_mnnvl
# 'gpu', written by DeepEP 21efbe9..e6b4f52~1 (1.1.x, 2025-06/07: deep_ep/buffer.py Buffer.__init__), removed by
# e6b4f52; named so the scoped block puts it back on those builds too.
NVSHMEM_IBGDA_NIC_HANDLER = "NVSHMEM_IBGDA_NIC_HANDLER"
DEFAULT_NVSHMEM_QP_DEPTH = 1024
NVSHMEM_MAX_TEAMS_VALUE = 7
NVSHMEM_CUMEM_GRANULARITY_VALUE = 2**29
NVSHMEM_WRITTEN = (NVSHMEM_DISABLE_P2P, NVSHMEM_IB_ENABLE_IBGDA, NVSHMEM_IBGDA_NUM_RC_PER_PE, NVSHMEM_QP_DEPTH,
                   NVSHMEM_MAX_TEAMS, NVSHMEM_DISABLE_NVLS, NVSHMEM_CUMEM_GRANULARITY, NVSHMEM_DISABLE_MNNVL,
                   NVSHMEM_IBGDA_NIC_HANDLER)


def low_latency_max_tokens(qp_depth: int = DEFAULT_NVSHMEM_QP_DEPTH) -> int:
    """``assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2`` (deepseek-ai/DeepEP@dd758ca
    deep_ep/buffers/legacy.py low_latency_dispatch/low_latency_combine, since @d981409), bounded by the
    dispatch kernel's finish tag (a rank sends fewer than ``LEGACY_FINISHED_SUM_TAG`` = 1024 tokens to one expert,
    csrc/kernels/legacy/compiled.cuh). The hybrid-ep branch has ``FINISHED_SUM_TAG`` 2048
    (deepseek-ai/DeepEP@94a9f8f csrc/kernels/configs.cuh) and no QP-depth assert: this bound is stricter than it
    needs there, never looser."""
    return min(qp_depth // 2 - 1, FINISHED_SUM_TAG - 1)


def qp_depth_from(env: dict[str, str] | Any) -> int:
    """``int(os.environ.get('NVSHMEM_QP_DEPTH', '1024'))``, as the V1 constructor reads it."""
    return int(env.get(NVSHMEM_QP_DEPTH, str(DEFAULT_NVSHMEM_QP_DEPTH)))


# =====================================================================================================
# DeepEP versions
# =====================================================================================================

#: The oldest DeepEP the adapter drives: 21efbe9 (2025-06-12, "Support UE8M0 data format", #206; 1.1.0) added
#: ``round_scale`` and ``use_ue8m0`` to ``Buffer.low_latency_dispatch`` and let normal-mode dispatch take int32 (UE8M0)
#: scales (csrc/deep_ep.cpp: ``x_scales->scalar_type() == torch::kFloat32 or ... == torch::kInt``; float32 only
#: before). Before it every LL dispatch of the adapter would be a ``TypeError`` (unexpected keyword) and normal-mode
#: UE8M0 the kFloat32 host assert; before ed7487c (2025-03-10) ``low_latency_dispatch`` has no ``use_fp8`` either
#: (FP8 only). The floor is read from the installed signature (``missing_ll_dispatch_keywords``), not the version
#: string: 1.1.0 spans both sides (b8d90fb, 9ec0612 before; deepseek-ai/DeepEP@21efbe9 deep_ep/buffer.py).
COMMIT_UE8M0 = "21efbe9"
COMMIT_LL_BF16 = "ed7487c"
#: What the adapter passes to ``low_latency_dispatch`` beyond the positional four (dispatcher.py).
LL_DISPATCH_KEYWORDS = ("use_fp8", "round_scale", "use_ue8m0")


def missing_ll_dispatch_keywords(module: Any) -> tuple[str, ...]:
    """The keywords the adapter passes that the installed ``Buffer.low_latency_dispatch`` lacks (empty from
    21efbe9 on; a DeepEP before it is refused by ``probe()``)."""
    buffer = getattr(module, "Buffer", None)
    if buffer is None or not hasattr(buffer, "low_latency_dispatch"):
        return ()
    try:
        params = inspect.signature(buffer.low_latency_dispatch).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(k for k in LL_DISPATCH_KEYWORDS if k not in params)


def floor_problem(module: Any) -> str | None:
    """Why the installed DeepEP is below the supported floor (``COMMIT_UE8M0``), or None."""
    missing = missing_ll_dispatch_keywords(module)
    if not missing:
        return None
    return (f"this DeepEP's Buffer.low_latency_dispatch has no {', '.join(missing)} (DeepEP 1.0.x and 1.1.0 before "
            f"{COMMIT_UE8M0}, 2025-06-12; no use_fp8 before {COMMIT_LL_BF16}), and its normal mode takes float32 "
            f"scales only: this adapter needs DeepEP from {COMMIT_UE8M0} on (1.1.0 of 2025-06-12 or later)")


#: Every commit of DeepEP main that setup.py calls 1.2.1, oldest first (linear history;
#: ``git log --reverse 3e2c5d8^..567632d``). b306af0 (2026-04-30) starts 2.x.
V121_COMMITS = (
    "3e2c5d8", "ef70b83", "1d3963d", "e9d053c", "9af0e0d", "2012e31", "abba6ad", "c939644", "da6ca24", "c475ec6",
    "d981409", "e02e4d2", "79bbb54", "12a0cc6", "de3a15d", "3f4cf8d", "987f8f0", "4623c67", "73b6ea4", "2be0d4f",
    "bfded34", "9249c25", "92fe2de", "1300811", "b57e5e2", "0a08009", "3fcf25e", "309785a", "29d31c0", "567632d",
)
#: 9af0e0d (2025-09-15) "support topk10 in low latency kernel (#403)": kNumMaxTopK 9 → 11 in
#: csrc/kernels/internode_ll.cu dispatch and combine.
COMMIT_LL_TOPK_11 = "9af0e0d"
#: c939644 (2025-09-22) "Support EP48/96": SWITCH_RDMA_RANKS gains 6 and 12, tuned configs gain 48, 96.
COMMIT_EP48_96 = "c939644"
#: da6ca24 (2025-09-24) "Make dtype of topk_idx configurable": ``deep_ep.topk_idx_t`` appears.
COMMIT_TOPK_IDX_T = "da6ca24"
#: c475ec6 (2025-09-25) elasticity: ``Buffer(enable_shrink=...)``.
COMMIT_ENABLE_SHRINK = "c475ec6"
#: d981409 (2025-09-25) "Check QP_DEPTH for low latency kernels": ``self.nvshmem_qp_depth`` and its assert.
COMMIT_QP_DEPTH_ASSERT = "d981409"
#: e02e4d2 (2025-09-26) "Support EP24 for internode kernels": SWITCH_RDMA_RANKS gains 3 again.
COMMIT_EP24 = "e02e4d2"
#: 73b6ea4 (2025-10-16) "support hidden-dim 3072": SWITCH_HIDDEN gains 3072.
COMMIT_HIDDEN_3072 = "73b6ea4"

LL_MAX_TOPK_BEFORE_9AF0E0D = 9
LL_MAX_TOPK = 11  # deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode_ll.cu dispatch/combine kNumMaxTopK
#: SWITCH_HIDDEN (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/launch.cuh); first commits per size:
#: 2560/5120/7168 @ebfe47e, 4096 @a107266 (2025-05-12), 2048 @7b0c25f (2025-06-20), 8192 @b651635
#: (2025-07-02), 6144 @b92d0d4 (2025-07-29), 3072 @73b6ea4 (2025-10-16).
LOW_LATENCY_HIDDEN_SIZES = frozenset({2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192})
LOW_LATENCY_HIDDEN_SIZES_V12 = LOW_LATENCY_HIDDEN_SIZES - {3072}  # 1.2.x before 73b6ea4; hybrid-ep @94a9f8f
LOW_LATENCY_HIDDEN_SIZES_V11 = frozenset({2560, 4096, 5120, 7168})  # all of 1.1.0 (2025-06-11 .. 09-10)
LOW_LATENCY_HIDDEN_SIZES_V10 = frozenset({2560, 5120, 7168})  # all of 1.0.0
#: SWITCH_RDMA_RANKS (num_ranks / 8) per version (csrc/kernels/launch.cuh, legacy/launch.cuh).
RDMA_RANKS = frozenset({2, 3, 4, 6, 8, 12, 16, 18, 20})  # @e02e4d2 .. @dd758ca
RDMA_RANKS_V12_BEFORE_EP48 = frozenset({2, 4, 8, 16, 18, 20})  # @3e2c5d8 .. c939644~1; hybrid-ep @94a9f8f
RDMA_RANKS_EP48_BEFORE_EP24 = frozenset({2, 4, 6, 8, 12, 16, 18, 20})  # @c939644 .. e02e4d2~1
#: 1.0.0 (@ebfe47e .. a107266, and 1.1.0's first commits b8d90fb .. 7b0c25f).
RDMA_RANKS_V10 = frozenset({2, 3, 4, 8, 16, 18, 20})
#: 1.1.0 as a whole: bc118b2 (2025-06-24) .. b92d0d4 have {2, 4, 8, 16}; d9767ce (2025-08-11) brings back 18 and
#: 20; 3 returns only with e02e4d2 (1.2.1). The intersection is the safe set (csrc/kernels/launch.cuh per commit).
RDMA_RANKS_V11 = frozenset({2, 4, 8, 16})

#: ``Buffer.get_dispatch_config`` / ``get_combine_config``: (nvl send, nvl recv, rdma send, rdma recv)
#: chunk sizes per EP size, with ``Buffer.num_sms`` SMs (deepseek-ai/DeepEP@dd758ca
#: deep_ep/buffers/legacy.py; the same since @e02e4d2).
TUNED_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                  24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                  96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
TUNED_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                 24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                 96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
#: The tables before @c939644 (1.2.1 up to 2025-09-21) and on the hybrid-ep branch @94a9f8f (deep_ep/buffer.py).
TUNED_DISPATCH_BEFORE_EP48 = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
                              16: (36, 288, 20, 128), 24: (8, 288, 32, 128), 32: (32, 288, 32, 128),
                              64: (20, 288, 28, 128), 128: (20, 560, 32, 128), 144: (32, 720, 12, 128),
                              160: (28, 720, 12, 128)}
TUNED_COMBINE_BEFORE_EP48 = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
                             16: (4, 288, 12, 128), 24: (1, 288, 8, 128), 32: (1, 288, 8, 128),
                             64: (1, 288, 20, 128), 128: (1, 560, 12, 128), 144: (2, 720, 8, 128),
                             160: (2, 720, 8, 128)}
#: 1.0.0 (@ebfe47e deep_ep/buffer.py): ``if num_ranks <= 8: return Config(Buffer.num_sms, 6, 256, 6, 128)`` (any
#: R up to 8, both directions), then these.
TUNED_DISPATCH_V10 = {**{n: (6, 256, 6, 128) for n in range(1, 9)}, 16: (16, 288, 20, 128), 24: (8, 288, 32, 128),
                      32: (8, 288, 32, 128), 64: (20, 288, 28, 128), 128: (20, 560, 32, 128),
                      144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
TUNED_COMBINE_V10 = {**{n: (6, 256, 6, 128) for n in range(1, 9)}, 16: (2, 288, 28, 128), 24: (1, 288, 20, 128),
                     32: (1, 288, 20, 128), 64: (1, 288, 20, 128), 128: (1, 560, 12, 128), 144: (2, 720, 8, 128),
                     160: (2, 720, 8, 128)}
#: 1.1.0 from b8d90fb (2025-06) up to d9767ce~1 (2025-08-10); from d9767ce 1.1.x has the ``*_BEFORE_EP48`` tables.
TUNED_DISPATCH_V11_EARLY = {**TUNED_DISPATCH_V10, 2: (24, 256, 6, 128)}
for _n in (1, 3, 5, 6, 7):
    del TUNED_DISPATCH_V11_EARLY[_n]
TUNED_COMBINE_V11_EARLY = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
                           **{n: c for n, c in TUNED_COMBINE_V10.items() if n > 8}}
#: The EP sizes to probe the installed DeepEP's ``get_dispatch_config`` with.
CANDIDATE_EP_SIZES = tuple(sorted(set(TUNED_DISPATCH) | set(TUNED_DISPATCH_BEFORE_EP48)))


_ALL_TUNED_TABLES = ((TUNED_DISPATCH, TUNED_COMBINE), (TUNED_DISPATCH_BEFORE_EP48, TUNED_COMBINE_BEFORE_EP48),
                     (TUNED_DISPATCH_V11_EARLY, TUNED_COMBINE_V11_EARLY), (TUNED_DISPATCH_V10, TUNED_COMBINE_V10))


def normal_world_sizes(rdma_ranks: frozenset[int], tuned: dict[int, Any]) -> frozenset[int]:
    """EP sizes with a tuned config and a compiled kernel (intranode 2/4/8, internode 8·RDMA ranks)."""
    kernels = set(INTRANODE_RANKS) | {NUM_MAX_NVL_PEERS * r for r in rdma_ranks}
    return frozenset(n for n in tuned if n in kernels)


@dataclass(frozen=True)
class DeepEPRelease:
    """What the installed DeepEP is, as far as this adapter's limits differ between releases.

    ``line``: "2.x" (main since b306af0), "1.x" (deep_ep/buffer.py), "hybrid-ep" (the branch), or
    "unknown". Every limit is the *safe* one for the range the detection could narrow it to.
    """

    line: str
    version: str | None
    ll_max_topk: int
    ll_hidden_sizes: frozenset[int]
    rdma_ranks: frozenset[int]
    tuned_dispatch: dict[int, tuple[int, int, int, int]] = field(default_factory=dict, compare=False, repr=False)
    reason: str = ""
    #: ``check_torch_deterministic()`` first in every dispatch/combine (2.x, deep_ep/utils/envs.py, b306af0).
    checks_deterministic: bool = False
    #: The LL signalling counts move with E only (from 42253d0; ``ll_clean_key``); False: with T, hidden and E.
    ll_clean_by_experts: bool = True
    #: (dispatch, combine) tuned tables this release may have (``Buffer.get_*_config``): one, or several where the
    #: release string cannot tell the builds apart (what the hardware check compares the installed getters with).
    tuned_tables: tuple = field(default=(), compare=False, repr=False)

    @property
    def world_sizes(self) -> frozenset[int]:
        return normal_world_sizes(self.rdma_ranks, self.tuned_dispatch)


def _commit_of(version: str | None) -> str | None:
    match = re.search(r"\+([0-9a-f]{7,40})", version or "")
    return match.group(1)[:7] if match else None


def _at_or_after(commit: str | None, milestone: str) -> bool | None:
    """Whether a 1.2.1 commit includes ``milestone`` (None: not a known 1.2.1 commit)."""
    if commit is None or commit not in V121_COMMITS:
        return None
    return V121_COMMITS.index(commit) >= V121_COMMITS.index(milestone)


def deep_ep_version(module: ModuleType) -> str | None:
    """``deep_ep.__version__`` (2.x, and the fakes), else the distribution's version (1.x and hybrid-ep
    builds: ``1.2.1+<commit>`` from a git checkout; deepseek-ai/DeepEP@e9d053c setup.py)."""
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    try:
        return importlib.metadata.version(REAL)
    except importlib.metadata.PackageNotFoundError:
        return None


def release_of(module: ModuleType) -> DeepEPRelease:
    """The release rules for an imported DeepEP (or fake)."""
    version = deep_ep_version(module)
    major = version.split(".")[0] if version else None
    buffer = getattr(module, "Buffer", None)
    nvfp4 = buffer is not None and "use_nvfp4" in inspect.signature(buffer.low_latency_dispatch).parameters
    if nvfp4 or hasattr(module, "HybridEPBuffer"):
        # Branched from main @abba6ad (after 9af0e0d, before c939644); deepseek-ai/DeepEP@94a9f8f.
        return DeepEPRelease("hybrid-ep", version, LL_MAX_TOPK, LOW_LATENCY_HIDDEN_SIZES_V12,
                             RDMA_RANKS_V12_BEFORE_EP48, TUNED_DISPATCH_BEFORE_EP48,
                             "hybrid-ep branch (low_latency_dispatch takes use_nvfp4)",
                             tuned_tables=((TUNED_DISPATCH_BEFORE_EP48, TUNED_COMBINE_BEFORE_EP48),))
    if major is not None and major.isdigit() and int(major) >= 2:
        return DeepEPRelease("2.x", version, LL_MAX_TOPK, LOW_LATENCY_HIDDEN_SIZES, RDMA_RANKS, TUNED_DISPATCH,
                             f"DeepEP {version}", checks_deterministic=True,
                             tuned_tables=((TUNED_DISPATCH, TUNED_COMBINE),))
    commit = _commit_of(version)
    base = (version or "").split("+")[0]
    if base.startswith("1.0"):
        return DeepEPRelease("1.x", version, LL_MAX_TOPK_BEFORE_9AF0E0D, LOW_LATENCY_HIDDEN_SIZES_V10,
                             RDMA_RANKS_V10, TUNED_DISPATCH_BEFORE_EP48, f"DeepEP {version}",
                             ll_clean_by_experts=False, tuned_tables=((TUNED_DISPATCH_V10, TUNED_COMBINE_V10),))
    if base.startswith("1.1"):  # 42253d0 and d9767ce fall inside 1.1.0: either side
        return DeepEPRelease("1.x", version, LL_MAX_TOPK_BEFORE_9AF0E0D, LOW_LATENCY_HIDDEN_SIZES_V11,
                             RDMA_RANKS_V11, TUNED_DISPATCH_BEFORE_EP48, f"DeepEP {version}",
                             ll_clean_by_experts=False, tuned_tables=(
                                 (TUNED_DISPATCH_V11_EARLY, TUNED_COMBINE_V11_EARLY),
                                 (TUNED_DISPATCH_BEFORE_EP48, TUNED_COMBINE_BEFORE_EP48)))
    if base.startswith("1.2"):
        topk11 = _at_or_after(commit, COMMIT_LL_TOPK_11)
        if topk11 is None and hasattr(module, "topk_idx_t"):
            topk11 = True  # topk_idx_t arrived with da6ca24, after 9af0e0d
        ep48, ep24 = _at_or_after(commit, COMMIT_EP48_96), _at_or_after(commit, COMMIT_EP24)
        rdma = (RDMA_RANKS if ep24 else RDMA_RANKS_EP48_BEFORE_EP24 if ep48 else RDMA_RANKS_V12_BEFORE_EP48)
        hidden = LOW_LATENCY_HIDDEN_SIZES if _at_or_after(commit, COMMIT_HIDDEN_3072) else LOW_LATENCY_HIDDEN_SIZES_V12
        how = f"commit {commit}" if commit in V121_COMMITS else "commit unknown: the safe bounds of 1.2.x"
        tables = (((TUNED_DISPATCH, TUNED_COMBINE),) if ep48 else
                  ((TUNED_DISPATCH_BEFORE_EP48, TUNED_COMBINE_BEFORE_EP48),) if ep48 is False else _ALL_TUNED_TABLES)
        return DeepEPRelease("1.x", version, LL_MAX_TOPK if topk11 else LL_MAX_TOPK_BEFORE_9AF0E0D, hidden, rdma,
                             TUNED_DISPATCH if ep48 else TUNED_DISPATCH_BEFORE_EP48, f"DeepEP {version} ({how})",
                             tuned_tables=tables)
    return DeepEPRelease("unknown", version, LL_MAX_TOPK_BEFORE_9AF0E0D, LOW_LATENCY_HIDDEN_SIZES_V10,
                         RDMA_RANKS_V11, TUNED_DISPATCH_BEFORE_EP48,
                         f"DeepEP version {version!r} unknown: the safe bounds", ll_clean_by_experts=False,
                         tuned_tables=_ALL_TUNED_TABLES)


#: Planning without DeepEP installed: the newest release (main @ dd758ca).
PLANNING_RELEASE = DeepEPRelease("2.x", None, LL_MAX_TOPK, LOW_LATENCY_HIDDEN_SIZES, RDMA_RANKS, TUNED_DISPATCH,
                                 "DeepEP not installed: planning with main @ dd758ca", checks_deterministic=True,
                                 tuned_tables=((TUNED_DISPATCH, TUNED_COMBINE),))


@dataclass(frozen=True)
class VendorInfo:
    """The DeepEP found: its module (None when missing), API generations, features and release."""

    module_name: str
    module: ModuleType | None
    error: str | None
    has_v1_buffer: bool = False
    has_elastic_buffer: bool = False
    has_nvfp4: bool = False
    emulated: bool = False
    release: DeepEPRelease = PLANNING_RELEASE

    def describe(self) -> str:
        if self.module is None:
            return f"{self.module_name} is not importable ({self.error})"
        apis = [n for n, ok in (("V1 Buffer", self.has_v1_buffer), ("V2 ElasticBuffer", self.has_elastic_buffer)) if ok]
        what = "emulated DeepEP" if self.emulated else "DeepEP"
        found = ", ".join(apis) or "no known buffer API"
        return (f"{what} {self.release.version or ''} ({self.release.line}): {found}; "
                f"NVFP4 low-latency dispatch: {'yes' if self.has_nvfp4 else 'no'}").replace("  ", " ")


def detect(module_name: str = REAL) -> VendorInfo:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
        return VendorInfo(module_name, None, f"{type(exc).__name__}: {exc}")
    buffer = getattr(module, "Buffer", None)
    nvfp4 = False
    if buffer is not None and hasattr(buffer, "low_latency_dispatch"):
        # The hybrid-ep branch adds use_nvfp4 / x_global_scale to low_latency_dispatch.
        nvfp4 = "use_nvfp4" in inspect.signature(buffer.low_latency_dispatch).parameters
    return VendorInfo(module_name, module, None, has_v1_buffer=buffer is not None,
                      has_elastic_buffer=hasattr(module, "ElasticBuffer"), has_nvfp4=nvfp4,
                      emulated=hasattr(module, EMULATED_NVSHMEM_ATTRIBUTE), release=release_of(module))


def topk_idx_dtype(module: ModuleType | None) -> torch.dtype:
    """``deep_ep.topk_idx_t`` (int64 unless built with ``EP_NUM_TOPK_IDX_BITS=32``; deepseek-ai/DeepEP@dd758ca
    deep_ep/__init__.py, csrc/python_api.cpp); int64 before @da6ca24 and on hybrid-ep, which assert kInt64."""
    dtype = getattr(module, "topk_idx_t", None) if module is not None else None
    return dtype if isinstance(dtype, torch.dtype) else torch.int64


# =====================================================================================================
# DeepEP sizes: the ported formulas (fallback) and the wrappers that call the installed DeepEP
# =====================================================================================================


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ConfigFields:
    """The five numbers of DeepEP's ``Config`` (deepseek-ai/DeepEP@dd758ca csrc/legacy/config.hpp), for
    planning without DeepEP and for ``options={"dispatch_config": ConfigFields(...)}``. The vendor's
    ``Config`` exposes none of them as attributes; ``to_vendor`` builds it.

    ``num_max_rdma_chunked_recv_tokens`` is the value as given; DeepEP rounds it up to a multiple of the
    RDMA send chunk (``rdma_recv``)."""

    num_sms: int = DEFAULT_NUM_SMS
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens)

    @property
    def rdma_recv(self) -> int:
        return _align(self.num_max_rdma_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens)

    def problems(self) -> list[str]:
        """The constructor's ``EP_HOST_ASSERT``s that fail (Config::Config)."""
        s, ns, nr, rs = self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens, \
            self.num_max_rdma_chunked_send_tokens
        checks = [(s >= 0, "num_sms >= 0"),
                  (ns > 0 and nr > 0, "num_max_nvl_chunked_send_tokens > 0 and num_max_nvl_chunked_recv_tokens > 0"),
                  (ns < nr, "num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens"),
                  (rs > 0 and self.num_max_rdma_chunked_recv_tokens > 0,
                   "num_max_rdma_chunked_send_tokens > 0 and num_max_rdma_chunked_recv_tokens > 0")]
        if all(ok for ok, _ in checks):
            checks += [(rs < self.rdma_recv, "num_max_rdma_chunked_send_tokens < num_max_rdma_chunked_recv_tokens"),
                       (rs <= self.rdma_recv // 2,
                        "num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens / 2")]
        return [text for ok, text in checks if not ok]

    def internode_problems(self, num_ranks: int) -> list[str]:
        """What ``internode::combine`` asserts of this config past 8 ranks (empty within a node)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return []
        return internode_combine_config_problems(self.num_sms, self.num_max_nvl_chunked_send_tokens,
                                                 self.num_max_nvl_chunked_recv_tokens,
                                                 self.num_max_rdma_chunked_send_tokens, num_ranks)

    def to_vendor(self, module: ModuleType) -> Any:
        return module.Config(*self.as_tuple())


def ported_nvl_buffer_size_hint(config: ConfigFields, hidden_bytes: int, num_ranks: int,
                                topk_idx_bytes: int = 8) -> int:
    """``Config::get_nvl_buffer_size_hint`` (deepseek-ai/DeepEP@dd758ca csrc/legacy/config.hpp; unchanged since
    @ebfe47e csrc/config.hpp, where the top-k index was always 8 bytes). Raises ValueError where DeepEP's
    ``EP_HOST_ASSERT`` fails."""
    if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
        raise ValueError("num_ranks < LEGACY_NUM_MAX_NVL_PEERS or num_ranks % LEGACY_NUM_MAX_NVL_PEERS == 0")
    if not (num_ranks <= NUM_MAX_NVL_PEERS or config.num_sms % 2 == 0):
        raise ValueError("num_ranks <= LEGACY_NUM_MAX_NVL_PEERS or num_sms % 2 == 0")
    rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
    nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
    slots = (config.num_sms // 2) * nvl_ranks
    per_token = (hidden_bytes + SOURCE_META_BYTES + HINT_RESERVED_TOPK * topk_idx_bytes + HINT_RESERVED_TOPK * 4
                 + HINT_RESERVED_SCALES * 4)
    total = slots * (2 * rdma_ranks + 3) * 4 + slots * config.num_max_nvl_chunked_recv_tokens * per_token
    return _align(total, 128)


def ported_rdma_buffer_size_hint(config: ConfigFields, hidden_bytes: int, num_ranks: int,
                                 topk_idx_bytes: int = 8) -> int:
    """``Config::get_rdma_buffer_size_hint`` (same sources): zero up to 8 ranks; each term twice (send and
    receive), the last one an int4 per token. No constant is added on any main commit (checked back to
    @ebfe47e); an earlier port here added 1 MiB."""
    if num_ranks <= NUM_MAX_NVL_PEERS:
        return 0
    if num_ranks % NUM_MAX_NVL_PEERS or config.num_sms % 2:
        raise ValueError("num_ranks % LEGACY_NUM_MAX_NVL_PEERS == 0 and num_sms % 2 == 0")
    slots = (config.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS)
    per_token = (hidden_bytes + SOURCE_META_BYTES + HINT_RESERVED_TOPK * topk_idx_bytes + HINT_RESERVED_TOPK * 4
                 + HINT_RESERVED_SCALES * 4 + 16)
    total = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + slots * config.rdma_recv * per_token * 2
    return _align(total, 128)


@dataclass(frozen=True)
class LowLatencyLayout:
    """``LowLatencyLayout`` (deepseek-ai/DeepEP@dd758ca csrc/legacy/config.hpp): odd/even send, receive and
    signalling buffers in one RDMA region. Message sizes: an int4 header plus the larger of BF16 and
    FP8 + fp32 scales (dispatch); per-128-channel min/max plus BF16 (combine)."""

    dispatch_msg_bytes: int
    combine_msg_bytes: int
    send_bytes: int
    recv_bytes: int
    signaling_bytes: int
    dispatch_bytes: int  # what dispatch alone would need (both halves)
    combine_bytes: int  # what combine alone would need (both halves)

    @classmethod
    def build(cls, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> "LowLatencyLayout":
        t, h, e = num_max_dispatch_tokens_per_rank, hidden, num_experts
        scales = h // 128
        dispatch_msg = 16 + max(2 * h, h + 4 * scales)
        combine_msg = 4 * scales + 2 * h
        send = max(t * dispatch_msg, e * t * combine_msg)
        recv = max(e * t * dispatch_msg, e * t * combine_msg)
        signaling = _align(e * 4, 128)
        return cls(dispatch_msg, combine_msg, send, recv, signaling,
                   dispatch_bytes=2 * (t * dispatch_msg + e * t * dispatch_msg + signaling),
                   combine_bytes=2 * (e * t * combine_msg + e * t * combine_msg + signaling))

    @property
    def total_bytes(self) -> int:
        return 2 * self.send_bytes + 2 * self.recv_bytes + 2 * self.signaling_bytes


def ported_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                      num_experts: int) -> int:
    """``get_low_latency_rdma_size_hint`` (same file): ``num_ranks`` does not enter; rounded with
    ``(n + 128) / 128 * 128``, which adds 128 bytes to an already aligned size."""
    total = LowLatencyLayout.build(num_max_dispatch_tokens_per_rank, hidden, num_experts).total_bytes
    return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES


def tuned_config_fields(table: dict[int, tuple[int, int, int, int]], num_ranks: int,
                        num_sms: int = DEFAULT_NUM_SMS) -> ConfigFields | None:
    chunks = table.get(num_ranks)
    return None if chunks is None else ConfigFields(num_sms, *chunks)


def _installed_buffer(module: ModuleType | None) -> Any:
    return getattr(module, "Buffer", None) if module is not None else None


def dispatch_config(module: ModuleType | None, num_ranks: int) -> Any:
    """The tuned dispatch config: the installed DeepEP's ``Buffer.get_dispatch_config(num_ranks)`` (a vendor
    ``Config``, with the class-level ``Buffer.num_sms``), else the ported ``ConfigFields`` (planning). None
    where there is no tuned config (DeepEP asserts 'Unsupported number of EP ranks')."""
    buffer = _installed_buffer(module)
    if buffer is None:
        return tuned_config_fields(TUNED_DISPATCH, num_ranks)
    try:
        return buffer.get_dispatch_config(num_ranks)
    except AssertionError:
        return None


def combine_config(module: ModuleType | None, num_ranks: int) -> Any:
    """As ``dispatch_config``, with ``Buffer.get_combine_config``."""
    buffer = _installed_buffer(module)
    if buffer is None:
        return tuned_config_fields(TUNED_COMBINE, num_ranks)
    try:
        return buffer.get_combine_config(num_ranks)
    except AssertionError:
        return None


def nvl_buffer_size_hint(config: Any, hidden_bytes: int, num_ranks: int) -> int:
    """The vendor ``Config``'s own ``get_nvl_buffer_size_hint`` (positional pybind arguments), or the port."""
    if isinstance(config, ConfigFields):
        return ported_nvl_buffer_size_hint(config, hidden_bytes, num_ranks)
    return int(config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))


def rdma_buffer_size_hint(config: Any, hidden_bytes: int, num_ranks: int) -> int:
    if isinstance(config, ConfigFields):
        return ported_rdma_buffer_size_hint(config, hidden_bytes, num_ranks)
    return int(config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))


def low_latency_rdma_size_hint(module: ModuleType | None, num_max_dispatch_tokens_per_rank: int, hidden: int,
                               num_ranks: int, num_experts: int) -> int:
    """``Buffer.get_low_latency_rdma_size_hint`` of the installed DeepEP, else the port."""
    buffer = _installed_buffer(module)
    if buffer is None:
        return ported_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return int(buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                     num_experts))


def supported_world_sizes(module: ModuleType | None, release: DeepEPRelease) -> frozenset[int]:
    """EP sizes the installed DeepEP has a tuned config *and* a kernel for (probing its getters)."""
    if _installed_buffer(module) is None:
        return release.world_sizes
    kernels = normal_world_sizes(release.rdma_ranks, {n: None for n in CANDIDATE_EP_SIZES})
    return frozenset(n for n in kernels if dispatch_config(module, n) is not None)


# =====================================================================================================
# DeepGEMM
# =====================================================================================================

# deepseek-ai/DeepGEMM@54e2261 csrc/apis/gemm.hpp register_apis (2.x names; the fp8 names are aliases of
# m_grouped_fp8_fp4_gemm_*); deep_gemm/__init__.py re-exports them, plus the legacy alias
# fp8_m_grouped_gemm_nt_masked. BF16 grouped GEMMs are 2.x only.
DG_FP8_CONTIGUOUS = "m_grouped_fp8_gemm_nt_contiguous"
DG_FP8_MASKED = "m_grouped_fp8_gemm_nt_masked"
#: The masked GEMM's name in PR #112 (9da4a23: its only name, deepseek-ai/DeepGEMM@9da4a23 csrc/python_api.cpp), an
#: alias from f85ec64 (2025-08-15, still 2.0.0) on; no contiguous alias ever existed (``git log --all -S
#: fp8_m_grouped_gemm_nt_contiguous``: no hit).
DG_FP8_MASKED_ALIAS = "fp8_m_grouped_gemm_nt_masked"
#: BF16 grouped GEMMs from f85ec64 (2025-08-15, "Add BF16 support for SM90 and SM100"); 2.0.0 builds before it have
#: none (and no ``m_grouped_fp8_gemm_nt_masked`` name).
DG_BF16_CONTIGUOUS = "m_grouped_bf16_gemm_nt_contiguous"
DG_BF16_MASKED = "m_grouped_bf16_gemm_nt_masked"
COMMIT_DG_BF16 = "f85ec64"
DG_MK_ALIGNMENT = "get_mk_alignment_for_contiguous_layout"  # deep_gemm/utils/layout.py re-export of _C
#: Settable from 2.4.2 (7f2a703; ``git log -S set_mk_alignment_for_contiguous_layout``).
DG_SET_MK_ALIGNMENT = "set_mk_alignment_for_contiguous_layout"
DG_SET_MK_ALIGNMENT_VERSION = (2, 4, 2)
#: Layout helpers (deepseek-ai/DeepGEMM@54e2261 csrc/apis/layout.hpp register_apis; deep_gemm/utils/layout.py):
#: ``get_tma_aligned_size(x, element_size)``, ``get_mn_major_tma_aligned_tensor(sf)`` (fp32 only, asserts kFloat),
#: ``get_mn_major_tma_aligned_packed_ue8m0_tensor(sf, psum_layout=None)`` (fp32 in, packed int32 out; ``py::arg``
#: only from 2.6.1: before it, from 9da4a23 on, bound without names as ``(arg0, /)``).
DG_TMA_ALIGNED_SIZE = "get_tma_aligned_size"
DG_MN_MAJOR_TMA_ALIGNED = "get_mn_major_tma_aligned_tensor"
DG_MN_MAJOR_PACKED_UE8M0 = "get_mn_major_tma_aligned_packed_ue8m0_tensor"
# deepseek-ai/DeepGEMM@0c88cd0 deep_gemm/jit_kernels/m_grouped_gemm.py (v1; same names @b05ed2f = PyPI 1.0.0)
#: Its scheduler takes a block's group from the block's first ``m_indices`` entry: -1 there (alignment padding, a
#: worst case's tail) is an illegal address before #113 (@b05ed2f deep_gemm/include/deep_gemm/scheduler.cuh:64),
#: ``max(0, ...)`` from it (@0c88cd0 scheduler.cuh:119). No Python name tells the builds apart, so the adapter
#: clamps the indices on the host for every v1 (the rows it computes there are padding, never read). The builds
#: with #113 then compute the padding blocks they would skip (8dfa329's is_computation_valid): speed, not results.
DG_V1_CONTIGUOUS = "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"
DG_V1_MASKED = "m_grouped_gemm_fp8_fp8_bf16_nt_masked"
DG_V1_ALIGNMENT = "get_m_alignment_for_contiguous_layout"
DG_V1_TMA_ALIGNED = "get_col_major_tma_aligned_tensor"
DG_V2_CONTIGUOUS_NAMES = (DG_FP8_CONTIGUOUS,)
DG_V2_MASKED_NAMES = (DG_FP8_MASKED, DG_FP8_MASKED_ALIAS)
DG_ALIGNMENT_NAMES = (DG_MK_ALIGNMENT, DG_V1_ALIGNMENT)

#: ``kLegacyMKAlignmentForContiguousLayout`` (deepseek-ai/DeepGEMM@54e2261 csrc/jit_kernels/heuristics/
#: runtime.hpp); v1 ``get_m_alignment_for_contiguous_layout`` returns 128 too. Settable from 2.4.2 (7f2a703).
DG_DEFAULT_MK_ALIGNMENT = 128
DG_BLOCK = 128
#: ``get_tma_aligned_size``: the MN axis of an MN-major scale tensor padded to 16 bytes
#: (deepseek-ai/DeepGEMM@54e2261 csrc/utils/math.hpp; v1 deep_gemm/jit_kernels/utils.py).
TMA_ALIGNMENT_BYTES = 16
#: v1's masked grouped GEMM: "For masked grouped GEMM, shape M should be multiple of the block M" when
#: num_groups > 1 and M > block_m (deepseek-ai/DeepGEMM@0c88cd0 m_grouped_gemm.py, since @6da94d2), block_m
#: chosen by get_best_configs from (64, 128, 256) (@0c88cd0 deep_gemm/jit_kernels/gemm.py; @b05ed2f = PyPI
#: 1.0.0 picks from (64, 128) and has no such assert).
DG_V1_MASKED_BLOCK_MS = (64, 128, 256)
DG_V1_PYPI_MASKED_BLOCK_MS = (64, 128)
#: The masked GEMM's BLOCK_M candidates in 2.x: {64, 128, 256} up to 79f48ee~1 (2.0.0), {64, 128} from 79f48ee
#: (2025-09-12, #193, "// Exclude 256 for performance", csrc/jit_kernels/heuristics/common.hpp; still 2.0.0), and
#: from 2.4.2 (7f2a703) on SM100 only ``get_mk_alignment_for_contiguous_layout()`` (heuristics/sm100.hpp
#: get_layout_candidates), on SM90 {64, 128} (heuristics/sm90.hpp). 2.0.0 and 2.1.0 (594953a) report no
#: ``__version__`` (it arrives in 93b3c28, 2.1.1): both are held to {64, 128, 256}, the safe side.
DG_MASKED_BLOCK_MS_2_0 = frozenset({64, 128, 256})
DG_MASKED_BLOCK_MS = frozenset({64, 128})
DG_MASKED_SM100_MK_VERSION = (2, 4, 2)
#: v1's fp8_gemm.cuh before 6c5da03 (2025-02-28; so PyPI 1.0.0 @ b05ed2f): ``DG_STATIC_ASSERT(not
#: kMustUseUniformedScaleB or SHAPE_K_SCALES % 2 == 0, "Misaligned barriers")``, kMustUseUniformedScaleB =
#: ``BLOCK_K % BLOCK_N == 0``: an odd ceil(K/128) fails to compile whenever the heuristic picks a BLOCK_N dividing
#: 128. No version string tells the builds apart; ``wgrad_gemm_fp8_fp8_fp32_nt`` (04278f6, 2025-05-14, after the
#: fix) marks a v1 known to compile them.
DG_V1_ODD_K_FIXED_MARKER = "wgrad_gemm_fp8_fp8_fp32_nt"
#: TMA descriptors (``cuTensorMapEncodeTiled``) need every global stride a multiple of 16 bytes; DeepGEMM encodes
#: the operands' row strides as they are and raises its "CUDA driver" DGException otherwise
#: (deepseek-ai/DeepGEMM@54e2261 csrc/jit_kernels/impls/runtime_utils.hpp make_tma_2d_desc).
TMA_STRIDE_BYTES = 16
#: DeepGEMM 2.x ``__version__`` from which the SM100 fp32 → UE8M0 scale cast device-asserts that every
#: scale is a power of two (``(bits & 0x807fffff) == 0``, deepseek-ai/DeepGEMM@54e2261
#: deep_gemm/include/deep_gemm/impls/smxx_layout.cuh, introduced by 54e2261 "#364"). Before it the CUDA cast packs
#: ``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 << 1`` without a mask (@88965b0, the same from @9da4a23): a non-power of two
#: brings its mantissa bits into the other bytes (garbage exponents); only the PyTorch fallback
#: (``get_mn_major_tma_aligned_packed_ue8m0_tensor_torch``) keeps ``bits >> 23``.
DG_POW2_ASSERT_VERSION = (2, 6, 1)
#: ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` takes ``py::arg("sf"), py::arg("psum_layout")`` from 2.6.1
#: (deepseek-ai/DeepGEMM@54e2261 csrc/apis/layout.hpp); before (@0f5f266, @7f2a703, @88965b0; @9da4a23
#: csrc/python_api.cpp) ``m.def`` with no ``py::arg``: one positional argument.
DG_PACKED_UE8M0_PY_ARGS_VERSION = (2, 6, 1)
#: DeepGEMM's JIT takes the CUDA root from ``CUDA_HOME`` or ``CUDA_PATH``, else from the grandparent of ``which nvcc``,
#: else /usr/local/cuda, once, at import (deepseek-ai/DeepGEMM@54e2261 deep_gemm/__init__.py:104-125 ``_find_cuda_home``,
#: ``_C.init``); it runs ``<root>/bin/nvcc`` and ``<root>/bin/cuobjdump`` (csrc/jit/compiler.hpp:35, 196), and NVRTC
#: includes ``<root>/include`` (:266). An nvcc that is a link or wrapper in /usr/local/bin makes that root /usr/local.
DG_CUDA_HOME_VARIABLES = ("CUDA_HOME", "CUDA_PATH")
#: NVRTC instead of NVCC (csrc/jit/compiler.hpp:354-360), the kernel cache (``$HOME/.deep_gemm`` by default, :49-51) and
#: the JIT's log (:58, 154, 223): DeepGEMM's environment, read when its compiler is first made (a ``LazyInit``, :354).
DG_JIT_USE_NVRTC, DG_JIT_CACHE_DIR, DG_JIT_DEBUG = "DG_JIT_USE_NVRTC", "DG_JIT_CACHE_DIR", "DG_JIT_DEBUG"
#: ``deep_gemm.__version__`` exists from 2.1.1 (93b3c28); 2.0.0 and 2.1.0 (594953a) have none.
DG_FIRST_VERSION_ATTRIBUTE = (2, 1, 1)
#: Compute-capability majors with grouped GEMMs: 9 (SM90: fp32 scales) and 10 (SM100: packed UE8M0).
DG_ARCH_SM90, DG_ARCH_SM100 = 9, 10


def tma_aligned_size(mn: int, element_size: int) -> int:
    """``get_tma_aligned_size(x, element_size)``: ``x`` rounded up to 16 bytes' worth of elements (the port)."""
    return _align(mn, TMA_ALIGNMENT_BYTES // element_size)


def dg_tma_aligned_size(module: Any, mn: int, element_size: int) -> int:
    """The installed DeepGEMM's ``get_tma_aligned_size`` (2.x), else the port (v1 keeps it in jit_kernels.utils,
    planning has none)."""
    fn = getattr(module, DG_TMA_ALIGNED_SIZE, None) if module is not None else None
    return int(fn(mn, element_size)) if fn is not None else tma_aligned_size(mn, element_size)


def ported_mn_major(t: torch.Tensor, aligned: int) -> torch.Tensor:
    """``[..., MN, K]`` → the same values MN-major with an MN stride of ``aligned``, groups dense: the layout
    ``get_mn_major_tma_aligned_tensor`` gives and DeepGEMM's SM100 kernels require of packed UE8M0 scales."""
    mn, k = t.shape[-2], t.shape[-1]
    out = torch.zeros(*t.shape[:-2], k, aligned, dtype=t.dtype, device=t.device).transpose(-1, -2)[..., :mn, :]
    out.copy_(t)
    return out


def is_mn_major_tma_aligned(module: Any, sf: torch.Tensor) -> bool:
    """MN-major, the MN stride TMA-aligned, groups dense: the layout ``get_mn_major_tma_aligned_tensor`` returns as it
    is (deepseek-ai/DeepGEMM@54e2261 csrc/jit_kernels/impls/smxx_layout.hpp:123-125; the same test in every 2.x, @9da4a23
    :101, @0f5f266 :117; v1's ``get_col_major_tma_aligned_tensor``, @0c88cd0 deep_gemm/jit_kernels/utils.py:94-103), which
    also passes ``check_sf_layout(..., tma_stride_check=true)`` (@54e2261 csrc/utils/layout.hpp:101-106, SM100's check
    of packed scales)."""
    mn, k = sf.shape[-2], sf.shape[-1]
    aligned = dg_tma_aligned_size(module, mn, sf.element_size())
    dense = sf.dim() == 2 or sf.stride(-3) == aligned * k
    return dense and sf.stride(-2) == 1 and sf.stride(-1) == aligned


def dg_mn_major(module: Any, sf: torch.Tensor) -> torch.Tensor:
    """``sf`` (fp32, or packed UE8M0 int32) MN-major and TMA-aligned, laid out with torch ops (the port, with DeepGEMM's
    aligned size) unless it already is. SM90's transform of fp32 activation scales then returns them as they are
    (deepseek-ai/DeepGEMM@54e2261 csrc/apis/layout.hpp:41-42 → ``is_mn_major_tma_aligned``); given them row-major it
    JIT-compiles and launches its ``transpose_fp32`` kernel (csrc/jit_kernels/impls/smxx_layout.hpp:135-150; a torch
    ``copy_`` for a non-contiguous tensor, :131-134), the first kernel of the runner's first call when that call
    segfaulted on the H100 (docs/evidence/vendor-notes/deepgemm-segfault-hypotheses.md). DeepGEMM's own
    ``get_mn_major_tma_aligned_tensor`` is that same code, so it is not called here."""
    if is_mn_major_tma_aligned(module, sf):
        return sf
    return ported_mn_major(sf, dg_tma_aligned_size(module, sf.shape[-2], sf.element_size()))


def ported_packed_ue8m0_mn_major(sf: torch.Tensor, module: Any = None) -> torch.Tensor:
    """fp32 powers of two ``[..., MN, K/128]`` → int32 ``[..., MN, ceil(K/512)]``: the exponent bytes (``bits >>
    23``), four per word, the first in the low byte, laid out MN-major and TMA-aligned (the port of
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor``'s PyTorch path, csrc/jit_kernels/impls/smxx_layout.hpp)."""
    k = sf.shape[-1]
    exps = (sf.float().contiguous().view(torch.int32) >> 23).to(torch.uint8)
    padded = torch.zeros(*sf.shape[:-1], _align(k, 4), dtype=torch.uint8, device=sf.device)
    padded[..., :k] = exps
    words = padded.view(torch.int32)
    return ported_mn_major(words, dg_tma_aligned_size(module, sf.shape[-2], 4))


def dg_cuda_home(nvcc: str | None = None) -> str | None:
    """The CUDA root to hand DeepGEMM explicitly (``DG_CUDA_HOME_VARIABLES``): that of the real ``nvcc`` (links
    resolved; ``nvcc``: its path, default the one on ``PATH``), else torch's ``CUDA_HOME``, else /usr/local/cuda, the
    first holding ``bin/nvcc`` and ``include/cuda.h``; None when none does."""
    import os
    import shutil

    found = nvcc or shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(found)))] if found else []
    try:
        from torch.utils.cpp_extension import CUDA_HOME as torch_home
    except Exception:  # noqa: BLE001 - torch without its extension helpers: the other candidates
        torch_home = None
    candidates += [c for c in (torch_home, "/usr/local/cuda") if c]
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "bin", "nvcc"))
                 and os.path.isfile(os.path.join(c, "include", "cuda.h"))), None)


def dg_packed_ue8m0_mn_major(module: Any, sf: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales → packed UE8M0, MN-major, TMA-aligned: the installed DeepGEMM's
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor`` (2.x), else the port."""
    fn = getattr(module, DG_MN_MAJOR_PACKED_UE8M0, None) if module is not None else None
    return fn(sf) if fn is not None else ported_packed_ue8m0_mn_major(sf, module)


def version_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", (version or "").split("+")[0])[:3])


def _first(module: Any, names: tuple[str, ...]) -> Callable[..., Any] | None:
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    return None


@dataclass(frozen=True)
class DeepGemmInfo:
    """The DeepGEMM found: its module (None when missing), generation ("v1", "v2", or None when it has no
    grouped GEMM we know), whether it has BF16 grouped GEMMs, and its version."""

    module_name: str
    module: Any
    generation: str | None
    has_bf16: bool
    error: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.module is None:
            return f"{self.module_name} is not importable ({self.error})"
        if self.generation is None:
            return (f"{self.module_name}: no known grouped GEMM API (neither 2.x m_grouped_fp8_gemm_nt_* "
                    f"nor v1 {DG_V1_MASKED})")
        bf16 = "with" if self.has_bf16 else "without"
        return f"DeepGEMM {self.version or ''} ({self.generation} API) {bf16} BF16 grouped GEMMs".replace("  ", " ")

    @property
    def compiles_odd_k_blocks(self) -> bool:
        """False for a v1 that may be PyPI 1.0.0 (no ``wgrad_gemm_fp8_fp8_fp32_nt``): "Misaligned barriers"."""
        return self.generation != "v1" or hasattr(self.module, DG_V1_ODD_K_FIXED_MARKER)

    @property
    def casts_pow2_strictly(self) -> bool:
        """SM100 scale cast: device assert (2.6.1+) rather than garbage exponents (or truncation) for non-powers of
        two."""
        return self.generation == "v2" and version_tuple(self.version) >= DG_POW2_ASSERT_VERSION

    def functions(self, weights: str) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
        """(contiguous, masked) for ``weights`` ("block_fp8" or "bf16")."""
        m = self.module
        if weights == "bf16":
            return getattr(m, DG_BF16_CONTIGUOUS, None), getattr(m, DG_BF16_MASKED, None)
        if self.generation == "v2":
            return _first(m, DG_V2_CONTIGUOUS_NAMES), _first(m, DG_V2_MASKED_NAMES)
        return getattr(m, DG_V1_CONTIGUOUS, None), getattr(m, DG_V1_MASKED, None)


def detect_deep_gemm(module: str | ModuleType | Any = DEEP_GEMM) -> DeepGemmInfo:
    """Import ``module`` (or take a module-like object) and read which API generation it has."""
    if isinstance(module, str):
        name = module
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
            return DeepGemmInfo(name, None, None, False, f"{type(exc).__name__}: {exc}")
    else:
        name = getattr(module, "__name__", type(module).__name__)
    version = getattr(module, "__version__", None)
    if _first(module, DG_V2_MASKED_NAMES) is not None:
        return DeepGemmInfo(name, module, "v2", hasattr(module, DG_BF16_MASKED), version=version)
    if hasattr(module, DG_V1_MASKED):
        return DeepGemmInfo(name, module, "v1", False, version=version)
    return DeepGemmInfo(name, module, None, False, version=version)


def dg_masked_block_ms(info: DeepGemmInfo | None, arch: int | None, mk_alignment: int = DG_DEFAULT_MK_ALIGNMENT
                       ) -> frozenset[int]:
    """Every BLOCK_M the installed DeepGEMM's masked GEMM may pick (its heuristic also depends on the SM count and
    the shapes): the masked GEMM stores whole BLOCK_M tiles into one ``[G·m, n]`` view (2.x
    csrc/jit_kernels/impls/runtime_utils.hpp make_tma_cd_desc, ``shape_m * num_groups``; the SM90 and SM100
    epilogues; v1 from 6db7e18), so a capacity ``m`` that is not a multiple of it lets one expert's last tile
    overwrite the next expert's first rows (DeepGEMM issues #15, #268). ``info`` None: planning, every version."""
    if info is None or info.generation is None:
        return DG_MASKED_BLOCK_MS_2_0 | {mk_alignment}
    if info.generation == "v1":
        return frozenset(DG_V1_MASKED_BLOCK_MS)
    version = version_tuple(info.version)
    if version < (2, 1):
        return DG_MASKED_BLOCK_MS_2_0
    if version >= DG_MASKED_SM100_MK_VERSION:
        if arch == DG_ARCH_SM100:
            return frozenset({mk_alignment})
        return DG_MASKED_BLOCK_MS if arch == DG_ARCH_SM90 else DG_MASKED_BLOCK_MS | {mk_alignment}
    if version >= (2, 4):  # 2.4.0/2.4.1: not on main; either rule
        return DG_MASKED_BLOCK_MS | {mk_alignment}
    return DG_MASKED_BLOCK_MS


def dg_masked_capacity_multiple(info: DeepGemmInfo | None, arch: int | None,
                                mk_alignment: int = DG_DEFAULT_MK_ALIGNMENT) -> int:
    """The capacity (DeepEP LL: R·T) every masked BLOCK_M divides; 1 expert per rank needs none."""
    return math.lcm(*dg_masked_block_ms(info, arch, mk_alignment))


#: The contiguous GEMMs' PSUM layout: ``use_psum_layout=True`` makes ``grouped_layout`` int32 ``[num_groups]``, each
#: group's end row, each group starting at the previous end rounded up to the mk alignment (the DeepEP V2 expanded
#: layout's ``psum_num_recv_tokens_per_expert``): deepseek-ai/DeepGEMM@54e2261 csrc/apis/gemm.hpp:197-199
#: (``num_groups == num_groups_``), deep_gemm/include/deep_gemm/scheduler/gemm.cuh:217-237, tests/generators.py:393.
#: 2.0-2.2 take a per-row ``m_indices`` only; 2.3.x has the keyword but runs it on SM100 only (SM90:
#: ``DG_HOST_ASSERT(not use_psum_layout)``, @0f5f266 csrc/apis/gemm.hpp:196 and :466); SM90 from 2.4.2 (@7f2a703).
#: Rows after the last group's aligned end are never written; padding rows in a group's blocks are computed from
#: their A rows, left unwritten, or zeroed, depending on version and architecture (docs/evidence/vendor-notes/
#: deepgemm-psum-layout.md section 4); the runner never reads them.
DG_USE_PSUM_LAYOUT = "use_psum_layout"
DG_PSUM_LAYOUT_VERSIONS = {DG_ARCH_SM100: (2, 3), DG_ARCH_SM90: (2, 4, 2)}


def dg_has_psum_layout(info: "DeepGemmInfo", arch: int | None) -> bool:
    """The installed DeepGEMM runs its contiguous GEMMs with ``use_psum_layout=True`` on ``arch`` (SM100 from 2.3,
    SM90 from 2.4.2; no ``__version__``: before 2.1.1, without it)."""
    since = DG_PSUM_LAYOUT_VERSIONS.get(arch) if arch is not None else None
    return info.generation == "v2" and since is not None and version_tuple(info.version) >= since


def mk_alignment(module: Any) -> int:
    """The installed DeepGEMM's ``get_mk_alignment_for_contiguous_layout()`` (v1:
    ``get_m_alignment_for_contiguous_layout()``), else 128."""
    fn = _first(module, DG_ALIGNMENT_NAMES)
    return int(fn()) if fn is not None else DG_DEFAULT_MK_ALIGNMENT


def device_capability(module: Any, device: torch.device | None = None) -> tuple[int, int] | None:
    """The compute capability the DeepGEMM kernels will run on: a fake's stand-in, else the CUDA device's
    (DeepGEMM reads ``device_runtime->get_arch_major()`` of the current device); None without a GPU."""
    emulated = getattr(module, EMULATED_CAPABILITY_ATTRIBUTE, None)
    if emulated is not None:
        return tuple(emulated)  # type: ignore[return-value]
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(device)
    return None


# =====================================================================================================
# Recorded signatures of every vendor callable the adapter calls (and the fakes implement)
# =====================================================================================================

_LEGACY = "deepseek-ai/DeepEP@dd758ca deep_ep/buffers/legacy.py"
_HYBRID = "deepseek-ai/DeepEP@94a9f8f deep_ep/buffer.py"
_V121 = "deepseek-ai/DeepEP@e9d053c deep_ep/buffer.py"
_CONFIG = "deepseek-ai/DeepEP@dd758ca csrc/legacy/buffer.hpp register_apis (pybind11 class_<Config>)"
_DG = "deepseek-ai/DeepGEMM@54e2261 csrc/apis/gemm.hpp register_apis (pybind11 py::arg)"
_DG_LAYOUT = "deepseek-ai/DeepGEMM@54e2261 csrc/apis/layout.hpp register_apis"
_DG_V1 = "deepseek-ai/DeepGEMM@0c88cd0 deep_gemm/jit_kernels/m_grouped_gemm.py"

BUFFER_INIT = VendorSignature(
    "Buffer.__init__", "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, "
    "num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, "
    "enable_shrink=False, comm=None)", _LEGACY)
BUFFER_GET_DISPATCH_CONFIG = VendorSignature("Buffer.get_dispatch_config", "(num_ranks)", _LEGACY)
BUFFER_GET_COMBINE_CONFIG = VendorSignature("Buffer.get_combine_config", "(num_ranks)", _LEGACY)
BUFFER_LL_SIZE_HINT = VendorSignature(
    "Buffer.get_low_latency_rdma_size_hint", "(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)",
    _LEGACY)
BUFFER_SET_NUM_SMS = VendorSignature("Buffer.set_num_sms", "(new_num_sms)", _LEGACY)
BUFFER_GET_DISPATCH_LAYOUT = VendorSignature(
    "Buffer.get_dispatch_layout", "(self, topk_idx, num_experts, previous_event=None, async_finish=False, "
    "allocate_on_comm_stream=False)", _LEGACY)
BUFFER_DISPATCH = VendorSignature(
    "Buffer.dispatch", "(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, "
    "is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, "
    "num_worst_tokens=0, config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False)",
    _LEGACY)
BUFFER_COMBINE = VendorSignature(
    "Buffer.combine", "(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, "
    "async_finish=False, allocate_on_comm_stream=False)", _LEGACY)
BUFFER_CLEAN_LL = VendorSignature(
    "Buffer.clean_low_latency_buffer", "(self, num_max_dispatch_tokens_per_rank, hidden, num_experts)", _LEGACY)
BUFFER_LL_DISPATCH = VendorSignature(
    "Buffer.low_latency_dispatch", "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
    "cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False, "
    "use_ue8m0=False, async_finish=False, return_recv_hook=False)", _LEGACY)
BUFFER_LL_COMBINE = VendorSignature(
    "Buffer.low_latency_combine", "(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, "
    "async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None)", _LEGACY)
BUFFER_DESTROY = VendorSignature("Buffer.destroy", "(self)", _LEGACY)
#: ``previous_event`` for normal mode in split phase: an event on the current stream (deep_ep/buffers/legacy.py capture).
BUFFER_CAPTURE = VendorSignature("Buffer.capture", "()", _LEGACY)
#: Main (2.x) only; 1.x and hybrid-ep have ``(self)`` (DeepEP@567632d deep_ep/utils.py:33, @94a9f8f utils.py:36): the
#: adapter calls it without arguments.
EVENT_OVERLAP_WAIT = VendorSignature("EventOverlap.current_stream_wait", "(self, release_handle=False)",
                                     "deepseek-ai/DeepEP@dd758ca deep_ep/utils/event.py")
CONFIG_INIT = VendorSignature(
    "Config.__init__", "(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
    "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)", _CONFIG)
# No py::arg on the hint methods: pybind11 names them arg0, arg1 and takes them positionally only.
CONFIG_NVL_HINT = VendorSignature("Config.get_nvl_buffer_size_hint", "(self, arg0, arg1, /)", _CONFIG)
CONFIG_RDMA_HINT = VendorSignature("Config.get_rdma_buffer_size_hint", "(self, arg0, arg1, /)", _CONFIG)

HYBRID_BUFFER_INIT = VendorSignature(
    "Buffer.__init__", "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, "
    "num_qps_per_rank=24, allow_nvlink_for_normal_mode=True, allow_nvlink_for_low_latency_mode=True, "
    "allow_mnnvl=False, use_fabric=False, explicitly_destroy=False, comm=None)", _HYBRID)
HYBRID_LL_DISPATCH = VendorSignature(
    "Buffer.low_latency_dispatch", "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
    "topk_weights=None, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, "
    "x_global_scale=None, use_fp8=True, round_scale=False, use_ue8m0=False, use_nvfp4=False, use_ue8m0_for_sf=False, "
    "async_finish=False, return_recv_hook=False)", _HYBRID)
HYBRID_LL_COMBINE = VendorSignature(
    "Buffer.low_latency_combine", "(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, "
    "async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None, overlap=False, "
    "src_signals=None, src_signal_expect_value=0)", _HYBRID)
#: Below the floor (``COMMIT_UE8M0``), recorded for the refusal's tests: 1.0.0 (@ebfe47e) and 1.1.0 before 21efbe9
#: (@21efbe9~1 = 9ec0612; ``use_fp8`` from ed7487c, the stats tensor from 5a2e37f).
V10_LL_DISPATCH = VendorSignature(
    "Buffer.low_latency_dispatch", "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
    "async_finish=False, return_recv_hook=False)", "deepseek-ai/DeepEP@ebfe47e deep_ep/buffer.py")
V11_BEFORE_UE8M0_LL_DISPATCH = VendorSignature(
    "Buffer.low_latency_dispatch", "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, "
    "cumulative_local_expert_recv_stats=None, use_fp8=True, async_finish=False, return_recv_hook=False)",
    "deepseek-ai/DeepEP@9ec0612 deep_ep/buffer.py")
V121_BUFFER_INIT = VendorSignature(
    "Buffer.__init__", "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, "
    "num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, "
    "comm=None)", _V121)
#: 1.2.1 from c475ec6 (``enable_shrink``) to 9249c25~1: main's 2.x constructor.
#: 1.2.1 from 9249c25 (2025-11-04, "Support cuMem API in cross process shared memory management (#217)") to 567632d,
#: the last 1.x commit on main: ``use_fabric`` between ``allow_mnnvl`` and ``explicitly_destroy``.
V121_FABRIC_BUFFER_INIT = VendorSignature(
    "Buffer.__init__", "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, "
    "num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False, "
    "explicitly_destroy=False, enable_shrink=False, comm=None)", "deepseek-ai/DeepEP@567632d deep_ep/buffer.py")

DG_FP8_CONTIGUOUS_SIG = VendorSignature(
    DG_FP8_CONTIGUOUS, "(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', "
    "disable_ue8m0_cast=False, use_psum_layout=False, ensure_zero_padding=True, expected_m_for_psum_layout=None)", _DG)
DG_FP8_MASKED_SIG = VendorSignature(
    DG_FP8_MASKED, "(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', "
    "disable_ue8m0_cast=False)", _DG)
DG_BF16_CONTIGUOUS_SIG = VendorSignature(
    DG_BF16_CONTIGUOUS, "(a, b, d, grouped_layout, compiled_dims='nk', use_psum_layout=False, "
    "ensure_zero_padding=True, expected_m_for_psum_layout=None)", _DG)
DG_BF16_MASKED_SIG = VendorSignature(DG_BF16_MASKED, "(a, b, d, masked_m, expected_m, compiled_dims='nk')", _DG)
DG_MK_ALIGNMENT_SIG = VendorSignature(DG_MK_ALIGNMENT, "()", _DG_LAYOUT)
# No py::arg on get_tma_aligned_size / get_mn_major_tma_aligned_tensor: positional only.
DG_TMA_ALIGNED_SIZE_SIG = VendorSignature(DG_TMA_ALIGNED_SIZE, "(arg0, arg1, /)", _DG_LAYOUT)
DG_MN_MAJOR_TMA_ALIGNED_SIG = VendorSignature(DG_MN_MAJOR_TMA_ALIGNED, "(arg0, /)", _DG_LAYOUT)
DG_MN_MAJOR_PACKED_UE8M0_SIG = VendorSignature(DG_MN_MAJOR_PACKED_UE8M0, "(sf, psum_layout=None)", _DG_LAYOUT)
#: Before 2.6.1: no ``py::arg`` (deepseek-ai/DeepGEMM@88965b0 csrc/apis/layout.hpp; the same @0f5f266, @7f2a703,
#: @38f8ef7, @9da4a23 csrc/python_api.cpp).
DG_MN_MAJOR_PACKED_UE8M0_SIG_BEFORE_2_6_1 = VendorSignature(
    DG_MN_MAJOR_PACKED_UE8M0, "(arg0, /)", "deepseek-ai/DeepGEMM@88965b0 csrc/apis/layout.hpp register_apis")
#: A lambda with no ``py::arg`` from 2.4.2 (deepseek-ai/DeepGEMM@7f2a703 .. @54e2261 csrc/apis/layout.hpp).
DG_SET_MK_ALIGNMENT_SIG = VendorSignature(DG_SET_MK_ALIGNMENT, "(arg0, /)", _DG_LAYOUT)
# 2.3.0 (0f5f266) .. 2.5.0: ``grouped_layout``, recipe_a/recipe_b, the PSUM layout; no ensure_zero_padding (2.6.1).
_DG_2_3 = "deepseek-ai/DeepGEMM@0f5f266 csrc/apis/gemm.hpp register_apis (the same @7f2a703, @891d57b)"
DG_FP8_CONTIGUOUS_SIG_2_3 = VendorSignature(
    DG_FP8_CONTIGUOUS, "(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', "
    "disable_ue8m0_cast=False, use_psum_layout=False, expected_m_for_psum_layout=None)", _DG_2_3)
DG_BF16_CONTIGUOUS_SIG_2_3 = VendorSignature(
    DG_BF16_CONTIGUOUS, "(a, b, d, grouped_layout, compiled_dims='nk', use_psum_layout=False, "
    "expected_m_for_psum_layout=None)", _DG_2_3)
# Before 2.3.0 (PR #112 @9da4a23 .. 2.2.0 @38f8ef7): the fourth argument is ``m_indices``; no recipe_a/recipe_b.
_DG_2_0 = "deepseek-ai/DeepGEMM@38f8ef7 csrc/apis/gemm.hpp register_apis (the same @9f19605; @9da4a23 python_api.cpp)"
DG_FP8_CONTIGUOUS_SIG_2_0 = VendorSignature(
    DG_FP8_CONTIGUOUS, "(a, b, d, m_indices, recipe=None, compiled_dims='nk', disable_ue8m0_cast=False)", _DG_2_0)
DG_FP8_MASKED_SIG_2_0 = VendorSignature(
    DG_FP8_MASKED, "(a, b, d, masked_m, expected_m, recipe=None, compiled_dims='nk', disable_ue8m0_cast=False)",
    _DG_2_0)
DG_BF16_CONTIGUOUS_SIG_2_0 = VendorSignature(DG_BF16_CONTIGUOUS, "(a, b, d, m_indices, compiled_dims='nk')", _DG_2_0)
#: PR #112 (9da4a23) up to f85ec64: the masked GEMM under its old name only (csrc/python_api.cpp).
DG_FP8_MASKED_SIG_PR112 = VendorSignature(
    DG_FP8_MASKED_ALIAS, "(a, b, d, masked_m, expected_m, recipe=None, compiled_dims='nk', disable_ue8m0_cast=False)",
    "deepseek-ai/DeepGEMM@9da4a23 csrc/python_api.cpp")
DG_V1_CONTIGUOUS_SIG = VendorSignature(DG_V1_CONTIGUOUS, "(lhs, rhs, out, m_indices)", _DG_V1)
DG_V1_MASKED_SIG = VendorSignature(DG_V1_MASKED, "(lhs, rhs, out, masked_m, expected_m)", _DG_V1)
DG_V1_ALIGNMENT_SIG = VendorSignature(DG_V1_ALIGNMENT, "()",
                                      "deepseek-ai/DeepGEMM@0c88cd0 deep_gemm/jit_kernels/utils.py")

#: (module attribute path, signature) of the main-line DeepEP V1 API the adapter calls.
DEEP_EP_SIGNATURES = (BUFFER_INIT, BUFFER_GET_DISPATCH_CONFIG, BUFFER_GET_COMBINE_CONFIG, BUFFER_LL_SIZE_HINT,
                      BUFFER_SET_NUM_SMS, BUFFER_GET_DISPATCH_LAYOUT, BUFFER_DISPATCH, BUFFER_COMBINE, BUFFER_CLEAN_LL,
                      BUFFER_LL_DISPATCH, BUFFER_LL_COMBINE, BUFFER_DESTROY, BUFFER_CAPTURE, CONFIG_INIT, CONFIG_NVL_HINT,
                      CONFIG_RDMA_HINT)
#: The hybrid-ep branch differs in these three; the rest as main.
HYBRID_SIGNATURES = (HYBRID_BUFFER_INIT, HYBRID_LL_DISPATCH, HYBRID_LL_COMBINE)
#: DeepGEMM 2.6.1 (@54e2261).
DEEP_GEMM_SIGNATURES = (DG_FP8_CONTIGUOUS_SIG, DG_FP8_MASKED_SIG, DG_BF16_CONTIGUOUS_SIG, DG_BF16_MASKED_SIG,
                        DG_MK_ALIGNMENT_SIG, DG_TMA_ALIGNED_SIZE_SIG, DG_MN_MAJOR_TMA_ALIGNED_SIG,
                        DG_MN_MAJOR_PACKED_UE8M0_SIG, DG_SET_MK_ALIGNMENT_SIG)
DEEP_GEMM_SIGNATURES_2_3 = (DG_FP8_CONTIGUOUS_SIG_2_3, DG_FP8_MASKED_SIG, DG_BF16_CONTIGUOUS_SIG_2_3,
                            DG_BF16_MASKED_SIG, DG_MK_ALIGNMENT_SIG, DG_TMA_ALIGNED_SIZE_SIG,
                            DG_MN_MAJOR_TMA_ALIGNED_SIG, DG_MN_MAJOR_PACKED_UE8M0_SIG_BEFORE_2_6_1)
DEEP_GEMM_SIGNATURES_2_0 = (DG_FP8_CONTIGUOUS_SIG_2_0, DG_FP8_MASKED_SIG_2_0, DG_BF16_CONTIGUOUS_SIG_2_0,
                            DG_BF16_MASKED_SIG, DG_MK_ALIGNMENT_SIG, DG_TMA_ALIGNED_SIZE_SIG,
                            DG_MN_MAJOR_TMA_ALIGNED_SIG, DG_MN_MAJOR_PACKED_UE8M0_SIG_BEFORE_2_6_1)
DEEP_GEMM_V1_SIGNATURES = (DG_V1_CONTIGUOUS_SIG, DG_V1_MASKED_SIG, DG_V1_ALIGNMENT_SIG)


def deep_gemm_signatures(generation: str | None, version: str | None, *, masked_name: str = DG_FP8_MASKED,
                         has_bf16: bool = True) -> tuple[VendorSignature, ...]:
    """The recorded signatures of the DeepGEMM found (v1, or 2.x by ``__version__``; 2.0.0 and 2.1.0 have none).
    ``masked_name``/``has_bf16``: what a 2.0.0 build has (before f85ec64: ``fp8_m_grouped_gemm_nt_masked`` only, no
    BF16 grouped GEMMs). ``set_mk_alignment_for_contiguous_layout`` is recorded from 2.4.2 on."""
    if generation == "v1":
        return DEEP_GEMM_V1_SIGNATURES
    v = version_tuple(version)
    records = (DEEP_GEMM_SIGNATURES_2_0 if v < (2, 3) else DEEP_GEMM_SIGNATURES if v >= DG_PACKED_UE8M0_PY_ARGS_VERSION
               else DEEP_GEMM_SIGNATURES_2_3)
    if DG_SET_MK_ALIGNMENT_VERSION <= v < DG_PACKED_UE8M0_PY_ARGS_VERSION:
        records += (DG_SET_MK_ALIGNMENT_SIG,)
    out = []
    for record in records:
        if record.qualname in (DG_BF16_CONTIGUOUS, DG_BF16_MASKED) and not has_bf16:
            continue
        if record.qualname == DG_FP8_MASKED and masked_name != DG_FP8_MASKED:
            record = DG_FP8_MASKED_SIG_PR112
        out.append(record)
    return tuple(out)


def deep_gemm_signatures_of(info: "DeepGemmInfo") -> tuple[VendorSignature, ...]:
    """The recorded signatures for the DeepGEMM ``info`` describes (its names tell a 2.0.0 build before f85ec64)."""
    masked = DG_FP8_MASKED if hasattr(info.module, DG_FP8_MASKED) else DG_FP8_MASKED_ALIAS
    return deep_gemm_signatures(info.generation, info.version, masked_name=masked, has_bf16=info.has_bf16)


#: 1.2.1 from 9249c25: ``use_fabric`` in the constructor.
COMMIT_USE_FABRIC = "9249c25"


def deep_ep_signatures(release: DeepEPRelease) -> tuple[VendorSignature, ...]:
    """The recorded signatures of the DeepEP found: main's, with the hybrid-ep branch's or 1.x's constructor. Where
    the release string cannot tell the builds apart (a 1.2.1 of unknown commit) several records share a qualname:
    the installed one must equal one of them. 1.0 and 1.1 are compared with 1.2.1's early records (their
    constructors grew ``allow_mnnvl``, ``explicitly_destroy`` and ``comm`` within 1.1; not recorded one by one)."""
    commit = _commit_of(release.version)
    if release.line == "hybrid-ep":
        overrides: tuple[VendorSignature, ...] = HYBRID_SIGNATURES
    elif release.line == "2.x":
        overrides = ()
    elif commit in V121_COMMITS:
        overrides = ((V121_FABRIC_BUFFER_INIT,) if _at_or_after(commit, COMMIT_USE_FABRIC) else
                     () if _at_or_after(commit, COMMIT_ENABLE_SHRINK) else (V121_BUFFER_INIT,))
    elif release.line == "1.x" and (release.version or "").startswith("1.2"):
        overrides = (V121_BUFFER_INIT, BUFFER_INIT, V121_FABRIC_BUFFER_INIT)  # which 1.2.1 commit: unknown
    else:
        overrides = (V121_BUFFER_INIT,)
    records: list[VendorSignature] = []
    for record in DEEP_EP_SIGNATURES:
        alternatives = [r for r in overrides if r.qualname == record.qualname]
        records += alternatives or [record]
    return tuple(records)


def lookup(module: Any, qualname: str) -> Any:
    """``Class.method`` or ``function`` of ``module`` (for comparing a recorded signature)."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj



# =====================================================================================================
# DeepEP V2: the ElasticBuffer (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/elastic.py, csrc/elastic/buffer.hpp).
# The facts the cuda_deepep_v2 backend and its fake use; docs/evidence/vendor-notes/deepep-v2-elasticbuffer.md has
# the rest.
# =====================================================================================================

#: ``deep_ep.ElasticBuffer`` and ``deep_ep.EPHandle`` (deep_ep/__init__.py:89).
ELASTIC_BUFFER = "ElasticBuffer"
EP_HANDLE = "EPHandle"
#: ``symmetric::kNumAlignmentBytes`` (csrc/kernels/backend/symmetric.hpp:16): ``num_bytes`` is a positive multiple
#: (csrc/elastic/buffer.hpp:98 ``num_buffer_bytes > 0 and num_buffer_bytes % symmetric::kNumAlignmentBytes == 0``).
V2_BUFFER_ALIGNMENT = 2 << 20
#: ``WorkspaceLayout`` (deep_ep/include/deep_ep/common/layout.cuh:37-40): ``num_ranks <= kNumMaxRanks``,
#: ``num_experts <= kNumMaxExperts``, ``num_experts_per_rank <= kNumMaxExpertsPerRank``, and E % R == 0.
V2_MAX_RANKS, V2_MAX_EXPERTS, V2_MAX_EXPERTS_PER_RANK = 1024, 2048, 256
#: ``EP_STATIC_ASSERT(kNumTopk <= 32, ...)`` (deep_ep/include/deep_ep/impls/dispatch.cuh:93): a JIT compile error.
V2_MAX_TOPK = 32
#: ``EP_STATIC_ASSERT(kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0, "Invalid hidden")``
#: (deep_ep/include/deep_ep/impls/combine.cuh:109): combine's hidden size, a JIT compile error otherwise.
V2_COMBINE_HIDDEN_MULTIPLE = 256
#: ``TokenLayout`` asserts ``num_hidden_bytes % ptx::kNumTMAAlignBytes == 0`` (layout.cuh:198; ptx.cuh:16).
V2_TMA_ALIGN_BYTES = 32
#: ``dispatch`` asserts ``(x.size(1) * x.element_size()) % sizeof(int4) == 0`` (csrc/elastic/buffer.hpp:751-756).
V2_INT4_BYTES = 16
#: README.md:70 "NCCL 2.30.4 and above": the device API (``ncclDevCommCreate``, GIN) DeepEP 2.x builds against. No
#: code compares versions; a DeepEP built against older headers does not build (docs/evidence/hardware-runs.md, 2026-11-23).
V2_MIN_NCCL = (2, 30, 4)
V2_INSTALL_HINT = ("DeepEP 2.x builds from source (https://github.com/deepseek-ai/DeepEP: install.sh, or `python "
                   "setup.py install`; README.md:64-107) on an SM90 CUDA machine with nvcc >= 12.3 at run time (JIT), "
                   "torch >= 2.10, NVSHMEM, and NCCL >= 2.30.4 (`pip install 'nvidia-nccl-cu13>=2.30.4'`, "
                   "README.md:70-79) that is the libnccl torch loads (else `import deep_ep` asserts; "
                   "EP_SUPPRESS_NCCL_CHECK=1 skips that check)")
#: csrc/kernels/backend/nccl.cu:86-99: with more than one rank the constructor asks NCCL for GIN and asserts
#: "NCCL GIN is unavailable..." when the network has none; on one NVLink domain ``EP_DISABLE_GIN=1`` skips it
#: (DeepEP #629/#630; README.md:343).
V2_GIN_UNAVAILABLE = "NCCL GIN is unavailable"
EP_DISABLE_GIN = "EP_DISABLE_GIN"
#: ``deep_ep.get_physical_domain_size(group)`` -> ``(num_rdma_ranks, num_nvlink_ranks)``: NCCL's world and LSA (NVLink)
#: teams of the group's communicator, no device communicator needed (deep_ep/utils/envs.py:116-127,
#: csrc/kernels/backend/nccl.cu:49-54; exported by deep_ep/__init__.py:92, 2.1.0 on). It wraps the group's NCCL
#: communicator as the size hint does: only after the group's first collective (DeepEP #726).
V2_PHYSICAL_DOMAIN_SIZE = "get_physical_domain_size"
#: DeepEP's GPU targets: "Hopper (SM90) GPUs" (README.md:64); its JIT compiles for ``sm_{major}{minor}a``, and for
#: major 10 ``sm_100a``/``sm_100f`` (csrc/jit/device_runtime.hpp:49-57, csrc/jit/compiler.hpp:215-219). Older GPUs
#: have no ``sm_XXa`` target: the first call's build fails. Other majors are not targets DeepEP names.
V2_ARCH_MAJORS = frozenset({9, 10})
#: One NVLink (NCCL LSA) domain, 8 GPUs on the H100/H200 nodes: the most ranks the adapter takes. Past a domain DeepEP
#: switches to its hybrid kernels unless told not to (``V2_ALLOW_HYBRID_MODE``: nccl.cu:116-125); nothing here has run
#: the direct kernels on more than a node's ranks.
V2_DIRECT_MAX_RANKS = 8
#: The hybrid kernels' channel slack in the size formula: ``8 * 160`` (csrc/elastic/buffer.hpp:57-59).
V2_HYBRID_CHANNEL_TOKENS = 1280
#: ``calculate_buffer_size`` sizes for top-32 when ``num_topk`` is 0 (csrc/elastic/buffer.hpp:663).
V2_DEFAULT_SIZING_TOPK = 32


def has_elastic_buffer(module: Any) -> bool:
    """Whether ``module`` (an installed ``deep_ep``, or a fake) has V2's ElasticBuffer."""
    return getattr(module, ELASTIC_BUFFER, None) is not None


#: What the V2 adapter passes and reads that DeepEP 2.0.0 (b306af0, a422b5a) lacks: ``dispatch(do_zero_padding=)``
#: and ``EPHandle.num_unaligned_recv_tokens_per_expert``, both from 2.1.0 (099d5f2, DeepEP #674). ``elastic.py`` is
#: Python, so the keyword shows in the signature (docs/evidence/vendor-notes/deepep-v2-elasticbuffer.md section 7).
V2_ZERO_PADDING = "do_zero_padding"
V2_MIN_VERSION = "2.1.0"


def elastic_dispatch_lacks_zero_padding(module: Any) -> bool:
    """The installed ElasticBuffer's ``dispatch`` has no ``do_zero_padding`` (DeepEP 2.0.0)."""
    dispatch = getattr(getattr(module, ELASTIC_BUFFER), "dispatch")
    try:
        return V2_ZERO_PADDING not in inspect.signature(dispatch).parameters
    except (TypeError, ValueError):  # not introspectable: take it as it comes
        return False


#: With ``async_with_compute_stream``, DeepEP ``record_stream``s every tensor of the call on the compute and comm
#: streams, unless this variable is a non-zero int: then the returned event alone holds them (``tensors_to_record``),
#: and dropping the event before the comm stream is done frees memory it still uses (csrc/elastic/buffer.hpp:562-573,
#: read with ``std::getenv`` + ``sscanf("%d")`` at every call: csrc/utils/system.hpp:19-35; README.md:338).
EP_AVOID_RECORD_STREAM = "EP_AVOID_RECORD_STREAM"


def _env_int_set(environ: Any, name: str) -> bool:
    """``get_env<int>(name, 0) != 0`` (csrc/utils/system.hpp:19-35: ``std::getenv`` + ``sscanf("%d")``). A value
    ``sscanf`` cannot read leaves DeepEP's int undefined: taken as set."""
    value = environ.get(name)
    if value is None:
        return False
    digits = re.match(r"\s*[+-]?\d+", value, flags=re.ASCII)
    return digits is None or int(digits.group()) != 0


def avoids_record_stream(environ: Any) -> bool:
    """Whether DeepEP's V2 calls skip ``record_stream`` under ``environ`` (``os.environ``, read at each call as
    DeepEP does)."""
    return _env_int_set(environ, EP_AVOID_RECORD_STREAM)


def gin_disabled(environ: Any) -> bool:
    """Whether the ElasticBuffer constructor skips NCCL GIN under ``environ`` (``get_env("EP_DISABLE_GIN", 0) == 0``
    asks for it, csrc/kernels/backend/nccl.cu:86): its device communicator then has no GIN contexts, which the direct
    kernels need to reach ranks outside the NVLink domain (nccl.cu:86-97)."""
    return _env_int_set(environ, EP_DISABLE_GIN)


#: ``num_sms``: ``EP_HOST_ASSERT(num_sms <= jit::device_runtime->get_num_sms())`` at each dispatch
#: (csrc/elastic/buffer.hpp:979; ``get_num_sms`` is ``multiProcessorCount``, csrc/jit/device_runtime.hpp:40-41); any
#: count is launched, odd ones with a cluster of 1 (``2 - (num_sms % 2)``, csrc/kernels/elastic/dispatch.hpp:226,
#: combine.hpp:174). Combine reuses the dispatch's (``handle.num_sms``, deep_ep/buffers/elastic.py:1086).
V2_NUM_SMS_ASSERT = "num_sms <= jit::device_runtime->get_num_sms()"


#: The device type whose backend DeepEP V2 takes from the group (deep_ep/utils/comm.py:61 ``torch.device('cuda')``).
V2_COMM_DEVICE = "cuda"


def group_backend_problem(group: Any, device: torch.device) -> str | None:
    """Why the group cannot carry DeepEP V2's communicator on ``device`` (None: it can). DeepEP takes
    ``group._get_backend(torch.device('cuda'))`` (deep_ep/utils/comm.py:61) and reuses its NCCL communicator
    (``_comm_ptr``, :62-64), or, for a backend without one (gloo), makes its own over ``all_gather_object``
    (:66-75); a group with no backend for the device type (``backend="cpu:gloo"``) raises torch's untyped
    "No backend type associated with device type" there, and in the adapter's first collective."""
    get = getattr(group, "_get_backend", None)
    if get is None:
        return None
    try:
        get(torch.device(device.type))
    except RuntimeError as exc:
        return str(exc)
    return None


def _a32(n: int) -> int:
    return _align(n, V2_TMA_ALIGN_BYTES)


def v2_dispatch_token_bytes(hidden_bytes: int, sf_packs: int, num_topk: int) -> int:
    """One token in the dispatch buffer (``TokenLayout``, layout.cuh:186-208): the hidden bytes, ``sf_packs`` 4-byte
    scales and ``12K+4`` bytes of routing, each rounded up to 32 bytes."""
    return _a32(hidden_bytes) + _a32(4 * sf_packs) + _a32(12 * num_topk + 4)


def v2_combine_token_bytes(hidden: int, num_topk: int) -> int:
    """One token in the combine buffer (csrc/kernels/elastic/combine.hpp:109-112): a BF16 row and ``8K`` bytes."""
    return _a32(2 * hidden) + _a32(8 * num_topk)


@dataclass(frozen=True)
class ElasticSizes:
    """``get_dispatch_buffer_size`` / ``get_combine_buffer_size`` and their 2 MiB-aligned maximum."""

    dispatch: int
    combine: int

    @property
    def total(self) -> int:
        return _align(max(self.dispatch, self.combine), V2_BUFFER_ALIGNMENT)


def ported_elastic_buffer_sizes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                                use_fp8_dispatch: bool = False, nvl_ranks: int | None = None,
                                allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True) -> ElasticSizes:
    """``calculate_buffer_size`` (deepseek-ai/DeepEP@dd758ca csrc/elastic/buffer.hpp:586-686), for planning without
    DeepEP; ``elastic_buffer_size_hint`` calls the installed one. ``nvl_ranks``: NCCL's LSA team (the NVLink domain,
    csrc/kernels/backend/nccl.cu:56-60), by default ``min(num_ranks, 8)``; the hybrid kernels run when it is smaller
    than the group (one node otherwise). Per token, dispatch moves the hidden bytes, FP8's scale packs (an
    "approximation": ``ceil(hidden/32)`` of them, :671-672) and ``12K+4`` bytes of routing, combine the BF16 row and
    ``8K`` bytes, each rounded up to 32 bytes."""
    R, N = num_ranks, num_max_tokens_per_rank
    if N <= 0 or hidden <= 0:
        raise ValueError("num_max_tokens_per_rank > 0 and hidden > 0")  # buffer.hpp:657
    K = num_topk or V2_DEFAULT_SIZING_TOPK
    elem, sf_packs = (1, -(-hidden // 32)) if use_fp8_dispatch else (2, 0)
    token_d = v2_dispatch_token_bytes(hidden * elem, sf_packs, K)
    token_c = v2_combine_token_bytes(hidden, K)
    nvl = min(R, 8) if nvl_ranks is None else nvl_ranks
    hybrid = allow_hybrid_mode and R > nvl
    r_out, r_up = (R // nvl, nvl) if hybrid else (1, R)
    in_nvl = r_up == nvl
    mr = allow_multiple_reduction
    if r_out == 1:
        dispatch = token_d * N * ((0 if in_nvl else 1) + R)
        combine = token_c * (0 if in_nvl else R) * N * (1 if mr else K) + token_c * (min(R, K) if mr else K) * N
    else:
        c = V2_HYBRID_CHANNEL_TOKENS
        l_up, l_out = (min(r_up, K), min(r_out, K)) if mr else (K, K)
        dispatch = token_d * (r_up * r_out * N + N + r_out * (N + c))
        combine = token_c * l_up * r_out * N + token_c * l_out * N + token_c * (1 if mr else K) * r_out * (N + c)
    return ElasticSizes(dispatch, combine)


#: ``ElasticBuffer(..., allow_hybrid_mode=True)`` and ``get_buffer_size_hint(..., allow_hybrid_mode=True)``
#: (deepseek-ai/DeepEP@dd758ca deep_ep/buffers/elastic.py:240, :384): with it, a group spanning more than one NVLink
#: (LSA) domain runs the hybrid kernels (csrc/kernels/backend/nccl.cu:118-124), at 2 nodes x 4 GPUs as at 2 x 1. The
#: adapter passes False to both: the direct kernels everywhere, over GIN across domains (nccl.cu:86-97).
V2_ALLOW_HYBRID_MODE = "allow_hybrid_mode"


def elastic_buffer_size_hint(module: Any, group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int,
                             use_fp8_dispatch: bool) -> int:
    """``ElasticBuffer.get_buffer_size_hint`` of the installed DeepEP (it needs the group's NCCL communicator: the
    LSA team size enters the result, elastic.py:380-406), else the port's; both without hybrid mode."""
    elastic = getattr(module, ELASTIC_BUFFER, None) if module is not None else None
    if elastic is not None:
        return int(elastic.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                                **{V2_ALLOW_HYBRID_MODE: False}))
    size = group.size() if group is not None else 1
    return ported_elastic_buffer_sizes(size, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch,
                                       allow_hybrid_mode=False).total


#: Read by DeepEP@dd758ca and left as set, each changing what a dispatcher does: ``import deep_ep`` skips its NCCL
#: version check (deep_ep/__init__.py:51, run at import: :83); "0" builds a communicator of its own instead of reusing
#: torch's (deep_ep/utils/comm.py:62); GIN across NICs (deep_ep/buffers/elastic.py:279); the RDMA service level handed
#: to the ElasticBuffer (elastic.py:323-324).
EP_SUPPRESS_NCCL_CHECK = "EP_SUPPRESS_NCCL_CHECK"
EP_REUSE_NCCL_COMM = "EP_REUSE_NCCL_COMM"
NCCL_GIN_CROSS_NIC = "NCCL_GIN_CROSS_NIC"
EP_OVERRIDE_RDMA_SL = "EP_OVERRIDE_RDMA_SL"
#: What the ElasticBuffer constructor writes into ``os.environ``: ``NCCL_SYM_REUSE_SYSMEM_HANDLES`` ('1', with
#: ``setdefault``) when ``NCCL_GIN_CROSS_NIC`` is '0' (deep_ep/buffers/elastic.py:279-282), read by NCCL when it maps
#: CPU-backed window segments; ``NCCL_WIN_STRIDE`` only with ``num_cpu_bytes > 0`` (:285-298), which the adapter never
#: passes. ``elastic.ElasticBuffers`` puts both back after the constructor (``restored_environ``), as ``buffers`` does
#: ``NVSHMEM_WRITTEN``: the adapter's buffers have no CPU segments, so neither changes what they do.
NCCL_SYM_REUSE_SYSMEM_HANDLES = "NCCL_SYM_REUSE_SYSMEM_HANDLES"
NCCL_WIN_STRIDE = "NCCL_WIN_STRIDE"
V2_WRITTEN = (NCCL_SYM_REUSE_SYSMEM_HANDLES, NCCL_WIN_STRIDE)
#: The variables another plugin may not set (``Backend.vendor_environment``): those DeepEP reads and that change what
#: V1 (NVSHMEM's, written by the Buffer from its arguments) or V2 does. Not listed: ``EP_NUM_TOPK_IDX_BITS`` and
#: ``EP_JIT_CACHE_DIR``, which ``import deep_ep`` itself sets to its build's values when unset
#: (deep_ep/__init__.py:11-16), inside this backend's own probe; JIT, debug and hybrid-mode variables
#: (csrc/jit/compiler.hpp, deep_ep/utils/envs.py), which change neither results nor sizes within 8 ranks.
READ_ENVIRONMENT = (*NVSHMEM_WRITTEN, EP_DISABLE_GIN, EP_AVOID_RECORD_STREAM, EP_SUPPRESS_NCCL_CHECK,
                    EP_REUSE_NCCL_COMM, NCCL_GIN_CROSS_NIC, EP_OVERRIDE_RDMA_SL)
