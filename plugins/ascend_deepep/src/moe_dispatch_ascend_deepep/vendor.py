"""The vendor boundary: every DeepEP-Ascend and torch_npu fact this plugin relies on.

DeepEP-Ascend is sgl-project/sgl-kernel-npu ``python/deep_ep`` (it installs as ``deep_ep``, like
CUDA DeepEP) with its C++ in ``csrc/deepep``; facts are cited as ``KN@<commit> <path> <symbol>``
(KN = sgl-project/sgl-kernel-npu, read at main f425bdf). torch_npu facts come from torch-npu 2.13.0:
the op schemas its ``libtorch_npu.so`` registers (what ``torch_npu.npu_X`` takes), the documented
prototypes in ``torch_npu/_op_plugin_docs.py`` (TNPU), and CANN's grouped-matmul sources
(hicann/ops-transformer) where the docs leave the A8W4 kernel out. The chip (Atlas A2/A3) is
``torch_npu.npu.get_soc_version()``'s.

Nothing here imports an adapter module or a fake. Adapters and fakes import these facts; the
fakes live in the moe-dispatch-ascend-deepep-testing distribution and are chosen by module-name string.
"""

from __future__ import annotations

import importlib
import importlib.util
import ast
import inspect
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping

from moe_dispatch.backend import VendorSignature

KN = "sgl-project/sgl-kernel-npu"
KN_MAIN = "f425bdf"
TNPU = "torch-npu 2.13.0 torch_npu/_op_plugin_docs.py"
#: The op schemas torch-npu 2.13.0 registers (``torch_npu/lib/libtorch_npu.so``); ``torch_npu.npu_X`` IS
#: ``torch.ops.npu.npu_X`` (``torch_npu/utils/custom_ops.py``), so these are the callables' signatures.
TNPU_SO = "torch-npu 2.13.0 torch_npu/lib/libtorch_npu.so (registered schema; torch_npu/utils/custom_ops.py)"

# -- module names ------------------------------------------------------------------------------------

REAL = "deep_ep"
TORCH_NPU = "torch_npu"
INSTALL_HINT = ("DeepEP-Ascend builds from source with CANN: see https://github.com/sgl-project/sgl-kernel-npu "
                "(python/deep_ep), on an Atlas A2/A3 machine, with torch-npu matching torch "
                "(pip install \"moe-dispatch-ascend-deepep[npu]\" \"torch==<your torch>\")")

# -- environment variables the vendor reads ------------------------------------------------------------


@dataclass(frozen=True)
class EnvVar:
    """An environment variable DeepEP-Ascend reads: when, its default, and what it changes."""

    name: str
    default: str | None
    read_at: str
    effect: str
    source: str


# KN@f425bdf python/deep_ep/deep_ep/strategies/normal_strategy.py DefaultNormalCommStrategy._intranode_dispatch
# (when quant_mode is None, since KN@929a00ae and before KN@7c2b9e06) and ._internode_dispatch (A2, > 8 ranks:
# always, except KN@7c2b9e06..929a00ae, where use_quant = False is hard-coded); read in Python at each dispatch, so
# the adapter sets it for every normal dispatch on every build, quant_mode or not.
INT8_ENV = "DEEP_NORMAL_MODE_USE_INT8_QUANT"
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::intranode_dispatch / internode_dispatch (since KN@cbbddb1d)
# and Buffer::low_latency_dispatch (since KN@ee7bc7d7, 2025-10-28): get_value_from_env(.., 1).
COUNTS_TYPE_ENV = "MOE_EXPERT_TOKEN_NUMS_TYPE"
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::low_latency_dispatch and ::low_latency_combine (since KN@7fe4eeb7).
NEG_ONE_ENV = "MOE_ENABLE_TOPK_NEG_ONE"
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::Buffer (since KN@d96c62d0).
SHARED_RANKS_ENV = "MOE_SHARED_EXPERT_RANK_NUM"
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::low_latency_dispatch / low_latency_combine.
CCU_ENV = "MOE_ENABLE_CCU"
# KN@f425bdf python/deep_ep/deep_ep/buffer.py Buffer.__init__ -> ep_strategy.StrategyMap (since KN@b2fce2cd).
STRATEGY_ENV = "DEEP_USE_MODE"
# KN@f425bdf csrc/deepep/ops/op_host/mc2_tiling_utils.h Mc2TilingUtils::GetMaxWindowSize (each op's tiling).
HCCL_BUFFSIZE = "HCCL_BUFFSIZE"
DEEPEP_HCCL_BUFFSIZE = "DEEPEP_HCCL_BUFFSIZE"
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::low_latency_dispatch: on ASCEND910B, "1"/"0" = layered (two-node).
INTRA_PCIE_ENV = "HCCL_INTRA_PCIE_ENABLE"
INTRA_ROCE_ENV = "HCCL_INTRA_ROCE_ENABLE"
# KN@f425bdf python/deep_ep/README.md (environment table: "Must be disabled on A2 when using DeepEP (remove or
# unset this variable)"; "A2 Single Node ... Must disable"), python/deep_ep/doc/A2_DEEPEP.md ("On A2, you must
# disable HCCL_OP_EXPANSION_MODE, otherwise unknown operator errors will occur"). HCCL reads it when it builds a
# communicator; torch_npu also takes it per group: hccl_config["hccl_op_expansion_mode"] → HcclCommConfig
# .hcclOpExpansionMode (Ascend/pytorch@9e73e708 torch_npu/csrc/distributed/ProcessGroupHCCL.cpp
# createHcclCommConfigWithOptions; the key is in torch-npu 2.13.0's libtorch_npu.so).
OP_EXPANSION_ENV = "HCCL_OP_EXPANSION_MODE"
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::Buffer ("ant moving home", since KN@92f5bb96).
LONG_SEQ_ROUND_ENV = "DEEPEP_NORMAL_LONG_SEQ_ROUND"
LONG_SEQ_TOKENS_ENV = "DEEPEP_NORMAL_LONG_SEQ_PER_ROUND_TOKENS"
LONG_SEQ_COMBINE_ENV = "DEEPEP_NORMAL_COMBINE_ENABLE_LONG_SEQ"

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(INT8_ENV, "0", "each normal dispatch (Python)",
           "'1': INT8 rows when quant_mode is None; the A2 internode path reads only this",
           "KN@f425bdf strategies/normal_strategy.py"),
    EnvVar(COUNTS_TYPE_ENV, "1", "each normal and low-latency dispatch (C++)",
           "'0': the normal count list and the low-latency recv_count are prefix sums; not 0/1: assert",
           "KN@f425bdf csrc/deepep/deep_ep.cpp"),
    EnvVar(NEG_ONE_ENV, "0", "each low_latency_dispatch and low_latency_combine (C++)",
           "'1': an active mask (topk_idx >= 0) goes to the op; with A2 layered: EP_HOST_ASSERT",
           "KN@f425bdf csrc/deepep/deep_ep.cpp"),
    EnvVar(SHARED_RANKS_ENV, "0", "Buffer construction (C++)",
           "ranks < N hold one shared expert; E_local = E / (R - N); the low-latency and fused layouts change",
           "KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::Buffer"),
    EnvVar(CCU_ENV, "0", "each low_latency_dispatch and low_latency_combine (C++, get_value_from_env)",
           "'1' on any SoC but ASCEND910B: comm_alg 'ccu', which the op's tiling sends to the A5 CCU op "
           "(MoeDistributeDispatchA5); pinned to '0' for the adapter's calls",
           "KN@f425bdf csrc/deepep/deep_ep.cpp; ops/op_host/moe_distribute_dispatch_v2_tiling.cpp"),
    EnvVar(STRATEGY_ENV, None, "Buffer construction (Python)",
           "overrides normal_strategy/low_latency_strategy: default | alltoall | ops; else ValueError",
           "KN@f425bdf python/deep_ep/deep_ep/buffer.py Buffer.__init__"),
    EnvVar(HCCL_BUFFSIZE, "200", "torch_npu: ONCE, at the first HCCL communicator of the process (a function-static "
           "strtol, > 0); the ops: each op's tiling (check)",
           "the HCCL window in MB of every group created without its own hccl_buffer_size option (a group's "
           "pg_options hccl_config wins: HCCL_BUFFER_SIZE_KEY); the ops parse it with std::stoi into a uint16 "
           "(ops2's A2 notify tiling: a uint32)",
           "KN@f425bdf csrc/deepep/ops/op_host/mc2_tiling_utils.h, ops2/op_host/notify_dispatch_tiling_a2.cc; "
           "Ascend/pytorch@9e73e708 torch_npu/csrc/core/npu/register/OptionsManager.cpp GetHcclBufferSize, "
           "ProcessGroupHCCL.cpp getHcclCommConfig"),
    EnvVar(DEEPEP_HCCL_BUFFSIZE, None, "each op's tiling",
           "replaces HCCL_BUFFSIZE as the window size the ops see: their check AND the normal kernels' layout "
           "(the second half starts at totalWinSize/2), so it must not exceed the group's real window; the README: "
           "'preliminary validation only; actual HCCL buffer must be configured by the framework (e.g., SGLang)' "
           "(sglang sizes its MoE group's hccl_buffer_size from it)",
           "KN@f425bdf csrc/deepep/ops/op_host/mc2_tiling_utils.h; ops/op_kernel/cam_moe_dispatch_normal.h, "
           "cam_moe_combine_normal.h (winDataSizeOffset); python/deep_ep/README.md"),
    EnvVar(INTRA_PCIE_ENV, "0", "each low-latency call on ASCEND910B (C++ and op tiling); each A2 internode normal "
           "dispatch and combine (op tiling)",
           "with HCCL_INTRA_ROCE_ENABLE=0: the A2 layered (two-node) kernels; the A2 internode normal combine has no "
           "other kernel", "KN@f425bdf csrc/deepep/deep_ep.cpp; ops2/op_host/moe_distribute_combine_a2_tiling.cpp"),
    EnvVar(INTRA_ROCE_ENV, "1", "as HCCL_INTRA_PCIE_ENABLE", "see HCCL_INTRA_PCIE_ENABLE",
           "KN@f425bdf csrc/deepep/deep_ep.cpp; ops2/op_host/dispatch_normal_a2_tiling.cpp"),
    EnvVar(OP_EXPANSION_ENV, None, "HCCL, when it builds the group's communicator (also the group's "
           "hccl_config['hccl_op_expansion_mode'])",
           "must be unset on Atlas A2 with DeepEP-Ascend (the vendor's docs: 'unknown operator errors'); "
           "A3 deployments set it (AIV)", "KN@f425bdf python/deep_ep/README.md; doc/A2_DEEPEP.md"),
    EnvVar(LONG_SEQ_ROUND_ENV, None, "Buffer construction (C++)",
           "rounds per dispatch; both long-seq variables or neither (EP_HOST_ASSERT)", "KN@f425bdf deep_ep.cpp"),
    EnvVar(LONG_SEQ_TOKENS_ENV, None, "Buffer construction (C++)", "tokens per round (default 8192)",
           "KN@f425bdf deep_ep.cpp"),
    EnvVar(LONG_SEQ_COMBINE_ENV, "0", "Buffer construction (C++)", "'1': rounds in combine too",
           "KN@f425bdf deep_ep.cpp"),
)

