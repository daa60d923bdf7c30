"""``DispatchSpec``: everything about one MoE layer's dispatch, fixed at creation; ``QuantHints``: what the layer's
quantization method tells the dispatcher (typed, instead of a dict)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import math
import numbers
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from ._errors import InvalidSpecError
from ._wire import DispatchDtype, Layout, Mode, WireFormat, wire_dtype

_FP32_TINY, _FP32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
#: The largest ``expert_alignment``: every local expert may add alignment - 1 padding rows per call.
MAX_EXPERT_ALIGNMENT = 1024


def check_global_scale(global_scale: object, parameter: str = "quant.input_global_scale") -> float:
    """NVFP4's global scale as one positive finite float: a Python or numpy real number, or a 1-element floating-point
    tensor or numpy array on the CPU, read once, here, at creation (a tensor on a device is the engine's to read, with
    ``float(t)``, where a sync is safe)."""
    allowed = "a positive finite float (448*6/amax), or a 1-element floating-point tensor on the CPU"
    value = global_scale
    if getattr(getattr(value, "dtype", None), "kind", "") == "f" and getattr(value, "size", 0) == 1:
        value = value.item()  # a numpy float scalar or array of one element
    if isinstance(value, torch.Tensor):
        why = (f"is on {value.device}, not the CPU" if value.device.type != "cpu" else
               "NVFP4 needs one scalar global scale for the whole dispatch" if value.numel() != 1 else
               f"must be a floating-point tensor, not {value.dtype}" if not value.is_floating_point() else "")
        if why:
            raise InvalidSpecError(why, parameter=parameter, value=global_scale, allowed=allowed)
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidSpecError(f"must be a number, not {type(value).__name__}", parameter=parameter,
                               value=global_scale, allowed=allowed)
    try:
        scale = float(value)
    except OverflowError:
        scale = math.inf
    if not math.isfinite(scale) or scale <= 0:
        raise InvalidSpecError("must be positive and finite", parameter=parameter, value=value, allowed=allowed)
    if not _FP32_TINY <= scale <= _FP32_MAX:  # the codecs compute in fp32: 1e39 is inf there, 1e-320 is 0
        raise InvalidSpecError("is outside float32's normal range, where the quantization computes (it would give "
                               "inf, NaN or all-zero rows)", parameter=parameter, value=value,
                               allowed=f"{_FP32_TINY:.3g} .. {_FP32_MAX:.3g} (448*6/amax of the activations)")
    return scale


def as_int(name: str, value: object, allowed: str, what: str = "must be an int") -> int:
    """An int or what ``operator.index`` takes (numpy integers), as an int; never a bool, a float or a tensor."""
    if not isinstance(value, (bool, torch.Tensor)):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - any other kind is refused below
            pass
    raise InvalidSpecError(f"{what}, not {type(value).__name__}", parameter=name, value=value, allowed=allowed)


def plain(value: Any) -> Any:
    """JSON-ready: a dataclass as a dict of all its fields, enums by value, sets sorted, mappings sorted by key."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in sorted((plain(k), v) for k, v in value.items())}
    return value


@dataclass(frozen=True)
class QuantHints:
    """What the quantization method of a layer tells the dispatcher.

    :param dispatcher_output_dtype: the wire dtype the layer's expert kernel needs (e.g. INT8 for W8A8, BF16 for
        W4A16); None lets later steps decide.
    :param input_global_scale: NVFP4 activation global scale (FlashInfer: 448·6/amax). Its presence asks for NVFP4
        dispatch.
    :param fp8_ue8m0_scales: FP8 scales rounded to powers of two and sent as one exponent byte (DeepGEMM on
        Blackwell wants UE8M0).
    """

    dispatcher_output_dtype: DispatchDtype | None = None
    input_global_scale: float | None = None
    fp8_ue8m0_scales: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatcher_output_dtype",
                           DispatchDtype.parse(self.dispatcher_output_dtype, "quant.dispatcher_output_dtype"))
        if self.input_global_scale is not None:
            object.__setattr__(self, "input_global_scale", check_global_scale(self.input_global_scale))
        if not isinstance(self.fp8_ue8m0_scales, bool):
            raise InvalidSpecError("must be a bool", parameter="quant.fp8_ue8m0_scales", value=self.fp8_ue8m0_scales,
                                   allowed="True, False")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QuantHints":
        """Build from the dict an engine's quant method used to hand over; an unknown key's error names the nearest."""
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {close[0]}?" if close else "no similar key"
                raise InvalidSpecError(f"unknown quant hint ({hint})", parameter="quant", value=key,
                                       allowed=", ".join(known))
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return plain(self)


