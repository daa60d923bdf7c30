"""What a backend plugin implements.

A ``Backend`` describes itself (name, capabilities, ``probe``), validates dtypes, sizes its
buffers, and creates a ``BackendDispatcher`` for one spec on one process group. The core's
``Dispatcher`` calls that object directly: no plugin-manager call on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from .capabilities import Capabilities, DtypeDecision, EnvRequirement
from .dtypes import DispatchDtype, Mode
from .errors import CapacityError, InvalidSpecError
from .output import DispatchOutput
from .spec import DispatchSpec

if TYPE_CHECKING:
    from .codecs import Codec
    from .distributed.comm import Comm
    from .pending import Pending
    from .trail import Resolution


@dataclass(frozen=True)
class BufferSize:
    """Bytes a dispatcher needs, dispatch and combine accounted separately (combine is BF16
    even when dispatch is FP8, so one cannot stand in for the other).

    :param allocated_bytes: what the backend really allocates, when that is not the sum:
        a vendor buffer shared by dispatch and combine (DeepEP) takes the larger of the two,
        plus whatever its layout adds. Must cover each of them.
    """

    dispatch_bytes: int
    combine_bytes: int
    notes: tuple[str, ...] = ()
    allocated_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.allocated_bytes is not None and self.allocated_bytes < max(self.dispatch_bytes, self.combine_bytes):
            raise ValueError(
                f"allocated_bytes {self.allocated_bytes:,} is smaller than dispatch ({self.dispatch_bytes:,}) "
                f"or combine ({self.combine_bytes:,})"
            )

    @property
    def total_bytes(self) -> int:
        """Bytes allocated: ``allocated_bytes`` when given, else dispatch + combine."""
        return self.allocated_bytes if self.allocated_bytes is not None else self.dispatch_bytes + self.combine_bytes

    @property
    def largest_allocation(self) -> int:
        """The biggest single buffer: the shared one, or the larger of dispatch and combine.
        What a backend's ``max_buffer_bytes`` limits."""
        return self.allocated_bytes if self.allocated_bytes is not None else max(self.dispatch_bytes, self.combine_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dispatch_bytes": self.dispatch_bytes,
            "combine_bytes": self.combine_bytes,
            "total_bytes": self.total_bytes,
            "shared": self.allocated_bytes is not None,
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class DispatchContext:
    """Everything ``Backend.create`` gets: the spec with its resolved dtype, the group
    wrapped in a byte-counting ``Comm``, and the codec of the wire format."""

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
    """One spec on one group. Holds no state of a call: everything combine needs travels
    in ``DispatchOutput.handle``."""

    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput: ...

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor: ...


@runtime_checkable
class SplitPhaseBackendDispatcher(BackendDispatcher, Protocol):
    """What the dispatcher of a backend with ``capabilities.split_phase`` adds: each call in two
    halves. ``*_start`` checks nothing the core has checked, issues the collectives (or the
    vendor's send kernels) and returns; the ``Pending``'s ``wait()`` receives and finishes. The
    buffers a started call reads and writes stay its own until its ``wait()`` has returned, even
    when the engine starts the other micro-batch's calls meanwhile or drops the ``Pending``."""

    def dispatch_start(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> "Pending[DispatchOutput]": ...

    def combine_start(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> "Pending[torch.Tensor]": ...


@runtime_checkable
class FusedBackendDispatcher(BackendDispatcher, Protocol):
    """What the dispatcher of a backend with ``capabilities.fused_forward`` adds: dispatch, the
    experts and combine in one call. ``Dispatcher.forward`` runs the core's input checks first
    and announces a failure to the peers."""

    def process_weights(self, weights: Any) -> Any:
        """The layer object ``fused_forward`` reads, built once at load time from this rank's
        experts (``ExpertWeights``): the vendor's layouts, or a typed error for a quantization
        scheme the fused op cannot take."""
        ...

    def fused_forward(
        self, layer: Any, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """bf16 ``[T, H]``: the weighted sum of this rank's tokens' expert outputs."""
        ...


class Backend:
    """Base class of dispatch backends. Subclasses set ``name`` and ``capabilities`` and
    implement ``buffer_size`` and ``create``; the rest has table-driven defaults."""

    name: str = ""
    capabilities: Capabilities
    description: str = ""
    #: What to install or configure when ``probe()`` says the backend cannot run here.
    install_hint: str = ""
    #: How this backend's buffers sized for a BF16 wire relate to what an engine (sglang) allocates
    #: for it; ``moe-dispatch plan`` prints it under its BF16 column ("": no engine counterpart).
    engine_sizing: str = ""

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
        caps = self.capabilities
        if spec.mode not in caps.dtypes:
            raise InvalidSpecError(
                f"backend {self.name!r} does not support this mode",
                parameter="mode",
                value=spec.mode.value,
                allowed=", ".join(m.value for m in caps.modes),
            )
        sizes = caps.world_sizes_for(spec.mode)
        if sizes is not None and world_size not in sizes:
            raise InvalidSpecError(
                f"backend {self.name!r} ({spec.mode.value}) does not support this EP size",
                parameter="world_size",
                value=world_size,
                allowed=", ".join(map(str, sorted(sizes))),
            )
        spec.local_experts(world_size)
        lim = caps.limits_for(spec.mode)
        t = spec.num_max_dispatch_tokens_per_rank
        if lim.max_tokens_per_rank is not None and t > lim.max_tokens_per_rank:
            raise CapacityError(
                f"backend {self.name!r} ({spec.mode.value}) handles at most {lim.max_tokens_per_rank} tokens per rank",
                parameter="num_max_dispatch_tokens_per_rank",
                value=t,
                allowed=f"1..{lim.max_tokens_per_rank}",
            )
        h = spec.hidden_size
        if lim.hidden_sizes is not None and h not in lim.hidden_sizes:
            raise InvalidSpecError(
                f"backend {self.name!r} ({spec.mode.value}) kernels are built for fixed hidden sizes",
                parameter="hidden_size",
                value=h,
                allowed=", ".join(map(str, sorted(lim.hidden_sizes))),
            )
        if h % lim.hidden_multiple or (lim.min_hidden is not None and h < lim.min_hidden) or (
            lim.max_hidden is not None and h > lim.max_hidden
        ):
            raise InvalidSpecError(
                f"backend {self.name!r} ({spec.mode.value}) does not support this hidden size",
                parameter="hidden_size",
                value=h,
                allowed=f"multiples of {lim.hidden_multiple} in [{lim.min_hidden or 1}, {lim.max_hidden or 'inf'}]",
            )
        if lim.max_top_k is not None and spec.top_k > lim.max_top_k:
            raise InvalidSpecError(
                f"backend {self.name!r} ({spec.mode.value}) supports at most top-{lim.max_top_k}",
                parameter="top_k",
                value=spec.top_k,
                allowed=f"1..{lim.max_top_k}",
            )

    def buffer_size(self, spec: DispatchSpec, world_size: int) -> BufferSize:
        """Bytes needed for ``spec`` (its ``output_dtype`` already resolved) on
        ``world_size`` ranks, dispatch and combine separately."""
        raise NotImplementedError

    def env_requirements(self, spec: DispatchSpec, world_size: int) -> tuple["EnvRequirement", ...]:
        """Environment variables the vendor library reads that must be large enough for
        ``spec`` (e.g. ``HCCL_BUFFSIZE``): what ``moe-dispatch plan`` and ``plan_buffers``
        check. None by default."""
        return ()

    def agreement(self, ctx: DispatchContext) -> Mapping[str, Any]:
        """What else every rank must agree on before ``create`` runs: the options and
        environment that decide a collective vendor call in ``create`` (a buffer's size, a
        shared buffer's mode). Compared field by field with the core's own fingerprint; a
        difference is a ``ConfigMismatchError`` on every rank instead of a hang inside the
        vendor's constructor. Values must be plain (numbers, strings, tuples, None). None by
        default."""
        return {}

    def create(self, ctx: DispatchContext) -> BackendDispatcher:
        """Build the per-layer dispatcher. Called once, at creation, on every rank."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


@dataclass(frozen=True)
class RunnerInfo:
    """An expert-kernel family, the wire dtype it needs (resolution step 5), and the
    combinations it works in, checked when a dispatcher is created for ``spec.runner``.

    :param needs: the dtype it asks for when no earlier step decided (None: any).
    :param reason: why, as the resolution trail shows it.
    :param accepts: every dtype its kernels can consume (None: any), e.g. BF16 and NVFP4
        for a kernel that quantizes BF16 itself but also takes NVFP4 rows.
    :param backends: the dispatch backends and modes whose output it consumes (None: any),
        e.g. ``{"cuda_deepep": frozenset({Mode.LOW_LATENCY})}``.
    :param probe: None when its kernels can run here, else why not (``moe-dispatch backends``
        shows it); cheap, and must not raise.
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
        return {
            "name": self.name,
            "needs": None if self.needs is None else self.needs.value,
            "accepts": None if self.accepts is None else sorted(d.value for d in self.accepts),
            "backends": None if self.backends is None else {
                b: sorted(m.value for m in modes) for b, modes in sorted(self.backends.items())},
            "available": None if self.probe is None else why_not is None,  # None: the runner has no probe
            "reason": why_not,
        }


__all__ = ["Backend", "BackendDispatcher", "BufferSize", "DispatchContext", "FusedBackendDispatcher", "RunnerInfo",
           "SplitPhaseBackendDispatcher"]
