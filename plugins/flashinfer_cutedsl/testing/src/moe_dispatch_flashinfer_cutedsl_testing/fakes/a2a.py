"""The Python layer of ``flashinfer/comm/trtllm_moe_alltoall.py`` for the fakes: ``MoeAlltoAll``'s
class-level workspace cache, its state machine and asserts, the workspace views, and the size
function, over the fake compiled module (``kernels``) and MNNVL memory (``mnnvl``).

``MoeAlltoAll_0_6_0`` / ``_0_6_14`` / ``_0_6_16`` / ``_0_7_1`` carry each release range's exact
signatures (a keyword a release does not take is a TypeError, as there); a version module
subclasses one and gives it its compiled module (``_KERNELS``), its ``MnnvlMemory`` (``_MNNVL``)
and its own ``_WORKSPACE_CACHE``. Written from flashinfer-ai/flashinfer@4230a48 (v0.6.0) ...
flashinfer-python==0.7.2.post1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable, ClassVar

import torch

from moe_dispatch_flashinfer_cutedsl import vendor

from .kernels import MoeA2AKernels


class SfLayout(IntEnum):
    """flashinfer/fp4_quantization.py SfLayout (the combine's ``sf_layout`` default)."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


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
    _MNNVL: ClassVar[Any]
    _WORKSPACE_CACHE: ClassVar[dict[tuple[Any, ...], dict[str, Any]]]
    _METAINFO_INDEX: ClassVar[dict[str, int] | None] = None

    @classmethod
    def _get_workspace(cls, key: tuple[Any, ...], workspace_size_per_rank: int, ep_rank: int, ep_size: int,
                       max_num_tokens: int, mapping: Any, eplb_stats_num_experts: int) -> dict[str, Any]:
        if key in cls._WORKSPACE_CACHE:
            return cls._WORKSPACE_CACHE[key]
        profile = cls._KERNELS.profile
        mnnvl_mem = cls._MNNVL(mapping, workspace_size_per_rank)
        workspace = mnnvl_mem.as_torch_strided_tensor(torch.uint8)
        if profile.eplb:
            metainfo = cls._KERNELS.moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens,
                                                       eplb_stats_num_experts)
        else:
            metainfo = cls._KERNELS.moe_a2a_initialize(workspace, ep_rank, ep_size, max_num_tokens)
        if profile.init_barrier:  # 0.7.1+: no peer publishes before every rank's memset
            cls._MNNVL.allocated_map[mnnvl_mem.ptr].comm.barrier()
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
            dispatch, combine = vendor.default_workspace_bytes_per_token(hidden_size, top_k)
            workspace_size_per_rank = workspace_size_per_rank_of(self._KERNELS, mapping.moe_ep_size, max_num_tokens,
                                                                 dispatch, combine, eplb_stats_num_experts)
        self._MNNVL.initialize()
        if mnnvl_config:
            self._MNNVL.set_comm_from_config(mapping, mnnvl_config)
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
        if profile.unmapped_check and not self.mnnvl_mem.mapped:
            raise RuntimeError("MNNVL handles are unmapped")
        assert self._state.phase == "idle", "dispatch called twice without combine"
        assert runtime_max_tokens_per_rank <= self.max_num_tokens, "runtime_max_tokens_per_rank exceeds max_num_tokens"
        if eplb_local_stats is not None:
            assert self.enable_eplb, ("eplb_local_stats provided but instance was constructed with "
                                      "eplb_stats_num_experts=0")
        if active_rank_mask is not None and not self.enable_rank_mask:
            raise ValueError("active_rank_mask requires the instance to have been constructed with "
                             "enable_rank_mask=True")
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
        if profile.unmapped_check and not self.mnnvl_mem.mapped:
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


# -- the signatures of each release range ----------------------------------------------------------


class MoeAlltoAll_0_6_0(MoeAlltoAllBase):  # noqa: N801 - v0.6.0-v0.6.13
    @classmethod
    def get_workspace(cls, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping) -> dict:
        key = (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens)
        return cls._get_workspace(key, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping, 0)

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None) -> None:
        self._init(mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank, hidden_size, mnnvl_config)

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None) -> list[torch.Tensor]:
        return self._dispatch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                              invalid_token_expert_id, expert_id_payload_index)

    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False) -> torch.Tensor:
        return self._combine(payload, runtime_max_tokens_per_rank, payload_in_workspace)


