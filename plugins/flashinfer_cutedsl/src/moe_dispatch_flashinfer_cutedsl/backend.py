"""The ``flashinfer_a2a`` backend: FlashInfer's MoE all-to-all as a dispatch backend.

Workspaces. ``MoeAlltoAll`` caches its MNNVL workspace at class level, keyed by (workspace size,
ep rank, ep size, max tokens, ...): two instances built alike share ONE workspace, and a second
dispatch would overwrite the first one's receive buffers and routing state. So each workspace a
dispatcher holds gets a key no other live workspace has: ``workspace_size_per_rank`` is FlashInfer's
size plus 128 bytes times a slot number, the slots being the first ones that no rank's cache holds
(the ranks agree on them at creation, since allocation is collective). FlashInfer never frees a
cached workspace, so a dispatcher's workspaces live as long as the process: create one dispatcher
per shape and use it for every layer.

Refused before anything is allocated, where FlashInfer would fail later:

- a group larger than the one FlashInfer's process-wide MNNVL address range was reserved for
  (``vendor.mnnvl_reservation``, read from FlashInfer's own class state): its peers would be mapped
  outside the range and ``cuMemMap`` fails; create the dispatcher on the largest group first;
- ``TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN`` parsing to 0 on FlashInfer < 0.6.14 (read once per process
  at the first dispatch): its warp policy never publishes and the ranks trap.

Before 0.7.1 FlashInfer does not barrier after ``moe_a2a_initialize``: a fast rank's first
dispatch could land in a peer's workspace before that peer's memset erases it. ``create`` ends
with a barrier on the dispatcher's group (every version; once per dispatcher).
"""

from __future__ import annotations

import os

import torch

import moe_dispatch as md
from moe_dispatch.codecs import as_bytes, from_bytes

from . import vendor
from .alltoall import FlashInferA2ADispatcher
from .mnnvl_comm import comm_backend_for
from .vendor import INSTALL_HINT, REAL, VendorInfo, detect

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N = md.Mode.NORMAL
#: Workspaces per dispatcher: one dispatch may await combine per workspace (two-batch overlap).
DEFAULT_IN_FLIGHT = 2


def capabilities(info: VendorInfo) -> md.Capabilities:
    return md.Capabilities(
        dtypes={N: frozenset({B, F8, F4})},
        fallbacks={(N, I8): md.Fallback(F8, "CUDA MoE kernels take FP8, not INT8; FP8 sends the same bytes per element")},
        # The kernels behind it (CuTe-DSL, TRT-LLM MoE) quantize BF16 themselves.
        default_dtype=B,
        devices=frozenset({"cpu"} if info.fake else {"cuda"}),
        limits={N: md.Limits(hidden_multiple=128, max_top_k=info.a2a_profile().max_top_k)},
    )


def dispatch_bytes_per_token(spec: md.DispatchSpec) -> int:
    """One token's dispatch payloads: the activation (data + scales), int32 ids, fp32 weights."""
    return spec.wire_format().bytes_per_token + 2 * 4 * spec.top_k


