"""The ``deep_ep.Buffer``s of this process, and the state the layers sharing one must agree on.

**One registry per process, as NVSHMEM is.** Every ``deep_ep.Buffer`` with RDMA bytes (low-latency mode, or normal
mode past 8 ranks) starts NVSHMEM in its constructor, as PE ``rank`` (LL) or ``rdma_rank`` (normal); a second live
init in the process gets the first's numbering back, or fails DeepEP's team assert past 8 ranks, and any Buffer's
``destroy()`` finalizes NVSHMEM for every Buffer (deepseek-ai/DeepEP@dd758ca csrc/kernels/backend/nvshmem.cu
init/finalize; csrc/legacy/buffer.hpp sync/destroy; ``vendor.nvshmem_pe``). So ``PROCESS_BUFFERS``, the adapter's
only process-wide state, keeps at most one such Buffer per process (per ``vendor.nvshmem_domain``: the fakes
emulate their own process), whatever the backend object, the layer or the group: every layer that needs NVSHMEM
uses it, the adapter's own or one handed in as ``options["buffer"]`` (which goes through the same registry: one
wrapper and one clean state per Buffer object, the same checks). A second one is a typed error that says what to
do. Intranode normal-mode Buffers (NVL bytes only) start no NVSHMEM; the registry keeps one per process group.

**Sizes and checks.** A Buffer the adapter creates is sized for the first layer that needs it, or for
``options["buffer_bytes"]`` (validated per mode: ``reserved_bytes``), with ``options["buffer_num_qps_per_rank"]``
QPs per peer when given. Every layer checks the Buffer it gets, created, reused or adopted, the same way
(``check_serves``): its mode, its regions, both below INT_MAX for internode normal mode, and the QPs per peer each
mode it serves needs.

**What they share.** DeepEP's low-latency kernels need their signalling counts zeroed before they run: after
internode normal-mode kernels used the Buffer, and after LL kernels of another E (before 42253d0: another (T,
hidden, E)) ``clean_low_latency_buffer`` must run first (``vendor.ll_clean_key``). ``SharedBuffer`` tracks that
for every layer on the Buffer and cleans right before the next LL kernel, or when a low-latency layer is created on
a Buffer that may not be clean (one handed in; one internode normal mode used); every rank makes the same calls in
the same order, so every rank cleans at the same point.

**CUDA graphs.** That bookkeeping is Python, which a graph replay skips (sglang PR #11666, DeepEP issue #93). Two
rules keep every replay correct: after each normal-mode combine past 8 ranks on an LL Buffer the adapter cleans
at once, once per E on the Buffer (half 1 of E sits at ``align_up(4E, 128)``: no single clean covers every E;
normal mode is never captured: it syncs the host), so the Buffer is clean whatever runs next, eager or replayed;
and an LL kernel is captured only on a Buffer that serves one E (one (T, hidden, E) before 42253d0), whose state
no eager call between two replays can change (a typed error otherwise, at capture and at the creation of a second
E on a captured Buffer). A graph never holds a clean (it would run only at that graph's replay, on the ranks
replaying it, while the adapter took the Buffer for clean at capture): a capture while a clean is due is a typed
error that asks for one eager LL step first.

**Lifetime.** The Buffers live as long as the process. The adapter creates them with ``explicitly_destroy=True``
(DeepEP from 0c984e2): their destructors run no collective, so a peer that died cannot make the survivors hang at
exit. ``close()`` (``DeepEPBackend.close``; collective: every rank calls it) destroys them; CUDA graphs that captured
LL kernels on one must be dropped first (a replay would run on freed NVSHMEM memory): ``close()`` warns.
"""

from __future__ import annotations

import gc
import hashlib
import os
import warnings
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import restored_environ

from . import vendor

#: DeepEP's constructor zeroes the whole RDMA buffer: clean for any layout.
ANY = "any"
BUFFER_OPTIONS = ("buffer", "buffer_bytes", "buffer_num_qps_per_rank")


@dataclass(frozen=True)
class BufferRequest:
    """A ``deep_ep.Buffer``: bytes per region, the mode, the QPs per peer (LL: at least the local experts; normal past
    8 ranks: the configs' channels or at least their SMs; 0 where unknown), and the configs' SMs."""

    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_qps_per_rank: int
    num_sms: int | None = None

    def covers(self, need: "BufferRequest") -> bool:
        return self.num_nvl_bytes >= need.num_nvl_bytes and self.num_rdma_bytes >= need.num_rdma_bytes

    @property
    def uses_nvshmem(self) -> bool:
        """``Buffer::sync`` starts NVSHMEM with RDMA bytes (LL mode, or normal mode past 8 ranks)."""
        return self.num_rdma_bytes > 0

    def describe(self) -> str:
        mode = "low-latency" if self.low_latency_mode else "normal"
        return f"{mode} NVL {self.num_nvl_bytes} RDMA {self.num_rdma_bytes} QPs {self.num_qps_per_rank}"


