"""``MoEDispatchDeepEPDispatcher``: sglang's ``DeepEPDispatcher`` interface over a moe-dispatch dispatcher.

sglang calls, per MoE layer and micro-batch (two-batch overlap keeps one of these per micro-batch)::

    dispatch_a(hidden_states, topk_output)   ->  Dispatcher.dispatch_start(...)      (split phase where it overlaps)
    dispatch_b()                             ->  .wait(): a DeepEPLLDispatchOutput  (MASKED is DeepEP's LL layout)
    the runner's experts on the masked rows  ->  a DeepEPLLCombineInput (rows unweighted)
    combine_a(combine_input)                 ->  Dispatcher.combine_start(rows, the dispatch's output)
    combine_b()                              ->  .wait(): [T, H] bf16, weighted and summed

The wire dtype is sglang's own choice (``get_deepep_output_dtype``: ``--deepep-dispatcher-output-dtype``, then the
quant config), handed to the spec with ``strict=True`` (a backend's fallback would hand the runner another dtype), so
moe-dispatch's resolution trail explains it; FP8 scales are powers of two where sglang's DeepGEMM runner reads them so;
the capacity is sglang's ``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK``. The spec is checked when the layer is
built and when its quant config arrives; the dispatcher is made at the first dispatch (sglang's warm-up forwards run
on every rank before any CUDA-graph capture, idle ranks with zero tokens) and shared by every layer and micro-batch
with the same spec, logging once with its resolution trail (sglang's logging is set up by then).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

import moe_dispatch as md

from . import BACKEND_VARIABLE
from . import _sglang as sg

_log = logging.getLogger(__name__)

#: sglang's dispatcher output dtypes served. Not: MXFP4, MXFP8 (no moe-dispatch wire format); NVFP4, whose consumer
#: reads DeepEP's permuted [M, K/2, E] rows (layers/moe/flashinfer_cutedsl_moe.py:86-88); INT8, which DeepEP on a GPU
#: sends as FP8 (deepep.py:519-529) and sglang's DeepGEMM runner reads with FP8's scale layout (deep_gemm.py:754).
_WIRE = {sg.DispatcherOutputDtype.BF16: "bf16", sg.DispatcherOutputDtype.FP8: "fp8"}


class MoEDispatchDeepEPDispatcher(sg.BaseDispatcher):
    """Takes ``DeepEPDispatcher``'s place (the same constructor); refuses when built what it cannot serve."""

    def __init__(self, group: torch.distributed.ProcessGroup, router_topk: int, permute_fusion: bool = False,
                 num_experts: int | None = None, num_local_experts: int | None = None, hidden_size: int | None = None,
                 params_dtype: torch.dtype | None = None, deepep_mode: Any = None, async_finish: bool = False,
                 return_recv_hook: bool = False, runner_backend: Any = None) -> None:
        super().__init__()
        if deepep_mode is not sg.DeepEPMode.LOW_LATENCY:
            raise md.InvalidSpecError(
                "moe-dispatch serves sglang's low-latency format only (normal mode's token-major rows are not "
                "mapped yet)", parameter="--deepep-mode", value=getattr(deepep_mode, "value", deepep_mode),
                allowed="low_latency")
        self.deepep_mode = self.dispatch_mode = deepep_mode  # dispatch_mode: get_deepep_output_dtype's mode key
        self.runner_backend = runner_backend
        self.group, self.num_experts, self.router_topk = group, num_experts, router_topk
        self.hidden_size, self.num_local_experts = hidden_size, num_local_experts
        self.backend = os.environ.get(BACKEND_VARIABLE, "torch")
        self._spec = self.spec()
        self._dispatcher: md.Dispatcher | None = None
        self._dispatching: tuple[md.Pending[md.DispatchOutput], torch.Tensor, torch.Tensor, int] | None = None
        self._output: md.DispatchOutput | None = None  # the dispatch whose rows the experts compute
        self._combining: md.Pending[torch.Tensor] | None = None
        self._deepep_dispatch_hooks = sg.DeepEPPDispatchHooks()
        self.expert_mask_gpu = None  # read by MaybeTboDeepEPDispatcher (AITER's sink expert: not used here)

    def spec(self) -> md.DispatchSpec:
        """The layer's spec from sglang's settings (its dtype choice, capacity, FP8 scale form)."""
        dtype = sg.get_deepep_output_dtype(self)
        if dtype not in _WIRE:
            raise md.InvalidSpecError("has no moe-dispatch wire format", parameter="--deepep-dispatcher-output-dtype",
                                      value=dtype.value, allowed=", ".join(sorted(_WIRE.values())))
        return md.DispatchSpec(self.hidden_size, self.num_experts, self.router_topk,
                               num_max_dispatch_tokens_per_rank=sg.capacity(), output_dtype=_WIRE[dtype],
                               mode="low_latency", quant=md.QuantHints(fp8_ue8m0_scales=sg.ue8m0_scales()))

    @property
    def dispatcher(self) -> md.Dispatcher:
        if self._dispatcher is None:
            # One per spec and group in the process, as sglang's DeepEP buffer: a dispatcher keeps no call state, the
            # layers run one after the other, and its two sets of buffers hold two-batch overlap's micro-batches.
            shared = sg.shared_dispatchers()
            key = (self.backend, self._spec, id(self.group))
            if key not in shared:
                shared[key] = md.create_dispatcher(self.backend, self._spec, group=self.group, strict=True,
                                                   in_flight=2)
                _log.info("moe-dispatch serves sglang's DeepEP MoE layers (%s=%s): %s", BACKEND_VARIABLE,
                          self.backend, shared[key].resolution)
            self._dispatcher = shared[key]
        return self._dispatcher

    def set_quant_config(self, quant_config: dict) -> None:
        super().set_quant_config(quant_config)
        spec = self.spec()
        if self._dispatcher is not None and spec != self._spec:
            raise md.InvalidSpecError("the quant config changed the dispatch after the layer's first dispatch",
                                      parameter="quant_config", value=quant_config,
                                      allowed="set before the first forward")
        self._spec = spec

    def set_overlap_args(self, combine_overlap_args: Any, meta_overlap_args: dict) -> None:
        if combine_overlap_args is None:  # shared experts overlapped outside SBO (models/deepseek_v2.py:1672-1684)
            return super().set_overlap_args(combine_overlap_args, meta_overlap_args)
        raise md.InvalidSpecError("single-batch overlap signals DeepEP's combine kernel from inside; moe-dispatch "
                                  "has no such hook", parameter="--enable-single-batch-overlap", value=True,
                                  allowed="off (two-batch overlap works)")

    def register_deepep_dispatch_hook(self, hook: Any) -> Any:
        return self._deepep_dispatch_hooks.register_hook(hook)

    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any) -> Any:
        self.dispatch_a(hidden_states, topk_output)
        self._deepep_dispatch_hooks(self)
        return self.dispatch_b()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: Any) -> None:
        ids, weights = topk_output.topk_ids.to(torch.int64), topk_output.topk_weights
        m = sg.expected_m(hidden_states.shape[0], self.dispatcher.world_size, ids.shape[1], self.num_experts)
        self._dispatching = (self.dispatcher.dispatch_start(hidden_states, ids, weights), ids, weights, m)

    def dispatch_b(self) -> Any:
        assert self._dispatching is not None, "dispatch_b without dispatch_a"
        started, ids, weights, expected_m = self._dispatching
        self._dispatching = None
        self._output = out = started.wait()
        masked_m = out.expert_counts().to(torch.int32)
        sg.get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(masked_m)
        # Views: sglang's DeepGEMM runner frees its input in place after the first GEMM (dispose_tensor: x.set_(),
        # moe_runner/deep_gemm.py:800, 946), and combine checks the rows against the output it keeps.
        return sg.DeepEPLLDispatchOutput(out.hidden_states.view(out.hidden_states.shape),
                                         None if out.hidden_states_scale is None else
                                         out.hidden_states_scale.view(out.hidden_states_scale.shape),
                                         ids, weights, masked_m, expected_m)

    def combine(self, combine_input: Any) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()

    def combine_a(self, combine_input: Any) -> None:
        assert self._output is not None, "combine_a without a dispatch"
        output, self._output = self._output, None
        self._combining = self.dispatcher.combine_start(combine_input.hidden_states, output)

    def combine_b(self) -> torch.Tensor:
        assert self._combining is not None, "combine_b without combine_a"
        combining, self._combining = self._combining, None
        return combining.wait()
