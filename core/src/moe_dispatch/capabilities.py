"""What a backend can do, as data: the dtype table, limits, and features.

The conformance kit reads these to pick its tests, ``moe-dispatch backends`` prints them,
and ``Backend.validate_dtype`` decides from them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from .dtypes import DispatchDtype, Mode


@dataclass(frozen=True)
class Fallback:
    """Replace a dtype the hardware cannot send by one it can, for a stated reason."""

    to: DispatchDtype
    reason: str


@dataclass(frozen=True)
class DtypeDecision:
    """A backend's verdict on a wire dtype: accept it, replace it (a recorded fallback), or reject it."""

    kind: Literal["accept", "fallback", "reject"]
    dtype: DispatchDtype
    reason: str = ""


@dataclass(frozen=True)
class Limits:
    """Shape limits of one mode, checked at dispatcher creation.

    :param max_tokens_per_rank: ceiling on ``num_max_dispatch_tokens_per_rank``.
    :param hidden_sizes: the only hidden sizes the kernels are built for (None: any).
    :param hidden_multiple: the hidden size must be a multiple of this.
    :param min_hidden: / :param max_hidden: inclusive bounds on the hidden size.
    :param max_top_k: the most experts per token.
    :param max_buffer_bytes: the most bytes one buffer may take.
    :param world_sizes: the EP sizes this mode runs on (None: any the backend supports). Vendors
        differ per mode: DeepEP's normal mode needs a tuned config per EP size while its
        low-latency mode runs on any.
    """

    max_tokens_per_rank: int | None = None
    hidden_sizes: frozenset[int] | None = None
    hidden_multiple: int = 1
    min_hidden: int | None = None
    max_hidden: int | None = None
    max_top_k: int | None = None
    max_buffer_bytes: int | None = None
    world_sizes: frozenset[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "hidden_sizes": None if self.hidden_sizes is None else sorted(self.hidden_sizes),
            "hidden_multiple": self.hidden_multiple,
            "min_hidden": self.min_hidden,
            "max_hidden": self.max_hidden,
            "max_top_k": self.max_top_k,
            "max_buffer_bytes": self.max_buffer_bytes,
            "world_sizes": None if self.world_sizes is None else sorted(self.world_sizes),
        }


