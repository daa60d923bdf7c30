"""``DispatchSpec``: everything about one MoE layer's dispatch, fixed at creation."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from .dtypes import DispatchDtype, Mode
from .errors import InvalidSpecError
from .hints import QuantHints
from .formats import wire_dtype
from .wire import WireFormat

#: The largest ``expert_alignment``: every local expert may add alignment - 1 padding rows per call.
MAX_EXPERT_ALIGNMENT = 1024


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpecError("must be a positive int", parameter=name, value=value, allowed="1, 2, 3, ...")
    return value


@dataclass(frozen=True)
class DispatchSpec:
    """One layer's dispatch, immutable.

    :param hidden_size: H, the activation width.
    :param num_experts: E, routed experts over the whole EP group.
    :param top_k: experts per token.
    :param num_max_dispatch_tokens_per_rank: T, the most tokens one rank may dispatch in
        one call; low-latency mode sizes its fixed exchanges from it.
    :param mode: ``"normal"`` or ``"low_latency"``.
    :param output_dtype: the wire dtype, or ``"auto"`` to let resolution decide.
    :param quant: hints from the layer's quantization method.
    :param runner: the expert-kernel family that consumes the output (``"torch"``,
        ``"deep_gemm"``, ``"flashinfer_cutedsl"``, ``"npu_w8a8"``, ...).
    :param group_list_type: 0 = cumulative offsets (each expert's end), 1 = per-expert counts.
    :param expert_alignment: PACKED rows with each local expert's rows starting at a multiple of
        this many rows, the gaps zero-filled (DeepGEMM's contiguous layout wants its
        ``get_mk_alignment_for_contiguous_layout()``, 128): 1 = dense. A backend that cannot write
        that layout itself has the core copy its rows into it (``Dispatcher.alignment`` says
        which); MASKED outputs ignore it.
    """

    hidden_size: int
    num_experts: int
    top_k: int
    num_max_dispatch_tokens_per_rank: int = 128
    mode: Mode = Mode.NORMAL
    output_dtype: DispatchDtype | None = None
    quant: QuantHints = field(default_factory=QuantHints)
    runner: str | None = None
    group_list_type: int = 1
    expert_alignment: int = 1

    def __post_init__(self) -> None:
        _positive_int("hidden_size", self.hidden_size)
        _positive_int("num_experts", self.num_experts)
        _positive_int("top_k", self.top_k)
        _positive_int("num_max_dispatch_tokens_per_rank", self.num_max_dispatch_tokens_per_rank)
        if self.top_k > self.num_experts:
            raise InvalidSpecError(
                "top_k cannot exceed the number of experts",
                parameter="top_k",
                value=self.top_k,
                allowed=f"1..num_experts ({self.num_experts})",
            )
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "output_dtype", DispatchDtype.parse(self.output_dtype))
        if isinstance(self.quant, Mapping):
            object.__setattr__(self, "quant", QuantHints.from_dict(self.quant))
        elif not isinstance(self.quant, QuantHints):
            raise InvalidSpecError(
                "must be QuantHints or a dict of its fields", parameter="quant", value=self.quant, allowed="QuantHints"
            )
        if self.runner is not None and (not isinstance(self.runner, str) or not self.runner):
            raise InvalidSpecError(
                "must be a non-empty str or None",
                parameter="runner",
                value=self.runner,
                allowed="None, or an expert-kernel family name such as 'torch', 'deep_gemm', 'npu_w8a8'",
            )
        if isinstance(self.group_list_type, bool) or self.group_list_type not in (0, 1):
            raise InvalidSpecError(
                "unknown group_list_type",
                parameter="group_list_type",
                value=self.group_list_type,
                allowed="0 (cumulative offsets), 1 (per-expert counts)",
            )
        if (isinstance(self.expert_alignment, bool) or not isinstance(self.expert_alignment, int)
                or not 1 <= self.expert_alignment <= MAX_EXPERT_ALIGNMENT):
            raise InvalidSpecError(
                "must be the row multiple each local expert's rows start at",
                parameter="expert_alignment",
                value=self.expert_alignment,
                allowed=f"an int in 1..{MAX_EXPERT_ALIGNMENT} (1: dense; DeepGEMM's contiguous layout: 128)",
            )

    def with_dtype(self, dtype: DispatchDtype) -> "DispatchSpec":
        """The same spec with a concrete wire dtype (what backends size buffers for)."""
        return dataclasses.replace(self, output_dtype=dtype)

    def wire_format(self, dtype: DispatchDtype | None = None) -> WireFormat:
        dtype = dtype or self.output_dtype
        if dtype is None:
            raise InvalidSpecError(
                "the wire dtype is not resolved yet", parameter="output_dtype", value="auto", allowed="a concrete dtype"
            )
        ue8m0 = self.quant.fp8_ue8m0_scales and wire_dtype(dtype).ue8m0_scale_bytes > 0
        return WireFormat(dtype, self.hidden_size, ue8m0=ue8m0)

    def local_experts(self, world_size: int) -> int:
        """Experts per rank; E must divide evenly."""
        if world_size <= 0 or self.num_experts % world_size:
            raise InvalidSpecError(
                f"experts must divide evenly over {world_size} ranks",
                parameter="num_experts",
                value=self.num_experts,
                allowed=f"a multiple of the world size ({world_size})",
            )
        return self.num_experts // world_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_max_dispatch_tokens_per_rank": self.num_max_dispatch_tokens_per_rank,
            "mode": self.mode.value,
            "output_dtype": "auto" if self.output_dtype is None else self.output_dtype.value,
            "quant": self.quant.to_dict(),
            "runner": self.runner,
            "group_list_type": self.group_list_type,
            "expert_alignment": self.expert_alignment,
        }

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        quant: QuantHints | Mapping[str, Any] | None = None,
        runner: str | None = None,
        expert_alignment: int = 1,
    ) -> "DispatchSpec":
        """Build from the flags ``add_cli_args`` added; the model's shape comes from the
        model config, the per-layer hints from its quant method, the alignment from its expert kernel."""
        return cls(
            hidden_size=hidden_size,
            num_experts=num_experts,
            top_k=top_k,
            num_max_dispatch_tokens_per_rank=args.num_max_dispatch_tokens_per_rank,
            mode=args.dispatch_mode,
            output_dtype=args.dispatch_output_dtype,
            quant=quant if quant is not None else QuantHints(),
            runner=runner if runner is not None else args.dispatch_runner,
            expert_alignment=expert_alignment,
        )


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags for expert-parallel dispatch to ``parser``."""
    group = parser.add_argument_group("MoE dispatch (moe-dispatch)")
    group.add_argument("--moe-a2a-backend", default="torch", help="dispatch backend name (see `moe-dispatch backends`)")
    group.add_argument(
        "--dispatch-output-dtype",
        default="auto",
        choices=["auto", *(d.value for d in DispatchDtype)],
        help="wire dtype of dispatched activations; auto resolves it per layer",
    )
    group.add_argument("--dispatch-mode", default="normal", choices=[m.value for m in Mode])
    group.add_argument(
        "--num-max-dispatch-tokens-per-rank",
        type=int,
        default=128,
        help="the most tokens one rank dispatches in one call (low-latency capacity)",
    )
    group.add_argument("--dispatch-runner", default=None, help="expert-kernel family consuming the output")
    group.add_argument(
        "--dispatch-strict", action="store_true", help="make any dtype fallback an error instead of a warning"
    )
    return parser


__all__ = ["DispatchSpec", "add_cli_args"]
