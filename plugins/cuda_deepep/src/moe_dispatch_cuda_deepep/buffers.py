"""The ``deep_ep.Buffer``s a backend shares between its dispatchers, and the state they share on one.

Why share. Every ``deep_ep.Buffer`` with RDMA bytes starts NVSHMEM in its constructor and its ``destroy()`` (run
by the destructor) calls ``nvshmem_finalize()`` for the whole process; in low-latency mode past 8 ranks the second
live Buffer fails DeepEP's ``cpu_rdma_team == NVSHMEM_TEAM_INVALID`` assert (deepseek-ai/DeepEP@dd758ca
csrc/kernels/backend/nvshmem.cu init/finalize; csrc/legacy/buffer.hpp sync/destroy). So, as sglang's
``DeepEPBuffer`` does, one Buffer per (process group, mode) serves every layer: the backend object owns it
(``SharedBuffers``), sized at the first layer's creation for that layer, or for ``options["buffer_bytes"]`` (the
size ``md.plan_buffers``/``moe-dispatch plan`` give for every layer). A later layer that needs more is a typed
``CapacityError`` that says how to pre-size. ``options["buffer"]`` adopts a Buffer the engine made itself.

What they share. DeepEP's low-latency kernels need their signalling counts zeroed: after normal-mode kernels ran on
the Buffer, or after LL kernels of another (T, hidden, E) layout, ``clean_low_latency_buffer`` must run first
(legacy.py docstring; a collective: barrier, clean, barrier). ``SharedBuffer`` tracks that for every dispatcher on
the Buffer and cleans right before the next LL kernel; every rank makes the same calls in the same order, so every
rank cleans at the same point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import moe_dispatch as md
from moe_dispatch.environ import restored_environ

from . import vendor

#: DeepEP's constructor zeroes the whole RDMA buffer: clean for any layout.
_CLEAN_FOR_ANY = ("any",)


@dataclass(frozen=True)
class BufferRequest:
    """The ``deep_ep.Buffer`` one layer needs: bytes per region, the mode, the QPs per peer (LL: at least the local
    experts; normal past 8 ranks: the configs' channels or at least their SMs), and the configs' SMs."""

    num_nvl_bytes: int
    num_rdma_bytes: int
    low_latency_mode: bool
    num_qps_per_rank: int
    num_sms: int | None = None

    def covers(self, need: "BufferRequest") -> bool:
        return self.num_nvl_bytes >= need.num_nvl_bytes and self.num_rdma_bytes >= need.num_rdma_bytes


@dataclass(eq=False)
class SharedBuffer:
    """One ``deep_ep.Buffer`` and what every dispatcher on it must agree on."""

    buffer: Any
    group: Any
    world_size: int
    held: BufferRequest  # what it was created with (adopted: what its attributes say)
    owned: bool
    qp_depth: int | None
    clean_for: tuple | None = field(default=_CLEAN_FOR_ANY)

    # -- every dispatcher's calls ------------------------------------------------------------------------------

    def before_low_latency(self, tokens: int, hidden: int, num_experts: int) -> None:
        """Clean the signalling counts if normal-mode kernels or another LL layout used the Buffer since."""
        layout = (tokens, hidden, num_experts)
        if self.clean_for == layout:
            return
        if self.clean_for != _CLEAN_FOR_ANY:
            self.buffer.clean_low_latency_buffer(tokens, hidden, num_experts)
        self.clean_for = layout

    def after_normal(self) -> None:
        if self.held.low_latency_mode:
            self.clean_for = None

    # -- a new layer on it ---------------------------------------------------------------------------------------

    def check_fits(self, need: BufferRequest, spec: md.DispatchSpec) -> None:
        """Typed errors for a layer this Buffer cannot serve (before DeepEP asserts or traps)."""
        if self.owned:
            self._check_owned(need, spec)
        else:
            self._check_adopted(need, spec)
        if need.low_latency_mode and self.qp_depth is not None:
            check_qp_depth(spec, self.qp_depth)

    def _check_owned(self, need: BufferRequest, spec: md.DispatchSpec) -> None:
        held = self.held
        if not held.covers(need):
            raise md.CapacityError(
                f"this process group's shared DeepEP Buffer ({spec.mode.value} mode) was created for the first layer "
                f"(NVL {held.num_nvl_bytes:,} B, RDMA {held.num_rdma_bytes:,} B); this layer needs NVL "
                f"{need.num_nvl_bytes:,} B, RDMA {need.num_rdma_bytes:,} B. Create the largest layer first, or give "
                "the first layer options={'buffer_bytes': md.plan_buffers('cuda_deepep', every_layers_spec, "
                "world_size).total_bytes} (or the (NVL, RDMA) pair DeepEPBackend.buffer_request gives)",
                parameter="options.buffer_bytes", value=(need.num_nvl_bytes, need.num_rdma_bytes),
                allowed=f"<= ({held.num_nvl_bytes}, {held.num_rdma_bytes}) on this Buffer")
        if need.low_latency_mode and held.num_qps_per_rank < need.num_qps_per_rank:
            raise md.CapacityError(
                f"DeepEP's LL kernels device-assert QPs per peer >= local experts; this group's shared Buffer has "
                f"{held.num_qps_per_rank}: create the layer with the most experts per rank first",
                parameter="num_experts", value=spec.num_experts,
                allowed=f"at most {held.num_qps_per_rank} experts per rank on this Buffer")
        if (not need.low_latency_mode and self.world_size > vendor.NUM_MAX_NVL_PEERS and need.num_sms is not None
                and not vendor.internode_qps_ok(held.num_qps_per_rank, need.num_sms)):
            raise md.InvalidSpecError(
                f"DeepEP's internode dispatch device-asserts QPs per peer == channels or >= SMs; this group's shared "
                f"Buffer has {held.num_qps_per_rank} QPs, this layer's configs use {need.num_sms} SMs",
                parameter="options.dispatch_config", value=need.num_sms,
                allowed=f"num_sms <= {held.num_qps_per_rank} or == {2 * held.num_qps_per_rank}")

    def _check_adopted(self, need: BufferRequest, spec: md.DispatchSpec) -> None:
        def refuse(why: str, allowed: str) -> md.InvalidSpecError:
            return md.InvalidSpecError(f"the shared DeepEP Buffer {why}", parameter="options.buffer",
                                       value=type(self.buffer).__name__, allowed=allowed)

        size = getattr(self.buffer, "group_size", self.world_size)
        if size != self.world_size:
            raise refuse(f"spans {size} ranks, not {self.world_size}", f"a Buffer of this {self.world_size}-rank group")
        if need.low_latency_mode and not self.held.low_latency_mode:
            raise refuse("was not created with low_latency_mode=True", "a low-latency Buffer")
        if not self.held.covers(need):
            raise refuse(f"is smaller than this layer needs (NVL {need.num_nvl_bytes:,} B, RDMA "
                         f"{need.num_rdma_bytes:,} B)", "a Buffer sized for the largest layer sharing it")


def check_qp_depth(spec: md.DispatchSpec, depth: int) -> None:
    """DeepEP's LL calls ``assert self.nvshmem_qp_depth >= (T + 1) * 2`` (read at the Buffer's construction)."""
    t = spec.num_max_dispatch_tokens_per_rank
    most = vendor.low_latency_max_tokens(depth)
    if t > most:
        raise md.CapacityError(f"DeepEP's low-latency calls assert {vendor.NVSHMEM_QP_DEPTH} ({depth}) >= 2·(T+1); "
                               f"raise {vendor.NVSHMEM_QP_DEPTH} before the Buffer is created, or lower T",
                               parameter="num_max_dispatch_tokens_per_rank", value=t, allowed=f"1..{most}")


def reserved_bytes(option: Any, low_latency: bool, world_size: int) -> tuple[int, int]:
    """``options["buffer_bytes"]``: an int (``BufferPlan.total_bytes``), taken for every region the mode uses (LL:
    RDMA; normal: NVL, and RDMA past 8 ranks), or an (NVL, RDMA) pair."""
    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if positive_int(option):
        if low_latency:
            return 0, option
        return option, option if world_size > vendor.NUM_MAX_NVL_PEERS else 0
    if isinstance(option, (tuple, list)) and len(option) == 2 and all(positive_int(v) for v in option):
        return int(option[0]), int(option[1])
    raise md.InvalidSpecError("the bytes to reserve in the shared DeepEP Buffer", parameter="options.buffer_bytes",
                              value=option, allowed="an int (md.plan_buffers(...).total_bytes) or (nvl, rdma)")


def _align(n: int) -> int:
    a = vendor.NUM_BUFFER_ALIGNMENT_BYTES
    return -(-n // a) * a


@dataclass
class SharedBuffers:
    """The Buffers one backend object owns, one per (process group, mode), and the Buffers it adopted
    (``options["buffer"]``). Engines create every layer through one backend object (the plugin host's)."""

    owned: dict[tuple[int, bool], SharedBuffer] = field(default_factory=dict)
    adopted: dict[int, SharedBuffer] = field(default_factory=dict)

    def adopt(self, buffer: Any, group: Any, world_size: int) -> SharedBuffer:
        known = self.adopted.get(id(buffer))
        if known is not None and known.buffer is buffer:
            return known
        held = BufferRequest(int(getattr(buffer, "num_nvl_bytes", 0)), int(getattr(buffer, "num_rdma_bytes", 0)),
                             bool(getattr(buffer, "low_latency_mode", False)), 0)
        # Its history is unknown: clean before the first LL kernel.
        shared = SharedBuffer(buffer, group, world_size, held, False, getattr(buffer, "nvshmem_qp_depth", None), None)
        self.adopted[id(buffer)] = shared
        return shared

    def get(self, group: Any, low_latency: bool) -> SharedBuffer | None:
        return self.owned.get((id(group), low_latency))

    def create(self, module: ModuleType, group: Any, world_size: int, need: BufferRequest, spec: md.DispatchSpec,
               reserve: Any) -> SharedBuffer:
        """This group's Buffer for ``need.low_latency_mode``, sized for ``need`` and ``reserve``."""
        other = self.get(group, not need.low_latency_mode)
        if other is not None and world_size > vendor.NUM_MAX_NVL_PEERS:
            raise md.InvalidSpecError(
                "past 8 ranks both modes' Buffers start NVSHMEM in this process, which DeepEP does once per process "
                "(a second init is untested, the first Buffer's destroy finalizes it for both): share one "
                "low_latency_mode=True deep_ep.Buffer sized for both modes through options={'buffer': ...} "
                "(sglang's auto mode); the adapter cleans its LL signalling after normal-mode use",
                parameter="mode", value=spec.mode.value,
                allowed=f"{'normal' if need.low_latency_mode else 'low_latency'} mode only on this group, or "
                        "options['buffer']")
        nvl, rdma = (0, 0) if reserve is None else reserved_bytes(reserve, need.low_latency_mode, world_size)
        held = BufferRequest(_align(max(need.num_nvl_bytes, nvl)), _align(max(need.num_rdma_bytes, rdma)),
                             need.low_latency_mode, need.num_qps_per_rank, need.num_sms)
        if not need.low_latency_mode and held.num_rdma_bytes > 0 and max(held.num_nvl_bytes, held.num_rdma_bytes) \
                >= vendor.INT_MAX:
            raise md.CapacityError("DeepEP's internode notify asserts both buffers below INT_MAX bytes",
                                   parameter="options.buffer_bytes", value=(held.num_nvl_bytes, held.num_rdma_bytes),
                                   allowed=f"< {vendor.INT_MAX} each")
        if need.low_latency_mode:
            check_qp_depth(spec, vendor.qp_depth_from(os.environ))
        if group is None:
            raise md.BackendUnavailableError(
                "DeepEP's Buffer needs a torch.distributed process group (it raises ValueError without one): call "
                "torch.distributed.init_process_group() first; a group of one rank works",
                parameter="group", value=None, allowed="an initialized process group")
        with restored_environ():  # the V1 Buffer writes NVSHMEM_* into os.environ while it starts
            depth = vendor.qp_depth_from(os.environ)
            buffer = module.Buffer(group, num_nvl_bytes=held.num_nvl_bytes, num_rdma_bytes=held.num_rdma_bytes,
                                   low_latency_mode=need.low_latency_mode, num_qps_per_rank=held.num_qps_per_rank)
        shared = SharedBuffer(buffer, group, world_size, held, True,
                              getattr(buffer, "nvshmem_qp_depth", depth) if need.low_latency_mode else None)
        self.owned[(id(group), need.low_latency_mode)] = shared
        return shared


__all__ = ["BufferRequest", "SharedBuffer", "SharedBuffers", "check_qp_depth", "reserved_bytes"]
