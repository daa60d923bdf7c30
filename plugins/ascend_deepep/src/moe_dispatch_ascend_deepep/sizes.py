"""The HCCL window this plugin requires and checks, from the vendor's own formulas.

DeepEP-Ascend ignores ``num_nvl_bytes`` / ``num_rdma_bytes`` (its size hints are dummies); every op
communicates through the HCCL window of its group and checks in its tiling the size it is told
(``DEEPEP_HCCL_BUFFSIZE`` when set, else ``HCCL_BUFFSIZE``: ``vendor.ops_window_mb``). Two numbers, then:

- the **group's window**, what HCCL allocated: the group's own ``hccl_buffer_size`` option when it was
  created with one (torch_npu ``pg_options``; sglang sizes its MoE group so, from ``DEEPEP_HCCL_BUFFSIZE``),
  else ``HCCL_BUFFSIZE``, else 200 MB (``GroupWindow``);
- the **ops' window**, what the ops check and the normal kernels lay their two halves out by.

The requirement (``required_window_bytes``) is the largest formula that applies on the chip (``soc``:
``"A2"``, ``"A3"``, or None when it cannot be known, e.g. planning on a machine without an NPU, where
the largest over both chips is the safe bound):

- low latency: the op's check and the README minimum, plus the A2 layered (two-node) kernels' assert
  when ``HCCL_INTRA_PCIE_ENABLE=1`` and ``HCCL_INTRA_ROCE_ENABLE=0`` (which only A2 reads: required
  on A3 as well, the safe side);
- normal: the A3 op's check (at least 213 MB whatever the shape), on A2 with at most 8 ranks the A2
  build's (at least 833 MB), and on A2 beyond 8 ranks (exactly 16: two 8-NPU servers, the only size its
  kernels handle) the internode kernels' (their RDMA, IPC and notify areas in the real window: at least
  1205 MB). ``create`` takes a chip torch_npu cannot name as A2 (the stricter); planning without the chip
  keeps, beyond 8 ranks, the A3 op's figure (what ``moe-dispatch plan`` has always shown there; pass
  ``soc="A2"`` to plan an A2 cluster).

``check_hccl_window`` requires ``needed <= ops' window <= group's window``: below the need the ops refuse
(or the kernels assert), and an ops' window above the group's makes the normal kernels write past its end.
Some kernels also keep window offsets in 32 bits, so windows are bounded from above too (``WindowBound``,
``window_bounds``): the A2 internode notify op's offset (group window <= 4495 MB), the A2 layered
low-latency kernels' IPC size (<= 4896 MB), the A2 multi-server low-latency halves (<= 8191 MB), and the
normal dispatch op's state-1 data offset (the ops' window, by the spec: ``vendor.normal_op_max_window_mb``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import moe_dispatch as md

from . import vendor as v


def is_a2_internode(mode: md.Mode, world_size: int, soc: str | None) -> bool:
    """Normal mode on more than 8 ranks of an Atlas A2 (``create`` takes a chip torch_npu cannot name as
    A2; planning without the chip keeps the A3 op's figure there: §3 of
    docs/evidence/plugins/ascend_deepep/vendor-notes.md)."""
    return mode is md.Mode.NORMAL and soc == v.SOC_A2 and world_size > v.A2_MAX_HCCS_PEERS


def required_window_bytes(mode: md.Mode, tokens: int, hidden: int, world_size: int, num_experts: int, top_k: int,
                          env: Mapping[str, str], soc: str | None = None) -> int:
    local = num_experts // world_size
    if mode is md.Mode.NORMAL:
        if is_a2_internode(mode, world_size, soc):  # A2 beyond a node: the internode kernels and the notify op
            return max(v.normal_internode_window_bytes_a2(tokens, hidden, world_size, local, top_k),
                       v.notify_dispatch_a2_window_bytes(num_experts, world_size, top_k))
        need = v.normal_op_window_bytes(tokens, hidden, top_k)  # the A3 op (CamMoeDispatchNormal)
        if soc != v.SOC_A3 and world_size <= v.A2_MAX_HCCS_PEERS:  # A2 (or unknown) single node: the ops2 op
            need = max(need, v.normal_op_window_bytes_a2(tokens, hidden, top_k))
        return need
    need = max(v.ll_op_window_bytes(tokens, hidden, world_size, local, top_k),
               v.readme_window_bytes(tokens, hidden, world_size, local, top_k))
    if v.is_layered(env):
        need = max(need, v.layered_window_bytes(tokens, hidden, num_experts, top_k))
    return need


def required_window_mb(spec: md.DispatchSpec, world_size: int, env: Mapping[str, str], soc: str | None = None) -> int:
    """What the windows must be at least for ``spec`` (MB, the ops' rounding); ``soc`` None: the
    largest over Atlas A2 and A3."""
    return v.window_mb(required_window_bytes(spec.mode, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                             world_size, spec.num_experts, spec.top_k, env, soc))


def _read_mb(name: str, raw: str, needed_mb: int) -> int:
    """A window variable as every reader reads it alike: torch_npu's ``strtol`` (the allocation), the ops'
    ``std::stoi`` (their check), Python's ``int`` (sglang's group size). Anything they read differently
    (``1_024``, non-ASCII digits, ``1024MB``) is refused rather than guessed."""
    have = v.plain_decimal(raw)
    if have is None:
        raise md.InvalidSpecError("is not a plain decimal number of MB (strtol, std::stoi and Python read anything "
                                  "else differently)", parameter=name, value=raw,
                                  allowed=f"ASCII digits >= {needed_mb}")
    if not 0 < have <= v.MAX_HCCL_BUFFSIZE_MB:  # the ops parse it into a uint16
        raise md.InvalidSpecError("DeepEP-Ascend's ops read the window size as a uint16 of MB", parameter=name,
                                  value=raw, allowed=f"{needed_mb}..{v.MAX_HCCL_BUFFSIZE_MB}")
    return have


@dataclass(frozen=True)
class WindowBound:
    """The largest window (MB) a kernel's 32-bit arithmetic addresses right, and why."""

    mb: int
    why: str