def _positive_int(name: str, value: Any) -> int:
    if (number := as_int(name, value, "1, 2, 3, ...", "must be a positive int")) <= 0:
        raise InvalidSpecError("must be a positive int", parameter=name, value=value, allowed="1, 2, 3, ...")
    return number


@dataclass(frozen=True)
class DispatchSpec:
    """One layer's dispatch, immutable.

    :param hidden_size: H, the activation width.
    :param num_experts: E, routed experts over the whole EP group.
    :param top_k: experts per token.
    :param num_max_dispatch_tokens_per_rank: T, the most tokens one rank may dispatch in one call; low-latency mode
        sizes its fixed exchanges from it.
    :param mode: ``"normal"`` or ``"low_latency"``.
    :param output_dtype: the wire dtype, or ``"auto"`` to let resolution decide.
    :param quant: hints from the layer's quantization method.
    :param runner: the expert-kernel family that consumes the output (``"torch"``, ``"deep_gemm"``,
        ``"flashinfer_cutedsl"``, ``"npu_w8a8"``, ...).
    :param group_list_type: 0 = cumulative offsets (each expert's end), 1 = per-expert counts.
    :param expert_alignment: PACKED rows with each local expert's rows starting at a multiple of this many rows, the
        gaps zero-filled (DeepGEMM's contiguous layout wants its ``get_mk_alignment_for_contiguous_layout()``, 128):
        1 = dense. A backend that cannot write that layout itself has the core copy its rows into it
        (``Dispatcher.alignment`` says which); MASKED outputs ignore it.
    :param layout: the output layout the engine reads: None (the backend's for the mode, MASKED or PACKED), or one the
        backend writes in the mode (``Capabilities.layouts_for``), e.g. ``"token_major"`` (each received token once:
        DeepEP's normal layout, sglang's and vLLM's token-major formats).
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
    layout: Layout | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "num_max_dispatch_tokens_per_rank"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.top_k > self.num_experts:
            raise InvalidSpecError("top_k cannot exceed the number of experts", parameter="top_k", value=self.top_k,
                                   allowed=f"1..num_experts ({self.num_experts})")
        object.__setattr__(self, "mode", Mode.parse(self.mode))
        object.__setattr__(self, "output_dtype", DispatchDtype.parse(self.output_dtype))
        if isinstance(self.quant, Mapping):
            object.__setattr__(self, "quant", QuantHints.from_dict(self.quant))
        elif not isinstance(self.quant, QuantHints):
            raise InvalidSpecError("must be QuantHints or a dict of its fields", parameter="quant", value=self.quant,
                                   allowed="QuantHints")
        if self.runner is not None and (not isinstance(self.runner, str) or not self.runner):
            raise InvalidSpecError("must be a non-empty str or None", parameter="runner", value=self.runner,
                                   allowed="None, or an expert-kernel family name such as 'torch', 'deep_gemm', "
                                           "'npu_w8a8'")
        kinds = "0 (cumulative offsets), 1 (per-expert counts)"
        object.__setattr__(self, "group_list_type", as_int("group_list_type", self.group_list_type, kinds))
        if self.group_list_type not in (0, 1):
            raise InvalidSpecError("unknown group_list_type", parameter="group_list_type", value=self.group_list_type,
                                   allowed=kinds)
        rows = f"an int in 1..{MAX_EXPERT_ALIGNMENT} (1: dense; DeepGEMM's contiguous layout: 128)"
        object.__setattr__(self, "expert_alignment", as_int("expert_alignment", self.expert_alignment, rows))
        if not 1 <= self.expert_alignment <= MAX_EXPERT_ALIGNMENT:
            raise InvalidSpecError("must be the row multiple each local expert's rows start at",
                                   parameter="expert_alignment", value=self.expert_alignment, allowed=rows)
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        if self.layout is Layout.TOKEN_MAJOR and (self.mode is not Mode.NORMAL or self.expert_alignment > 1):
            raise InvalidSpecError("token-major rows are normal mode's and dense (each received token once)",
                                   parameter="layout", value=self.layout.value,
                                   allowed="token_major with mode normal and expert_alignment 1")

    def with_dtype(self, dtype: DispatchDtype) -> "DispatchSpec":
        """The same spec with a concrete wire dtype (what backends size buffers for)."""
        return dataclasses.replace(self, output_dtype=dtype)

    def wire_format(self, dtype: DispatchDtype | None = None) -> WireFormat:
        dtype = dtype or self.output_dtype
        if dtype is None:
            raise InvalidSpecError("the wire dtype is not resolved yet", parameter="output_dtype", value="auto",
                                   allowed="a concrete dtype")
        return WireFormat(dtype, self.hidden_size,
                          ue8m0=self.quant.fp8_ue8m0_scales and wire_dtype(dtype).ue8m0_scale_bytes > 0)

    def local_experts(self, world_size: int) -> int:
        """Experts per rank; E must divide evenly."""
        if world_size <= 0 or self.num_experts % world_size:
            raise InvalidSpecError(f"experts must divide evenly over {world_size} ranks", parameter="num_experts",
                                   value=self.num_experts, allowed=f"a multiple of the world size ({world_size})")
        return self.num_experts // world_size

    def to_dict(self) -> dict[str, Any]:
        """Every field, in declaration order, as plain values (``output_dtype`` None as "auto"): what
        ``explain --json`` prints and, resolved, what every rank must agree on at creation."""
        return {**plain(self), "output_dtype": "auto" if self.output_dtype is None else self.output_dtype.value}

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, hidden_size: int, num_experts: int, top_k: int,
                  quant: QuantHints | Mapping[str, Any] | None = None, runner: str | None = None,
                  expert_alignment: int = 1) -> "DispatchSpec":
        """Build from the flags ``add_cli_args`` added; the model's shape comes from the model config, the per-layer
        hints from its quant method, the alignment from its expert kernel."""
        return cls(hidden_size=hidden_size, num_experts=num_experts, top_k=top_k,
                   num_max_dispatch_tokens_per_rank=args.num_max_dispatch_tokens_per_rank, mode=args.dispatch_mode,
                   output_dtype=args.dispatch_output_dtype, quant=quant if quant is not None else QuantHints(),
                   runner=runner if runner is not None else args.dispatch_runner, expert_alignment=expert_alignment)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags for expert-parallel dispatch to ``parser``. ``DispatchSpec.from_args`` reads the spec's;
    the other two are ``create_dispatcher(args.moe_a2a_backend, spec, strict=args.dispatch_strict)``'s."""
    group = parser.add_argument_group("MoE dispatch (moe-dispatch)")
    group.add_argument("--moe-a2a-backend", default="torch", help="dispatch backend name (see `moe-dispatch backends`)")
    group.add_argument("--dispatch-output-dtype", default="auto", choices=["auto", *(d.value for d in DispatchDtype)],
                       help="wire dtype of dispatched activations; auto resolves it per layer")
    group.add_argument("--dispatch-mode", default="normal", choices=[m.value for m in Mode])
    group.add_argument("--num-max-dispatch-tokens-per-rank", type=int, default=128,
                       help="the most tokens one rank dispatches in one call (low-latency capacity)")
    group.add_argument("--dispatch-runner", default=None, help="expert-kernel family consuming the output")
    group.add_argument("--dispatch-strict", action="store_true",
                       help="make any dtype fallback an error instead of a warning")
    return parser