@dataclass(frozen=True)
class Capabilities:
    """A backend's declared abilities.

    :param dtypes: per mode, the wire dtypes accepted as they are. A mode that is absent is
        not supported.
    :param fallbacks: per (mode, dtype), the dtype sent instead and why.
    :param rejections: per dtype, why it is rejected (the message users see).
    :param default_dtype: the backend's default wire dtype (resolution step 6).
    :param combine_dtype: what combine sends back.
    :param fused_forward: the backend replaces dispatch → experts → combine with one call.
    :param cuda_graph_modes: modes whose dispatch and combine make no host sync.
    :param split_phase: modes whose ``dispatch_start``/``combine_start`` return while the data is
        still on its way (``SplitPhaseBackendDispatcher``), so an engine overlaps them with other
        work; in the other modes the core runs the call to the end at start (``Pending.overlapped``
        is False).
    :param expert_alignment: modes whose PACKED rows the backend writes at the spec's
        ``expert_alignment`` itself (gaps zeroed); in the others the core copies them there.
    :param worst_case_rows: modes (low latency only) whose PACKED rows are the backend's worst
        case, the same count every call, the rows past the experts' segments unspecified
        (``DispatchOutput``, "Worst-case rows"); such a mode writes its own alignment (it is in
        ``expert_alignment``: the core's copy reads exact rows). Elsewhere the core holds PACKED
        rows to the segments' end.
    :param devices: device types it runs on (``"cpu"``, ``"cuda"``, ``"npu"``).
    :param limits: per mode, shape limits.
    :param fp8_ue8m0: FP8 with power-of-two (UE8M0) scales is supported.
    :param world_sizes: the EP sizes it supports in every mode (None: any); a mode narrows it
        with ``Limits.world_sizes``.
    """

    dtypes: Mapping[Mode, frozenset[DispatchDtype]]
    fallbacks: Mapping[tuple[Mode, DispatchDtype], Fallback] = field(default_factory=dict)
    rejections: Mapping[DispatchDtype, str] = field(default_factory=dict)
    default_dtype: DispatchDtype | None = None
    combine_dtype: DispatchDtype = DispatchDtype.BF16
    fused_forward: bool = False
    cuda_graph_modes: frozenset[Mode] = frozenset()
    split_phase: frozenset[Mode] = frozenset()
    expert_alignment: frozenset[Mode] = frozenset()
    worst_case_rows: frozenset[Mode] = frozenset()
    devices: frozenset[str] = frozenset({"cpu"})
    limits: Mapping[Mode, Limits] = field(default_factory=dict)
    fp8_ue8m0: bool = False
    world_sizes: frozenset[int] | None = None

    @property
    def modes(self) -> tuple[Mode, ...]:
        return tuple(m for m in Mode if m in self.dtypes)

    def limits_for(self, mode: Mode) -> Limits:
        return self.limits.get(mode, Limits())

    def world_sizes_for(self, mode: Mode) -> frozenset[int] | None:
        """The EP sizes ``mode`` runs on: the backend's, narrowed by the mode's limits (None: any)."""
        per_mode = self.limits_for(mode).world_sizes
        if self.world_sizes is None:
            return per_mode
        return self.world_sizes if per_mode is None else self.world_sizes & per_mode

    def decide(self, mode: Mode, dtype: DispatchDtype) -> DtypeDecision:
        """The table-driven verdict that ``Backend.validate_dtype`` returns by default."""
        accepted = self.dtypes.get(mode)
        if accepted is None:
            return DtypeDecision("reject", dtype, f"mode {mode.value} is not supported")
        if dtype in accepted:
            return DtypeDecision("accept", dtype)
        fallback = self.fallbacks.get((mode, dtype))
        if fallback is not None:
            return DtypeDecision("fallback", fallback.to, fallback.reason)
        reason = self.rejections.get(dtype) or f"{dtype.value} is not supported in {mode.value} mode"
        return DtypeDecision("reject", dtype, reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "modes": {m.value: sorted(d.value for d in self.dtypes[m]) for m in self.modes},
            "fallbacks": [
                {"mode": m.value, "from": d.value, "to": f.to.value, "reason": f.reason}
                for (m, d), f in sorted(self.fallbacks.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))
            ],
            "rejections": {d.value: r for d, r in sorted(self.rejections.items(), key=lambda kv: kv[0].value)},
            "default_dtype": None if self.default_dtype is None else self.default_dtype.value,
            "combine_dtype": self.combine_dtype.value,
            "fused_forward": self.fused_forward,
            "cuda_graph_modes": sorted(m.value for m in self.cuda_graph_modes),
            "split_phase": sorted(m.value for m in self.split_phase),
            "expert_alignment": sorted(m.value for m in self.expert_alignment),
            "worst_case_rows": sorted(m.value for m in self.worst_case_rows),
            "devices": sorted(self.devices),
            "limits": {m.value: lim.to_dict() for m, lim in sorted(self.limits.items(), key=lambda kv: kv[0].value)},
            "fp8_ue8m0": self.fp8_ue8m0,
            "world_sizes": None if self.world_sizes is None else sorted(self.world_sizes),
        }


@dataclass(frozen=True)
class EnvRequirement:
    """An environment variable a backend reads when it creates its dispatcher and that must be
    at least ``minimum`` for a spec (Ascend: ``HCCL_BUFFSIZE`` in MB, the HCCL window).

    A backend states these by implementing ``env_requirements(spec, world_size)``; the planner
    compares them with the ``env`` it was given.

    :param default: the value the vendor uses when the variable is unset (None: no default).
    """

    variable: str
    minimum: int
    unit: str
    default: int | None = None
    reason: str = ""



__all__ = ["EnvRequirement", "Capabilities", "DtypeDecision", "Fallback", "Limits"]
