"""The HCCL window this plugin requires and checks, from the vendor's own formulas.

DeepEP-Ascend ignores ``num_nvl_bytes`` / ``num_rdma_bytes`` (its size hints are dummies); every op
communicates through the HCCL window (``HCCL_BUFFSIZE`` MB, default 200) and checks it in its
tiling (``vendor.ll_op_window_bytes``, ``vendor.normal_op_window_bytes``), reading
``DEEPEP_HCCL_BUFFSIZE`` instead when that is set. The requirement here is the largest formula
that applies: low-latency the op's check and the README minimum, plus the A2 layered
(two-node) formula when ``HCCL_INTRA_PCIE_ENABLE=1`` and ``HCCL_INTRA_ROCE_ENABLE=0`` (which
only A2 reads: requiring it on A3 as well is the safe side); normal mode the normal op's check
(at least 213 MB whatever the shape).
"""

from __future__ import annotations

from typing import Mapping

import moe_dispatch as md

from . import vendor as v


def required_window_bytes(mode: md.Mode, tokens: int, hidden: int, world_size: int, num_experts: int, top_k: int,
                          env: Mapping[str, str]) -> int:
    local = num_experts // world_size
    if mode is md.Mode.NORMAL:
        return v.normal_op_window_bytes(tokens, hidden, top_k)
    need = max(v.ll_op_window_bytes(tokens, hidden, world_size, local, top_k),
               v.readme_window_bytes(tokens, hidden, world_size, local, top_k))
    if v.is_layered(env):
        need = max(need, v.layered_window_bytes(tokens, hidden, num_experts, top_k))
    return need


def required_window_mb(spec: md.DispatchSpec, world_size: int, env: Mapping[str, str]) -> int:
    """What ``HCCL_BUFFSIZE`` must be at least for ``spec`` (MB, the ops' rounding)."""
    return v.window_mb(required_window_bytes(spec.mode, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                             world_size, spec.num_experts, spec.top_k, env))


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
    """Raise (not warn: the op refuses at its first call, or corrupts when only
    DEEPEP_HCCL_BUFFSIZE was raised) when HCCL's window or the one the ops check is smaller than
    ``needed_mb``; say the value to export."""
    raw = env.get(v.HCCL_BUFFSIZE)
    have = v.DEFAULT_HCCL_BUFFSIZE_MB if raw is None else _read_mb(v.HCCL_BUFFSIZE, raw, needed_mb)
    checked = [(v.HCCL_BUFFSIZE, have, "the default" if raw is None else "set")]
    deepep = env.get(v.DEEPEP_HCCL_BUFFSIZE)
    if deepep is not None:
        checked.append((v.DEEPEP_HCCL_BUFFSIZE, _read_mb(v.DEEPEP_HCCL_BUFFSIZE, deepep, needed_mb), "set"))
    for name, mb, where in checked:
        if mb < needed_mb:
            raise md.CapacityError(
                f"the HCCL window ({name} {where} {mb} MB) is smaller than the {needed_mb} MB this spec needs "
                f"(DeepEP-Ascend's ops check it at each call); export {name}={needed_mb} before the process group "
                "starts, or lower --num-max-dispatch-tokens-per-rank",
                parameter=name, value=mb, allowed=f">= {needed_mb}",
            )


# -- the names before issue 13 (core/tests/test_plan.py uses them) ----------------------------------------


def hccl_buffer_bytes(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    """The README's non-layered minimum only (``vendor.readme_window_bytes``); what the plugin
    requires is ``required_window_bytes``, which is larger."""
    return v.readme_window_bytes(tokens, hidden, world_size, local_experts, top_k)


def hccl_buffer_mb(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    return v.window_mb(hccl_buffer_bytes(tokens, hidden, world_size, local_experts, top_k))


check_hccl_buffsize = check_hccl_window


__all__ = ["check_hccl_buffsize", "check_hccl_window", "hccl_buffer_bytes", "hccl_buffer_mb", "required_window_bytes",
           "required_window_mb"]
