"""Everything a backend plugin may use: the one module a plugin imports besides ``moe_dispatch``.

A plugin is a module named by an entry point in the ``moe_dispatch.backends`` group; it sets
``MOE_DISPATCH_API = API_VERSION`` and registers through the hooks (``@hookimpl``)::

    Backend            describes itself (name, Capabilities, probe), checks a spec, sizes its buffers
      └ create(DispatchContext) ─► BackendDispatcher: dispatch ─► DispatchOutput, combine ─► bf16 [T, H]
                                   (SplitPhaseBackendDispatcher: *_start ─► Pending; FusedBackendDispatcher)

The rest are the pieces the built-in and vendor backends share: the counted ``Comm`` over a process group, the wire
codecs (bit-exact with the vendors' kernels), group-list and row helpers, scale layouts, the CUDA stream hand-over of
split calls, and the vendor-boundary helpers a plugin's ``vendor.py`` uses (``VendorSignature``, ``restored_environ``).
The helpers only vendor adapters use are defined here, so a dispatch on the built-ins never loads them.
docs/writing-a-backend.md walks through a backend; the conformance kit (``moe-dispatch-testing``) tests one.
"""

from __future__ import annotations

import torch

from ._alignment import align_rows
from ._codecs import (
    E2M1_MAX,
    FP8_MAX,
    Codec,
    INT8Codec,
    NVFP4Codec,
    Quantized,
    as_bytes,
    e2m1_unpack,
    from_bytes,
    make_codec,
    pow2_ceil,
    ue8m0_value,
    unpack_ue8m0,
)
from ._contract import (
    Backend,
    BackendDispatcher,
    BufferSize,
    Capabilities,
    DispatchContext,
    DtypeDecision,
    EnvRequirement,
    Fallback,
    FusedBackendDispatcher,
    Limits,
    RunnerInfo,
    SplitPhaseBackendDispatcher,
)
from ._distributed.comm import DEFAULT_TIMEOUT_S, Comm, Traffic, check_timeout
from ._environ import restored_environ
from ._experts import ExpertWeights, dequantize_rows, dequantized_weights, swiglu
from ._hookspecs import API_VERSION, Command, hookimpl
from ._output import align_up, group_counts, group_list_from_counts, group_starts, rows_by_expert
from ._scale_layouts import from_mma_view, swizzle_128x4, swizzled_shape, to_mma_view, unswizzle_128x4
from ._signatures import REQUIRED, Param, VendorSignature
from ._streams import StartMark, hand_over, handed_over, keep_on_current, start_mark
from ._wire import WireFormat, wire_dtype


def row_experts(counts: torch.Tensor, expert_alignment: int, rows: int) -> torch.Tensor:
    """int64 ``[rows]``: the local expert each PACKED row belongs to, -1 for padding rows (device ops only, no host
    sync). A zero-count expert shares its start with the next: the last expert starting at or before a row owns it."""
    counts = counts.to(torch.int64)
    starts = group_starts(counts, expert_alignment)
    index = torch.arange(rows, device=counts.device)
    expert = (torch.searchsorted(starts, index, right=True) - 1).clamp(min=0)
    return torch.where(index < starts[expert] + counts[expert], expert, -1) if counts.numel() else index.new_full(
        (rows,), -1)


def sum_weighted_rows(expert_rows: torch.Tensor, row_token: torch.Tensor, row_weight: torch.Tensor,
                      num_tokens: int) -> torch.Tensor:
    """fp32 ``[num_tokens, H]``: each expert row times its routing weight, added into its received token in row
    order. For vendors whose combine only adds (DeepEP normal mode, FlashInfer's MoE all-to-all)."""
    out = torch.zeros(num_tokens, expert_rows.shape[-1], dtype=torch.float32, device=expert_rows.device)
    return out.index_add_(0, row_token, expert_rows.float() * row_weight.unsqueeze(1))


def kept_routing(t: torch.Tensor, caller: torch.Tensor) -> torch.Tensor:
    """``t``, made from the caller's routing tensor ``caller`` (a cast, ``contiguous()``), as the backend's own
    memory: a copy when it still is the caller's. For a vendor that reads the routing again at combine: an engine
    may overwrite its router outputs once dispatch has returned (CUDA-graph engines reuse them every step)."""
    return t.clone() if t.data_ptr() == caller.data_ptr() else t


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales ``[..., G]`` → int32 ``[..., ceil(G/4)]``, four biased exponent bytes per word,
    group ``4i`` in the low byte (DeepGEMM's SM100 scale format, which DeepEP's low-latency dispatch emits with
    ``use_ue8m0``; ``unpack_ue8m0`` is the inverse). Missing groups in the last word are zero."""
    exponent = (torch.frexp(scale.float()).exponent - 1 + 127).clamp(0, 254).to(torch.uint8)
    return from_bytes(torch.nn.functional.pad(exponent, (0, -exponent.shape[-1] % 4)), torch.int32)


def nvfp4_global_scale(amax: float) -> float:
    """FlashInfer's convention for the activation global scale: 448·6/amax."""
    return FP8_MAX * E2M1_MAX / max(float(amax), 1e-12)


def quantize_weights_w8a8(weights: ExpertWeights) -> ExpertWeights:
    """Symmetric int8 per output channel (the W8A8 weight format)."""

    def q(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = w.float().abs().amax(dim=-1).clamp_min(1e-10) / 127.0
        return torch.round(w.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale

    (w13, s13), (w2, s2) = q(weights.w13_weight), q(weights.w2_weight)
    return ExpertWeights(w13, w2, s13, s2)


__all__ = [
    "API_VERSION", "DEFAULT_TIMEOUT_S", "FP8_MAX", "REQUIRED", "Backend", "BackendDispatcher", "BufferSize",
    "Capabilities", "Codec", "Comm", "Command", "DispatchContext", "DtypeDecision", "EnvRequirement", "Fallback",
    "FusedBackendDispatcher", "INT8Codec", "Limits", "NVFP4Codec", "Param", "Quantized", "RunnerInfo",
    "SplitPhaseBackendDispatcher", "StartMark", "Traffic", "VendorSignature", "WireFormat", "align_rows", "align_up",
    "as_bytes", "check_timeout", "dequantize_rows", "dequantized_weights", "e2m1_unpack", "from_bytes",
    "from_mma_view", "group_counts", "group_list_from_counts", "group_starts", "hand_over", "handed_over", "hookimpl",
    "keep_on_current", "kept_routing", "make_codec", "nvfp4_global_scale", "pack_ue8m0", "pow2_ceil",
    "quantize_weights_w8a8", "restored_environ", "row_experts", "rows_by_expert", "start_mark", "sum_weighted_rows",
    "swiglu", "swizzle_128x4", "swizzled_shape", "to_mma_view", "ue8m0_value", "unswizzle_128x4", "unpack_ue8m0",
    "wire_dtype",
]
