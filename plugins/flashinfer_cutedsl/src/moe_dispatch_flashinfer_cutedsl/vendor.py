"""FlashInfer, as this plugin knows it: the one vendor boundary.

Every FlashInfer name the adapters call, the recorded signature of each call per version, the
kernel limits and environment variables per version, the ported workspace formula, and
``detect()``. The adapters (``backend``, ``alltoall``, ``mnnvl_comm``, ``experts``, ``weights``)
and the fakes (the testing distribution's ``moe_dispatch_flashinfer_cutedsl_testing.fakes``) take
these facts from here and from nowhere else.

Citations: ``flashinfer-ai/flashinfer@<commit> <path> <symbol>`` for the git tags (v0.6.0 =
4230a48, v0.6.4 = f1e6fdc, v0.6.6 = 70b142b, v0.6.7 = 56ed540, v0.6.8 = b9372aa, v0.6.11 = 98f48f8,
v0.6.12 = d768c14, v0.6.13 = 57ba7ee, v0.6.14 = 19f1a41, v0.6.15 = 8eccd0c, v0.6.16 = 8da13a2,
v0.6.17 = a0a6b01, main = fb28d72) and ``flashinfer-python==X (wheel) <path>`` for releases that are only on the package
index (0.6.18, 0.7.0, 0.7.1, 0.7.2.post1, 0.7.4; there is no 0.7.3). ``csrc/...`` paths of a wheel are under
``flashinfer/data/csrc``. ``moeAlltoAllKernels.*`` is short for
``csrc/nv_internal/tensorrt_llm/kernels/communicationKernels/moeAlltoAllKernels.*``.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import torch

from moe_dispatch.backend import VendorSignature

Version = tuple[int, int, int]

REAL = "flashinfer"
INSTALL_HINT = 'pip install "moe-dispatch-flashinfer-cutedsl[flashinfer]" (flashinfer-python), on a CUDA machine'


# -- versions ----------------------------------------------------------------------------------

#: ``MoeAlltoAll`` first ships in v0.6.0 (flashinfer-ai/flashinfer@4230a48
#: flashinfer/comm/trtllm_moe_alltoall.py; absent at v0.5.3 = 0e68a2f).
A2A_SINCE: Version = (0, 6, 0)
#: ``CuteDslMoEWrapper`` first ships in v0.6.4 (flashinfer-ai/flashinfer@f1e6fdc
#: flashinfer/fused_moe/cute_dsl/fused_moe.py; absent at v0.6.3).
CUTEDSL_SINCE: Version = (0, 6, 4)
#: The newest release every fact here was read from (flashinfer-python==0.7.4 wheel).
VERIFIED_UNTIL: Version = (0, 7, 4)
#: 0.7.4 has no ``MoeAlltoAll`` (its wheel has no flashinfer/comm/trtllm_moe_alltoall.py; flashinfer.comm
#: exports neither it nor ``moe_a2a_*``): the same TRT-LLM kernels ship as ``flashinfer.moe_ep``'s
#: ``NVLinkOneSidedAlltoAll`` (see "flashinfer.moe_ep" below). The adapter drives that from EP_SINCE on and
#: ``MoeAlltoAll`` before it.
EP_SINCE: Version = (0, 7, 4)
_EP = "flashinfer-python==0.7.4 flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/communication.py"


def parse_version(text: str) -> Version | None:
    """``"0.7.2.post1"`` → (0, 7, 2); ``"0.6.18rc7"`` → (0, 6, 18); None when not a version."""
    m = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def _pick(rules: tuple[tuple[Version, Any], ...], version: Version) -> Any:
    """The value of the last rule whose version is <= ``version`` (rules oldest first)."""
    found = rules[0][1]
    for since, value in rules:
        if version >= since:
            found = value
    return found


# -- kernel limits (moeAlltoAllKernels.h, trtllm_moe_alltoall.cu) --------------------------------

#: kMaxTopK: 8 until v0.6.7 (flashinfer-ai/flashinfer@56ed540 moeAlltoAllKernels.h), 22 from
#: v0.6.8 (flashinfer-ai/flashinfer@b9372aa moeAlltoAllKernels.h). It sizes calculateOffsets'
#: top-k metadata, so the workspace grows with it.
MAX_TOP_K_RULES: tuple[tuple[Version, int], ...] = (((0, 6, 0), 8), ((0, 6, 8), 22))
#: The top-k values the kernels are instantiated for (SWITCH_TOP_K in moeAlltoAllKernels.cu;
#: any other value fails "Unsupported top_k" at launch): v0.6.0-v0.6.7 (56ed540), v0.6.8-v0.6.15
#: (b9372aa), v0.6.16+ (8da13a2, fb28d72, 0.7.2.post1).
TOP_K_VALUES_RULES: tuple[tuple[Version, frozenset[int]], ...] = (
    ((0, 6, 0), frozenset({1, 2, 4, 8})),
    ((0, 6, 8), frozenset({1, 2, 4, 6, 8, 10, 16, 22})),
    ((0, 6, 16), frozenset({1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22})),
    ((0, 7, 4), frozenset({1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 22})),  # EP_TOP_K_VALUES
)
#: kMaxPayloads: 8 until v0.6.7, 4 in v0.6.8-v0.6.13 (b9372aa), 6 from v0.6.14 (19f1a41), 4 in 0.7.4.
MAX_PAYLOADS_RULES: tuple[tuple[Version, int], ...] = (((0, 6, 0), 8), ((0, 6, 8), 4), ((0, 6, 14), 6), ((0, 7, 4), 4))
#: kMaxRanks: every version (TLLM_CHECK in the launchers until v0.6.15, TVM_FFI_ICHECK in
#: moeA2ADispatchOp/moeA2ACombineOp from v0.6.16 = 8da13a2).
MAX_RANKS = 64
#: Until v0.6.15 moeA2ADispatchOp checks ``numExperts >= epSize && numExperts % epSize == 0``;
#: from v0.6.16 (8da13a2) only ``numExperts >= epSize`` (ceil/floor expert partition).
UNEVEN_EXPERTS_SINCE: Version = (0, 6, 16)
#: kMaxExperts = 256 is declared in moeAlltoAllKernels.h until v0.6.7 but checked nowhere
#: (flashinfer-ai/flashinfer@56ed540): FlashInfer has no experts-per-rank limit.
#: NUM_METAINFO_FIELDS: 9 until v0.6.15, 10 from v0.6.16 (EPLB_GATHERED_STATS_OFFSET_INDEX added
#: before PAYLOAD_DATA_OFFSET_INDEX; csrc/nv_internal/tensorrt_llm/thop/moeAlltoAllMeta.h).
METAINFO_NAMES_0_6_0: tuple[str, ...] = (
    "FLAG_VAL", "LOCAL_TOKEN_COUNTER", "SEND_COUNTERS", "RECV_COUNTERS", "DISPATCH_COMPLETION_FLAGS",
    "COMBINE_COMPLETION_FLAGS", "TOPK_TARGET_RANKS", "TOPK_SEND_INDICES", "PAYLOAD_DATA")
METAINFO_NAMES_0_6_16: tuple[str, ...] = METAINFO_NAMES_0_6_0[:8] + ("EPLB_GATHERED_STATS", "PAYLOAD_DATA")
EPLB_SINCE: Version = (0, 6, 16)
#: Combine accepts FP8 payloads and the output_dtype/output_scales arguments from v0.6.14
#: (19f1a41 csrc/trtllm_moe_alltoall.cu toNvDataType, moeA2ACombineOp).
COMBINE_QUANT_SINCE: Version = (0, 6, 14)
#: The ``backend=`` keyword ("trtllm" | "cake") and a sixth workspace-cache key field from 0.7.1
#: (flashinfer-python==0.7.1 flashinfer/comm/trtllm_moe_alltoall.py MoeAlltoAll.get_workspace).
A2A_BACKEND_SINCE: Version = (0, 7, 1)
#: ``MoeAlltoAll`` is ``@typing_extensions.deprecated`` (a DeprecationWarning at construction) in
#: favour of flashinfer.moe_ep.NVLinkOneSidedAlltoAll from 0.7.2 (flashinfer-python==0.7.2.post1
#: flashinfer/comm/trtllm_moe_alltoall.py ``@deprecated("MoeAlltoAll is deprecated; ...")``; its
#: docstring says ".. deprecated:: 0.7.1", but the 0.7.1 wheel's module has no ``deprecated`` at all).
#: ``typing_extensions.deprecated`` on a class warns in its ``__new__``, at every construction; under
#: an "error" warnings filter (``python -W error``, pytest ``filterwarnings = error``) that is an
#: exception. The message starts with A2A_DEPRECATION (0.7.2.post1, as quoted above).
A2A_DEPRECATED_SINCE: Version = (0, 7, 2)
A2A_DEPRECATION = "MoeAlltoAll is deprecated; use flashinfer.moe_ep.NVLinkOneSidedAlltoAll"
#: ``MoeAlltoAll(..., hidden_size=H)`` without ``workspace_size_per_rank`` sizes its workspace with
#: ``MoeAlltoAll.get_moe_workspace_size_per_rank(ep_size, top_k, max_num_tokens, hidden_size)``: 2H + 4k
#: + 4k dispatch bytes per token (bf16 rows, int32 ids, fp32 scales) and 2H combine bytes (every
#: version: flashinfer-ai/flashinfer@4230a48 ... flashinfer-python==0.7.2.post1
#: flashinfer/comm/trtllm_moe_alltoall.py); FlashInfer's own tests and benchmarks size theirs so too.
#: That is the adapter's BF16 size, and the workspace-cache key holds no top-k or expert count.
def default_workspace_bytes_per_token(hidden_size: int, top_k: int) -> tuple[int, int]:
    """(dispatch, combine) bytes per token of FlashInfer's default workspace size."""
    return 2 * hidden_size + 8 * top_k, 2 * hidden_size


#: Combine's payload dtypes: half, bfloat16, float32 (+ float8_e4m3fn from v0.6.14); anything
#: else raises TypeError "Unsupported dtype for MoE combine" (trtllm_moe_alltoall.cu toNvDataType).
COMBINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHELINE = 128  # kCachelineAlignment (trtllm_moe_alltoall.cu)