#: The variables another plugin may not set (``Backend.vendor_environment``): DeepEP-Ascend's reads and the HCCL ones
#: above (not ``ASCEND_CUSTOM_OPP_PATH``/``LD_LIBRARY_PATH``, which ``import deep_ep`` writes, in this backend's probe).
READ_ENVIRONMENT = tuple(e.name for e in ENV_VARS)

STRATEGY_DEFAULT = "default"
# KN@f425bdf python/deep_ep/deep_ep/ep_strategy.py StrategyMap.strategy_map
STRATEGIES = ("default", "alltoall", "ops")


_ASCII_DIGITS = frozenset("0123456789")
_LONG_MAX = (1 << 63) - 1


def _wrap(value: int, bits: int, signed: bool) -> int:
    """A C integer conversion: ``value`` modulo 2**bits (two's complement when ``signed``)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if signed and value >> (bits - 1) else value


def parse_env_int(raw: str | None, default: int) -> int:
    """DeepEP-Ascend's ``get_value_from_env``: ``strtol(s, &end, 10)`` accepted only when the first
    character is an ASCII digit, ``*end == '\\0'`` (all of it consumed: no sign, blank, ``_`` or other
    digits) and no ERANGE; the long is then cast to int (KN@f425bdf csrc/deepep/config.cpp
    get_value_from_env)."""
    if not raw or raw[0] not in _ASCII_DIGITS or not set(raw) <= _ASCII_DIGITS:
        return default
    value = int(raw, 10)
    return default if value > _LONG_MAX else _wrap(value, 32, signed=True)


_C_SPACE = " \t\n\v\f\r"
_C_INTEGER_PREFIX = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")


def _c_integer_prefix(raw: str) -> int | None:
    """What C's integer parsers read: leading C whitespace, an optional sign, the longest run of ASCII digits;
    None where there are no digits."""
    found = _C_INTEGER_PREFIX.match(raw)
    if not found:
        return None
    sign, digits = -1 if found.group(1) == "-" else 1, found.group(2).lstrip("0") or "0"
    # beyond 20 digits every reader clamps or throws alike: stand in 10**20 (past any long) and keep clear of
    # Python's limit on converting long digit strings
    return sign * (int(digits, 10) if len(digits) <= 20 else 10 ** 20)


def strtol_prefix(raw: str) -> int:
    """``strtol(raw, nullptr, 10)``: 0 where there are no digits, LONG_MAX/LONG_MIN beyond a long (what torch_npu
    reads HCCL_BUFFSIZE with, Ascend/pytorch@9e73e708 torch_npu/csrc/core/npu/register/OptionsManager.cpp
    GetHcclBufferSize)."""
    value = _c_integer_prefix(raw) or 0
    return max(-_LONG_MAX - 1, min(_LONG_MAX, value))


def plain_decimal(raw: str) -> int | None:
    """The value of ``raw`` when every reader of a window variable reads it alike: C whitespace, an optional
    ``+``, ASCII digits, C whitespace (``strtol``: torch_npu's allocation; ``std::stoi``: the ops' check;
    Python ``int()``: sglang's group size). None for anything else (``1_024``, non-ASCII digits, ``1024MB``,
    ``0x400``, a sign ``-``, 2³¹ and beyond), which they read differently."""
    body = raw.strip(_C_SPACE)
    digits = body[1:] if body.startswith("+") else body
    if not digits or not set(digits) <= _ASCII_DIGITS or len(digits.lstrip("0")) > 10:
        return None
    value = int(digits, 10)
    return value if value < 1 << 31 else None  # std::stoi throws out_of_range where strtol reads a number


def stoi_prefix(raw: str) -> int | None:
    """``std::stoi(raw)``: as strtol, but None where stoi throws (no digits: invalid_argument; beyond int:
    out_of_range)."""
    value = _c_integer_prefix(raw)
    return value if value is not None and -(1 << 31) <= value < (1 << 31) else None


def ops_window_mb(env: Mapping[str, str]) -> int:
    """The window (MB) each op's tiling sees: ``DEEPEP_HCCL_BUFFSIZE`` when set, else ``HCCL_BUFFSIZE``,
    parsed with ``std::stoi`` into a ``uint16_t`` (a value stoi rejects leaves the default 200)
    (KN@f425bdf csrc/deepep/ops/op_host/mc2_tiling_utils.h Mc2TilingUtils::GetMaxWindowSize; ops2's
    mc2_tiling_utils.h the same; the A2 notify tiling, ops2/op_host/notify_dispatch_tiling_a2.cc GetMaxWindowSize,
    keeps a uint32: the same for every value this plugin accepts, <= 65535)."""
    name = DEEPEP_HCCL_BUFFSIZE if env.get(DEEPEP_HCCL_BUFFSIZE) is not None else HCCL_BUFFSIZE
    raw = env.get(name)
    parsed = None if raw is None else stoi_prefix(raw)
    return DEFAULT_HCCL_BUFFSIZE_MB if parsed is None else _wrap(parsed, 16, signed=False)


# -- the group's HCCL window -----------------------------------------------------------------------------------
# HCCL gives each communicator its own window (HcclCommConfig.hcclBufferSize, MB). torch_npu fills it from the
# group's pg_options: ``ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": N}`` (Ascend/pytorch@9e73e708
# torch_npu/csrc/distributed/ProcessGroupHCCL.cpp createHCCLComm config; docs/zh/developer_notes/distributed/
# parameter_setting/setting_HCCL_communicator_parameter.md: the group's option > the variable > the default, e.g.
# HCCL_BUFFSIZE=200 and a group's 100 give that group 100 MB); a group created without it takes HCCL_BUFFSIZE,
# else 200. The options stay readable: torch_npu binds
# ``ProcessGroupHCCL.options`` (read-only) and ``Options.hccl_config`` (read-write) (Ascend/pytorch@9e73e708
# torch_npu/csrc/distributed/Init.cpp), and torch-npu 2.13.0 reads ``group._get_backend(torch.device("npu"))
# .options.hccl_config`` itself (torch_npu/profiler/profiler_interface.py _add_group_info_to_metadata).
# sglang sizes its default and MoE groups so: hccl_buffer_size = int(DEEPEP_HCCL_BUFFSIZE or HCCL_BUFFSIZE or 200)
# (sgl-project/sglang@0005973a python/sglang/srt/distributed/parallel_state.py get_torch_distributed_pg_options).
HCCL_BUFFER_SIZE_KEY = "hccl_buffer_size"
# Other hccl_config keys torch_npu passes to HCCL (Ascend/pytorch@9e73e708 ProcessGroupHCCL.cpp
# createHcclCommConfigWithOptions; both in torch-npu 2.13.0's libtorch_npu.so): "hccl_buffer_name" makes
# communicators of that name share ONE buffer (HcclCommConfig.hcclBufferName; getHcclNPUStream also shares their
# stream), "hccl_op_expansion_mode" is HCCL_OP_EXPANSION_MODE for this group (hcclOpExpansionMode, an int).
HCCL_BUFFER_NAME_KEY = "hccl_buffer_name"
HCCL_OP_EXPANSION_KEY = "hccl_op_expansion_mode"
SGLANG_GROUP_WINDOW_RULE = ("sglang creates its MoE group with hccl_config={'hccl_buffer_size': DEEPEP_HCCL_BUFFSIZE "
                            "or HCCL_BUFFSIZE or 200}")


def group_hccl_config(process_group: Any) -> dict[str, Any] | None:
    """The ``hccl_config`` the group's HCCL backend was created with (``{}``: none), or None where it
    cannot be read (no torch_npu, no NPU backend on the group, an older torch_npu)."""
    try:
        import torch

        backend = process_group._get_backend(torch.device(NPU_DEVICE_TYPE))
        return dict(backend.options.hccl_config)
    except Exception:  # noqa: BLE001 - unreadable is an answer (the caller takes the documented rule)
        return None


def is_layered(env: Mapping[str, str]) -> bool:
    """The A2 two-node ("layered") low-latency kernels: HCCL_INTRA_PCIE_ENABLE=1 and
    HCCL_INTRA_ROCE_ENABLE=0 (read on ASCEND910B only; KN@f425bdf deep_ep.cpp low_latency_dispatch)."""
    return env.get(INTRA_PCIE_ENV) == "1" and env.get(INTRA_ROCE_ENV) == "0"


# -- limits ------------------------------------------------------------------------------------------

# KN@f425bdf python/deep_ep/deep_ep/buffer.py Buffer.get_dispatch_config / get_combine_config: `assert num_ranks
# in config_map` ("Unsupported number of EP ranks"), run by dispatch/combine when config is None.
CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
# KN@f425bdf buffer.py Buffer.num_sms (class attribute) and the Config rows of get_dispatch_config.
NUM_SMS = 20
# KN@f425bdf csrc/deepep/ops/op_host/moe_distribute_dispatch_v2_tiling.cpp (A3) and
# ops2/op_host/moe_distribute_dispatch_v2_tiling.cc (A2): MIN_EP_WORLD_SIZE = 2, MAX_EP_WORLD_SIZE = 768;
# cam_moe_dispatch_normal_tiling.cc (normal): 2 .. 384.
MIN_EP_WORLD_SIZE = 2
MAX_EP_WORLD_SIZE_LL = 768
MAX_EP_WORLD_SIZE_NORMAL = 384
# ... BS_UPPER_BOUND = 512 (x rows per rank in low-latency); python/deep_ep/doc/LOW_LATENCY_API.md: num_tokens <= 512.
LL_MAX_TOKENS = 512
# ... K_MAX = 16; doc: A2 internode top-k [2, 16], otherwise (0, 16].
MAX_TOP_K = 16
A2_LAYERED_MIN_TOP_K = 2
# ... H_MIN = 1024, H_MAX = 8192 (A3 op); ops2 (A2): h % 32 == 0 and h <= 7168 (MAX_HIDDEN_SIZE_A2).
MIN_HIDDEN = 1024
MAX_HIDDEN = 7168
HIDDEN_MULTIPLE = 32
# doc LOW_LATENCY_API.md num_experts (0, 512]; ops2 MAX_MOE_EXPERT_NUMS_A2 = 512 (A3 op: 1024).
MAX_EXPERTS = 512
# KN@f425bdf csrc/deepep/deep_ep.cpp: MAX_TOKENS_PER_ROUND = 8192 = the default per_round_tokens; with round = 1
# get_dispatch_layout asserts num_tokens <= round * per_round_tokens.
NORMAL_MAX_TOKENS = 8192
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::Buffer: on ASCEND910B num_rdma_ranks = max(1, R / A2_MAX_HCCS_PEERS), so
# ranks >= 16 take the internode path (9..15 stay on one "node"; this plugin refuses R % 8 != 0 there); the ops2
# low-latency tiling takes its multi-server kernels from R > 8 (moe_distribute_dispatch_v2_tiling.cc
# MoeDistributeDispatchA2GetIsSingle: epWorldSize <= RANK_NUM_PER_NODE_A2 is the single-server kernel).
A2_MAX_HCCS_PEERS = 8
# KN@f425bdf csrc/deepep/deep_ep.cpp PADDING_SIZE: an empty receive still returns this many rows.
EMPTY_RECEIVE_ROWS = 1
# KN@f425bdf ep_strategy.py VALID_QUANT_MODES (normal) and strategies/low_latency_strategy.py valid_quant_modes.
NORMAL_QUANT_MODES = frozenset({"bf16", "int8", "mx_fp8_e4m3", "mx_fp8_e5m2", "pertoken_fp8_e4m3", "mx_fp4_e2m1"})
LL_QUANT_MODES = frozenset({None, "int8", "mx_fp8_e4m3", "mx_fp8_e5m2", "pertoken_fp8_e4m3", "mx_fp4_e2m1"})
# KN@f425bdf deep_ep.cpp: the A5-only ones fail EP_HOST_ASSERT_S on A2/A3 builds (not __DAV_C310__).
A5_ONLY_QUANT_MODES = frozenset({"mx_fp8_e4m3", "mx_fp8_e5m2", "pertoken_fp8_e4m3", "mx_fp4_e2m1"})


# The normal op (CamMoeDispatchNormal) tiling (KN@f425bdf csrc/deepep/ops/op_host/cam_moe_dispatch_normal_tiling.cc
# CheckAttrs / GetAttrAndSetTilingData / CheckTensorShape; ops2 the A2 build): EP 2..384, E <= 1024 (A2: 512),
# E % R == 0, E_local·R <= 1280 (DISPATCH_STATUS_MAX_SUPPORT_NUM), k in (0, min(16, E)], H 1024..8192 (A2: 7168),
# globalBS > 0 ("globalBS is invalid, should be positive").
NORMAL_OP_MAX_EXPERTS = {"A3": 1024, "A2": 512}
NORMAL_OP_MAX_HIDDEN = {"A3": 8192, "A2": 7168}
NORMAL_OP_MAX_DISPATCH_STATUS = 1280
# KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::intranode_dispatch: `real_max_bs = max(max_bs, num_worst_tokens)` is a
# Buffer member (deep_ep.hpp) that intranode_combine passes to aclnnCamMoeCombineNormal; max_bs is the largest
# batch over the source ranks (ops/op_kernel/notify_dispatch.h); global_bs = min(per_round_tokens, real_max_bs)·R.
# The combine's tiling refuses realMaxBs != 0 below its own batch ("realMaxBs is invalid, only support 0 or value
# greater than or equal to the BS of all ranks", ops/op_host/cam_moe_combine_normal_tiling.cc). num_worst_tokens
# reaches intranode_dispatch on every supported build (KN@0ac00159 buffer.py Buffer.dispatch) and only raises
# real_max_bs there (the count list and the output rows are unchanged, unlike CUDA DeepEP).

# -- the chip (SoC) -------------------------------------------------------------------------------------

SOC_A2, SOC_A3 = "A2", "A3"
# torch_npu.npu.get_soc_version() codes (torch_npu's c10_npu::SocVersion, Ascend/pytorch@9e73e708
# torch_npu/csrc/core/npu/NpuVariables.h): Ascend910B1 = 220 .. Ascend910B4_1 = 225 (Atlas A2); Ascend910_9391 = 250,
# 9392, 9381, 9382, 9372, 9362, Ascend910_9363 = 256 (Atlas A3; 9363 was appended after 9362); Ascend950 = 260 (A5).
# DeepEP-Ascend's C++ asks the same platform (op::GetCurrentPlatformInfo().GetSocVersion() == ASCEND910B,
# KN@f425bdf deep_ep.cpp Buffer::Buffer).
A2_SOC_CODES = range(220, 226)
A3_SOC_CODES = range(250, 257)
# Where the code is one this table does not know (a newer part), the name decides, as torch_npu itself does
# (torch-npu 2.13.0 torch_npu/distributed/distributed_c10d.py: "Ascend910B1" <= name <= "Ascend910B4_1",
# "Ascend910_9362" <= name <= "Ascend910_9392"; NpuVariables.cpp maps "Ascend910B4-1", "Ascend910_9363" ...):
# "Ascend910B<digit>..." is an Atlas A2 part, "Ascend910_93xx" an Atlas A3 part; anything else is unknown.
A2_SOC_NAME = re.compile(r"^Ascend910B\d")
A3_SOC_NAME = re.compile(r"^Ascend910_93\d\d")
# KN@f425bdf build.sh: "auto-select ops (A3/A5) or ops2 (A2)"; csrc/deepep/ops2 has no FusedDeepMoe and no
# DispatchFFNCombine op, so an A2 wheel's fused_deep_moe fails in EXEC_NPU_CMD.
FUSED_OPS_SOCS = frozenset({SOC_A3})


def soc_family(code: int | None) -> str | None:
    """``"A2"``, ``"A3"`` or None (another or unknown chip) for a ``torch_npu.npu.get_soc_version()`` code."""
    if code in A2_SOC_CODES:
        return SOC_A2
    if code in A3_SOC_CODES:
        return SOC_A3
    return None


def soc_family_from_name(name: str | None) -> str | None:
    """``"A2"``, ``"A3"`` or None for a ``torch_npu.npu.get_device_name()`` SoC name."""
    if not isinstance(name, str):
        return None
    if A2_SOC_NAME.match(name):
        return SOC_A2
    if A3_SOC_NAME.match(name):
        return SOC_A3
    return None


def current_soc(torch_npu_module: Any) -> str | None:
    """The chip family ``torch_npu_module`` reports: by ``npu.get_soc_version()``'s code, and by
    ``npu.get_device_name()`` where the code is not one of the known A2/A3 codes (None if neither says)."""
    try:
        family = soc_family(int(torch_npu_module.npu.get_soc_version()))
    except Exception:  # noqa: BLE001 - no device, or an older torch_npu: ask the name
        family = None
    if family is not None:
        return family
    try:
        return soc_family_from_name(torch_npu_module.npu.get_device_name())
    except Exception:  # noqa: BLE001 - unknown
        return None


# A2 (ASCEND910B) with 16 ranks or more (num_rdma_ranks = max(1, R / 8) > 1; this plugin refuses R % 8 != 0 beyond
# 8): DeepEP-Ascend takes its internode paths (KN@f425bdf deep_ep.cpp A2_MAX_HCCS_PEERS;
# strategies/normal_strategy.py DefaultNormalCommStrategy.dispatch: get_num_rdma_ranks() > 1).
# Normal mode (Buffer::internode_dispatch / internode_combine; the same at KN@0ac00159):
# - the Python reads only DEEP_NORMAL_MODE_USE_INT8_QUANT (quant_mode and num_worst_tokens are not passed on);
#   the C++ turns it into quant mode 2 (DYNAMIC_SCALES), global_bs = MAX_BATCH_SIZE(4096)·R;
# - aclnnNotifyDispatchA2's tiling: rankSize in (0, 64], localRankSize <= 8, and `2·4 B·sendCount + 2 MB` against
#   the window the ops see (ops2/op_host/notify_dispatch_tiling_a2.cc MAX_A2_WORLD_SIZE, CheckTensorDataType);
#   but its KERNEL exchanges with exactly one peer server: targetRankId = (1 − serverId)·localRankSize + localRank
#   ("2个server的计算方式", ops2/op_kernel/notify_dispatch_a2.h CpGM2GMPingPong, ConstructBatchWriteInfo,
#   offsetInner), deep_ep.cpp internode_dispatch allocates offset_inner [2, MAX_BATCH_SIZE, E] ("the current rank
#   and the peer rank"), and the combine is built with COMBINE_2SERVER_VERSION (moe_distribute_combine_a2_layered.h):
#   the path exists for two 8-NPU servers, 16 ranks (the README's "A2 Dual Node"; the vendor's CI runs
#   node_size 2, tests/python/deepep/run_test_internode.sh WORLD_SIZE=2); the same at KN@0ac00159;
# - aclnnDispatchNormalA2's tiling (ops2/op_host/dispatch_normal_a2_tiling.cpp
#   MoeDistributeDispatchA2CheckShapeAndSetTiling / ...CheckAttrAndSetTiling): bs <= 4096, k 2..16 (2..10 before
#   KN@7a396def, 2026-07-15), H % 32 and <= 7168, R % 8 == 0 and R <= 256, E % R, E <= 512, quant mode 0 or 2;
#   no window check (the `R·maxBs·H·2·2·E_l` one in the same file is in MoeDistributeDispatchA3TilingFuncImpl,
#   which IMPL_OP_OPTILING never calls);
# - its tiling key is 2000000000 + 1000 [+ 100000000 with the layered variables] + quant mode [+ 10 with scales]
#   (MoeDistributeDispatchA2CalcTilingKey) and ops2/op_kernel/dispatch_normal_a2.cpp has kernels for 2100001000,
#   2000000000 and 2000001000 only, all CamMoeDistributeDispatchA2Layered<bfloat16_t, bfloat16_t, ...>: no INT8;
#   the README: "A2 Dual Node ... Normal mode does NOT support quantization";
# - aclnnMoeDistributeCombineA2's tiling (ops2/op_host/moe_distribute_combine_a2_tiling.cpp): key 3000 with the
#   layered variables (bs <= 4096), else 2000 (bs <= 256); ops2/op_kernel/moe_distribute_combine_a2.cpp has
#   TILING_KEY_IS(3000) only: the README "A2 Dual Node: Must set HCCL_INTRA_PCIE_ENABLE=1 and
#   HCCL_INTRA_ROCE_ENABLE=0".
# Low latency: ops2/op_host/moe_distribute_dispatch_v2_tiling.cc MAX_EP_WORLD_SIZE_A2 = 256, RANK_NUM_PER_NODE_A2 = 8.
A2_INTERNODE_MAX_TOKENS = 4096
A2_INTERNODE_MAX_EP = 256
A2_INTERNODE_EP_MULTIPLE = 8
A2_INTERNODE_MAX_EP_NORMAL = 64  # the notify TILING's limit; the kernels take exactly A2_INTERNODE_NORMAL_RANKS
#: The one world size the A2 internode normal kernels handle: two servers of 8 (notify_dispatch_a2.h, above).
A2_INTERNODE_NORMAL_RANKS = 16
A2_INTERNODE_MAX_TOP_K = 16
#: dispatch_normal_a2_tiling.cpp MAX_K_VALUE_A2 before KN@7a396def (which precedes KN@f451a596, the first change
#: Python sees: low_latency_dispatch(quant_mode=); a build without it may have the old limit).
A2_INTERNODE_MAX_TOP_K_OLD = 10
A2_INTERNODE_DISPATCH_KERNELS = frozenset({2100001000, 2000000000, 2000001000})
A2_INTERNODE_COMBINE_KERNELS = frozenset({3000})
A2_INTERNODE_COMBINE_MAX_BS = {True: 4096, False: 256}  # by layered
QUANT_MODE_NONE, QUANT_MODE_DYNAMIC = 0, 2  # deep_ep.cpp NO_SCALES, DYNAMIC_SCALES


def a2_internode_dispatch_tiling_key(quant_mode: int, layered: bool, scales: bool) -> int:
    """MoeDistributeDispatchA2CalcTilingKey (ops2/op_host/dispatch_normal_a2_tiling.cpp)."""
    return 2000000000 + 1000 + (100000000 if layered else 0) + quant_mode + (10 if scales else 0)


def a2_internode_combine_tiling_key(layered: bool) -> int:
    """MoeDistributeCombineA2CalcTilingKey (ops2/op_host/moe_distribute_combine_a2_tiling.cpp)."""
    return 3000 if layered else 2000


def ll_receive_rows(tokens: int, world_size: int, local_experts: int, top_k: int) -> int:
    """Rows of ``low_latency_dispatch``'s packed output, ``T·R·min(k, E_local)`` (no shared
    experts; KN@f425bdf csrc/deepep/deep_ep.cpp Buffer::low_latency_dispatch num_max_tokens)."""
    return tokens * world_size * min(top_k, local_experts)


# -- HCCL window: the ops' own checks, ported -----------------------------------------------------------

MIB = 1 << 20
DEFAULT_HCCL_BUFFSIZE_MB = 200
#: Mc2TilingUtils::GetMaxWindowSize parses the MB count into a uint16 (KN@f425bdf mc2_tiling_utils.h).
MAX_HCCL_BUFFSIZE_MB = 65535
_WIN_ALIGN, _UB_ALIGN, _SCALE_IDX, _OUT_BYTES = 512, 32, 44, 2


def _ceil(n: int, a: int) -> int:
    return -(-n // a) * a


def readme_window_bytes(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    """The documented non-layered minimum ``(bs·R·min(E_local, k)·H·2 B + 2 MB)·2``
    (KN@f425bdf python/deep_ep/README.md "HCCL_BUFFSIZE"; doc/LOW_LATENCY_API.md Constraints)."""
    return 2 * (tokens * world_size * min(local_experts, top_k) * hidden * 2 + 2 * MIB)


def ll_op_window_bytes(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int,
                       shared_experts: int = 0) -> int:
    """What ``MoeLowLatencyCombineV2``'s tiling checks (it always sizes BF16 rows, so it bounds the
    dispatch op's check too): ``((T·tokDispatch·R·E_local) + T·tokCombine·(k + shared))·2`` with
    ``tokCombine = ceil512(2H)``, ``tokDispatch = ceil512(ceil32(2H) + 44)``
    (KN@f425bdf csrc/deepep/ops/op_host/moe_distribute_combine_v2_tiling.cpp; the same in
    moe_distribute_dispatch_v2_tiling.cpp CheckWinSize and ops2 for A2 single-node)."""
    combine = _ceil(hidden * _OUT_BYTES, _WIN_ALIGN)
    dispatch = _ceil(_ceil(hidden * _OUT_BYTES, _UB_ALIGN) + _SCALE_IDX, _WIN_ALIGN)
    return (tokens * dispatch * world_size * local_experts + tokens * combine * (top_k + shared_experts)) * 2


def layered_window_bytes(tokens: int, hidden: int, num_experts: int, top_k: int) -> int:
    """A2 layered (two-node) low latency: the dispatch kernel's assert ``E·bs·(H·2 B + 4·RoundUp(k, 8)·4 B) +
    4 MB + 800 MB`` on the real window (KN@f425bdf csrc/deepep/ops2/op_kernel/moe_distribute_dispatch_v2_layered.h
    Init: alignK_ = RoundUp(axisK_, 8)); the combine's (moe_distribute_combine_v2_layered.h) and the README's use
    k unpadded, so this one bounds them."""
    return num_experts * tokens * (hidden * 2 + 4 * _ceil(top_k, 8) * 4) + 4 * MIB + 800 * MIB


def normal_op_window_bytes(tokens: int, hidden: int, top_k: int, per_round_tokens: int = NORMAL_MAX_TOKENS) -> int:
    """``CamMoeDispatchNormal``'s tiling check with one round: ``(maxBs·k·(tokCombine + tokDispatch)
    + 4 MB + 102 MB)·2``, maxBs = min(per_round_tokens, the batch)
    (KN@f425bdf csrc/deepep/ops/op_host/cam_moe_dispatch_normal_tiling.cc, op_host/tiling_args.h)."""
    max_bs = min(per_round_tokens, tokens)
    combine = _ceil(hidden * _OUT_BYTES, _WIN_ALIGN)
    dispatch = _ceil(_ceil(hidden * _OUT_BYTES, _UB_ALIGN) + _SCALE_IDX, _WIN_ALIGN)
    return (max_bs * top_k * (combine + dispatch) + 4 * MIB + 102 * MIB) * 2


def normal_op_window_bytes_a2(tokens: int, hidden: int, top_k: int, per_round_tokens: int = NORMAL_MAX_TOKENS) -> int:
    """The A2 build's ``CamMoeDispatchNormal`` check (ranks <= 8 on ASCEND910B): ``(maxBs·k·(tokCombine +
    tokDispatch) + 8 MB + 404 MB)·2 + 4·2 MB``, maxBs = min(per_round_tokens, real_max_bs)
    (KN@f425bdf csrc/deepep/ops2/op_host/cam_moe_dispatch_normal_tiling.cc, ops2/op_host/tiling_args.h
    COMBINE_STATE_WIN_OFFSET 8 MB, NOTIFY_DISPATCH_WIN_OFFSET 404 MB, STATE_SIZE 2 MB): at least 833 MB."""
    max_bs = min(per_round_tokens, tokens)
    combine = _ceil(hidden * _OUT_BYTES, _WIN_ALIGN)
    dispatch = _ceil(_ceil(hidden * _OUT_BYTES, _UB_ALIGN) + _SCALE_IDX, _WIN_ALIGN)
    return (max_bs * top_k * (combine + dispatch) + 8 * MIB + 404 * MIB) * 2 + 4 * 2 * MIB


# A2 internode normal mode: the kernels lay out the REAL window (winContext_->winSize: the group's, not what the
# ops' environment says) as 800 MB of RDMA area (two halves of 400 MB, 1 MB of status each), a 4 MB IPC offset,
# IPC data, and the notify op's 400 MB at the end (KN@f425bdf csrc/deepep/ops2/op_kernel/a2/
# cam_moe_distribute_dispatch_a2_layered.h RDMA_DATA_SIZE, IPC_DATA_OFFSET, STATUS_SIZE_LAYERED;
# ops2/op_kernel/moe_distribute_combine_a2_layered.h NOTIFY_DATA_SIZE; ops2/op_kernel/notify_dispatch_a2.h
# notifyMemoryOffset = winSize − 2·IPC_BUFF_MAX_SIZE (200 MB, comm_args.h)).
A2_RDMA_BYTES = 800 * MIB
A2_IPC_OFFSET_BYTES = 4 * MIB
A2_NOTIFY_BYTES = 400 * MIB
A2_STATUS_BYTES = 1 * MIB
A2_INTERNODE_RESERVED_BYTES = A2_RDMA_BYTES + A2_IPC_OFFSET_BYTES + A2_NOTIFY_BYTES  # 1204 MB
UINT32_SPAN = 1 << 32
#: MoeDistributeCombineA2 keeps IPC_DATA_SIZE = winSize − 1204 MB in a uint32_t: from 1204 + 4096 MB it wraps
#: (moe_distribute_combine_a2_layered.h IPC_DATA_SIZE); the notify op's bound below is the tighter.
A2_INTERNODE_COMBINE_MAX_WINDOW_MB = 1204 + 4096 - 1
#: aclnnNotifyDispatchA2 keeps ``notifyMemoryOffset = winSize − 2·IPC_BUFF_MAX_SIZE`` (200 MB, ops2/op_kernel/
#: comm_args.h) in a uint32_t (ops2/op_kernel/notify_dispatch_a2.h Init, member notifyMemoryOffset; the same at
#: KN@0ac00159): from 400 + 4096 MB it wraps, and its 400 MB area and persistent magic land in the 0..804 MB the
#: dispatch and combine rewrite every call. The largest group window the A2 internode path takes.
A2_INTERNODE_MAX_WINDOW_MB = 400 + 4096 - 1
_SERVER = 8  # SERVER_RANK_SIZE


def normal_internode_combine_assert_bytes(tokens: int, hidden: int, world_size: int, top_k: int) -> int:
    """MoeDistributeCombineA2Layered::Init's ``assert(winSize >= serverNum·bs·(H·2 B + 4·k·4 B) + 4 MB + 800 MB +
    400 MB)`` ("the HCCL_BUFFSIZE ... the min value should be ...MB") (KN@f425bdf
    ops2/op_kernel/moe_distribute_combine_a2_layered.h)."""
    return world_size // _SERVER * tokens * (hidden * 2 + 4 * top_k * 4) + A2_INTERNODE_RESERVED_BYTES


def normal_internode_ipc_bytes(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    """The IPC data the combine writes: AlltoAllDispatch puts one ``(H + 16)`` bf16 entry per (token of the
    destination rank, expert of this server) into that destination's node slice, ``8·floor(IPC_DATA_SIZE / R)``
    (moe_distribute_combine_a2_layered.h AlltoAllDispatch: ipcSliceSize, tokenOffset over the server's experts):
    up to ``T·min(k, 8·E_l)`` entries per slice, so IPC_DATA_SIZE >= ``R·ceil(T·min(k, 8·E_l)·(2H + 32) / 8)``."""
    per_slice = tokens * min(top_k, _SERVER * local_experts) * (hidden * 2 + 32)
    return world_size * -(-per_slice // _SERVER)


def normal_internode_window_bytes_a2(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    """The real window the A2 internode normal kernels need: the combine's assert and its IPC slices
    (``normal_internode_ipc_bytes`` after the 1204 MB the kernels reserve), the larger."""
    return max(normal_internode_combine_assert_bytes(tokens, hidden, world_size, top_k),
               A2_INTERNODE_RESERVED_BYTES + normal_internode_ipc_bytes(tokens, hidden, world_size, local_experts,
                                                                        top_k))


def a2_internode_dispatch_server_bytes(world_size: int) -> int:
    """The dispatch's share of the RDMA area per destination server: ``floor4K((400 MB − 1 MB) / S)``
    (cam_moe_distribute_dispatch_a2_layered.h WIN_SIZE, SERVER_SIZE_ON_WIN), holding ``32 B`` of count and one
    ``H·2 B + 4·RoundUp(k, 8)·4 B`` token struct per token of the rank sent to that server (tokenStructLen_)."""
    return (A2_RDMA_BYTES // 2 - A2_STATUS_BYTES) // (world_size // _SERVER) // 4096 * 4096


def a2_internode_combine_server_bytes(world_size: int) -> int:
    """The combine's share of the RDMA area per server: ``8·floor32((400 MB − 1 MB) / R)`` (moe_distribute_combine_
    a2_layered.h dataSpaceSize_, rankSizeOnWin_), holding token i of a rank at ``i·H·2 B``
    (COMBINE_2SERVER_VERSION)."""
    return (A2_RDMA_BYTES // 2 - A2_STATUS_BYTES) // world_size // 32 * 32 * _SERVER


def a2_internode_notify_offset(window_bytes: int) -> int:
    """notifyMemoryOffset as the notify op computes it from the real window: ``(winSize − 400 MB) mod 2³²``."""
    return (window_bytes - A2_NOTIFY_BYTES) % UINT32_SPAN


#: The combine's RDMA write per server is ``countReL = MAX_BS`` rows of ``H·2 B`` whatever the batch
#: (moe_distribute_combine_a2_layered.h, COMBINE_2SERVER_VERSION; BatchWrite length countReL·H).
A2_INTERNODE_COMBINE_ROWS = A2_INTERNODE_MAX_TOKENS


def a2_internode_ipc_window_bytes(window_bytes: int) -> int:
    """IPC_DATA_SIZE as the combine computes it from the real window: ``(winSize − 1204 MB) mod 2^32``."""
    return (window_bytes - A2_INTERNODE_RESERVED_BYTES) % (1 << 32)


def notify_dispatch_a2_window_bytes(num_experts: int, world_size: int, top_k: int) -> int:
    """aclnnNotifyDispatchA2's tiling check against the window the ops see: ``2·4 B·sendCount + 2 MB`` with
    sendCount = ``E·4097 + S + 4096·(1 + 2S + 2k)`` (deep_ep.cpp get_dispatch_layout notify_send_data_size;
    ops2/op_host/notify_dispatch_tiling_a2.cc)."""
    servers = world_size // _SERVER
    send_count = num_experts * (1 + A2_INTERNODE_MAX_TOKENS) + servers + \
        A2_INTERNODE_MAX_TOKENS * (1 + 2 * servers + 2 * top_k)
    return 2 * 4 * send_count + 2 * MIB


# -- 32-bit window arithmetic in the kernels: the largest windows they address right ------------------------------

# A2 layered low latency (R > 8 with HCCL_INTRA_PCIE_ENABLE=1, HCCL_INTRA_ROCE_ENABLE=0): the dispatch keeps
# ``uint32_t totalSize_ = winSize`` and ``RANK_SIZE_ON_IPC = (totalSize_ − 800 MB − 4 MB)/(E_l·R)``
# (ops2/op_kernel/moe_distribute_dispatch_v2_layered.h Init), the combine ``uint32_t IPC_DATA_SIZE = winSize −
# 800 MB − 4 MB`` and each destination's slice at ``dstRankId·ipcSliceSize + IPC_DATA_OFFSET`` (4 MB), a uint32
# sum (moe_distribute_combine_v2_layered.h Init, slice addressing). Both are right while the IPC area and its
# offset stay below 4 GiB: a window of at most 800 + 4096 MB. The same at KN@0ac00159.
A2_LAYERED_RESERVED_BYTES = 800 * MIB + 4 * MIB
A2_LAYERED_MAX_WINDOW_MB = 800 + 4096
# A2 beyond 8 ranks, not layered (the multi-server "fullmesh" kernels, tiling key 2000001000 / combine 2000): the
# dispatch keeps ``uint32_t totalSize_ = winSize / 2`` (ops2/op_kernel/moe_distribute_dispatch_v2.h Init) and the
# combine ``uint32_t halfWinSize_ = winSize / 2`` (ops2/op_kernel/moe_distribute_combine_v2.h Init): from 8192 MB
# the half wraps. The single-server kernels (R <= 8) and A3's keep uint64 offsets.
A2_LL_MULTI_SERVER_MAX_WINDOW_MB = 2 * 4096 - 1


def a2_layered_ipc_bytes(window_bytes: int) -> int:
    """The layered kernels' IPC area as they compute it from the real window: ``(winSize − 804 MB) mod 2³²``."""
    return (window_bytes - A2_LAYERED_RESERVED_BYTES) % UINT32_SPAN


