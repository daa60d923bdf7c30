"""The ``cuda_deepep_v2`` backend: DeepEP V2's ``ElasticBuffer`` (DeepEP 2.x, deepseek-ai/DeepEP@dd758ca).

    x ──codec (FP8: the core's per-128 cast; V2 moves (x, sf) as it is given)──▶ ElasticBuffer.dispatch(
        do_expand=True, expert_alignment=spec.expert_alignment, do_zero_padding=(alignment > 1),
        do_cpu_sync=(mode is normal))
        ──▶ rows per (token, local expert), grouped by expert, each expert at a multiple of the alignment = PACKED,
        counts = EPHandle.num_unaligned_recv_tokens_per_expert (on the device; low latency: worst-case rows)
    experts' unweighted rows ──× the row's weight (V2's combine applies none)──▶ ElasticBuffer.combine
        (each token's local rows summed in fp32, one partial per rank, summed at home in fp32) ──▶ bf16 [T, H]

A backend of its own rather than a version switch inside ``cuda_deepep``: V2 is another API (one buffer for every
layer and both directions, on NCCL's device API instead of NVSHMEM, JIT kernels) with other limits (any hidden size
that is a multiple of 256, top-32, 256 experts per rank, any EP size up to 1024) and another buffer size function, so
its capabilities, plan and failure modes differ from V1's; an engine names the one it deploys, and the V1 adapter,
audited four times, is left as it is. ``moe-dispatch explain`` says which DeepEP each can drive and why not.

Both modes are one V2 call: normal mode waits on the host for the counts (``do_cpu_sync=True``: exact shapes);
low-latency mode does not (``do_cpu_sync=False``, csrc/elastic/buffer.hpp:1065-1071): the rows are
DeepEP's worst case, ``align(R·N·min(K, E_local) + (a - 1)·E_local, a)``, the same every call, the counts stay on the
device, and the rows after the last expert's aligned end are unwritten, which the contract allows of low-latency
PACKED rows (``DispatchOutput``, "Worst-case rows"; ``Capabilities.worst_case_rows``); with no host sync and fixed
shapes the blocking calls can be captured in a CUDA graph (docs/evidence/vendor-notes/deepep-v2-elasticbuffer.md §5:
inferred from the source, not yet run), after a warm-up call of each shape (the no-sync kernels are JIT builds of their
own). Started calls under capture rely on torch taking DeepEP's ``record_stream`` while capturing, which DeepEP's
deep_ep/utils/event.py:26-28 calls incompatible with CUDA graphs (under ``EP_AVOID_RECORD_STREAM`` they run whole). The
worst case costs: combine's weighting multiplies every row, the tail included. Both in split
phase too: ``dispatch_start``/``combine_start`` pass ``async_with_compute_stream=True`` (DeepEP's kernels run on its
comm stream, after everything queued on the current one; in normal mode the dispatch start returns once the host has
the counts, which takes every peer's notify and whatever DeepEP's comm stream had queued, another micro-batch's calls
included; in low-latency mode at once) and ``wait()`` makes the current stream wait on DeepEP's event before anything
reads the outputs. Not driven: cached handles (the no-sync path with a fresh handle needs none), and DeepEP's hybrid
kernels: the buffer is made with ``allow_hybrid_mode=False`` (a group over several NVLink domains, 2 nodes x 4 GPUs,
runs the direct kernels over GIN); past 8 ranks, where no run here has checked them, it is refused.

``DispatchSpec.expert_alignment`` is DeepEP's own ``expert_alignment`` with ``do_zero_padding`` (DeepEP 2.1.0 on): the
rows arrive in DeepGEMM's contiguous (PSUM) layout, and combine takes the expert rows in it (padding rows are never
read), so neither side copies the rows.

A started call's inputs are DeepEP's until ``wait()``: its data warps read them on the comm stream after the start
returns (the contract's rule, ``Dispatcher.dispatch_start``); the routing it reads is the adapter's own copy when it
was the caller's memory. Under ``EP_AVOID_RECORD_STREAM`` DeepEP keeps a call's tensors alive only through its
event, so the starts run the calls to their end instead (``Pending.overlapped`` False). A ``wait()`` on another stream
than the start's waits for that one and records what it hands out there (``moe_dispatch.backend.hand_over``).

One ``ElasticBuffer`` per process group serves every layer (``ElasticBuffers``); a layer that needs more than the
current one replaces it (a collective, at creation, in the same order on every rank), unless the old one may still be
read: ``destroy()`` deregisters its NCCL window and frees its symmetric memory (csrc/elastic/buffer.hpp:152-166;
csrc/kernels/backend/nccl.cu:155-163), so after a dispatch or combine was captured in a CUDA graph on the group, or
while a dispatch waits for its combine or a started call for its ``wait()``, a larger layer is a ``CapacityError``:
create the largest layer first, or reserve with ``options["buffer_bytes"]`` (as ``cuda_deepep``'s V1 Buffer takes
it) on the first. ``close()`` destroys them (and warns if graphs captured calls on them).
"""