#: ``MoeAlltoAll._WORKSPACE_CACHE``: class-level dict of workspaces (every version). Its key starts
#: (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens) in every version; v0.6.16 adds
#: eplb_stats_num_experts (8da13a2 MoeAlltoAll.get_workspace), 0.7.1 adds backend. Two instances
#: with the same key share ONE workspace.
WORKSPACE_CACHE_ATTR = "_WORKSPACE_CACHE"
CACHE_KEY_RULES: tuple[tuple[Version, tuple[str, ...]], ...] = (
    ((0, 6, 0), ("workspace_size_per_rank", "ep_rank", "ep_size", "max_num_tokens")),
    ((0, 6, 16), ("workspace_size_per_rank", "ep_rank", "ep_size", "max_num_tokens", "eplb_stats_num_experts")),
    ((0, 7, 1), ("workspace_size_per_rank", "ep_rank", "ep_size", "max_num_tokens", "eplb_stats_num_experts",
                 "backend")),
)
#: From v0.6.15 dispatch/combine raise RuntimeError("MNNVL handles are unmapped") after
#: checkpoint_prepare (flashinfer-ai/flashinfer@8eccd0c flashinfer/comm/trtllm_moe_alltoall.py), and
#: MnnvlMemory.allocated_map holds ``_MnnvlAllocationRecord``s (tuples before; see mnnvl_reservation).
A2A_UNMAPPED_CHECK_SINCE: Version = (0, 6, 15)
#: From 0.7.1 get_workspace barriers on the allocation's comm after moe_a2a_initialize ("Do not let
#: a peer publish into that workspace until every rank has completed the same initialization, or a
#: late memset can erase the peer's first completion epoch": flashinfer-python==0.7.1 and 0.7.2.post1
#: flashinfer/comm/trtllm_moe_alltoall.py MoeAlltoAll.get_workspace; absent in v0.6.15 ... 0.7.0 and
#: fb28d72). Before it a fast rank's first dispatch can race a peer's memset: the adapter barriers.
A2A_INIT_BARRIER_SINCE: Version = (0, 7, 1)
#: The dispatch kernel's vector stores into the packed receive planes (moeAlltoAllKernels.cu
#: vectorized_dispatch): until 0.7.0 the width is the largest of 16/8/4/2/1 bytes dividing the
#: row size (``bytes_per_token``) alone (flashinfer-ai/flashinfer@4230a48 ... fb28d72, and the
#: 0.6.18 / 0.7.0 wheels), while csrc/trtllm_moe_alltoall.cu moeA2ADispatchOp packs the planes back
#: to back (``offset += payloadByteSizes[i]``, R·T·bytes_per_token each): a plane (or a source
#: row) not aligned to that width is a "misaligned address" fault. From 0.7.1 the width also
#: divides every plane and source address (``copy_alignment``; flashinfer-python==0.7.1
#: moeAlltoAllKernels.cu: "Receive planes are packed without vector-width padding").
DISPATCH_VECTOR_WIDTHS: tuple[int, ...] = (16, 8, 4, 2, 1)
PLANE_ALIGNMENT_FIXED_SINCE: Version = (0, 7, 1)
#: The combine kernel (moeAlltoAllKernels.cu vectorized_combine_impl) sums a token's top-k copies
#: in a pairwise tree (stride 1, 2, 4, ...: acc[i] += acc[i + s] for i = 0, 2s, 4s, ... with
#: i + s < top_k; the specialised TOP_K branches of every version are exactly this), a duplicate
#: or dead slot contributing zero. Until v0.6.15 the adds are in the payload dtype (``T``, bf16
#: rounding at each add: flashinfer-ai/flashinfer@4230a48 / 8eccd0c ``accumulate_vec<T, ...>``);
#: from v0.6.16 in float32, cast once (8da13a2: "Accumulate across all valid ranks into float32").
COMBINE_FP32_SINCE: Version = (0, 6, 16)
#: ``MoeAlltoAll._state.phase``: "idle" | "dispatched" (every version: 4230a48 ... 0.7.2.post1
#: flashinfer/comm/trtllm_moe_alltoall.py _A2AState). ``dispatch`` sets "dispatched" after its op
#: returned (before sanitize); ``combine`` resets it only after its op returned.
A2A_STATE_ATTR = "_state"


def a2a_phase(instance: Any) -> str | None:
    """The phase of a ``MoeAlltoAll`` instance (None: not readable in this version)."""
    return getattr(getattr(instance, A2A_STATE_ATTR, None), "phase", None)


#: The default kernel backend of 0.7.1+ (``backend="trtllm"``).
A2A_DEFAULT_BACKEND = "trtllm"

# -- environment variables FlashInfer reads ----------------------------------------------------

#: Threading policy of the dispatch kernel until v0.6.13 (csrc/nv_internal/cpp/common/envUtils.cpp
#: getEnvMoeA2AOneBlockPerToken: ``static ... = getIntEnv(...)``, a function-static read once per
#: process at the first dispatch; std::stoi, default true, any value parsing to 0 turns it off).
#: Off is the WarpPolicy, which is broken: its "last token" counter (moeAlltoAllKernels.cu
#: moeA2ADispatchKernel, 4230a48) is bumped once per block's first warp, so with several warps per
#: block it counts blocks and no block publishes the receive counters and completion flags; ranks
#: that do publish wait for them and trap. FlashInfer removed the policy in v0.6.14 (19f1a41,
#: a28703432 "One sided MOE A2A warp token policy hangs in some cases"). The adapter refuses it.
ENV_ONE_BLOCK_PER_TOKEN = "TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN"
ONE_BLOCK_PER_TOKEN_UNTIL: Version = (0, 6, 14)
#: Block sizes of the dispatch/combine kernels, every version (envUtils.cpp
#: getEnvMoeA2ADispatchBlockSize / getEnvMoeA2ACombineBlockSize, function-statics, sanitizeBlockSize:
#: default 256, <= 0 → 256, clamped to 1024, rounded up to a multiple of 32). Performance only
#: (and the warps per block of the WarpPolicy above).
ENV_DISPATCH_BLOCK_SIZE = "TLLM_MOE_A2A_DISPATCH_BLOCK_SIZE"
ENV_COMBINE_BLOCK_SIZE = "TLLM_MOE_A2A_COMBINE_BLOCK_SIZE"
DEFAULT_BLOCK_SIZE = 256
WARP_SIZE = 32
#: NVFP4 "4over6" scale search in fp4_quantize, read on every call, on when exactly "1"
#: (envUtils.cpp getBoolEnv / getEnvNVFP4Use4Over6) from v0.6.12 (d768c14). It changes the
#: quantized bits and the global-scale recipe; from 0.7.1 ``fp4_quantize(nvfp4_4over6=None)``
#: ignores the environment (flashinfer-python==0.7.1 flashinfer/quantization/fp4_quantization.py).
ENV_NVFP4_4OVER6 = "FLASHINFER_NVFP4_4OVER6"
ENV_NVFP4_4OVER6_KNOBS = ("FLASHINFER_NVFP4_4OVER6_ERR_MODE", "FLASHINFER_NVFP4_4OVER6_ERR_USE_FAST_MATH",
                          "FLASHINFER_NVFP4_4OVER6_E4M3_USE_256")
NVFP4_4OVER6_SINCE: Version = (0, 6, 12)
NVFP4_4OVER6_ARG_SINCE: Version = (0, 7, 1)
#: Exact (not fast-math) reciprocals in the FP4 quantize kernels, read on every call
#: (envUtils.cpp getEnvDisableFP4QuantFastMath): TRTLLM_DISABLE_FP4_QUANT_FAST_MATH from v0.6.12
#: (flashinfer-ai/flashinfer@d768c14 csrc/nv_internal/cpp/common/envUtils.cpp), either it or
#: FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH from v0.6.13 (57ba7ee). On when exactly "1".
ENV_DISABLE_FP4_FAST_MATH = ("FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH", "TRTLLM_DISABLE_FP4_QUANT_FAST_MATH")
FP4_FAST_MATH_ENV_RULES: tuple[tuple[Version, tuple[str, ...]], ...] = (
    ((0, 6, 0), ()), ((0, 6, 12), ("TRTLLM_DISABLE_FP4_QUANT_FAST_MATH",)), ((0, 6, 13), ENV_DISABLE_FP4_FAST_MATH))
FP4_FAST_MATH_ENV_SINCE: Version = (0, 6, 12)
#: The variables another plugin may not set (``Backend.vendor_environment``): those FlashInfer reads that change the
#: all-to-all (above) or the CuTe-DSL runner's quantized activations (fp4_quantize: the 4over6 search and the fast-math
#: reciprocals). FlashInfer's Python side reads none (flashinfer-python==0.7.2.post1 flashinfer/comm/).
READ_ENVIRONMENT = (ENV_ONE_BLOCK_PER_TOKEN, ENV_DISPATCH_BLOCK_SIZE, ENV_COMBINE_BLOCK_SIZE, ENV_NVFP4_4OVER6,
                    *ENV_NVFP4_4OVER6_KNOBS, *ENV_DISABLE_FP4_FAST_MATH)
#: How FlashInfer reads a boolean variable: exactly "1" (envUtils.cpp getBoolEnv; Python
#: nvfp4_quantization_utils.env_flag_enabled).
ENV_TRUE = "1"


def env_flag(env: Any, name: str) -> bool:
    return env.get(name) == ENV_TRUE


def fp4_fast_math_env(version: Version) -> tuple[str, ...]:
    """The exact-math variables ``fp4_quantize`` reads in ``version`` (either one "1" switches)."""
    return tuple(_pick(FP4_FAST_MATH_ENV_RULES, version))


def cpp_stoi(text: str) -> int:
    """``std::stoi`` as FlashInfer's getIntEnv reads a variable: leading blanks, a sign, digits,
    the rest ignored. :raises ValueError: no digits (std::invalid_argument) or out of int32 range."""
    m = re.match(r"^[ \t\n\v\f\r]*([+-]?\d+)", text)
    if m is None:
        raise ValueError(f"std::invalid_argument: stoi({text!r})")
    value = int(m.group(1))
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"std::out_of_range: stoi({text!r})")
    return value