# The normal dispatch op (CamMoeDispatchNormal; A3 and A2 up to 8 ranks) keeps its data offset in a uint32:
# ``uint32_t winDataSizeOffset = dataState·(totalWinSize / 2) + min(realMaxBatchSize, perRoundTokens)·topK·
# hSizeAlignCombine`` with hSizeAlignCombine = ceil512(2H) (doubled with rounds > 1) and totalWinSize the ops'
# window (Mc2TilingUtils::GetMaxWindowSize: DEEPEP_HCCL_BUFFSIZE, else HCCL_BUFFSIZE) (KN@f425bdf
# csrc/deepep/ops/op_kernel/cam_moe_dispatch_normal.h Init, members dataState / winDataSizeOffset; identical at
# KN@0ac00159 and KN@929a00ae); the A2 build halves ``totalWinSize − 4·STATE_SIZE`` (2 MB,
# ops2/op_kernel/comm_args.h; ops2/op_kernel/cam_moe_dispatch_normal.h). The data is addressed from that offset (GetWindAddrByRankId), so in
# state 1 an offset past 4 GiB wraps onto the first half's combine area and dispatch data. The combine keeps its
# half in a uint64 (cam_moe_combine_normal.h winDataSizeOffset_). The adapter runs one round and passes
# num_worst_tokens = T, so realMaxBatchSize = T.
NORMAL_OP_A2_STATE_BYTES = 4 * 2 * MIB


