"""Fake of FlashInfer 0.7.2 (flashinfer-python==0.7.2.post1; models 0.7.1-0.7.2).

Differs from 0.6.16-0.7.0: ``backend=`` ("trtllm" | "cake") on MoeAlltoAll and the size function,
a six-field workspace-cache key, ``MoeAlltoAll`` deprecated (DeprecationWarning at construction),
``fp4_quantize(nvfp4_4over6=)``, CuteDslMoEWrapper with SiTU and ``quant_mode``.
"""

from __future__ import annotations

import warnings
from enum import IntEnum
from types import SimpleNamespace
from typing import Any

import torch

from .. import vendor
from . import a2a, mnnvl, nvfp4
from .cute_dsl import CuteDslBase
from .kernels import MoeA2AKernels
from .mapping import Mapping

__version__ = "0.7.2"
VERSION: vendor.Version = (0, 7, 2)
KERNELS = MoeA2AKernels(vendor.profile(VERSION))
_UNSET = nvfp4.UNSET
DEFAULT_SWIGLU_ALPHA = vendor.DEFAULT_SWIGLU_ALPHA
DEFAULT_SWIGLU_BETA = vendor.DEFAULT_SWIGLU_BETA
DEFAULT_SWIGLU_LIMIT = vendor.DEFAULT_SWIGLU_LIMIT


class SfLayout(IntEnum):
    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


class ActivationType(IntEnum):
    Swiglu = vendor.ACTIVATION_SWIGLU


def get_moe_alltoall_module(backend: str = "trtllm") -> MoeA2AKernels:
    return KERNELS


def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token, eplb_stats_num_experts=0, *,
                                        backend="trtllm") -> int:
    return a2a.workspace_size_per_rank(KERNELS, ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                       combine_payload_size_per_token, eplb_stats_num_experts)


class MoeAlltoAll(a2a.MoeAlltoAllBase):
    _KERNELS = KERNELS
    _WORKSPACE_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}

    @classmethod
    def get_workspace(cls, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                      eplb_stats_num_experts=0, *, backend="trtllm") -> dict:
        key = (workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, eplb_stats_num_experts, backend)
        return cls._get_workspace(key, workspace_size_per_rank, ep_rank, ep_size, max_num_tokens, mapping,
                                  eplb_stats_num_experts)

    def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                 hidden_size=None, mnnvl_config=None, eplb_stats_num_experts=0, enable_rank_mask=False, *,
                 backend="trtllm") -> None:
        warnings.warn("MoeAlltoAll is deprecated; use flashinfer.moe_ep.NVLinkOneSidedAlltoAll (CakeAlltoAll for "
                      "backend='cake'). Its implementation will move into those classes.", DeprecationWarning,
                      stacklevel=2)
        self._init(mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank, hidden_size, mnnvl_config,
                   eplb_stats_num_experts, enable_rank_mask, backend)

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


def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                 is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None, backend="cuda",
                 nvfp4_4over6=_UNSET) -> tuple[torch.Tensor, torch.Tensor]:
    return nvfp4.quantize(VERSION, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                          is_sf_8x4_layout, is_global_scale_inversed, backend, nvfp4_4over6)


class CuteDslMoEWrapper(CuteDslBase):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True,
                 activation_type=ActivationType.Swiglu.value, swiglu_alpha=DEFAULT_SWIGLU_ALPHA,
                 swiglu_beta=DEFAULT_SWIGLU_BETA, swiglu_limit=DEFAULT_SWIGLU_LIMIT, situ_beta=None,
                 situ_linear_beta=None, use_fused_finalize=True, quant_mode="w4a4") -> None:
        if (activation_type != ActivationType.Swiglu.value or situ_beta is not None
                or (swiglu_alpha, swiglu_beta, swiglu_limit) != (DEFAULT_SWIGLU_ALPHA, DEFAULT_SWIGLU_BETA,
                                                                 DEFAULT_SWIGLU_LIMIT)
                or quant_mode not in ("w4a4", "nvfp4")):
            raise NotImplementedError("fake CuteDslMoEWrapper implements W4A4 with the default SwiGLU")
        self.quant_mode = "w4a4"
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None, *, per_token_scale=None) -> torch.Tensor:
        if x.dtype is not torch.uint8:
            raise TypeError("quant_mode='w4a4' requires packed uint8 input")
        if per_token_scale is not None:
            raise NotImplementedError("fake CuteDslMoEWrapper: per_token_scale is not emulated")
        return self._run(x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
                         fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic)


_A2A_MODULE = SimpleNamespace(MoeAlltoAll=MoeAlltoAll, get_moe_alltoall_module=get_moe_alltoall_module,
                              moe_a2a_get_workspace_size_per_rank=moe_a2a_get_workspace_size_per_rank)
comm = SimpleNamespace(
    MoeAlltoAll=MoeAlltoAll, Mapping=Mapping,
    moe_a2a_get_workspace_size_per_rank=moe_a2a_get_workspace_size_per_rank,
    mnnvl=SimpleNamespace(MnnvlConfig=mnnvl.MnnvlConfig, MnnvlMemory=mnnvl.MnnvlMemory, MpiComm=mnnvl.MpiComm,
                          MPIBackend=mnnvl.MPIBackend,
                          TorchDistBackend=mnnvl.TorchDistBackend, CommBackend=mnnvl.CommBackend),
    trtllm_moe_alltoall=_A2A_MODULE,
)

__all__ = ["CuteDslMoEWrapper", "KERNELS", "Mapping", "MoeAlltoAll", "comm", "fp4_quantize",
           "moe_a2a_get_workspace_size_per_rank"]
