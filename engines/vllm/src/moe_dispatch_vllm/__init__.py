"""vLLM's modular MoE kernels over a moe-dispatch backend (``pip install moe-dispatch-vllm``).

::

    prepare_finalize = MoEDispatchPrepareAndFinalize.for_layer("torch", moe_config, quant_config,
                                                               group=get_ep_group().device_group)
    kernel = FusedMoEKernel(prepare_finalize, NaiveBatchedExperts(moe_config, quant_config,
                            prepare_finalize.max_num_tokens_per_rank(), prepare_finalize.num_dispatchers()))

``MoEDispatchPrepareAndFinalize`` is a ``FusedMoEPrepareAndFinalizeModular`` in vLLM's ``BatchedExperts`` format
(moe-dispatch's MASKED layout, low latency) or, with ``for_layer(..., mode="normal")``, its ``Standard`` format
(TOKEN_MAJOR rows, as DeepEP HT): vLLM's experts on unquantized activations run on any moe-dispatch backend that
writes the layout, with ``prepare_async``/``finalize_async`` on the split phase (dual-batch overlap); block-FP8
experts get FP8 rows. vLLM 0.33.0 chooses its prepare/finalize from a closed list (``maybe_make_prepare_finalize``),
so an engine builds the kernel itself as above; vLLM PR #50556 would let a plugin register it by name.
"""

from __future__ import annotations

from ._prepare_finalize import MoEDispatchPrepareAndFinalize

__all__ = ["MoEDispatchPrepareAndFinalize"]
