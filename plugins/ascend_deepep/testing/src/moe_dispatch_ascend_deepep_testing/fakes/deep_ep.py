"""A fake of DeepEP-Ascend's ``deep_ep`` as of sgl-project/sgl-kernel-npu main f425bdf, on
torch.distributed (gloo on CPU): real results between real processes, and the vendor's checks.

What it enforces, as the vendor does (``KN`` = sgl-project/sgl-kernel-npu @ f425bdf):

- Python layer (``python/deep_ep/deep_ep/buffer.py``, ``strategies/*.py``): the signatures
  (``vendor.DEEP_EP_SIGNATURES``; ``deep_ep_env_only``: ``_ENV_ONLY``); ``config=None`` →
  ``get_dispatch_config(num_ranks)``, whose ``assert num_ranks in config_map`` fails outside
  ``vendor.CONFIG_RANKS``; ``handle`` →
  ``NotImplementedError``; ``quant_mode`` validation (``ValueError``); the low-latency mapping
  ``quant_mode is None and use_fp8`` → ``"int8"`` (since KN@f451a596); the normal priority
  explicit ``quant_mode`` > tuple ``x`` > ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` read at the call;
  ``DEEP_USE_MODE`` read at construction.
- pybind (``csrc/deepep/deep_ep.cpp``): a ``config`` that is not this module's ``Config`` is a
  ``TypeError``; ``EP_HOST_ASSERT`` (an ``EPException``, a ``std::exception``) is a ``RuntimeError``:
  contiguity, dtypes, shapes, ``T >= num_tokens``, ``low_latency_mode``; the environment read where
  the C++ reads it (``MOE_SHARED_EXPERT_RANK_NUM`` and the long-sequence rounds at construction,
  ``MOE_EXPERT_TOKEN_NUMS_TYPE`` and ``MOE_ENABLE_TOPK_NEG_ONE`` at each call).
- The aclnn ops' tiling checks (a failed ``EXEC_NPU_CMD`` is a ``RuntimeError``): low latency EP
  size 2..768 (A2 beyond 8 ranks: multiples of 8 up to 256), batch <= 512, H 1024..8192, top-k <= 16
  and <= E, E % R, the HCCL window against ``DEEPEP_HCCL_BUFFSIZE`` / ``HCCL_BUFFSIZE`` read at each
  call with ``std::stoi`` into a uint16 (``vendor.ops_window_mb``, ``vendor.ll_op_window_bytes``);
  normal (``CamMoeDispatchNormal``) EP 2..384, E <= 1024 (A2 512), E % R, E_local·R <= 1280, top-k
  <= min(16, E), H 1024..8192 (A2 7168), a positive global batch, and its window sized by
  ``real_max_bs`` (``vendor.normal_op_window_bytes``, A2 ``normal_op_window_bytes_a2``); the combine's
  ``realMaxBs >= its batch``.
- State (C++ ``Buffer`` members): ``real_max_bs = max(largest batch over the ranks, num_worst_tokens)``
  set by each normal dispatch and read by the next normal combine, whichever dispatch that combine
  belongs to; the HCCL window allocated the group at construction (its ``hccl_buffer_size`` option,
  ``fakes.torch_npu.group_hccl_config``, else ``HCCL_BUFFSIZE`` then): an ops' window above it makes the
  normal kernels write past it ("(fake)" RuntimeError) and the low-latency kernels fault (their
  CheckWindowSize); on A2 layered the layered kernels' assert on it (k padded to 8 in the dispatch);
  the chip, from ``fakes.torch_npu.npu.get_soc_version()`` (and its name) at construction.
- Atlas A2 beyond 8 ranks (normal mode takes DeepEP-Ascend's internode path): INT8 from the variable
  only; aclnnNotifyDispatchA2's, aclnnDispatchNormalA2's and aclnnMoeDistributeCombineA2's tiling and
  whether their tiling keys have a kernel (module functions ``a2_internode_*``: INT8 and an unlayered
  combine have none); the combine kernel's window assert; "(fake)" where the kernels would write past
  their areas of the real window: the IPC flags at 800 MB + 2 MB, each server's share of the 800 MB
  RDMA area (the combine writes a fixed 4096 rows), the combine's IPC slices (one entry per (token,
  expert of the server)); and where the kernels go wrong: the notify kernel's 2-server exchange
  (R = 16 only) and its uint32 offset (from 4496 MB).
- 32-bit window arithmetic ("(fake)": silent corruption on the device): the normal dispatch op's
  ``dataState`` flipping each call and its uint32 state-1 ``winDataSizeOffset``; on A2 the layered
  low-latency kernels' uint32 IPC area (``winSize − 804 MB``) and the multi-server kernels' uint32
  ``winSize / 2``.
- INT8 as the kernels compute it: normal ``s = 127/(amax + 1e-12)``, ``q = rint(x·s)``, scale ``1/s``
  (ops/op_kernel/cam_moe_dispatch_normal.h); low latency ``s = 127/amax`` (a zero row: scale 0)
  (moe_distribute_dispatch_v2.h), in fp32.
- Layouts: normal rows one per (token, local expert), grouped by local expert, source rank,
  source token; never-filled ``recv_topk_*`` (``[received, k]``); one row when nothing arrived;
  low-latency rows packed expert by expert in ``[T·R·min(k, E_l), H]`` with garbage past the
  counts (NaN / 127 here, so a reader of padding shows it); int64 counts.
- State: ``get_dispatch_layout`` feeds the next ``dispatch`` on the same buffer (the C++ keeps
  ``notify_send_data``); a dispatch with other ids than the layout's is a ``RuntimeError`` here
  (garbage on the device); ``Buffer.num_sms`` is class-level.
- Waits: bytes move between the rank processes through the core's ``Comm``, which, inside a
  dispatcher's call on the same ranks, waits with that dispatcher's ``Watch`` (its ``timeout_s``, its
  peers' failure notices); the vendor's API takes a group and no deadline.

Fake-only, marked "(fake)" in messages: ``-1`` ids reaching the low-latency op without
``MOE_ENABLE_TOPK_NEG_ONE=1`` raise (the kernel gets no active mask; its behaviour is not
documented), and so does what is not emulated: the ``alltoall``/``ops`` strategies, shared-expert
ranks, pre-quantized tuple ``x``, A5's FP8/FP4 modes and the CCU op (``MOE_ENABLE_CCU=1`` off A2).
The chip is the fake torch_npu's (``fakes.torch_npu.soc_version(220)`` makes it an A2: the A2 build's
normal op, the internode path beyond 8 ranks, layered and multi-server checks apply).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

import moe_dispatch.backend as mdb
from moe_dispatch.backend import as_bytes, from_bytes
from moe_dispatch_ascend_deepep import vendor as v

from . import torch_npu as fake_torch_npu

QUANT_MODES = ("bf16", "int8")
A3, A2 = v.SOC_A3, v.SOC_A2
_CONFIG_MAP = {n: (v.NUM_SMS, 6, 256, 6, 128) for n in v.CONFIG_RANKS}  # values do not matter on NPU


#: What a VendorCall notes of the environment at the call (fake-only instrumentation; A2's internode
#: path reads only DEEP_NORMAL_MODE_USE_INT8_QUANT for its INT8 choice).
NOTED_ENV = (v.INT8_ENV, v.COUNTS_TYPE_ENV, v.NEG_ONE_ENV)


@dataclass(frozen=True)
class VendorCall:
    name: str
    x_dtype: torch.dtype
    int8: bool
    payload_bytes: int
    env: tuple[tuple[str, str | None], ...] = ()

    def env_at_call(self, name: str) -> str | None:
        return dict(self.env).get(name)


def _ep_assert(cond: bool, what: str) -> None:
    """``EP_HOST_ASSERT``: an ``EPException`` (std::exception), which pybind raises as RuntimeError."""
    if not cond:
        raise RuntimeError(f"Failed: Assertion error csrc/deepep/deep_ep.cpp error message or error code is '{what}'")


def _op_check(cond: bool, op: str, what: str) -> None:
    """A failed aclnn tiling check: EXEC_NPU_CMD raises RuntimeError."""
    if not cond:
        raise RuntimeError(f"{op} tiling failed: {what}")


def _incompatible(fn: str, arg: str, value: Any) -> TypeError:
    return TypeError(f"{fn}(): incompatible function arguments. The following argument types are supported: "
                     f"... {arg}: deep_ep_cpp.Config ...; invoked with {type(value).__name__}")


def _window_mb() -> int:
    """Mc2TilingUtils::GetMaxWindowSize at the call: DEEPEP_HCCL_BUFFSIZE, else HCCL_BUFFSIZE, else 200,
    std::stoi into a uint16 (``vendor.ops_window_mb``)."""
    return v.ops_window_mb(os.environ)


#: The ``dataState`` word at ``localWindowsExp + 950 KB + block·512`` of the group's HCCL window, by process group:
#: the normal dispatch op flips it each call (KN@f425bdf ops/op_kernel/cam_moe_dispatch_normal.h Init:
#: ``dataState = selfDataStatusTensor(0)``), and on A3 so does the low-latency dispatch (ops/op_kernel/
#: moe_distribute_dispatch_v2.h ``STATE_WIN_OFFSET``, ``InitWinState``; moe_distribute_base.h
#: ``GetStatusDataSpaceGm``: the same window). Every Buffer on one group shares it for the group's life.
_WINDOW_DATA_STATE: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _flip_window_state(group: Any) -> int:
    """Flip the group's ``dataState``; the state the calling kernel runs in."""
    import torch.distributed as dist

    owner = dist.group.WORLD if group is None else group
    state = _WINDOW_DATA_STATE.get(owner, 0)
    _WINDOW_DATA_STATE[owner] = 1 - state
    return state


