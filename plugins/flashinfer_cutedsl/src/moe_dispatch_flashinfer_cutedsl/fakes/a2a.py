"""The Python layer of ``flashinfer/comm/trtllm_moe_alltoall.py`` for the fakes: ``MoeAlltoAll``'s
class-level workspace cache, its state machine and asserts, the workspace views, and the size
function, over the fake compiled module (``kernels``) and MNNVL memory (``mnnvl``).

The version modules subclass ``MoeAlltoAllBase`` with each release's exact signatures (a keyword a
release does not take is a TypeError, as there) and give it its own ``_WORKSPACE_CACHE``.
Written from flashinfer-ai/flashinfer@4230a48 (v0.6.0) ... flashinfer-python==0.7.2.post1.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import vendor
from .kernels import MoeA2AKernels
from .mnnvl import MnnvlMemory

#: Read by the kernels once per process (function-statics in envUtils.cpp); performance only.
_STATIC_ENV: dict[str, str | None] = {}


def _read_static_env(profile: vendor.A2AProfile) -> None:
    names = [vendor.ENV_DISPATCH_BLOCK_SIZE, vendor.ENV_COMBINE_BLOCK_SIZE]
    if profile.reads_one_block_per_token:
        names.append(vendor.ENV_ONE_BLOCK_PER_TOKEN)
    for name in names:
        _STATIC_ENV.setdefault(name, os.environ.get(name))


def wrap_payload_tensor_in_workspace(workspace: torch.Tensor, leading_shape: list[int], slice_start: int,
                                     slice_end: int, dtype: torch.dtype) -> torch.Tensor:
    """``moe_a2a_wrap_payload_tensor_in_workspace``: absolute byte offsets into the workspace."""
    if workspace.ndim == 1:
        workspace = workspace.unsqueeze(0)
    base = workspace.view(dtype=torch.uint8)
    assert workspace.ndim == 2, "workspace must be shape [ep_size, size_per_rank]"
    assert slice_end - slice_start <= base.shape[1], "slice_end - slice_start must belong to a single rank"
    slice_rank = slice_start // base.stride(0)
    local_start = slice_start % base.stride(0)
    local_end = local_start + (slice_end - slice_start)
    assert local_end <= base.shape[1], "slice must fall within the workspace size per rank"
    return base[slice_rank, local_start:local_end].view(dtype=dtype).view(*leading_shape, -1)


def workspace_size_per_rank(kernels: MoeA2AKernels, ep_size: int, max_num_tokens: int,
                            total_dispatch_payload_size_per_token: int, combine_payload_size_per_token: int,
                            eplb_stats_num_experts: int = 0) -> int:
    """``moe_a2a_get_workspace_size_per_rank``: the aux size from the compiled module, padded."""
    aux = kernels.moe_a2a_get_aux_data_size(ep_size, max_num_tokens, eplb_stats_num_experts)
    return (vendor.pad128(aux) + vendor.pad128(ep_size * max_num_tokens * total_dispatch_payload_size_per_token)
            + vendor.pad128(ep_size * max_num_tokens * combine_payload_size_per_token))


@dataclass
class _A2AState:
    phase: str = "idle"  # idle | dispatched
    local_num_tokens: int | None = None
    combine_payload_offset: int | None = None
    eplb_gathered_stats: torch.Tensor | None = None


class MoeAlltoAllBase:
    """Shared body; subclasses set ``_KERNELS`` and their own ``_WORKSPACE_CACHE`` dict."""

    _KERNELS: ClassVar[MoeA2AKernels]
    _WORKSPACE_CACHE: ClassVar[dict[tuple[Any, ...], dict[str, Any]]]
    _METAINFO_INDEX: ClassVar[dict[str, int] | None] = None

    @classmethod
    def _get_workspace(cls, key: tuple[Any, ...], workspace_size_per_rank: int, ep_rank: int, ep_size: int,
                       max_num_tokens: int, mapping: Any, eplb_stats_num_experts: int) -> dict[str, Any]:
        if key in cls._WORKSPACE_CACHE:
            return cls._WORKSPACE_CACHE[key]
        profile = cls._KERNELS.profile
        mnnvl_mem = MnnvlMemory(mapping, workspace_size_per_rank)
        workspace = mnnvl_mem.as_torch_strided_tensor(torch.uint8)
        if profile.eplb:
            metainfo = cls._KERNELS.moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens,
                                                       eplb_stats_num_experts)
        else:
            metainfo = cls._KERNELS.moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens)
        if profile.init_barrier:
            MnnvlMemory.allocated_map[mnnvl_mem.ptr].comm.barrier()
        cls._WORKSPACE_CACHE[key] = {
            "workspace_size_per_rank": workspace_size_per_rank, "max_num_tokens": max_num_tokens,
            "ep_rank": ep_rank, "ep_size": ep_size, "eplb_stats_num_experts": eplb_stats_num_experts,
            "mnnvl_mem": mnnvl_mem, "workspace": workspace, "metainfo": metainfo,
        }
        return cls._WORKSPACE_CACHE[key]

    @classmethod
    def _init_constants(cls) -> None:
        if cls._METAINFO_INDEX is None:
            names, values = cls._KERNELS.moe_a2a_get_metainfo_index_pairs()
            cls._METAINFO_INDEX = {n.replace("MOE_A2A_", "") if n.startswith("MOE_A2A_") else n: int(v)
                                   for n, v in zip(names, values, strict=True)}

    def _init(self, mapping: Any, max_num_tokens: int, top_k: int, num_experts: int,
              workspace_size_per_rank: int | None, hidden_size: int | None, mnnvl_config: Any,
              eplb_stats_num_experts: int = 0, enable_rank_mask: bool = False,
              backend: str = vendor.A2A_DEFAULT_BACKEND) -> None:
        profile = self._KERNELS.profile
        if profile.backend_kw:
            if backend not in (vendor.A2A_DEFAULT_BACKEND, "cake"):
                raise ValueError(f"Unknown MoE all-to-all backend {backend!r}; expected 'trtllm' or 'cake'")
            if backend != vendor.A2A_DEFAULT_BACKEND:
                raise ValueError('backend="cake" requires compute capability 10.0 or 10.3 (fake: no GPU)')
        self._backend = backend
        self._init_constants()
        self.eplb_stats_num_experts = eplb_stats_num_experts
        self.enable_eplb = eplb_stats_num_experts > 0
        self.enable_rank_mask = enable_rank_mask
        if workspace_size_per_rank is None:
            assert hidden_size is not None, "hidden_size must be provided if workspace_size_per_rank is not provided"
            per_token = 2 * hidden_size + 8 * top_k
            workspace_size_per_rank = workspace_size_per_rank_of(self._KERNELS, mapping.moe_ep_size, max_num_tokens,
                                                                 per_token, 2 * hidden_size, eplb_stats_num_experts)
        MnnvlMemory.initialize()
        if mnnvl_config:
            MnnvlMemory.set_comm_from_config(mapping, mnnvl_config)
        self.workspace_size_per_rank = workspace_size_per_rank
        self.max_num_tokens = max_num_tokens
        self.ep_size = mapping.moe_ep_size
        self.ep_rank = mapping.moe_ep_rank
        self.top_k = top_k
        self.num_experts = num_experts
        if not isinstance(self.top_k, int) or self.top_k <= 0:
            raise ValueError("top_k must be a positive int")
        if not isinstance(self.num_experts, int) or self.num_experts <= 0:
            raise ValueError("num_experts must be a positive int")
        values = {"workspace_size_per_rank": workspace_size_per_rank, "ep_rank": self.ep_rank,
                  "ep_size": self.ep_size, "max_num_tokens": max_num_tokens,
                  "eplb_stats_num_experts": eplb_stats_num_experts, "backend": backend}
        key = tuple(values[f] for f in profile.cache_key)
        self._WORKSPACE = self._get_workspace(key, workspace_size_per_rank, self.ep_rank, self.ep_size,
                                              max_num_tokens, mapping, eplb_stats_num_experts)
        assert self._WORKSPACE["workspace_size_per_rank"] == workspace_size_per_rank, "Workspace size mismatch"
        assert self._WORKSPACE["max_num_tokens"] == self.max_num_tokens, "Max tokens mismatch"
        assert self._WORKSPACE["ep_rank"] == self.ep_rank, "EP rank mismatch"
        assert self._WORKSPACE["ep_size"] == self.ep_size, "EP size mismatch"
        self.mnnvl_mem = self._WORKSPACE["mnnvl_mem"]
        self.workspace = self._WORKSPACE["workspace"]
        self.metainfo = self._WORKSPACE["metainfo"]
        self._state = _A2AState()

    def _dispatch(self, token_selected_experts: torch.Tensor, input_payloads: list[torch.Tensor],
                  runtime_max_tokens_per_rank: int, invalid_token_expert_id: int | None,
                  expert_id_payload_index: int | None, eplb_local_stats: torch.Tensor | None = None,
                  active_rank_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        profile = self._KERNELS.profile
        if profile.init_barrier and not self.mnnvl_mem.mapped:
            raise RuntimeError("MNNVL handles are unmapped")
        assert self._state.phase == "idle", "dispatch called twice without combine"
        assert runtime_max_tokens_per_rank <= self.max_num_tokens, "runtime_max_tokens_per_rank exceeds max_num_tokens"
        if eplb_local_stats is not None:
            assert self.enable_eplb, ("eplb_local_stats provided but instance was constructed with "
                                      "eplb_stats_num_experts=0")
        if active_rank_mask is not None and not self.enable_rank_mask:
            raise ValueError("active_rank_mask requires the instance to have been constructed with "
                             "enable_rank_mask=True")
        _read_static_env(profile)
        k = self._KERNELS
        if profile.eplb:
            got = k.moe_a2a_dispatch(token_selected_experts, input_payloads, self.workspace, self.metainfo,
                                     runtime_max_tokens_per_rank, self.ep_rank, self.ep_size, self.top_k,
                                     self.num_experts, False, eplb_local_stats, self.enable_rank_mask,
                                     active_rank_mask)
        else:
            got = k.moe_a2a_dispatch(token_selected_experts, input_payloads, self.workspace, self.metainfo,
                                     runtime_max_tokens_per_rank, self.ep_rank, self.ep_size, self.top_k,
                                     self.num_experts)
        recv_offsets, recv_sizes, combine_payload_offset = got[:3]
        recv = [wrap_payload_tensor_in_workspace(self.workspace, [self.ep_size, runtime_max_tokens_per_rank],
                                                 off, off + size, pay.dtype)
                for pay, off, size in zip(input_payloads, recv_offsets, recv_sizes, strict=True)]
        self._state.local_num_tokens = token_selected_experts.size(0)
        self._state.combine_payload_offset = combine_payload_offset
        self._state.phase = "dispatched"
        if invalid_token_expert_id is not None:
            assert expert_id_payload_index is not None, (
                "expert_id_payload_index required when invalid_token_expert_id is set")
            if profile.eplb:
                k.moe_a2a_sanitize_expert_ids(recv[expert_id_payload_index], self.workspace, self.metainfo,
                                              self.ep_rank, invalid_token_expert_id, False)
            else:
                k.moe_a2a_sanitize_expert_ids(recv[expert_id_payload_index], self.workspace, self.metainfo,
                                              self.ep_rank, invalid_token_expert_id)
        return recv

    def _combine(self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, payload_in_workspace: bool,
                 output_dtype: torch.dtype | None = None, output_scales: torch.Tensor | None = None,
                 output_scalar_scale: float = 1.0, sf_layout: Any = 2, output: torch.Tensor | None = None,
                 use_low_precision: bool = False, active_rank_mask: torch.Tensor | None = None) -> torch.Tensor:
        profile = self._KERNELS.profile
        if profile.init_barrier and not self.mnnvl_mem.mapped:
            raise RuntimeError("MNNVL handles are unmapped")
        assert self._state.phase == "dispatched", "combine called before successful dispatch"
        assert runtime_max_tokens_per_rank <= self.max_num_tokens, "runtime_max_tokens_per_rank exceeds max_num_tokens"
        if active_rank_mask is not None and not self.enable_rank_mask:
            raise ValueError("active_rank_mask requires the instance to have been constructed with "
                             "enable_rank_mask=True")
        if output is not None:
            if not output.is_contiguous():
                raise ValueError(f"output must be contiguous, got stride={output.stride()}")
        layout = int(getattr(sf_layout, "value", sf_layout))
        k = self._KERNELS
        args = (payload, self._state.local_num_tokens, self.workspace, self.metainfo, runtime_max_tokens_per_rank,
                self.ep_rank, self.ep_size, self.top_k, self._state.combine_payload_offset, payload_in_workspace)
        if not profile.combine_quant:
            out = k.moe_a2a_combine(*args)
        elif not profile.eplb:
            out = k.moe_a2a_combine(*args, output_dtype, output_scales, output_scalar_scale, layout)
        elif output is None:
            out = k.moe_a2a_combine(*args, output_dtype, output_scales, output_scalar_scale, layout, use_low_precision,
                                    False, self.enable_rank_mask, active_rank_mask)
        else:
            k.moe_a2a_combine_into(*args, output_dtype, output_scales, output_scalar_scale, layout, use_low_precision,
                                   False, self.enable_rank_mask, active_rank_mask, output)
            out = output
        self._state = _A2AState()
        return out

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank: int, hidden_size: int,
                                                dtype: torch.dtype) -> torch.Tensor:
        if self._state.phase != "dispatched":
            raise RuntimeError("get_combine_payload_tensor_in_workspace called before successful dispatch")
        element_size = torch.tensor([], dtype=dtype).element_size()
        start = self._state.combine_payload_offset
        assert start is not None
        return wrap_payload_tensor_in_workspace(
            self.workspace[self.ep_rank, :], [self.ep_size, runtime_max_tokens_per_rank], start,
            start + self.ep_size * runtime_max_tokens_per_rank * hidden_size * element_size, dtype)


def workspace_size_per_rank_of(kernels: MoeA2AKernels, ep_size: int, max_num_tokens: int, dispatch: int,
                               combine: int, eplb_stats_num_experts: int = 0) -> int:
    return workspace_size_per_rank(kernels, ep_size, max_num_tokens, dispatch, combine, eplb_stats_num_experts)


__all__ = ["MoeAlltoAllBase", "wrap_payload_tensor_in_workspace", "workspace_size_per_rank"]