def one_block_per_token(env: Any, version: Version) -> bool | None:
    """What getEnvMoeA2AOneBlockPerToken returns in ``version`` (None: not read, v0.6.14+).
    :raises ValueError: a value std::stoi rejects (FlashInfer raises at the first dispatch)."""
    if version >= ONE_BLOCK_PER_TOKEN_UNTIL:
        return None
    text = env.get(ENV_ONE_BLOCK_PER_TOKEN)
    return True if text is None else cpp_stoi(text) != 0


def sanitize_block_size(text: str | None) -> int:
    """envUtils.cpp sanitizeBlockSize(getIntEnv(...)): the kernels' block size."""
    block = DEFAULT_BLOCK_SIZE if text is None else cpp_stoi(text)
    if block <= 0:
        block = DEFAULT_BLOCK_SIZE
    block = min(block, 1024)
    return (block + WARP_SIZE - 1) // WARP_SIZE * WARP_SIZE


def dispatch_vector_width(bytes_per_token: int) -> int:
    """The store width FlashInfer < 0.7.1 picks for a payload row (vectorized_dispatch)."""
    return next(w for w in DISPATCH_VECTOR_WIDTHS if bytes_per_token % w == 0)


def combine_reduction_pairs(top_k: int) -> list[tuple[int, int]]:
    """The combine kernel's adds ``acc[i] += acc[j]``, in order (see COMBINE_FP32_SINCE)."""
    pairs, stride = [], 1
    while stride < top_k:
        pairs += [(i, i + stride) for i in range(0, top_k, 2 * stride) if i + stride < top_k]
        stride *= 2
    return pairs


# -- MNNVL communicator (flashinfer/comm/mnnvl.py) ---------------------------------------------

#: ``MnnvlMemory.comm`` is class-level: ``set_comm_from_config(mapping, config)`` sets it to
#: ``config.comm_backend.Split(pp_rank * cp_size + cp_rank, tp_rank)``; without an mnnvl_config
#: ``get_comm`` falls back to ``MpiComm().Split(...)`` (mpi4py's COMM_WORLD: ImportError without
#: mpi4py, a one-rank world without mpirun). Every version (4230a48 ... 0.7.2.post1).
#: The methods a CommBackend has (flashinfer/comm/mnnvl.py CommBackend, an ABC until v0.6.15; a
#: Protocol in flashinfer/comm/abstractions.py from v0.6.16). Nothing checks isinstance.
_MNNVL = "flashinfer-ai/flashinfer@4230a48 flashinfer/comm/mnnvl.py CommBackend"
COMM_BACKEND_METHODS: tuple[VendorSignature, ...] = tuple(
    VendorSignature(f"CommBackend.{name}", text, _MNNVL) for name, text in (
        ("Get_rank", "(self)"), ("Get_size", "(self)"), ("allgather", "(self, data)"),
        ("bcast", "(self, data, root)"), ("barrier", "(self)"), ("Split", "(self, color, key)")))
#: ``TorchDistBackend.Split`` builds process groups from ``Get_rank()`` of the group it wraps,
#: i.e. correct for the WORLD group only (4230a48 and 8da13a2 flashinfer/comm/*.py), so the
#: adapter hands FlashInfer its own CommBackend whose Split is the identity it checks. Its
#: ``bcast`` maps the group root to a global rank from v0.6.13 (57ba7ee); before it passes
#: ``src=root`` as is.
TORCHDIST_BCAST_GLOBAL_ROOT_SINCE: Version = (0, 6, 13)
#: The MNNVL address reservation is class-level and per process (every version: 4230a48 ...
#: 0.7.2.post1 flashinfer/comm/mnnvl.py): ``new_mnnvl_memory_address`` reserves
#: ``current_rank_stride * comm_size`` bytes of VA for the comm of the allocation that needed it
#: (stride = the size rounded up to ``fabric_page_size``, 512 MiB); ``open_mnnvl_memory`` puts
#: every later allocation that fits (``current_mem_offset + aligned_size <= current_rank_stride``)
#: into that range and maps peer i at ``current_start_address + current_rank_stride * i +
#: current_mem_offset`` for every i < its own comm's size. An allocation over MORE ranks than the
#: reservation's maps outside it: ``cuMemMap`` fails (CUDA_ERROR_INVALID_VALUE).
MNNVL_FABRIC_PAGE_SIZE = 1 << 29
#: ``allocated_map[ptr]``: a tuple ``(mapping, aligned_size, mem_handles, start_address, rank_stride,
#: address_offset)`` until v0.6.14, an ``_MnnvlAllocationRecord`` (``comm_size``, ``start_address``,
#: ...) from v0.6.15 (8eccd0c).
MNNVL_RECORD_SINCE: Version = (0, 6, 15)
#: The MNNVL handle type (FABRIC or POSIX fd), and with it the handle exchange's collectives. Until
#: v0.6.15 ``get_allocation_prop`` picks FABRIC when ``platform.machine()`` is aarch64 (no collective;
#: flashinfer-ai/flashinfer@4230a48 / 8eccd0c flashinfer/comm/mnnvl.py). From v0.6.16
#: ``open_mnnvl_memory`` calls ``MnnvlMemory._resolve_fabric_support(comm, dev_id)`` after the size
#: allgather: it returns the class-level ``_fabric_supported`` when set, else AND-reduces every rank's
#: probe over the allocation's comm (``all_ranks_agree`` = ``all(comm.allgather(local))``, a
#: collective) and caches the result for the process ("All ranks must take the same handle-exchange
#: path or the collective deadlocks"; flashinfer-ai/flashinfer@8da13a2 ... fb28d72, 0.6.18 ...
#: 0.7.2.post1 mnnvl.py ``_resolve_fabric_support``, identical). Ranks of one allocation of which
#: some have it cached (an earlier allocation over another group) and some not issue different
#: collectives: the AND-reduce's allgather meets a peer's handle exchange.
MNNVL_FABRIC_AGREEMENT_SINCE: Version = (0, 6, 16)
#: 0.7.4 drops that process-wide decision: every allocation chooses its handle type collectively
#: (flashinfer-python==0.7.4 flashinfer/comm/mnnvl.py ``choose_mnnvl_handle_type``: an allgather of
#: (hostname, why not FABRIC, NVML cluster UUID); FABRIC on one host when every GPU supports it, else POSIX
#: fds; across hosts FABRIC in one NVLink domain or a RuntimeError naming each rank) and gathers every rank's
#: allocation error before any rank imports (``_create_and_import_handles``: all ranks raise together).
MNNVL_HANDLE_PER_ALLOCATION_SINCE: Version = EP_SINCE
MNNVL_FABRIC_ATTR = "_fabric_supported"
#: ``mnnvl_fabric_decision``'s values: the class-level decision (None / False / True) as an int
#: every rank can gather; ``MNNVL_FABRIC_ABSENT`` where the FlashInfer has no decision (< v0.6.16).
MNNVL_FABRIC_UNDECIDED, MNNVL_FABRIC_ABSENT = -1, -2


@dataclass(frozen=True)
class MnnvlReservation:
    """The MNNVL address range new allocations go into: the most ranks any of its allocations
    mapped (the comm that reserved it had at least that many), and the bytes per rank left.

    ``comm_size`` None: no allocation holds the range. ``new_mnnvl_memory_address`` sets the class
    state before ``_create_and_map_handles`` (cuMemCreate, the handle exchange, cuMemMap), and the
    record is written only after it: an allocation that failed in between (out of memory, the
    pidfd / SCM_RIGHTS exchange) leaves its range reserved for an unknown number of ranks, possibly
    with some of its own mappings in it, and nothing ever frees or replaces it (4230a48 ...
    0.7.2.post1 flashinfer/comm/mnnvl.py open_mnnvl_memory). A range whose allocations all closed is
    freed and the state reset (close_mnnvl_memory), so "no record" means exactly that."""

    comm_size: int | None
    room: int

    @property
    def orphaned(self) -> bool:
        return self.comm_size is None


def mnnvl_reservation(memory: Any) -> MnnvlReservation | None:
    """Read FlashInfer's class-level ``MnnvlMemory`` state (None: no range reserved)."""
    start = int(getattr(memory, "current_start_address", 0) or 0)
    stride = int(getattr(memory, "current_rank_stride", 0) or 0)
    if not start or stride <= 0:
        return None
    sizes = []
    for record in dict(getattr(memory, "allocated_map", {})).values():
        if hasattr(record, "comm_size"):
            size, where = int(record.comm_size), int(record.start_address)
        else:  # (mapping, aligned_size, mem_handles, start_address, rank_stride, address_offset)
            size, where = len(record[2]), int(record[3])
        if where == start:
            sizes.append(size)
    room = stride - int(getattr(memory, "current_mem_offset", 0) or 0)
    return MnnvlReservation(max(sizes) if sizes else None, room)


def retire_mnnvl_range(memory: Any) -> None:
    """Mark FlashInfer's current MNNVL address range full (``current_mem_offset =
    current_rank_stride``): the state FlashInfer itself leaves a full range in, so its next
    allocation reserves a new range over its own comm (``open_mnnvl_memory``: ``current_mem_offset
    + aligned_size > current_rank_stride`` → ``new_mnnvl_memory_address``, every version). Used for
    a range no allocation holds (``MnnvlReservation.orphaned``), which FlashInfer never frees anyway."""
    memory.current_mem_offset = memory.current_rank_stride



def mnnvl_fabric_decision(memory: Any) -> int:
    """FlashInfer's per-process FABRIC decision (``MnnvlMemory._fabric_supported``, v0.6.16+) as an
    int: ``MNNVL_FABRIC_ABSENT`` before v0.6.16 (no such state), ``MNNVL_FABRIC_UNDECIDED`` (None:
    the next ``open_mnnvl_memory`` runs the AND-reduce allgather), 0 (False) or 1 (True: cached,
    no collective)."""
    if not hasattr(memory, MNNVL_FABRIC_ATTR):
        return MNNVL_FABRIC_ABSENT
    decided = getattr(memory, MNNVL_FABRIC_ATTR)
    return MNNVL_FABRIC_UNDECIDED if decided is None else int(bool(decided))