def window_bounds(mode: md.Mode, world_size: int, env: Mapping[str, str], soc: str | None
                  ) -> WindowBound | None:
    """The upper bound on the GROUP's window (what the kernels read as ``winSize``) on ``soc`` (None: not
    known, the A2 bound applies; it does not on A3)."""
    if soc == v.SOC_A3:
        return None
    if mode is md.Mode.NORMAL:
        if world_size > v.A2_MAX_HCCS_PEERS:
            return WindowBound(v.A2_INTERNODE_MAX_WINDOW_MB, "DeepEP-Ascend's Atlas A2 internode notify op keeps its "
                               "offset (the window minus 400 MB) in a uint32: above it its area and magic wrap onto "
                               "the dispatch's and combine's")
        return None
    if v.is_layered(env):
        return WindowBound(v.A2_LAYERED_MAX_WINDOW_MB, "DeepEP-Ascend's Atlas A2 layered low-latency kernels keep the "
                           "window and its IPC area (the window minus 804 MB) in uint32s: above it the IPC slices "
                           "overlap")
    if world_size > v.A2_MAX_HCCS_PEERS:
        return WindowBound(v.A2_LL_MULTI_SERVER_MAX_WINDOW_MB, "DeepEP-Ascend's Atlas A2 multi-server low-latency "
                           "kernels keep half the window in a uint32: from 8192 MB the halves overlap")
    return None


def normal_op_bound(tokens: int, hidden: int, top_k: int, soc: str | None) -> WindowBound:
    """The upper bound on the OPS' window for the normal dispatch op (A3; A2 up to 8 ranks): its state-1
    data offset ``W/2 + min(T, 8192)·k·ceil512(2H)`` is a uint32 (``soc`` None: A3's, the smaller)."""
    return WindowBound(v.normal_op_max_window_mb(tokens, hidden, top_k, soc),
                       "DeepEP-Ascend's normal dispatch op keeps its second-half data offset (half the window plus "
                       "T·k·ceil512(2H)) in a uint32: above it the second half's data wraps onto the first's")


