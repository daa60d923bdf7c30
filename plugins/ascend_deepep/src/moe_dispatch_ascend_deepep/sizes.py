"""The HCCL window this plugin requires and checks, from the vendor's own formulas.

DeepEP-Ascend ignores ``num_nvl_bytes`` / ``num_rdma_bytes`` (its size hints are dummies); every op
communicates through the HCCL window (``HCCL_BUFFSIZE`` MB, default 200) and checks it in its
tiling (``vendor.ll_op_window_bytes``, ``vendor.normal_op_window_bytes``, and on Atlas A2
``vendor.normal_op_window_bytes_a2``), reading ``DEEPEP_HCCL_BUFFSIZE`` instead when that is set.
The requirement here is the largest formula that applies on the chip (``soc``: ``"A2"``, ``"A3"``,
or None when it cannot be known, e.g. planning on a machine without an NPU, where the largest over
both chips is the safe bound):

- low latency: the op's check and the README minimum, plus the A2 layered (two-node) formula
  when ``HCCL_INTRA_PCIE_ENABLE=1`` and ``HCCL_INTRA_ROCE_ENABLE=0`` (which only A2 reads: required
  on A3 as well, the safe side);
- normal: the A3 op's check (at least 213 MB whatever the shape), and on A2 with at most 8 ranks
  the A2 build's (at least 833 MB). A2 with more than 8 ranks takes DeepEP-Ascend's internode
  path, whose tiling checks no window: the A3 formula is required there as a floor (VENDOR.md,
  "Only the hardware can settle").

``DEEPEP_HCCL_BUFFSIZE`` is not only the ops' check: the normal kernels place their second window
half at ``DEEPEP_HCCL_BUFFSIZE/2``, so it must lie between the need and the real window
(``HCCL_BUFFSIZE``), or the kernels write past the window.
"""

from __future__ import annotations

from typing import Mapping

import moe_dispatch as md

from . import vendor as v


def required_window_bytes(mode: md.Mode, tokens: int, hidden: int, world_size: int, num_experts: int, top_k: int,
                          env: Mapping[str, str], soc: str | None = None) -> int:
    local = num_experts // world_size
    if mode is md.Mode.NORMAL:
        # The A3 op's check; on A2 beyond 8 ranks (internode: its tiling checks none) the same, as a floor.
        need = v.normal_op_window_bytes(tokens, hidden, top_k)
        if soc != v.SOC_A3 and world_size <= v.A2_MAX_HCCS_PEERS:  # A2 (or unknown) single node: the ops2 op
            need = max(need, v.normal_op_window_bytes_a2(tokens, hidden, top_k))
        return need
    need = max(v.ll_op_window_bytes(tokens, hidden, world_size, local, top_k),
               v.readme_window_bytes(tokens, hidden, world_size, local, top_k))
    if v.is_layered(env):
        need = max(need, v.layered_window_bytes(tokens, hidden, num_experts, top_k))
    return need


def required_window_mb(spec: md.DispatchSpec, world_size: int, env: Mapping[str, str], soc: str | None = None) -> int:
    """What ``HCCL_BUFFSIZE`` must be at least for ``spec`` (MB, the ops' rounding); ``soc`` None: the
    largest over Atlas A2 and A3."""
    return v.window_mb(required_window_bytes(spec.mode, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                             world_size, spec.num_experts, spec.top_k, env, soc))


def _read_mb(name: str, raw: str, needed_mb: int) -> int:
    try:
        have = int(raw)
    except ValueError:
        raise md.InvalidSpecError("is not a whole number of MB", parameter=name, value=raw,
                                  allowed=f"an integer >= {needed_mb}") from None
    if not 0 < have <= v.MAX_HCCL_BUFFSIZE_MB:  # the ops parse it into a uint16
        raise md.InvalidSpecError("DeepEP-Ascend's ops read the window size as a uint16 of MB", parameter=name,
                                  value=raw, allowed=f"{needed_mb}..{v.MAX_HCCL_BUFFSIZE_MB}")
    return have


def check_hccl_window(needed_mb: int, env: Mapping[str, str]) -> None:
    """Raise (not warn: the op refuses at its first call, or corrupts) when HCCL's window or the one
    the ops see is smaller than ``needed_mb``, or when ``DEEPEP_HCCL_BUFFSIZE`` is larger than the real
    window (the normal kernels lay their two halves out by it); say the value to export."""
    raw = env.get(v.HCCL_BUFFSIZE)
    have = v.DEFAULT_HCCL_BUFFSIZE_MB if raw is None else _read_mb(v.HCCL_BUFFSIZE, raw, needed_mb)
    checked = [(v.HCCL_BUFFSIZE, have, "the default" if raw is None else "set")]
    deepep = env.get(v.DEEPEP_HCCL_BUFFSIZE)
    ops_mb = None
    if deepep is not None:
        ops_mb = _read_mb(v.DEEPEP_HCCL_BUFFSIZE, deepep, needed_mb)
        checked.append((v.DEEPEP_HCCL_BUFFSIZE, ops_mb, "set"))
    for name, mb, where in checked:
        if mb < needed_mb:
            raise md.CapacityError(
                f"the HCCL window ({name} {where} {mb} MB) is smaller than the {needed_mb} MB this spec needs "
                f"(DeepEP-Ascend's ops check it at each call); export {name}={needed_mb} before the process group "
                "starts, or lower --num-max-dispatch-tokens-per-rank",
                parameter=name, value=mb, allowed=f">= {needed_mb}",
            )
    if ops_mb is not None and ops_mb > have:
        raise md.InvalidSpecError(
            f"{v.DEEPEP_HCCL_BUFFSIZE}={ops_mb} MB is larger than the real HCCL window ({v.HCCL_BUFFSIZE} "
            f"{checked[0][2]} {have} MB): DeepEP-Ascend's normal kernels place their second window half at "
            f"{v.DEEPEP_HCCL_BUFFSIZE}/2 and would write past the window; unset it or keep it <= {v.HCCL_BUFFSIZE}",
            parameter=v.DEEPEP_HCCL_BUFFSIZE, value=ops_mb, allowed=f"{needed_mb}..{have}")


__all__ = ["check_hccl_window", "required_window_bytes", "required_window_mb"]