def forget_mnnvl_fabric_decision(memory: Any) -> None:
    """Unset the decision (``_fabric_supported = None``, its class default): FlashInfer's next
    ``open_mnnvl_memory`` probes the device again and AND-reduces over that allocation's comm
    (``_resolve_fabric_support``, v0.6.16+), as in a process that never allocated. Done on every
    rank of a group at once, that is the collective every rank then makes."""
    if hasattr(memory, MNNVL_FABRIC_ATTR):
        setattr(memory, MNNVL_FABRIC_ATTR, None)

# -- recorded signatures ------------------------------------------------------------------------

_A2A = "flashinfer/comm/trtllm_moe_alltoall.py"
_CUTE = "flashinfer/fused_moe/cute_dsl/fused_moe.py"


@dataclass(frozen=True)
class SignatureRule:
    """``signature`` holds for versions in [since, until) (until None: open)."""

    since: Version
    until: Version | None
    signature: VendorSignature

    def covers(self, version: Version) -> bool:
        return version >= self.since and (self.until is None or version < self.until)


def _rule(since: Version, until: Version | None, qualname: str, text: str, source: str) -> SignatureRule:
    return SignatureRule(since, until, VendorSignature(qualname, text, source))


_INIT_A = ("(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None, hidden_size=None, "
           "mnnvl_config=None")
_DISPATCH_A = ("(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank, "
               "invalid_token_expert_id=None, expert_id_payload_index=None")
_COMBINE_A = "(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False"
_COMBINE_Q = ", output_dtype=None, output_scales=None, output_scalar_scale=1.0, sf_layout=SfLayout.layout_linear"
_WS_A = "(ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token"
_FP4_A = ("(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True, "
          "is_sf_8x4_layout=False")
_CUTE_A = ("(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False, max_num_tokens={mnt}, "
           "num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16, "
           "output_dtype=torch.bfloat16, device='cuda'")
_SWIGLU = (", enable_pdl=True, activation_type=ActivationType.Swiglu.value, swiglu_alpha=DEFAULT_SWIGLU_ALPHA, "
           "swiglu_beta=DEFAULT_SWIGLU_BETA, swiglu_limit=DEFAULT_SWIGLU_LIMIT")
_RUN_A = ("(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha, "
          "fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None")

#: Every vendor callable the adapters call (and the fakes define), per version range.
SIGNATURES: dict[str, tuple[SignatureRule, ...]] = {
    "MoeAlltoAll.__init__": (
        _rule((0, 6, 0), (0, 6, 16), "MoeAlltoAll.__init__", _INIT_A + ")",
              f"flashinfer-ai/flashinfer@4230a48 {_A2A} MoeAlltoAll.__init__"),
        _rule((0, 6, 16), (0, 7, 1), "MoeAlltoAll.__init__",
              _INIT_A + ", eplb_stats_num_experts=0, enable_rank_mask=False)",
              f"flashinfer-ai/flashinfer@8da13a2 {_A2A} MoeAlltoAll.__init__"),
        _rule((0, 7, 1), EP_SINCE, "MoeAlltoAll.__init__",
              _INIT_A + ", eplb_stats_num_experts=0, enable_rank_mask=False, *, backend='trtllm')",
              f"flashinfer-python==0.7.2.post1 {_A2A} MoeAlltoAll.__init__"),
    ),
    "MoeAlltoAll.dispatch": (
        _rule((0, 6, 0), (0, 6, 16), "MoeAlltoAll.dispatch", _DISPATCH_A + ")",
              f"flashinfer-ai/flashinfer@4230a48 {_A2A} MoeAlltoAll.dispatch"),
        _rule((0, 6, 16), EP_SINCE, "MoeAlltoAll.dispatch", _DISPATCH_A + ", eplb_local_stats=None, active_rank_mask=None)",
              f"flashinfer-ai/flashinfer@8da13a2 {_A2A} MoeAlltoAll.dispatch"),
    ),
    "MoeAlltoAll.combine": (
        _rule((0, 6, 0), (0, 6, 14), "MoeAlltoAll.combine", _COMBINE_A + ")",
              f"flashinfer-ai/flashinfer@4230a48 {_A2A} MoeAlltoAll.combine"),
        _rule((0, 6, 14), (0, 6, 16), "MoeAlltoAll.combine", _COMBINE_A + _COMBINE_Q + ")",
              f"flashinfer-ai/flashinfer@19f1a41 {_A2A} MoeAlltoAll.combine"),
        _rule((0, 6, 16), EP_SINCE, "MoeAlltoAll.combine",
              _COMBINE_A + _COMBINE_Q + ", output=None, *, use_low_precision=False, active_rank_mask=None)",
              f"flashinfer-ai/flashinfer@8da13a2 {_A2A} MoeAlltoAll.combine"),
    ),
    "moe_a2a_get_workspace_size_per_rank": (
        _rule((0, 6, 0), (0, 6, 16), "moe_a2a_get_workspace_size_per_rank", _WS_A + ")",
              f"flashinfer-ai/flashinfer@4230a48 {_A2A} moe_a2a_get_workspace_size_per_rank"),
        _rule((0, 6, 16), (0, 7, 1), "moe_a2a_get_workspace_size_per_rank", _WS_A + ", eplb_stats_num_experts=0)",
              f"flashinfer-ai/flashinfer@8da13a2 {_A2A} moe_a2a_get_workspace_size_per_rank"),
        _rule((0, 7, 1), EP_SINCE, "moe_a2a_get_workspace_size_per_rank",
              _WS_A + ", eplb_stats_num_experts=0, *, backend='trtllm')",
              f"flashinfer-python==0.7.2.post1 {_A2A} moe_a2a_get_workspace_size_per_rank"),
    ),
    "Mapping.__init__": (
        _rule((0, 6, 0), None, "Mapping.__init__",
              "(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, cp_config=None, tp_size=1, pp_size=1, "
              "moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1, attn_tp_size=-1, attn_cp_size=-1, "
              "auto_parallel=False, enable_attention_dp=False)",
              "flashinfer-ai/flashinfer@4230a48 flashinfer/comm/mapping.py Mapping.__init__ "
              "(same through 0.7.2.post1)"),
    ),
    "MnnvlConfig": (  # a dataclass: its generated __init__
        _rule((0, 6, 0), None, "MnnvlConfig",
              "(self, comm_backend=None, allocation_granularity=0, fabric_page_size=536870912)",
              "flashinfer-ai/flashinfer@4230a48 flashinfer/comm/mnnvl.py MnnvlConfig (fields, through 0.7.2.post1)"),
    ),
    "fp4_quantize": (
        _rule((0, 6, 0), (0, 6, 7), "fp4_quantize", _FP4_A + ", enable_pdl=None)",
              "flashinfer-ai/flashinfer@4230a48 flashinfer/fp4_quantization.py fp4_quantize"),
        # Moved in v0.6.7; flashinfer/fp4_quantization.py is a re-exporting stub from then on.
        _rule((0, 6, 7), (0, 6, 8), "fp4_quantize", _FP4_A + ", enable_pdl=None)",
              "flashinfer-ai/flashinfer@56ed540 flashinfer/quantization/fp4_quantization.py fp4_quantize"),
        _rule((0, 6, 8), (0, 6, 11), "fp4_quantize", _FP4_A + ", enable_pdl=None, backend='cuda')",
              "flashinfer-ai/flashinfer@b9372aa flashinfer/quantization/fp4_quantization.py fp4_quantize"),
        _rule((0, 6, 11), (0, 7, 1), "fp4_quantize",
              _FP4_A + ", is_global_scale_inversed=False, enable_pdl=None, backend='cuda')",
              "flashinfer-ai/flashinfer@98f48f8 flashinfer/quantization/fp4_quantization.py fp4_quantize"),
        _rule((0, 7, 1), EP_SINCE, "fp4_quantize",
              _FP4_A + ", is_global_scale_inversed=False, enable_pdl=None, backend='cuda', nvfp4_4over6=_UNSET)",
              "flashinfer-python==0.7.2.post1 flashinfer/quantization/fp4_quantization.py fp4_quantize"),
        # backend="auto": the same CUDA kernel unless batch_invariant=True (fp4_quantization.py:1137).
        _rule(EP_SINCE, None, "fp4_quantize",
              _FP4_A + ", is_global_scale_inversed=False, enable_pdl=None, backend='auto', nvfp4_4over6=_UNSET, *, "
              "batch_invariant=False)",
              "flashinfer-python==0.7.4 flashinfer/quantization/fp4_quantization.py fp4_quantize"),
    ),
    "CuteDslMoEWrapper.__init__": (
        _rule((0, 6, 4), (0, 6, 7), "CuteDslMoEWrapper.__init__", _CUTE_A.format(mnt=4096) + ")",
              f"flashinfer-ai/flashinfer@f1e6fdc {_CUTE} CuteDslMoEWrapper.__init__"),
        _rule((0, 6, 7), (0, 6, 14), "CuteDslMoEWrapper.__init__", _CUTE_A.format(mnt=4096) + ", enable_pdl=True)",
              f"flashinfer-ai/flashinfer@56ed540 {_CUTE} CuteDslMoEWrapper.__init__"),
        _rule((0, 6, 14), (0, 6, 15), "CuteDslMoEWrapper.__init__",
              _CUTE_A.format(mnt=None) + ", enable_pdl=True, activation='silu')",
              f"flashinfer-ai/flashinfer@19f1a41 {_CUTE} CuteDslMoEWrapper.__init__"),
        _rule((0, 6, 15), (0, 6, 16), "CuteDslMoEWrapper.__init__", _CUTE_A.format(mnt=None) + _SWIGLU + ")",
              f"flashinfer-ai/flashinfer@8eccd0c {_CUTE} CuteDslMoEWrapper.__init__"),
        _rule((0, 6, 16), (0, 6, 18), "CuteDslMoEWrapper.__init__",
              _CUTE_A.format(mnt=None) + _SWIGLU + ", use_fused_finalize=True)",
              f"flashinfer-ai/flashinfer@8da13a2 {_CUTE} CuteDslMoEWrapper.__init__"),
        _rule((0, 6, 18), EP_SINCE, "CuteDslMoEWrapper.__init__",
              _CUTE_A.format(mnt=None) + _SWIGLU + ", situ_beta=None, situ_linear_beta=None, use_fused_finalize=True, "
              "quant_mode='w4a4')",
              f"flashinfer-python==0.7.2.post1 {_CUTE} CuteDslMoEWrapper.__init__ (also fb28d72, 0.6.18)"),
        _rule(EP_SINCE, None, "CuteDslMoEWrapper.__init__",
              _CUTE_A.format(mnt=None) + _SWIGLU + ", situ_beta=None, situ_linear_beta=None, use_fused_finalize=True, "
              "quant_mode='w4a4', clamped_relu2_limit=None, swap_ab=False)",
              f"flashinfer-python==0.7.4 {_CUTE} CuteDslMoEWrapper.__init__"),
    ),
    "CuteDslMoEWrapper.run": (
        _rule((0, 6, 4), (0, 6, 16), "CuteDslMoEWrapper.run", _RUN_A + ")",
              f"flashinfer-ai/flashinfer@f1e6fdc {_CUTE} CuteDslMoEWrapper.run"),
        _rule((0, 6, 16), EP_SINCE, "CuteDslMoEWrapper.run", _RUN_A + ", *, per_token_scale=None)",
              f"flashinfer-ai/flashinfer@8da13a2 {_CUTE} CuteDslMoEWrapper.run"),
        _rule(EP_SINCE, None, "CuteDslMoEWrapper.run", _RUN_A + ", *, per_token_scale=None, nvfp4_4over6=_UNSET)",
              f"flashinfer-python==0.7.4 {_CUTE} CuteDslMoEWrapper.run"),
    ),
    # flashinfer.moe_ep (EP_SINCE on): the one-sided NVLink all-to-all.
    "create_communication": (
        _rule(EP_SINCE, None, "create_communication", "(bootstrap, params, backend, **options)",
              "flashinfer-python==0.7.4 flashinfer/moe_ep/core/comm/communication.py create_communication"),
    ),
    "BootstrapConfig": (  # a frozen dataclass: its generated __init__
        _rule(EP_SINCE, None, "BootstrapConfig",
              "(self, world_size, rank, stream=0, auto_bootstrap=True, nccl_comm=None, process_group=None, "
              "tcp_store=None, *, device=None)",
              "flashinfer-python==0.7.4 flashinfer/moe_ep/config.py BootstrapConfig"),
    ),
    "MoEEpCommParams": (
        _rule(EP_SINCE, None, "MoEEpCommParams",
              "(self, num_experts, top_k, max_tokens_per_rank, hidden_size, dtype=None, dispatch_format=None, "
              "invalid_expert_id=-1)",
              "flashinfer-python==0.7.4 flashinfer/moe_ep/core/comm/communication.py MoEEpCommParams"),
    ),
    "NVLinkOneSidedConfig": (
        _rule(EP_SINCE, None, "NVLinkOneSidedConfig",
              "(self, backend_name='nvlink_one_sided', extra_payload_bytes_per_token=0, eplb_stats_num_experts=0, "
              "enable_rank_mask=False, use_low_precision_combine=False, comm_backend=None, cft=None, "
              "cft_max_tokens_for_dispatch=128, cft_max_tokens_for_combine=128, lamport=None, "
              "lamport_max_tokens=None, timeout_sec=300, enable_pdl=None)",
              "flashinfer-python==0.7.4 flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/config.py"),
    ),
    "NVLinkOneSidedAlltoAll.__init__": (
        _rule(EP_SINCE, None, "NVLinkOneSidedAlltoAll.__init__", "(self, bootstrap, params, config=None)",
              f"{_EP} NVLinkOneSidedAlltoAll.__init__"),
    ),
    "NVLinkOneSidedAlltoAll.dispatch": (
        _rule(EP_SINCE, None, "NVLinkOneSidedAlltoAll.dispatch",
              "(self, hidden_states, topk_ids, topk_weights=None, *, hidden_states_scale=None, "
              "runtime_max_tokens_per_rank=None, eplb_local_stats=None, active_rank_mask=None)",
              f"{_EP} NVLinkOneSidedAlltoAll.dispatch"),
    ),
    "NVLinkOneSidedAlltoAll.combine": (
        _rule(EP_SINCE, None, "NVLinkOneSidedAlltoAll.combine", "(self, expert_output, *, output=None, "
              "active_rank_mask=None)", f"{_EP} NVLinkOneSidedAlltoAll.combine"),
    ),
}


