"""The vendor boundary of the FuseEP plugin: DeepEP-Ascend's ``Buffer.fused_deep_moe``.

FuseEP lives on DeepEP-Ascend's ``Buffer`` (sgl-project/sgl-kernel-npu ``python/deep_ep``), so the
module names, environment variables, detection and HCCL facts are ``moe_dispatch_ascend_deepep.vendor``'s
(re-exported here); this module adds what is particular to the fused op: its recorded
signatures per version, its limits, its weight layouts and its HCCL window checks, each cited
as ``KN@<commit> <path>`` (KN = sgl-project/sgl-kernel-npu, main f425bdf).
"""

from __future__ import annotations

from typing import Mapping

from moe_dispatch_ascend_deepep.vendor import (  # noqa: F401 - re-exported vendor facts
    ACL_FORMAT_FRACTAL_NZ, DEEPEP_HCCL_BUFFSIZE, DEFAULT_HCCL_BUFFSIZE_MB, FUSED_OPS_SOCS, HCCL_BUFFER_SIZE_KEY,
    HCCL_BUFFSIZE, INSTALL_HINT, KN, MIB, REAL, stoi_prefix,
    SIG_FUSED_DEEP_MOE, SIG_FUSED_DEEP_MOE_NO_FUSE_MODE, SIG_FUSED_DEEP_MOE_NO_PROFILE, SIG_NPU_FORMAT_CAST, SOC_A2,
    SOC_A3, TORCH_NPU, VendorInfo, detect, window_mb,
)

# KN@f425bdf buffer.py class FuseMode(IntEnum): FUSED_DEEP_MOE = 1, DISPATCH_FFN_COMBINE = 2 (module level;
# not exported from deep_ep/__init__.py: `from deep_ep.buffer import FuseMode` or the integers).
FUSED_DEEP_MOE, DISPATCH_FFN_COMBINE = 1, 2
FUSE_MODES = {FUSED_DEEP_MOE: "fused_deep_moe (aclnnFusedDeepMoe)",
              DISPATCH_FFN_COMBINE: "dispatch_ffn_combine (aclnnDispatchFFNCombine)"}
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::fused_deep_moe: EP_HOST_ASSERT_S(quant_mode 0 or 1) on A2/A3.
QUANT_INT8 = 1

# -- expert ids of -1 ------------------------------------------------------------------------------------
# Mode 2: "Currently, topk=-1 is not supported." (KN@f425bdf tests/python/deepep/test_dispatch_ffn_combine.py;
# its routing sorts the expert ids, ops/op_kernel/dispatch_ffn_combine_kernel/moe_init_routing_quant_v2/
# moe_v2_sort_one_core.h). Mode 1: -1 is documented (python/deep_ep/doc/FUSED_DEEP_MOE.md), but the vendor's
# test guarantees "that each token has at least one valid expert" (tests/python/deepep/test_fused_deep_moe.py):
# a token with none is never exercised.
MINUS_ONE_UNSUPPORTED_MODES = frozenset({2})

# -- limits: KN@f425bdf python/deep_ep/doc/FUSED_DEEP_MOE.md "Constraints" (mode 1) and
#    csrc/deepep/ops/op_host/fused_deep_moe_tiling.cpp CheckData (MIN/MAX_BATCH_SIZE, SUPPORT_TOP_K,
#    MIN/MAX_TOKEN_LENGTH, MIN/MAX_GMM1_HIDDEN, MAX_MOE_EXERT_NUM).
MIN_BATCH, MAX_BATCH = 1, 256
MIN_HIDDEN, MAX_HIDDEN = 512, 7168
MIN_GMM1_HIDDEN, MAX_GMM1_HIDDEN = 1024, 6144  # gmm1's N = 2·intermediate
MAX_TOP_K = 12
MAX_EXPERTS = 512
# Mode 1's tiling: "moeExpertNumPerRank must <= (aivNum/2)", aivNum = GetCoreNumAiv() (KN@f425bdf
# csrc/deepep/ops/op_host/fused_deep_moe_tiling.cpp:183-188, :339-341): two vector cores per local expert. The
# count is torch_npu.npu.get_device_limit(device)["vector_core_num"] (torch-npu 2.13.0 torch_npu/npu/npu_config.py
# :244-258); 48 on Atlas A3 (24 AI cores x 2), the value assumed where it cannot be read.
MODE1_AIV_PER_LOCAL_EXPERT = 2
A3_VECTOR_CORES = 48
VECTOR_CORE_KEY = "vector_core_num"

