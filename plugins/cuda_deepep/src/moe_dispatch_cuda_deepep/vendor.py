"""The vendor boundary of cuda_deepep: every DeepEP and DeepGEMM fact the adapter and the fakes use.

Each fact carries its source as ``owner/repo@commit path [symbol]`` (read from the local mirrors of
deepseek-ai/DeepEP and deepseek-ai/DeepGEMM). Sizes and layouts the vendor computes itself are called
through the installed module (``dispatch_config``, ``nvl_buffer_size_hint``, ``low_latency_rdma_size_hint``,
``mk_alignment``); the ported formulas here are the fallback for planning without DeepEP/DeepGEMM and
are tested equal to the vendor's published numbers.

Nothing here imports the adapter or the fakes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, NamedTuple

import torch

# =====================================================================================================
# Module names
# =====================================================================================================

#: The real DeepEP package (``pip install`` from a source checkout; not on the package index).
REAL = "deep_ep"
#: The real DeepGEMM package.
DEEP_GEMM = "deep_gemm"
FAKES = "moe_dispatch_cuda_deepep.fakes"
#: DeepEP 2.x (main @ dd758ca): the V1 ``Buffer`` in ``deep_ep/buffers/legacy.py``.
EMULATOR = "moe_dispatch_cuda_deepep.fakes.deep_ep"
#: A DeepEP built from the hybrid-ep branch (@ 94a9f8f): NVFP4 low-latency dispatch.
EMULATOR_NVFP4 = "moe_dispatch_cuda_deepep.fakes.deep_ep_hybrid"
#: DeepEP 1.2.1 before 2025-09-15 (@ e9d053c): low-latency top-k at most 9.
EMULATOR_V1_TOPK9 = "moe_dispatch_cuda_deepep.fakes.deep_ep_v121_topk9"
#: DeepEP 2.x built with ``EP_NUM_TOPK_IDX_BITS=32``: ``deep_ep.topk_idx_t`` is int32.
EMULATOR_TOPK_INT32 = "moe_dispatch_cuda_deepep.fakes.deep_ep_topk_int32"
#: DeepGEMM 2.6.1 (@ 54e2261) on an SM90 device.
DEEP_GEMM_EMULATOR = "moe_dispatch_cuda_deepep.fakes.deep_gemm"
#: DeepGEMM 2.6.1 (@ 54e2261) on an SM100 device.
DEEP_GEMM_EMULATOR_SM100 = "moe_dispatch_cuda_deepep.fakes.deep_gemm_sm100"
#: DeepGEMM v1 (main @ 0c88cd0, the last v1; PyPI deep_gemm 1.0.0 is @ b05ed2f).
DEEP_GEMM_V1_EMULATOR = "moe_dispatch_cuda_deepep.fakes.deep_gemm_v1"
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
#: Internode notify: ``num_nvl_experts <= num_threads (512)``, num_nvl_experts = 8 · local experts
#: (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/internode.cu notify_dispatch, kNumThreads = 512).
NORMAL_INTERNODE_MAX_NVL_EXPERTS = 512
#: ``SWITCH_RANKS``: intranode kernels exist for these world sizes only
#: (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/launch.cuh).
INTRANODE_RANKS = frozenset({2, 4, 8})
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
DEFAULT_NVSHMEM_QP_DEPTH = 1024
NVSHMEM_MAX_TEAMS_VALUE = 7
NVSHMEM_CUMEM_GRANULARITY_VALUE = 2**29
NVSHMEM_WRITTEN = (NVSHMEM_DISABLE_P2P, NVSHMEM_IB_ENABLE_IBGDA, NVSHMEM_IBGDA_NUM_RC_PER_PE, NVSHMEM_QP_DEPTH,
                   NVSHMEM_MAX_TEAMS, NVSHMEM_DISABLE_NVLS, NVSHMEM_CUMEM_GRANULARITY, NVSHMEM_DISABLE_MNNVL)


def low_latency_max_tokens(qp_depth: int = DEFAULT_NVSHMEM_QP_DEPTH) -> int:
    """``assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2`` (deepseek-ai/DeepEP@dd758ca
    deep_ep/buffers/legacy.py low_latency_dispatch/low_latency_combine, since @d981409), bounded by the
    dispatch kernel's ``FINISHED_SUM_TAG`` count (a rank sends fewer than 1024 tokens to one expert)."""
    return min(qp_depth // 2 - 1, FINISHED_SUM_TAG - 1)


def qp_depth_from(env: dict[str, str] | Any) -> int:
    """``int(os.environ.get('NVSHMEM_QP_DEPTH', '1024'))``, as the V1 constructor reads it."""
    return int(env.get(NVSHMEM_QP_DEPTH, str(DEFAULT_NVSHMEM_QP_DEPTH)))


# =====================================================================================================
# DeepEP versions
# =====================================================================================================

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
RDMA_RANKS_V10_V11 = frozenset({2, 3, 4, 8, 16, 18, 20})  # @ebfe47e .. 1.1.0

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
#: The EP sizes to probe the installed DeepEP's ``get_dispatch_config`` with.
CANDIDATE_EP_SIZES = tuple(sorted(set(TUNED_DISPATCH) | set(TUNED_DISPATCH_BEFORE_EP48)))


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
                             "hybrid-ep branch (low_latency_dispatch takes use_nvfp4)")
    if major is not None and major.isdigit() and int(major) >= 2:
        return DeepEPRelease("2.x", version, LL_MAX_TOPK, LOW_LATENCY_HIDDEN_SIZES, RDMA_RANKS, TUNED_DISPATCH,
                             f"DeepEP {version}", checks_deterministic=True)
    commit = _commit_of(version)
    base = (version or "").split("+")[0]
    if base.startswith("1.0"):
        return DeepEPRelease("1.x", version, LL_MAX_TOPK_BEFORE_9AF0E0D, LOW_LATENCY_HIDDEN_SIZES_V10,
                             RDMA_RANKS_V10_V11, TUNED_DISPATCH_BEFORE_EP48, f"DeepEP {version}")
    if base.startswith("1.1"):
        return DeepEPRelease("1.x", version, LL_MAX_TOPK_BEFORE_9AF0E0D, LOW_LATENCY_HIDDEN_SIZES_V11,
                             RDMA_RANKS_V10_V11, TUNED_DISPATCH_BEFORE_EP48, f"DeepEP {version}")
    if base.startswith("1.2"):
        topk11 = _at_or_after(commit, COMMIT_LL_TOPK_11)
        if topk11 is None and hasattr(module, "topk_idx_t"):
            topk11 = True  # topk_idx_t arrived with da6ca24, after 9af0e0d
        ep48, ep24 = _at_or_after(commit, COMMIT_EP48_96), _at_or_after(commit, COMMIT_EP24)
        rdma = (RDMA_RANKS if ep24 else RDMA_RANKS_EP48_BEFORE_EP24 if ep48 else RDMA_RANKS_V12_BEFORE_EP48)
        hidden = LOW_LATENCY_HIDDEN_SIZES if _at_or_after(commit, COMMIT_HIDDEN_3072) else LOW_LATENCY_HIDDEN_SIZES_V12
        how = f"commit {commit}" if commit in V121_COMMITS else "commit unknown: the safe bounds of 1.2.x"
        return DeepEPRelease("1.x", version, LL_MAX_TOPK if topk11 else LL_MAX_TOPK_BEFORE_9AF0E0D, hidden, rdma,
                             TUNED_DISPATCH if ep48 else TUNED_DISPATCH_BEFORE_EP48, f"DeepEP {version} ({how})")
    return DeepEPRelease("unknown", version, LL_MAX_TOPK_BEFORE_9AF0E0D, LOW_LATENCY_HIDDEN_SIZES_V10,
                         RDMA_RANKS_V12_BEFORE_EP48, TUNED_DISPATCH_BEFORE_EP48,
                         f"DeepEP version {version!r} unknown: the safe bounds")