def signature(qualname: str, version: Version) -> VendorSignature | None:
    """The recorded signature of ``qualname`` in ``version`` (None: the callable does not exist)."""
    for rule in SIGNATURES[qualname]:
        if rule.covers(version):
            return rule.signature
    return None


# -- CuTe-DSL MoE ---------------------------------------------------------------------------------

#: ``@supported_compute_capability([100, 103])`` on CuteDslMoEWrapper.__init__ (8da13a2; [100, 103,
#: 107] in 0.7.2.post1): compute capability 10.x.
CUTEDSL_MAJOR = 10
#: ActivationType.Swiglu (flashinfer/tllm_enums.py; 3 in 0.7.2.post1), the default activation_type.
ACTIVATION_SWIGLU = 3
#: SwiGLU defaults of activation_type-era wrappers (flashinfer/fused_moe/cute_dsl/fused_moe.py
#: DEFAULT_SWIGLU_*; inspect reads them as 1.0, 0.0 and float32 max in 0.7.2.post1).
DEFAULT_SWIGLU_ALPHA = 1.0
DEFAULT_SWIGLU_BETA = 0.0
DEFAULT_SWIGLU_LIMIT = 3.4028234663852886e38
#: w1 rows: up ("linear") and gate interleaved in groups of 64, up first (flashinfer-ai/flashinfer@f1e6fdc
#: tests/moe/test_cute_dsl_fused_moe.py interleave_linear_and_gate; 0.7.2.post1 fused_moe.py
#: cute_dsl_fused_moe: "interleaved 64-row up/gate pair").
W1_INTERLEAVE_GROUP = 64
W1_UP_FIRST = True
#: NVFP4: 16 elements per e4m3 block scale (sf_vec_size default 16, every version).
NVFP4_BLOCK = 16
#: The e4m3 scales of the weights are 128x4-swizzled and viewed as the MMA layout
#: (32, 4, ceil(M/128), 4, ceil(K/64), E) (flashinfer-ai/flashinfer@f1e6fdc flashinfer/cute_dsl/utils.py
#: convert_sf_to_mma_layout; tests/moe/test_cute_dsl_fused_moe.py create_moe_tensors).
#: ``make_ptr(..., assumed_align=N)`` asserts "pointer must be N bytes aligned"
#: (flashinfer-ai/flashinfer@f1e6fdc flashinfer/cute_dsl/utils.py _Pointer.__init__, which the host
#: wrappers import): 32 bytes for activations and weights, 16 for block scales. The kernels read
#: every tensor through its raw pointer with a layout fixed in the wrapper (gather fusion .py
#: ``make_ptr(b.data_ptr())``, ``b_scale.data_ptr()``, ``alpha.data_ptr()``): no stride is checked.
MAKE_PTR_ALIGN_DATA = 32
MAKE_PTR_ALIGN_SCALES = 16
#: Output rows of tokens with no local expert: v0.6.4-v0.6.6 allocate the output with
#: ``torch.empty`` and zero only routed rows (``moe_output_memset``, sparse:
#: flashinfer-ai/flashinfer@70b142b flashinfer/fused_moe/cute_dsl/fused_moe.py, csrc/nv_internal/
#: tensorrt_llm/kernels/cuteDslKernels/moeUtils.cu), so those rows are uninitialised; from v0.6.7
#: the output is zeroed densely (56ed540 fused_moe.py ``moe_output.zero_()``).
CUTEDSL_DENSE_ZERO_SINCE: Version = (0, 6, 7)
#: ``token_final_scales`` dtypes the finalize GEMM takes (f1e6fdc
#: blockscaled_contiguous_grouped_gemm_finalize_fusion.py): float32, bfloat16, float16.
TOKEN_FINAL_SCALES_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: From 0.6.18 ``run`` raises TypeError for activations that are not packed uint8 with
#: quant_mode='w4a4' (flashinfer-python==0.6.18 fused_moe.py cute_dsl_fused_moe_nvfp4; 0.7.0
#: CuteDslMoEWrapper.run "quant_mode='w4a4' requires packed uint8 input").
CUTEDSL_X_DTYPE_CHECK_SINCE: Version = (0, 6, 18)


@dataclass(frozen=True)
class RoutingLimits:
    """What ``moe_sort`` (the routing step ``run`` starts with) accepts for ``num_experts``."""

    max_experts: int
    multiple: int
    message: str  # what FlashInfer raises beyond ``max_experts``


#: ``moe_sort`` → routingDeepSeek::run with precomputed ids. Until v0.6.7 its FLASHINFER_CHECKs
#: (flashinfer-ai/flashinfer@f1e6fdc csrc/trtllm_fused_moe_routing_deepseek.cu: ``topK <= numExperts``,
#: ``numExperts <= MaxSupportedExpertCount`` = 512 "Routing kernel expects #experts %d  <= #threads %d",
#: ``numExperts % 4 == 0`` "... to be a multiple of 4."). From v0.6.8 the ids go to
#: runPostTopKPipeline (b9372aa csrc/fused_moe/trtllm_backend/trtllm_fused_moe_routing_common.cu),
#: whose tiers stop at MaxSupportedExperts = 2048 (include/flashinfer/trtllm/fused_moe/
#: RoutingCustomPolicy.cuh: FLASHINFER_WARN("Unsupported numExperts") and no kernel until v0.6.15;
#: FLASHINFER_CHECK "runPostTopKPipeline: no compiled tier covers numExperts=" from v0.6.16, 8da13a2).
CUTEDSL_ROUTING_RULES: tuple[tuple[Version, RoutingLimits], ...] = (
    ((0, 6, 4), RoutingLimits(512, 4, "Routing kernel expects #experts {e}  <= #threads 512")),
    ((0, 6, 8), RoutingLimits(2048, 1, "Unsupported numExperts")),
    ((0, 6, 16), RoutingLimits(2048, 1, "runPostTopKPipeline: no compiled tier covers numExperts={e} topK=1")),
)


def cutedsl_routing_limits(version: Version) -> RoutingLimits:
    return _pick(CUTEDSL_ROUTING_RULES, version)  # type: ignore[no-any-return]