# -- weight layouts --------------------------------------------------------------------------------------
# Mode 1: gmm1's N axis is gate/up interleaved in tiles of 64 (KN@f425bdf tests/python/deepep/test_fused_deep_moe.py
# GMM_TILE_N_DIM = 64, reshape_fusion_gmm_weight; its scale through permute_weight(scale, 128), the same
# permutation); sglang python/sglang/srt/hardware_backend/npu/moe/fuseep.py @008b79d does the same.
GMM1_TILE_N = 64
# Mode 1 weights [E_l, H, 2I] (gmm1) and [E_l, H, I] (gmm2), scales fp32 [E_l, 2I] / [E_l, H]
# (fused_deep_moe_tiling.cpp CheckGmmWeight: dim0 = E_l, scale dim1 = gmm1 N / H).
# Mode 2: gmm1 [E_l, H, 2I] without interleave, gmm2 [E_l, I, H]; scales are the fp32 bits read as
# int32 and widened to int64 (KN@f425bdf tests/python/deepep/test_dispatch_ffn_combine.py
# scale_from_float_to_int64, init_fused2_weights_int8; buffer.py docstring: "NOT auto-converted").
# FRACTAL_NZ int8 needs the last two dims aligned (16, 32): mode 2's w2ᵀ [E_l, I, H] takes I % 16 == 0, and its tiling
# reads N from gmm1's storage shape (dispatch_ffn_combine_tiling.cpp:121), so no padding may enter it.
MODE2_INTERMEDIATE_MULTIPLE = 16
# npu_format_cast(w, 29) falls back to ND while torch_npu.npu.config.allow_internal_format is False (the Atlas A3
# default; torch-npu 2.13.0 libtorch_npu.so "Cannot create tensor with internal format while
# allow_internal_format=False, tensor will be created with base format."): mode 1's op then refuses the weights
# (fused_deep_moe.cpp:22,32: FRACTAL_NZ only), mode 2's reads ND bytes as NZ (aclnn_dispatch_ffn_combine.cpp:41
# weightNz=true; dispatch_ffn_combine_def.cpp:21,26 accept ND). The vendor's tests and sglang's init_npu_backend set
# it True; ``torch_npu.get_npu_format(w)`` tells which format the cast gave.
ALLOW_INTERNAL_FORMAT = "torch_npu.npu.config.allow_internal_format"


# -- mode 2's row bound ------------------------------------------------------------------------------------


# Mode 2 keeps its row counts and sizes in uint32 (ops/op_kernel/dispatch_ffn_combine_tiling.h:11-24) and multiplies
# maxOutputSize by gmm1's N (2I) and by H in 32 bits (dispatch_ffn_combine_tiling.cpp:268-273, kernel.hpp:1010-1047;
# the attribute read as an int, tiling :78, :89): past 2**32 the workspace regions wrap and overlap.
MODE2_PRODUCT_LIMIT = 1 << 32
MODE2_ATTR_LIMIT = 1 << 31
# Mode 2's window variable: before KN@f7455efe (#608, tag 2026.7.3) its tiling reads HCCL_BUFFSIZE only
# (dispatch_ffn_combine_tiling.cpp @0ac00159 :29, :62-84, check :270-279; @7c2b9e06 :54-76); from it DEEPEP_HCCL_BUFFSIZE
# when set (f425bdf :43-65). Parsed with std::stoul, 200 MB when unset, unparsable or above 65535 (:50-55). No Python
# name tells the builds apart but Buffer.dispatch(quant_mode=) (KN@7c2b9e06, one commit before f7455efe): a build
# without it reads HCCL_BUFFSIZE only (the one commit with it that still does, 7c2b9e06, is untagged).
MODE2_DEEPEP_WINDOW_SINCE = "f7455efe"
MODE2_WINDOW_DEFAULT_MB, MODE2_WINDOW_MAX_MB = 200, 65535


