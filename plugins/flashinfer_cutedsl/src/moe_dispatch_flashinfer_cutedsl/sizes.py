"""The MoE all-to-all workspace, in plain Python, ported from FlashInfer.

``flashinfer/comm/trtllm_moe_alltoall.py`` (``get_moe_workspace_size_per_rank``, v0.5–0.7)
sizes one rank's workspace as ``pad128(aux) + pad128(R·T·dispatch_bytes) + pad128(R·T·combine_bytes)``;
``aux`` is ``moeA2AGetAuxDataSize`` from ``csrc/trtllm_moe_alltoall.cu`` (flags, per-rank
counters, and per-token top-k target ranks and send indices for ``kMaxTopK`` = 8 experts).
"""

from __future__ import annotations

#: tensorrt_llm ``moe_alltoall`` kernel limits (``moeAlltoAllKernels.h``).
MAX_TOP_K = 8
MAX_EXPERTS_PER_RANK = 256
MAX_PAYLOADS = 8
_LINE = 128
_INT32 = 4


def pad128(n: int) -> int:
    return -(-n // _LINE) * _LINE


def aux_bytes(ep_size: int, max_num_tokens: int) -> int:
    """``calculateOffsets(...)[PAYLOAD_DATA_OFFSET_INDEX]``: the metadata ahead of the payloads."""
    offset = _INT32 + _INT32 + 2 * ep_size * _INT32  # flag, local counter, send and recv counters
    offset = pad128(offset) + ep_size * _INT32  # dispatch completion flags
    offset = pad128(offset) + ep_size * _INT32  # combine completion flags
    offset = pad128(offset) + max_num_tokens * MAX_TOP_K * _INT32  # top-k target ranks
    offset = pad128(offset) + max_num_tokens * MAX_TOP_K * _INT32  # top-k send indices
    return pad128(offset)


def dispatch_bytes_per_token(wire_bytes: int, top_k: int) -> int:
    """One token's dispatch payloads: the activation (data + scales), int32 ids, fp32 weights."""
    return wire_bytes + 2 * 4 * top_k


def workspace_size_per_rank(ep_size: int, max_num_tokens: int, dispatch_bytes: int, combine_bytes: int) -> int:
    """Bytes of one rank's workspace for per-token ``dispatch_bytes`` / ``combine_bytes``."""
    slots = ep_size * max_num_tokens
    return pad128(aux_bytes(ep_size, max_num_tokens)) + pad128(slots * dispatch_bytes) + pad128(slots * combine_bytes)


__all__ = ["MAX_EXPERTS_PER_RANK", "MAX_PAYLOADS", "MAX_TOP_K", "aux_bytes", "dispatch_bytes_per_token",
           "pad128", "workspace_size_per_rank"]
