"""A whole layer through a torch_npu runner: dispatch, ``NpuExperts`` on each rank's experts, combine."""

from __future__ import annotations

import torch

import moe_dispatch as md
from moe_dispatch_ascend_deepep.experts import REAL, NpuExperts
from moe_dispatch_ascend_deepep.vendor import REAL as DEEPEP
from moe_dispatch_testing import LayerCheck, check_layer, random_expert_weights

from . import ascend_backend


def run_layer(rank: int, world: int, scheme: str, mode: str = "normal", kernel_module: str = REAL,
              vendor_module: str = DEEPEP, hidden: int = 1024, intermediate: int = 256,
              experts_per_rank: int = 2, top_k: int = 2, tokens: int = 8, seed: int = 0) -> LayerCheck:
    """Run on every rank (``RankPool.map`` in the tests, torchrun on an NPU): an ascend_deepep
    dispatcher whose spec takes the kernel's quant hints, the kernel on this rank's experts,
    combine, and the relative error against the dense fp32 reference on the dequantized weights."""
    experts = NpuExperts(scheme, kernel_module)
    spec = md.DispatchSpec(hidden, experts_per_rank * world, top_k, num_max_dispatch_tokens_per_rank=tokens,
                           mode=mode, quant=experts.quant_hints(), runner=experts.runner)
    # The HCCL window is read from the process environment, as HCCL and the ops read it.
    dispatcher = md.create_dispatcher(ascend_backend(vendor_module), spec, env={})
    device = torch.device("npu" if kernel_module == REAL else "cpu")
    g = torch.Generator().manual_seed(seed)
    global_layer = experts.process_weights(random_expert_weights(spec.num_experts, hidden, intermediate, generator=g))
    layer = global_layer.slice(rank * experts_per_rank, experts_per_rank).to(device)
    return check_layer(rank, world, dispatcher, experts, layer, global_layer.dequantized(), tokens=tokens,
                       generator=g, device=device)


__all__ = ["run_layer"]