def _allocated_window_mb(group: Any) -> int:
    """The window HCCL allocates for the group's communicator: the group's ``hccl_buffer_size`` option when it
    was created with one (``fakes.torch_npu.group_hccl_config``), else ``HCCL_BUFFSIZE`` then (parsed as the ops
    parse it; HCCL's own parser is not in these sources), else 200 (vendor.HCCL_BUFFER_SIZE_KEY)."""
    option = fake_torch_npu.hccl_config_of(group).get(v.HCCL_BUFFER_SIZE_KEY)
    if option is not None:
        return int(option)
    return v.ops_window_mb({k: val for k, val in os.environ.items() if k == v.HCCL_BUFFSIZE})


# -- Atlas A2 beyond 8 ranks: the internode ops' checks (module functions: one rank's view, testable alone) ----


def a2_internode_notify_tiling(world_size: int, num_experts: int, top_k: int, ops_window_mb: int) -> None:
    """aclnnNotifyDispatchA2's tiling (KN@f425bdf ops2/op_host/notify_dispatch_tiling_a2.cc)."""
    op = "aclnnNotifyDispatchA2"
    _op_check(0 < world_size <= v.A2_INTERNODE_MAX_EP_NORMAL, op,
              f"rankSize is invalid, only support (0, {v.A2_INTERNODE_MAX_EP_NORMAL}], but got rankSize={world_size}.")
    need = v.notify_dispatch_a2_window_bytes(num_experts, world_size, top_k)
    _op_check(need <= ops_window_mb * v.MIB, op, f"HCCL_BUFFSIZE is too SMALL, should larger than {need // v.MIB}MB")


def a2_internode_dispatch_tiling(world_size: int, rank: int, bs: int, hidden: int, top_k: int, num_experts: int,
                                 quant_mode: int, scales: bool, env: Any, max_top_k: int, ops_window_mb: int) -> None:
    """aclnnNotifyDispatchA2's and aclnnDispatchNormalA2's tiling, and whether the tiling key has a kernel
    (KN@f425bdf ops2/op_host/dispatch_normal_a2_tiling.cpp; ops2/op_kernel/dispatch_normal_a2.cpp)."""
    a2_internode_notify_tiling(world_size, num_experts, top_k, ops_window_mb)
    op = "aclnnDispatchNormalA2"
    _op_check(hidden % 32 == 0 and 0 < hidden <= v.MAX_HIDDEN, op, "hiddensize is invalid.")
    _op_check(0 <= bs <= v.A2_INTERNODE_MAX_TOKENS, op,
              f"batchsize is invalid. bs: {bs}, should satisfy 0<=bs<={v.A2_INTERNODE_MAX_TOKENS}")
    _op_check(v.A2_LAYERED_MIN_TOP_K <= top_k <= max_top_k, op,
              f"k should be in [{v.A2_LAYERED_MIN_TOP_K}, {max_top_k}], but got k={top_k}.")
    _op_check(not (quant_mode == v.QUANT_MODE_NONE and scales), op, "scales should be null when quantMode is unQuant.")
    _op_check(0 < world_size <= v.A2_INTERNODE_MAX_EP and world_size % v.A2_INTERNODE_EP_MULTIPLE == 0, op,
              "epWorldSize is invalid.")
    _op_check(0 <= rank < world_size, op, "epRankId is invalid.")
    _op_check(0 < num_experts <= v.MAX_EXPERTS and num_experts % world_size == 0, op,
              f"moeExpertNum is invalid, only support (0, {v.MAX_EXPERTS}], but got moeExpertNum={num_experts}.")
    _op_check(quant_mode in (v.QUANT_MODE_NONE, v.QUANT_MODE_DYNAMIC), op, "quantMode is invalid.")
    key = v.a2_internode_dispatch_tiling_key(quant_mode, v.is_layered(env), scales)
    if key not in v.A2_INTERNODE_DISPATCH_KERNELS:
        raise RuntimeError(f"{op}: no kernel for tiling key {key} (dispatch_normal_a2.cpp has "
                           f"{sorted(v.A2_INTERNODE_DISPATCH_KERNELS)}, BF16 only)")


def a2_internode_combine_tiling(world_size: int, bs: int, hidden: int, top_k: int, num_experts: int, env: Any) -> None:
    """aclnnMoeDistributeCombineA2's tiling and kernel choice (KN@f425bdf ops2/op_host/
    moe_distribute_combine_a2_tiling.cpp; ops2/op_kernel/moe_distribute_combine_a2.cpp: TILING_KEY_IS(3000) only)."""
    op = "aclnnMoeDistributeCombineA2"
    layered = v.is_layered(env)
    _op_check(0 < hidden <= v.MAX_HIDDEN and hidden % 32 == 0, op, "hiddensize is invalid.")
    _op_check(v.A2_LAYERED_MIN_TOP_K <= top_k <= v.A2_INTERNODE_MAX_TOP_K, op,
              f"k should be in [{v.A2_LAYERED_MIN_TOP_K}, {v.A2_INTERNODE_MAX_TOP_K}], but got k={top_k}.")
    most = v.A2_INTERNODE_COMBINE_MAX_BS[layered]
    _op_check(bs <= most, op, f"Batchsize must be smaller than {most}.")
    _op_check(0 < world_size <= v.A2_INTERNODE_MAX_EP and world_size % v.A2_INTERNODE_EP_MULTIPLE == 0, op,
              "epWorldSize is invalid.")
    _op_check(0 < num_experts <= v.MAX_EXPERTS and num_experts % world_size == 0, op, "moeExpertNum is invalid.")
    key = v.a2_internode_combine_tiling_key(layered)
    if key not in v.A2_INTERNODE_COMBINE_KERNELS:
        raise RuntimeError(f"{op}: no kernel for tiling key {key} (moe_distribute_combine_a2.cpp has "
                           f"{sorted(v.A2_INTERNODE_COMBINE_KERNELS)}: {v.INTRA_PCIE_ENV}=1, {v.INTRA_ROCE_ENV}=0)")


