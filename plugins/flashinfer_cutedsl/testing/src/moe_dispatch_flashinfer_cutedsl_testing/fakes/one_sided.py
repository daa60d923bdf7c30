"""FlashInfer 0.7.4's ``flashinfer.moe_ep`` one-sided NVLink all-to-all, on CPU.

``OneSidedKernels`` is the compiled module ``get_nvlink_one_sided_alltoall_module()`` returns, written from
flashinfer-python==0.7.4 csrc/nvlink_one_sided_alltoall.cu (the host ops and their checks) and
csrc/nv_internal/tensorrt_llm/kernels/moe/communication/moeAlltoAllKernels.cu (what the fence-path kernels do):

- ``moe_a2a_get_workspace_layout`` writes calculateWorkspaceLayout's offsets (``vendor.ep_workspace_layout``);
- ``moe_a2a_initialize`` checks the layout and zeroes this rank's slice, the two rounds' receive counters -1;
- ``moe_a2a_dispatch``: ``flag_val += 1``; per token, a pick is sent only for ``0 <= id < num_experts``
  (``valid_expert``), to its rank by the ceil/floor partition, once per rank (the first pick); slots
  numbered in token order (the GPU's atomics give any order); each payload row stored in the target's
  plane at ``[source, slot]``, the planes on 128-byte boundaries from the dispatch region; the target's
  receive counter of this round (``round_parity``) and completion flag set, every peer's flag awaited;
- ``moe_a2a_sanitize_expert_ids``: ids of rows at or past their source's count become the invalid id
  (other rows keep stale bytes);
- ``moe_a2a_combine``: ``flag_val += 1``; the payload's valid rows staged into this rank's combine region;
  each token sums the rows its sent picks went to, in pick order compacted over the sent ones, in float32
  groups of eight (``((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7))``) and then across groups, cast to the payload dtype.

No GPU here has CFT counted writes or the Lamport transport (``moe_a2a_lamport_available`` is False): every
step takes the fence path, as on an SM90 GPU. The Python layer (``NVLinkOneSidedAlltoAll`` and the configs)
follows flashinfer/moe_ep/backends/split/comm/nvlink_one_sided/communication.py, nvlink_common.py and
core/comm/communication.py of the same wheel.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from moe_dispatch.backend import as_bytes, from_bytes
from moe_dispatch_flashinfer_cutedsl import vendor

from . import tvm
from .kernels import _i32, _target_ranks, _word
from .mapping import Mapping
from .mnnvl import MnnvlConfig, segment_of

_NAMES = vendor.EP_METAINFO_NAMES
_FIELD = {name: i for i, name in enumerate(_NAMES)}
_SUPPORTED_TOP_K = tuple(sorted(vendor.EP_TOP_K_VALUES))


def _round_parity(flag_val: int) -> int:
    return ((flag_val - 1) >> 1) & 1


class OneSidedKernels:
    """The JIT module of 0.7.4's one-sided all-to-all (fence path only)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def moe_a2a_get_metainfo_index_pairs(self) -> tuple[list[str], list[int]]:
        names = [f"MOE_A2A_{n}_INDEX" for n in _NAMES] + ["MOE_A2A_NUM_METAINFO_FIELDS", "MOE_A2A_MAX_RANKS",
                                                           "MOE_A2A_MAX_TOP_K", "MOE_A2A_MAX_PAYLOADS",
                                                           "MOE_A2A_WORKSPACE_ALIGNMENT"]
        return names, list(range(len(_NAMES))) + [len(_NAMES), vendor.EP_MAX_RANKS, max(_SUPPORTED_TOP_K),
                                                   vendor.EP_MAX_PAYLOADS, vendor.EP_WORKSPACE_ALIGNMENT]

    def moe_a2a_lamport_available(self) -> bool:
        return False

    def moe_a2a_get_workspace_layout(self, ep_size: int, max_num_tokens: int, top_k: int, dispatch_bytes: int,
                                     combine_input_bytes: int, combine_recv_bytes: int, eplb_stats_num_experts: int,
                                     can_use_cft: bool, metainfo: torch.Tensor) -> None:
        tvm.check_cpu("metainfo", metainfo)
        tvm.check_type("metainfo", metainfo, torch.int64)
        tvm.icheck(metainfo.dim() == 1 and metainfo.numel() == len(_NAMES), "metainfo.size(0) == NUM_METAINFO_FIELDS",
                   "metainfo must have NUM_METAINFO_FIELDS elements")
        tvm.icheck(0 < ep_size <= vendor.EP_MAX_RANKS, "epSize > 0 && epSize <= kMaxRanks", f"Invalid EP size: {ep_size}")
        tvm.icheck(max_num_tokens > 0, "maxNumTokens > 0", f"Invalid allocation-time token capacity: {max_num_tokens}")
        tvm.icheck(0 < top_k <= max(_SUPPORTED_TOP_K), "topK > 0 && topK <= kMaxTopK", f"Invalid top_k: {top_k}")
        tvm.icheck(can_use_cft or combine_recv_bytes == 0, "canUseCft || combineRecvBytes == 0",
                   "A combine receive payload requires CFT support")
        if can_use_cft:
            raise NotImplementedError("fake: CFT counted-write regions are not emulated (no such GPU here)")
        layout = vendor.ep_workspace_layout(ep_size, max_num_tokens, top_k, dispatch_bytes, combine_input_bytes,
                                            eplb_stats_num_experts)
        metainfo.copy_(torch.tensor([layout[n] for n in _NAMES], dtype=torch.int64))

    @staticmethod
    def _layout(metainfo: torch.Tensor) -> dict[str, int]:
        tvm.icheck(metainfo.dim() == 1 and metainfo.numel() == len(_NAMES), "metainfo.size(0) == NUM_METAINFO_FIELDS")
        return dict(zip(_NAMES, (int(v) for v in metainfo.tolist())))

    @staticmethod
    def _workspace(workspace: torch.Tensor, ep_size: int, layout: dict[str, int]) -> None:
        tvm.check_type("workspace", workspace, torch.uint8)
        tvm.icheck(workspace.dim() == 2 and workspace.shape[0] == ep_size, "workspace.size(0) == epSize",
                   "workspace first dimension must equal epSize")
        tvm.icheck(workspace.shape[1] >= layout["WORKSPACE_SIZE"], "workspace.size(1) >= WORKSPACE_SIZE",
                   "Workspace is smaller than its layout")
        if segment_of(workspace) is None:
            tvm.device_fault("the workspace is not MNNVL memory: the kernels store into peers' slices of it")

    def moe_a2a_initialize(self, workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int, ep_size: int) -> None:
        layout = self._layout(metainfo)
        tvm.icheck(0 <= ep_rank < ep_size, "epRank >= 0 && epRank < epSize", "Invalid EP rank")
        tvm.icheck(layout["EP_SIZE"] == ep_size, "layout[EP_SIZE_INDEX] == epSize", "Workspace layout EP size mismatch")
        expected = vendor.ep_workspace_layout(ep_size, layout["MAX_NUM_TOKENS"], layout["TOP_K"],
                                              layout["DISPATCH_PAYLOAD_SIZE"], layout["COMBINE_INPUT_SIZE"],
                                              layout["EPLB_STATS_NUM_EXPERTS"])
        tvm.icheck(layout == expected, "layout == expected", "Workspace layout metadata is inconsistent")
        self._workspace(workspace, ep_size, layout)
        row = workspace[ep_rank]
        row[: layout["WORKSPACE_SIZE"]].zero_()
        _i32(row, layout["RECV_COUNTERS_OFFSET"], 2 * ep_size).fill_(-1)
        self.calls.append("moe_a2a_initialize")

    def moe_a2a_dispatch(self, token_selected_experts: torch.Tensor, input_payloads: list[torch.Tensor],
                         workspace: torch.Tensor, metainfo: torch.Tensor, runtime_max_tokens_per_rank: int,
                         ep_rank: int, ep_size: int, top_k: int, num_experts: int,
                         eplb_local_stats: torch.Tensor | None, use_cft: bool, expert_id_payload_index: int,
                         invalid_token_expert_id: int, use_lamport: bool, enable_rank_mask: bool,
                         active_rank_mask: torch.Tensor | None, timeout_sec: int, enable_pdl: bool
                         ) -> tuple[list[int], int, int]:
        tse, T, R = token_selected_experts, runtime_max_tokens_per_rank, ep_size
        tvm.check_input("tokenSelectedExperts", tse)
        tvm.check_type("tokenSelectedExperts", tse, torch.int32)
        tvm.icheck(tse.dim() == 2, "tokenSelectedExperts.ndim() == 2", "tokenSelectedExperts must be a 2D tensor")
        tvm.icheck(tse.shape[1] == top_k, "tokenSelectedExperts.size(1) == topK")
        layout = self._layout(metainfo)
        tvm.icheck(not use_lamport and not use_cft, "no Lamport or CFT step", "fake: fence path only")
        tvm.icheck(0 < T <= layout["MAX_NUM_TOKENS"], "0 < runtimeMaxTokensPerRank <= MAX_NUM_TOKENS",
                   "runtimeMaxTokensPerRank must be positive and at most the allocation-time capacity")
        tvm.icheck(0 < R <= vendor.EP_MAX_RANKS and 0 <= ep_rank < R, "epSize/epRank in range")
        tvm.icheck(0 < len(input_payloads) <= vendor.EP_MAX_PAYLOADS, "0 < numPayloads <= kMaxPayloads",
                   "Too many input payloads")
        tvm.icheck(num_experts >= R, "numExperts >= epSize", "numExperts must be greater than or equal to epSize")
        if eplb_local_stats is not None or enable_rank_mask or active_rank_mask is not None:
            raise NotImplementedError("fake: EPLB statistics and rank masks are not emulated")
        local = tse.shape[0]
        offsets, current = [], layout["DISPATCH_PAYLOAD_OFFSET"]
        for pay in input_payloads:
            tvm.check_input("payload", pay)
            tvm.icheck(pay.dim() == 2, "payload.ndim() == 2", "payload must be a 2D tensor")
            tvm.icheck(pay.shape[0] == local, "payload.size(0) == localNumTokens",
                       "payload must have the same first dimension as tokenSelectedExperts")
            tvm.icheck(pay.data_ptr() % vendor.EP_PAYLOAD_ALIGNMENT == 0, "payload.data_ptr() % 16 == 0",
                       "payload must be 16-byte aligned")
            offsets.append(current)
            current = -(-(current + R * T * pay.shape[1] * pay.element_size()) // vendor.CACHELINE) * vendor.CACHELINE
        self._workspace(workspace, R, layout)
        tvm.icheck(R == layout["EP_SIZE"] and top_k == layout["TOP_K"], "epSize/topK == layout",
                   "Dispatch EP size/top_k differs from its workspace layout")
        tvm.icheck(local <= T, "localNumTokens <= runtimeMaxTokensPerRank", "Local token count exceeds the runtime capacity")
        capacity = layout["DISPATCH_PAYLOAD_OFFSET"] + layout["DISPATCH_PAYLOAD_SIZE"]
        tvm.icheck(current <= capacity, "currentOffset <= recvRegionOffset + recvRegionSize",
                   f"Dispatch payload exceeds its workspace capacity: need {current - layout['DISPATCH_PAYLOAD_OFFSET']} "
                   f"bytes, capacity {layout['DISPATCH_PAYLOAD_SIZE']}")
        tvm.launch_check(top_k in _SUPPORTED_TOP_K, "Unsupported top_k")
        row = workspace[ep_rank]
        flag = _i32(row, layout["FLAG_VAL_OFFSET"], 1)
        flag += 1
        flag_val = int(flag.item())
        parity = _round_parity(flag_val)
        _i32(row, layout["RECV_COUNTERS_OFFSET"] + (parity ^ 1) * R * 4, R).fill_(-1)
        ids = tse.long()
        valid = (ids >= 0) & (ids < num_experts)
        targets = torch.where(valid, _target_ranks(ids.clamp(min=0), num_experts, R, True), -1)
        first = valid.clone()
        for k in range(1, top_k):
            first[:, k] &= ~(targets[:, :k] == targets[:, k : k + 1]).any(dim=1)
        tok, pick = first.nonzero(as_tuple=True)  # token-major: slots numbered in token order
        dest = targets[tok, pick]
        onehot = torch.nn.functional.one_hot(dest, R) if dest.numel() else torch.zeros(0, R, dtype=torch.int64)
        index = torch.full_like(targets, -1)
        index[tok, pick] = (onehot.cumsum(0) - 1).gather(1, dest.unsqueeze(1)).squeeze(1)
        counts = onehot.sum(0)
        _i32(row, layout["TOPK_TARGET_RANKS_OFFSET"], local * top_k).copy_(torch.where(first, targets, -1).flatten())
        _i32(row, layout["TOPK_TARGET_INDICES_OFFSET"], local * top_k).copy_(index.flatten())
        _i32(row, layout["SEND_COUNTERS_OFFSET"], R).copy_(counts)
        outgoing: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for r in range(R):
            sel = tok[dest == r]
            stores = [(base + ep_rank * T * pay.shape[1] * pay.element_size(), as_bytes(pay[sel]).reshape(-1))
                      for pay, base in zip(input_payloads, offsets)]
            stores.append((layout["RECV_COUNTERS_OFFSET"] + (parity * R + ep_rank) * 4, _word(int(counts[r]))))
            stores.append((layout["DISPATCH_COMPLETION_FLAGS_OFFSET"] + ep_rank * 4, _word(flag_val)))
            outgoing[r] = stores
        segment = segment_of(workspace)
        assert segment is not None
        for stores in segment.exchange(outgoing):
            for offset, raw in stores:
                row[offset : offset + raw.numel()] = raw
        peers = _i32(row, layout["DISPATCH_COMPLETION_FLAGS_OFFSET"], R)
        if not bool((peers == flag_val).all()):
            tvm.device_fault(f"dispatch: rank {ep_rank} waited {timeout_sec} s for completion flags {peers.tolist()} "
                             f"to reach {flag_val} (trap)")
        self.calls.append("moe_a2a_dispatch")
        return offsets, layout["COMBINE_INPUT_OFFSET"], -1

    def moe_a2a_sanitize_expert_ids(self, expert_ids: torch.Tensor, workspace: torch.Tensor, metainfo: torch.Tensor,
                                    ep_rank: int, invalid_expert_id: int, enable_pdl: bool) -> None:
        tvm.check_input("expertIds", expert_ids)
        tvm.check_type("expertIds", expert_ids, torch.int32)
        tvm.icheck(expert_ids.dim() == 3, "expertIds.ndim() == 3")
        layout = self._layout(metainfo)
        R, T, _ = expert_ids.shape
        row = workspace[ep_rank]
        parity = _round_parity(int(_i32(row, layout["FLAG_VAL_OFFSET"], 1).item()))
        recv = _i32(row, layout["RECV_COUNTERS_OFFSET"] + parity * R * 4, R).long()
        expert_ids[torch.arange(T).unsqueeze(0) >= recv.unsqueeze(1)] = invalid_expert_id
        self.calls.append("moe_a2a_sanitize_expert_ids")

    def moe_a2a_combine(self, payload: torch.Tensor, local_num_tokens: int, workspace: torch.Tensor,
                        metainfo: torch.Tensor, runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int,
                        top_k: int, combine_payload_offset: int, payload_in_workspace: bool, use_low_precision: bool,
                        use_cft: bool, enable_rank_mask: bool, active_rank_mask: torch.Tensor | None,
                        output: torch.Tensor, timeout_sec: int, enable_pdl: bool, use_lamport: bool) -> None:
        T, R, local = runtime_max_tokens_per_rank, ep_size, local_num_tokens
        tvm.check_input("payload", payload)
        tvm.icheck(payload.dim() == 3, "payload.ndim() == 3", "payload must be [ep_size, runtime_max_tokens, hidden]")
        tvm.icheck(payload.shape[0] == R, "payload.size(0) == epSize", "payload first dimension must equal epSize")
        tvm.icheck(payload.shape[1] == T and T > 0, "payload.size(1) == runtimeMaxTokensPerRank")
        tvm.icheck(payload.data_ptr() % vendor.EP_PAYLOAD_ALIGNMENT == 0, "payload.data_ptr() % 16 == 0",
                   "payload must be 16-byte aligned")
        tvm.icheck(local >= 0, "localNumTokens >= 0", "localNumTokens must be non-negative")
        if payload.dtype not in vendor.COMBINE_DTYPES:
            raise TypeError(f"Unsupported dtype for MoE combine: {payload.dtype}")
        tvm.check_input("output", output)
        tvm.icheck(output.dtype == payload.dtype, "output.dtype() == payload.dtype()",
                   "output dtype must match the payload dtype")
        H = payload.shape[2]
        tvm.icheck(tuple(output.shape) == (local, H), "output is [localNumTokens, hidden]")
        layout = self._layout(metainfo)
        self._workspace(workspace, R, layout)
        tvm.icheck(R == layout["EP_SIZE"] and top_k == layout["TOP_K"], "epSize/topK == layout")
        tvm.icheck(T <= layout["MAX_NUM_TOKENS"], "runtimeMaxTokensPerRank <= MAX_NUM_TOKENS")
        tvm.icheck(not (use_lamport or use_cft or use_low_precision or payload_in_workspace),
                   "fence path, bf16 wire, payload outside the workspace", "fake: not emulated")
        tvm.icheck(combine_payload_offset == layout["COMBINE_INPUT_OFFSET"],
                   "combinePayloadOffset == COMBINE_INPUT_OFFSET")
        width = H * payload.element_size()
        tvm.icheck(R * T * width <= layout["COMBINE_INPUT_SIZE"], "payloadSize <= regionSize",
                   "combine payload exceeds its workspace region")
        row = workspace[ep_rank]
        flag = _i32(row, layout["FLAG_VAL_OFFSET"], 1)
        flag += 1
        flag_val = int(flag.item())
        parity = _round_parity(flag_val)
        recv = _i32(row, layout["RECV_COUNTERS_OFFSET"] + parity * R * 4, R).long()
        region = row[combine_payload_offset : combine_payload_offset + R * T * width].view(R, T, width)
        valid = torch.arange(T).unsqueeze(0) < recv.unsqueeze(1)
        region[valid] = as_bytes(payload.reshape(R * T, H)).view(R, T, width)[valid]
        outgoing = {s: [(combine_payload_offset, region[s].reshape(-1)),
                        (layout["COMBINE_COMPLETION_FLAGS_OFFSET"] + ep_rank * 4, _word(flag_val))] for s in range(R)}
        regions: dict[int, torch.Tensor] = {}
        segment = segment_of(workspace)
        assert segment is not None
        for r, stores in enumerate(segment.exchange(outgoing)):
            (_, rows), (flag_offset, raw) = stores
            regions[r] = rows.view(T, width)
            row[flag_offset : flag_offset + 4] = raw
        peers = _i32(row, layout["COMBINE_COMPLETION_FLAGS_OFFSET"], R)
        if not bool((peers == flag_val).all()):
            tvm.device_fault(f"combine: rank {ep_rank} waited {timeout_sec} s for completion flags {peers.tolist()} "
                             f"to reach {flag_val} (trap)")
        targets = _i32(row, layout["TOPK_TARGET_RANKS_OFFSET"], local * top_k).view(local, top_k).long()
        index = _i32(row, layout["TOPK_TARGET_INDICES_OFFSET"], local * top_k).view(local, top_k).long()
        sent = index >= 0
        compact = sent.long().cumsum(1) - 1  # vectorized_combine: sources packed in pick order
        slots = -(-max(int(sent.sum(1).max()) if local else 0, 1) // 8) * 8
        acc = torch.zeros(slots, local, H, dtype=torch.float32)
        for t, k in sent.nonzero().tolist():
            acc[compact[t, k], t] = from_bytes(regions[int(targets[t, k])][index[t, k]], payload.dtype).float()
        for i, j in vendor.combine_reduction_pairs(slots):  # eight-wide trees, then across groups
            acc[i] = acc[i] + acc[j]
        output.copy_(acc[0].to(payload.dtype))
        self.calls.append("moe_a2a_combine")


KERNELS = OneSidedKernels()


class QuantFormat(enum.Enum):
    """flashinfer/fused_moe/api.py QuantFormat."""

    BF16 = 0
    FP16 = 1
    FP8PerTensor = 2
    DeepSeekFp8 = 3
    MXFP8 = 4
    NVFP4 = 5
    MXFP4 = 6
    MXINT4 = 7
    INT4 = 8


_BYTES_PER_TOKEN = {"BF16": lambda h: 2 * h, "FP16": lambda h: 2 * h, "FP8PerTensor": lambda h: h,
                    "DeepSeekFp8": lambda h: h + 4 * -(-h // 128), "MXFP8": lambda h: h + -(-h // 32),
                    "NVFP4": lambda h: -(-h // 2) + -(-h // 16), "MXFP4": lambda h: -(-h // 2) + -(-h // 32)}


@dataclass(frozen=True)
class BootstrapConfig:
    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    device: Optional[int] = field(default=None, kw_only=True)
    nccl_comm: Optional[int] = None
    process_group: Any = field(default=None, compare=False, hash=False)
    tcp_store: Any = None

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise ValueError(f"world_size must be positive, got {self.world_size}")
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")
        if self.device is not None and self.device < 0:
            raise ValueError(f"device must be non-negative, got {self.device}")


@dataclass(frozen=True)
class MoEEpCommParams:
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype: Any = None
    dispatch_format: Any = None
    invalid_expert_id: int = -1

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "max_tokens_per_rank", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEEpCommParams.{name} must be a positive int")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEEpCommParams.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if 0 <= self.invalid_expert_id < self.num_experts:
            raise ValueError("MoEEpCommParams.invalid_expert_id must lie outside "
                             f"[0, num_experts={self.num_experts}), got {self.invalid_expert_id}")
        if self.dispatch_format is not None and (not isinstance(self.dispatch_format, QuantFormat)
                                                 or self.dispatch_format.name not in _BYTES_PER_TOKEN):
            raise ValueError(f"MoEEpCommParams.dispatch_format must be one of QuantFormat.{{...}} or None, got "
                             f"{self.dispatch_format!r}")

    @property
    def token_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype is None else self.dtype

    @property
    def dispatch_bytes_per_token(self) -> int:
        if self.dispatch_format is None:
            return self.hidden_size * self.token_dtype.itemsize
        return _BYTES_PER_TOKEN[self.dispatch_format.name](self.hidden_size)


@dataclass
class NVLinkOneSidedConfig:
    backend_name: str = "nvlink_one_sided"
    extra_payload_bytes_per_token: int = 0
    eplb_stats_num_experts: int = 0
    enable_rank_mask: bool = False
    use_low_precision_combine: bool = False
    comm_backend: Any = None
    cft: Optional[bool] = None
    cft_max_tokens_for_dispatch: int = 128
    cft_max_tokens_for_combine: int = 128
    lamport: Optional[bool] = None
    lamport_max_tokens: Optional[int] = None
    timeout_sec: int = 300
    enable_pdl: Optional[bool] = None


@dataclass(frozen=True)
class MoEEpDispatchResult:
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor | None
    tokens_per_rank: int
    hidden_states_scale: torch.Tensor | None = None
    eplb_gathered_stats: torch.Tensor | None = None


class NVLinkOneSidedAlltoAll:
    """``NVLinkOneSidedAlltoAll`` of 0.7.4 on the fence path; subclasses give it ``_MNNVL`` and its own
    ``_WORKSPACES`` (class-level, keyed by (ep_rank, ep_size, the layout): one layout, one workspace)."""

    backend_name: ClassVar[str] = "nvlink_one_sided"
    _MNNVL: ClassVar[Any]
    _WORKSPACES: ClassVar[dict[tuple, dict[str, Any]]]

    @classmethod
    def is_platform_supported(cls) -> bool:
        """nvlink_platform_supported: the fake's GPUs have P2P NVLinks, all up."""
        return True

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams,
                 config: Optional[NVLinkOneSidedConfig] = None) -> None:
        self.config = config = NVLinkOneSidedConfig() if config is None else config
        if config.lamport is True and config.cft is True:
            raise ValueError("lamport=True and cft=True both ask for every eligible step; set one of them to None or "
                             "False")
        comm_backend = config.comm_backend
        if comm_backend is None:
            raise NotImplementedError("fake: pass NVLinkOneSidedConfig(comm_backend=...) (no torch.distributed default)")
        if comm_backend.Get_size() != bootstrap.world_size:
            raise ValueError(f"MNNVL communicator has {comm_backend.Get_size()} ranks but the EP group has "
                             f"world_size={bootstrap.world_size}")
        if comm_backend.Get_rank() != bootstrap.rank:
            raise ValueError(f"MNNVL communicator rank {comm_backend.Get_rank()} does not match the EP rank "
                             f"{bootstrap.rank}")
        comm_backend.allgather(True)  # nvlink_platform_supported on every rank
        R = bootstrap.world_size
        mapping = Mapping(world_size=R, rank=bootstrap.rank, gpus_per_node=R, tp_size=R, moe_ep_size=R)
        self.bootstrap, self.params = bootstrap, params
        self.ep_rank, self.ep_size = bootstrap.rank, R
        if params.num_experts % R != 0:
            raise ValueError(f"NVLinkOneSidedAlltoAll requires num_experts ({params.num_experts}) divisible by the EP "
                             f"size ({R})")
        if config.extra_payload_bytes_per_token < 0:
            raise ValueError("extra_payload_bytes_per_token must be non-negative")
        if not 0 <= config.eplb_stats_num_experts <= params.num_experts:
            raise ValueError("eplb_stats_num_experts must be in [0, num_experts]")
        if isinstance(config.timeout_sec, bool) or not isinstance(config.timeout_sec, int):
            raise TypeError("timeout_sec must be an integer number of seconds")
        if params.top_k not in _SUPPORTED_TOP_K:
            raise ValueError(f"NVLinkOneSidedAlltoAll supports top_k in {_SUPPORTED_TOP_K}, got {params.top_k}")
        if R > vendor.EP_MAX_RANKS:
            raise ValueError(f"NVLinkOneSidedAlltoAll supports at most {vendor.EP_MAX_RANKS} EP ranks, got {R}")
        self._module = KERNELS
        memory = self._MNNVL
        memory.initialize()
        memory.set_comm_from_config(mapping, MnnvlConfig(comm_backend=comm_backend))
        comm = memory.get_comm(mapping)
        votes = comm.allgather((False, False, None, config.lamport_max_tokens))  # no CFT, no Lamport here
        if len({v[3] for v in votes}) > 1:
            raise ValueError("lamport_max_tokens must be the same on every EP rank")
        tokens = R * params.max_tokens_per_rank
        dispatch = vendor.ep_dispatch_bytes(tokens, params.dispatch_bytes_per_token, params.top_k,
                                            config.extra_payload_bytes_per_token)
        metainfo = torch.empty(len(_NAMES), dtype=torch.int64)
        KERNELS.moe_a2a_get_workspace_layout(R, params.max_tokens_per_rank, params.top_k, dispatch,
                                             tokens * params.hidden_size * max(params.token_dtype.itemsize, 2), 0,
                                             config.eplb_stats_num_experts, False, metainfo)
        key = (self.ep_rank, R, tuple(metainfo.tolist()))
        state = self._WORKSPACES.get(key)
        if state is None:
            mem = memory(mapping, int(metainfo[_FIELD["WORKSPACE_SIZE"]]))
            workspace = mem.as_torch_strided_tensor(torch.uint8)
            KERNELS.moe_a2a_initialize(workspace, metainfo, self.ep_rank, R)
            comm.barrier()
            state = {"key": key, "mnnvl_mem": mem, "workspace": workspace, "metainfo": metainfo, "refcount": 0,
                     "round_owner": None}
            self._WORKSPACES[key] = state
        state["refcount"] += 1
        self._state: dict[str, Any] | None = state
        self.workspace, self.metainfo = state["workspace"], state["metainfo"]
        self._round: dict[str, Any] | None = None

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for extent in shape:
            n *= extent
        return self.workspace[self.ep_rank].narrow(0, offset, n * dtype.itemsize).view(dtype).view(shape)

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 *, hidden_states_scale: torch.Tensor | None = None, runtime_max_tokens_per_rank: Optional[int] = None,
                 eplb_local_stats: torch.Tensor | None = None, active_rank_mask: torch.Tensor | None = None
                 ) -> MoEEpDispatchResult:
        if self._state is None:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        owner = self._state["round_owner"]
        if owner is self:
            raise RuntimeError("dispatch called twice without an intervening combine")
        if owner is not None:
            raise RuntimeError(f"another {type(self).__name__} sharing this workspace has a dispatch awaiting its "
                               "combine; instances that share a workspace must run their rounds one after another")
        if active_rank_mask is not None and not self.config.enable_rank_mask:
            raise ValueError("active_rank_mask requires enable_rank_mask=True")
        capacity = self.params.max_tokens_per_rank
        T = capacity if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank
        if not 0 < T <= capacity:
            raise ValueError(f"runtime_max_tokens_per_rank={runtime_max_tokens_per_rank} must be in (0, {capacity}]")
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        payloads = [hidden_states] + ([hidden_states_scale] if hidden_states_scale is not None else [])
        id_index = len(payloads)
        payloads.append(topk_ids)
        if topk_weights is not None:
            payloads.append(topk_weights)
        offsets, combine_offset, _ = KERNELS.moe_a2a_dispatch(
            topk_ids, payloads, self.workspace, self.metainfo, T, self.ep_rank, self.ep_size, self.params.top_k,
            self.params.num_experts, eplb_local_stats, False, -1, self.params.invalid_expert_id, False,
            self.config.enable_rank_mask, active_rank_mask, self.config.timeout_sec, False)
        recv = [self._view(int(o), p.dtype, (self.ep_size, T, p.shape[1])) for o, p in zip(offsets, payloads)]
        KERNELS.moe_a2a_sanitize_expert_ids(recv[id_index], self.workspace, self.metainfo, self.ep_rank,
                                            self.params.invalid_expert_id, False)
        self._round = {"tokens_per_rank": T, "local_num_tokens": topk_ids.shape[0], "combine_offset": combine_offset}
        self._state["round_owner"] = self
        recv = [t.flatten(0, 1) for t in recv]
        return MoEEpDispatchResult(
            hidden_states=recv[0], hidden_states_scale=recv[1] if hidden_states_scale is not None else None,
            topk_ids=recv[id_index], topk_weights=recv[id_index + 1] if topk_weights is not None else None,
            tokens_per_rank=T)

    def combine(self, expert_output: torch.Tensor, *, output: torch.Tensor | None = None,
                active_rank_mask: torch.Tensor | None = None) -> torch.Tensor:
        state = self._round
        if state is None:
            raise RuntimeError("combine called before dispatch")
        if active_rank_mask is not None and not self.config.enable_rank_mask:
            raise ValueError("active_rank_mask requires enable_rank_mask=True")
        T = state["tokens_per_rank"]
        if expert_output.dim() == 2:
            payload = expert_output.view(self.ep_size, T, -1)
        elif expert_output.dim() == 3:
            payload = expert_output
        else:
            raise ValueError(f"expert_output must be 2D or 3D, got shape {tuple(expert_output.shape)}")
        if output is None:
            output = torch.empty(state["local_num_tokens"], payload.shape[-1], dtype=payload.dtype)
        KERNELS.moe_a2a_combine(payload, state["local_num_tokens"], self.workspace, self.metainfo, T, self.ep_rank,
                                self.ep_size, self.params.top_k, state["combine_offset"], False,
                                self.config.use_low_precision_combine, False, self.config.enable_rank_mask,
                                active_rank_mask, output, self.config.timeout_sec, False, False)
        self._round = None
        self._state["round_owner"] = None
        return output

    def destroy(self) -> None:
        state = self._state
        if state is None:
            return
        if state["round_owner"] is self:
            state["round_owner"] = None
        self._state = self._round = self.workspace = self.metainfo = None
        state["refcount"] -= 1
        if state["refcount"] == 0:
            self._WORKSPACES.pop(state["key"], None)
            state.clear()


def create_communication_for(cls: type[NVLinkOneSidedAlltoAll]) -> Any:
    """``create_communication`` over a registry holding ``cls`` as "nvlink_one_sided"."""

    def create_communication(bootstrap: BootstrapConfig, params: MoEEpCommParams, backend: Any, **options: Any) -> Any:
        name = getattr(backend, "backend_name", backend)
        if not isinstance(name, str):
            raise TypeError(f"backend must be a string or have a .backend_name str attr; got {backend!r}")
        if name != cls.backend_name:
            raise KeyError(f"unknown communication backend {name!r}; available: ['{cls.backend_name}'] (fake)")
        if not isinstance(backend, str):
            options["config"] = backend
        return cls(bootstrap, params, **options)

    return create_communication


__all__ = ["BootstrapConfig", "KERNELS", "MoEEpCommParams", "MoEEpDispatchResult", "NVLinkOneSidedAlltoAll",
           "NVLinkOneSidedConfig", "OneSidedKernels", "QuantFormat", "create_communication_for"]
