"""Expert compute between dispatch and combine: the ``ExpertKernel`` protocol and the torch reference that accepts
every wire dtype, both layouts and both group-list types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ._errors import InvalidInputError
from ._output import align_up, group_counts, group_starts, rows_by_expert
from ._wire import DispatchDtype, WireFormat, wire_dtype

if TYPE_CHECKING:
    from ._output import DispatchOutput


@runtime_checkable
class ExpertKernel(Protocol):
    """Runs a layer's local experts on dispatched rows, without the routing weights.

    ``needs_dispatch_dtype`` is the wire dtype its kernels must receive (None: any); an engine passes it as
    ``QuantHints(dispatcher_output_dtype=...)`` so resolution picks it.

    A kernel that wants each expert's PACKED rows at aligned starts (DeepGEMM's contiguous layout) has the engine pass
    ``DispatchSpec(expert_alignment=...)``, and takes the keyword ``expert_alignment`` (given only when above 1:
    ``moe_dispatch.run_experts``); its output keeps the input's rows, padding rows included (their values are ignored).
    """

    needs_dispatch_dtype: DispatchDtype | None

    def apply_without_routing_weights(
        self, layer: Any, hidden_states: torch.Tensor, hidden_states_scale: torch.Tensor | None,
        group_list_type: int, group_list: torch.Tensor, output_dtype: torch.dtype, *, global_scale: float | None = None,
    ) -> torch.Tensor:
        """gmm1 → SwiGLU → gmm2 per local expert; rows keep their positions (PACKED ``[rows, H]`` or MASKED
        ``[E_local, capacity, H]``)."""
        ...


@dataclass
class ExpertWeights:
    """A layer's local experts, in the attribute names engines use: ``w13_weight`` ``[E_local, 2I, H]`` (gate rows,
    then up rows), ``w2_weight`` ``[E_local, H, I]``; bf16/fp32, or int8 with per-output-channel fp32 scales
    ``w13_weight_scale`` ``[E_local, 2I]`` and ``w2_weight_scale`` ``[E_local, H]`` (W8A8)."""

    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    w13_weight_scale: torch.Tensor | None = None
    w2_weight_scale: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13_weight.shape[0])

    def slice(self, first: int, count: int) -> "ExpertWeights":
        """The experts ``first .. first+count-1`` (a rank's share of a global layer)."""
        rows = slice(first, first + count)
        scales = [None if t is None else t[rows] for t in (self.w13_weight_scale, self.w2_weight_scale)]
        return ExpertWeights(self.w13_weight[rows], self.w2_weight[rows], *scales)


def dequantized_weights(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``w13``, ``w2`` of a layer, applying per-channel scales to int8 weights."""
    w13, w2 = layer.w13_weight, layer.w2_weight
    if w13.dtype == torch.int8:
        w13 = w13.float() * layer.w13_weight_scale.float().unsqueeze(-1)
    if w2.dtype == torch.int8:
        w2 = w2.float() * layer.w2_weight_scale.float().unsqueeze(-1)
    return w13.float(), w2.float()


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchExperts:
    """The reference expert kernel: dequantize, then fp32 gmm1 → SwiGLU → gmm2. Takes PACKED rows at any
    ``expert_alignment``, with worst-case rows past the segments (padding rows come out zero)."""

    needs_dispatch_dtype: DispatchDtype | None = None

    def apply_without_routing_weights(
        self, layer: Any, hidden_states: torch.Tensor, hidden_states_scale: torch.Tensor | None,
        group_list_type: int, group_list: torch.Tensor, output_dtype: torch.dtype, *, global_scale: float | None = None,
        expert_alignment: int = 1,
    ) -> torch.Tensor:
        if not isinstance(group_list, torch.Tensor) or group_list.dim() != 1:
            raise InvalidInputError("needs one entry per local expert", parameter="group_list", value=group_list,
                                    allowed="[E_local]")
        for name in ("w13_weight", "w2_weight"):  # a layer not sliced to this rank holds all E experts
            if (held := int(getattr(layer, name).shape[0])) != (local := group_list.shape[0]):
                raise InvalidInputError(f"holds {held} experts, but the dispatch output has {local} local experts "
                                        f"(one group-list entry each); give each rank its own experts: "
                                        f"ExpertWeights.slice(rank * {local}, {local})", parameter=f"layer.{name}",
                                        value=held, allowed=f"{local} (E_local)")
        w13, w2 = dequantized_weights(layer)
        experts, hidden = w13.shape[0], w13.shape[2]
        x = dequantize_rows(hidden_states, hidden_states_scale, hidden, global_scale)
        counts = group_counts(group_list.to(torch.int64), group_list_type, expert_alignment)
        if hidden_states.dim() == 3:  # MASKED [E_local, capacity, H]
            if hidden_states.shape[0] != experts:
                raise InvalidInputError("masked layout needs one block per local expert", parameter="hidden_states",
                                        value=hidden_states, allowed=f"[{experts}, capacity, {hidden}]")
            out = torch.bmm(swiglu(torch.bmm(x, w13.transpose(1, 2))), w2.transpose(1, 2))
            valid = torch.arange(x.shape[1], device=x.device).unsqueeze(0) < counts.unsqueeze(1)
            return torch.where(valid.unsqueeze(-1), out, 0.0).to(output_dtype)
        starts = group_starts(counts, expert_alignment)
        span = int(align_up(counts, expert_alignment).sum())
        if bool((counts < 0).any()) or span > x.shape[0]:  # rows past the segments: padding (low latency's worst case)
            layout = f" in segments aligned to {expert_alignment} rows" if expert_alignment > 1 else ""
            raise InvalidInputError(f"counts sum to {int(counts.sum())}{layout} ({span} rows) but there are "
                                    f"{x.shape[0]} rows", parameter="group_list", value=group_list.tolist(),
                                    allowed="per-expert counts >= 0 whose segments fit the rows")
        out = torch.zeros(x.shape[0], hidden, dtype=output_dtype, device=x.device)
        for e, (start, n) in enumerate(zip(starts.tolist(), counts.tolist())):
            if n:
                out[start : start + n] = (swiglu(x[start : start + n] @ w13[e].t()) @ w2[e].t()).to(output_dtype)
        return out


def dequantize_rows(hidden_states: torch.Tensor, scale: torch.Tensor | None, hidden: int,
                    global_scale: float | None = None) -> torch.Tensor:
    """Dispatched rows in any wire dtype back to fp32 ``[..., H]``."""
    from ._codecs import Quantized, dispatch_dtype_of, make_codec  # the codecs load with the first dispatch
    dtype = dispatch_dtype_of(hidden_states)
    if wire_dtype(dtype).scaled and scale is None:
        raise InvalidInputError(f"{dtype.value} rows need their scales", parameter="hidden_states_scale", value=None,
                                allowed="a tensor")
    if wire_dtype(dtype).global_scale and global_scale is None:
        raise InvalidInputError(f"{dtype.value} rows need the dispatcher's global scale", parameter="global_scale",
                                value=None, allowed="DispatchOutput.global_scale")
    return make_codec(WireFormat(dtype, hidden), global_scale).dequantize(Quantized(hidden_states, scale))


def token_major_experts(experts: ExpertKernel, layer: Any, out: "DispatchOutput") -> torch.Tensor:
    """TOKEN_MAJOR rows through a kernel of PACKED rows: one row per (row, local expert), the outputs weighted and
    added per row in ascending expert order (the bits PACKED's combine adds)."""
    ids, rows = out.row_topk_ids, out.hidden_states
    assert ids is not None and out.row_topk_weights is not None
    row_slot, counts = rows_by_expert(ids, len(out.group_list))
    row = torch.div(row_slot, ids.shape[1], rounding_mode="floor")
    raw = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # bytes: float8 index kernels vary by device
    scale = out.hidden_states_scale
    y = experts.apply_without_routing_weights(
        layer, raw.index_select(0, row).view(rows.dtype), None if scale is None else scale.index_select(0, row), 1,
        counts, torch.bfloat16, global_scale=out.global_scale)
    weighted = y.float() * out.row_topk_weights.reshape(-1).index_select(0, row_slot).unsqueeze(1)
    return torch.zeros(len(rows), y.shape[1], device=y.device).index_add_(0, row, weighted).to(torch.bfloat16)