#: Planning without DeepEP installed: the newest release (main @ dd758ca).
PLANNING_RELEASE = DeepEPRelease("2.x", None, LL_MAX_TOPK, LOW_LATENCY_HIDDEN_SIZES, RDMA_RANKS, TUNED_DISPATCH,
                                 "DeepEP not installed: planning with main @ dd758ca", checks_deterministic=True)


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
                      emulated=module_name.startswith(FAKES), release=release_of(module))


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
DG_FP8_MASKED_ALIAS = "fp8_m_grouped_gemm_nt_masked"
DG_FP8_CONTIGUOUS_ALIAS = "fp8_m_grouped_gemm_nt_contiguous"
DG_BF16_CONTIGUOUS = "m_grouped_bf16_gemm_nt_contiguous"
DG_BF16_MASKED = "m_grouped_bf16_gemm_nt_masked"
DG_MK_ALIGNMENT = "get_mk_alignment_for_contiguous_layout"  # deep_gemm/utils/layout.py re-export of _C
DG_TMA_ALIGNED_SIZE = "get_tma_aligned_size"
# deepseek-ai/DeepGEMM@0c88cd0 deep_gemm/jit_kernels/m_grouped_gemm.py (v1; same names @b05ed2f = PyPI 1.0.0)
DG_V1_CONTIGUOUS = "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"
DG_V1_MASKED = "m_grouped_gemm_fp8_fp8_bf16_nt_masked"
DG_V1_ALIGNMENT = "get_m_alignment_for_contiguous_layout"
DG_V1_TMA_ALIGNED = "get_col_major_tma_aligned_tensor"
DG_V2_CONTIGUOUS_NAMES = (DG_FP8_CONTIGUOUS, DG_FP8_CONTIGUOUS_ALIAS)
DG_V2_MASKED_NAMES = (DG_FP8_MASKED, DG_FP8_MASKED_ALIAS)
DG_ALIGNMENT_NAMES = (DG_MK_ALIGNMENT, DG_V1_ALIGNMENT)