def normal_op_state1_offset(window_bytes: int, tokens: int, hidden: int, top_k: int, soc: str,
                            per_round_tokens: int = NORMAL_MAX_TOKENS, rounds: int = 1) -> int:
    """The state-1 ``winDataSizeOffset`` before the kernel's uint32 truncation (``soc`` "A3" or "A2"; with
    ``rounds`` > 1 the kernel doubles hSizeAlignCombine)."""
    half = (window_bytes - (NORMAL_OP_A2_STATE_BYTES if soc == SOC_A2 else 0)) // 2
    row = _ceil(hidden * _OUT_BYTES, _WIN_ALIGN) * (2 if rounds > 1 else 1)
    return half + min(tokens, per_round_tokens) * top_k * row


def normal_op_max_window_mb(tokens: int, hidden: int, top_k: int, soc: str | None) -> int:
    """The largest ops' window (MB) whose state-1 offset stays below 2³² on ``soc`` (None: either chip, the
    smaller: A3's, which does not subtract the A2 build's 8 MB)."""
    c = normal_op_state1_offset(0, tokens, hidden, top_k, SOC_A3)
    most = (UINT32_SPAN - c - 1) // (MIB // 2)
    return most + NORMAL_OP_A2_STATE_BYTES // MIB if soc == SOC_A2 else most


