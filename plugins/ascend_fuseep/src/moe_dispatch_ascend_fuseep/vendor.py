"""The vendor boundary of the FuseEP plugin: DeepEP-Ascend's ``Buffer.fused_deep_moe``.

FuseEP lives on DeepEP-Ascend's ``Buffer`` (sgl-project/sgl-kernel-npu ``python/deep_ep``), so the
module names, environment variables, detection and HCCL facts are ``moe_dispatch_ascend_deepep.vendor``'s
(re-exported here); this module adds what is particular to the fused op: its recorded
signatures per version, its limits, its weight layouts and its HCCL window checks, each cited
as ``KN@<commit> <path>`` (KN = sgl-project/sgl-kernel-npu, main f425bdf).
"""

from __future__ import annotations

from moe_dispatch_ascend_deepep.vendor import (  # noqa: F401 - re-exported vendor facts
    ACL_FORMAT_FRACTAL_NZ, DEEPEP_HCCL_BUFFSIZE, DEFAULT_HCCL_BUFFSIZE_MB, FUSED_OPS_SOCS, HCCL_BUFFER_SIZE_KEY,
    HCCL_BUFFSIZE, INSTALL_HINT, KN, MIB, REAL,
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


# -- mode 2's row bound ------------------------------------------------------------------------------------


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
    "MINUS_ONE_UNSUPPORTED_MODES",
    "DISPATCH_FFN_COMBINE", "FUSED_DEEP_MOE", "FUSE_MODES", "GMM1_TILE_N", "dispatch_ffn_combine_window_bytes", "fused_deep_moe_window_bytes", "mode2_max_output_rows",
    "mode2_min_output_rows",
]
