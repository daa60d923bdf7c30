"""``MoEDispatchDeepEPDispatcher``: sglang's ``DeepEPDispatcher`` interface over moe-dispatch dispatchers.

sglang calls, per MoE layer and micro-batch (two-batch overlap keeps one of these per micro-batch)::

    dispatch_a(hidden_states, topk_output)   ->  Dispatcher.dispatch_start(...)      (split phase where it overlaps)
    dispatch_b()                             ->  .wait(), in sglang's format for the mode:
        low_latency: a DeepEPLLDispatchOutput     (moe-dispatch's MASKED rows are DeepEP's LL layout)
        normal:      a DeepEPNormalDispatchOutput (TOKEN_MAJOR rows: each received token once, as DeepEP's)
    the runner's experts                     ->  LL: rows unweighted; normal: one weighted row per received row
    combine_a(combine_input)                 ->  Dispatcher.combine_start(rows, the dispatch's output)
    combine_b()                              ->  .wait(): [T, H] bf16

``--deepep-mode auto`` keeps one dispatcher per mode and picks per forward as sglang does (prefill: normal). The wire
dtype is sglang's own choice per mode (``get_deepep_output_dtype``: ``--deepep-dispatcher-output-dtype``, then the
quant config), handed to the spec with ``strict=True`` (a backend's fallback would hand the runner another dtype), so
moe-dispatch's resolution trail explains it; FP8 scales are powers of two where sglang's DeepGEMM runner reads them so
(normal mode: packed four to an int32, as its ep_scatter reads them); normal mode's counts are rounded to the row
multiple sglang asks DeepEP for. The capacity is sglang's ``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` (low
latency) or its largest prefill (normal). The specs are checked when the layer is built and when its quant config
arrives; a dispatcher is made at its mode's first dispatch (sglang's warm-up forwards run on every rank before any
CUDA-graph capture, idle ranks with zero tokens) and shared by every layer and micro-batch with the same spec,
logging once with its resolution trail (sglang's logging is set up by then).
"""

from __future__ import annotations