#: fp4_quantize (Python wrapper, every version): a column-major input is transposed, anything else
#: reaches ``CHECK_CONTIGUOUS(self)`` and ``TVM_FFI_ICHECK_GE(rank, 2)`` (csrc/nv_internal/tensorrt_llm/
#: thop/fp4Quantize.cpp), leading dims flattened into M. Swizzled scales come back
#: ``reshape(-1, K/16)`` until v0.6.7 (a torch error when K/16 % 4 != 0, the buffer being padded),
#: ``reshape(-1, round_up(K/16, 4))`` from v0.6.8 (b9372aa). The global scale is read through a raw
#: fp32 pointer until v0.6.12 (the dtype check commented out, f1e6fdc fp4Quantize.cpp:44); from v0.6.13
#: Python casts it to float32 on the input's device (57ba7ee) and C++ checks it.
FP4_SF_PADDED_COLS_SINCE: Version = (0, 6, 8)
FP4_GLOBAL_SCALE_CAST_SINCE: Version = (0, 6, 13)

# -- the ported workspace formula (csrc/trtllm_moe_alltoall.cu calculateOffsets) -------------------


def pad128(n: int) -> int:
    return -(-n // CACHELINE) * CACHELINE


def metainfo_offsets(ep_size: int, max_num_tokens: int, version: Version,
                     eplb_stats_num_experts: int = 0) -> dict[str, int]:
    """``calculateOffsets(epSize, maxNumTokens[, eplbStatsNumExperts])`` by field name
    (flashinfer-ai/flashinfer@4230a48 / 8da13a2 csrc/trtllm_moe_alltoall.cu)."""
    i32 = 4
    k = max_top_k(version)
    off: dict[str, int] = {}
    o = 0
    off["FLAG_VAL"] = o
    o += i32
    off["LOCAL_TOKEN_COUNTER"] = o
    o += i32
    off["SEND_COUNTERS"] = o
    o += ep_size * i32
    off["RECV_COUNTERS"] = o
    o += ep_size * i32
    o = pad128(o)
    off["DISPATCH_COMPLETION_FLAGS"] = o
    o = pad128(o + ep_size * i32)
    off["COMBINE_COMPLETION_FLAGS"] = o
    o = pad128(o + ep_size * i32)
    off["TOPK_TARGET_RANKS"] = o
    o = pad128(o + max_num_tokens * k * i32)
    off["TOPK_SEND_INDICES"] = o
    o = pad128(o + max_num_tokens * k * i32)
    if version >= EPLB_SINCE:
        off["EPLB_GATHERED_STATS"] = o
        o = pad128(o + ep_size * eplb_stats_num_experts * i32)
    off["PAYLOAD_DATA"] = o
    return off


def aux_data_size(ep_size: int, max_num_tokens: int, version: Version, eplb_stats_num_experts: int = 0) -> int:
    """``moe_a2a_get_aux_data_size``: the metadata ahead of the payloads."""
    return metainfo_offsets(ep_size, max_num_tokens, version, eplb_stats_num_experts)["PAYLOAD_DATA"]


def ported_workspace_size_per_rank(ep_size: int, max_num_tokens: int, dispatch_bytes_per_token: int,
                                   combine_bytes_per_token: int, version: Version) -> int:
    """``moe_a2a_get_workspace_size_per_rank`` (flashinfer-ai/flashinfer@4230a48 ... 0.7.2.post1
    flashinfer/comm/trtllm_moe_alltoall.py): pad128(aux) + pad128(R·T·dispatch) + pad128(R·T·combine)."""
    slots = ep_size * max_num_tokens
    return (pad128(aux_data_size(ep_size, max_num_tokens, version)) + pad128(slots * dispatch_bytes_per_token)
            + pad128(slots * combine_bytes_per_token))


# -- per-version profile -------------------------------------------------------------------------


def max_top_k(version: Version) -> int:
    return int(_pick(MAX_TOP_K_RULES, version))


def top_k_values(version: Version) -> frozenset[int]:
    return frozenset(_pick(TOP_K_VALUES_RULES, version))


def kernel_top_k(top_k: int, version: Version) -> int | None:
    """The smallest top-k the kernels are built for that holds ``top_k`` ids (None: none does)."""
    fits = [k for k in top_k_values(version) if k >= top_k]
    return min(fits) if fits else None


@dataclass(frozen=True)
class A2AProfile:
    """What MoeAlltoAll does in one FlashInfer version (every field cited above)."""

    version: Version
    max_top_k: int
    top_k_values: frozenset[int]
    max_payloads: int
    uneven_experts: bool
    metainfo_names: tuple[str, ...]
    cache_key: tuple[str, ...]
    combine_quant: bool
    eplb: bool
    backend_kw: bool
    deprecated: bool
    reads_one_block_per_token: bool
    unmapped_check: bool
    init_barrier: bool
    plane_alignment_fixed: bool
    fp32_combine: bool
    mnnvl_records: bool
    bcast_global_root: bool
    one_sided: bool  # flashinfer.moe_ep's NVLinkOneSidedAlltoAll (EP_SINCE on) instead of MoeAlltoAll
    max_ranks: int = MAX_RANKS


def profile(version: Version) -> A2AProfile:
    return A2AProfile(
        version=version,
        max_top_k=max_top_k(version),
        top_k_values=top_k_values(version),
        max_payloads=int(_pick(MAX_PAYLOADS_RULES, version)),
        uneven_experts=version >= UNEVEN_EXPERTS_SINCE,
        metainfo_names=METAINFO_NAMES_0_6_16 if version >= EPLB_SINCE else METAINFO_NAMES_0_6_0,
        cache_key=tuple(_pick(CACHE_KEY_RULES, version)),
        combine_quant=version >= COMBINE_QUANT_SINCE,
        eplb=version >= EPLB_SINCE,
        backend_kw=version >= A2A_BACKEND_SINCE,
        deprecated=version >= A2A_DEPRECATED_SINCE,
        reads_one_block_per_token=version < ONE_BLOCK_PER_TOKEN_UNTIL,
        unmapped_check=version >= A2A_UNMAPPED_CHECK_SINCE,
        init_barrier=version >= A2A_INIT_BARRIER_SINCE,
        plane_alignment_fixed=version >= PLANE_ALIGNMENT_FIXED_SINCE,
        fp32_combine=version >= COMBINE_FP32_SINCE,
        mnnvl_records=version >= MNNVL_RECORD_SINCE,
        bcast_global_root=version >= TORCHDIST_BCAST_GLOBAL_ROOT_SINCE,
        one_sided=version >= EP_SINCE,
        max_ranks=EP_MAX_RANKS if version >= EP_SINCE else MAX_RANKS,
    )


# -- what FlashInfer raises when the machine cannot run it -----------------------------------------

#: Messages of FlashInfer's own refusals of the environment (not of the adapter's calls): the MNNVL
#: handle exchange (flashinfer-ai/flashinfer@4230a48 flashinfer/comm/mnnvl.py open_mnnvl_memory:
#: "pidfd_open(...) failed", "pidfd_getfd(...) failed" (container without SYS_PTRACE, kernel < 5.6);
#: flashinfer-python==0.7.2.post1 mnnvl.py "[MnnvlMemory] POSIX fd exchange via SCM_RIGHTS requires
#: all ranks to share the same host"), the driver refusing the handle type (checkCudaErrors:
#: "CUDA error code=801(CUDA_ERROR_NOT_SUPPORTED)"), and the JIT build (0.7.2.post1
#: flashinfer/jit/cpp_ext.py "Ninja build failed.", "Could not find nvcc", "nvcc not found";
#: jit/core.py MissingJITCacheError, "FlashInfer requires GPUs with sm75 or higher").
ENVIRONMENT_REFUSALS: tuple[str, ...] = (
    "pidfd_open(", "pidfd_getfd(", "[MnnvlMemory] POSIX fd exchange", "CUDA_ERROR_NOT_SUPPORTED",
    "Ninja build failed", "Could not find nvcc", "nvcc not found", "MissingJITCacheError",
    "FlashInfer requires GPUs with sm75",
    # 0.7.4: flashinfer/comm/mnnvl.py allocate_mnnvl_handles / choose_mnnvl_handle_type; moe_ep nvlink_common.py:83-89.
    "[MNNVL] allocating memory shared through", "[MNNVL] memory shared across hosts", "NVLink backends are not supported")


def is_environment_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is FlashInfer refusing this machine."""
    seen: BaseException | None = exc
    while seen is not None:
        text = f"{type(seen).__name__}: {seen}"
        if any(marker in text for marker in ENVIRONMENT_REFUSALS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# -- flashinfer.moe_ep's one-sided NVLink all-to-all (0.7.4+) -------------------------------------

#: ``create_communication(bootstrap, params, backend=NVLinkOneSidedConfig(...))`` returns an
#: ``NVLinkOneSidedAlltoAll`` (flashinfer/moe_ep/core/comm/communication.py; ``MoEEpLayer(...,
#: backend=SplitConfig(comm=NVLinkOneSidedConfig()))`` wraps the same object with its own inner kernel).
#: Its contract (communication.py module docstring): ``dispatch`` returns ``ep_size * T`` receive rows, each
#: token at most once per rank with its full top-k routing as GLOBAL ids, rows without a token all
#: ``invalid_expert_id``; the expert computation weights and reduces over the rank's local experts, one
#: output row per received row; ``combine`` sums a token's per-rank rows on its source rank.
#: The kernels send a pick only for ``0 <= id < num_experts`` (moeAlltoAllKernels.cu:303 ``valid_expert``):
#: -1 goes nowhere, so the kernel's top-k is padded with -1 (weights 0) and -1 needs no replacement.
#: Top-k values the kernels are built for (``_SUPPORTED_TOP_K``: ValueError otherwise; SWITCH_TOP_K).
EP_TOP_K_VALUES = frozenset({1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 22})
#: kMaxRanks (moeAlltoAllKernels.h:31), read as ``layout_constants().MAX_RANKS`` (ValueError past it).
EP_MAX_RANKS = 256
#: Every source payload (and combine's input) must start 16-byte aligned (moeA2ADispatchOp, moeA2ACombineOp:
#: "payload must be 16-byte aligned"); each receive plane starts on kCachelineAlignment (128) itself.
EP_PAYLOAD_ALIGNMENT = 16
#: kWorkspaceAlignment (moeAlltoAllMeta.h:123): each capacity of the layout is padded to it.
EP_WORKSPACE_ALIGNMENT = 256
#: kMaxPayloads (moeAlltoAllKernels.h:30); the layout reserves one alignment per payload.
EP_MAX_PAYLOADS = 4
#: The dispatch format ``MoEEpCommParams.dispatch_format`` names (flashinfer.fused_moe.api.QuantFormat) for
#: each wire dtype the backend sends, the bytes it reserves per token being ours: BF16 rows (None),
#: DeepSeekFp8 = H + 4·ceil(H/128) (FP8 with fp32 scales per 128), NVFP4 = H/2 + H/16
#: (core/comm/communication.py ``_DISPATCH_BYTES_PER_TOKEN``).
EP_DISPATCH_FORMATS = {"bf16": None, "fp8": "DeepSeekFp8", "nvfp4": "NVFP4"}


def ep_bytes_per_token(dtype: str, hidden: int) -> int:
    """``MoEEpCommParams.dispatch_bytes_per_token`` for the dispatch format of ``dtype`` (a wire dtype's value)."""
    return {"bf16": 2 * hidden, "fp8": hidden + 4 * -(-hidden // 128),
            "nvfp4": -(-hidden // 2) + -(-hidden // 16)}[dtype]
#: ``NVLinkOneSidedAlltoAll._WORKSPACES``: class-level, keyed by (ep_rank, ep_size, the layout): instances
#: with one layout share ONE workspace and must run their rounds one after another (nvlink_common.py
#: ``check_round_owner`` raises otherwise). ``_round`` is None between a combine and the next dispatch.
EP_ROUND_ATTR = "_round"
#: The metainfo fields, in order (moeAlltoAllMeta.h MoeA2AMetaInfoIndex, NUM_METAINFO_FIELDS 33).
EP_METAINFO_NAMES = (
    "FLAG_VAL_OFFSET", "LOCAL_TOKEN_COUNTER_OFFSET", "SEND_COUNTERS_OFFSET", "RECV_COUNTERS_OFFSET",
    "DISPATCH_COMPLETION_FLAGS_OFFSET", "DISPATCH_COUNTED_WRITE_COUNTERS_OFFSET", "DISPATCH_COUNTER_BASELINE_OFFSET",
    "TOPK_TARGET_RANKS_OFFSET", "TOPK_TARGET_INDICES_OFFSET", "EPLB_GATHERED_STATS_OFFSET", "DISPATCH_PAYLOAD_OFFSET",
    "DISPATCH_PAYLOAD_SIZE", "COMBINE_COMPLETION_FLAGS_OFFSET", "COMBINE_COUNTED_WRITE_COUNTERS_OFFSET",
    "COMBINE_COUNTER_BASELINE_OFFSET", "COMBINE_INPUT_OFFSET", "COMBINE_INPUT_SIZE", "COMBINE_RECV_OFFSET",
    "COMBINE_RECV_SIZE", "MAX_NUM_TOKENS", "TOP_K", "EP_SIZE", "EPLB_STATS_NUM_EXPERTS", "CFT_ENABLED",
    "WORKSPACE_SIZE", "LAMPORT_MAX_NUM_TOKENS", "LAMPORT_PAYLOAD_FORMAT", "LAMPORT_HIDDEN_SIZE",
    "LAMPORT_STATE_OFFSET", "LAMPORT_LANDING_OFFSET", "LAMPORT_COMBINE_LANDING_OFFSET", "LAMPORT_RECV_OFFSET",
    "LAMPORT_RECV_SIZE")


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def ep_dispatch_bytes(tokens: int, bytes_per_token: int, top_k: int, extra_per_token: int = 0) -> int:
    """The dispatch capacity ``NVLinkOneSidedAlltoAll.__init__`` asks the layout for (``tokens = R·T``)."""
    return tokens * (bytes_per_token + 2 * top_k * 4 + extra_per_token) + EP_MAX_PAYLOADS * EP_WORKSPACE_ALIGNMENT


def ep_workspace_layout(ep_size: int, max_tokens: int, top_k: int, dispatch_bytes: int, combine_input_bytes: int,
                        eplb_stats_num_experts: int = 0) -> dict[str, int]:
    """``calculateWorkspaceLayout`` (csrc/nvlink_one_sided_alltoall.cu:125-208) without CFT (no counted-write
    regions: an SM90 GPU, or a driver before the 615 branch) and without Lamport regions: offsets and sizes."""
    layout = dict.fromkeys(EP_METAINFO_NAMES, 0)
    offset = 0

    def reserve(name: str, nbytes: int, alignment: int = 4) -> None:
        nonlocal offset
        offset = _align(offset, alignment)
        layout[name] = offset
        offset += nbytes

    counts = ep_size * 4
    reserve("FLAG_VAL_OFFSET", 4)
    reserve("LOCAL_TOKEN_COUNTER_OFFSET", 4)
    reserve("SEND_COUNTERS_OFFSET", counts)
    reserve("RECV_COUNTERS_OFFSET", 2 * counts)  # two rounds' worth (round_parity)
    reserve("DISPATCH_COMPLETION_FLAGS_OFFSET", counts, CACHELINE)
    reserve("TOPK_TARGET_RANKS_OFFSET", max_tokens * top_k * 4, CACHELINE)
    reserve("TOPK_TARGET_INDICES_OFFSET", max_tokens * top_k * 4, CACHELINE)
    reserve("EPLB_GATHERED_STATS_OFFSET", ep_size * eplb_stats_num_experts * 4, CACHELINE)
    reserve("DISPATCH_PAYLOAD_OFFSET", _align(dispatch_bytes, EP_WORKSPACE_ALIGNMENT), EP_WORKSPACE_ALIGNMENT)
    layout["DISPATCH_PAYLOAD_SIZE"] = _align(dispatch_bytes, EP_WORKSPACE_ALIGNMENT)
    reserve("COMBINE_COMPLETION_FLAGS_OFFSET", counts, CACHELINE)
    reserve("COMBINE_INPUT_OFFSET", _align(combine_input_bytes, EP_WORKSPACE_ALIGNMENT), EP_WORKSPACE_ALIGNMENT)
    layout["COMBINE_INPUT_SIZE"] = _align(combine_input_bytes, EP_WORKSPACE_ALIGNMENT)
    layout.update(MAX_NUM_TOKENS=max_tokens, TOP_K=top_k, EP_SIZE=ep_size,
                  EPLB_STATS_NUM_EXPERTS=eplb_stats_num_experts, WORKSPACE_SIZE=offset)
    return layout


def ep_distinct_extra(slot: int, ep_size: int, max_tokens: int) -> int:
    """``extra_payload_bytes_per_token`` of a dispatcher's workspace ``slot`` (from 0): (slot + 1) × the least whole
    bytes per token whose ``R·T`` rows add a full kWorkspaceAlignment, so every slot's layout (the workspace cache
    key) differs after padding from the others' and from that of an instance FlashInfer's users build with the
    default 0 (vLLM's, sglang's, FlashInfer's own tests)."""
    return (slot + 1) * -(-EP_WORKSPACE_ALIGNMENT // (ep_size * max_tokens))


#: ``NVLinkOneSidedConfig(cft=False, lamport=False)``: the fence transport only. CFT counted writes (compute capability
#: 10+, a 615+ driver) and the Lamport transport (10.x) each add workspace regions FlashInfer sizes itself (the CFT
#: combine inbox R·T·2H in every workspace though one per process binds CFT; the Lamport landing rows) and place rows
#: otherwise; neither has run on hardware here nor is in the fakes, so the adapter asks for neither and plans the
#: workspace it allocates. (communication.py ``_cft_unsupported_reason``, ``_lamport_unsupported_reason``, the layout.)
EP_TRANSPORTS = {"cft": False, "lamport": False}


EP_WORKSPACES_ATTR = "_WORKSPACES"


def ep_cached_layouts(cls: Any, ep_rank: int, ep_size: int) -> list[dict[str, int]]:
    """The layouts of the workspaces ``NVLinkOneSidedAlltoAll._WORKSPACES`` holds for (ep_rank, ep_size)."""
    return [dict(zip(EP_METAINFO_NAMES, key[2])) for key in getattr(cls, EP_WORKSPACES_ATTR, {})
            if tuple(key[:2]) == (ep_rank, ep_size) and len(key[2]) == len(EP_METAINFO_NAMES)]


def ep_round_open(instance: Any) -> bool:
    """Whether an ``NVLinkOneSidedAlltoAll`` has a dispatch awaiting its combine (its ``_round``)."""
    return getattr(instance, EP_ROUND_ATTR, None) is not None


# -- detect() ---------------------------------------------------------------------------------------

#: Where each entry point lives (first that resolves). ``flashinfer.CuteDslMoEWrapper`` is only
#: there when every CuTe-DSL module imports (0.7.2.post1 also needs triton for SM12x kernels),
#: so the defining module is tried last.
PATHS: dict[str, tuple[str, ...]] = {
    "fp4_quantize": ("fp4_quantize",),
    "CuteDslMoEWrapper": ("CuteDslMoEWrapper", "fused_moe.CuteDslMoEWrapper",
                          "fused_moe.cute_dsl.fused_moe.CuteDslMoEWrapper"),
    "MoeAlltoAll": ("comm.MoeAlltoAll", "comm.trtllm_moe_alltoall.MoeAlltoAll"),
    "Mapping": ("comm.Mapping", "comm.mapping.Mapping"),
    "MnnvlConfig": ("comm.mnnvl.MnnvlConfig",),
    "MnnvlMemory": ("comm.mnnvl.MnnvlMemory",),
    "moe_a2a_get_workspace_size_per_rank": ("comm.moe_a2a_get_workspace_size_per_rank",
                                            "comm.trtllm_moe_alltoall.moe_a2a_get_workspace_size_per_rank"),
    "create_communication": ("moe_ep.create_communication",),
    "BootstrapConfig": ("moe_ep.BootstrapConfig",),
    "MoEEpCommParams": ("moe_ep.MoEEpCommParams",),
    "NVLinkOneSidedConfig": ("moe_ep.NVLinkOneSidedConfig",),
    "NVLinkOneSidedAlltoAll": ("moe_ep.NVLinkOneSidedAlltoAll",),
    "QuantFormat": ("fused_moe.api.QuantFormat",),
    "get_nvlink_one_sided_alltoall_module": (
        "moe_ep.backends.split.comm.nvlink_one_sided.kernels.get_nvlink_one_sided_alltoall_module",),
}
#: The names each all-to-all generation has: looked for only in its versions (a missing one is a reason).
_A2A_ONLY = ("MoeAlltoAll", "Mapping", "moe_a2a_get_workspace_size_per_rank")
_EP_ONLY = ("create_communication", "BootstrapConfig", "MoEEpCommParams", "NVLinkOneSidedConfig", "QuantFormat",
            "NVLinkOneSidedAlltoAll",
            "get_nvlink_one_sided_alltoall_module")


@dataclass(frozen=True)
class FlashInferAPI:
    """The vendor entry points the plugin calls, wherever this FlashInfer version keeps them."""

    fp4_quantize: Any
    CuteDslMoEWrapper: Any
    MoeAlltoAll: Any
    Mapping: Any
    MnnvlConfig: Any
    MnnvlMemory: Any
    moe_a2a_get_workspace_size_per_rank: Any
    create_communication: Any = None
    BootstrapConfig: Any = None
    MoEEpCommParams: Any = None
    NVLinkOneSidedConfig: Any = None
    QuantFormat: Any = None
    get_nvlink_one_sided_alltoall_module: Any = None
    NVLinkOneSidedAlltoAll: Any = None


@dataclass(frozen=True)
class VendorInfo:
    module_name: str
    api: FlashInferAPI | None
    version_text: str
    error: str | None
    fake: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def version(self) -> Version | None:
        return parse_version(self.version_text)

    def a2a_profile(self) -> A2AProfile:
        """The all-to-all behaviour of this version (the newest verified one when unknown)."""
        return profile(self.version or VERIFIED_UNTIL)

    def a2a_reason(self) -> str | None:
        """None when this FlashInfer has a usable MoeAlltoAll, else why not."""
        if self.api is None:
            return self.describe()
        v = self.version
        if v is not None and v < A2A_SINCE:
            return f"{self.describe()}; MoeAlltoAll needs FlashInfer >= {_text(A2A_SINCE)}"
        if self.a2a_profile().one_sided:
            missing = [n for n in _EP_ONLY if getattr(self.api, n) is None]
            return f"{self.describe()}; flashinfer.moe_ep lacks {', '.join(missing)} ({'; '.join(self.notes)})" \
                if missing else None
        if self.api.MoeAlltoAll is None:
            return f"{self.describe()}; MoeAlltoAll is not importable ({'; '.join(self.notes) or 'not found'})"
        if self.api.MnnvlConfig is None:
            return f"{self.describe()}; flashinfer.comm.mnnvl.MnnvlConfig is missing"
        return None

    def cutedsl_reason(self) -> str | None:
        if self.api is None:
            return self.describe()
        v = self.version
        if v is not None and v < CUTEDSL_SINCE:
            return f"{self.describe()}; CuteDslMoEWrapper needs FlashInfer >= {_text(CUTEDSL_SINCE)}"
        if self.api.CuteDslMoEWrapper is None:
            return f"{self.describe()}; CuteDslMoEWrapper is not importable here"
        return None

    def describe(self) -> str:
        if self.api is None:
            return f"{self.module_name} is not usable ({self.error})"
        what = f"fake of FlashInfer {self.version_text}" if self.fake else f"FlashInfer {self.version_text}"
        a2a = self.api.create_communication or self.api.MoeAlltoAll
        parts = [n for n, ok in (("CuTe-DSL MoE", self.api.CuteDslMoEWrapper), ("MoE all-to-all", a2a)) if ok is not None]
        text = f"{what}: {', '.join(parts) or 'neither CuTe-DSL MoE nor MoE all-to-all'}"
        if self.version is not None and self.version[:3] > VERIFIED_UNTIL:
            text += f" (newer than {_text(VERIFIED_UNTIL)}, the last version checked)"
        if self.api.MoeAlltoAll is not None and self.version is not None and self.version >= A2A_DEPRECATED_SINCE:
            text += "; its MoeAlltoAll is deprecated in favour of flashinfer.moe_ep (the adapter silences that warning)"
        return text


def _text(v: Version) -> str:
    return ".".join(map(str, v))


def _find(module: ModuleType, paths: tuple[str, ...], notes: list[str]) -> Any:
    """The first of ``paths`` (dotted, relative to ``module``) that resolves."""
    for path in paths:
        obj: Any = module
        try:
            for part in path.split("."):
                if hasattr(obj, part):
                    obj = getattr(obj, part)
                else:
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
        except Exception as exc:  # noqa: BLE001 - a missing submodule is "not there"
            notes.append(f"{module.__name__}.{path}: {type(exc).__name__}: {exc}")
            continue
        return obj
    return None


#: Set (True) by a module that stands in for FlashInfer (the testing distribution's fakes), never by FlashInfer: what
#: ``detect`` reads to plan a stand-in for CPU memory.
EMULATION_MARKER = "MOE_DISPATCH_STANDS_IN_FOR_FLASHINFER"


def detect(module_name: str = REAL) -> VendorInfo:
    """Import ``module_name`` (FlashInfer, or a module standing in for it: a fake of the testing
    distribution, marked ``EMULATION_MARKER``) and find the entry points."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
        return VendorInfo(module_name, None, "", f"{type(exc).__name__}: {exc}", module_name != REAL)
    fake = bool(getattr(module, EMULATION_MARKER, False))
    version_text = str(getattr(module, "__version__", ""))
    one_sided = (parse_version(version_text) or VERIFIED_UNTIL) >= EP_SINCE
    skip = _A2A_ONLY if one_sided else _EP_ONLY
    notes: list[str] = []
    found = {name: None if name in skip else _find(module, paths, notes) for name, paths in PATHS.items()}
    return VendorInfo(module_name, FlashInferAPI(**found), version_text, None, fake, tuple(notes))


def workspace_size_per_rank(info: VendorInfo, ep_size: int, max_num_tokens: int, dispatch_bytes_per_token: int,
                            combine_bytes_per_token: int, *, planning: bool) -> tuple[int, str]:
    """Bytes of one workspace and where the number came from.

    FlashInfer's own ``moe_a2a_get_workspace_size_per_rank`` when it is installed and can run
    (it calls the JIT-compiled module's ``moe_a2a_get_aux_data_size``: a fake, or the real one on a
    CUDA machine). For ``planning`` elsewhere, the ported formula with this version's kMaxTopK
    (the newest verified version's when FlashInfer is missing: kMaxTopK only grew)."""
    fn: Callable[..., int] | None = info.api.moe_a2a_get_workspace_size_per_rank if info.api else None
    if fn is not None and (info.fake or torch.cuda.is_available() or not planning):
        return int(fn(ep_size, max_num_tokens, dispatch_bytes_per_token, combine_bytes_per_token)), \
            f"{info.module_name}.moe_a2a_get_workspace_size_per_rank"
    version = info.version or VERIFIED_UNTIL
    return ported_workspace_size_per_rank(ep_size, max_num_tokens, dispatch_bytes_per_token, combine_bytes_per_token,
                                          version), f"ported formula (kMaxTopK {max_top_k(version)})"


def ep_workspace_bytes(info: VendorInfo, ep_size: int, max_tokens: int, top_k: int, dispatch_bytes: int,
                       combine_bytes: int, *, planning: bool) -> tuple[int, str]:
    """Bytes of one ``NVLinkOneSidedAlltoAll`` workspace without CFT and Lamport regions, and where the number
    came from: the compiled module's ``moe_a2a_get_workspace_layout`` when it can run (as for
    ``workspace_size_per_rank``), else the port (``ep_workspace_layout``). CFT (compute capability 10+, a 615+
    driver) adds counted-write regions and a combine inbox, the Lamport transport (10.x) its landing rows."""
    loader = info.api.get_nvlink_one_sided_alltoall_module if info.api else None
    if loader is not None and (info.fake or torch.cuda.is_available() or not planning):
        metainfo = torch.zeros(len(EP_METAINFO_NAMES), dtype=torch.int64)
        loader().moe_a2a_get_workspace_layout(ep_size, max_tokens, top_k, dispatch_bytes, combine_bytes, 0, 0, False,
                                              metainfo)
        return int(metainfo[EP_METAINFO_NAMES.index("WORKSPACE_SIZE")]), \
            f"{info.module_name}'s moe_a2a_get_workspace_layout"
    layout = ep_workspace_layout(ep_size, max_tokens, top_k, dispatch_bytes, combine_bytes)
    return layout["WORKSPACE_SIZE"], "ported calculateWorkspaceLayout (no CFT, no Lamport)"


def sm100_reason() -> str | None:
    """None on an SM100-class GPU (compute capability 10.x), else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (the CuTe-DSL MoE kernels need an SM100-class GPU: B200, GB200, B300)"
    major, minor = torch.cuda.get_device_capability()
    if major != CUTEDSL_MAJOR:
        return f"the CuTe-DSL MoE kernels need an SM100-class GPU (compute capability 10.x); this one is {major}.{minor}"
    return None


__all__ = [
    "READ_ENVIRONMENT",
    "A2AProfile", "FlashInferAPI", "INSTALL_HINT", "MnnvlReservation", "REAL", "RoutingLimits",
    "SIGNATURES", "SignatureRule", "VendorInfo", "Version", "a2a_phase", "aux_data_size", "combine_reduction_pairs",
    "cpp_stoi", "cutedsl_routing_limits", "default_workspace_bytes_per_token", "detect", "dispatch_vector_width",
    "forget_mnnvl_fabric_decision", "fp4_fast_math_env", "is_environment_refusal", "kernel_top_k", "metainfo_offsets", "mnnvl_fabric_decision",
    "mnnvl_reservation",
    "one_block_per_token", "parse_version", "ported_workspace_size_per_rank", "profile", "retire_mnnvl_range",
    "sanitize_block_size", "signature", "sm100_reason", "workspace_size_per_rank",
    "ep_bytes_per_token", "ep_cached_layouts", "ep_dispatch_bytes", "ep_distinct_extra", "ep_round_open", "ep_workspace_bytes", "ep_workspace_layout",
]