def a2_internode_combine_kernel_window(window_bytes: int, world_size: int, bs: int, hidden: int, top_k: int) -> None:
    """MoeDistributeCombineA2Layered::Init's assert on the real window (a device assert: RuntimeError here)."""
    need = v.normal_internode_combine_assert_bytes(bs, hidden, world_size, top_k)
    if window_bytes < need:
        raise RuntimeError(f"aclnnMoeDistributeCombineA2: assert failed: The HCCL_BUFFSIZE is "
                           f"{window_bytes // v.MIB}MB, the min value should be {need // v.MIB}MB.")


def a2_internode_notify_kernel(world_size: int, window_bytes: int) -> None:
    """aclnnNotifyDispatchA2's KERNEL (ops2/op_kernel/notify_dispatch_a2.h): it exchanges with one peer server,
    ``(1 − serverId)·localRankSize + localRank`` ("2个server的计算方式"), and keeps
    ``notifyMemoryOffset = winSize − 2·200 MB`` in a uint32 (its area and persistent magic). "(fake)": on the device, wrong peers or a wrapped
    area over the dispatch's and combine's 0..804 MB, no error."""
    servers = world_size // v.A2_MAX_HCCS_PEERS
    if world_size != v.A2_INTERNODE_NORMAL_RANKS:
        raise RuntimeError(f"(fake) aclnnNotifyDispatchA2: its kernel exchanges with one peer server "
                           f"((1 - serverId)·8 + localRank); {servers} servers here")
    offset = v.a2_internode_notify_offset(window_bytes)
    if offset != window_bytes - v.A2_NOTIFY_BYTES:
        raise RuntimeError(f"(fake) aclnnNotifyDispatchA2: uint32 notifyMemoryOffset = {window_bytes // v.MIB} MB − "
                           f"400 MB wraps to {offset // v.MIB} MB, inside the dispatch/combine's 0..804 MB")


def a2_internode_combine_rdma(world_size: int, hidden: int) -> None:
    """MoeDistributeCombineA2Layered (COMBINE_2SERVER_VERSION): each server's RDMA write is ``countReL = MAX_BS``
    (4096) rows of ``H·2 B`` whatever the batch, into that server's share of the 800 MB RDMA half."""
    write = v.A2_INTERNODE_COMBINE_ROWS * hidden * 2
    block = v.a2_internode_combine_server_bytes(world_size)
    if write > block:
        raise RuntimeError(f"(fake) aclnnMoeDistributeCombineA2: writes {v.A2_INTERNODE_COMBINE_ROWS} rows·"
                           f"{hidden * 2} B = {write} B per server into a {block} B share: into the next server's "
                           "block")