#: ``kLegacyMKAlignmentForContiguousLayout`` (deepseek-ai/DeepGEMM@54e2261 csrc/jit_kernels/heuristics/
#: runtime.hpp); v1 ``get_m_alignment_for_contiguous_layout`` returns 128 too. 2.6.1 makes it settable.
DG_DEFAULT_MK_ALIGNMENT = 128
DG_BLOCK = 128
#: ``get_tma_aligned_size``: the MN axis of an MN-major scale tensor padded to 16 bytes
#: (deepseek-ai/DeepGEMM@54e2261 csrc/utils/math.hpp; v1 deep_gemm/jit_kernels/utils.py).
TMA_ALIGNMENT_BYTES = 16
#: v1's masked grouped GEMM: "For masked grouped GEMM, shape M should be multiple of the block M" when
#: num_groups > 1 and M > block_m (deepseek-ai/DeepGEMM@0c88cd0 m_grouped_gemm.py, since @6da94d2), block_m
#: chosen by get_best_configs from (64, 128, 256) (@0c88cd0 deep_gemm/jit_kernels/gemm.py).
DG_V1_MASKED_BLOCK_MS = (64, 128, 256)
#: DeepGEMM 2.x ``__version__`` from which the SM100 fp32 → UE8M0 scale cast device-asserts that every
#: scale is a power of two (``(bits & 0x807fffff) == 0``, deepseek-ai/DeepGEMM@54e2261
#: deep_gemm/include/deep_gemm/impls/smxx_layout.cuh, introduced by 54e2261 "#364"; 2.5.0 before it kept
#: the exponent bits only: ``sf.view(int) >> 23``, csrc/jit_kernels/impls/smxx_layout.hpp).
DG_POW2_ASSERT_VERSION = (2, 6, 1)
#: Compute-capability majors with grouped GEMMs: 9 (SM90: fp32 scales) and 10 (SM100: packed UE8M0).
DG_ARCH_SM90, DG_ARCH_SM100 = 9, 10


def tma_aligned_size(mn: int, element_size: int) -> int:
    """``get_tma_aligned_size(x, element_size)``: ``x`` rounded up to 16 bytes' worth of elements."""
    return _align(mn, TMA_ALIGNMENT_BYTES // element_size)


def v1_masked_m_is_safe(m: int) -> bool:
    """Whether v1's masked GEMM accepts a capacity ``m`` whatever block M its heuristic picks."""
    return all(m <= bm or m % bm == 0 for bm in DG_V1_MASKED_BLOCK_MS)


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
    def casts_pow2_strictly(self) -> bool:
        """SM100 scale cast: device assert (2.6.1+) rather than silent truncation."""
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

class VendorSignature(NamedTuple):
    """A vendor callable's recorded signature: the parameter list of its ``def`` (pybind: its ``py::arg``s),
    and where it was read. The same fields as ``moe_dispatch.signatures.VendorSignature``, which the
    tests build from it (importing that module here would import pytest with the plugin)."""

    qualname: str
    text: str
    source: str


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
V121_BUFFER_INIT = VendorSignature(
    "Buffer.__init__", "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, "
    "num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, "
    "comm=None)", _V121)

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
DG_V1_CONTIGUOUS_SIG = VendorSignature(DG_V1_CONTIGUOUS, "(lhs, rhs, out, m_indices)", _DG_V1)
DG_V1_MASKED_SIG = VendorSignature(DG_V1_MASKED, "(lhs, rhs, out, masked_m, expected_m)", _DG_V1)
DG_V1_ALIGNMENT_SIG = VendorSignature(DG_V1_ALIGNMENT, "()",
                                      "deepseek-ai/DeepGEMM@0c88cd0 deep_gemm/jit_kernels/utils.py")

#: (module attribute path, signature) of the main-line DeepEP V1 API the adapter calls.
DEEP_EP_SIGNATURES = (BUFFER_INIT, BUFFER_GET_DISPATCH_CONFIG, BUFFER_GET_COMBINE_CONFIG, BUFFER_LL_SIZE_HINT,
                      BUFFER_SET_NUM_SMS, BUFFER_GET_DISPATCH_LAYOUT, BUFFER_DISPATCH, BUFFER_COMBINE, BUFFER_CLEAN_LL,
                      BUFFER_LL_DISPATCH, BUFFER_LL_COMBINE, BUFFER_DESTROY, CONFIG_INIT, CONFIG_NVL_HINT,
                      CONFIG_RDMA_HINT)
#: The hybrid-ep branch differs in these three; the rest as main.
HYBRID_SIGNATURES = (HYBRID_BUFFER_INIT, HYBRID_LL_DISPATCH, HYBRID_LL_COMBINE)
DEEP_GEMM_SIGNATURES = (DG_FP8_CONTIGUOUS_SIG, DG_FP8_MASKED_SIG, DG_BF16_CONTIGUOUS_SIG, DG_BF16_MASKED_SIG,
                        DG_MK_ALIGNMENT_SIG)
DEEP_GEMM_V1_SIGNATURES = (DG_V1_CONTIGUOUS_SIG, DG_V1_MASKED_SIG, DG_V1_ALIGNMENT_SIG)


def lookup(module: Any, qualname: str) -> Any:
    """``Class.method`` or ``function`` of ``module`` (for comparing a recorded signature)."""
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj

