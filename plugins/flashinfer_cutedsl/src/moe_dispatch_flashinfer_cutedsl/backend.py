"""The ``flashinfer_a2a`` backend: FlashInfer's MoE all-to-all as a dispatch backend: ``MoeAlltoAll``
(0.6.0-0.7.2) or, from 0.7.4 (which has no ``MoeAlltoAll``), ``flashinfer.moe_ep``'s ``NVLinkOneSidedAlltoAll``:
the same TRT-LLM kernels, made by ``create_communication`` (``_one_sided_instances``).

Workspaces from 0.7.4. ``NVLinkOneSidedAlltoAll._WORKSPACES`` keys a workspace by (rank, world, its layout), so
each slot asks for its own layout with a few extra dispatch bytes per token (``vendor.ep_distinct_extra``);
the slots are the first past every layout of this shape the ranks' caches hold (``_first_free_ep_slot``,
compared on the fields no transport changes). The size is FlashInfer's ``moe_a2a_get_workspace_layout`` where its
module runs, else the port (``vendor.ep_workspace_layout``); CFT counted writes and the Lamport transport
(compute capability 10), which add regions of their own, are asked off (``vendor.EP_TRANSPORTS``). The MNNVL address-range refusals below apply to
both; 0.7.4 chooses the handle type per allocation, so it has no process-wide FABRIC decision to agree on.

Workspaces. ``MoeAlltoAll`` caches its MNNVL workspace at class level, keyed by (workspace size,
ep rank, ep size, max tokens, ...): two instances built alike share ONE workspace, and a second
dispatch would overwrite the first one's receive buffers and routing state. So each workspace a
dispatcher holds gets a key no other live workspace has: ``workspace_size_per_rank`` is FlashInfer's
size + 64 bytes + 128 bytes times a slot number, the slots being the first ones from 0 that no
rank's cache holds (gathered at creation, since allocation is collective). Every size FlashInfer's
own functions give (its default, ``moe_a2a_get_workspace_size_per_rank``, and so what vLLM and
SGLang pass) is a sum of 128-byte-padded terms, a multiple of 128, whatever the shape, top-k or
dtype: no such ``MoeAlltoAll`` can have a dispatcher's key (the cache key holds no top-k or hidden
size, so a neighbouring shape's FlashInfer size could equal FlashInfer's size + 128 B × j of this
one). The kernels only need ``size >= required``. FlashInfer never frees a cached workspace, so a
dispatcher's workspaces live as long as the process: create one dispatcher per shape and use it
for every layer.

Agreed by every rank before ``create`` (``agreement``: a ``ConfigMismatchError`` on every rank
instead of mismatched collectives inside FlashInfer's constructor): the FlashInfer, the number of
workspaces and one workspace's size. Refused before anything is allocated, where FlashInfer would
fail later:

- a group larger than the one FlashInfer's process-wide MNNVL address range was reserved for
  (``vendor.mnnvl_reservation``, read from FlashInfer's own class state): its peers would be mapped
  outside the range and ``cuMemMap`` fails; create the dispatcher on the largest group first;
- ``TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN`` parsing to 0 on FlashInfer < 0.6.14 (read once per process
  at the first dispatch): its warp policy never publishes and the ranks trap.

From FlashInfer 0.6.16 the MNNVL handle type is decided once per process, by an AND-reduce over
the comm of the first allocation (``MnnvlMemory._fabric_supported``): a rank that decided it
(an earlier MNNVL allocation over another group) skips that collective, a rank that did not makes
it, and the first allocation over a group holding both pairs the wrong collectives (a raise on
some ranks, a hang on the others). ``create`` gathers every rank's decision with the slots, and
where they differ every rank forgets it, so all of them decide again together, over this group.

An allocation that fails past its reservation (out of memory, the handle exchange) leaves FlashInfer's
range as it was: a new range with no record of how many ranks it was reserved for, or a range whose
current offset may hold the failed allocation's mappings. Either way FlashInfer is made to reserve
a new range for the next allocation (``vendor.retire_mnnvl_range``: when ``create`` finds a range no
allocation holds, and after a ``create`` whose constructors raised) rather than map into it.

FlashInfer 0.7.2 warns (DeprecationWarning) at every ``MoeAlltoAll`` construction: exactly that
warning is ignored, around the constructors only, so an "error" warnings filter does not fail
``create``.

Before 0.7.1 FlashInfer does not barrier after ``moe_a2a_initialize``: a fast rank's first
dispatch could land in a peer's workspace before that peer's memset erases it. ``create`` ends
with a barrier on the dispatcher's group (every version; once per dispatcher).
"""

