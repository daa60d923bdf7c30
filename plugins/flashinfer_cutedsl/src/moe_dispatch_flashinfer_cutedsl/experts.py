"""``flashinfer_cutedsl``: FlashInfer's CuTe-DSL MoE as an expert kernel between dispatch and
combine (``apply_without_routing_weights``).

``CuteDslMoEWrapper.run`` routes, weights and sums by itself; given already-dispatched rows it
is driven with top-k 1: each row is a "token" whose one expert is the row's expert
(``local_expert_offset + e``) with weight 1, so the output is the unweighted expert row and
dispatch/combine keep the routing. MASKED ``[E_l, capacity, H]`` rows are passed flat; slots
past an expert's count get id -1, which the kernel skips (no compute), so there is no host sync
and no compaction. Their output rows are zero from FlashInfer 0.6.7; 0.6.4-0.6.6 leave them
uninitialised (``torch.empty``, only routed rows zeroed), so there the runner zeroes them itself.
No rows at all (a rank that received none) return zeros without calling FlashInfer.

Input: BF16 rows are quantized here (``fp4_quantize`` with the layer's input global scale,
linear scales, which the kernel requires), or NVFP4 rows come from the dispatcher (scales
linear, as they crossed the wire) with its global scale; ``w1_alpha`` folds in whichever
global scale the rows carry.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb

from . import vendor
from .vendor import INSTALL_HINT, REAL, VendorInfo, detect, sm100_reason
from .weights import CuteDslLayer

B, F4 = md.DispatchDtype.BF16, md.DispatchDtype.NVFP4
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY

def _aligned(t: torch.Tensor, alignment: int) -> torch.Tensor:
    """``t`` contiguous at an address the CuTe-DSL kernels accept (``make_ptr`` asserts
    ``pointer must be N bytes aligned``: 32 for activations, 16 for scales); a copy if not."""
    t = t.contiguous()
    return t if t.data_ptr() % alignment == 0 else t.clone()


class CuteDslExperts:
    """The expert kernel. ``module`` is ``flashinfer`` (or one of the fakes, in tests)."""

    needs_dispatch_dtype: md.DispatchDtype | None = B

    def __init__(self, module: str = REAL) -> None:
        self.module = module
        self._info: VendorInfo | None = None

    def vendor(self) -> VendorInfo:
        if self._info is None:
            self._info = detect(self.module)
        return self._info

    def probe(self) -> str | None:
        """None when the kernel can run here, else why not (no FlashInfer, no SM100 GPU)."""
        info = self.vendor()
        reason = info.cutedsl_reason()
        if reason is not None:
            return reason
        return None if info.fake else sm100_reason()

    def process_weights(self, weights: md.ExpertWeights, *, first_expert: int, num_experts: int,
                        input_global_scale: float, fc2_input_scale: float) -> CuteDslLayer:
        """Quantize a rank's experts to W4A4 and build the kernel wrapper for them.

        :raises InvalidSpecError: an expert range FlashInfer's routing step cannot take
            (``first_expert`` + local experts past ``num_experts``; ``num_experts`` beyond the
            version's limit, or not a multiple of 4 before 0.6.8)."""
        reason = self.probe()
        if reason is not None:
            raise md.BackendUnavailableError(f"cannot run here: {reason}; {INSTALL_HINT}",
                                             parameter="runner", value=RUNNER.name)
        _check_expert_range(self.vendor(), int(weights.w13_weight.shape[0]), first_expert, num_experts)
        layer = CuteDslLayer.from_weights(weights, first_expert=first_expert, num_experts=num_experts,
                                          input_global_scale=input_global_scale, fc2_input_scale=fc2_input_scale)
        api = self.vendor().api
        assert api is not None
        layer.wrapper = api.CuteDslMoEWrapper(
            num_experts=num_experts, top_k=1, hidden_size=layer.hidden_size,
            intermediate_size=layer.intermediate_size, num_local_experts=layer.num_local_experts,
            local_expert_offset=first_expert, output_dtype=torch.bfloat16,
            device="cpu" if self.vendor().fake else "cuda")
        return layer

    def quant_hints(self, nvfp4_dispatch: bool = False, layer: CuteDslLayer | None = None) -> md.QuantHints:
        """BF16 dispatch by default; NVFP4 dispatch with the layer's input global scale."""
        if nvfp4_dispatch:
            if layer is None:
                raise md.InvalidSpecError("NVFP4 dispatch needs the layer's input global scale",
                                          parameter="layer", value=None, allowed="a CuteDslLayer")
            return md.QuantHints(input_global_scale=layer.input_global_scale)
        return md.QuantHints(dispatcher_output_dtype=B)

    def apply_without_routing_weights(
        self, layer: Any, hidden_states: torch.Tensor, hidden_states_scale: torch.Tensor | None,
        group_list_type: int, group_list: torch.Tensor, output_dtype: torch.dtype, *,
        global_scale: float | None = None,
    ) -> torch.Tensor:
        if not isinstance(layer, CuteDslLayer) or layer.wrapper is None:
            raise md.InvalidInputError("needs the layer CuteDslExperts.process_weights made", parameter="layer",
                                       value=type(layer).__name__, allowed="CuteDslLayer")
        if layer.device != hidden_states.device:  # the kernels read every tensor by raw pointer
            raise md.InvalidInputError("the layer's weights are on another device than the rows", parameter="layer",
                                       value=str(layer.device), allowed=f"{hidden_states.device} (CuteDslLayer.to)")
        el, h = layer.num_local_experts, layer.hidden_size
        if group_list.shape != (el,):
            raise md.InvalidInputError("needs one entry per local expert", parameter="group_list",
                                       value=group_list, allowed=f"[{el}]")
        nvfp4 = hidden_states.dtype == torch.uint8
        width = h // 2 if nvfp4 else h
        if hidden_states.dtype not in (torch.bfloat16, torch.uint8) or hidden_states.shape[-1] != width:
            raise md.InvalidInputError("CuTe-DSL MoE takes BF16 or packed NVFP4 rows", parameter="hidden_states",
                                       value=hidden_states, allowed=f"bfloat16 [..., {h}] or uint8 [..., {h // 2}]")
        masked = hidden_states.dim() == 3
        device = hidden_states.device
        counts = mdb.group_counts(group_list.to(device=device, dtype=torch.int64), group_list_type)
        valid = None
        if masked:
            cap = hidden_states.shape[1]
            valid = torch.arange(cap, device=device).unsqueeze(0) < counts.unsqueeze(1)  # [E_l, cap]
            expert = torch.where(valid, torch.arange(el, device=device).unsqueeze(1), -1).reshape(-1, 1)
        else:
            expert = torch.repeat_interleave(torch.arange(el, device=device), counts).unsqueeze(1)
            if expert.shape[0] != hidden_states.shape[0]:
                raise md.InvalidInputError(f"counts sum to {expert.shape[0]} but there are {hidden_states.shape[0]} rows",
                                           parameter="group_list", value=group_list.tolist(),
                                           allowed="per-expert counts summing to the row count")
        ids = torch.where(expert >= 0, expert + layer.first_expert, -1).to(torch.int32)
        rows = hidden_states.reshape(-1, width)
        if rows.shape[0] == 0:  # fp4_quantize would launch an empty grid; nothing to compute
            return torch.zeros(*hidden_states.shape[:-1], h, dtype=output_dtype, device=device)
        info = self.vendor()
        api = info.api
        assert api is not None
        if nvfp4:
            if hidden_states_scale is None or global_scale is None:
                raise md.InvalidInputError("NVFP4 rows need their block scales and global scale",
                                           parameter="hidden_states_scale", value=hidden_states_scale,
                                           allowed="e4m3 [..., H/16] and DispatchOutput.global_scale")
            x, x_sf, gs_in = rows, hidden_states_scale.reshape(-1, h // 16).view(torch.uint8), float(global_scale)
        else:
            gs_in = layer.input_global_scale
            gs = torch.tensor([gs_in], dtype=torch.float32, device=rows.device)
            x, x_sf = api.fp4_quantize(rows.contiguous(), gs, is_sf_swizzled_layout=False, **_no_4over6(info))
        x, x_sf = _aligned(x, 32), _aligned(x_sf, 16)
        # One fp32 per local expert, contiguous: the kernel reads them through raw pointers.
        w1_alpha = (1.0 / (gs_in * layer.w1_global_scale)).to(device=device, dtype=torch.float32).contiguous()
        w2_alpha = (1.0 / (layer.fc2_input_scale * layer.w2_global_scale)).to(device=device,
                                                                                dtype=torch.float32).contiguous()
        out = layer.wrapper.run(
            x, x_sf, ids, torch.ones(ids.shape, dtype=torch.float32, device=device),
            layer.w1_weight, layer.w1_weight_sf, w1_alpha,
            torch.tensor([layer.fc2_input_scale], dtype=torch.float32, device=device),
            layer.w2_weight, layer.w2_weight_sf, w2_alpha)
        out = out.reshape(*hidden_states.shape[:-1], h)
        version = info.version or vendor.VERIFIED_UNTIL
        if valid is not None and version < vendor.CUTEDSL_DENSE_ZERO_SINCE:
            out = out.masked_fill(~valid.unsqueeze(-1), 0)  # uninitialised rows of -1 slots (no host sync)
        return out.to(output_dtype)


def _check_expert_range(info: VendorInfo, local_experts: int, first_expert: int, num_experts: int) -> None:
    """What ``CuteDslMoEWrapper.run``'s routing step (moe_sort) accepts, checked at load time."""
    limits = vendor.cutedsl_routing_limits(info.version or vendor.VERIFIED_UNTIL)
    if not 0 <= first_expert or first_expert + local_experts > num_experts:
        raise md.InvalidSpecError(
            "the rank's experts must lie inside the model's (ids past num_experts break FlashInfer's routing "
            "histogram)",
            parameter="first_expert", value=first_expert,
            allowed=f"0..{num_experts - local_experts} for {local_experts} local of {num_experts} experts")
    if num_experts > limits.max_experts or num_experts % limits.multiple:
        rule = f"<= {limits.max_experts}" + (f", a multiple of {limits.multiple}" if limits.multiple > 1 else "")
        raise md.InvalidSpecError(f"FlashInfer {info.version_text}'s routing step cannot take this many experts",
                                  parameter="num_experts", value=num_experts, allowed=rule)


def _no_4over6(info: VendorInfo) -> dict[str, Any]:
    """Keep fp4_quantize on plain NVFP4, as the core codec (and so NVFP4 dispatch) quantizes.
    From v0.6.12 FLASHINFER_NVFP4_4OVER6=1 switches it to the 4over6 search (other bits, another
    global-scale recipe); from 0.7.1 ``nvfp4_4over6=None`` ignores the variable, before it the
    runner refuses to run with it set."""
    version = info.version or vendor.VERIFIED_UNTIL
    if version >= vendor.NVFP4_4OVER6_ARG_SINCE:
        return {"nvfp4_4over6": None}
    if version >= vendor.NVFP4_4OVER6_SINCE and vendor.env_flag(os.environ, vendor.ENV_NVFP4_4OVER6):
        raise md.InvalidSpecError(
            f"FlashInfer {info.version_text} quantizes with the NVFP4 4over6 search when this is set; the runner's "
            "scales and the NVFP4 wire codec assume plain NVFP4", parameter=vendor.ENV_NVFP4_4OVER6,
            value=os.environ.get(vendor.ENV_NVFP4_4OVER6), allowed="unset, or FlashInfer >= 0.7.1")
    return {}


#: Resolution step 5, and the combinations tested behind each dispatch backend (the
#: conformance of each pairing is in tests/test_cutedsl_runner.py).
RUNNER = mdb.RunnerInfo(
    "flashinfer_cutedsl", B, "CuTe-DSL MoE quantizes BF16 rows to NVFP4 itself",
    accepts=frozenset({B, F4}),
    backends={"cuda_deepep": frozenset({N, LL}), "flashinfer_a2a": frozenset({N}), "torch": frozenset({N, LL})},
    probe=lambda: CuteDslExperts().probe(),
)


__all__ = ["CuteDslExperts", "RUNNER"]
