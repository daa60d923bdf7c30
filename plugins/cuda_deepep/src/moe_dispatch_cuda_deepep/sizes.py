"""DeepEP V1 buffer sizes, ported to plain Python so they are tested without a GPU.

Follows deepseek-ai/DeepEP ``csrc/config.hpp`` (``Config::get_nvl_buffer_size_hint``,
``Config::get_rdma_buffer_size_hint``, ``LowLatencyLayout``, ``get_low_latency_rdma_size_hint``;
``csrc/legacy/config.hpp`` after the EPv2 rewrite, PR #605) and the tuned configs of
``deep_ep/buffer.py`` (``Buffer.get_dispatch_config`` / ``get_combine_config``, V1, with the
48- and 96-rank entries). Checked against DeepEP's published numbers: the low-latency hint
for T=128, H=7168, E=256 is 1,908,410,496 bytes (issue #368); the NVL hint of
``Config(24, 8, 512, 16, 128)`` for 7168 hidden bytes on 16 ranks is 453,380,736 (PR #434).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_dispatch import InvalidSpecError

NUM_MAX_NVL_PEERS = 8
NUM_BUFFER_ALIGNMENT_BYTES = 128
SOURCE_META_BYTES = 8  # internode::SourceMeta: two ints
_MAX_TOPK = 128  # kNumMaxTopK reserved per token
_MAX_SCALES = 128  # kNumMaxScales reserved per token
DEFAULT_NUM_SMS = 20  # Buffer.num_sms


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Config:
    """DeepEP's ``Config``: SMs and chunk sizes of the normal-mode kernels.

    The RDMA receive chunk is rounded up to a multiple of the send chunk, as DeepEP does.
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    def __post_init__(self) -> None:
        if self.num_sms < 0 or self.num_sms % 2:
            raise InvalidSpecError("DeepEP needs an even SM count", parameter="config.num_sms", value=self.num_sms,
                                   allowed="even, >= 0")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise InvalidSpecError("NVL send chunk must be positive and below the receive chunk",
                                   parameter="config.num_max_nvl_chunked_send_tokens",
                                   value=self.num_max_nvl_chunked_send_tokens,
                                   allowed=f"1..{self.num_max_nvl_chunked_recv_tokens - 1}")
        rdma_recv = _align(self.num_max_rdma_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens)
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens", rdma_recv)
        if not 0 < self.num_max_rdma_chunked_send_tokens <= rdma_recv // 2:
            raise InvalidSpecError("RDMA send chunk must be at most half the receive chunk",
                                   parameter="config.num_max_rdma_chunked_send_tokens",
                                   value=self.num_max_rdma_chunked_send_tokens, allowed=f"1..{rdma_recv // 2}")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            raise InvalidSpecError("DeepEP spans nodes of 8 GPUs", parameter="world_size", value=num_ranks,
                                   allowed="fewer than 8, or a multiple of 8")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_channels * nvl_ranks
        per_token = hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4
        total = slots * (2 * rdma_ranks + 3) * 4 + slots * self.num_max_nvl_chunked_recv_tokens * per_token
        return _align(total, 128)

    def rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        slots = self.num_channels * rdma_ranks
        per_token = hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4 + 16
        total = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        total += slots * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        total += 1 << 20  # "add a large number to be safe"
        return _align(total, 128)


# (nvl send, nvl recv, rdma send, rdma recv) per EP size, from Buffer.get_dispatch_config / get_combine_config.
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
SUPPORTED_EP_SIZES = frozenset(_DISPATCH)


def _config(table: dict[int, tuple[int, int, int, int]], num_ranks: int, num_sms: int) -> Config:
    if num_ranks not in table:
        raise InvalidSpecError("DeepEP has no tuned normal-mode config for this EP size; pass your own "
                               "`Config` in options={'dispatch_config': ..., 'combine_config': ...}",
                               parameter="world_size", value=num_ranks,
                               allowed=", ".join(map(str, sorted(table))))
    return Config(num_sms, *table[num_ranks])


def dispatch_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    return _config(_DISPATCH, num_ranks, num_sms)


def combine_config(num_ranks: int, num_sms: int = DEFAULT_NUM_SMS) -> Config:
    return _config(_COMBINE, num_ranks, num_sms)


@dataclass(frozen=True)
class LowLatencyLayout:
    """``LowLatencyLayout``: odd/even send, receive and signalling buffers, one RDMA region."""

    dispatch_msg_bytes: int
    combine_msg_bytes: int
    send_bytes: int
    recv_bytes: int
    signaling_bytes: int
    dispatch_bytes: int  # what dispatch alone would need (both halves)
    combine_bytes: int  # what combine alone would need (both halves)

    @classmethod
    def build(cls, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> "LowLatencyLayout":
        t, h, e = num_max_dispatch_tokens_per_rank, hidden, num_experts
        scales = h // 128
        dispatch_msg = 16 + max(2 * h, h + 4 * scales)  # int4 header + the larger of BF16 and FP8+scales
        combine_msg = 4 * scales + 2 * h  # per-128-channel min/max (LogFMT) + BF16
        send = max(t * dispatch_msg, e * t * combine_msg)
        recv = max(e * t * dispatch_msg, e * t * combine_msg)
        signaling = _align(e * 4, 128)
        return cls(dispatch_msg, combine_msg, send, recv, signaling,
                   dispatch_bytes=2 * (t * dispatch_msg + e * t * dispatch_msg + signaling),
                   combine_bytes=2 * (e * t * combine_msg + e * t * combine_msg + signaling))

    @property
    def total_bytes(self) -> int:
        return 2 * self.send_bytes + 2 * self.recv_bytes + 2 * self.signaling_bytes


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    """``Buffer.get_low_latency_rdma_size_hint``; ``num_ranks`` does not enter. DeepEP rounds
    with ``(n + 128) / 128 * 128``, which adds 128 bytes to an already aligned size."""
    total = LowLatencyLayout.build(num_max_dispatch_tokens_per_rank, hidden, num_experts).total_bytes
    return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES


__all__ = ["Config", "LowLatencyLayout", "SUPPORTED_EP_SIZES", "combine_config", "dispatch_config",
           "low_latency_rdma_size_hint"]