class MoeAlltoAll_0_6_14(MoeAlltoAll_0_6_0):  # noqa: N801 - v0.6.14-v0.6.15: combine's quant arguments
    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False, output_dtype=None,
                output_scales=None, output_scalar_scale=1.0, sf_layout=SfLayout.layout_linear) -> torch.Tensor:
        return self._combine(payload, runtime_max_tokens_per_rank, payload_in_workspace, output_dtype, output_scales,
                             output_scalar_scale, sf_layout)


class MoeAlltoAll_0_6_16(MoeAlltoAllBase):  # noqa: N801 - v0.6.16-v0.7.0: EPLB, rank mask, output=
    @classmethod
    def get_workspace(cls, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                      eplb_stats_num_experts=0) -> dict:
        key = (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts)
        return cls._get_workspace(key, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                                  eplb_stats_num_experts)

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0, enable_rank_mask=False) -> None:
        self._init(mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank, hidden_size, mnnvl_config,
                   eplb_stats_num_experts, enable_rank_mask)

    def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                 invalid_token_expert_id=None, expert_id_payload_index=None, eplb_local_stats=None,
                 active_rank_mask=None) -> list[torch.Tensor]:
        return self._dispatch(token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                              invalid_token_expert_id, expert_id_payload_index, eplb_local_stats, active_rank_mask)

    def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False, output_dtype=None,
                output_scales=None, output_scalar_scale=1.0, sf_layout=SfLayout.layout_linear, output=None, *,
                use_low_precision=False, active_rank_mask=None) -> torch.Tensor:
        return self._combine(payload, runtime_max_tokens_per_rank, payload_in_workspace, output_dtype, output_scales,
                             output_scalar_scale, sf_layout, output, use_low_precision, active_rank_mask)


class MoeAlltoAll_0_7_1(MoeAlltoAll_0_6_16):  # noqa: N801 - 0.7.1+: backend=, six-field key; deprecated 0.7.2
    @classmethod
    def get_workspace(cls, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                      eplb_stats_num_experts=0, *, backend="trtllm") -> dict:
        key = (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, backend)
        return cls._get_workspace(key, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                                  eplb_stats_num_experts)

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0, enable_rank_mask=False, *,
                 backend="trtllm") -> None:
        if self._KERNELS.profile.deprecated:
            warnings.warn(f"{vendor.A2A_DEPRECATION} (CakeAlltoAll for backend='cake'). Its implementation will move "
                          "into those classes.", DeprecationWarning, stacklevel=2)
        self._init(mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank, hidden_size, mnnvl_config,
                   eplb_stats_num_experts, enable_rank_mask, backend)


def size_function(kernels: MoeA2AKernels) -> Callable[..., int]:
    """``moe_a2a_get_workspace_size_per_rank`` of ``kernels``' version, with its signature."""
    p = kernels.profile
    if p.backend_kw:
        def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                                combine_payload_size_per_token, eplb_stats_num_experts=0, *,
                                                backend="trtllm") -> int:
            return workspace_size_per_rank(kernels, ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                           combine_payload_size_per_token, eplb_stats_num_experts)
    elif p.eplb:
        def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                                combine_payload_size_per_token, eplb_stats_num_experts=0) -> int:
            return workspace_size_per_rank(kernels, ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                           combine_payload_size_per_token, eplb_stats_num_experts)
    else:
        def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                                combine_payload_size_per_token) -> int:
            return workspace_size_per_rank(kernels, ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                           combine_payload_size_per_token)
    return moe_a2a_get_workspace_size_per_rank


__all__ = ["MoeAlltoAllBase", "MoeAlltoAll_0_6_0", "MoeAlltoAll_0_6_14", "MoeAlltoAll_0_6_16", "MoeAlltoAll_0_7_1",
           "SfLayout", "size_function", "wrap_payload_tensor_in_workspace", "workspace_size_per_rank"]