class FlashInferA2ABackend(md.Backend):
    """FlashInfer's ``MoeAlltoAll`` (TRT-LLM's MNNVL all-to-all), normal mode, any wire dtype
    but INT8. ``in_flight``: workspaces per dispatcher (default 2)."""

    name = "flashinfer_a2a"
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
    def capabilities(self) -> md.Capabilities:  # type: ignore[override]
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
        if vendor.kernel_top_k(spec.top_k, profile.version) is None:
            raise md.InvalidSpecError(
                f"FlashInfer {'.'.join(map(str, profile.version))}'s all-to-all kernels take top-k up to "
                f"{profile.max_top_k}", parameter="top_k", value=spec.top_k, allowed=f"1..{profile.max_top_k}")
        _check_threading_policy(profile.version)

    def workspace_bytes(self, spec: md.DispatchSpec, world_size: int, *, planning: bool) -> tuple[int, str]:
        """One workspace (FlashInfer's size function when it can run, else the ported formula)."""
        return vendor.workspace_size_per_rank(self.vendor(), world_size, spec.num_max_dispatch_tokens_per_rank,
                                              dispatch_bytes_per_token(spec), 2 * spec.hidden_size, planning=planning)

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> md.BufferSize:
        total, source = self.workspace_bytes(spec, world_size, planning=True)
        combine = vendor.pad128(world_size * spec.num_max_dispatch_tokens_per_rank * 2 * spec.hidden_size)
        slack = vendor.CACHELINE * (self.in_flight - 1) * self.in_flight // 2  # the distinct cache keys
        return md.BufferSize(
            total - combine, combine,
            notes=(f"one workspace = {total:,} B ({source}), x{self.in_flight} workspaces (in_flight) + "
                   f"{vendor.CACHELINE} B per further slot to keep FlashInfer's cache keys distinct",),
            allocated_bytes=self.in_flight * total + slack,
        )

    def create(self, ctx: md.DispatchContext) -> FlashInferA2ADispatcher:
        info = self.vendor()
        api = info.api
        assert api is not None
        spec, R, rank = ctx.spec, ctx.world_size, ctx.rank
        in_flight = ctx.options.get("in_flight", self.in_flight)
        if in_flight != self.in_flight:
            raise md.InvalidSpecError(
                "buffer_size planned another number of workspaces", parameter="options.in_flight", value=in_flight,
                allowed=f"{self.in_flight}, or FlashInferA2ABackend(in_flight={in_flight})")
        T = spec.num_max_dispatch_tokens_per_rank
        kernel_k = vendor.kernel_top_k(spec.top_k, info.a2a_profile().version)
        assert kernel_k is not None  # check_spec
        base, _ = self.workspace_bytes(spec, R, planning=False)
        slots = _free_slots(api.MoeAlltoAll, api.MnnvlMemory, ctx.comm, rank, R, T, base, self.in_flight)
        mapping = api.Mapping(world_size=R, rank=rank, gpus_per_node=R, tp_size=R, moe_ep_size=R)
        config = api.MnnvlConfig(comm_backend=comm_backend_for(ctx.comm))
        instances = [api.MoeAlltoAll(mapping, T, kernel_k, spec.num_experts,
                                     workspace_size_per_rank=base + vendor.CACHELINE * j, mnnvl_config=config)
                     for j in slots]
        if len({inst.workspace.data_ptr() for inst in instances}) != len(instances):
            raise md.CapacityError("FlashInfer handed two in-flight slots one workspace", parameter="in_flight",
                                   value=self.in_flight, allowed="distinct workspaces")
        # No rank dispatches into a workspace before every rank has initialized it (FlashInfer
        # barriers itself from 0.7.1 only).
        ctx.comm.barrier("flashinfer_a2a: workspaces initialized")
        return FlashInferA2ADispatcher(ctx, instances, kernel_k)


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


def _free_slots(cls: type, memory: type, comm: md.Comm, rank: int, world: int, tokens: int, base: int,
                count: int) -> list[int]:
    """``count`` slot numbers j whose key (base + 128·j, rank, world, tokens, ...) no rank's
    ``MoeAlltoAll._WORKSPACE_CACHE`` holds, the same on every rank; refused on every rank when
    any rank's MNNVL address range was reserved for fewer ranks than ``world`` and may still
    take the workspace (``open_mnnvl_memory`` reuses it when the aligned size, >= ``base``, fits)."""
    cache = getattr(cls, vendor.WORKSPACE_CACHE_ATTR, {})
    line = vendor.CACHELINE
    used = [(key[0] - base) // line for key in cache
            if tuple(key[1:4]) == (rank, world, tokens) and key[0] >= base and (key[0] - base) % line == 0]
    first = max(used) + 1 if used else 0
    reserved = vendor.mnnvl_reservation(memory)
    narrow = reserved.comm_size if reserved is not None and reserved.comm_size < world and reserved.room >= base else 0
    everyone = comm.gather_uncounted(as_bytes(torch.tensor([[first, narrow]], dtype=torch.int64)).reshape(-1),
                                     "flashinfer_a2a workspace slots")
    agreed = from_bytes(everyone.reshape(comm.world_size, -1), torch.int64).reshape(comm.world_size, 2)
    narrowest = [int(n) for n in agreed[:, 1].tolist() if n]
    if narrowest:
        raise md.InvalidSpecError(
            f"FlashInfer's MNNVL address range in this process is reserved for {min(narrowest)} rank(s) (by an "
            f"earlier allocation over a smaller group) and would take this dispatcher's workspaces; FlashInfer "
            f"maps a group's peers inside that range, so a group of {world} fails in cuMemMap",
            parameter="group", value=f"{world} ranks",
            allowed=f"at most {min(narrowest)} rank(s) in this process, or create the dispatcher on the largest "
                    "group first")
    start = int(agreed[:, 0].max())
    return list(range(start, start + count))


__all__ = ["DEFAULT_IN_FLIGHT", "FlashInferA2ABackend", "capabilities", "dispatch_bytes_per_token"]