import logging
import os
import types
from typing import Any

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb

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
        self.deepep_mode, self.runner_backend = deepep_mode, runner_backend
        self.group, self.num_experts, self.router_topk = group, num_experts, router_topk
        self.hidden_size, self.num_local_experts = hidden_size, num_local_experts
        self.backend = os.environ.get(BACKEND_VARIABLE, "torch")
        self._modes = [m for m in (sg.DeepEPMode.NORMAL, sg.DeepEPMode.LOW_LATENCY)
                       if m is deepep_mode or deepep_mode is sg.DeepEPMode.AUTO]
        if sg.DeepEPMode.NORMAL in self._modes:
            _check_normal_mode(deepep_mode)
        self._specs = {mode: self.spec(mode) for mode in self._modes}
        self._dispatchers: dict[Any, md.Dispatcher] = {}
        self._dispatching: tuple[Any, md.Pending[md.DispatchOutput], torch.Tensor, torch.Tensor, int] | None = None
        self._output: md.DispatchOutput | None = None  # the dispatch whose rows the experts compute
        self._combining: md.Pending[torch.Tensor] | None = None
        self._deepep_dispatch_hooks = sg.DeepEPPDispatchHooks()
        self.expert_mask_gpu = sg.aiter_expert_mask(num_local_experts)  # read by MaybeTboDeepEPDispatcher

    def spec(self, mode: Any) -> md.DispatchSpec:
        """A mode's spec from sglang's settings (its dtype choice, capacity, FP8 scale form)."""
        # dispatch_mode: get_deepep_output_dtype's key for the mode's own dtype (utils.py:375-382)
        dtype = sg.get_deepep_output_dtype(types.SimpleNamespace(
            quant_config=self.quant_config, dispatch_mode=mode, runner_backend=self.runner_backend))
        if dtype not in _WIRE:
            raise md.InvalidSpecError("has no moe-dispatch wire format", parameter="--deepep-dispatcher-output-dtype",
                                      value=dtype.value, allowed=", ".join(sorted(_WIRE.values())))
        normal = mode is sg.DeepEPMode.NORMAL
        if normal and not sg.normal_sends_fp8():
            dtype = sg.DispatcherOutputDtype.BF16  # as sglang's normal mode sends without DeepGEMM
        return md.DispatchSpec(self.hidden_size, self.num_experts, self.router_topk,
                               num_max_dispatch_tokens_per_rank=sg.normal_tokens() if normal else sg.capacity(),
                               output_dtype=_WIRE[dtype], mode=mode.value, layout="token_major" if normal else "masked",
                               quant=md.QuantHints(fp8_ue8m0_scales=sg.ue8m0_scales()))

    def dispatcher(self, mode: Any) -> md.Dispatcher:
        if mode not in self._dispatchers:
            # One per spec and group in the process, as sglang's DeepEP buffer: a dispatcher keeps no call state, the
            # layers run one after the other, and its two sets of buffers hold two-batch overlap's micro-batches.
            shared, spec = sg.shared_dispatchers(), self._specs[mode]
            key = (self.backend, spec, id(self.group))
            if key not in shared:
                shared[key] = md.create_dispatcher(self.backend, spec, group=self.group, strict=True, in_flight=2)
                _log.info("moe-dispatch serves sglang's DeepEP MoE layers in %s mode (%s=%s): %s", spec.mode,
                          BACKEND_VARIABLE, self.backend, shared[key].resolution)
            self._dispatchers[mode] = shared[key]
        return self._dispatchers[mode]

    def set_quant_config(self, quant_config: dict) -> None:
        super().set_quant_config(quant_config)
        specs = {mode: self.spec(mode) for mode in self._modes}
        if any(specs[mode] != self._specs[mode] for mode in self._dispatchers):
            raise md.InvalidSpecError("the quant config changed the dispatch after the layer's first dispatch",
                                      parameter="quant_config", value=quant_config,
                                      allowed="set before the first forward")
        self._specs = specs

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
        mode = (self.deepep_mode if self.deepep_mode is not sg.DeepEPMode.AUTO else  # as DeepEPDispatcher (:1097)
                self.deepep_mode.resolve(sg.get_is_extend_in_batch()))
        ids, weights = topk_output.topk_ids.to(torch.int64), topk_output.topk_weights
        started = self.dispatcher(mode).dispatch_start(hidden_states, ids, weights)
        self._dispatching = (mode, started, ids, weights, hidden_states.shape[0])

    def dispatch_b(self) -> Any:
        assert self._dispatching is not None, "dispatch_b without dispatch_a"
        mode, started, ids, weights, tokens = self._dispatching
        self._dispatching = None
        self._output = out = started.wait()
        if mode is sg.DeepEPMode.NORMAL:
            return self._normal_output(out, ids)
        masked_m = out.expert_counts().to(torch.int32)
        sg.get_global_expert_distribution_recorder().on_deepep_dispatch_low_latency(masked_m)
        m = sg.expected_m(tokens, self.dispatcher(mode).world_size, ids.shape[1], self.num_experts)
        # Views: sglang's DeepGEMM runner frees its input in place after the first GEMM (dispose_tensor: x.set_(),
        # moe_runner/deep_gemm.py:800, 946), and combine checks the rows against the output it keeps.
        return sg.DeepEPLLDispatchOutput(_view(out.hidden_states), _view(out.hidden_states_scale), ids, weights,
                                         masked_m, m)

    def _normal_output(self, out: md.DispatchOutput, ids: torch.Tensor) -> Any:
        """DeepEP's normal-mode output from TOKEN_MAJOR rows, and what sglang's recorder reads of its layout."""
        alignment = sg.normal_expert_alignment()
        per_expert = mdb.align_up(out.expert_counts(), alignment).tolist()
        routed = ids[ids >= 0]
        ranks = self.dispatcher(sg.DeepEPMode.NORMAL).world_size
        in_rank = torch.zeros(ids.shape[0], ranks + 1, dtype=torch.bool, device=ids.device).scatter_(
            1, torch.where(ids >= 0, ids // (self.num_experts // ranks), ranks), True)[:, :ranks]
        sg.get_global_expert_distribution_recorder().on_deepep_dispatch_normal(
            per_expert, num_tokens_per_rank=in_rank.sum(0).to(torch.int32), num_tokens_per_rdma_rank=None,
            num_tokens_per_expert=torch.bincount(routed, minlength=self.num_experts).to(torch.int32))
        scale, ue8m0 = out.hidden_states_scale, self._specs[sg.DeepEPMode.NORMAL].quant.fp8_ue8m0_scales
        if scale is not None and ue8m0 and scale.dtype != torch.int32:
            scale = mdb.pack_ue8m0(scale)  # ep_scatter reads four UE8M0 exponents per int32 (ep_moe_kernels.py:1251)
        return sg.DeepEPNormalDispatchOutput(_view(out.hidden_states), _view(scale), out.row_topk_ids,
                                             out.row_topk_weights, per_expert)

    def combine(self, combine_input: Any) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()

    def combine_a(self, combine_input: Any) -> None:
        assert self._output is not None, "combine_a without a dispatch"
        output, self._output = self._output, None
        mode = sg.DeepEPMode.NORMAL if output.layout is md.Layout.TOKEN_MAJOR else sg.DeepEPMode.LOW_LATENCY
        self._combining = self.dispatcher(mode).combine_start(combine_input.hidden_states, output)

    def combine_b(self) -> torch.Tensor:
        assert self._combining is not None, "combine_b without combine_a"
        combining, self._combining = self._combining, None
        return combining.wait()


def _check_normal_mode(deepep_mode: Any) -> None:
    """What normal mode cannot serve, refused when the layer is built, naming the setting."""
    if sg.is_npu:  # moe_runner/ascend.py:321-347 reads DeepEP-Ascend's rows grouped by expert, not token-major ones
        raise md.InvalidSpecError("sglang's Ascend runner reads normal-mode rows grouped by expert; moe-dispatch "
                                  "hands them over token-major", parameter="--deepep-mode", value=deepep_mode.value,
                                  allowed="low_latency on Ascend")
    if sg.chunked_prefill_size() <= 0:
        raise md.InvalidSpecError("a prefill of any length would be one forward: moe-dispatch sizes normal mode for "
                                  "sglang's largest chunk", parameter="--chunked-prefill-size",
                                  value=sg.chunked_prefill_size(), allowed="> 0 (chunked prefill on)")


def _view(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.view(t.shape)