def mode2_window_mb(env: Mapping[str, str], reads_deepep: bool) -> tuple[str, int]:
    """(the variable mode 2's tiling reads, the window it sees in MB)."""
    name = DEEPEP_HCCL_BUFFSIZE if reads_deepep and env.get(DEEPEP_HCCL_BUFFSIZE) is not None else HCCL_BUFFSIZE
    raw = env.get(name)
    value = None if raw is None else stoi_prefix(raw)
    ok = value is not None and 0 <= value <= MODE2_WINDOW_MAX_MB
    return name, value if ok else MODE2_WINDOW_DEFAULT_MB


def mode2_workspace_bytes(rows: int, top_k: int, world_size: int, local_experts: int, hidden: int,
                          intermediate: int, max_output: int) -> int:
    """The workspace mode 2 allocates at each call (``EXEC_NPU_CMD``, csrc/deepep/pytorch_npu_helper.hpp:577-581) for
    ``rows`` local tokens: 16 MiB + max(coc, initRouting) (KN@f425bdf dispatch_ffn_combine_tiling.cpp:261-275, the same
    at 0ac00159 :280-294; initRouting from moe_init_routing_v2_tiling.h:239-248), about max_output·(8 + 5I + 3H)."""
    n = 2 * intermediate
    coc = (-(-rows // 256) * 256 * top_k * 4 + 3 * world_size * world_size * local_experts * 4
           + max_output * (4 * 2 + n * 2 + hidden * 2 + hidden + intermediate) + world_size * 4 * 16
           + (local_experts + world_size) * 4 * 16)
    routing = rows * top_k * (4 * 2 * 3 + 4 * 2) + 40 * 2 * 4 + 16 * MIB
    return 16 * MIB + max(coc, routing)


def mode2_max_output_rows(tokens: int, world_size: int, top_k: int) -> int:
    """``num_max_dispatch_tokens_per_rank`` for fuse mode 2 is ``max_output_size``, "the maximum
    number of tokens received in dispatch (typically max_bs * num_ranks * topk)" (KN@f425bdf
    buffer.py fused_deep_moe docstring); the vendor's own test passes ``T·k·R``
    (tests/python/deepep/test_dispatch_ffn_combine.py), and the op's tiling sizes its workspace
    rows by it (csrc/deepep/ops/op_host/dispatch_ffn_combine_tiling.cpp cocWorkspace)."""
    return tokens * world_size * top_k


def mode2_min_output_rows(tokens: int, world_size: int, local_experts: int, top_k: int) -> int:
    """The most rows one rank can receive: every token of every rank to min(k, E_l) of its experts."""
    return tokens * world_size * min(top_k, local_experts)


# -- HCCL window: the fused ops' own checks, ported ------------------------------------------------------


def fused_deep_moe_window_bytes(tokens: int, world_size: int, local_experts: int, hidden: int) -> int:
    """Mode 1: ``epRankSize·maxBs·moeExpertNumPerRank·h·2 B·2`` with maxBs = max(bs, T)
    (KN@f425bdf csrc/deepep/ops/op_host/fused_deep_moe_tiling.cpp; globalBs = max(bs, T)·R in deep_ep.cpp)."""
    return world_size * tokens * local_experts * hidden * 2 * 2


def dispatch_ffn_combine_window_bytes(tokens: int, top_k: int, hidden: int) -> int:
    """Mode 2: ``M·topK·K·1 B·3 + 10 MB`` with M the local rows, K = H (the message says 3 MB,
    the code adds 10; KN@f425bdf csrc/deepep/ops/op_host/dispatch_ffn_combine_tiling.cpp)."""
    return tokens * top_k * hidden * 3 + 10 * MIB


__all__ = [
    "A3_VECTOR_CORES", "ALLOW_INTERNAL_FORMAT", "MODE1_AIV_PER_LOCAL_EXPERT", "MODE2_ATTR_LIMIT",
    "MODE2_DEEPEP_WINDOW_SINCE", "MODE2_INTERMEDIATE_MULTIPLE", "MODE2_PRODUCT_LIMIT", "VECTOR_CORE_KEY",
    "mode2_window_mb", "mode2_workspace_bytes",
    "MINUS_ONE_UNSUPPORTED_MODES",
    "DISPATCH_FFN_COMBINE", "FUSED_DEEP_MOE", "FUSE_MODES", "GMM1_TILE_N", "dispatch_ffn_combine_window_bytes", "fused_deep_moe_window_bytes", "mode2_max_output_rows",
    "mode2_min_output_rows",
]