from __future__ import annotations

import os
import re
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import as_bytes, from_bytes

from . import vendor
from .alltoall import FlashInferA2ADispatcher, OneSidedDispatcher
from .mnnvl_comm import comm_backend_for
from .vendor import INSTALL_HINT, REAL, VendorInfo, detect

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N = md.Mode.NORMAL
#: Workspaces per dispatcher: one dispatch may await combine per workspace (two-batch overlap).
DEFAULT_IN_FLIGHT = 2
#: A dispatcher's workspaces are FlashInfer's size + SLOT_RESIDUE + 128 B × slot, slots from
#: FIRST_SLOT: sizes ≡ 64 (mod 128), which none of FlashInfer's size functions gives (every one is
#: pad_up(aux, 128) + pad_up(R·T·dispatch, 128) + pad_up(R·T·combine, 128): flashinfer-ai/flashinfer@4230a48
#: ... 0.7.2.post1 flashinfer/comm/trtllm_moe_alltoall.py moe_a2a_get_workspace_size_per_rank), so no
#: FlashInfer-sized MoeAlltoAll of any shape shares a dispatcher's cache key.
FIRST_SLOT = 0
SLOT_RESIDUE = vendor.CACHELINE // 2


def slot_size(base: int, slot: int) -> int:
    """The ``workspace_size_per_rank`` of a dispatcher's workspace in ``slot``."""
    return base + SLOT_RESIDUE + vendor.CACHELINE * slot


def capabilities(info: VendorInfo) -> mdb.Capabilities:
    return mdb.Capabilities(
        dtypes={N: frozenset({B, F8, F4})},
        fallbacks={(N, I8): mdb.Fallback(F8, "CUDA MoE kernels take FP8, not INT8; FP8 sends the same bytes per element")},
        # The kernels behind it (CuTe-DSL, TRT-LLM MoE) quantize BF16 themselves.
        default_dtype=B,
        masked_modes=frozenset(),  # PACKED: the received rows gathered by expert (alltoall.py)
        devices=frozenset({"cpu"} if info.fake else {"cuda"}),
        limits={N: mdb.Limits(hidden_multiple=128, max_top_k=info.a2a_profile().max_top_k)},
    )


def dispatch_bytes_per_token(spec: md.DispatchSpec) -> int:
    """One token's dispatch payloads: the activation (data + scales), int32 ids, fp32 weights."""
    return spec.wire_format().bytes_per_token + 2 * 4 * spec.top_k