def normal_op_max_tokens(spec: md.DispatchSpec, world_size: int, env: Mapping[str, str], need_soc: str | None,
                         bound_soc: str | None) -> int | None:
    """None where some ops' window holds this spec below the normal op's bound; else the largest tokens per
    rank for which one does (the need grows with T, the bound shrinks)."""
    def fits(t: int) -> bool:
        need = required_window_mb(spec_with_tokens(spec, t), world_size, env, need_soc)
        return need <= normal_op_bound(t, spec.hidden_size, spec.top_k, bound_soc).mb

    T = spec.num_max_dispatch_tokens_per_rank
    if fits(T):
        return None
    lo, hi = 0, T  # fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def spec_with_tokens(spec: md.DispatchSpec, tokens: int) -> md.DispatchSpec:
    return dataclasses.replace(spec, num_max_dispatch_tokens_per_rank=tokens)


@dataclass(frozen=True)
class GroupWindow:
    """The window HCCL gives the group (MB), the name of what sets it (``parameter`` of an error about
    it) and how it was found."""

    mb: int
    parameter: str
    source: str


def group_window(hccl_config: Mapping[str, Any] | None, env: Mapping[str, str], stated: Any = None,
                 stated_name: str = "hccl_window_mb", needed_mb: int = 0) -> GroupWindow:
    """The group's window: its ``hccl_buffer_size`` option where ``hccl_config`` (the group's options, as
    read) has one; else ``HCCL_BUFFSIZE`` (or HCCL's 200). ``hccl_config`` None means the options could not
    be read: ``stated`` (the caller's ``hccl_window_mb``) then, else the HCCL_BUFFSIZE rule, the window of a
    group created without options (documented; state the window for any other group)."""
    if stated is not None and (not isinstance(stated, int) or isinstance(stated, bool) or stated <= 0):
        raise md.InvalidSpecError("is the group's HCCL window in MB", parameter=stated_name, value=stated,
                                  allowed="a positive int")
    shared = None if hccl_config is None else hccl_config.get(v.HCCL_BUFFER_NAME_KEY)
    if shared is not None:
        raise md.InvalidSpecError(
            f"the group was created with {v.HCCL_BUFFER_NAME_KEY}={shared!r}: its HCCL window is shared with every "
            "communicator of that name, whose collectives would overwrite DeepEP-Ascend's flags, magic and window "
            "halves", parameter="process_group", value=f"{v.HCCL_BUFFER_NAME_KEY}={shared!r}",
            allowed=f"a group without {v.HCCL_BUFFER_NAME_KEY} (its own window)")
    option = None if hccl_config is None else hccl_config.get(v.HCCL_BUFFER_SIZE_KEY)
    if option is not None:
        if stated is not None and stated != option:
            raise md.InvalidSpecError(
                f"the group was created with {v.HCCL_BUFFER_SIZE_KEY}={option} (its HCCL window, read from its "
                "options)", parameter=stated_name, value=stated, allowed=f"{option} or None")
        return GroupWindow(int(option), v.HCCL_BUFFER_SIZE_KEY, f"{option} MB, its {v.HCCL_BUFFER_SIZE_KEY} option")
    if hccl_config is None and stated is not None:
        return GroupWindow(stated, stated_name, f"{stated} MB, options[{stated_name!r}]: its options cannot be read")
    raw = env.get(v.HCCL_BUFFSIZE)
    unread = "" if hccl_config is not None else \
        f"; its options cannot be read here: pass options={{{stated_name!r}: N}} if it has its own size"
    if raw is None:
        return GroupWindow(v.DEFAULT_HCCL_BUFFSIZE_MB, v.HCCL_BUFFSIZE, f"HCCL's default {v.DEFAULT_HCCL_BUFFSIZE_MB} "
                           f"MB: {v.HCCL_BUFFSIZE} unset, no {v.HCCL_BUFFER_SIZE_KEY} option{unread}")
    mb = _read_mb(v.HCCL_BUFFSIZE, raw, needed_mb)
    return GroupWindow(mb, v.HCCL_BUFFSIZE, f"{v.HCCL_BUFFSIZE}={mb} MB, no {v.HCCL_BUFFER_SIZE_KEY} option{unread}")