from __future__ import annotations

import functools
import gc
import importlib
import math
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch import DispatchOutput
from moe_dispatch.backend import (
    DEFAULT_TIMEOUT_S,
    check_timeout,
    group_list_from_counts,
    hand_over,
    keep_on_current,
    kept_routing,
    pack_ue8m0,
    restored_environ,
    start_mark,
)

from . import vendor
from .backend import check_runner_alignment

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N, L = md.Mode.NORMAL, md.Mode.LOW_LATENCY
NAME = "cuda_deepep_v2"


def capabilities(emulated: bool) -> mdb.Capabilities:
    limits = mdb.Limits(hidden_multiple=vendor.V2_COMBINE_HIDDEN_MULTIPLE, max_top_k=vendor.V2_MAX_TOPK,
                       world_sizes=frozenset(range(1, vendor.V2_DIRECT_MAX_RANKS + 1)))
    int8 = mdb.Fallback(F8, "DeepEP has no INT8 dispatch; FP8 sends the same bytes per element")
    return mdb.Capabilities(
        dtypes={N: frozenset({B, F8}), L: frozenset({B, F8})},
        fallbacks={(N, I8): int8, (L, I8): int8},
        rejections={F4: "DeepEP V2 moves pre-quantized rows with one 4-byte scale format; NVFP4 is not driven"},
        default_dtype=F8,
        fp8_ue8m0=True,  # packed four exponents per int32 word before dispatch: V2 moves any 4-byte scale (§3)
        expert_alignment=frozenset({N, L}),  # expert_alignment + do_zero_padding: DeepGEMM's layout, no copy
        split_phase=frozenset({N, L}),  # async_with_compute_stream: wait() orders the current stream after DeepEP's
        cuda_graph_modes=frozenset({L}),  # do_cpu_sync=False: no host wait, fixed shapes (not yet run on hardware)
        worst_case_rows=frozenset({L}),  # do_cpu_sync=False: DeepEP's worst-case rows (buffer.hpp:1065-1071)
        masked_modes=frozenset(),  # V2 has no MASKED output: PACKED in both modes
        devices=frozenset({"cpu"} if emulated else {"cuda"}),
        limits={N: limits, L: limits},
    )


def _module(name: str) -> tuple[Any, str | None]:
    """The DeepEP module and why it cannot drive V2 (None: it can)."""
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - DeepEP's import asserts on NCCL (deep_ep/__init__.py check_nccl_so)
        return None, f"deep_ep does not import ({type(exc).__name__}: {exc}); {vendor.V2_INSTALL_HINT}"
    version = getattr(module, "__version__", "1.x")
    if not vendor.has_elastic_buffer(module):
        return module, (f"DeepEP {version} has no ElasticBuffer (V2 is DeepEP 2.x, with NCCL >= "
                        f"{'.'.join(map(str, vendor.V2_MIN_NCCL))}); backend 'cuda_deepep' drives its V1 Buffer")
    if vendor.elastic_dispatch_lacks_zero_padding(module):
        return module, (f"DeepEP {version}'s ElasticBuffer.dispatch has no {vendor.V2_ZERO_PADDING} and its EPHandle "
                        f"no per-expert counts (both from {vendor.V2_MIN_VERSION}); upgrade DeepEP to "
                        f"{vendor.V2_MIN_VERSION} or later")
    return module, None


