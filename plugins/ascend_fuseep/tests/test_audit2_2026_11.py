"""The second independent audit (2026-11, docs/vendor-audits/2026-11/round2/ascend.md) where it concerns FuseEP: the window
the fused path checks is the group's (#19, inherited from ascend_deepep), and the fuse mode decides
which collective op runs, so the ranks agree on it before the Buffer exists (new)."""

from __future__ import annotations

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep.fakes import torch_npu as fake_npu
from moe_dispatch_ascend_fuseep import FuseEPBackend
from moe_dispatch_ascend_fuseep import vendor as v

H, LOCAL, K, T = 1024, 2, 2, 8


def _create(fuse_mode: int) -> md.Dispatcher:
    spec = md.DispatchSpec(H, LOCAL * 2, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    return md.create_dispatcher(FuseEPBackend(v.FAKE), spec, env={}, options={"fuse_mode": fuse_mode})


def mixed_fuse_modes(rank: int, world: int) -> str:
    try:
        _create(1 if rank == 0 else 2)
    except md.ConfigMismatchError as exc:
        return f"ConfigMismatchError {exc.parameter}"
    return "created"


def test_new_ranks_with_different_fuse_modes_get_a_config_mismatch(moe_rank_pools):
    """fuse_mode picks the collective op (aclnnFusedDeepMoe or aclnnDispatchFFNCombine): two ranks that differ
    would each wait in their own op on the device. The agreement refuses on every rank instead."""
    assert moe_rank_pools.get(2).map(mixed_fuse_modes) == ["ConfigMismatchError ascend_fuseep: fuse_mode"] * 2


def sglang_window(rank: int, world: int) -> str:
    import torch.distributed as dist

    with fake_npu.group_hccl_config(dist.group.WORLD, {v.HCCL_BUFFER_SIZE_KEY: 2048}), \
            restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "2048", v.HCCL_BUFFSIZE: "400"}):
        try:
            _create(1)
        except md.MoEDispatchError as exc:
            return f"{type(exc).__name__} {exc.parameter}"
    return "created"


def test_19_fuseep_takes_the_groups_window(moe_rank_pools):
    """sglang's NPU layout (MoE group sized by DEEPEP_HCCL_BUFFSIZE, HCCL_BUFFSIZE smaller) is accepted."""
    assert moe_rank_pools.get(2).map(sglang_window) == ["created"] * 2
