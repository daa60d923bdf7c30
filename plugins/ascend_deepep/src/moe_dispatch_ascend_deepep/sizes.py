"""The HCCL window DeepEP-Ascend communicates through, in plain Python.

DeepEP-Ascend ignores ``num_nvl_bytes`` / ``num_rdma_bytes`` (its ``Config`` size hints return
the hidden bytes, ``get_low_latency_rdma_size_hint`` returns T: sgl-kernel-npu
``csrc/deepep/config.cpp`` @e75ee72); memory comes from the HCCL buffer, ``HCCL_BUFFSIZE`` in
MB (default 200). Its README gives the minimum for the non-layered kernels:
``2 · (bs · R · min(E_local, k) · H · 2 B + 2 MB)`` — BF16 rows both ways, so the same for an
INT8 dispatch. H=7168, k=8, E=256, bs=128: R=8 → 228 MB, R=16 → 452 MB, R=32 → 900 MB.
"""

from __future__ import annotations

import math
from typing import Mapping

import moe_dispatch as md

MIB = 1 << 20
HCCL_BUFFSIZE = "HCCL_BUFFSIZE"
DEFAULT_HCCL_BUFFSIZE_MB = 200


def hccl_buffer_bytes(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    return 2 * (tokens * world_size * min(local_experts, top_k) * hidden * 2 + 2 * MIB)


def hccl_buffer_mb(tokens: int, hidden: int, world_size: int, local_experts: int, top_k: int) -> int:
    """What ``HCCL_BUFFSIZE`` must be at least (MB, rounded up)."""
    return math.ceil(hccl_buffer_bytes(tokens, hidden, world_size, local_experts, top_k) / MIB)


def check_hccl_buffsize(needed_mb: int, env: Mapping[str, str]) -> None:
    """Raise (not warn: the kernel would fail or corrupt later, on the device) when the
    environment gives the HCCL window less than the spec needs; say the value to set."""
    raw = env.get(HCCL_BUFFSIZE)
    try:
        have = DEFAULT_HCCL_BUFFSIZE_MB if raw is None else int(raw)
    except ValueError:
        raise md.InvalidSpecError("is not a whole number of MB", parameter=HCCL_BUFFSIZE, value=raw,
                                  allowed=f"an integer >= {needed_mb}") from None
    if have < needed_mb:
        where = "the default" if raw is None else "set"
        raise md.CapacityError(
            f"the HCCL window ({where} {have} MB) is smaller than the {needed_mb} MB this spec needs; "
            f"export {HCCL_BUFFSIZE}={needed_mb} before the process group starts, or lower "
            f"--num-max-dispatch-tokens-per-rank",
            parameter=HCCL_BUFFSIZE, value=have, allowed=f">= {needed_mb}",
        )


__all__ = ["DEFAULT_HCCL_BUFFSIZE_MB", "HCCL_BUFFSIZE", "MIB", "check_hccl_buffsize", "hccl_buffer_bytes",
           "hccl_buffer_mb"]
