"""Every vLLM name the adapter uses, imported once, with where it is in vLLM 0.33.0 (``vllm/``)."""

from __future__ import annotations

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # :281 FusedMoEPrepareAndFinalizeModular
from vllm.model_executor.layers.fused_moe.config import (  # :1274 FusedMoEConfig, :472 batched_scale_shape
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (  # :78, :17
    TopKWeightAndReduceContiguous,  # Standard format: [M, topk, H] rows weighted and summed (what DeepEP HT uses)
    TopKWeightAndReduceDelegate,  # the experts leave weights and the sum to finalize
)

# :154 the micro-batch (DBO ubatch) of this thread; :123 run the hook the other micro-batch left for this one (the
# kernel does so before prepare only: modular_kernel.py:1278; a prepare/finalize does before its combine, as
# prepare_finalize/deepep_ll.py:394 does)
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_maybe_run_recv_hook

__all__ = ["FusedMoEConfig", "FusedMoEQuantConfig", "TopKWeightAndReduceContiguous", "TopKWeightAndReduceDelegate",
           "dbo_current_ubatch_id", "dbo_maybe_run_recv_hook", "mk"]