def a2_layered_ipc_layout(window_bytes: int, world_size: int, local_experts: int) -> None:
    """The A2 layered low-latency kernels' IPC area and slices from the real window, in uint32s
    (moe_distribute_dispatch_v2_layered.h ``totalSize_``, ``RANK_SIZE_ON_IPC``; moe_distribute_combine_v2_layered.h
    ``IPC_DATA_SIZE``, ``dstRankId·ipcSliceSize + IPC_DATA_OFFSET``)."""
    ipc = v.a2_layered_ipc_bytes(window_bytes)
    true = window_bytes - v.A2_LAYERED_RESERVED_BYTES
    last = (world_size - 1) * (ipc // world_size) + 4 * v.MIB  # the combine's last slice offset
    if ipc != true or last >= v.UINT32_SPAN:
        raise RuntimeError(f"(fake) layered low latency: the uint32 IPC area of a {window_bytes // v.MIB} MB window is "
                           f"{ipc // v.MIB} MB, not {true // v.MIB}: its slices for {local_experts} experts × "
                           f"{world_size} ranks overlap")


def a2_ll_half_window(window_bytes: int) -> None:
    """The A2 multi-server (not layered) low-latency kernels keep ``winSize / 2`` in a uint32
    (moe_distribute_dispatch_v2.h ``totalSize_``, moe_distribute_combine_v2.h ``halfWinSize_``)."""
    if window_bytes // 2 >= v.UINT32_SPAN:
        raise RuntimeError(f"(fake) A2 multi-server low latency: the uint32 half of a {window_bytes // v.MIB} MB window "
                           f"wraps to {(window_bytes // 2) % v.UINT32_SPAN // v.MIB} MB: the two halves overlap")


def _quant_rows(x: torch.Tensor, epsilon: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch kernels' per-token INT8, in fp32: ``s = 127/(amax + epsilon)`` (normal: 1e-12f) or
    ``127/amax`` (low latency, no epsilon: a zero row has s = inf, scale 1/s = 0 and, [U], zero data),
    ``q = rint(x·s)``, the scale ``1/s``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    one27 = torch.tensor(127.0, dtype=torch.float32)
    s = one27 / (amax + torch.tensor(epsilon, dtype=torch.float32)) if epsilon is not None else one27 / amax
    q = torch.round(xf * s)
    q = torch.where(torch.isfinite(q), q, torch.zeros((), dtype=q.dtype)).clamp(-127, 127).to(torch.int8)
    return q, (torch.tensor(1.0, dtype=torch.float32) / s).squeeze(-1)


def quant_normal(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CamMoeDispatchNormal's INT8 (KN@f425bdf ops/op_kernel/cam_moe_dispatch_normal.h QuantProcess)."""
    return _quant_rows(x, 1e-12)


def quant_low_latency(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoeDistributeDispatchV2's and the fused op's INT8 (KN@f425bdf ops/op_kernel/moe_distribute_dispatch_v2.h;
    ops/utils/op_kernel/operator/cam_moe_distribute_combine/op_kernel/a3/cam_moe_distribute_dispatch.h)."""
    return _quant_rows(x, None)


class _Named(str):
    """A string constant whose repr is its vendor spelling (``NormalStrategy.DEFAULT``)."""

    def __new__(cls, value: str, name: str) -> "_Named":
        obj = super().__new__(cls, value)
        obj._name = name  # type: ignore[attr-defined]
        return obj

    def __repr__(self) -> str:
        return self._name  # type: ignore[attr-defined,no-any-return]


class NormalStrategy:
    DEFAULT = _Named("default", "NormalStrategy.DEFAULT")
    ALLTOALL = "alltoall"


class LowLatencyStrategy:
    DEFAULT = _Named("default", "LowLatencyStrategy.DEFAULT")
    OPS = "ops"
    ALLTOALL = "alltoall"


class FuseMode(IntEnum):
    """KN buffer.py ``class FuseMode(IntEnum)`` (module level, not exported by ``deep_ep``)."""

    FUSED_DEEP_MOE = 1
    DISPATCH_FFN_COMBINE = 2

    def __repr__(self) -> str:
        return f"FuseMode.{self.name}"


class Config:
    """pybind ``deep_ep_cpp.Config``: ``init<int, int, int, int, int>`` with keyword names and defaults
    (``vendor.SIG_CONFIG_INIT``); anything but ints is pybind's TypeError."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        args = (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        if not all(isinstance(a, int) for a in args):
            raise TypeError("__init__(): incompatible constructor arguments. The following argument types are "
                            f"supported: (self, {', '.join(f'{n}: int' for n in v.CONFIG_FIELDS)}); invoked with {args}")
        for name, value in zip(v.CONFIG_FIELDS, args):
            setattr(self, name, value)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes  # a dummy on NPU

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes


class EventHandle:
    pass


class EventOverlap:
    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        pass


def _int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low-latency / fused dispatch INT8 (``quant_low_latency``)."""
    return quant_low_latency(x)


@dataclass
class _Exchange:
    """The fake's own record of one dispatch (the vendor keeps device tensors in the handle)."""

    group: torch.Tensor
    recv: torch.Tensor
    send: torch.Tensor
    tok: torch.Tensor
    slot: torch.Tensor
    tokens: int
    rows: int  # rows the combine must get back
    num_experts: int = 0
    #: A2 internode: every rank's [batch, unique tokens per server (S), rows sent to each rank (R)]
    notify: torch.Tensor | None = None


class Buffer:
    num_sms: int = v.NUM_SMS

    def __init__(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 12,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        normal_strategy: Union[str, NormalStrategy] = NormalStrategy.DEFAULT,
        low_latency_strategy: Union[str, LowLatencyStrategy] = LowLatencyStrategy.DEFAULT,
    ) -> None:
        self.group = group
        self.comm = mdb.Comm(group)  # bound to no dispatcher: waits with the calling one's Watch
        self.rank, self.group_size = self.comm.rank, self.comm.world_size
        self.low_latency_mode = low_latency_mode
        # the C++ reads GetSocVersion() at construction; HCCL allocates the window when the communicator is made
        self.soc_version = v.soc_family(fake_torch_npu.npu.get_soc_version())
        self.allocated_window_mb = _allocated_window_mb(group)
        self.real_max_bs = 0  # deep_ep.hpp Buffer::real_max_bs
        # deep_ep_cpp.Buffer(...): the constructor's environment (KN deep_ep.cpp Buffer::Buffer)
        _ep_assert(0 <= self.rank < self.group_size, "0 <= rank and rank < num_ranks")
        shared = v.parse_env_int(os.environ.get(v.SHARED_RANKS_ENV), 0)
        if shared:
            raise NotImplementedError(f"(fake) {v.SHARED_RANKS_ENV}={shared}: shared-expert ranks are not emulated")
        rounds_raw, tokens_raw = os.environ.get(v.LONG_SEQ_ROUND_ENV), os.environ.get(v.LONG_SEQ_TOKENS_ENV)
        _ep_assert((rounds_raw is None) == (tokens_raw is None), "roundSet == tokensSet")
        self.round, self.per_round_tokens = 1, v.NORMAL_MAX_TOKENS
        if rounds_raw is not None and tokens_raw is not None:
            r, t = int(rounds_raw), int(tokens_raw)
            _ep_assert(1 <= r <= 256 and 32 <= t <= 8192 and r * t <= 131072, "long-sequence rounds in range")
            self.round, self.per_round_tokens = r, t
        self.num_rdma_ranks = max(1, self.group_size // v.A2_MAX_HCCS_PEERS) if self.soc_version == A2 else 1
        # Python: DEEP_USE_MODE overrides both strategies (KN buffer.py Buffer.__init__)
        mode = os.getenv(v.STRATEGY_ENV)
        if mode is not None:
            if mode.lower() not in v.STRATEGIES:
                raise ValueError(f"Unsupported mode combination: DEEP_USE_MODE={mode}, ")
            normal_strategy = "default" if mode.lower() != "alltoall" else "alltoall"
            low_latency_strategy = {"default": "default", "alltoall": "alltoall", "ops": "ops"}[mode.lower()]
        if normal_strategy != "default" or low_latency_strategy != "default":
            raise NotImplementedError(f"(fake) strategies {normal_strategy!r}/{low_latency_strategy!r}: only the "
                                      "default strategies are emulated")
        self.calls: list[VendorCall] = []
        self._layout: tuple[torch.Tensor, int] | None = None

    # -- static helpers -----------------------------------------------------------------------------------

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _CONFIG_MAP, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(*_CONFIG_MAP[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _CONFIG_MAP, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(*_CONFIG_MAP[num_ranks])

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return num_max_dispatch_tokens_per_rank  # a dummy on NPU (KN csrc/deepep/config.cpp)

    def fused_deep_moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       gmm1_permuted_weight: torch.Tensor, gmm1_permuted_weight_scale: torch.Tensor,
                       gmm2_weight: torch.Tensor, gmm2_weight_scale: torch.Tensor,
                       num_max_dispatch_tokens_per_rank: int, num_experts: int, quant_mode: int = 1,
                       fuse_mode: FuseMode = FuseMode.FUSED_DEEP_MOE, profile_enable: bool = False
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("(fake) fused_deep_moe is faked by moe-dispatch-ascend-fuseep-testing's fakes.deep_ep")

    # -- normal mode ----------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        _ep_assert(topk_idx.dim() == 2, "topk_idx.dim() == 2")
        _ep_assert(topk_idx.is_contiguous(), "topk_idx.is_contiguous()")
        _ep_assert(num_experts > 0, "num_experts > 0")
        n = topk_idx.shape[0]
        _ep_assert(n <= self.round * self.per_round_tokens, "num_tokens must not exceed the configured capacity")
        _op_check(topk_idx.dtype == torch.int64, "aclnnDispatchLayout", "topk_idx must be int64")
        R = self.group_size
        local = num_experts // R
        valid = topk_idx >= 0
        in_rank = torch.zeros(n, R, dtype=torch.int32)
        rows = torch.arange(n).unsqueeze(1).expand_as(topk_idx)
        in_rank[rows[valid], topk_idx[valid] // local] = 1
        per_expert = torch.zeros(self.round, num_experts, dtype=torch.int32)
        for r in range(self.round):
            part = topk_idx[r * self.per_round_tokens:(r + 1) * self.per_round_tokens]
            per_expert[r] = torch.bincount(part[part >= 0], minlength=num_experts)[:num_experts].to(torch.int32)
        self._layout = (topk_idx.clone(), num_experts)  # the C++ Buffer keeps it for the next dispatch
        return in_rank.sum(0).to(torch.int32), None, per_expert.flatten(), in_rank, EventOverlap()

    def dispatch(
        self,
        x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        handle: Optional[Tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        quant_mode: Optional[str] = None,
    ) -> Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:  # strategies/normal_strategy.py: get_num_rdma_ranks() > 1 (A2 beyond 8 ranks)
            return self._internode_dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                            topk_idx, topk_weights, config)
        if quant_mode is None:
            data, quant = self._quant_from_x(x)
        else:  # KN strategies/normal_strategy.py: an explicit quant_mode wins
            if quant_mode not in v.NORMAL_QUANT_MODES:
                raise ValueError(f"Invalid quant_mode: {quant_mode}. Valid options: {set(v.NORMAL_QUANT_MODES)}")
            data, quant = x, quant_mode
        return self._intranode_dispatch(data, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                        topk_idx, topk_weights, config, quant, num_worst_tokens)

    @staticmethod
    def _quant_from_x(x: Any) -> tuple[Any, str]:
        """quant_mode None: a tuple x by its second dtype, else DEEP_NORMAL_MODE_USE_INT8_QUANT at the call."""
        if isinstance(x, torch.Tensor):
            return x, "int8" if os.getenv(v.INT8_ENV) == "1" else "bf16"
        if isinstance(x, tuple) and len(x) == 2:
            raise NotImplementedError("(fake) pre-quantized tuple x is not emulated")
        raise TypeError(f"Unsupported x type: {type(x)}")

    def _dispatch_asserts(self, fn: str, x: Any, handle: Any, num_tokens_per_rank: Any, is_token_in_rank: Any,
                          num_tokens_per_expert: Any, topk_idx: Any, topk_weights: Any, config: Any) -> int:
        """deep_ep.cpp Buffer::intranode_dispatch's and ::internode_dispatch's host asserts (the same list), then
        DEEP_EP's expert-token-count type, which both read: 1 counts per expert, 0 their prefix sums."""
        if handle is not None:
            raise NotImplementedError("Optional communication handle is not supported yet.")
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        if not isinstance(config, Config):
            raise _incompatible(fn, "config", config)
        _ep_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        _ep_assert(num_tokens_per_expert.dtype == torch.int32, "num_tokens_per_expert->scalar_type() == at::kInt")
        _ep_assert(num_tokens_per_rank.dtype == torch.int32, "num_tokens_per_rank->scalar_type() == at::kInt")
        _ep_assert(x.dim() == 2 and x.is_contiguous(), "new_x.dim() == 2 and new_x.is_contiguous()")
        _ep_assert(num_tokens_per_expert.dim() == 1 and num_tokens_per_expert.is_contiguous(),
                   "num_tokens_per_expert->dim() == 1 and contiguous")
        _ep_assert(num_tokens_per_expert.numel() % self.group_size == 0, "num_tokens_per_expert->size(0) % num_ranks == 0")
        _ep_assert(tuple(num_tokens_per_rank.shape) == (self.group_size,), "num_tokens_per_rank->size(0) == num_ranks")
        _ep_assert(topk_idx is not None, "topk_idx.has_value()")
        _ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx->dim() == 2 and is_contiguous()")
        _ep_assert(topk_weights is not None and topk_weights.dim() == 2 and topk_weights.is_contiguous(),
                   "topk_weights->dim() == 2 and topk_weights->is_contiguous()")
        _ep_assert(x.shape[0] == topk_idx.shape[0], "num_tokens == topk_idx->size(0)")
        _ep_assert(topk_idx.shape[1] == topk_weights.shape[1], "num_topk == topk_weights->size(1)")
        _ep_assert(topk_weights.dtype == torch.float32, "topk_weights->scalar_type() == at::kFloat")
        counts_type = v.parse_env_int(os.environ.get(v.COUNTS_TYPE_ENV), 1)
        _ep_assert(counts_type in (0, 1), "expert_token_nums_type == 1 or expert_token_nums_type == 0")
        return counts_type

    # -- Atlas A2 beyond 8 ranks (internode) ------------------------------------------------------------------

    #: dispatch_normal_a2_tiling.cpp MAX_K_VALUE_A2 of this build (16 since KN@7a396def).
    A2_INTERNODE_MAX_TOP_K = v.A2_INTERNODE_MAX_TOP_K

    def _internode_dispatch(self, x: Any, handle: Any, num_tokens_per_rank: Any, is_token_in_rank: Any,
                            num_tokens_per_expert: Any, topk_idx: Any, topk_weights: Any, config: Any
                            ) -> Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple,
                                       EventOverlap]:
        """strategies/normal_strategy.py DefaultNormalCommStrategy._internode_dispatch: INT8 from
        DEEP_NORMAL_MODE_USE_INT8_QUANT only (quant_mode, num_worst_tokens are not passed on); deep_ep.cpp
        Buffer::internode_dispatch; the A2 ops' tiling and kernel choice (a2_internode_*); the kernels' use of
        the real window and their fixed RDMA area ("(fake)": on the device, writes past them)."""
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        if x_scales is not None:
            raise NotImplementedError("(fake) pre-quantized tuple x is not emulated")
        use_quant = os.getenv(v.INT8_ENV) == "1"
        counts_type = self._dispatch_asserts("internode_dispatch", x, handle, num_tokens_per_rank, is_token_in_rank,
                                             num_tokens_per_expert, topk_idx, topk_weights, config)
        if self._layout is None or not torch.equal(self._layout[0], topk_idx):
            raise RuntimeError("(fake) dispatch without get_dispatch_layout on the same topk_idx first: the C++ "
                               "uses the layout state the last get_dispatch_layout left on this Buffer")
        num_experts = self._layout[1]
        self._layout = None
        R, n, h, k = self.group_size, x.shape[0], x.shape[1], topk_idx.shape[1]
        _op_check(x.dtype in (torch.bfloat16, torch.float16), "aclnnDispatchNormalA2", "x must be bf16/fp16")
        if x.dtype != torch.bfloat16:  # the op takes fp16; every kernel built is <bfloat16_t, bfloat16_t, ...>
            raise RuntimeError("(fake) aclnnDispatchNormalA2: fp16 x would be read as bf16 by its only kernels")
        quant_mode = v.QUANT_MODE_DYNAMIC if use_quant else v.QUANT_MODE_NONE
        a2_internode_dispatch_tiling(R, self.rank, n, h, k, num_experts, quant_mode, False, os.environ,
                                     self.A2_INTERNODE_MAX_TOP_K, _window_mb())
        local = num_experts // R
        window = self.allocated_window_mb * v.MIB
        a2_internode_notify_kernel(R, window)
        notify = self._internode_notify(topk_idx, local)
        if window < v.A2_RDMA_BYTES + v.A2_IPC_OFFSET_BYTES // 2:
            raise RuntimeError(f"(fake) aclnnDispatchNormalA2: its IPC flags sit 800 MB + 2 MB into the window; the "
                               f"group's is {self.allocated_window_mb} MB: writes past it")
        servers = R // v.A2_MAX_HCCS_PEERS
        block = v.a2_internode_dispatch_server_bytes(R)
        per_token = h * 2 + 4 * -(-k // 8) * 8 * 4
        most = int(notify[:, 1:1 + servers].max())
        if 32 + most * per_token > block:
            raise RuntimeError(f"(fake) aclnnDispatchNormalA2: {most} tokens of one rank to one server take "
                               f"{32 + most * per_token} B of the RDMA area's {block} B per server: the kernel writes "
                               "into the next server's block")
        recv_data, _, counts, state = self._exchange("dispatch", x, None, topk_idx, local)
        state.num_experts, state.notify = num_experts, notify
        total = int(counts.sum())
        if total == 0:  # deep_ep.cpp: never an empty output
            recv_data = torch.zeros(v.EMPTY_RECEIVE_ROWS, x.shape[1], dtype=x.dtype)
        state.rows = recv_data.shape[0]
        listed = counts.tolist() if counts_type == 1 else torch.cumsum(counts, 0).tolist()
        garbage_idx = torch.empty(total, k, dtype=topk_idx.dtype)
        garbage_w = torch.empty(total, k, dtype=torch.float32)
        vendor_handle = (state, is_token_in_rank, None, topk_idx, topk_weights, None, None, None, None)
        return recv_data, garbage_idx, garbage_w, listed, vendor_handle, EventOverlap()

    def _internode_notify(self, topk_idx: torch.Tensor, local: int) -> torch.Tensor:
        """aclnnNotifyDispatchA2's exchange, as far as the fake's checks need it: every rank's batch, its
        tokens per destination server (each once) and its rows per destination rank."""
        R = self.group_size
        servers = R // v.A2_MAX_HCCS_PEERS
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // local, torch.zeros_like(topk_idx))
        per_server = torch.zeros(servers, dtype=torch.int64)
        for j in range(servers):
            per_server[j] = int(((dest // v.A2_MAX_HCCS_PEERS == j) & valid).any(dim=1).sum())
        rows = torch.bincount(dest[valid], minlength=R)[:R].to(torch.int64)
        mine = torch.cat([torch.tensor([topk_idx.shape[0]], dtype=torch.int64), per_server, rows])
        gathered = self.comm.gather_uncounted(mine.view(torch.uint8), "notify_dispatch_a2")
        return gathered.view(torch.int64).view(R, -1)

    def _internode_combine(self, x: torch.Tensor, handle: Tuple) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                                            EventOverlap]:
        """strategies/normal_strategy.py _internode_combine; deep_ep.cpp Buffer::internode_combine (the weights
        are the dispatch's expand_scales: the sender's); MoeDistributeCombineA2's tiling, kernel choice and
        assert, and ("(fake)") its IPC slices and RDMA area."""
        state, _, _, topk_idx, topk_weights_ori, _, _, _, _ = handle
        _ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        op = "aclnnMoeDistributeCombineA2"
        _op_check(x.dtype in (torch.bfloat16, torch.float16), op, "expandX must be bf16/fp16")
        R, h, k, bs = self.group_size, x.shape[1], topk_idx.shape[1], topk_idx.shape[0]
        a2_internode_combine_tiling(R, bs, h, k, state.num_experts, os.environ)
        notify = state.notify
        batches = notify[:, 0]
        window = self.allocated_window_mb * v.MIB
        # every rank's kernel asserts on its own batch; here every rank raises for the largest
        a2_internode_combine_kernel_window(window, R, int(batches.max()), h, k)
        servers, peers = R // v.A2_MAX_HCCS_PEERS, v.A2_MAX_HCCS_PEERS
        slice_entries = (v.a2_internode_ipc_window_bytes(window) // R * peers) // (h * 2 + 32)
        sent = notify[:, 1 + servers:]  # [source d, destination r]: rows r received from d
        entries = sent.view(R, servers, peers).sum(dim=2)  # per (d, server of r): what r's server returns to d
        if int(entries.max()) > slice_entries:
            raise RuntimeError(f"(fake) {op}: {int(entries.max())} (token, expert) entries for one rank from one "
                               f"server in an IPC slice of {slice_entries}: the kernel writes into the next slice")
        a2_internode_combine_rdma(R, h)
        return self._weighted_return(x, state, topk_idx, topk_weights_ori)

    def _intranode_dispatch(self, x: Any, handle: Any, num_tokens_per_rank: Any, is_token_in_rank: Any,
                            num_tokens_per_expert: Any, topk_idx: Any, topk_weights: Any, config: Any, quant: str,
                            num_worst_tokens: int = 0
                            ) -> Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        counts_type = self._dispatch_asserts("intranode_dispatch", x, handle, num_tokens_per_rank, is_token_in_rank,
                                             num_tokens_per_expert, topk_idx, topk_weights, config)
        if quant in v.A5_ONLY_QUANT_MODES:
            _ep_assert(False, f"{quant} is not supported on this device, please use int8 or bf16 instead.")
        _op_check(x.dtype in (torch.bfloat16, torch.float16), "aclnnCamMoeDispatchNormal", "x must be bf16/fp16")
        if self._layout is None or not torch.equal(self._layout[0], topk_idx):
            raise RuntimeError("(fake) dispatch without get_dispatch_layout on the same topk_idx first: the C++ "
                               "uses the layout state the last get_dispatch_layout left on this Buffer")
        num_experts = self._layout[1]
        self._layout = None
        # aclnnNotifyDispatch: max_bs = the largest batch over the source ranks; the Buffer member
        # real_max_bs = max(max_bs, num_worst_tokens) (read again by the next combine)
        max_bs = self._max_batch_over_ranks(x.shape[0])
        self.real_max_bs = max(max_bs, int(num_worst_tokens))
        global_bs = min(self.per_round_tokens, self.real_max_bs) * self.group_size
        self._normal_op_checks(x, topk_idx, num_experts, global_bs)
        data, scale = quant_normal(x) if quant == "int8" else (x, None)
        local = num_experts // self.group_size
        recv_data, recv_scale, counts, state = self._exchange("dispatch", data, scale, topk_idx, local)
        total = int(counts.sum())
        if total == 0:  # deep_ep.cpp: never an empty output
            recv_data = torch.zeros(v.EMPTY_RECEIVE_ROWS, data.shape[1], dtype=data.dtype)
            recv_scale = torch.zeros(v.EMPTY_RECEIVE_ROWS) if scale is not None else None
        state.rows = recv_data.shape[0]
        k = topk_idx.shape[1]
        garbage_idx = torch.empty(total, k, dtype=topk_idx.dtype)  # at::empty, never filled
        garbage_w = torch.empty(total, k, dtype=torch.float32)
        listed = counts.tolist() if counts_type == 1 else torch.cumsum(counts, 0).tolist()
        vendor_handle = (None, None, None, state, is_token_in_rank, counts.to(torch.int32), topk_idx, topk_weights)
        recv_x = (recv_data, recv_scale) if scale is not None else recv_data
        return recv_x, garbage_idx, garbage_w, listed, vendor_handle, EventOverlap()

    def _max_batch_over_ranks(self, n: int) -> int:
        """aclnnNotifyDispatch's max_bs (outside the traffic counts: the C++ exchanges it in its notify op)."""
        mine = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
        return int(self.comm.gather_uncounted(mine, "notify_dispatch").view(torch.int64).max())

    def _check_window_extent(self, op: str) -> None:
        """The normal kernels lay the window out by the size the ops see (totalWinSize/2 is the second
        half); more than HCCL allocated means writes past it (no check on the device: corruption)."""
        if _window_mb() > self.allocated_window_mb:
            raise RuntimeError(f"(fake) {op}: the ops see a {_window_mb()} MB window ({v.DEEPEP_HCCL_BUFFSIZE} or "
                               f"{v.HCCL_BUFFSIZE}) but HCCL allocated the group {self.allocated_window_mb} MB: the "
                               "kernels would write past the window")

    def _normal_op_checks(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, global_bs: int) -> None:
        """CamMoeDispatchNormal's tiling (KN@f425bdf ops/op_host/cam_moe_dispatch_normal_tiling.cc; ops2 on A2)."""
        op, R = "aclnnCamMoeDispatchNormal", self.group_size
        soc = self.soc_version or A3
        h, k = x.shape[1], topk_idx.shape[1]
        _op_check(v.MIN_EP_WORLD_SIZE <= R <= v.MAX_EP_WORLD_SIZE_NORMAL, op,
                  f"epWorldSize is invalid, only support [2, 384], but got epWorldSize={R}")
        _op_check(0 < num_experts <= v.NORMAL_OP_MAX_EXPERTS[soc], op,
                  f"moeExpertNum is invalid, only support (0, {v.NORMAL_OP_MAX_EXPERTS[soc]}], got {num_experts}")
        _op_check(num_experts // R * R <= v.NORMAL_OP_MAX_DISPATCH_STATUS, op,
                  "The moe experts num must meet the conditions, (moeExpertNum / epWorldSize * epWorldSize <= 1280")
        _op_check(num_experts % R == 0, op, "moeExpertNum should be divisible by epWorldSize")
        _op_check(global_bs > 0, op, f"globalBS is invalid, should be positive, but got globalBS={global_bs}")
        _op_check(v.MIN_HIDDEN <= h <= v.NORMAL_OP_MAX_HIDDEN[soc], op,
                  f"xShape dims1(H) should be in [1024, {v.NORMAL_OP_MAX_HIDDEN[soc]}], but got {h}")
        _op_check(0 < k <= min(v.MAX_TOP_K, num_experts), op, f"expertIdShape's dim1(k) should be in (0, 16], got {k}")
        formula = v.normal_op_window_bytes_a2 if soc == A2 else v.normal_op_window_bytes
        need = formula(global_bs // R, h, k, self.per_round_tokens)
        _op_check(need <= _window_mb() * v.MIB, op,
                  f"HCCL_BUFFSIZE is too SMALL, NEEDED_HCCL_BUFFSIZE = {need // v.MIB + 1}MB, "
                  f"HCCL_BUFFSIZE={_window_mb()}MB")
        self._check_window_extent(op)
        self._normal_op_half_offset(op, soc, h, k)

    def _normal_op_half_offset(self, op: str, soc: str, hidden: int, top_k: int) -> None:
        """The kernel flips dataState each call and keeps ``winDataSizeOffset = dataState·(totalWinSize/2) +
        min(realMaxBs, perRound)·k·hSizeAlignCombine`` in a uint32 (ops/op_kernel/cam_moe_dispatch_normal.h Init;
        A2: half of totalWinSize − 8 MB): "(fake)" where state 1's data wraps onto the first half."""
        if _flip_window_state(self.group) == 0:
            return
        offset = v.normal_op_state1_offset(_window_mb() * v.MIB, self.real_max_bs, hidden, top_k, soc,
                                           self.per_round_tokens, self.round)
        if offset >= v.UINT32_SPAN:
            raise RuntimeError(f"(fake) {op}: the state-1 uint32 winDataSizeOffset {offset} wraps to "
                               f"{offset % v.UINT32_SPAN}: the data lands on the first half's combine area and data")

    def combine(
        self,
        x: torch.Tensor,
        handle: Tuple,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        combine_send_cost_stats: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        config = self.get_combine_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:
            return self._internode_combine(x, handle)
        _, _, _, state, _, _, topk_idx, topk_weights_ori = handle  # the sender's own weights, not the argument
        _ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        op = "aclnnCamMoeCombineNormal"
        _op_check(x.dtype in (torch.bfloat16, torch.float16), op, "x must be bf16/fp16")
        bs = topk_idx.shape[0]  # expert_scales = the handle's topk_weights [bs, k]
        _op_check(self.real_max_bs == 0 or self.real_max_bs >= bs, op,
                  "realMaxBs is invalid, only support 0 or value greater than or equal to the BS of all ranks."
                  f"but got realMaxBs={self.real_max_bs}, bs={bs} (real_max_bs is the LAST normal dispatch's)")
        self._check_window_extent(op)
        return self._weighted_return(x, state, topk_idx, topk_weights_ori)

    # -- the exchange between ranks -----------------------------------------------------------------

    def _exchange(self, name: str, data: torch.Tensor, scale: torch.Tensor | None, topk_idx: torch.Tensor,
                  local: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, _Exchange]:
        """One row per (token, destination expert), ids -1 skipped; received grouped by local
        expert, then source rank, then source token."""
        n = data.shape[0]
        R = self.group_size
        tok, slot = (topk_idx >= 0).nonzero(as_tuple=True)
        expert = topk_idx[tok, slot].long()
        order = torch.argsort(expert // local * (n + 1) + tok, stable=True)  # by destination rank, then token
        tok, slot, expert = tok[order], slot[order], expert[order]
        dest = expert // local
        columns = [as_bytes(data[tok])] + ([as_bytes(scale[tok].unsqueeze(1))] if scale is not None else [])
        payload = sum(c.shape[1] for c in columns)
        rows = torch.cat(columns + [as_bytes(torch.stack([expert - dest * local, tok], dim=1))], dim=1)
        send = torch.bincount(dest, minlength=R)
        recv = self.comm.exchange_counts(send)
        got = self.comm.all_to_all(rows, send.tolist(), recv.tolist(), (("payload", payload), ("metadata", 16)))
        self.calls.append(VendorCall(name, data.dtype, scale is not None, int(rows.shape[0]) * payload,
                                     tuple((k, os.environ.get(k)) for k in NOTED_ENV)))
        src = torch.repeat_interleave(torch.arange(R), recv)
        meta = from_bytes(got[:, payload:], torch.int64)
        le, src_tok = meta[:, 0], meta[:, 1]
        span = int(src_tok.max()) + 1 if src_tok.numel() else 1
        group = torch.argsort((le * R + src) * span + src_tok, stable=True)
        dw = data.shape[1] * data.element_size()
        recv_data = from_bytes(got[group, :dw], data.dtype)
        recv_scale = from_bytes(got[group, dw:payload], torch.float32).squeeze(1) if scale is not None else None
        state = _Exchange(group, recv, send, tok, slot, n, group.numel())
        return recv_data, recv_scale, torch.bincount(le, minlength=local), state

    def _weighted_return(self, x: torch.Tensor, state: _Exchange, topk_idx: torch.Tensor,
                         topk_weights_ori: Optional[torch.Tensor]) -> Tuple[torch.Tensor, None, EventOverlap]:
        """Both normal combines' last step: the rows dispatch returned (``x``) back to their senders, each token the
        sum of its rows weighted by the sender's own top-k weights (ones where dispatch had none)."""
        if x.shape[0] != state.rows:
            raise RuntimeError(f"(fake) combine got {x.shape[0]} rows; the kernel reads the {state.rows} rows "
                               "dispatch returned")
        weights = torch.ones(topk_idx.shape) if topk_weights_ori is None else topk_weights_ori.float()
        rows, tok, slot = self._return(x, state)
        out = torch.zeros(state.tokens, x.shape[1]).index_add_(0, tok, rows * weights[tok, slot].unsqueeze(1))
        return out.to(x.dtype), None, EventOverlap()

    def _return(self, x: torch.Tensor, state: _Exchange) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each dispatched row back to its sender: fp32 rows and their (token, slot)."""
        total = state.group.numel()
        back = torch.empty(total, x.shape[1], dtype=torch.bfloat16)
        back[state.group] = x[:total].to(torch.bfloat16)  # arrival order
        got = self.comm.all_to_all(as_bytes(back), state.recv.tolist(), state.send.tolist(),
                                   (("combine", 2 * x.shape[1]),))
        return from_bytes(got, torch.bfloat16).float(), state.tok, state.slot

    # -- low-latency mode -----------------------------------------------------------------------------

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        use_mxfp4: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        topk_weights: Optional[torch.Tensor] = None,
        quant_mode: Optional[str] = None,
    ) -> Tuple[Any, torch.Tensor, Tuple, EventOverlap, Callable]:
        # KN buffer.py Buffer.low_latency_dispatch (since KN@f451a596): the legacy flags when quant_mode is None
        if quant_mode is None:
            if use_mxfp4:
                quant_mode = "mx_fp4_e2m1"
            elif use_fp8 and use_ue8m0:
                quant_mode = "mx_fp8_e4m3"
            elif use_fp8:
                quant_mode = "int8"
        if quant_mode not in v.LL_QUANT_MODES:  # strategies/low_latency_strategy.py
            raise ValueError(f"Unsupported quant_mode: {quant_mode}")
        recv_x, scales, counts, vendor_handle = self._ll_dispatch(x, topk_idx.int(), num_max_dispatch_tokens_per_rank,
                                                                  num_experts, quant_mode)
        if self.soc_version != A2:  # A3's MoeDistributeDispatchV2 flips the normal op's dataState word too
            _flip_window_state(self.group)
        hook: Callable[[], None] = lambda: None  # noqa: E731
        return ((recv_x, scales) if quant_mode is not None else recv_x), counts, vendor_handle, EventOverlap(), hook

    def _ll_checks(self, op: str, x: torch.Tensor, topk_ids: torch.Tensor, T: int, num_experts: int) -> int:
        """deep_ep.cpp's asserts and the op tiling's checks; returns E_local."""
        R = self.group_size
        n, h = x.shape[0], x.shape[1] if x.dim() == 2 else 0
        k = topk_ids.shape[1]
        _op_check(v.MIN_EP_WORLD_SIZE <= R <= v.MAX_EP_WORLD_SIZE_LL, op,
                  f"epWorldSize is invalid, only support [2, 768], but got epWorldSize={R}")
        if self.soc_version == A2 and R > v.A2_MAX_HCCS_PEERS:  # ops2 moe_distribute_dispatch_v2_tiling.cc
            _op_check(R % v.A2_INTERNODE_EP_MULTIPLE == 0 and R <= v.A2_INTERNODE_MAX_EP, op,
                      f"epWorldSize is invalid: A2 multi-server takes multiples of 8 up to 256, got {R}")
        if self.soc_version != A2 and v.parse_env_int(os.environ.get(v.CCU_ENV), 0) == 1:
            raise RuntimeError(f"(fake) {v.CCU_ENV}=1 sends {op} down comm_alg 'ccu', the A5 CCU op "
                               "(MoeDistributeDispatchA5): not emulated, and not what an A3 runs")
        _op_check(0 < num_experts <= 1024 and num_experts % R == 0, op,
                  f"moeExpertNum should be divisible by epWorldSize and in (0, 1024], got {num_experts}")
        _op_check(n <= v.LL_MAX_TOKENS, op, f"xDim0(BS) is invalid. Should be between [0, 512], but got xDim0={n}")
        _op_check(1024 <= h <= 8192, op, f"xShape dims1(H) should be in [1024, 8192], but got {h}")
        _op_check(0 < k <= min(v.MAX_TOP_K, num_experts), op, f"expertIdShape's dim1(k) should be in (0, 16], got {k}")
        local = num_experts // R
        need = v.ll_op_window_bytes(T, h, R, local, k)
        _op_check(need <= _window_mb() * v.MIB, op,
                  f"HCCL_BUFFSIZE is too SMALL, NEEDED_HCCL_BUFFSIZE = {need // v.MIB + 1}MB, "
                  f"HCCL_BUFFSIZE={_window_mb()}MB")
        if self.soc_version == A2 and v.is_layered(os.environ):  # the layered kernels' assert on the real window
            pad = op.endswith("DispatchV2")  # moe_distribute_dispatch_v2_layered.h pads k to 8; the combine does not
            need = num_experts * n * (h * 2 + 4 * (-(-k // 8) * 8 if pad else k) * 4) + 804 * v.MIB
            if need > self.allocated_window_mb * v.MIB:
                raise RuntimeError(f"{op}: assert failed: The HCCL_BUFFSIZE is {self.allocated_window_mb}MB, the min "
                                   f"value should be {need // v.MIB}MB.")
        if self.soc_version == A2 and v.is_layered(os.environ):
            a2_layered_ipc_layout(self.allocated_window_mb * v.MIB, R, num_experts // R)
        elif self.soc_version == A2 and R > v.A2_MAX_HCCS_PEERS:
            a2_ll_half_window(self.allocated_window_mb * v.MIB)
        if _window_mb() > self.allocated_window_mb:  # moe_distribute_dispatch_v2.h CheckWindowSize: a deliberate fault
            raise RuntimeError(f"{op}: CheckWindowSize failed: tiling window {_window_mb()} MB > the HCCL window "
                               f"{self.allocated_window_mb} MB")
        enable_neg_one = v.parse_env_int(os.environ.get(v.NEG_ONE_ENV), 0)
        if enable_neg_one:
            layered = self.soc_version == A2 and v.is_layered(os.environ)
            _ep_assert(not layered, "isLayered == false")
        elif bool((topk_ids < 0).any()):
            raise RuntimeError(f"(fake) expert id -1 reached {op} without {v.NEG_ONE_ENV}=1: no active mask goes to "
                               "the kernel, whose behaviour with -1 is not documented")
        return local

    def _ll_dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, T: int, num_experts: int,
                     quant_mode: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Tuple]:
        # deep_ep.cpp Buffer::low_latency_dispatch
        _ep_assert(self.low_latency_mode, "low_latency_mode")
        _ep_assert(T >= x.shape[0], "num_max_dispatch_tokens_per_rank >= x.size(0)")
        name = "none" if quant_mode is None else quant_mode
        if name in v.A5_ONLY_QUANT_MODES:
            _ep_assert(False, f"{name} is not supported on this device, please use int8 or bf16 instead.")
        _ep_assert(name in ("none", "int8"), 'quant_mode_name == "none"')
        op = "aclnnMoeLowLatencyDispatchV2"
        _op_check(x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16), op, "x must be 2-D bf16/fp16")
        _op_check(topk_ids.dtype == torch.int32 and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0], op,
                  "expertIds must be int32 [bs, k]")
        counts_type = v.parse_env_int(os.environ.get(v.COUNTS_TYPE_ENV), 1)
        _op_check(counts_type in (0, 1), op, "expertTokenNumsType only support 0 or 1")
        local = self._ll_checks(op, x, topk_ids, T, num_experts)
        int8 = name == "int8"
        data, scale = quant_low_latency(x) if int8 else (x, None)
        recv_data, recv_scale, counts, state = self._exchange("low_latency_dispatch", data, scale, topk_ids, local)
        cap = v.ll_receive_rows(T, self.group_size, local, topk_ids.shape[1])
        state.rows = cap
        packed = torch.full((cap, x.shape[1]), 127 if int8 else float("nan"), dtype=data.dtype)  # garbage past counts
        packed[: recv_data.shape[0]] = recv_data
        scales = torch.full((cap,), float("nan")) if int8 else torch.empty(1)
        if recv_scale is not None:
            scales[: recv_scale.shape[0]] = recv_scale
        out_counts = counts.to(torch.int64) if counts_type == 1 else torch.cumsum(counts, 0).to(torch.int64)
        vendor_handle = (state, None, T, x.shape[1], num_experts, out_counts, None)
        return packed, scales, out_counts, vendor_handle

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, EventOverlap, Callable]:
        topk_ids = topk_idx.int()
        state, _, T, hidden, num_experts, _, _ = handle
        # deep_ep.cpp Buffer::low_latency_combine
        _ep_assert(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16,
                   "x.dim() == 2 and x.is_contiguous() and x.scalar_type() == at::kBFloat16")
        _ep_assert(T >= topk_ids.shape[0], "num_max_dispatch_tokens_per_rank >= topk_idx.size(0)")
        op = "aclnnMoeLowLatencyCombineV2"
        self._ll_checks(op, torch.empty(topk_ids.shape[0], hidden), topk_ids, T, num_experts)
        _op_check(x.shape[0] >= state.rows, op, f"expandX's dim0 must be >= {state.rows}, got {x.shape[0]}")
        rows, tok, slot = self._return(x, state)
        combined = torch.zeros(topk_weights.shape[0], x.shape[1]).index_add_(
            0, tok, rows * topk_weights[tok, slot].float().unsqueeze(1))
        hook: Callable[[], None] = lambda: None  # noqa: E731
        return combined.to(torch.bfloat16), EventOverlap(), hook


__all__ = ["A2", "A3", "Buffer", "Config", "quant_low_latency", "quant_normal", "EventHandle", "EventOverlap", "FuseMode", "LowLatencyStrategy", "NormalStrategy",
           "VendorCall"]