# -- the options ---------------------------------------------------------------------------------------------------


def _non_negative_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def reserved_bytes(option: Any, low_latency: bool, world_size: int) -> tuple[int, int]:
    """``options["buffer_bytes"]``: an int (``BufferPlan.total_bytes``), taken for every region the mode uses (LL: RDMA;
    normal: NVL, and RDMA past 8 ranks), or an (NVL, RDMA) pair. A pair may not set a region DeepEP refuses: RDMA
    bytes in normal mode within 8 ranks (``num_ranks > 8 or low_latency_mode``, a constructor assert), NVL bytes on
    an LL Buffer of 1, 3, 5, 6 or 7 ranks (its destructor's ``intranode::barrier`` has no kernel for them:
    ``std::terminate``). NVL bytes on an LL Buffer elsewhere reserve room for normal-mode layers on it."""
    internode = world_size > vendor.NUM_MAX_NVL_PEERS
    if _non_negative_int(option):
        if low_latency:
            return 0, option
        return option, option if internode else 0
    if not (isinstance(option, (tuple, list)) and len(option) == 2 and all(_non_negative_int(v) for v in option)):
        raise md.InvalidSpecError("the bytes to reserve in the process's DeepEP Buffer",
                                  parameter="options.buffer_bytes", value=option,
                                  allowed="an int (moe_dispatch.planning.plan_buffers(...).total_bytes) or (nvl, rdma)")
    nvl, rdma = int(option[0]), int(option[1])
    if not low_latency and not internode and rdma:
        raise md.InvalidSpecError("DeepEP's constructor asserts RDMA bytes only past 8 ranks or in low-latency mode",
                                  parameter="options.buffer_bytes", value=option, allowed="(nvl, 0) within 8 ranks")
    if low_latency and nvl and min(world_size, vendor.NUM_MAX_NVL_PEERS) not in vendor.INTRANODE_RANKS:
        raise md.InvalidSpecError(
            f"a DeepEP Buffer with NVL bytes runs intranode::barrier in its destroy(), which has no kernel for "
            f"{world_size} ranks: the destructor throws (std::terminate)", parameter="options.buffer_bytes",
            value=option, allowed=f"(0, rdma) on {world_size} ranks")
    return nvl, rdma


def qps_option(options: Mapping[str, Any]) -> int | None:
    """``options["buffer_num_qps_per_rank"]``: the QPs per peer of the Buffer (created, or handed in)."""
    qps = options.get("buffer_num_qps_per_rank")
    if qps is not None and not (_non_negative_int(qps) and qps > 0):
        raise md.InvalidSpecError("QPs per peer of the DeepEP Buffer", parameter="options.buffer_num_qps_per_rank",
                                  value=qps, allowed="a positive int")
    return qps


