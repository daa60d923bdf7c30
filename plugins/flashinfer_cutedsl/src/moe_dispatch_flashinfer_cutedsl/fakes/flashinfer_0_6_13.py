"""Fake of FlashInfer 0.6.13 (models v0.6.8-v0.6.15).

kMaxTopK 22 with top-k in {1, 2, 4, 6, 8, 10, 16, 22}, 4 payloads (6 from v0.6.14), fp4_quantize with
is_global_scale_inversed and backend=, reading FLASHINFER_NVFP4_4OVER6 (v0.6.12+). v0.6.14-v0.6.15 add
combine's output_dtype/output_scales arguments, not modelled here.
"""

from __future__ import annotations

from enum import IntEnum
from types import SimpleNamespace
from typing import Any

import torch

from .. import vendor
from . import a2a, mnnvl, nvfp4
from .cute_dsl import CuteDslBase
from .kernels import MoeA2AKernels
from .mapping import Mapping

__version__ = "0.6.13"
VERSION: vendor.Version = (0, 6, 13)
KERNELS = MoeA2AKernels(vendor.profile(VERSION))


class SfLayout(IntEnum):
    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


def get_moe_alltoall_module() -> MoeA2AKernels:
    return KERNELS

def moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                        combine_payload_size_per_token) -> int:
    return a2a.workspace_size_per_rank(KERNELS, ep_size, max_num_tokens, total_dispatch_payload_size_per_token,
                                       combine_payload_size_per_token)


class MoeAlltoAll(a2a.MoeAlltoAllBase):
    _KERNELS = KERNELS
    _WORKSPACE_CACHE: dict[tuple[Any, ...], dict[str, Any]] = {}

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


def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                 is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None,
                 backend="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    return nvfp4.quantize(VERSION, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                          is_sf_8x4_layout, is_global_scale_inversed, backend)


class CuteDslMoEWrapper(CuteDslBase):
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=4096, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True) -> None:
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None) -> torch.Tensor:
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