def check_hccl_window(needed_mb: int, env: Mapping[str, str], group: GroupWindow | None = None,
                      group_max: WindowBound | None = None, ops_max: WindowBound | None = None) -> GroupWindow:
    """Raise (not warn: the op refuses at its first call, the kernels assert, or memory is corrupted) unless
    ``needed_mb <= ops' window <= group's window``, the group's window <= ``group_max`` and the ops' window
    <= ``ops_max`` where the kernels' 32-bit arithmetic bounds them; say what to change. ``group`` None: a
    group created without options (``HCCL_BUFFSIZE``)."""
    group = group or group_window({}, env, needed_mb=needed_mb)
    ops_name = v.DEEPEP_HCCL_BUFFSIZE if env.get(v.DEEPEP_HCCL_BUFFSIZE) is not None else v.HCCL_BUFFSIZE
    ops_raw = env.get(ops_name)
    ops_mb = v.DEFAULT_HCCL_BUFFSIZE_MB if ops_raw is None else _read_mb(ops_name, ops_raw, needed_mb)
    sized = f"the group's HCCL window ({group.source})"
    if group.mb < needed_mb:
        fix = (f"export {v.HCCL_BUFFSIZE}={needed_mb} before the process group starts" if group.parameter ==
               v.HCCL_BUFFSIZE else f"create the group with {v.HCCL_BUFFER_SIZE_KEY} >= {needed_mb}")
        raise md.CapacityError(
            f"{sized} is smaller than the {needed_mb} MB this spec needs (DeepEP-Ascend's ops check it and its kernels "
            f"use it); {fix} ({v.SGLANG_GROUP_WINDOW_RULE}), or lower --num-max-dispatch-tokens-per-rank",
            parameter=group.parameter, value=group.mb, allowed=f">= {needed_mb}")
    if group_max is not None and group.mb > group_max.mb:
        raise md.InvalidSpecError(f"{sized} is larger than {group_max.mb} MB: {group_max.why}",
                                  parameter=group.parameter, value=group.mb, allowed=f"{needed_mb}..{group_max.mb}")
    where = "the default" if ops_raw is None else "set"
    if ops_mb < needed_mb:
        raise md.CapacityError(
            f"the window DeepEP-Ascend's ops see ({ops_name} {where} {ops_mb} MB) is smaller than the {needed_mb} MB "
            f"this spec needs (they check it at each call); export {ops_name}={needed_mb} (at most {group.mb}, the "
            "group's window), or lower --num-max-dispatch-tokens-per-rank",
            parameter=ops_name, value=ops_mb, allowed=f">= {needed_mb}")
    if ops_mb > group.mb:
        raise md.InvalidSpecError(
            f"the window DeepEP-Ascend's ops see ({ops_name} {where} {ops_mb} MB) is larger than {sized}: the normal "
            f"kernels place their second window half at {ops_name}/2 and would write past the window (the "
            f"low-latency ones fault); export {v.DEEPEP_HCCL_BUFFSIZE} between {needed_mb} and {group.mb}, or give the "
            f"group {ops_mb} MB ({v.SGLANG_GROUP_WINDOW_RULE})",
            parameter=ops_name, value=ops_mb, allowed=f"{needed_mb}..{group.mb}")
    if ops_max is not None and ops_mb > ops_max.mb:
        raise md.InvalidSpecError(
            f"the window DeepEP-Ascend's ops see ({ops_name} {where} {ops_mb} MB) is larger than {ops_max.mb} MB for "
            f"this spec: {ops_max.why}; export {v.DEEPEP_HCCL_BUFFSIZE} between {needed_mb} and {ops_max.mb}",
            parameter=ops_name, value=ops_mb, allowed=f"{needed_mb}..{ops_max.mb}")
    return group


__all__ = ["GroupWindow", "WindowBound", "check_hccl_window", "group_window", "is_a2_internode", "normal_op_bound",
           "normal_op_max_tokens", "required_window_bytes", "required_window_mb", "window_bounds"]