def _align(n: int) -> int:
    a = vendor.NUM_BUFFER_ALIGNMENT_BYTES
    return -(-n // a) * a


def planned_request(need: BufferRequest, options: Mapping[str, Any], world_size: int) -> BufferRequest:
    """The Buffer the adapter creates for a layer that needs ``need``: grown to ``options["buffer_bytes"]`` and
    ``options["buffer_num_qps_per_rank"]``."""
    reserve = options.get("buffer_bytes")
    nvl, rdma = (0, 0) if reserve is None else reserved_bytes(reserve, need.low_latency_mode, world_size)
    qps = max(need.num_qps_per_rank, qps_option(options) or 0)
    held = BufferRequest(_align(max(need.num_nvl_bytes, nvl)), _align(max(need.num_rdma_bytes, rdma)),
                         need.low_latency_mode, qps, need.num_sms)
    problems = vendor.constructor_bytes_problems(held.num_nvl_bytes, held.num_rdma_bytes, held.low_latency_mode)
    if problems:
        raise md.CapacityError(f"DeepEP's Buffer constructor asserts {problems[0]}", parameter="options.buffer_bytes",
                               value=(held.num_nvl_bytes, held.num_rdma_bytes),
                               allowed=f"NVL <= {vendor.INT_MAX} when RDMA > 0; each region < "
                                       f"{vendor.MAX_BUFFER_BYTES} (RDMA <= {vendor.INT_MAX} outside low-latency mode)")
    if not need.low_latency_mode and held.uses_nvshmem and not vendor.internode_bytes_ok(held.num_nvl_bytes,
                                                                                          held.num_rdma_bytes):
        raise md.CapacityError("DeepEP's internode notify asserts both buffers below INT_MAX bytes",
                               parameter="options.buffer_bytes", value=(held.num_nvl_bytes, held.num_rdma_bytes),
                               allowed=f"< {vendor.INT_MAX} each")
    return held


def adopted_request(buffer: Any, options: Mapping[str, Any]) -> BufferRequest:
    """What a Buffer handed in holds, from its attributes (deep_ep/buffers/legacy.py sets them) and its QPs per peer:
    ``options["buffer_num_qps_per_rank"]``, else ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` (DeepEP's constructor writes it,
    NVSHMEM reads it at init; 0 when neither says)."""
    held = BufferRequest(int(getattr(buffer, "num_nvl_bytes", 0)), int(getattr(buffer, "num_rdma_bytes", 0)),
                         bool(getattr(buffer, "low_latency_mode", False)), 0)
    qps = qps_option(options)
    if qps is None and held.uses_nvshmem:
        written = os.environ.get(vendor.NVSHMEM_IBGDA_NUM_RC_PER_PE, "")
        qps = int(written) if written.isdigit() else None
    return BufferRequest(held.num_nvl_bytes, held.num_rdma_bytes, held.low_latency_mode, qps or 0)


# -- what a Buffer must hold for a layer ---------------------------------------------------------------------------


def check_serves(held: BufferRequest, world_size: int, need: BufferRequest, spec: md.DispatchSpec, *,
                 parameter: str) -> None:
    """Typed errors for a Buffer holding ``held`` that cannot serve a layer needing ``need`` (before DeepEP asserts
    or traps). ``parameter``: where the Buffer came from (``options.buffer``, ``options.buffer_bytes``)."""
    internode = world_size > vendor.NUM_MAX_NVL_PEERS
    if need.low_latency_mode and not held.low_latency_mode:
        raise md.InvalidSpecError("DeepEP's low-latency calls assert a Buffer created with low_latency_mode=True",
                                  parameter=parameter, value=held.describe(), allowed="a low-latency Buffer")
    if not held.covers(need):
        raise md.CapacityError(
            f"the DeepEP Buffer holds NVL {held.num_nvl_bytes:,} B, RDMA {held.num_rdma_bytes:,} B; this layer needs "
            f"NVL {need.num_nvl_bytes:,} B, RDMA {need.num_rdma_bytes:,} B. Create the largest layer first, or give "
            "the first layer options={'buffer_bytes': moe_dispatch.planning.plan_buffers('cuda_deepep', "
            "every_layers_spec, world_size).total_bytes} (or the (NVL, RDMA) pair DeepEPBackend.buffer_request gives)",
            parameter=parameter, value=(need.num_nvl_bytes, need.num_rdma_bytes),
            allowed=f"<= ({held.num_nvl_bytes}, {held.num_rdma_bytes}) on this Buffer")
    if not need.low_latency_mode and internode and not vendor.internode_bytes_ok(held.num_nvl_bytes,
                                                                                  held.num_rdma_bytes):
        raise md.CapacityError(
            "DeepEP's internode notify_dispatch/cached_notify assert num_nvl_bytes and num_rdma_bytes < INT_MAX "
            "(an LL Buffer may hold more): this Buffer cannot serve normal mode past 8 ranks", parameter=parameter,
            value=(held.num_nvl_bytes, held.num_rdma_bytes), allowed=f"< {vendor.INT_MAX} each")
    qps_needed = need.low_latency_mode or internode
    if not qps_needed:
        return
    qps, allowed = held.num_qps_per_rank, ""
    if need.low_latency_mode and qps < spec.local_experts(world_size):
        problem = f"ibgda_get_state()->num_rc_per_pe >= num_local_experts ({spec.local_experts(world_size)})"
        allowed = f">= {spec.local_experts(world_size)}"
    elif not need.low_latency_mode and need.num_sms is not None and not vendor.internode_qps_ok(qps, need.num_sms):
        problem = f"num_rc_per_pe == num_channels ({need.num_sms // 2}) or num_rc_per_pe >= num_sms ({need.num_sms})"
        allowed = f"{need.num_sms // 2} or >= {need.num_sms}"
    else:
        return
    known = "unknown: DeepEP records none, and NVSHMEM_IBGDA_NUM_RC_PER_PE is not set" if not qps else f"{qps}"
    raise md.InvalidSpecError(
        f"DeepEP's kernels device-assert {problem}; this Buffer's QPs per peer: {known}. Create the first layer with "
        "options={'buffer_num_qps_per_rank': ...} large enough for every layer, or pass the QPs of the Buffer you hand "
        "in", parameter="options.buffer_num_qps_per_rank", value=qps or None, allowed=allowed)


def check_qp_depth(spec: md.DispatchSpec, depth: int) -> None:
    """DeepEP's LL calls ``assert self.nvshmem_qp_depth >= (T + 1) * 2`` (read at the Buffer's construction)."""
    t = spec.num_max_dispatch_tokens_per_rank
    most = vendor.low_latency_max_tokens(depth)
    if t > most:
        raise md.CapacityError(f"DeepEP's low-latency calls assert {vendor.NVSHMEM_QP_DEPTH} ({depth}) >= 2·(T+1); "
                               f"raise {vendor.NVSHMEM_QP_DEPTH} before the Buffer is created, or lower T",
                               parameter="num_max_dispatch_tokens_per_rank", value=t, allowed=f"1..{most}")


# -- one Buffer and its state --------------------------------------------------------------------------------------


@dataclass(eq=False)
class SharedBuffer:
    """One ``deep_ep.Buffer`` of this process and what every layer on it must agree on: which LL layouts use it, how
    clean its signalling counts are, whether a CUDA graph captured LL kernels on it."""

    buffer: Any
    group: Any
    world_size: int
    held: BufferRequest
    owned: bool
    qp_depth: int | None
    domain: str
    #: ``vendor.ll_clean_key``: the signalling counts move with E only (DeepEP from 42253d0).
    clean_by_experts: bool = True
    #: ANY (fresh from the constructor), or the layouts its counts are known clean for.
    clean: Any = ANY
    #: clean key → (T, hidden, E) of the first LL layer with it (what ``clean_low_latency_buffer`` is called with).
    layouts: dict[Any, tuple[int, int, int]] = field(default_factory=dict)
    captured: bool = False
    #: LL calls captured into CUDA graphs since the last eager one. DeepEP picks the signalling half on the host
    #: (``low_latency_buffer_idx ^= 1``) at capture, so a replayed kernel keeps its half: graphs holding an odd count
    #: (a dispatch without its combine) leave the eager calls' half out of step with the replays'.
    captured_since_eager: int = 0
    #: The handles of eager LL dispatches not yet combined (a dropped one goes with its handle). A graph captured
    #: while one is pending starts on the other half from the one its replays find once that combine has run.
    pending: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: The handles of LL dispatches captured and not yet combined (in the same graph or the next one).
    captured_pending: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    #: The receive of the last LL call made with DeepEP's receive hook that has not run yet: the next LL call on this
    #: Buffer, from any layer, would zero the signalling half it waits on (``vendor.LL_CALLS_AWAITING_RECEIVE``), so
    #: every call settles it first, as vLLM does before each new call (``dbo_maybe_run_recv_hook``).
    unreceived: "Receive | None" = None
    closed: bool = False
    internode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.internode = self.world_size > vendor.NUM_MAX_NVL_PEERS

    def key(self, tokens: int, hidden: int, num_experts: int) -> Any:
        return vendor.ll_clean_key(self.clean_by_experts, tokens, hidden, num_experts)

    # -- a new layer on it ---------------------------------------------------------------------------------------

    def check_layout(self, spec: md.DispatchSpec) -> None:
        """A captured Buffer serves one clean key for its life (a replay cannot clean)."""
        key = self.key(spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.num_experts)
        if self.captured and key not in self.layouts:
            raise md.InvalidSpecError(
                "CUDA graphs captured LL kernels on the process's DeepEP Buffer for another "
                f"{self._what()}: a layer of this one would leave its signalling counts in a state the replays do not "
                "clean (DeepEP issue #93)", parameter=self._parameter(), value=key,
                allowed=f"{sorted(self.layouts)} (the captured layers'), or layers created before any capture and not "
                        "captured")

    def register(self, spec: md.DispatchSpec) -> None:
        t, h, e = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.num_experts
        self.layouts.setdefault(self.key(t, h, e), (t, h, e))

    def _what(self) -> str:
        return "expert count" if self.clean_by_experts else "(T, hidden, E)"

    def _parameter(self) -> str:
        return "num_experts" if self.clean_by_experts else "num_max_dispatch_tokens_per_rank, hidden_size, num_experts"

    # -- every layer's calls ---------------------------------------------------------------------------------------

    def sent(self, hook: Callable[[], None] | None) -> "Receive | None":
        """A call DeepEP made with ``return_recv_hook=True`` has sent (its hook; None for a whole call)."""
        if hook is None:
            return None
        self.unreceived = Receive(hook, _current_stream())
        return self.unreceived

    def receive(self, receipt: "Receive | None") -> None:
        """Run ``receipt``'s hook unless it ran already (settled by a later call): once, as DeepEP needs (a second
        run adds the dispatch's counts again); then order the current stream after it. Not on a closed Buffer."""
        if receipt is None:
            return
        if self.unreceived is receipt:
            self.unreceived = None
        if not self.closed:
            receipt.run()
            receipt.order()

    def settle(self) -> None:
        """Before any call on the Buffer: the receive still awaited, at the same point on every rank (every rank
        makes the same calls in the same order)."""
        self.receive(self.unreceived)

    def check_open(self) -> None:
        if self.closed:
            raise md.BackendUnavailableError("this dispatcher's DeepEP Buffer was closed (DeepEPBackend.close)",
                                             parameter="dispatcher", value="closed",
                                             allowed="a dispatcher created after the close")

    def needs_clean(self, key: Any) -> bool:
        return self.clean != ANY and key not in self.clean

    def clean_now(self, tokens: int, hidden: int, num_experts: int) -> None:
        """Eager, at a point every rank reaches (a collective kernel): zero this layout's signalling counts."""
        key = self.key(tokens, hidden, num_experts)
        if self.needs_clean(key):
            self.settle()  # the clean zeroes both signalling halves, the awaited receive's included
            self.buffer.clean_low_latency_buffer(tokens, hidden, num_experts)
            self.clean = self.clean | {key}

    def before_low_latency(self, tokens: int, hidden: int, num_experts: int, capturing: bool = False,
                           dispatch: bool = True) -> None:
        """Clean the signalling counts unless they are known clean for this layout; under capture, only on a
        Buffer whose state no eager call can change between replays, and never: a clean captured into a graph runs
        only when it is replayed (an eager call before that reads stale counts), and only that graph holds it (ranks
        replaying other graphs skip the collective)."""
        self.check_open()
        key = self.key(tokens, hidden, num_experts)
        if capturing:
            if len(self.layouts) > 1:
                raise md.InvalidSpecError(
                    f"the process's DeepEP Buffer serves LL layers of {len(self.layouts)} {self._what()}s: a CUDA "
                    "graph replay skips the adapter's cleaning, and the state the graph was captured in can differ at "
                    "the replay (DeepEP issue #93); capture layers of one, or run these eagerly",
                    parameter=self._parameter(), value=sorted(self.layouts), allowed="one per process when captured")
            if self.needs_clean(key):
                raise md.InvalidSpecError(
                    "the process's DeepEP Buffer needs clean_low_latency_buffer before this LL call (a normal-mode "
                    "dispatch past 8 ranks wrote its RDMA region and its combine did not run): a clean captured into "
                    "a graph runs only at that graph's replay, on the ranks replaying it. Run one low-latency step "
                    "eagerly (it cleans), then capture", parameter="cuda_graph_capture", value="clean due",
                    allowed="capture after an eager low-latency step")
            if _live(self.pending):
                raise md.InvalidSpecError(
                    f"{len(self.pending)} eager low-latency dispatch(es) on the process's DeepEP Buffer await their "
                    "combine: DeepEP picks the signalling half on the host at capture, so this graph would start on "
                    "the other half from the one its replays find once those combines ran (the replays would read the "
                    "flags they left). Combine them (or drop their outputs), then capture",
                    parameter="cuda_graph_capture", value=f"{len(self.pending)} eager dispatches pending",
                    allowed="capture with every eager low-latency dispatch combined")
            if dispatch and self.captured_since_eager % 2 and not _live(self.captured_pending):
                raise md.InvalidSpecError(
                    "a capture ended with a low-latency dispatch whose combine was never captured (an aborted "
                    "capture?): DeepEP moved its host-side signalling half at that capture, so every graph captured "
                    "from here would read the counts the last kernel run left. The Buffer serves no more CUDA graphs "
                    "in this process", parameter="cuda_graph_capture",
                    value=f"{self.captured_since_eager} low-latency calls captured",
                    allowed="each captured dispatch followed by its combine (in the same graph or the next one)")
            self.captured = True
            self.captured_since_eager += 1
        elif self.captured_since_eager % 2:
            raise md.InvalidSpecError(
                f"CUDA graphs captured {self.captured_since_eager} low-latency calls on the process's DeepEP Buffer "
                "since its last eager one, an odd count (a dispatch without its combine): DeepEP picks the signalling "
                "half on the host at capture, so a replayed kernel keeps its half and an eager call here would read "
                "the counts or flags a replay left (wrong rows, a wrong sum). Capture each low-latency dispatch with "
                "its combine in the same graph", parameter="cuda_graph_capture",
                value=f"{self.captured_since_eager} low-latency calls captured",
                allowed="an even count: each dispatch captured with its combine")
        else:
            self.captured_since_eager = 0
        if self.needs_clean(key):
            self.buffer.clean_low_latency_buffer(tokens, hidden, num_experts)
        self.clean = frozenset({key})

    def after_normal_dispatch(self) -> None:
        """Internode normal-mode kernels write the RDMA region where the LL counts live (intranode ones the NVL
        region only)."""
        self.check_open()
        if self.held.low_latency_mode and self.internode:
            self.clean = frozenset()

    def after_normal(self) -> None:
        """The end of a normal-mode round (its combine): on an LL Buffer past 8 ranks, clean now for every LL layout
        on it, so that the next LL kernel finds the counts clean whether it runs eagerly or in a replayed graph."""
        self.check_open()
        if not (self.held.low_latency_mode and self.internode):
            return
        self.clean = frozenset()
        # One clean per E: half 1 of E sits at align_up(4E, 128), outside a larger E's two halves whenever 4·E_max
        # is not a multiple of 128 (vendor.ll_signalling_halves): no single clean covers every E.
        for t, h, e in self.layouts.values():
            self.buffer.clean_low_latency_buffer(t, h, e)
        self.clean = frozenset(self.layouts)

    def close(self) -> None:
        """Destroy it (the adapter's own; collective) or let it go (one handed in: its owner destroys it). A DeepEP
        without ``explicitly_destroy`` (before 0c984e2) frees it in its destructor when the last reference goes."""
        if self.closed:
            return
        if self.buffer is not None:
            self.settle()  # the hook holds the Buffer's memory: run it while the Buffer lives (owned or handed in)
        self.closed = True
        if self.owned and self.captured:
            warnings.warn("CUDA graphs captured DeepEP low-latency kernels on a Buffer close() now destroys (its NVSHMEM "
                          "memory is freed and NVSHMEM finalized): replaying them runs kernels on freed memory; drop "
                          "them first", RuntimeWarning, stacklevel=3)
        if self.owned and getattr(self.buffer, "explicitly_destroy", False):
            self.buffer.destroy()
        self.buffer = None


class Receive:
    """DeepEP's receive hook of one call: it launches the receive kernel on the stream that was current when the
    call started (the hook keeps it: csrc/legacy/buffer.hpp ``launch_stream``), and the host does not wait. Runs
    once; ``order`` makes the current stream wait for that one (the next call's send, or the engine's reads, may be
    on another stream)."""

    __slots__ = ("_hook", "stream")

    def __init__(self, hook: Callable[[], None], stream: Any) -> None:
        self._hook: Callable[[], None] | None = hook
        self.stream = stream

    @property
    def pending(self) -> bool:
        return self._hook is not None

    def run(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()

    def order(self) -> None:
        current = _current_stream()
        if self.stream is not None and current is not None and current != self.stream:
            current.wait_stream(self.stream)


def _current_stream() -> Any:
    """The current CUDA stream, where CUDA has started in this process (None on a CPU host: the fake's calls)."""
    return torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _live(handles: "weakref.WeakSet[Any]") -> int:
    """How many of ``handles`` are alive, after a collection when any seems to be: an output dropped in a reference
    cycle must count as dropped on every rank alike (the refusals it decides are the same on every rank)."""
    if len(handles):
        gc.collect()
    return len(handles)


# -- the registry --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferPlan:
    """What a layer will use: ``create`` a Buffer holding ``held``, ``reuse`` the registered ``entry``, or ``adopt``
    the Buffer handed in. Every rank must plan the same (``DeepEPBackend.agreement``)."""

    decision: str
    held: BufferRequest
    entry: SharedBuffer | None = None
    buffer: Any = None

    def agreement(self) -> dict[str, Any]:
        h = self.held
        mode = "LL" if h.low_latency_mode else "normal"
        return {"buffer": self.decision,
                "buffer held": f"{h.num_nvl_bytes},{h.num_rdma_bytes},{mode},{h.num_qps_per_rank}"}


class ProcessBuffers:
    """The ``deep_ep.Buffer``s of this process that the adapter uses: at most one with NVSHMEM per process (per
    ``vendor.nvshmem_domain``), and one intranode normal-mode Buffer per process group."""

    def __init__(self) -> None:
        self._entries: list[SharedBuffer] = []
        self._closes = 0  # close() calls: every rank makes them in the same order

    def nvshmem(self, domain: str) -> SharedBuffer | None:
        return next((e for e in self._entries if e.domain == domain and e.held.uses_nvshmem), None)

    def wrapper_of(self, buffer: Any) -> SharedBuffer | None:
        return next((e for e in self._entries if e.buffer is buffer), None)

    def nvl_only(self, domain: str, group: Any) -> SharedBuffer | None:
        return next((e for e in self._entries if e.domain == domain and not e.held.uses_nvshmem and e.group is group),
                    None)

    def plan(self, module: ModuleType | Any, group: Any, world_size: int, need: BufferRequest, spec: md.DispatchSpec,
             options: Mapping[str, Any]) -> BufferPlan:
        """Which Buffer a layer needing ``need`` uses; typed errors for every Buffer that cannot serve it."""
        domain = vendor.nvshmem_domain(module)
        given = options.get("buffer")
        if given is not None:
            return self._plan_given(domain, given, group, world_size, need, spec, options)
        if need.low_latency_mode or need.uses_nvshmem:
            entry = self.nvshmem(domain)
            if entry is None:
                return BufferPlan("create", planned_request(need, options, world_size))
            if entry.group is not group:
                raise md.InvalidSpecError(
                    "NVSHMEM starts once per process, and this process's DeepEP Buffer with NVSHMEM serves another "
                    "process group: create every layer of the process on one group", parameter="group",
                    value=f"{world_size} ranks", allowed="the group of the process's NVSHMEM Buffer")
            if need.low_latency_mode and not entry.held.low_latency_mode:
                raise md.InvalidSpecError(
                    "this process's DeepEP Buffer with NVSHMEM is a normal-mode one (past 8 ranks), and NVSHMEM starts "
                    "once per process: create the low-latency layer first, with options={'buffer_bytes': (nvl, rdma), "
                    "'buffer_num_qps_per_rank': ...} covering both modes (DeepEPBackend.both_modes_options), or hand "
                    "every layer one low_latency_mode=True Buffer as options['buffer']", parameter="mode",
                    value=spec.mode.value, allowed="normal mode only, or low-latency first")
            self._check_reuse(entry, need, spec, options, world_size)
            return BufferPlan("reuse", entry.held, entry)
        entry = self.nvl_only(domain, group)
        if entry is None:
            return BufferPlan("create", planned_request(need, options, world_size))
        self._check_reuse(entry, need, spec, options, world_size)
        return BufferPlan("reuse", entry.held, entry)

    def _plan_given(self, domain: str, given: Any, group: Any, world_size: int, need: BufferRequest,
                    spec: md.DispatchSpec, options: Mapping[str, Any]) -> BufferPlan:
        size = getattr(given, "group_size", world_size)
        if size != world_size:
            raise md.InvalidSpecError(f"the DeepEP Buffer handed in spans {size} ranks, not {world_size}",
                                      parameter="options.buffer", value=type(given).__name__,
                                      allowed=f"a Buffer of this {world_size}-rank group")
        # DeepEP keeps the group it was made on (Buffer.group; deepseek-ai/DeepEP@dd758ca deep_ep/buffers/legacy.py
        # __init__) and routes by its ranks: another group of the same size routes by another rank order.
        known = self.wrapper_of(given)
        if getattr(given, "group", group) is not group or (known is not None and known.group is not group):
            raise md.InvalidSpecError(
                "the DeepEP Buffer handed in was made on another process group than this layer's: DeepEP routes by "
                "the ranks of its own group", parameter="options.buffer", value=type(given).__name__,
                allowed="a Buffer made on the layer's group (the same group object)")
        entry = known
        if entry is not None:  # the adapter's own, or one adopted before: its one wrapper
            self._check_reuse(entry, need, spec, options, world_size, parameter="options.buffer")
            return BufferPlan("reuse", entry.held, entry)
        held = adopted_request(given, options)
        other = self.nvshmem(domain) if held.uses_nvshmem else None
        if other is not None:
            raise md.InvalidSpecError(
                "NVSHMEM starts once per process and this process already has a DeepEP Buffer with NVSHMEM (the "
                "adapter's, or one handed in before): hand that one Buffer to every layer, or leave options['buffer'] "
                "out and the layers share the process's one", parameter="options.buffer", value=type(given).__name__,
                allowed="the process's one NVSHMEM Buffer")
        check_serves(held, world_size, need, spec, parameter="options.buffer")
        depth = getattr(given, "nvshmem_qp_depth", None)
        if need.low_latency_mode and depth is not None:
            check_qp_depth(spec, depth)
        return BufferPlan("adopt", held, None, given)

    @staticmethod
    def _check_reuse(entry: SharedBuffer, need: BufferRequest, spec: md.DispatchSpec, options: Mapping[str, Any],
                     world_size: int, parameter: str | None = None) -> None:
        entry.check_open()
        check_serves(entry.held, world_size, need, spec,
                     parameter=parameter or ("options.buffer_bytes" if entry.owned else "options.buffer"))
        reserve = options.get("buffer_bytes")
        if reserve is not None and parameter is None:
            nvl, rdma = reserved_bytes(reserve, need.low_latency_mode, world_size)
            if nvl > entry.held.num_nvl_bytes or rdma > entry.held.num_rdma_bytes:
                raise md.CapacityError(
                    "the process's DeepEP Buffer was created before this layer, smaller than options['buffer_bytes'] "
                    "asks: pass the reservation to the first layer", parameter="options.buffer_bytes",
                    value=(nvl, rdma), allowed=f"<= ({entry.held.num_nvl_bytes}, {entry.held.num_rdma_bytes})")
        if need.low_latency_mode:
            entry.check_layout(spec)
            if entry.qp_depth is not None:
                check_qp_depth(spec, entry.qp_depth)

    def open(self, plan: BufferPlan, module: ModuleType | Any, group: Any, world_size: int, spec: md.DispatchSpec,
             clean_by_experts: bool) -> SharedBuffer:
        """The plan carried out: the Buffer the layer uses, registered, with the layer's LL layout."""
        if plan.decision == "reuse":
            entry = plan.entry
            assert entry is not None
        elif plan.decision == "adopt":
            entry = SharedBuffer(plan.buffer, group, world_size, plan.held, False,
                                 getattr(plan.buffer, "nvshmem_qp_depth", None), vendor.nvshmem_domain(module),
                                 clean_by_experts, clean=frozenset())  # its history is unknown: clean before LL
            self._entries.append(entry)
        else:
            entry = self._create(plan.held, module, group, world_size, spec, clean_by_experts)
        if spec.mode is md.Mode.LOW_LATENCY:
            entry.register(spec)
            # Clean now (creation is collective: every rank is here) rather than at the first LL call, which may be
            # captured into a CUDA graph: an adopted Buffer's history is unknown; a reused one may be dirty.
            entry.clean_now(spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.num_experts)
        return entry

    def _create(self, held: BufferRequest, module: ModuleType | Any, group: Any, world_size: int,
                spec: md.DispatchSpec, clean_by_experts: bool) -> SharedBuffer:
        if group is None:
            raise md.BackendUnavailableError(
                "DeepEP's Buffer needs a torch.distributed process group (it raises ValueError without one): call "
                "torch.distributed.init_process_group() first; a group of one rank works",
                parameter="group", value=None, allowed="an initialized process group")
        depth = vendor.qp_depth_from(os.environ)
        if held.low_latency_mode:
            check_qp_depth(spec, depth)
        extra = {"explicitly_destroy": True} if vendor.takes_explicitly_destroy(module) else {}
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):  # the V1 Buffer writes them while it starts
            buffer = module.Buffer(group, num_nvl_bytes=held.num_nvl_bytes, num_rdma_bytes=held.num_rdma_bytes,
                                   low_latency_mode=held.low_latency_mode,
                                   num_qps_per_rank=max(1, held.num_qps_per_rank), **extra)
        entry = SharedBuffer(buffer, group, world_size, held, True,
                             getattr(buffer, "nvshmem_qp_depth", depth) if held.low_latency_mode else None,
                             vendor.nvshmem_domain(module), clean_by_experts)
        self._entries.append(entry)
        return entry

    def close(self, domain: str, timeout_s: float) -> None:
        """Destroy the adapter's Buffers of ``domain`` and forget the ones handed in, in creation order (every rank
        registered them in the same order): a collective. Before each destroy (itself a collective: DeepEP's barrier
        kernels, the fake's gloo calls) the ranks of its group meet in a barrier that waits ``timeout_s`` and names a
        missing rank (``CollectiveTimeoutError``/``PeerFailedError``): a peer that died or never calls ``close`` is
        not waited for in the vendor's teardown. The Buffers not yet destroyed when that happens are closed without
        a destroy (their dispatchers refuse calls; DeepEP only warns at exit that ``destroy()`` was not called)."""
        entries = [e for e in self._entries if e.domain == domain]
        self._entries = [e for e in self._entries if e.domain != domain]
        self._closes += 1
        try:
            for i, entry in enumerate(entries):
                if entry.owned and entry.group is not None and not entry.closed:
                    comm = mdb.Comm(entry.group, timeout_s=timeout_s)
                    # The same name on every rank without an exchange (they close in the same order): the barrier's
                    # store keys, by which a timeout names the ranks that never came.
                    comm.bind(hashlib.sha1(f"cuda_deepep close {domain} {self._closes} {i}".encode()).hexdigest())
                    comm.barrier("cuda_deepep: close (every rank destroys the Buffer)")
                    with comm.calling():  # a fake's collectives in the destroy wait with this barrier's Watch
                        entry.close()
                else:
                    entry.close()
        finally:
            for entry in entries:
                if not entry.closed:  # a barrier failed: the peers cannot take part in the destroy
                    entry.closed, entry.buffer = True, None

    def reset(self) -> None:
        """Forget every Buffer without destroying any (what a new process starts with; the tests' fresh process)."""
        for entry in self._entries:
            entry.closed = True
        self._entries = []


#: This process's Buffers (NVSHMEM is per process).
PROCESS_BUFFERS = ProcessBuffers()

__all__ = ["ANY", "BUFFER_OPTIONS", "PROCESS_BUFFERS", "BufferPlan", "BufferRequest", "ProcessBuffers", "SharedBuffer",
           "adopted_request", "check_qp_depth", "check_serves", "planned_request", "qps_option", "reserved_bytes"]
