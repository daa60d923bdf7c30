"""``MoEDispatchPrepareAndFinalize``: vLLM's prepare/finalize contract over a moe-dispatch dispatcher, in both of
vLLM's activation formats.

vLLM's ``FusedMoEKernel`` calls, per MoE layer and micro-batch::

    prepare(a1, topk_weights, topk_ids, ...)   ->  Dispatcher.dispatch, in the dispatcher's layout:
        low latency, MASKED: [E_local, capacity*world, H] rows, the counts as expert_num_tokens (BatchedExperts)
        normal, TOKEN_MAJOR: each received token once, its top-k as global ids (Standard, as DeepEP HT hands over)
    the experts                                ->  unweighted rows, TopKWeightAndReduceDelegate
    finalize(output, fused_expert_output, ...) ->  BatchedExperts: Dispatcher.combine (weights applied, summed);
                                                   Standard: each row's top-k weighted and summed, then combine

``finalize`` gets no handle, so the dispatch's output waits here, one per micro-batch (vLLM's DBO ubatch id).
``prepare_async``/``finalize_async`` return (hook, receiver): the hook waits for the started call, so under DBO the
other micro-batch computes while this one's tokens travel.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

import moe_dispatch as md

from . import _vllm as vl

#: The dispatchers ``for_layer`` made, per process group (gone with it).
_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple[str, md.DispatchSpec, str], md.Dispatcher]] = \
    weakref.WeakKeyDictionary()


def _wire(quant_config: Any) -> str:
    """The wire dtype for the experts' ``quant_config``: BF16 rows for unquantized experts; FP8 for block-FP8 ones
    whose activations have one fp32 scale per 128 columns (DeepSeek's [128, 128] blocks), which are moe-dispatch's
    FP8 rows and scales as they arrive ([rows, H/128]; batched: [E, rows, H/128]), quantized before the send as
    vLLM's DeepEP prepare does for block quantization (prepare_finalize/deepep_ht.py:300-330)."""
    if quant_config.quant_dtype is None:
        return "bf16"
    block = quant_config.block_shape
    if quant_config.quant_dtype == torch.float8_e4m3fn and block is not None and block[-1] == 128:
        return "fp8"
    raise md.InvalidSpecError("moe-dispatch sends BF16, or FP8 in 128-column groups, to vLLM's experts",
                              parameter="quant_config", value=f"{quant_config.quant_dtype} {block}",
                              allowed="unquantized experts, or block FP8 with 128-column activation groups")


class MoEDispatchPrepareAndFinalize(vl.mk.FusedMoEPrepareAndFinalizeModular):
    """vLLM's prepare/finalize on ``dispatcher``: ``BatchedExperts`` on MASKED rows (low latency), ``Standard`` on
    TOKEN_MAJOR rows (normal mode with ``DispatchSpec(layout="token_major")``)."""

    def __init__(self, dispatcher: md.Dispatcher) -> None:
        super().__init__()
        spec = dispatcher.spec
        layout = spec.layout or dispatcher.backend.capabilities.layouts_for(spec.mode)[0]
        if layout not in (md.Layout.MASKED, md.Layout.TOKEN_MAJOR):
            raise md.InvalidSpecError("vLLM's experts read MASKED rows (BatchedExperts) or each received token once "
                                      "(Standard)", parameter="spec.layout", value=layout.value,
                                      allowed="masked (low_latency), token_major (normal)")
        self.dispatcher, self.standard = dispatcher, layout is md.Layout.TOKEN_MAJOR
        self._outputs: dict[int, md.DispatchOutput] = {}  # the dispatch each micro-batch's finalize combines
        self._linear_map: torch.Tensor | None = None  # the layer's expert_map, once checked to be the linear one

    @classmethod
    def for_layer(cls, backend: str, moe: Any, quant_config: Any, group: Any = None, *, mode: str = "low_latency",
                  **create: Any) -> MoEDispatchPrepareAndFinalize:
        """A dispatcher made from vLLM's own layer config (``FusedMoEConfig``: sizes, ``max_num_tokens`` per rank)
        and the experts' ``FusedMoEQuantConfig`` (the wire dtype), on ``group``: vLLM's EP group
        (``get_ep_group().device_group``; None: the default group). ``mode``: ``"low_latency"`` (BatchedExperts, as
        DeepEP LL) or ``"normal"`` (Standard, as DeepEP HT). ``create``: more ``create_dispatcher`` arguments. The
        layer's experts must be the group rank's contiguous slice (vLLM's linear placement)."""
        import torch.distributed as dist

        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        for parameter, value, allowed in (
                ("moe_config.in_dtype", moe.in_dtype, torch.bfloat16),
                ("moe_config.num_local_experts", moe.num_local_experts, moe.num_experts // world),
                ("moe_config.moe_parallel_config.ep_rank", moe.moe_parallel_config.ep_rank, rank)):
            if value != allowed:  # refused on the rank that has it, before the collective creation
                raise md.InvalidSpecError(f"does not match the group ({world} ranks, this one {rank}): each rank "
                                          "holds its contiguous slice of the experts, in bf16 activations",
                                          parameter=parameter, value=value, allowed=allowed)
        normal = md.Mode.parse(mode) is md.Mode.NORMAL
        spec = md.DispatchSpec(moe.hidden_dim, moe.num_experts, moe.experts_per_token,
                               num_max_dispatch_tokens_per_rank=moe.max_num_tokens, output_dtype=_wire(quant_config),
                               mode=mode, layout="token_major" if normal else "masked")
        # One dispatcher per group, backend and spec, shared by the layers (as vLLM shares a DeepEP buffer through
        # its all2all manager's handle cache): it keeps no call state and holds two micro-batches' buffers.
        owner = group if group is not None else dist.group.WORLD  # None without torch.distributed: nothing shared
        shared = {} if owner is None else _SHARED.setdefault(owner, {})
        key = (backend, spec, repr(sorted(create.items())))
        if key not in shared:
            shared[key] = md.create_dispatcher(backend, spec, group=group, strict=True, **create)
        return cls(shared[key])

    @property
    def activation_format(self) -> Any:
        formats = vl.mk.FusedMoEActivationFormat
        return formats.Standard if self.standard else formats.BatchedExperts

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def max_num_tokens_per_rank(self) -> int | None:
        return None if self.standard else self.dispatcher.spec.num_max_dispatch_tokens_per_rank

    def num_dispatchers(self) -> int:
        return self.dispatcher.world_size

    def output_is_reduced(self) -> bool:
        return True  # combine returns each token's sum over every rank's experts

    def supports_async(self) -> bool:
        return True

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config: Any,
                defer_input_quant: bool = False) -> Any:
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config, defer_input_quant)
        hook()
        return receiver()

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_map: torch.Tensor | None, apply_router_weight_on_input: bool, quant_config: Any,
                      defer_input_quant: bool = False) -> tuple[Callable[[], None], Callable[[], Any]]:
        self._check(num_experts, apply_router_weight_on_input, quant_config, defer_input_quant, expert_map)
        if apply_router_weight_on_input:  # top-1: the input scaled before dispatch, as vLLM's DeepEP HT and LL do
            a1, topk_weights = (a1 * topk_weights.to(a1.dtype)).to(a1.dtype), torch.ones_like(topk_weights)
        started = self.dispatcher.dispatch_start(a1, topk_ids.to(torch.int64), topk_weights)
        ubatch = vl.dbo_current_ubatch_id()

        def hook() -> None:
            self._outputs[ubatch] = started.wait()

        def receiver() -> Any:
            out = self._outputs[ubatch]
            counts = out.expert_counts().to(torch.int32)
            if self.standard:  # normal mode has read the counts on the host already: vLLM's kernels may too
                meta = vl.mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=counts.cpu())
                return out.hidden_states, out.hidden_states_scale, meta, self._global_ids(out), out.row_topk_weights
            meta = vl.mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)
            return out.hidden_states, out.hidden_states_scale, meta, None, None
        return hook, receiver

    def _global_ids(self, out: md.DispatchOutput) -> torch.Tensor:
        """The received rows' top-k in vLLM's global expert space, which its experts localize with ``expert_map``; a
        -1 (an expert elsewhere: weight 0) points at an expert of another rank, as vLLM's DeepEP HT prepare does
        (prepare_finalize/deepep_ht.py:249-253)."""
        local, ids = out.group_list.shape[0], out.row_topk_ids
        offset = self.dispatcher.rank * local
        return torch.where(ids == -1, self.dispatcher.spec.num_experts - 1 if offset == 0 else 0, ids + offset)

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool, weight_and_reduce_impl: Any) -> None:
        hook, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                             apply_router_weight_on_input, weight_and_reduce_impl)
        hook()
        receiver()

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: Any) -> tuple[Callable[[], None], Callable[[], None]]:
        if self.standard:  # each received row's top-k weighted and summed here, as DeepEP HT's finalize does (:386)
            if isinstance(weight_and_reduce_impl, vl.TopKWeightAndReduceDelegate):
                weight_and_reduce_impl = vl.TopKWeightAndReduceContiguous()
            if fused_expert_output.numel():  # no rows reached this rank: nothing to weigh
                fused_expert_output = weight_and_reduce_impl.apply(None, fused_expert_output, topk_weights, topk_ids,
                                                                   apply_router_weight_on_input)
        elif not isinstance(weight_and_reduce_impl, vl.TopKWeightAndReduceDelegate):
            raise md.InvalidInputError("moe-dispatch's combine applies the routing weights and sums: the experts "
                                       "must leave both to finalize", parameter="weight_and_reduce_impl",
                                       value=type(weight_and_reduce_impl).__name__,
                                       allowed="TopKWeightAndReduceDelegate")
        vl.dbo_maybe_run_recv_hook()  # the other micro-batch's pending receive, before this combine starts
        started = self.dispatcher.combine_start(fused_expert_output, self._outputs.pop(vl.dbo_current_ubatch_id()))
        combined: list[torch.Tensor] = []
        return (lambda: combined.append(started.wait())), (lambda: output.copy_(combined[0]))

    def _check(self, num_experts: int, apply_router_weight_on_input: bool, quant_config: Any,
               defer_input_quant: bool, expert_map: torch.Tensor | None) -> None:
        """What this prepare/finalize cannot do, refused before anything is sent."""
        spec, wire = self.dispatcher.spec, str(self.dispatcher.output_dtype)
        for parameter, value, allowed in (
                ("num_experts", num_experts, spec.num_experts),
                ("apply_router_weight_on_input", apply_router_weight_on_input and spec.top_k > 1, False),
                ("defer_input_quant", defer_input_quant and wire != "bf16", False),  # BF16 rows: nothing to defer
                ("quant_config", _wire(quant_config), wire)):
            if value != allowed:
                raise md.InvalidInputError("does not match the dispatcher (the weights are applied in combine, or to "
                                           "the input at top-1; the rows arrive in the wire dtype)",
                                           parameter=parameter, value=value, allowed=allowed)
        if expert_map is not None and expert_map is not self._linear_map:
            self._check_linear(expert_map)

    def _check_linear(self, expert_map: torch.Tensor) -> None:
        """moe-dispatch sends expert e to rank e // E_local: vLLM's linear placement, not its round-robin one
        (expert_map_manager.py:80-86). Read once per map (a device sync)."""
        local, rank = self.dispatcher.spec.local_experts(self.dispatcher.world_size), self.dispatcher.rank
        linear = torch.full_like(expert_map, -1)
        linear[rank * local:(rank + 1) * local] = torch.arange(local, dtype=expert_map.dtype, device=expert_map.device)
        if not torch.equal(expert_map, linear):
            raise md.InvalidInputError("places the experts other than moe-dispatch sends them (rank r holds experts "
                                       "r*E_local ..)", parameter="expert_map", value=expert_map.tolist(),
                                       allowed="the linear placement (--expert-placement-strategy linear)")
        self._linear_map = expert_map