def window_mb(nbytes: int) -> int:
    """HCCL_BUFFSIZE (MB) that passes an op's ``actualSize > HCCL_BUFFSIZE·MiB`` check."""
    return math.ceil(nbytes / MIB)


def low_latency_rdma_size_hint(module: ModuleType, tokens: int, hidden: int, world_size: int, experts: int) -> int:
    """DeepEP-Ascend's only exported size function; a dummy that returns ``tokens``
    (KN@f425bdf csrc/deepep/config.cpp get_low_latency_rdma_size_hint), used to tell the
    builds apart, never to size anything."""
    return int(module.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, world_size, experts))


# -- recorded signatures --------------------------------------------------------------------------------


_BUF = f"{KN}@{KN_MAIN} python/deep_ep/deep_ep/buffer.py"

SIG_BUFFER_INIT = VendorSignature(
    "Buffer.__init__",
    "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=12, "
    "allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, normal_strategy=NormalStrategy.DEFAULT, "
    "low_latency_strategy=LowLatencyStrategy.DEFAULT)", _BUF + " Buffer.__init__ (since KN@9aa6257c)")
SIG_BUFFER_INIT_OLD = VendorSignature(
    "Buffer.__init__",
    "(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=12, "
    "allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False)", f"{KN}@450070c2 buffer.py (until KN@9aa6257c)")
