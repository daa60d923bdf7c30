"""The compiled MoE all-to-all module (what ``get_moe_alltoall_module()`` returns), on CPU.

Written from csrc/trtllm_moe_alltoall.cu (the host ops and their checks) and
moeAlltoAllKernels.cu (what the kernels do) of the version the profile names (see ``vendor``):

- ``moe_a2a_initialize`` zeroes this rank's row and returns the metainfo offsets (int64, CPU).
- ``moe_a2a_dispatch``: prepare (send counters 0, local token counter 0, ``flag_val += 1``);
  per token, per top-k slot, target rank = expert id / experts per rank in C integer division
  (truncation: id -1 goes to rank 0, or to rank -1 with one expert per rank: an out-of-bounds
  store; ids >= num_experts go past the last rank), the first slot per target rank sends and the
  others are duplicates (-1 in ``topk_target_ranks`` / ``topk_send_indices``); each payload row is
  stored at the target's ``[source rank, slot]`` with the vector width of the version (until
  0.7.0 chosen from the row size alone: a plane or source row not aligned to it is a "misaligned
  address" fault); the target's ``recv_counters[source]`` and completion flag are set by the rank's
  "last token", then every peer's flag must equal ours (a trap otherwise). Until v0.6.13 the
  threading policy is read once per process (``TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN``, with the block
  size): the warp policy counts blocks, so with more than one token per block nothing is
  published. All routing state lives in the workspace row, so two MoeAlltoAll instances sharing
  one workspace overwrite each other exactly as on the GPU. Slots are numbered in token order (the
  GPU's atomics give any order).
- ``moe_a2a_sanitize_expert_ids``: ids of slots at or past ``recv_counters[source]`` become the
  invalid id; other slots keep what is in the workspace (stale rows are not cleared).
- ``moe_a2a_combine``: prepare (``flag_val += 1``; the payload's valid slots, those below
  ``recv_counters``, staged into this rank's combine region unless ``payload_in_workspace``);
  completion flags to and from every peer; each of this rank's tokens sums the rows its
  non-duplicate slots were sent to, read from the peers' combine regions, in the kernel's pairwise
  tree: in the payload dtype until v0.6.15, in fp32 from v0.6.16; cast to the output dtype.

Stores into a peer's row and loads from it travel through the allocation's communicator
(``mnnvl.Segment.exchange``): one collective per kernel, in place of NVLink.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from moe_dispatch.backend import as_bytes, from_bytes
from moe_dispatch_flashinfer_cutedsl import vendor

from . import tvm
from .mnnvl import Segment, segment_of

_I32 = 4


def _i32(row: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    return row[offset : offset + n * _I32].view(torch.int32)


def _word(value: int) -> torch.Tensor:
    return as_bytes(torch.tensor([[value]], dtype=torch.int32)).reshape(-1)


def _target_ranks(ids: torch.Tensor, num_experts: int, ep_size: int, uneven: bool) -> torch.Tensor:
    """compute_target_rank_id in C integer division (truncation toward zero)."""
    base = num_experts // ep_size
    rem = num_experts - base * ep_size if uneven else 0
    if rem == 0:
        return torch.div(ids, base, rounding_mode="trunc")
    split = rem * (base + 1)
    low = torch.div(ids, base + 1, rounding_mode="trunc")
    high = rem + torch.div(ids - split, base, rounding_mode="trunc")
    return torch.where(ids < split, low, high)


class MoeA2AKernels:
    """The JIT module of one FlashInfer version (``vendor.A2AProfile``)."""

    def __init__(self, profile: vendor.A2AProfile) -> None:
        self.profile = profile
        self.calls: list[str] = []
        self._statics: dict[str, str | None] | None = None

    def _function_statics(self) -> dict[str, str | None]:
        """envUtils.cpp's function-statics: the environment at this module's first dispatch."""
        if self._statics is None:
            names = [vendor.ENV_DISPATCH_BLOCK_SIZE, vendor.ENV_COMBINE_BLOCK_SIZE]
            if self.profile.reads_one_block_per_token:
                names.append(vendor.ENV_ONE_BLOCK_PER_TOKEN)
            self._statics = {name: os.environ.get(name) for name in names}
        return self._statics

    def reset_function_statics(self) -> None:
        """Fake-only (tests): forget what the first dispatch read, as a new process would."""
        self._statics = None

    def _publishes(self, local: int) -> bool:
        """Whether the dispatch kernel's "last token" writes the counters and flags: always with
        one block per token; with the warp policy only if its counter (one count per block's first
        warp) reaches the token count (moeAlltoAllKernels.cu, v0.6.0-v0.6.13)."""
        statics = self._function_statics()
        try:
            one_block = vendor.one_block_per_token(statics, self.profile.version)
            block = vendor.sanitize_block_size(statics[vendor.ENV_DISPATCH_BLOCK_SIZE])
        except ValueError as exc:  # std::stoi throws: a C++ exception through tvm-ffi
            raise RuntimeError(str(exc)) from None
        if one_block is None or one_block or local == 0:
            return True
        warps_per_block = block // vendor.WARP_SIZE
        return -(-local // warps_per_block) == local

    # -- constants -------------------------------------------------------------------------------

    def moe_a2a_get_metainfo_index_pairs(self) -> tuple[list[str], list[int]]:
        names = [f"MOE_A2A_{n}_OFFSET_INDEX" for n in self.profile.metainfo_names]
        values = list(range(len(names)))
        return names + ["MOE_A2A_NUM_METAINFO_FIELDS"], values + [len(names)]

    def moe_a2a_get_aux_data_size(self, ep_size: int, max_num_tokens: int, eplb_stats_num_experts: int = 0) -> int:
        fn = "moe_a2a_get_aux_data_size"
        tvm.integer(fn, "ep_size", ep_size)
        tvm.integer(fn, "max_num_tokens", max_num_tokens)
        return vendor.aux_data_size(ep_size, max_num_tokens, self.profile.version, eplb_stats_num_experts)

    def _offsets(self, metainfo: torch.Tensor) -> dict[str, int]:
        tvm.check_cpu("metainfo", metainfo)
        tvm.check_type("metainfo", metainfo, torch.int64)
        tvm.icheck(metainfo.dim() == 1, "metainfo.ndim() == 1")
        tvm.icheck(metainfo.numel() == len(self.profile.metainfo_names),
                   "metainfo.size(0) == fi_throughput::NUM_METAINFO_FIELDS")
        return dict(zip(self.profile.metainfo_names, (int(v) for v in metainfo.tolist())))

    def _segment(self, workspace: torch.Tensor) -> Segment:
        seg = segment_of(workspace)
        if seg is None:
            tvm.device_fault("the workspace is not MNNVL memory: the kernels store into peers' rows of it")
        assert seg is not None
        return seg

    # -- initialize --------------------------------------------------------------------------------

    def moe_a2a_initialize(self, workspace: torch.Tensor, ep_rank: int, ep_size: int, max_num_tokens: int,
                           eplb_stats_num_experts: int = 0) -> torch.Tensor:
        fn = "moe_a2a_initialize"
        tvm.tensor(fn, "workspace", workspace)
        for name, value in (("ep_rank", ep_rank), ("ep_size", ep_size), ("max_num_tokens", max_num_tokens)):
            tvm.integer(fn, name, value)
        tvm.check_type("workspace", workspace, torch.uint8)
        tvm.icheck(workspace.dim() == 2, "workspace.ndim() == 2", "workspace must be a 2D tensor")
        tvm.icheck(workspace.shape[0] == ep_size, "workspace.size(0) == epSize",
                   f"workspace first dim must equal ep_size ({workspace.shape[0]} vs. {ep_size})")
        tvm.icheck(0 <= ep_rank < ep_size, "epRank >= 0 && epRank < epSize", "epRank out of range")
        workspace[ep_rank].zero_()
        if self.profile.eplb:
            tvm.icheck(eplb_stats_num_experts >= 0, "eplbStatsNumExperts >= 0",
                       "eplb_stats_num_experts must be non-negative")
        off = vendor.metainfo_offsets(ep_size, max_num_tokens, self.profile.version, eplb_stats_num_experts)
        self.calls.append(fn)
        return torch.tensor([off[n] for n in self.profile.metainfo_names], dtype=torch.int64)

    # -- dispatch ------------------------------------------------------------------------------------

    def moe_a2a_dispatch(self, token_selected_experts: torch.Tensor, input_payloads: list[torch.Tensor],
                         workspace: torch.Tensor, metainfo: torch.Tensor, runtime_max_tokens_per_rank: int,
                         ep_rank: int, ep_size: int, top_k: int, num_experts: int, enable_pdl: bool = False,
                         eplb_local_stats: torch.Tensor | None = None, enable_rank_mask: bool = False,
                         active_rank_mask: torch.Tensor | None = None) -> tuple[Any, ...]:
        p, fn = self.profile, "moe_a2a_dispatch"
        tvm.tensor(fn, "token_selected_experts", token_selected_experts)
        if not isinstance(input_payloads, (list, tuple)) or not all(isinstance(x, torch.Tensor)
                                                                     for x in input_payloads):
            raise TypeError(f"Mismatched type on argument `input_payloads` when calling: `{fn}`: "
                            "expected Array<Tensor>")
        for name, value in (("runtime_max_tokens_per_rank", runtime_max_tokens_per_rank), ("ep_rank", ep_rank),
                            ("ep_size", ep_size), ("top_k", top_k), ("num_experts", num_experts)):
            tvm.integer(fn, name, value)
        tse = token_selected_experts
        tvm.check_input("tokenSelectedExperts", tse)
        tvm.check_type("tokenSelectedExperts", tse, torch.int32)
        tvm.icheck(tse.dim() == 2, "tokenSelectedExperts.ndim() == 2", "token_selected_experts must be 2D")
        tvm.icheck(tse.shape[1] == top_k, "tokenSelectedExperts.size(1) == topK",
                   "token_selected_experts shape mismatch")
        n_pay = len(input_payloads)
        tvm.icheck(n_pay > 0, "numPayloads > 0", "At least one payload is required")
        tvm.icheck(n_pay <= p.max_payloads, "numPayloads <= tl_throughput::kMaxPayloads",
                   f"Too many payloads: {n_pay} > {p.max_payloads}")
        local = tse.shape[0]
        for i, pay in enumerate(input_payloads):
            tvm.check_input("payload", pay)
            tvm.icheck(pay.dim() == 2, "payload.ndim() == 2", f"payload {i} must be 2D")
            tvm.icheck(pay.shape[0] == local, "payload.size(0) == localNumTokens",
                       f"payload {i} first dimension must match local_num_tokens")
        off = self._offsets(metainfo)
        tvm.check_type("workspace", workspace, torch.uint8)
        tvm.icheck(workspace.dim() == 2, "workspace.ndim() == 2")
        tvm.icheck(workspace.shape[0] == ep_size, "workspace.size(0) == epSize")
        if p.eplb:
            tvm.icheck(0 < ep_size <= p.max_ranks, "epSize > 0 && epSize <= tl_throughput::kMaxRanks",
                       f"epSize must be in the range (0, {p.max_ranks}]")
        tvm.icheck(0 <= ep_rank < ep_size, "epRank >= 0 && epRank < epSize")
        tvm.icheck(runtime_max_tokens_per_rank > 0, "runtimeMaxTokensPerRank > 0")
        if p.uneven_experts:
            tvm.icheck(num_experts >= ep_size, "numExperts >= epSize", "num_experts must be >= ep_size")
        else:
            tvm.icheck(num_experts >= ep_size and num_experts % ep_size == 0,
                       "numExperts >= epSize && numExperts % epSize == 0", "num_experts must be divisible by ep_size")
        tvm.icheck(0 < top_k <= p.max_top_k, "topK > 0 && topK <= tl_throughput::kMaxTopK")
        if eplb_local_stats is not None:
            tvm.icheck(p.eplb, "eplb supported")  # older versions have no such argument at all
        T, R = runtime_max_tokens_per_rank, ep_size
        sizes, total = [], 0
        for i, pay in enumerate(input_payloads):
            nbytes = R * T * pay.shape[1] * pay.element_size()
            sizes.append(nbytes)
            total += nbytes
            tvm.icheck(total % pay.element_size() == 0, "totalBytesNeeded % elementSize == 0",
                       f"Misaligned payload buffer {i} with element size {pay.element_size()}. Consider reordering "
                       "payloads by largest to smallest element size")
        required = off["PAYLOAD_DATA"] + total
        tvm.icheck(workspace.shape[1] >= required, "sizePerRank >= requiredSize",
                   f"workspace size per rank insufficient, need {required} bytes but has {workspace.shape[1]}")
        if p.eplb and not enable_rank_mask:
            tvm.icheck(active_rank_mask is None, "!hasActiveRankMask(activeRankMask)",
                       "active_rank_mask requires enable_rank_mask=True")
        if enable_rank_mask or active_rank_mask is not None:
            raise NotImplementedError("fake: the rank-mask kernel variant is not emulated")
        # The launcher's host checks.
        tvm.launch_check(0 < ep_size <= p.max_ranks,
                         "TLLM_CHECK failed: params.ep_size > 0 && params.ep_size <= kMaxRanks")
        tvm.launch_check(top_k in p.top_k_values, "Unsupported top_k")
        publishes = self._publishes(local)
        seg = self._segment(workspace)
        row = workspace[ep_rank]
        stride = workspace.stride(0)
        payload_offsets = [off["PAYLOAD_DATA"] + sum(sizes[:i]) for i in range(n_pay)]
        if not p.plane_alignment_fixed:  # vectorized_dispatch: the width from the row size alone
            for i, (pay, base) in enumerate(zip(input_payloads, payload_offsets)):
                width = vendor.dispatch_vector_width(pay.shape[1] * pay.element_size())
                if base % width or pay.data_ptr() % width:
                    tvm.device_fault(f"moe_a2a_dispatch: payload {i} stored {width} bytes at a time into a receive "
                                     f"plane at byte {base} of the rank's workspace, from a source at "
                                     f"{pay.data_ptr():#x}", "misaligned address")

        # prepare_dispatch
        _i32(row, off["SEND_COUNTERS"], R).zero_()
        _i32(row, off["LOCAL_TOKEN_COUNTER"], 1).zero_()
        flag = _i32(row, off["FLAG_VAL"], 1)
        flag += 1
        flag_val = int(flag.item())

        ids = tse.long()
        targets = _target_ranks(ids, num_experts, R, p.uneven_experts)
        bad = (targets < 0) | (targets >= R)
        if bool(bad.any()):
            t, k = (int(v) for v in bad.nonzero()[0])
            tvm.device_fault(f"moe_a2a_dispatch: expert id {int(ids[t, k])} (token {t}, slot {k}) maps to target "
                             f"rank {int(targets[t, k])}; send_counters[{int(targets[t, k])}] is outside [0, {R})")
        # First slot per (token, target rank) sends; the rest are duplicates.
        first = torch.ones_like(targets, dtype=torch.bool)
        for k in range(1, top_k):
            first[:, k] = ~(targets[:, :k] == targets[:, k : k + 1]).any(dim=1)
        tok, slot = first.nonzero(as_tuple=True)  # token-major: slots numbered in token order
        dest = targets[tok, slot]
        onehot = torch.nn.functional.one_hot(dest, R)
        send_idx = torch.full_like(targets, -1)
        send_idx[tok, slot] = (onehot.cumsum(0) - 1).gather(1, dest.unsqueeze(1)).squeeze(1)
        counts = onehot.sum(0) if dest.numel() else torch.zeros(R, dtype=torch.int64)
        _i32(row, off["TOPK_TARGET_RANKS"], local * top_k).copy_(torch.where(first, targets, -1).flatten().int())
        _i32(row, off["TOPK_SEND_INDICES"], local * top_k).copy_(send_idx.flatten().int())
        _i32(row, off["SEND_COUNTERS"], R).copy_(counts.int())
        _i32(row, off["LOCAL_TOKEN_COUNTER"], 1).fill_(local)

        # Stores into every target's row: the payload rows, then (by the rank's last token)
        # recv_counters[me] and the completion flag.
        outgoing: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for r in range(R):
            sel = tok[dest == r]
            stores = []
            for pay, base in zip(input_payloads, payload_offsets):
                width = pay.shape[1] * pay.element_size()
                stores.append((base + ep_rank * T * width, as_bytes(pay[sel]).reshape(-1)))
            if publishes:
                stores.append((off["RECV_COUNTERS"] + ep_rank * _I32, _word(int(counts[r]))))
                stores.append((off["DISPATCH_COMPLETION_FLAGS"] + ep_rank * _I32, _word(flag_val)))
            if eplb_local_stats is not None:
                n = eplb_local_stats.numel()
                stores.append((off["EPLB_GATHERED_STATS"] + ep_rank * n * _I32,
                               as_bytes(eplb_local_stats.int().reshape(-1, 1)).reshape(-1)))
            outgoing[r] = stores
        for stores in seg.exchange(outgoing):
            for offset, raw in stores:
                row[offset : offset + raw.numel()] = raw
        peers = _i32(row, off["DISPATCH_COMPLETION_FLAGS"], R)
        if publishes and not bool((peers == flag_val).all()):
            tvm.device_fault(f"dispatch: rank {ep_rank} timed out waiting for completion flags {peers.tolist()} "
                             f"to reach {flag_val} (trap)")
        self.calls.append(fn)
        recv_offsets = [ep_rank * stride + o for o in payload_offsets]
        combine_offset = vendor.pad128(payload_offsets[-1] + sizes[-1])
        if not p.eplb:
            return recv_offsets, sizes, combine_offset
        eplb_off = ep_rank * stride + off["EPLB_GATHERED_STATS"] if eplb_local_stats is not None else -1
        eplb_n = 0 if eplb_local_stats is None else eplb_local_stats.numel()
        return recv_offsets, sizes, combine_offset, eplb_off, eplb_n

    # -- sanitize ------------------------------------------------------------------------------------

    def moe_a2a_sanitize_expert_ids(self, expert_ids: torch.Tensor, workspace: torch.Tensor, metainfo: torch.Tensor,
                                    ep_rank: int, invalid_expert_id: int, enable_pdl: bool = False) -> None:
        fn = "moe_a2a_sanitize_expert_ids"
        tvm.tensor(fn, "expert_ids", expert_ids)
        tvm.integer(fn, "ep_rank", ep_rank)
        tvm.integer(fn, "invalid_expert_id", invalid_expert_id)
        tvm.check_input("expertIds", expert_ids)
        tvm.check_type("expertIds", expert_ids, torch.int32)
        tvm.icheck(expert_ids.dim() == 3, "expertIds.ndim() == 3")
        off = self._offsets(metainfo)
        tvm.check_type("workspace", workspace, torch.uint8)
        tvm.icheck(workspace.dim() == 2, "workspace.ndim() == 2")
        R, T, _ = expert_ids.shape
        recv = _i32(workspace[ep_rank], off["RECV_COUNTERS"], R).long()
        stale = torch.arange(T).unsqueeze(0) >= recv.unsqueeze(1)  # [R, T]
        expert_ids[stale] = invalid_expert_id
        self.calls.append(fn)

    # -- combine -------------------------------------------------------------------------------------

    def moe_a2a_combine(self, payload: torch.Tensor, local_num_tokens: int, workspace: torch.Tensor,
                        metainfo: torch.Tensor, runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int,
                        top_k: int, combine_payload_offset: int, payload_in_workspace: bool = False,
                        output_dtype: torch.dtype | None = None, output_scales: torch.Tensor | None = None,
                        output_scalar_scale: float = 1.0, sf_layout: Any = 2, use_low_precision: bool = False,
                        enable_pdl: bool = False, enable_rank_mask: bool = False,
                        active_rank_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._combine(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank,
                             ep_size, top_k, combine_payload_offset, payload_in_workspace, output_dtype, output_scales,
                             use_low_precision, active_rank_mask, None)

    def moe_a2a_combine_into(self, payload: torch.Tensor, local_num_tokens: int, workspace: torch.Tensor,
                             metainfo: torch.Tensor, runtime_max_tokens_per_rank: int, ep_rank: int, ep_size: int,
                             top_k: int, combine_payload_offset: int, payload_in_workspace: bool,
                             output_dtype: torch.dtype | None, output_scales: torch.Tensor | None,
                             output_scalar_scale: float, sf_layout: Any, use_low_precision: bool, enable_pdl: bool,
                             enable_rank_mask: bool, active_rank_mask: torch.Tensor | None,
                             output: torch.Tensor) -> None:
        self._combine(payload, local_num_tokens, workspace, metainfo, runtime_max_tokens_per_rank, ep_rank, ep_size,
                      top_k, combine_payload_offset, payload_in_workspace, output_dtype, output_scales,
                      use_low_precision, active_rank_mask, output)

    def _combine(self, payload: torch.Tensor, local: int, workspace: torch.Tensor, metainfo: torch.Tensor, T: int,
                 ep_rank: int, ep_size: int, top_k: int, combine_offset: int, in_workspace: bool,
                 output_dtype: torch.dtype | None, output_scales: torch.Tensor | None, low_precision: bool,
                 active_rank_mask: torch.Tensor | None, output: torch.Tensor | None) -> torch.Tensor:
        p, fn = self.profile, "moe_a2a_combine"
        tvm.tensor(fn, "payload", payload)
        for name, value in (("local_num_tokens", local), ("runtime_max_tokens_per_rank", T), ("ep_rank", ep_rank),
                            ("ep_size", ep_size), ("top_k", top_k), ("combine_payload_offset", combine_offset)):
            tvm.integer(fn, name, value)
        tvm.check_input("payload", payload)
        tvm.icheck(payload.dim() == 3, "payload.ndim() == 3",
                   "payload must be [ep_size, runtime_max_tokens_per_rank, hidden]")
        tvm.icheck(payload.shape[0] == ep_size, "payload.size(0) == epSize")
        tvm.icheck(payload.shape[1] == T, "payload.size(1) == runtimeMaxTokensPerRank")
        if p.eplb:
            tvm.icheck(0 < ep_size <= p.max_ranks, "epSize > 0 && epSize <= tl_throughput::kMaxRanks")
        tvm.icheck(0 <= ep_rank < ep_size, "epRank >= 0 && epRank < epSize")
        tvm.icheck(0 < top_k <= p.max_top_k, "topK > 0 && topK <= tl_throughput::kMaxTopK")
        tvm.icheck(local >= 0, "localNumTokens >= 0")
        off = self._offsets(metainfo)
        tvm.check_type("workspace", workspace, torch.uint8)
        tvm.icheck(workspace.dim() == 2, "workspace.ndim() == 2")
        tvm.icheck(workspace.shape[0] == ep_size, "workspace.size(0) == epSize")
        row = workspace[ep_rank]
        nbytes = payload.numel() * payload.element_size()
        tvm.icheck(combine_offset >= 0 and combine_offset + nbytes <= workspace.shape[1],
                   "combinePayloadOffset >= 0 && combinePayloadOffset + payloadBytes <= sizePerRank",
                   "workspace insufficient for combine payload region")
        if in_workspace:
            expected = row.data_ptr() + combine_offset
            tvm.icheck(payload.data_ptr() == expected, "payload.data_ptr() == expectedPtr",
                       "payload_in_workspace is True but tensor pointer mismatch: "
                       f"{payload.data_ptr():#x} != {expected:#x}")
        accepted = vendor.COMBINE_DTYPES + ((torch.float8_e4m3fn,) if p.combine_quant else ())
        if payload.dtype not in accepted:
            raise TypeError("Unsupported dtype for MoE combine")
        out_dtype = output_dtype if output_dtype is not None else (torch.bfloat16 if low_precision else payload.dtype)
        if output_scales is not None or low_precision:
            raise NotImplementedError("fake: quantized / low-precision combine is not emulated")
        if p.combine_quant:
            tvm.icheck(out_dtype == payload.dtype, "output.dtype() == payload.dtype()",
                       "output_dtype without output_scales must match payload dtype")
        if p.eplb:
            tvm.icheck(active_rank_mask is None, "!hasActiveRankMask(activeRankMask)",
                       "active_rank_mask requires enable_rank_mask=True")
        tvm.launch_check(top_k in p.top_k_values, "Unsupported top_k")
        seg = self._segment(workspace)
        H = payload.shape[2]
        width = H * payload.element_size()
        region = row[combine_offset : combine_offset + nbytes].view(ep_size, T, width)
        # prepare_combine: a new round (flag_val + 1); the payload's valid slots (below the
        # source's recv_counter) staged into our combine region; the others keep stale bytes.
        flag = _i32(row, off["FLAG_VAL"], 1)
        flag += 1
        flag_val = int(flag.item())
        if not in_workspace:
            recv = _i32(row, off["RECV_COUNTERS"], ep_size).long()
            valid = torch.arange(T).unsqueeze(0) < recv.unsqueeze(1)  # [R, T]
            staged = as_bytes(payload.reshape(ep_size * T, H)).view(ep_size, T, width)
            region[valid] = staged[valid]
        # Each source rank reads its rows [source, :] of our region; every rank sets its
        # completion flag in each peer's row and waits for theirs.
        outgoing = {s: [(combine_offset, region[s].reshape(-1)),
                        (off["COMBINE_COMPLETION_FLAGS"] + ep_rank * _I32, _word(flag_val))] for s in range(ep_size)}
        incoming = seg.exchange(outgoing)
        regions: dict[int, torch.Tensor] = {}
        for r, stores in enumerate(incoming):
            for their_offset, raw in stores:
                if their_offset == combine_offset:
                    regions[r] = raw.view(T, width)
                elif their_offset == off["COMBINE_COMPLETION_FLAGS"] + r * _I32:
                    row[their_offset : their_offset + _I32] = raw
                else:
                    tvm.device_fault(f"combine: rank {r} stored at byte {their_offset}, outside its combine region "
                                     "and flag")
        peers = _i32(row, off["COMBINE_COMPLETION_FLAGS"], ep_size)
        if not bool((peers == flag_val).all()):
            tvm.device_fault(f"combine: rank {ep_rank} timed out waiting for completion flags {peers.tolist()} "
                             f"to reach {flag_val} (trap)")
        targets = _i32(row, off["TOPK_TARGET_RANKS"], local * top_k).view(local, top_k).long()
        sends = _i32(row, off["TOPK_SEND_INDICES"], local * top_k).view(local, top_k).long()
        acc_dtype = torch.float32 if p.fp32_combine else payload.dtype
        acc = torch.zeros(top_k, local, H, dtype=acc_dtype)  # a duplicate / dead slot adds zero
        for k in range(top_k):
            for r in range(ep_size):
                mine = ((targets[:, k] == r) & (sends[:, k] >= 0)).nonzero().squeeze(1)
                if mine.numel() == 0:
                    continue
                acc[k, mine] = from_bytes(regions[r][sends[mine, k]], payload.dtype).to(acc_dtype)
        for i, j in vendor.combine_reduction_pairs(top_k):  # each add rounds in acc_dtype
            acc[i] = acc[i] + acc[j]
        result = acc[0].to(out_dtype)
        self.calls.append(fn)
        if output is None:
            return result
        tvm.check_input("output", output)
        tvm.icheck(tuple(output.shape) == (local, H) and output.dtype == out_dtype, "output matches",
                   "output dtype must match payload dtype")
        output.copy_(result)
        return output


__all__ = ["MoeA2AKernels"]
