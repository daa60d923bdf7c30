"""What a backend is: ``Backend`` (capabilities as data, checks, sizes, ``create``), the ``BackendDispatcher`` protocols
it creates, and the data they get (``DispatchContext``) and declare (``Capabilities``, ``Limits``, ``BufferSize``,
``RunnerInfo``). The ``Dispatcher`` calls a backend dispatcher directly: no plugin-manager call on the hot path."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import torch

from ._errors import CapacityError, InvalidSpecError
from ._output import DispatchOutput
from ._spec import DispatchSpec, plain
from ._wire import DispatchDtype, Layout, Mode

if TYPE_CHECKING:
    from ._codecs import Codec
    from ._distributed.comm import Comm
    from ._pending import Pending
    from ._trail import Resolution


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
    :param world_sizes: the EP sizes this mode runs on (None: any the backend supports); vendors differ per mode
        (DeepEP's normal mode needs a tuned config per EP size, its low-latency mode runs on any).
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
        return plain(self)


@dataclass(frozen=True)
class Capabilities:
    """A backend's declared abilities.

    :param dtypes: per mode, the wire dtypes accepted as they are. A mode that is absent is not supported.
    :param fallbacks: per (mode, dtype), the dtype sent instead and why.
    :param rejections: per dtype, why it is rejected (the message users see).
    :param default_dtype: the backend's default wire dtype (resolution step 6).
    :param combine_dtype: what combine sends back.
    :param fused_forward: the backend replaces dispatch → experts → combine with one call.
    :param cuda_graph_modes: modes whose dispatch and combine make no host sync.
    :param split_phase: modes whose ``dispatch_start``/``combine_start`` return while the data is still on its way
        (``SplitPhaseBackendDispatcher``), so an engine overlaps them with other work; in the other modes the core
        runs the call to the end at start (``Pending.overlapped`` is False).
    :param expert_alignment: modes whose PACKED rows the backend writes at the spec's ``expert_alignment`` itself
        (gaps zeroed); in the others the core copies them there.
    :param masked_modes: modes whose dispatch returns MASKED rows; PACKED elsewhere. ``expert_alignment`` does not
        apply to MASKED rows; the core refuses an output in the other layout (``PluginError`` naming ``layout``).
    :param token_major_modes: normal-mode only: modes whose dispatch returns TOKEN_MAJOR rows when the spec asks
        (``DispatchSpec(layout="token_major")``) and whose combine then takes one weighted row per received row.
    :param worst_case_rows: modes (low latency only) whose PACKED rows are the backend's worst case, the same count
        every call, the rows past the experts' segments unspecified (``DispatchOutput``, "Worst-case rows"); such a
        mode writes its own alignment (it is in ``expert_alignment``: the core's copy reads exact rows). Elsewhere
        the core holds PACKED rows to the segments' end.
    :param devices: device types it runs on (``"cpu"``, ``"cuda"``, ``"npu"``).
    :param limits: per mode, shape limits.
    :param fp8_ue8m0: FP8 with power-of-two (UE8M0) scales is supported.
    :param world_sizes: the EP sizes it supports in every mode (None: any); a mode narrows it with
        ``Limits.world_sizes``.
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
    masked_modes: frozenset[Mode] = frozenset()
    token_major_modes: frozenset[Mode] = frozenset()
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

    def layouts_for(self, mode: Mode) -> tuple[Layout, ...]:
        """The output layouts dispatch writes in ``mode``: its own (MASKED or PACKED) first, then TOKEN_MAJOR where
        declared."""
        own = Layout.MASKED if mode in self.masked_modes else Layout.PACKED
        return (own, Layout.TOKEN_MAJOR) if mode in self.token_major_modes else (own,)

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
        return DtypeDecision("reject", dtype,
                             self.rejections.get(dtype) or f"{dtype.value} is not supported in {mode.value} mode")

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain values (``dtypes`` as ``modes``, ``fallbacks`` as a list): ``backends --json``."""
        return {
            "modes": {m.value: sorted(d.value for d in self.dtypes[m]) for m in self.modes},
            "fallbacks": [{"mode": m.value, "from": d.value, "to": f.to.value, "reason": f.reason}
                          for (m, d), f in sorted(self.fallbacks.items())],  # str enums: sorted by value
            **{f.name: plain(getattr(self, f.name)) for f in fields(self)[2:]},
        }


@dataclass(frozen=True)
class EnvRequirement:
    """An environment variable a backend reads when it creates its dispatcher and that must be at least ``minimum``
    for a spec (Ascend: ``HCCL_BUFFSIZE`` in MB, the HCCL window), stated by ``Backend.env_requirements``; the
    planner compares it with the ``env`` it was given.

    :param default: the value the vendor uses when the variable is unset (None: no default).
    """

    variable: str
    minimum: int
    unit: str
    default: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class BufferSize:
    """Bytes a dispatcher needs, dispatch and combine accounted separately (combine is BF16 even when dispatch is
    FP8, so one cannot stand in for the other).

    :param allocated_bytes: what the backend really allocates, when that is not the sum: a vendor buffer shared by
        dispatch and combine (DeepEP) takes the larger of the two, plus whatever its layout adds. Must cover each of
        them.
    """

    dispatch_bytes: int
    combine_bytes: int
    notes: tuple[str, ...] = ()
    allocated_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.allocated_bytes is not None and self.allocated_bytes < max(self.dispatch_bytes, self.combine_bytes):
            raise ValueError(f"allocated_bytes {self.allocated_bytes:,} is smaller than dispatch "
                             f"({self.dispatch_bytes:,}) or combine ({self.combine_bytes:,})")

    @property
    def total_bytes(self) -> int:
        """Bytes allocated: ``allocated_bytes`` when given, else dispatch + combine."""
        return self.allocated_bytes if self.allocated_bytes is not None else self.dispatch_bytes + self.combine_bytes

    @property
    def largest_allocation(self) -> int:
        """The biggest single buffer (what ``max_buffer_bytes`` limits): the shared one, or dispatch's or combine's."""
        return max(self.dispatch_bytes, self.combine_bytes) if self.allocated_bytes is None else self.allocated_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"dispatch_bytes": self.dispatch_bytes, "combine_bytes": self.combine_bytes,
                "total_bytes": self.total_bytes, "shared": self.allocated_bytes is not None, "notes": list(self.notes)}


@dataclass(frozen=True)
class DispatchContext:
    """Everything ``Backend.create`` gets: the spec with its resolved dtype, the group wrapped in a byte-counting
    ``Comm``, and the codec of the wire format."""

    spec: DispatchSpec
    resolution: "Resolution"
    comm: "Comm"
    codec: "Codec"
    buffer_size: BufferSize
    device: torch.device
    options: dict[str, Any] = field(default_factory=dict)
    #: Calls the engine keeps in flight at once (two micro-batches: 2): how many sets of buffers a backend that
    #: reuses them should plan at creation (``create_dispatcher(in_flight=)``).
    in_flight: int = 2

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def dtype(self) -> DispatchDtype:
        return self.resolution.dtype

    @property
    def local_experts(self) -> int:
        return self.spec.local_experts(self.world_size)


@runtime_checkable
class BackendDispatcher(Protocol):
    """One spec on one group. Holds no state of a call: all that combine needs travels in ``DispatchOutput.handle``."""

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchOutput: ...

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor: ...


@runtime_checkable
class SplitPhaseBackendDispatcher(BackendDispatcher, Protocol):
    """What the dispatcher of a backend with ``capabilities.split_phase`` adds: each call in two halves. ``*_start``
    checks nothing the core has checked, issues the collectives (or the vendor's send kernels) and returns; the
    ``Pending``'s ``wait()`` receives and finishes. A started call's buffers stay its own until its ``wait()`` has
    returned, even when the engine starts the other micro-batch's calls meanwhile or drops the ``Pending``."""

    def dispatch_start(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> "Pending[DispatchOutput]": ...

    def combine_start(self, expert_output: torch.Tensor,
                      dispatch_output: DispatchOutput) -> "Pending[torch.Tensor]": ...


@runtime_checkable
class FusedBackendDispatcher(BackendDispatcher, Protocol):
    """What the dispatcher of a backend with ``capabilities.fused_forward`` adds: dispatch, the experts and combine
    in one call. ``Dispatcher.forward`` runs the core's input checks first and announces a failure to the peers."""

    def process_weights(self, weights: Any) -> Any:
        """The layer object ``fused_forward`` reads, built once at load time from this rank's ``ExpertWeights``: the
        vendor's layouts, or a typed error for a quantization scheme the fused op cannot take."""
        ...

    def fused_forward(self, layer: Any, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        """bf16 ``[T, H]``: the weighted sum of this rank's tokens' expert outputs."""
        ...


class Backend:
    """Base class of dispatch backends. Subclasses set ``name`` and ``capabilities`` and implement ``buffer_size``
    and ``create``; the rest has table-driven defaults."""

    name: str = ""
    capabilities: Capabilities
    description: str = ""
    #: What to install or configure when ``probe()`` says the backend cannot run here.
    install_hint: str = ""
    #: How this backend's buffers sized for a BF16 wire relate to what an engine (sglang) allocates for it;
    #: ``moe-dispatch plan`` prints it under its BF16 column ("": no engine counterpart).
    engine_sizing: str = ""
    #: The environment variables the vendor library reads (its ``vendor.py`` lists them): a plugin that changes one
    #: of them at import or in ``probe()`` steers this backend unseen, so the host leaves that plugin out.
    vendor_environment: tuple[str, ...] = ()

    def probe(self) -> str | None:
        """None if the backend can run on this machine, else why not."""
        return None

    def default_dtype(self, spec: DispatchSpec) -> DispatchDtype | None:
        """Resolution step 6: this backend's default wire dtype."""
        return self.capabilities.default_dtype

    def validate_dtype(self, dtype: DispatchDtype, spec: DispatchSpec) -> DtypeDecision:
        """Accept ``dtype``, replace it by a recorded fallback, or reject it."""
        return self.capabilities.decide(spec.mode, dtype)

    def check_spec(self, spec: DispatchSpec, world_size: int) -> None:
        """Raise a typed error when ``spec`` exceeds this backend's declared limits."""
        caps, mode, name = self.capabilities, spec.mode.value, self.name
        if spec.mode not in caps.dtypes:
            raise InvalidSpecError(f"backend {name!r} does not support this mode", parameter="mode", value=mode,
                                   allowed=", ".join(m.value for m in caps.modes))
        sizes = caps.world_sizes_for(spec.mode)
        if sizes is not None and world_size not in sizes:
            raise InvalidSpecError(f"backend {name!r} ({mode}) does not support this EP size", parameter="world_size",
                                   value=world_size, allowed=", ".join(map(str, sorted(sizes))))
        spec.local_experts(world_size)
        lim, t, h = caps.limits_for(spec.mode), spec.num_max_dispatch_tokens_per_rank, spec.hidden_size
        if lim.max_tokens_per_rank is not None and t > lim.max_tokens_per_rank:
            raise CapacityError(f"backend {name!r} ({mode}) handles at most {lim.max_tokens_per_rank} tokens per rank",
                                parameter="num_max_dispatch_tokens_per_rank", value=t,
                                allowed=f"1..{lim.max_tokens_per_rank}")
        if lim.hidden_sizes is not None and h not in lim.hidden_sizes:
            raise InvalidSpecError(f"backend {name!r} ({mode}) kernels are built for fixed hidden sizes",
                                   parameter="hidden_size", value=h,
                                   allowed=", ".join(map(str, sorted(lim.hidden_sizes))))
        if h % lim.hidden_multiple or not (lim.min_hidden or 1) <= h <= (lim.max_hidden or h):
            raise InvalidSpecError(
                f"backend {name!r} ({mode}) does not support this hidden size", parameter="hidden_size", value=h,
                allowed=f"multiples of {lim.hidden_multiple} in [{lim.min_hidden or 1}, {lim.max_hidden or 'inf'}]")
        if lim.max_top_k is not None and spec.top_k > lim.max_top_k:
            raise InvalidSpecError(f"backend {name!r} ({mode}) supports at most top-{lim.max_top_k}",
                                   parameter="top_k", value=spec.top_k, allowed=f"1..{lim.max_top_k}")

    def buffer_size(self, spec: DispatchSpec, world_size: int) -> BufferSize:
        """Bytes for ``spec`` (its ``output_dtype`` resolved) on ``world_size`` ranks, dispatch and combine apart."""
        raise NotImplementedError

    def env_requirements(self, spec: DispatchSpec, world_size: int) -> tuple["EnvRequirement", ...]:
        """Environment variables the vendor library reads that must be large enough for ``spec`` (e.g.
        ``HCCL_BUFFSIZE``): what ``moe-dispatch plan`` and ``plan_buffers`` check. None by default."""
        return ()

    def agreement(self, ctx: DispatchContext) -> Mapping[str, Any]:
        """What else every rank must agree on before ``create`` runs: the options and environment that decide a
        collective vendor call in ``create`` (a buffer's size, a shared buffer's mode). Compared field by field with
        the core's own fingerprint; a difference is a ``ConfigMismatchError`` on every rank instead of a hang inside
        the vendor's constructor. Values must be plain (numbers, strings, tuples, None). None by default."""
        return {}

    def create(self, ctx: DispatchContext) -> BackendDispatcher:
        """Build the per-layer dispatcher. Called once, at creation, on every rank."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


@dataclass(frozen=True)
class RunnerInfo:
    """An expert-kernel family, the wire dtype it needs (resolution step 5), and the combinations it works in,
    checked when a dispatcher is created for ``spec.runner``.

    :param needs: the dtype it asks for when no earlier step decided (None: any).
    :param reason: why, as the resolution trail shows it.
    :param accepts: every dtype its kernels can consume (None: any), e.g. BF16 and NVFP4 for a kernel that quantizes
        BF16 itself but also takes NVFP4 rows.
    :param backends: the dispatch backends and modes whose output it consumes (None: any), e.g.
        ``{"cuda_deepep": frozenset({Mode.LOW_LATENCY})}``.
    :param probe: None when its kernels can run here, else why not (``moe-dispatch backends`` shows it); cheap, and
        must not raise.
    """

    name: str
    needs: DispatchDtype | None
    reason: str = ""
    accepts: frozenset[DispatchDtype] | None = None
    backends: Mapping[str, frozenset[Mode]] | None = None
    probe: Callable[[], str | None] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        try:
            why_not = self.probe() if self.probe is not None else None
        except Exception as exc:  # noqa: BLE001 - a probe that raises is a reason, not a crash
            why_not = f"probe raised {type(exc).__name__}: {exc}"
        return {"name": self.name, "needs": plain(self.needs),
                "accepts": None if self.accepts is None else sorted(d.value for d in self.accepts),
                "backends": None if self.backends is None else {
                    b: sorted(m.value for m in modes) for b, modes in sorted(self.backends.items())},
                "available": None if self.probe is None else why_not is None,  # None: the runner has no probe
                "reason": why_not}