class ElasticBuffers:
    """This process's ``ElasticBuffer``s, one per process group, grown to the largest layer created."""

    def __init__(self) -> None:
        self._by_group: dict[int, Shared] = {}

    def open(self, module: Any, group: Any, num_bytes: int, timeout_s: float, device: torch.device) -> "Shared":
        """The group's buffer, made (or replaced by a larger one) when ``num_bytes`` exceeds it. DeepEP's host wait
        for the counts gives up after ``num_cpu_timeout_secs`` ("Dispatch CPU wait", buffer.hpp:1063): the creating
        dispatcher's ``timeout_s``, so a peer that never dispatches ends in an error, not a hang, in normal mode.
        Low-latency mode has no host wait: a peer that never comes ends in DeepEP's device trap after
        ``num_gpu_timeout_secs`` (100 s by default, comm.cuh:37-47), which loses the process's CUDA context."""
        shared = self._by_group.get(id(group))
        if shared is not None and shared.buffer is not None and shared.buffer.num_bytes >= num_bytes:
            return shared
        if shared is None:
            shared = self._by_group[id(group)] = Shared()
        if shared.buffer is not None:  # every rank replaces it at the same creation: the plans are agreed
            # ... and refuses together: a dispatch output alive on some ranks only must not let the others into
            # destroy()'s barrier (one flag, max-reduced over the group).
            why = shared.replace_refusal(num_bytes)
            flag = torch.tensor([0 if why is None else 1], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            if int(flag.item()):
                raise md.CapacityError(
                    why or "another rank's DeepEP ElasticBuffer of this group may still be read (a dispatch awaiting "
                    "its combine, a started call, or a captured graph there), so no rank replaces it",
                    parameter="options.buffer_bytes", value=num_bytes,
                    allowed=f"<= {shared.buffer.num_bytes} on this group's buffer")
            shared.buffer.destroy()
            shared.buffer = None
        with restored_environ(names=vendor.V2_WRITTEN):  # what the constructor writes (elastic.py:279-298)
            shared.buffer = getattr(module, vendor.ELASTIC_BUFFER)(  # never the hybrid kernels (V2_ALLOW_HYBRID_MODE)
                group, num_bytes=num_bytes, num_cpu_timeout_secs=max(1, math.ceil(timeout_s)),
                explicitly_destroy=True, **{vendor.V2_ALLOW_HYBRID_MODE: False})
        return shared

    def close(self) -> None:
        """Destroy every buffer, in creation order (DeepEP's ``destroy()`` is a device barrier of the group, with
        no timeout of ours: every rank must get here)."""
        for shared in self._by_group.values():
            if shared.buffer is not None:
                if shared.captured:
                    warnings.warn("CUDA graphs captured DeepEP V2 calls on an ElasticBuffer close() now destroys (its "
                                  "NCCL window is deregistered and its memory freed): replaying them runs kernels on "
                                  "freed memory; drop them first", RuntimeWarning, stacklevel=3)
                shared.buffer.destroy()
                shared.buffer = None
        self._by_group.clear()


@dataclass(eq=False)
class Shared:
    """One group's buffer, as every layer's dispatcher sees it (replaced in place when it grows), and what may still
    read it: graphs captured on it, dispatches awaiting their combine, started calls awaiting their ``wait()``."""

    buffer: Any = None
    #: A dispatch or combine ran under CUDA-graph capture on this buffer: a replay reads its window, whenever it runs.
    captured: bool = False
    #: Dispatch handles not yet combined and started calls not yet waited (dropped ones leave with their objects).
    outstanding: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def replace_refusal(self, num_bytes: int) -> str | None:
        """Why this rank must not destroy its buffer (``destroy()`` frees its NCCL window) for one of ``num_bytes``,
        None when it may (a collection first, so that an output dropped in a reference cycle counts as dropped)."""
        if len(self.outstanding):
            gc.collect()
        pending = len(self.outstanding)
        if not (self.captured or pending):
            return None
        why = ("CUDA graphs captured DeepEP V2 calls on it (their replays would run on the freed window)"
               if self.captured else f"{pending} dispatch(es) await their combine or started call(s) their wait() "
                                     "on it")
        held = self.buffer.num_bytes
        return (f"the group's DeepEP ElasticBuffer holds {held:,} B and this layer needs {num_bytes:,} B; replacing it "
                f"would destroy it (its NCCL window deregistered, its memory freed: csrc/elastic/buffer.hpp:152-166) "
                f"while {why}. Create the largest layer first, or give the first layer options={{'buffer_bytes': ...}} "
                f"(e.g. moe_dispatch.planning.plan_buffers('{NAME}', every_layers_spec, world_size).total_bytes)")


@dataclass(frozen=True, eq=False)  # by identity: ``Shared.outstanding`` holds them
class ElasticHandle:
    """What combine needs of one dispatch: DeepEP's handle and each received row's routing weight."""

    vendor_handle: Any
    weights: torch.Tensor  # fp32 [rows]: the weight of the (token, expert) pair each row is


class DeepEPV2Backend(mdb.Backend):
    vendor_environment = vendor.READ_ENVIRONMENT
    name = NAME
    description = ("DeepEP 2.x's V2 ElasticBuffer (NCCL device API): rows per (token, expert), the host waiting for "
                   "the counts in normal mode and not in low-latency mode (worst-case rows), one buffer per group; "
                   "DeepEP's V1 Buffer is backend 'cuda_deepep'")
    install_hint = vendor.V2_INSTALL_HINT
    engine_sizing = "DeepEP's own size formula with use_fp8_dispatch=False (what a BF16 wire needs)"

    def __init__(self, vendor_module: str = vendor.REAL) -> None:
        self.vendor_module = vendor_module
        self._buffers = ElasticBuffers()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_buffers": ElasticBuffers()}  # each process its own buffers

    @property
    def capabilities(self) -> mdb.Capabilities:  # type: ignore[override]
        return capabilities(self.vendor_module != vendor.REAL)

    def probe(self) -> str | None:
        module, why = _module(self.vendor_module)
        if why is not None:
            return why
        if self.vendor_module == vendor.REAL and not torch.cuda.is_available():
            return "no CUDA device"
        capability = vendor.device_capability(module)
        if capability is not None and capability[0] not in vendor.V2_ARCH_MAJORS:
            return (f"DeepEP 2.x targets SM90 and SM100 (README.md:64; its JIT builds sm_90a / sm_100a: "
                    f"csrc/jit/device_runtime.hpp:49-57); this GPU is compute capability "
                    f"{capability[0]}.{capability[1]}")
        return None

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        if world_size > vendor.V2_DIRECT_MAX_RANKS:  # before the generic EP-size refusal: say why
            raise md.InvalidSpecError(
                f"backend {self.name!r} drives DeepEP V2's direct kernels (allow_hybrid_mode=False), checked on one "
                "node's NVLink domain at most; past 8 ranks no run here has checked them", parameter="world_size",
                value=world_size, allowed=f"1..{vendor.V2_DIRECT_MAX_RANKS}")
        super().check_spec(spec, world_size)
        name = vendor.device_name(_module(self.vendor_module)[0])
        if vendor.pcie_pairs_only(name) and world_size > vendor.PCIE_MAX_RANKS:  # the V1 Buffer's rule, the same call
            raise md.InvalidSpecError(
                f"DeepEP's ElasticBuffer asserts at most 2 ranks on PCIe GPUs ({name}: '{vendor.PCIE_ASSERT_MESSAGE}', "
                "check_nvlink_connections, deep_ep/buffers/elastic.py:320)", parameter="world_size",
                value=world_size, allowed=f"1..{vendor.PCIE_MAX_RANKS} on this GPU")
        check_runner_alignment(spec, self.name)
        local = spec.num_experts // world_size
        for ok, parameter, value, allowed in (
            (spec.num_experts <= vendor.V2_MAX_EXPERTS, "num_experts", spec.num_experts,
             f"1..{vendor.V2_MAX_EXPERTS}"),
            (local <= vendor.V2_MAX_EXPERTS_PER_RANK, "num_experts", spec.num_experts,
             f"at most {vendor.V2_MAX_EXPERTS_PER_RANK} experts per rank ({vendor.V2_MAX_EXPERTS_PER_RANK * world_size}"
             f" on {world_size} ranks)"),
        ):
            if not ok:
                raise md.InvalidSpecError(f"backend {self.name!r}: DeepEP V2's workspace layout (layout.cuh:37-40) "
                                          "does not take this", parameter=parameter, value=value, allowed=allowed)

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> mdb.BufferSize:
        fp8 = spec.output_dtype is F8
        sizes = vendor.ported_elastic_buffer_sizes(world_size, spec.num_max_dispatch_tokens_per_rank,
                                                   spec.hidden_size, spec.top_k, fp8, allow_hybrid_mode=False)
        return mdb.BufferSize(sizes.dispatch, sizes.combine, allocated_bytes=sizes.total,
                             notes=("one ElasticBuffer per process group, shared by every layer: the largest layer's "
                                    "size (plus DeepEP's ~14 MiB workspace per rank)",
                                    "planned for one NVLink domain: over several (2 nodes x 4 GPUs) DeepEP's own hint, "
                                    "which creation allocates, adds send buffers (1.2-2.2x)"))

    def agreement(self, ctx: mdb.DispatchContext) -> dict[str, Any]:
        """The planned size, from the port: DeepEP's own hint wraps the group's NCCL communicator, which PyTorch
        creates lazily, and a DeepEP call before the group's first collective caches a null one and crashes
        (DeepEP #726). ``create`` calls DeepEP only after a collective."""
        spec = ctx.spec
        num_sms, reserve = self._check_options(ctx)
        return {"elastic num_bytes": max(vendor.ported_elastic_buffer_sizes(
            ctx.world_size, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.top_k, ctx.dtype is F8,
            allow_hybrid_mode=False).total, reserve), "num_sms": num_sms}

    def _check_options(self, ctx: mdb.DispatchContext) -> tuple[int, int]:
        """``options`` and the group, checked before any collective or DeepEP call (typed errors): the SM count, the
        reserved bytes, and a group that has a backend for the device (DeepEP takes it, deep_ep/utils/comm.py:61)."""
        module, _ = _module(self.vendor_module)
        num_sms = _num_sms_option(ctx.options, vendor.device_num_sms(module))
        reserve = _buffer_bytes_option(ctx.options)
        group = ctx.comm.process_group
        # DeepEP asks the group for its CUDA backend whatever the dispatcher's device (comm.py:61); the fake, CPU's.
        device = ctx.device if self.vendor_module != vendor.REAL else torch.device(vendor.V2_COMM_DEVICE)
        problem = None if group is None else vendor.group_backend_problem(group, device)
        if problem is not None:
            raise md.InvalidSpecError(
                f"DeepEP's ElasticBuffer takes the group's {device.type} backend for its NCCL communicator "
                f"(deep_ep/utils/comm.py:61): {problem}", parameter="group",
                value=torch.distributed.get_backend(group),
                allowed=f"a group with a {device.type} backend (NCCL: init_process_group('nccl') or "
                        "'cpu:gloo,cuda:nccl')")
        return num_sms, reserve

    def create(self, ctx: mdb.DispatchContext) -> "ElasticDispatcher":
        module, why = _module(self.vendor_module)
        assert why is None, why  # probe() said so before create_dispatcher got here
        group = ctx.comm.process_group
        if group is None:
            raise md.InvalidSpecError("DeepEP's ElasticBuffer runs on a torch.distributed process group",
                                      parameter="group", value=None,
                                      allowed="an initialized torch.distributed group (NCCL on a GPU)")
        self._check_torch_flags()
        num_sms, reserve = self._check_options(ctx)
        # A collective on the group's own device first: PyTorch creates an NCCL communicator at its first collective,
        # and DeepEP must not see it before (DeepEP #726: a null ncclComm_t, then a segfault in ncclTeamWorld).
        torch.distributed.all_reduce(torch.zeros(1, device=ctx.device), group=group)
        self._check_gin_domains(module, group, ctx.world_size)
        spec = ctx.spec
        hint = vendor.elastic_buffer_size_hint(module, group, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                               spec.top_k, ctx.dtype is F8)
        num_bytes = max(hint, reserve)
        try:
            shared = self._buffers.open(module, group, num_bytes, ctx.comm.timeout_s, ctx.device)
        except RuntimeError as exc:
            if vendor.V2_GIN_UNAVAILABLE not in str(exc):
                raise
            raise md.BackendUnavailableError(
                "DeepEP's ElasticBuffer found no NCCL GIN with full connectivity on this network (nccl.cu:86-99; the "
                "direct kernels need it across NVLink domains, which a multi-plane network may not give); on one "
                f"NVLink domain set {vendor.EP_DISABLE_GIN}=1 before creating it (DeepEP #629/#630)",
                parameter=vendor.EP_DISABLE_GIN, value=None,
                allowed="1 on one NVLink-only node, or a network with full-connectivity GIN") from exc
        return ElasticDispatcher(ctx, shared, vendor.topk_idx_dtype(module), num_sms,
                                 functools.partial(vendor.stream_capturing, module))

    @staticmethod
    def _check_gin_domains(module: Any, group: Any, world_size: int) -> None:
        """``EP_DISABLE_GIN`` set on a group over several NVLink domains: the constructor then makes a device
        communicator without GIN contexts (csrc/kernels/backend/nccl.cu:86-97), and the direct kernels have no way
        to the ranks outside the domain. Refused before any buffer, with DeepEP's own domain size (after the
        collective above: it wraps the group's NCCL communicator)."""
        if world_size <= 1 or not vendor.gin_disabled(os.environ):
            return
        domain = getattr(module, vendor.V2_PHYSICAL_DOMAIN_SIZE, None)
        if domain is None:
            return
        _, nvl = domain(group)
        if nvl < world_size:
            raise md.InvalidSpecError(
                f"{vendor.EP_DISABLE_GIN} is set, so DeepEP's ElasticBuffer makes no NCCL GIN contexts "
                f"(csrc/kernels/backend/nccl.cu:86-97), and this group spans {world_size // nvl} NVLink domains of "
                f"{nvl} ranks: its direct kernels need GIN to reach the other domains", parameter=vendor.EP_DISABLE_GIN,
                value=os.environ.get(vendor.EP_DISABLE_GIN),
                allowed=f"unset or 0 on a group over several NVLink domains (1 only within one: {nvl} ranks here)")

    @staticmethod
    def _check_torch_flags() -> None:
        """Every V2 call asserts that torch does not both use deterministic algorithms and fill uninitialized memory
        (deep_ep/utils/envs.py:183-189 ``check_torch_deterministic``): refused here with the fix, not a bare assert."""
        if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
            raise md.InvalidSpecError("DeepEP 2.x refuses to run while torch fills uninitialized memory (deterministic "
                                      "mode)", parameter="torch.use_deterministic_algorithms", value=True,
                                      allowed="False, or torch.utils.deterministic.fill_uninitialized_memory = False")

    def close(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Destroy this process's ElasticBuffers (a collective, like DeepEP's ``destroy()``: every rank, at the same
        point); their dispatchers then refuse calls."""
        check_timeout(timeout_s)
        self._buffers.close()


def _num_sms_option(options: Any, device_sms: int | None) -> int:
    """``options["num_sms"]``: an int from 0 (DeepEP's pick) to the device's SM count (``device_sms``; unbounded
    without a device), odd or even (``vendor.V2_NUM_SMS_ASSERT``); checked before any buffer is made (the agreement
    compares the options across ranks)."""
    value = options.get("num_sms", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (device_sms is not None
                                                                               and value > device_sms):
        most = device_sms if device_sms is not None else "the GPU's SM count"
        raise md.InvalidSpecError(f"DeepEP V2 asserts {vendor.V2_NUM_SMS_ASSERT} at every dispatch "
                                  "(csrc/elastic/buffer.hpp:979); 0 is its own pick", parameter="options.num_sms",
                                  value=value, allowed=f"an int in 0..{most}")
    return value


def _buffer_bytes_option(options: Any) -> int:
    """``options["buffer_bytes"]``: the bytes the group's ElasticBuffer reserves when this layer creates it (or
    replaces it), beyond this layer's own hint (e.g. ``moe_dispatch.planning.plan_buffers(...).total_bytes`` over every
    layer); rounded up to DeepEP's 2 MiB alignment (csrc/elastic/buffer.hpp:98). 0 when not given."""
    value = options.get("buffer_bytes")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise md.InvalidSpecError("the bytes to reserve in the group's DeepEP ElasticBuffer",
                                  parameter="options.buffer_bytes", value=value,
                                  allowed="a non-negative int (moe_dispatch.planning.plan_buffers(...).total_bytes)")
    return -(-value // vendor.V2_BUFFER_ALIGNMENT) * vendor.V2_BUFFER_ALIGNMENT


@dataclass
class ElasticDispatcher:
    """One layer's dispatch and combine on its group's shared ``ElasticBuffer``."""

    ctx: mdb.DispatchContext
    shared: Shared
    topk_idx_dtype: torch.dtype
    #: ``options["num_sms"]``: the SMs DeepEP's kernels take; 0, DeepEP's own pick (``get_theoretical_num_sms``, which
    #: falls to 4 where ``nvidia-smi nvlink -s`` cannot be read), resolved by every 2.x the adapter accepts
    #: (deepseek-ai/DeepEP@b306af0 deep_ep/buffers/elastic.py:732-733; @dd758ca :926-930, combine reusing the
    #: handle's at :1085-1088): 0 never reaches the kernels' ``num_sms > 0`` assert (csrc/elastic/buffer.hpp:728).
    num_sms: int = 0
    #: ``torch.cuda.is_current_stream_capturing()`` on the vendor's device (``vendor.stream_capturing``).
    capturing: Callable[[], bool] = lambda: False
    spec: md.DispatchSpec = field(init=False)

    def __post_init__(self) -> None:
        self.spec = self.ctx.spec

    def _buffer(self) -> Any:
        if self.shared.buffer is None:
            raise md.BackendUnavailableError(f"backend {NAME!r}: its ElasticBuffers were destroyed by close()",
                                             parameter="backend", value=NAME, allowed="a dispatcher created after "
                                             "the last close()")
        return self.shared.buffer

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchOutput:
        return self._dispatch(hidden_states, topk_ids, topk_weights, split=False, started=False)()

    def dispatch_start(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> md.Pending[DispatchOutput]:
        """DeepEP's kernels on its comm stream (``async_with_compute_stream``); ``wait()`` orders the current stream
        after them. In normal mode the start returns when the host has the counts (``do_cpu_sync``): every peer's
        notify, and whatever DeepEP's comm stream and the current stream had queued before; in low-latency mode at
        once. DeepEP's kernels read the inputs until ``wait()`` (the contract's rule). Synchronous under
        ``EP_AVOID_RECORD_STREAM``."""
        split = _splits()
        return md.Pending(self._dispatch(hidden_states, topk_ids, topk_weights, split=split, started=True),
                          overlapped=split)

    def _dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  split: bool, started: bool) -> Callable[[], DispatchOutput]:
        spec, ctx = self.spec, self.ctx
        fp8 = ctx.dtype is F8
        if fp8:
            q = ctx.codec.quantize(hidden_states)
            # DeepGEMM on SM100 takes UE8M0 packed four per int32 word (as DeepEP's V1 LL kernels emit it)
            scale = pack_ue8m0(q.scale) if ctx.codec.wire.ue8m0 else q.scale
            x: Any = (q.data.contiguous(), scale.contiguous())
        else:
            x = hidden_states.to(torch.bfloat16).contiguous()
        ids = topk_ids.to(self.topk_idx_dtype).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        # The routing as given, whenever wait() runs: the adapter's own memory, which DeepEP reads too (so a router
        # buffer the engine reuses is never DeepEP's input; hidden_states still is, until wait(): the contract's rule).
        ids, weights = kept_routing(ids, topk_ids), kept_routing(weights, topk_weights)
        alignment = spec.expert_alignment
        buffer = self._buffer()
        if self.capturing():
            self.shared.captured = True  # before the call: a capture that fails after it still holds its kernels
        recv, _, recv_w, handle, event = buffer.dispatch(
            x, topk_idx=ids, topk_weights=weights, num_experts=spec.num_experts,
            num_max_tokens_per_rank=spec.num_max_dispatch_tokens_per_rank, expert_alignment=alignment,
            num_sms=self.num_sms, do_cpu_sync=spec.mode is N, do_expand=True, do_zero_padding=alignment > 1,
            async_with_compute_stream=split)
        mark = start_mark(ids) if started else None  # after DeepEP's call: a whole one ends with a wait for its stream
        ours = ElasticHandle(handle, recv_w)
        self.shared.outstanding.add(ours)  # until its combine (or until it is dropped)

        def finish() -> DispatchOutput:
            rows, scale = recv if fp8 else (recv, None)
            if split:  # the outputs and the handle's counts are DeepEP's comm stream's until then
                event.current_stream_wait()
            unaligned = handle.num_unaligned_recv_tokens_per_expert
            hand_over(mark, (rows, scale, recv_w, ids, weights, unaligned))
            return DispatchOutput(rows, scale, ids, weights,
                                  group_list_from_counts(unaligned.to(torch.int64), spec.group_list_type, alignment),
                                  spec.group_list_type, md.Layout.PACKED, ctx.dtype, ours, None,
                                  expert_alignment=alignment)
        return finish

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        return self._combine(expert_output, dispatch_output, split=False, started=False)()

    def combine_start(self, expert_output: torch.Tensor,
                      dispatch_output: DispatchOutput) -> md.Pending[torch.Tensor]:
        """The weighting on the current stream, DeepEP's combine on its comm stream after it (the start does not
        hold the host); ``wait()`` orders the current stream after DeepEP's event. Synchronous under
        ``EP_AVOID_RECORD_STREAM``."""
        split = _splits()
        return md.Pending(self._combine(expert_output, dispatch_output, split=split, started=True), overlapped=split)

    def _combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput,
                 split: bool, started: bool) -> Callable[[], torch.Tensor]:
        h: ElasticHandle = dispatch_output.handle
        # V2's combine sums what it is given (combine.cuh; refs.py:177-243): the weights are applied here, in fp32,
        # and each weighted row is rounded once to bf16 before DeepEP's fp32 sums. Padding rows (weight 0, any value)
        # and low latency's unwritten tail (weights too: NaN times anything) are never read: combine takes each
        # (token, expert)'s row from recv_src_metadata, for the tokens the device counted (combine.cuh:44-46).
        # Made on the dispatch's stream, read on this one (an engine may combine on another): recorded here, as a
        # dispatch DeepEP ran whole recorded them nowhere else.
        keep_on_current((h.weights, *(v for v in vars(h.vendor_handle).values() if isinstance(v, torch.Tensor))))
        weighted = (expert_output.float() * h.weights.unsqueeze(1)).to(torch.bfloat16).contiguous()
        buffer = self._buffer()
        if self.capturing():
            self.shared.captured = True
        combined, _, event = buffer.combine(weighted, h.vendor_handle, async_with_compute_stream=split)
        mark = start_mark(weighted) if started else None
        self.shared.outstanding.discard(h)
        in_flight = _InFlight()
        if split:
            self.shared.outstanding.add(in_flight)

        def finish() -> torch.Tensor:
            if split:
                event.current_stream_wait()
            self.shared.outstanding.discard(in_flight)
            hand_over(mark, (combined,))
            return combined
        return finish


class _InFlight:
    """A started combine not yet waited (held by its ``Pending``: dropped with it)."""


def _splits() -> bool:
    """Whether a ``*_start`` runs split: not when ``EP_AVOID_RECORD_STREAM`` is set, where DeepEP keeps the call's
    tensors alive only through the returned event, so a ``Pending`` dropped unwaited, or waited on another stream,
    would free memory DeepEP's comm stream still uses (buffer.hpp:562-573)."""
    return not vendor.avoids_record_stream(os.environ)


__all__ = ["DeepEPV2Backend", "ElasticBuffers", "ElasticDispatcher", "NAME", "capabilities"]