SIG_GET_DISPATCH_LAYOUT = VendorSignature(
    "Buffer.get_dispatch_layout",
    "(self, topk_idx, num_experts, previous_event=None, async_finish=False, allocate_on_comm_stream=False)",
    _BUF + " Buffer.get_dispatch_layout")
SIG_DISPATCH = VendorSignature(
    "Buffer.dispatch",
    "(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, "
    "num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, "
    "config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False, "
    "dispatch_wait_recv_cost_stats=None, quant_mode=None)", _BUF + " Buffer.dispatch (since KN@7c2b9e06)")
SIG_DISPATCH_ENV_ONLY = VendorSignature(
    "Buffer.dispatch",
    "(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None, "
    "num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, "
    "config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False, "
    "dispatch_wait_recv_cost_stats=None)", f"{KN}@be6b5e7f buffer.py Buffer.dispatch (KN@ff12c201 .. KN@7c2b9e06)")
SIG_COMBINE = VendorSignature(
    "Buffer.combine",
    "(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False, "
    "allocate_on_comm_stream=False, combine_send_cost_stats=None)", _BUF + " Buffer.combine (since KN@ff12c201)")
SIG_LOW_LATENCY_DISPATCH = VendorSignature(
    "Buffer.low_latency_dispatch",
    "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, "
    "use_fp8=True, round_scale=False, use_ue8m0=False, use_mxfp4=False, async_finish=False, "
    "return_recv_hook=False, topk_weights=None, quant_mode=None)",
    _BUF + " Buffer.low_latency_dispatch (since KN@f451a596)")
SIG_LOW_LATENCY_DISPATCH_USE_FP8 = VendorSignature(
    "Buffer.low_latency_dispatch",
    "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, "
    "use_fp8=True, round_scale=False, use_ue8m0=False, use_mxfp4=False, async_finish=False, "
    "return_recv_hook=False, topk_weights=None)", f"{KN}@be6b5e7f buffer.py Buffer.low_latency_dispatch "
    "(KN@be6b5e7f .. KN@f451a596)")
SIG_LOW_LATENCY_DISPATCH_TOPK_WEIGHTS = VendorSignature(
    "Buffer.low_latency_dispatch",
    "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, "
    "use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False, topk_weights=None)",
    f"{KN}@9aa6257c buffer.py Buffer.low_latency_dispatch (KN@9aa6257c .. KN@be6b5e7f)")
SIG_LOW_LATENCY_DISPATCH_OLD = VendorSignature(
    "Buffer.low_latency_dispatch",
    "(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats=None, "
    "use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False)",
    f"{KN}@0ac00159 buffer.py Buffer.low_latency_dispatch (KN@0ac00159 .. KN@9aa6257c)")
SIG_LOW_LATENCY_COMBINE = VendorSignature(
    "Buffer.low_latency_combine",
    "(self, x, topk_idx, topk_weights, handle, zero_copy=False, async_finish=False, return_recv_hook=False, "
    "out=None)", _BUF + " Buffer.low_latency_combine (unchanged since KN@450070c2)")
SIG_LL_SIZE_HINT = VendorSignature(
    "Buffer.get_low_latency_rdma_size_hint",
    "(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)", _BUF + " (staticmethod)")
SIG_GET_DISPATCH_CONFIG = VendorSignature("Buffer.get_dispatch_config", "(num_ranks)", _BUF + " (staticmethod)")
SIG_GET_COMBINE_CONFIG = VendorSignature("Buffer.get_combine_config", "(num_ranks)", _BUF + " (staticmethod)")
SIG_FUSED_DEEP_MOE = VendorSignature(
    "Buffer.fused_deep_moe",
    "(self, x, topk_idx, topk_weights, gmm1_permuted_weight, gmm1_permuted_weight_scale, gmm2_weight, "
    "gmm2_weight_scale, num_max_dispatch_tokens_per_rank, num_experts, quant_mode=1, "
    "fuse_mode=FuseMode.FUSED_DEEP_MOE, profile_enable=False)", _BUF + " Buffer.fused_deep_moe (since KN@0a7c55a4)")
SIG_FUSED_DEEP_MOE_NO_PROFILE = VendorSignature(
    "Buffer.fused_deep_moe",
    "(self, x, topk_idx, topk_weights, gmm1_permuted_weight, gmm1_permuted_weight_scale, gmm2_weight, "
    "gmm2_weight_scale, num_max_dispatch_tokens_per_rank, num_experts, quant_mode=1, "
    "fuse_mode=FuseMode.FUSED_DEEP_MOE)", f"{KN}@0ac00159 buffer.py Buffer.fused_deep_moe (KN@0ac00159 .. KN@0a7c55a4)")
SIG_FUSED_DEEP_MOE_NO_FUSE_MODE = VendorSignature(
    "Buffer.fused_deep_moe",
    "(self, x, topk_idx, topk_weights, gmm1_permuted_weight, gmm1_permuted_weight_scale, gmm2_weight, "
    "gmm2_weight_scale, num_max_dispatch_tokens_per_rank, num_experts, quant_mode=1)",
    f"{KN}@c4e7608f buffer.py Buffer.fused_deep_moe (KN@c4e7608f .. KN@0ac00159)")
#: pybind ``Config``: ``init<int, int, int, int, int>`` with keyword names and defaults
#: (KN@f425bdf csrc/deepep/pybind_extension.cpp; csrc/deepep/config.hpp struct Config).
SIG_CONFIG_INIT = VendorSignature(
    "Config.__init__",
    "(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
    "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)",
    f"{KN}@{KN_MAIN} csrc/deepep/pybind_extension.cpp (pybind11::init<int, int, int, int, int>, py::arg defaults)")
CONFIG_FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

#: The Buffer methods the adapter calls, as main f425bdf has them: what a fake of main must equal.
DEEP_EP_SIGNATURES = (SIG_BUFFER_INIT, SIG_GET_DISPATCH_LAYOUT, SIG_DISPATCH, SIG_COMBINE, SIG_LOW_LATENCY_DISPATCH,
                      SIG_LOW_LATENCY_COMBINE, SIG_LL_SIZE_HINT, SIG_GET_DISPATCH_CONFIG, SIG_GET_COMBINE_CONFIG,
                      SIG_FUSED_DEEP_MOE)
#: The same methods as KN@be6b5e7f has them (before ``quant_mode``).
DEEP_EP_SIGNATURES_ENV_ONLY = (SIG_BUFFER_INIT, SIG_GET_DISPATCH_LAYOUT, SIG_DISPATCH_ENV_ONLY, SIG_COMBINE,
                               SIG_LOW_LATENCY_DISPATCH_USE_FP8, SIG_LOW_LATENCY_COMBINE, SIG_LL_SIZE_HINT,
                               SIG_GET_DISPATCH_CONFIG, SIG_GET_COMBINE_CONFIG, SIG_FUSED_DEEP_MOE_NO_PROFILE)