class FlashInferA2ABackend(mdb.Backend):
    """FlashInfer's ``MoeAlltoAll`` (TRT-LLM's MNNVL all-to-all), normal mode, any wire dtype
    but INT8. ``in_flight``: workspaces per dispatcher (default 2)."""

    vendor_environment = vendor.READ_ENVIRONMENT
    name = "flashinfer_a2a"
    engine_sizing = ("sglang's sizing per workspace: sglang (token_dispatcher/flashinfer.py @008b79d) sizes the dispatch "
                     "payload as max(quantized, BF16), i.e. for BF16, since a layer without a global scale sends BF16; "
                     "it keeps one workspace at T = max(chunked_prefill_size, 4096), this backend two (dispatches in "
                     "flight) at the T planned.")
    description = "FlashInfer MoE all-to-all (MNNVL): one copy per destination rank, add-only combine"
    install_hint = INSTALL_HINT

    def __init__(self, vendor_module: str = REAL, in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        if not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 1:
            raise md.InvalidSpecError("needs at least one workspace", parameter="in_flight", value=in_flight,
                                      allowed="an int >= 1")
        self.vendor_module = vendor_module
        self.in_flight = in_flight
        self._info: VendorInfo | None = None

    def vendor(self) -> VendorInfo:
        if self._info is None:
            self._info = detect(self.vendor_module)
        return self._info

    @property
    def capabilities(self) -> mdb.Capabilities:  # type: ignore[override]
        return capabilities(self.vendor())

    def probe(self) -> str | None:
        info = self.vendor()
        reason = info.a2a_reason()
        if reason is None and not info.fake and not torch.cuda.is_available():
            return "no CUDA device"
        return reason

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        super().check_spec(spec, world_size)
        profile = self.vendor().a2a_profile()
        if world_size > profile.max_ranks:
            raise md.InvalidSpecError(f"FlashInfer's all-to-all supports at most {profile.max_ranks} ranks (kMaxRanks)",
                                      parameter="world_size", value=world_size, allowed=f"1..{profile.max_ranks}")
        kernel_k = vendor.kernel_top_k(spec.top_k, profile.version)
        if kernel_k is None:
            raise md.InvalidSpecError(
                f"FlashInfer {'.'.join(map(str, profile.version))}'s all-to-all kernels take top-k up to "
                f"{profile.max_top_k}", parameter="top_k", value=spec.top_k, allowed=f"1..{profile.max_top_k}")
        if profile.one_sided and kernel_k > spec.num_experts:  # MoEEpCommParams: top_k <= num_experts
            raise md.InvalidSpecError(
                f"FlashInfer's one-sided kernels are built for top-k {sorted(profile.top_k_values)}: top-{spec.top_k} "
                f"runs as top-{kernel_k}, more than the {spec.num_experts} experts", parameter="top_k",
                value=spec.top_k, allowed=f"one of {sorted(k for k in profile.top_k_values if k <= spec.num_experts)} "
                                          f"(or at least {kernel_k} experts)")
        _check_threading_policy(profile.version)

    def workspace_bytes(self, spec: md.DispatchSpec, world_size: int, *, planning: bool) -> tuple[int, str]:
        """One workspace (FlashInfer's size function when it can run, else the ported formula).
        It runs while the ranks plan and agree, before the core can tell the peers of an untyped
        error: a failure of it (its JIT module failing to build) is a typed error, chained."""
        try:
            info, T = self.vendor(), spec.num_max_dispatch_tokens_per_rank
            if info.a2a_profile().one_sided:
                return self._ep_workspace_bytes(spec, world_size, 0, planning=planning)
            return vendor.workspace_size_per_rank(info, world_size, T, dispatch_bytes_per_token(spec),
                                                  2 * spec.hidden_size, planning=planning)
        except Exception as exc:
            raise md.BackendUnavailableError(
                f"FlashInfer's moe_a2a_get_workspace_size_per_rank failed: {type(exc).__name__}: {exc}",
                parameter="backend", value=self.name) from exc

    def _ep_sizes(self, spec: md.DispatchSpec, world: int, slot: int) -> tuple[int, int, int]:
        """(kernel top-k, dispatch capacity, combine capacity) of a one-sided workspace in ``slot``."""
        T = spec.num_max_dispatch_tokens_per_rank
        k = vendor.kernel_top_k(spec.top_k, self.vendor().a2a_profile().version) or spec.top_k
        wire = vendor.ep_bytes_per_token(spec.wire_format().dtype.value, spec.hidden_size)
        return k, vendor.ep_dispatch_bytes(world * T, wire, k, vendor.ep_distinct_extra(slot, world, T)), \
            world * T * 2 * spec.hidden_size

    def _ep_layout(self, spec: md.DispatchSpec, world: int, slot: int) -> dict[str, int]:
        return vendor.ep_workspace_layout(world, spec.num_max_dispatch_tokens_per_rank, *self._ep_sizes(spec, world, slot))

    def _ep_workspace_bytes(self, spec: md.DispatchSpec, world: int, slot: int, *, planning: bool) -> tuple[int, str]:
        """One ``NVLinkOneSidedAlltoAll`` workspace of a dispatcher's ``slot`` (its extra bytes per token)."""
        return vendor.ep_workspace_bytes(self.vendor(), world, spec.num_max_dispatch_tokens_per_rank,
                                         *self._ep_sizes(spec, world, slot), planning=planning)

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> mdb.BufferSize:
        total, source = self.workspace_bytes(spec, world_size, planning=True)
        if self.vendor().a2a_profile().one_sided:
            combine = self._ep_layout(spec, world_size, 0)["COMBINE_INPUT_SIZE"]
            slots = [self._ep_workspace_bytes(spec, world_size, j, planning=True)[0] for j in range(self.in_flight)]
            return mdb.BufferSize(
                total - combine, combine,
                notes=(f"one workspace = {total:,} B ({source}), x{self.in_flight} workspaces (in_flight), each with "
                       "a few extra dispatch bytes per token (NVLinkOneSidedConfig.extra_payload_bytes_per_token) so "
                       "that FlashInfer gives each its own workspace",),
                allocated_bytes=sum(slots))
        combine = vendor.pad128(world_size * spec.num_max_dispatch_tokens_per_rank * 2 * spec.hidden_size)
        slots = range(FIRST_SLOT, FIRST_SLOT + self.in_flight)  # the least the distinct cache keys add
        return mdb.BufferSize(
            total - combine, combine,
            notes=(f"one workspace = {total:,} B ({source}), x{self.in_flight} workspaces (in_flight), each "
                   f"{SLOT_RESIDUE} B + {vendor.CACHELINE} B x its slot number (from {FIRST_SLOT}) larger to keep "
                   "FlashInfer's cache keys distinct from each other and from every FlashInfer-sized one",),
            allocated_bytes=sum(slot_size(total, j) for j in slots),
        )

    def agreement(self, ctx: mdb.DispatchContext) -> dict[str, Any]:
        """What decides FlashInfer's collective constructors: the FlashInfer (its workspace layout,
        kernels and cache key), how many workspaces (one collective allocation each) and the size of
        one. No environment variable decides them (FlashInfer's mnnvl.py and trtllm_moe_alltoall.py
        read none; the kernels' block sizes are read per rank at the first launch).

        Refused here, on every rank before any allocation: ``options.in_flight`` other than the
        planned number, and an MNNVL address range reserved for fewer ranks than the group."""
        in_flight = ctx.options.get("in_flight", self.in_flight)
        if in_flight != self.in_flight:
            raise md.InvalidSpecError(
                "buffer_size planned another number of workspaces", parameter="options.in_flight", value=in_flight,
                allowed=f"{self.in_flight}, or FlashInferA2ABackend(in_flight={in_flight})")
        info = self.vendor()
        assert info.api is not None  # probe
        if info.a2a_profile().one_sided and not info.api.NVLinkOneSidedAlltoAll.is_platform_supported():
            # here, on the rank's own thread and device (probe may run elsewhere, on device 0): before any collective
            raise md.BackendUnavailableError(
                "FlashInfer's NVLink one-sided all-to-all is not supported on this rank's GPU (no P2P-capable NVLink, "
                "or not all of its NVLinks up: moe_ep nvlink_common.py nvlink_platform_supported)",
                parameter="backend", value=self.name, allowed="GPUs whose NVLinks are all up")
        base = self._workspace(ctx)
        _check_reservation(info.api.MnnvlMemory, ctx.world_size, base)
        return {"FlashInfer": f"{info.module_name} {info.version_text}", "in_flight": self.in_flight,
                "workspace bytes per rank": base}

    def _workspace(self, ctx: mdb.DispatchContext) -> int:
        """One workspace's size, by FlashInfer's own function (the number ``agreement`` carries)."""
        return self.workspace_bytes(ctx.spec, ctx.world_size, planning=False)[0]

    def create(self, ctx: mdb.DispatchContext) -> FlashInferA2ADispatcher:
        info = self.vendor()
        api = info.api
        assert api is not None
        spec, R, rank = ctx.spec, ctx.world_size, ctx.rank
        T = spec.num_max_dispatch_tokens_per_rank
        kernel_k = vendor.kernel_top_k(spec.top_k, info.a2a_profile().version)
        assert kernel_k is not None  # check_spec
        base = self._workspace(ctx)
        one_sided = info.a2a_profile().one_sided
        slots, fabric = _gather_process_state(api, ctx.comm, rank, R, T, base, self.in_flight,
                                              (lambda j: self._ep_layout(spec, R, j)) if one_sided else None)
        if len(set(fabric)) > 1:  # some ranks would skip FlashInfer's FABRIC AND-reduce, some make it
            vendor.forget_mnnvl_fabric_decision(api.MnnvlMemory)
        reserved = vendor.mnnvl_reservation(api.MnnvlMemory)
        if reserved is not None and reserved.orphaned:  # left by a failed allocation: ranks unknown
            vendor.retire_mnnvl_range(api.MnnvlMemory)
        try:
            if one_sided:
                instances = _one_sided_instances(api, ctx, kernel_k, slots)
            else:
                mapping = api.Mapping(world_size=R, rank=rank, gpus_per_node=R, tp_size=R, moe_ep_size=R)
                config = api.MnnvlConfig(comm_backend=comm_backend_for(ctx.comm))
                with _deprecation_ignored():
                    instances = [api.MoeAlltoAll(mapping, T, kernel_k, spec.num_experts,
                                                 workspace_size_per_rank=slot_size(base, j), mnnvl_config=config)
                                 for j in slots]
        except BaseException:
            # An allocation that failed past its reservation may have mapped handles at the range's
            # current offset, which FlashInfer neither unmaps nor moves past: allocate elsewhere next.
            vendor.retire_mnnvl_range(api.MnnvlMemory)
            raise
        if len({inst.workspace.data_ptr() for inst in instances}) != len(instances):
            raise md.CapacityError("FlashInfer handed two in-flight slots one workspace", parameter="in_flight",
                                   value=self.in_flight, allowed="distinct workspaces")
        # No rank dispatches into a workspace before every rank has initialized it (FlashInfer
        # barriers itself from 0.7.1 only).
        ctx.comm.barrier("flashinfer_a2a: workspaces initialized")
        cls = OneSidedDispatcher if one_sided else FlashInferA2ADispatcher
        return cls(ctx, instances, kernel_k)


def _one_sided_instances(api: Any, ctx: mdb.DispatchContext, kernel_k: int, slots: list[int]) -> list[Any]:
    """An ``NVLinkOneSidedAlltoAll`` per slot, each on a workspace of its own (the slot's extra bytes per
    token), handle exchange over the dispatcher's group, the fence transport only (``vendor.EP_TRANSPORTS``)."""
    spec, R, T = ctx.spec, ctx.world_size, ctx.spec.num_max_dispatch_tokens_per_rank
    fmt = vendor.EP_DISPATCH_FORMATS[spec.wire_format().dtype.value]
    params = api.MoEEpCommParams(num_experts=spec.num_experts, top_k=kernel_k, max_tokens_per_rank=T,
                                 hidden_size=spec.hidden_size, dtype=torch.bfloat16,
                                 dispatch_format=None if fmt is None else getattr(api.QuantFormat, fmt))
    bootstrap = api.BootstrapConfig(world_size=R, rank=ctx.rank)
    comm = comm_backend_for(ctx.comm)
    instances: list[Any] = []
    try:
        for j in slots:
            instances.append(api.create_communication(bootstrap, params, api.NVLinkOneSidedConfig(
                extra_payload_bytes_per_token=vendor.ep_distinct_extra(j, R, T), comm_backend=comm,
                **vendor.EP_TRANSPORTS)))
    except BaseException:
        for instance in instances:  # their workspaces back to FlashInfer (no collective without CFT)
            instance.destroy()
        raise
    return instances


def _check_threading_policy(version: vendor.Version) -> None:
    """Refuse TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN=0 where FlashInfer reads it (< 0.6.14)."""
    value = os.environ.get(vendor.ENV_ONE_BLOCK_PER_TOKEN)
    try:
        one_block = vendor.one_block_per_token(os.environ, version)
        why = "selects the warp policy, whose dispatch never publishes its completion flags (the ranks trap)"
    except ValueError as exc:
        one_block, why = False, f"is not a number std::stoi reads ({exc}): FlashInfer raises at the first dispatch"
    if one_block is False:
        raise md.InvalidSpecError(
            f"FlashInfer {'.'.join(map(str, version))} reads this once per process at the first dispatch; it {why}",
            parameter=vendor.ENV_ONE_BLOCK_PER_TOKEN, value=value,
            allowed="unset or a non-zero integer, or FlashInfer >= "
                    f"{'.'.join(map(str, vendor.ONE_BLOCK_PER_TOKEN_UNTIL))}")


@contextmanager
def _deprecation_ignored() -> Iterator[None]:
    """FlashInfer's deprecation of ``MoeAlltoAll`` (a DeprecationWarning at every construction from
    0.7.2), and nothing else, ignored; the caller's filters are back on exit."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(vendor.A2A_DEPRECATION), category=DeprecationWarning)
        yield


def _check_reservation(memory: Any, world: int, base: int) -> None:
    """Refuse a group larger than the one FlashInfer's MNNVL address range was reserved for, when
    the range may still take the workspace (``open_mnnvl_memory`` reuses it when the aligned size,
    >= ``base``, fits): FlashInfer would map the group's peers outside it."""
    reserved = vendor.mnnvl_reservation(memory)
    if reserved is None or reserved.comm_size is None or reserved.comm_size >= world or reserved.room < base:
        return
    raise md.InvalidSpecError(
        f"FlashInfer's MNNVL address range in this process is reserved for {reserved.comm_size} rank(s) (by an "
        f"earlier allocation over a smaller group) and would take this dispatcher's workspaces; FlashInfer "
        f"maps a group's peers inside that range, so a group of {world} fails in cuMemMap",
        parameter="group", value=f"{world} ranks",
        allowed=f"at most {reserved.comm_size} rank(s) in this process, or create the dispatcher on the largest "
                "group first")


def _first_free_slot(cls: type, rank: int, world: int, tokens: int, base: int) -> int:
    """The first slot j >= FIRST_SLOT past every one whose key (``slot_size(base, j)``, rank, world,
    tokens, ...) this rank's ``MoeAlltoAll._WORKSPACE_CACHE`` holds."""
    cache = getattr(cls, vendor.WORKSPACE_CACHE_ATTR, {})
    line, first = vendor.CACHELINE, slot_size(base, FIRST_SLOT)
    used = [(key[0] - first) // line for key in cache
            if tuple(key[1:4]) == (rank, world, tokens) and key[0] >= first and (key[0] - first) % line == 0]
    return max([FIRST_SLOT - 1, *used]) + 1


def _first_free_ep_slot(cls: type, rank: int, world: int, layout_of: Callable[[int], dict[str, int]]) -> int:
    """The first slot j >= FIRST_SLOT past every one whose workspace (``layout_of(j)``: compared on the fields
    that do not depend on the transports FlashInfer adds regions for) this rank's
    ``NVLinkOneSidedAlltoAll._WORKSPACES`` holds."""
    fields = ("MAX_NUM_TOKENS", "TOP_K", "COMBINE_INPUT_SIZE", "DISPATCH_PAYLOAD_SIZE", "EPLB_STATS_NUM_EXPERTS")
    shape = {f: layout_of(FIRST_SLOT)[f] for f in fields if f != "DISPATCH_PAYLOAD_SIZE"}
    held = {tuple(lay[f] for f in fields) for lay in vendor.ep_cached_layouts(cls, rank, world)
            if all(lay[f] == v for f, v in shape.items())}  # this shape's only: its slots differ in capacity alone
    largest = max((key[3] for key in held), default=-1)  # slots grow the dispatch capacity: none past this is held
    used, j = [], FIRST_SLOT
    while (layout := layout_of(j))["DISPATCH_PAYLOAD_SIZE"] <= largest:
        if tuple(layout[f] for f in fields) in held:
            used.append(j)
        j += 1
    return max([FIRST_SLOT - 1, *used]) + 1


def _gather_process_state(api: Any, comm: mdb.Comm, rank: int, world: int, tokens: int, base: int, count: int,
                          layout_of: Callable[[int], dict[str, int]] | None = None) -> tuple[list[int], list[int]]:
    """One gather over the group of this process's FlashInfer state that ``create`` needs equal on
    every rank: ``count`` slot numbers no rank's cache holds (each rank's cache may hold other keys:
    from the largest first free slot over the ranks), and every rank's FABRIC decision
    (``vendor.mnnvl_fabric_decision``), by rank."""
    first = _first_free_slot(api.MoeAlltoAll, rank, world, tokens, base) if layout_of is None else \
        _first_free_ep_slot(api.NVLinkOneSidedAlltoAll, rank, world, layout_of)
    mine = [first, vendor.mnnvl_fabric_decision(api.MnnvlMemory)]
    everyone = comm.gather_uncounted(as_bytes(torch.tensor(mine, dtype=torch.int64)),
                                     "flashinfer_a2a workspace slots and FABRIC decisions")
    table = from_bytes(everyone.reshape(comm.world_size, -1), torch.int64).reshape(comm.world_size, len(mine))
    start = int(table[:, 0].max())
    return list(range(start, start + count)), [int(v) for v in table[:, 1]]


__all__ = ["DEFAULT_IN_FLIGHT", "FIRST_SLOT", "SLOT_RESIDUE", "slot_size", "FlashInferA2ABackend", "capabilities", "dispatch_bytes_per_token"]
