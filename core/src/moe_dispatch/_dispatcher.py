"""The ``Dispatcher``: what an engine calls on the hot path (``create_dispatcher`` makes one)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ._checks import InputChecks, OutputChecks, not_an_output
from ._contract import Backend, BackendDispatcher, BufferSize, FusedBackendDispatcher, SplitPhaseBackendDispatcher
from ._distributed.comm import Comm, Traffic
from ._errors import CallOrderError, CapacityError, CommunicationError, InvalidInputError, PluginError
from ._output import DispatchOutput
from ._pending import Pending
from ._resolution import Resolution
from ._spec import DispatchSpec
from ._wire import DispatchDtype, Layout, Mode

if TYPE_CHECKING:
    from ._experts import ExpertKernel


# A DispatchOutput is frozen for the engine; the core sets these two fields through their slots (half the cost of
# object.__setattr__ on the hot path).
_set_call = DispatchOutput.call.__set__  # type: ignore[attr-defined]
_set_combined = DispatchOutput.combined.__set__  # type: ignore[attr-defined]

#: Dispatches in flight at once by default: two micro-batches.
DEFAULT_IN_FLIGHT = 2


@dataclass(frozen=True)
class AlignmentPlan:
    """How a dispatcher delivers ``spec.expert_alignment``: ``native`` (the backend writes it), by a core copy, or
    not at all (1: dense rows, or MASKED rows, to which it does not apply)."""

    alignment: int
    native: bool
    note: str

    @property
    def copies(self) -> bool:
        """The core copies PACKED rows into the aligned layout (and back)."""
        return self.alignment > 1 and not self.native


def plan_alignment(backend: Backend, mode: Mode, alignment: int) -> AlignmentPlan:
    capabilities, name = backend.capabilities, backend.name
    if mode in capabilities.masked_modes:
        return AlignmentPlan(1, True, f"backend {name!r} returns MASKED rows in {mode.value} mode: expert_alignment "
                                      "does not apply")
    if alignment == 1:
        return AlignmentPlan(1, True, "dense PACKED rows (expert_alignment 1)")
    if mode in capabilities.expert_alignment:
        return AlignmentPlan(alignment, True, f"backend {name!r} writes each expert's rows at a multiple of "
                                              f"{alignment}, the gaps zeroed")
    return AlignmentPlan(alignment, False, f"backend {name!r} writes dense rows in {mode.value} mode: the core "
                                           f"copies PACKED rows to starts at multiples of {alignment} after dispatch "
                                           "and gathers the expert rows back before combine (one copy each way)")


class Dispatcher:
    """One layer's dispatch and combine on one group (``create_dispatcher`` makes it). Keeps nothing of a call:
    several dispatches may be in flight, each combined with its own ``DispatchOutput``, and each call may be split
    in two (``dispatch_start``/``combine_start`` → ``Pending``) to overlap micro-batches.

    Every rank makes the same calls in the same order: the same dispatchers, each dispatch, its combine and each
    forward; a rank at another call than its peers gets ``CallOrderError`` on every rank. After a failure that
    involved the peers, further calls are refused with ``CommunicationError`` instead of entering a collective the
    group cannot finish.
    """

    def __init__(self, backend: Backend, spec: DispatchSpec, resolution: Resolution, impl: BackendDispatcher,
                 comm: Comm, buffer_size: BufferSize, *, check_inputs: bool | None = None) -> None:
        self.backend, self.spec, self.resolution, self.buffer_size = backend, spec, resolution, buffer_size
        self.check_inputs = check_inputs
        self._impl, self._comm = impl, comm
        self._checks = InputChecks(spec, comm.device, impl)
        #: How ``spec.expert_alignment`` is delivered: by the backend, or by a core copy.
        self.alignment: AlignmentPlan = plan_alignment(backend, spec.mode, spec.expert_alignment)
        self._copy_alignment = self.alignment.copies
        self._outputs = OutputChecks(backend.name, spec, comm.world_size,
                                     1 if self._copy_alignment else spec.expert_alignment,
                                     worst_case=spec.mode in backend.capabilities.worst_case_rows,
                                     masked=spec.mode in backend.capabilities.masked_modes)
        # None: unfused; else whether impl has the fused calls. Decided once: a runtime Protocol check reads
        # attributes, too slow for every forward.
        self._fused: bool | None = (isinstance(impl, FusedBackendDispatcher) if backend.capabilities.fused_forward
                                    else None)
        # None: no split phase in this mode (the core runs each call at its start); else whether impl has the halves.
        self._split: bool | None = (isinstance(impl, SplitPhaseBackendDispatcher)
                                    if spec.mode in backend.capabilities.split_phase else None)
        self._dispatches = self._forwards = 0
        self._broken: str | None = None  # why this dispatcher can make no more calls
        # The hot path's per-call steps chosen once (a Python call level costs 50-100 ns): calls are numbered only
        # with peers, and the aligned copy only where the core makes it.
        self._numbered = comm.world_size > 1
        self._received = self._received_aligned if self._copy_alignment else self._outputs.dispatch
        # On gloo every backend call runs inside comm.calling(): the Comms a vendor (or a fake of one) makes wait
        # with this dispatcher's Watch. Elsewhere the methods themselves.
        self._in_call = in_call = comm.in_call
        self._dispatch_impl, self._combine_impl = in_call(impl.dispatch), in_call(impl.combine)

    @property
    def output_dtype(self) -> DispatchDtype:
        return self.resolution.dtype

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank has sent through this dispatcher so far, by category."""
        return self._comm.traffic

    @property
    def comm(self) -> Comm:
        """The counted process-group calls this dispatcher makes (``traffic``, ``recording()``)."""
        return self._comm

    @property
    def backend_dispatcher(self) -> BackendDispatcher:
        """The backend's own object: for callers that skip the core's checks, or share its vendor buffer."""
        return self._impl

    @property
    def uid(self) -> str:
        """The id its ranks agreed on at creation; ``CallOrderError`` names dispatchers by it."""
        return self._comm.uid

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchOutput:
        """Quantize to the wire dtype and send each token to the ranks of its experts.

        :param hidden_states: bf16 ``[T, H]`` with T <= ``num_max_dispatch_tokens_per_rank``.
        :param topk_ids: int32/int64 ``[T, top_k]`` global expert ids, -1 for none.
        :param topk_weights: fp32 ``[T, top_k]``, on the device of ``hidden_states``.
        :raises InvalidInputError: a wrong type, shape, dtype or device (always checked), or, with ``check_inputs``
            on, an expert id outside ``-1, 0..E-1``, an expert listed twice in one token, or NaN/Inf in
            ``topk_weights`` or ``hidden_states``.
        :raises CapacityError: T > ``num_max_dispatch_tokens_per_rank`` (raise ``--num-max-dispatch-tokens-per-rank``).
        :raises PeerFailedError: / :raises CollectiveTimeoutError: another rank failed, died or stalled while this one
            waited for it (docs/reliability.md).

        The checks run before any collective and modify nothing; an error is also posted to the peers, which stop
        waiting for this rank. The metadata checks always run (about 0.5 µs); the value checks as ``check_inputs``
        says (``create_dispatcher``), never while a CUDA graph is captured (check inputs before a replay).
        """
        if self._broken is not None:
            self._usable("dispatch")
        try:  # _check_dispatch inlined: a Python call level is a tenth of the core's cost per call
            values = self._checks.dispatch(hidden_states, topk_ids, topk_weights, self.check_inputs)
        except BaseException as exc:
            self._failed("dispatch", exc, before=("dispatch", self._dispatches + 1))
            raise
        try:
            self._dispatches = number = self._dispatches + 1
            if self._numbered:
                self._comm.begin("dispatch", number)
            out = self._received(self._dispatch_impl(hidden_states, topk_ids, topk_weights), values)
        except BaseException as exc:
            self._dispatch_failed(exc)
        _set_call(out, number)  # frozen for the engine, numbered here
        return out

    def _received_aligned(self, out: object, check_values: bool) -> DispatchOutput:
        """``_received`` where the core aligns: the backend's output checked and moved to the aligned layout."""
        checked = self._outputs.dispatch(out, check_values)
        if checked.layout is Layout.PACKED:
            from ._alignment import align_rows
            return align_rows(checked, self.spec.expert_alignment)
        return checked

    def _backend_rows(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput
                      ) -> tuple[torch.Tensor, DispatchOutput]:
        """What the backend's combine takes: its own output, and the expert rows in its order."""
        if self._copy_alignment:
            from ._alignment import dense_rows, is_core_aligned
            if is_core_aligned(dispatch_output):
                return dense_rows(expert_output, dispatch_output)
        return expert_output, dispatch_output

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        """Send the unweighted expert rows back, apply the top-k weights, sum: bf16 ``[T, H]``.

        :raises InvalidInputError: ``expert_output`` that is not bf16 ``[..., H]`` with one row per dispatched row on
            the dispatch output's device, or a ``dispatch_output`` this dispatcher did not return, or one already
            combined.
        """
        if self._broken is not None:
            self._usable("combine")
        try:  # _check_combine inlined (a call level saved); on a refusal it runs again, to tell the peers and raise
            self._checks.combine(expert_output, dispatch_output)
        except BaseException:
            self._check_combine(expert_output, dispatch_output)
            raise
        try:
            if self._numbered:
                self._comm.begin("combine", dispatch_output.call)
            rows, out = (self._backend_rows(expert_output, dispatch_output) if self._copy_alignment else
                         (expert_output, dispatch_output))
            result = self._outputs.combine(self._combine_impl(rows, out), dispatch_output)
        except BaseException as exc:
            self._failed("combine", exc)  # with peers, the dispatcher is broken; alone, a retry may complete it
            raise
        _set_combined(dispatch_output, True)
        return result

    @property
    def split_phase(self) -> bool:
        """Whether ``dispatch_start``/``combine_start`` return while the data is on its way (the backend's
        ``split_phase`` names this mode). When False they still work, running each call whole at start; either way
        a call's ``Pending.overlapped`` says whether it overlapped."""
        return self._split is not None

    def dispatch_start(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> Pending[DispatchOutput]:
        """``dispatch`` in two halves: start now, ``wait()`` for the ``DispatchOutput`` later, and compute something
        else in between (the other micro-batch, shared experts).

        The input checks and their errors are ``dispatch``'s, raised here before anything is sent; what fails later (a
        peer, the backend's work after the start) is raised by ``wait()``. Every rank makes a given call in the same
        form (started or blocking); waits may come in any order. The inputs are the call's until ``wait()`` returns (a
        vendor's stream or the reference backends' thread may still read them): do not write into them before then.
        """
        if self._split is None:
            return Pending.completed(self.dispatch(hidden_states, topk_ids, topk_weights), _start_mark(hidden_states))
        self._usable("dispatch")
        values = self._check_dispatch(hidden_states, topk_ids, topk_weights)
        try:
            self._dispatches = number = self._dispatches + 1
            self._comm.begin("dispatch", number)
            started = _pending_from(self.backend.name, "dispatch_start", self._in_call(
                self._split_impl().dispatch_start)(hidden_states, topk_ids, topk_weights))
        except BaseException as exc:
            self._dispatch_failed(exc)
        return Pending(functools.partial(self._receive_dispatch, started, number, values),
                       overlapped=_overlapped(started))

    def combine_start(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> Pending[torch.Tensor]:
        """``combine`` in two halves: this rank's rows are on their way when it returns; ``wait()`` gives the bf16
        ``[T, H]``. Checked as ``combine``; the output counts as combined from here on, and ``expert_output`` is
        the call's until ``wait()``."""
        if self._split is None:
            return Pending.completed(self.combine(expert_output, dispatch_output), _start_mark(expert_output))
        self._usable("combine")
        self._check_combine(expert_output, dispatch_output)
        try:
            self._comm.begin("combine", dispatch_output.call)
            started = _pending_from(self.backend.name, "combine_start", self._in_call(self._split_impl().combine_start)(
                *self._backend_rows(expert_output, dispatch_output)))
        except BaseException as exc:
            self._failed("combine", exc)
            raise
        _set_combined(dispatch_output, True)  # its rows are on their way back: no second combine
        return Pending(functools.partial(self._receive_combine, started, dispatch_output),
                       overlapped=_overlapped(started))

    def _receive_dispatch(self, started: Pending[DispatchOutput], number: int, check_values: bool) -> DispatchOutput:
        try:
            out = self._received(self._in_call(started.wait)(), check_values)
        except BaseException as exc:
            self._received_failed()
            self._dispatch_failed(exc)
        _set_call(out, number)
        return out

    def _receive_combine(self, started: Pending[torch.Tensor], dispatch_output: DispatchOutput) -> torch.Tensor:
        try:
            return self._outputs.combine(self._in_call(started.wait)(), dispatch_output)
        except BaseException as exc:
            self._received_failed()
            self._failed("combine", exc)
            raise

    def _received_failed(self) -> None:
        """A call failed after its collectives ran (at ``wait()``): with peers, whatever the error, this dispatcher
        makes no more calls (its exchange is in an unknown state)."""
        if self.world_size > 1 and self._broken is None:
            self._broken = f"a started call failed at wait() on rank {self.rank}"

    def _split_impl(self) -> SplitPhaseBackendDispatcher:
        if not self._split:
            raise PluginError(f"backend {self.backend.name!r} declares capabilities.split_phase for "
                              f"{self.spec.mode.value} mode, but its dispatcher {type(self._impl).__name__} has no "
                              "dispatch_start/combine_start (moe_dispatch.backend.SplitPhaseBackendDispatcher)")
        return self._impl  # type: ignore[return-value]

    def _check_dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        phase: str = "dispatch") -> bool:
        """The input checks of ``phase``; whether the value checks ran (the output checks read the counts then)."""
        try:
            return self._checks.dispatch(hidden_states, topk_ids, topk_weights, self.check_inputs)
        except BaseException as exc:
            self._failed(phase, exc, before=(phase, (self._forwards if phase == "forward" else self._dispatches) + 1))
            raise

    def _dispatch_failed(self, exc: BaseException) -> NoReturn:
        oom = _out_of_memory(exc, self.buffer_size)
        self._failed("dispatch", oom or exc)
        if oom is not None:
            raise oom from exc
        raise exc

    def _check_combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> None:
        try:
            self._checks.combine(expert_output, dispatch_output)
        except BaseException as exc:
            self._failed("combine", exc, before=(
                "combine", dispatch_output.call if isinstance(dispatch_output, DispatchOutput) else None))
            raise

    def _usable(self, operation: str) -> None:
        if self._broken is not None:
            raise CommunicationError(f"this dispatcher cannot {operation}: {self._broken}; the process group must be "
                                     "rebuilt (a collective its ranks started may never finish) and the dispatcher "
                                     "created again")

    def _failed(self, operation: str, exc: BaseException, *, before: tuple[str, int | None] | None = None,
                call: tuple[str, int | None] | None = None) -> None:
        """A call failed on this rank: tell the peers. Refused inputs leave the dispatcher as it was: the core's
        checks (``before``: the phase and number of the call they refused, before its collectives) and an
        ``InvalidInputError`` from the backend, which the contract puts before its collectives too (or from the
        expert kernel, between them: ``call``): only the peers waiting in that very call stop (``Watch.refused``),
        and this rank's next calls are told apart from it. Any other failure once the call had begun, with peers,
        breaks the dispatcher (the peers have left the call, and the group may hold an unfinished collective)."""
        if self.world_size == 1:
            return  # no one to tell
        if before is None and not isinstance(exc, InvalidInputError):
            self._broken = f"{operation} failed on rank {self.rank}: {type(exc).__name__}: {exc}"
        if self._broken is not None:
            # The call check's mismatch and the checks of a returned output leave no collective unfinished.
            if isinstance(exc, (CallOrderError, PluginError)):
                self._comm.announce_failure(operation, exc)
            else:
                self._comm.abandon(operation, exc, self._comm.begun_at)
            return
        if before is None and call is None:
            begun = self._comm.watch.call  # the call whose backend refused its inputs
            call = (begun.phase, begun.number) if begun is not None else (operation, None)
        self._comm.announce_refusal(operation, exc, *(before or call))  # type: ignore[misc]

    @property
    def fused(self) -> bool:
        """Whether ``forward`` runs the backend's fused op (``capabilities.fused_forward``)."""
        return self._fused is not None

    def process_weights(self, weights: Any) -> Any:
        """The ``layer`` ``forward`` takes, built once at load time from this rank's experts: the fused op's layout
        on a fused backend; otherwise ``weights`` as they are (the expert kernel builds its own)."""
        return self._fused_impl().process_weights(weights) if self.fused else weights

    def forward(self, experts: "ExpertKernel | None", layer: Any, hidden_states: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer over the group: dispatch → ``experts`` → combine, or the backend's fused op (``experts``
        unused); bf16 ``[T, H]`` out. The input checks run either way, and a failure on this rank (the expert
        kernel's included) is announced to the peers, which stop waiting."""
        if self.fused:
            self._usable("forward")
            self._check_dispatch(hidden_states, topk_ids, topk_weights, "forward")
            try:
                self._forwards += 1
                self._comm.begin("forward", self._forwards)
                return self._in_call(self._fused_impl().fused_forward)(layer, hidden_states, topk_ids, topk_weights)
            except BaseException as exc:
                self._failed("forward", exc)
                raise
        if experts is None:
            self._usable("forward")
            missing = InvalidInputError("an unfused backend needs the expert kernel", parameter="experts", value=None,
                                        allowed="an ExpertKernel (apply_without_routing_weights)")
            self._failed("forward", missing, before=("dispatch", self._dispatches + 1))  # the peers may be in dispatch
            raise missing
        out = self.dispatch(hidden_states, topk_ids, topk_weights)
        try:
            rows = run_experts(experts, layer, out)
        except BaseException as exc:
            self._failed("experts", exc, call=("combine", out.call))  # the peers wait for this rank's combine
            raise
        return self.combine(rows, out)

    def _fused_impl(self) -> FusedBackendDispatcher:
        if not self._fused:
            raise PluginError(f"backend {self.backend.name!r} declares capabilities.fused_forward, but its dispatcher "
                              f"{type(self._impl).__name__} has no fused_forward/process_weights "
                              "(moe_dispatch.backend.FusedBackendDispatcher)")
        return self._impl  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (f"<Dispatcher {self.backend.name} {self.spec.mode.value} {self.output_dtype.value} "
                f"rank {self.rank}/{self.world_size}>")


def run_experts(experts: "ExpertKernel", layer: Any, out: DispatchOutput) -> torch.Tensor:
    """``experts`` on a dispatch output's rows, bf16 out: what ``Dispatcher.forward`` runs between its calls
    (``expert_alignment`` is passed only when the rows are aligned: ``ExpertKernel``)."""
    if not isinstance(out, DispatchOutput):
        raise InvalidInputError(not_an_output(out), parameter="out", value=type(out).__name__,
                                allowed="the DispatchOutput a dispatch returned")
    if out.layout is Layout.TOKEN_MAJOR:
        from ._experts import token_major_experts
        return token_major_experts(experts, layer, out)
    extra = {"expert_alignment": out.expert_alignment} if out.expert_alignment > 1 else {}
    return experts.apply_without_routing_weights(layer, out.hidden_states, out.hidden_states_scale,
                                                 out.group_list_type, out.group_list, torch.bfloat16,
                                                 global_scale=out.global_scale, **extra)


def _pending_from(backend: str, call: str, started: object) -> Pending[Any]:
    if not callable(getattr(started, "wait", None)):
        raise PluginError(f"backend {backend!r} broke the contract: {call}() returned this", parameter=f"{call}()",
                          value=type(started).__name__, allowed="a moe_dispatch.Pending (an object with wait())")
    return started  # type: ignore[return-value]


def _overlapped(started: Pending[Any]) -> bool:
    """Whether the backend's started call is still on its way (False: it ran to its end at start)."""
    return bool(getattr(started, "overlapped", True))


def _out_of_memory(exc: BaseException, buffers: BufferSize) -> CapacityError | None:
    """An allocator failure inside a backend's dispatch, as a typed error (None for anything else)."""
    text = str(exc)
    if not (isinstance(exc, torch.OutOfMemoryError)
            or (isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))):
        return None
    return CapacityError(f"the device ran out of memory in dispatch ({type(exc).__name__}: "
                         f"{text.splitlines()[0] if text else ''}); the planned buffers are {buffers.total_bytes:,} "
                         "bytes", parameter="num_max_dispatch_tokens_per_rank", value=None,
                         allowed="a smaller capacity or batch, or more free device memory")


def _start_mark(t: torch.Tensor) -> Any:
    """Where a call run to its end at start ended on its CUDA stream (None off CUDA: no streams module then)."""
    if not t.is_cuda:
        return None
    from ._streams import start_mark
    return start_mark(t)