#: Every signature a supported build (KN@0ac00159 .. main) has, per method (checked by AST against buffer.py at
#: 0ac00159, 3d98638a, 607b0002, 9aa6257c, b2fce2cd, 27306d00, 9a77a110, be6b5e7f, f451a596, 7c2b9e06, d6617476,
#: eb44721d, 454d9c3e, 929a00ae, 0a7c55a4, f425bdf): what the hardware check accepts as "a recorded version". The
#: adapter's calls (positional x, ids, T, E and keyword use_fp8/quant_mode) are valid on each.
RECORDED_VERSIONS: dict[str, tuple[VendorSignature, ...]] = {
    "Buffer.__init__": (SIG_BUFFER_INIT, SIG_BUFFER_INIT_OLD),
    "Buffer.get_dispatch_layout": (SIG_GET_DISPATCH_LAYOUT,),
    "Buffer.dispatch": (SIG_DISPATCH, SIG_DISPATCH_ENV_ONLY),
    "Buffer.combine": (SIG_COMBINE,),
    "Buffer.low_latency_dispatch": (SIG_LOW_LATENCY_DISPATCH, SIG_LOW_LATENCY_DISPATCH_USE_FP8,
                                    SIG_LOW_LATENCY_DISPATCH_TOPK_WEIGHTS, SIG_LOW_LATENCY_DISPATCH_OLD),
    "Buffer.low_latency_combine": (SIG_LOW_LATENCY_COMBINE,),
    "Buffer.get_low_latency_rdma_size_hint": (SIG_LL_SIZE_HINT,),
    "Buffer.get_dispatch_config": (SIG_GET_DISPATCH_CONFIG,),
    "Buffer.get_combine_config": (SIG_GET_COMBINE_CONFIG,),
    "Buffer.fused_deep_moe": (SIG_FUSED_DEEP_MOE, SIG_FUSED_DEEP_MOE_NO_PROFILE),
}

def _param_from_prototype(raw: str) -> str:
    """``Tensor? smooth_scales=None`` → ``smooth_scales=None``; ``int[]? tuning_config`` →
    ``tuning_config=None`` (an optional type without a default defaults to None)."""
    text = " ".join(raw.split())
    if text == "*":
        return "*"
    head, _, default = text.partition("=")
    words = head.strip().split(" ")
    name = words[-1]
    if default:
        return f"{name}={default.strip()}"
    return f"{name}=None" if len(words) > 1 and words[-2].endswith("?") else name


# torch_npu: ``torch_npu.npu_X = torch.ops.npu.npu_X`` (torch-npu 2.13.0 torch_npu/utils/custom_ops.py), so what a
# call may pass is the op schema torch_npu registers (read from torch_npu/lib/libtorch_npu.so with `strings`;
# torchnpugen/custom_functions.py renames a schema's `self` to `input`). The records below are those schemas as
# Python parameter lists; the fakes take exactly these. The docstring prototypes (_op_plugin_docs.py) differ in
# names (`self`, `x`), order and missing keywords: kept in TORCH_NPU_DOC_SIGNATURES as what the docs say.
TORCH_NPU_SCHEMAS = {
    "npu_grouped_matmul":
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0, "
        "int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, "
        "int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
        "int? per_token_scale_dtype=None) -> Tensor[]",
    "npu_dynamic_quant":
        "npu_dynamic_quant(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, "
        "int? dst_type=None, str quant_mode=\"pertoken\", float dst_type_max=0.0) -> (Tensor, Tensor)",
    "npu_dequant_swiglu_quant":
        "npu_dequant_swiglu_quant(Tensor x, *, Tensor? weight_scale=None, Tensor? activation_scale=None, "
        "Tensor? bias=None, Tensor? quant_scale=None, Tensor? quant_offset=None, Tensor? group_index=None, "
        "bool activate_left=False, int quant_mode=0, int? dst_type=None, int? round_mode=None, "
        "int? activate_dim=None, int swiglu_mode=0, float clamp_limit=7.0, float glu_alpha=1.702, "
        "float glu_bias=1.0) -> (Tensor, Tensor)",
    "npu_swiglu": "npu_swiglu(Tensor input, int dim=-1) -> Tensor",
    "npu_convert_weight_to_int4pack": "npu_convert_weight_to_int4pack(Tensor weight, int inner_k_tiles=0) -> Tensor",
    "npu_format_cast":
        "npu_format_cast(Tensor input, int acl_format, *, int? customize_dtype=None, int? input_dtype=None) -> Tensor",
}


