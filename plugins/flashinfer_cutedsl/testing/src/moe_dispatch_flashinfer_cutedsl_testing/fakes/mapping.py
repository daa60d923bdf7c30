"""``flashinfer.comm.Mapping`` (flashinfer/comm/mapping.py, unchanged from v0.6.0 through
0.7.2.post1): the constructor's checks and the ranks MoeAlltoAll and MnnvlMemory read."""

from __future__ import annotations


class Mapping:
    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, cp_config=None, tp_size=1,
                 pp_size=1, moe_cluster_size=-1, moe_tp_size=-1, moe_ep_size=-1, attn_tp_size=-1, attn_cp_size=-1,
                 auto_parallel=False, enable_attention_dp=False) -> None:
        if moe_cluster_size == -1:
            moe_cluster_size = 1
        if moe_tp_size == -1 and moe_ep_size == -1:
            moe_tp_size, moe_ep_size = tp_size // moe_cluster_size, 1
        elif moe_tp_size == -1:
            moe_tp_size = tp_size // (moe_ep_size * moe_cluster_size)
        elif moe_ep_size == -1:
            moe_ep_size = tp_size // (moe_tp_size * moe_cluster_size)
        if attn_tp_size == -1 and attn_cp_size == -1:
            attn_tp_size, attn_cp_size = tp_size * cp_size, 1
        elif attn_tp_size == -1:
            attn_tp_size = cp_size * tp_size // attn_cp_size
        elif attn_cp_size == -1:
            attn_cp_size = cp_size * tp_size // attn_tp_size
        if attn_cp_size != 1:
            raise ValueError(f"attn_cp_size must be 1 for now, but got {attn_tp_size}, {attn_cp_size}.")
        if auto_parallel:
            if tp_size != 1 or pp_size != 1:
                raise ValueError("When auto parallel is enabled, tp_size, pp_size, cp_size must be 1, but got "
                                 f"{tp_size}, {pp_size}, {cp_size}.")
        elif tp_size * pp_size * cp_size != world_size:
            raise ValueError("world_size must equal to tp_size * pp_size * cp_size, but got "
                             f"{world_size} != {tp_size} * {pp_size} * {cp_size}.")
        if moe_tp_size * moe_ep_size * moe_cluster_size != tp_size:
            raise ValueError("tp_size must equal to moe_tp_size * moe_ep_size * moe_cluster_size, but got "
                             f"{tp_size} != {moe_tp_size} * {moe_ep_size} * {moe_cluster_size}")
        if attn_tp_size * attn_cp_size != tp_size * cp_size:
            raise ValueError("tp_size * cp_size must equal to attn_tp_size * attn_cp_size, but got "
                             f"{tp_size} * {cp_size} != {attn_tp_size} * {attn_cp_size}")
        if moe_ep_size != 1 and cp_size > 1:
            raise NotImplementedError("CP don't support MoE tp/ep yet")
        self.tp_size, self.cp_size, self.pp_size = tp_size, cp_size, pp_size
        self.cp_config = cp_config if cp_config is not None else {}
        self.moe_tp_size, self.moe_ep_size, self.moe_cluster_size = moe_tp_size, moe_ep_size, moe_cluster_size
        self.attn_tp_size, self.attn_cp_size = attn_tp_size, attn_cp_size
        self.auto_parallel, self.world_size = auto_parallel, world_size
        self.enable_attention_dp = enable_attention_dp
        self.rank = rank
        self.gpus_per_node = gpus_per_node

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, rank: int) -> None:
        # The vendor's test (`rank < 0 and rank >= world_size`) can never be true for an int.
        if not self.enable_attention_dp and (not isinstance(rank, int) or rank < 0 and rank >= self.world_size):
            raise ValueError(f"Rank should be an integer between 0 and {self.world_size - 1}, but got {rank}.")
        self._rank = rank

    @property
    def tp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank % (self.tp_size * self.cp_size) // self.tp_size

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank % self.moe_ep_size