def _split_params(text: str, opening: str = "([", closing: str = ")]") -> list[str]:
    """``text`` split at the commas outside any of the brackets (a schema's ``(``/``[``; a documented
    prototype's type annotations add ``<``/``>``)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in opening and 1 or 0
        depth -= ch in closing and 1 or 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur] if cur.strip() else parts


def schema_params(schema: str) -> str:
    """A registered op schema (``op(Tensor input, *, int? y=None) -> Tensor``) as a Python parameter
    list (``(input, *, y=None)``): what ``torch.ops.npu.<op>`` accepts, positionally or by keyword."""
    start = schema.index("(") + 1
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(schema[end], 0)
        end += 1
    return "(" + ", ".join(_param_from_prototype(p) for p in _split_params(schema[start:end - 1])) + ")"


def registered_schema(library: bytes, op: str) -> str | None:
    """The schema ``libtorch_npu.so`` registers for ``op`` (its bytes, read without loading it)."""
    match = re.search(rb"\x00(" + re.escape(op.encode()) + rb"\([^\x00]*?\) -> [^\x00]+)\x00", library)
    return None if match is None else match.group(1).decode()


def torch_npu_library_path() -> str | None:
    """``torch_npu/lib/libtorch_npu.so`` of the installed torch_npu, found without importing it."""
    spec = importlib.util.find_spec(TORCH_NPU)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "lib", "libtorch_npu.so")
    return path if os.path.exists(path) else None


def _schema_signature(op: str) -> VendorSignature:
    return VendorSignature(op, schema_params(TORCH_NPU_SCHEMAS[op]), f"{TNPU_SO} {op}")


SIG_NPU_GROUPED_MATMUL = _schema_signature("npu_grouped_matmul")
SIG_NPU_DYNAMIC_QUANT = _schema_signature("npu_dynamic_quant")
SIG_NPU_DEQUANT_SWIGLU_QUANT = _schema_signature("npu_dequant_swiglu_quant")
SIG_NPU_SWIGLU = _schema_signature("npu_swiglu")
SIG_NPU_CONVERT_WEIGHT_TO_INT4PACK = _schema_signature("npu_convert_weight_to_int4pack")
SIG_NPU_FORMAT_CAST = _schema_signature("npu_format_cast")
TORCH_NPU_SIGNATURES = (SIG_NPU_GROUPED_MATMUL, SIG_NPU_DYNAMIC_QUANT, SIG_NPU_DEQUANT_SWIGLU_QUANT, SIG_NPU_SWIGLU,
                        SIG_NPU_CONVERT_WEIGHT_TO_INT4PACK, SIG_NPU_FORMAT_CAST)

# The documented prototypes (TNPU docstrings), written as Python parameter lists: what the docs say, not what
# the callable takes (the optional test compares them with an installed _op_plugin_docs.py).
TORCH_NPU_DOC_SIGNATURES = (
    VendorSignature(
        "npu_grouped_matmul",
        "(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None, "
        "per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None, "
        "activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0, "
        "output_dtype=None, tuning_config=None)", TNPU + " npu_grouped_matmul"),
    VendorSignature("npu_dynamic_quant", "(x, *, smooth_scales=None, group_index=None, dst_type=None)",
                    TNPU + " npu_dynamic_quant"),
    VendorSignature(
        "npu_dequant_swiglu_quant",
        "(x, *, weight_scale=None, activation_scale=None, bias=None, quant_scale=None, quant_offset=None, "
        "group_index=None, activate_left=False, quant_mode=0, swiglu_mode=0, clamp_limit=7.0, glu_alpha=1.702, "
        "glu_bias=1.0)", TNPU + " npu_dequant_swiglu_quant"),
    VendorSignature("npu_swiglu", "(self, dim=-1)", TNPU + " npu_swiglu"),
    VendorSignature("npu_convert_weight_to_int4pack", "(weight, inner_k_tiles=0)",
                    TNPU + " npu_convert_weight_to_int4pack"),
    VendorSignature("npu_format_cast", "(self, acl_format)", TNPU + " npu_format_cast"),
)
#: ACL formats (TNPU npu_format_cast example; torch_npu ACL_FORMAT_*): ND and FRACTAL_NZ.
ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ = 2, 29
#: TNPU npu_dequant_swiglu_quant constraints: with group_index, H <= 10496 and 64-aligned.
DEQUANT_SWIGLU_MAX_H = 10496
#: TNPU npu_grouped_matmul: lists of at most 128 tensors; the op-plugin doc: at most 1024 groups.
GMM_MAX_GROUPS = 1024

# CANN's A8W4 grouped matmul (int8 x with int4 weights, per-group uint64 scales: sglang's W4A8), read in
# hicann/ops-transformer @c29bc10 gmm/grouped_matmul op_host/grouped_matmul_tiling.cpp GMMTiling::A8W4Tiling and the
# MSD kernels (grouped_matmul_antiquant_a8w4_msd_pre.h shifts x by -8; _msd.h adds the bias), and
# gmm/grouped_matmul/docs/aclnnGroupedMatmulV5.md @0dd10d2 ("A8W4场景约束"):
# - y = ((x - 8) @ (w·s) + bias)·per_token_scale with bias REQUIRED = 8·Σ_k (w·s), fp32 [E, N]
#   ("bias_i = 8 × weight_i * scale_i，并沿k轴规约"), so that y = (x @ (w·s))·pts;
# - group_list is read as per-group counts whatever group_list_type says (tiling keys hard-code
#   GROUPED_MATMUL_GROUP_LIST_TYPE_COUNT; "算子不会检查groupListType的值，会认为groupListType为1");
# - quantGroupSize 256 only ("当前支持quantGroupSize=256"), k % 64 == 0 and k <= 18432 (tiling GRAPH_FAILED).
A8W4_X_SHIFT = 8
A8W4_GROUP_SIZE = 256
A8W4_K_MULTIPLE = 64
A8W4_MAX_K = 18432
# CANN aclnn_grouped_matmul.cpp @c29bc10 (antiquant): "antiquantOffset must not be nullptr in antiquant".
# torch-npu 2.13.0: every npu_X kernel is registered for the NPU key only (torchnpugen/templates/
# CustomRegisterSchema.cpp TORCH_LIBRARY_IMPL(npu, PrivateUse1, m)): a CPU tensor is "Could not run
# 'npu::<op>' with arguments from the 'CPU' backend" (NotImplementedError).
NPU_DEVICE_TYPE = "npu"


def a8w4_scale_bias(values: Any, scale: Any) -> Any:
    """CANN A8W4's required bias, ``8·Σ_k w·s`` as fp32 ``[E, N]``, from the int4 weight values ``[E, K, N]``
    and the fp32 scale the op multiplies them by, ``[E, K, N]`` (per group already expanded along K)."""
    return (A8W4_X_SHIFT * (values.double() * scale.double()).sum(dim=1)).float()



def torch_npu_docs_path() -> str | None:
    """``torch_npu/_op_plugin_docs.py`` of the installed torch_npu, found without importing it
    (importing torch_npu needs CANN)."""
    spec = importlib.util.find_spec(TORCH_NPU)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "_op_plugin_docs.py")
    return path if os.path.exists(path) else None


def documented_signature(docs_source: str, op: str) -> str | None:
    """The parameter list of ``op`` as torch_npu's ``_op_plugin_docs.py`` documents its prototype
    (``torch_npu.<op>(Tensor x, *, Tensor? y=None, ...) -> ...``), in Python syntax; None when
    the file documents no such op."""
    with warnings.catch_warnings():  # the docs hold invalid escape sequences (\e, \[ ...)
        warnings.simplefilter("ignore")
        tree = ast.parse(docs_source)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_add_torch_npu_docstr"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value == op):
            continue
        doc = node.args[1].value if isinstance(node.args[1], ast.Constant) else ""
        for match in re.finditer(rf"(?<![\w.])(?:torch_npu\.)?{re.escape(op)}\(", doc):
            depth, start = 1, match.end()
            for i in range(start, len(doc)):
                depth += {"(": 1, ")": -1}.get(doc[i], 0)
                if depth == 0:
                    params = [_param_from_prototype(p) for p in _split_params(doc[start:i], "([<", ")]>")]
                    return "(" + ", ".join(params) + ")"
    return None


# -- version rules ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionRule:
    """A behaviour that starts at a KN main commit, and how ``detect`` sees it."""

    feature: str
    since: str
    date: str
    first_tag: str
    detected_by: str


VERSION_RULES: tuple[VersionRule, ...] = (
    VersionRule("low-latency -1 ids behind MOE_ENABLE_TOPK_NEG_ONE", "7fe4eeb7", "2025-11-26", "20251128",
                "not visible from Python; the supported floor below implies it"),
    VersionRule("an empty batch is no longer padded with a fake token (topk = arange(k), x = 2) that receivers "
                "count as a real row", "8fe74692", "2026-03-02", "2026.03.10.rc1",
                "not visible from Python; the supported floor below implies it"),
    VersionRule("supported floor: fused_deep_moe(fuse_mode=), the first Python-visible change after KN@8fe74692",
                "0ac00159", "2026-03-16", "2026.03.31.rc1", "'fuse_mode' in Buffer.fused_deep_moe"),
    VersionRule("strategies; normal_strategy/low_latency_strategy arguments", "9aa6257c", "2026-06-09", "2026.6.1",
                "'normal_strategy' in Buffer.__init__"),
    VersionRule("DEEP_USE_MODE read at Buffer construction", "b2fce2cd", "2026-06-11", "2026.06.15.post1",
                "follows the strategies; harmless to pin before"),
    VersionRule("low_latency_dispatch(quant_mode=): None + use_fp8 means int8, 'bf16' is a ValueError", "f451a596",
                "2026-07-18", "2026.7.3", "'quant_mode' in Buffer.low_latency_dispatch"),
    VersionRule("dispatch(quant_mode=)", "7c2b9e06", "2026-07-22", "2026.7.3", "'quant_mode' in Buffer.dispatch"),
    VersionRule("DEEP_NORMAL_MODE_USE_INT8_QUANT honoured again when quant_mode is None", "929a00ae", "2026-08-04",
                "2026.8.10", "not visible; the adapter always passes quant_mode and pins the variable"),
    VersionRule("A2 internode normal dispatch takes top-k up to 16 (was 10: dispatch_normal_a2_tiling.cpp "
                "MAX_K_VALUE_A2)", "7a396def", "2026-07-15", "2026.7.2",
                "not visible; implied by 'quant_mode' in Buffer.low_latency_dispatch (KN@f451a596, later)"),
    VersionRule("fused_deep_moe(quant_mode=) (was use_fp8)", "c4e7608f", "2025-10-16", "20251022",
                "'quant_mode' in Buffer.fused_deep_moe"),
    VersionRule("fused_deep_moe(fuse_mode=): mode 2 dispatch_ffn_combine", "0ac00159", "2026-03-16",
                "2026.03.31.rc1", "'fuse_mode' in Buffer.fused_deep_moe"),
    VersionRule("fused_deep_moe(profile_enable=)", "0a7c55a4", "2026-08-17", "2026.8.17",
                "'profile_enable' in Buffer.fused_deep_moe"),
)


# -- detect -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VendorInfo:
    module_name: str
    module: ModuleType | None
    error: str | None
    is_ascend: bool = False
    supported: bool = False
    has_quant_mode: bool = False  # Buffer.dispatch(quant_mode=)
    ll_quant_mode: bool = False  # Buffer.low_latency_dispatch(quant_mode=)
    has_strategies: bool = False
    fused_params: tuple[str, ...] = field(default_factory=tuple)  # Buffer.fused_deep_moe's parameters
    emulated: bool = False

    def describe(self) -> str:
        if self.module is None:
            return f"{self.module_name} is not importable ({self.error})"
        if not self.is_ascend:
            return f"{self.module_name} is CUDA DeepEP, not DeepEP-Ascend (both install as deep_ep)"
        if not self.supported:
            return (f"{self.module_name} is a DeepEP-Ascend older than {KN}@0ac00159 (2026-03-16, tag 2026.03.31.rc1): "
                    "before KN@8fe74692 it pads an empty batch with a fake token that the receivers count, and "
                    "before KN@7fe4eeb7 low-latency -1 ids have no MOE_ENABLE_TOPK_NEG_ONE; upgrade sgl-kernel-npu")
        what = "emulated DeepEP-Ascend" if self.emulated else "DeepEP-Ascend"
        how = "quant_mode argument" if self.has_quant_mode else "DEEP_NORMAL_MODE_USE_INT8_QUANT only"
        return f"{what}: INT8 normal dispatch chosen by {how}"


def _params(fn: object) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ()



def detect(module_name: str = REAL) -> VendorInfo:
    """What the installed ``module_name`` is, from its Python signatures only (no NPU touched)."""
    emulated = module_name.startswith("moe_dispatch_")  # the plugins' own fakes of deep_ep
    if not emulated and importlib.util.find_spec(TORCH_NPU) is None:
        return VendorInfo(module_name, None, "torch_npu is not installed")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
        return VendorInfo(module_name, None, f"{type(exc).__name__}: {exc}")
    buffer = getattr(module, "Buffer", None)
    # Both builds install as deep_ep. DeepEP-Ascend's LL size hint is a dummy that returns T
    # (KN@f425bdf csrc/deepep/config.cpp); CUDA DeepEP's is ~1.9 GB for this shape.
    try:
        is_ascend = buffer is not None and low_latency_rdma_size_hint(module, 128, 7168, 8, 256) == 128
    except Exception:  # noqa: BLE001 - an unexpected build is "not DeepEP-Ascend"
        is_ascend = False
    if not is_ascend:
        return VendorInfo(module_name, module, None, emulated=emulated)
    ll = _params(buffer.low_latency_dispatch)
    fused = _params(buffer.fused_deep_moe) if hasattr(buffer, "fused_deep_moe") else ()
    supported = "fuse_mode" in fused  # KN@0ac00159 and later (see VERSION_RULES)
    return VendorInfo(module_name, module, None, True, supported, "quant_mode" in _params(buffer.dispatch),
                      "quant_mode" in ll, "normal_strategy" in _params(buffer.__init__), fused, emulated)


__all__ = [
    "READ_ENVIRONMENT",
    "A2_INTERNODE_COMBINE_MAX_WINDOW_MB", "A2_INTERNODE_COMBINE_ROWS", "A2_INTERNODE_MAX_WINDOW_MB",
    "A2_INTERNODE_NORMAL_RANKS", "A2_LAYERED_MAX_WINDOW_MB", "A2_LL_MULTI_SERVER_MAX_WINDOW_MB",
    "HCCL_BUFFER_NAME_KEY", "HCCL_BUFFER_SIZE_KEY", "HCCL_OP_EXPANSION_KEY", "OP_EXPANSION_ENV",
    "a2_internode_combine_server_bytes", "a2_internode_combine_tiling_key", "a2_internode_dispatch_server_bytes",
    "a2_internode_dispatch_tiling_key", "a2_internode_ipc_window_bytes", "a2_internode_notify_offset",
    "a2_layered_ipc_bytes", "normal_op_max_window_mb", "normal_op_state1_offset", "plain_decimal", "strtol_prefix",
    "group_hccl_config", "normal_internode_combine_assert_bytes", "normal_internode_ipc_bytes",
    "normal_internode_window_bytes_a2", "notify_dispatch_a2_window_bytes", "soc_family_from_name",
    "DEEP_EP_SIGNATURES", "DEEP_EP_SIGNATURES_ENV_ONLY", "ENV_VARS", "INSTALL_HINT", "REAL", "TORCH_NPU",
    "VERSION_RULES", "EnvVar", "VendorInfo", "VersionRule", "detect", "is_layered",
    "layered_window_bytes", "ll_op_window_bytes", "ll_receive_rows", "normal_op_window_bytes",
    "normal_op_window_bytes_a2", "ops_window_mb", "parse_env_int", "readme_window_bytes", "registered_schema",
    "schema_params", "soc_family", "current_soc", "stoi_prefix", "window_mb",
]
