"""What FuseEP's creation checks before the Buffer exists: the chip (the fused ops exist on Atlas A3
only; a chip torch_npu cannot name is an A3 here), the vendor build (``fuse_mode`` from KN@0ac00159), the
group's HCCL window and the window variables as the vendor reads them (inherited from ascend_deepep),
and the fuse mode every rank must agree on."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8, restored_environ
from moe_dispatch_ascend_deepep_testing.fakes import torch_npu as fake_npu
from moe_dispatch_ascend_fuseep import FuseEPBackend
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep_testing import FAKE, FAKE_NO_FUSE_MODE, fuseep_backend
from moe_dispatch_ascend_fuseep_testing.support import LOCAL, H, I, K, T, fused_dispatcher
from moe_dispatch_testing import random_expert_weights

A2 = 220  # torch_npu.npu.get_soc_version() of an Ascend910B1 (Atlas A2)
SPEC = md.DispatchSpec(1024, 4, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")


# -- the chip and the vendor build ----------------------------------------------------------------------------


def on_a2(rank: int, world: int) -> str:
    with fake_npu.soc_version(A2):
        reason = fuseep_backend(FAKE).probe()
        try:
            d = fused_dispatcher(1)
        except md.BackendUnavailableError as exc:
            return f"refused: {exc.parameter}={exc.value}; probe: {reason}"
        weights = random_expert_weights(LOCAL * world, H, I, generator=torch.Generator().manual_seed(0))
        layer = d.process_weights(quantize_weights_w8a8(weights).slice(rank * LOCAL, LOCAL))
        x = torch.randn(T, H).to(torch.bfloat16)
        try:
            d.forward(None, layer, x, torch.tensor([[0, 1]] * T), torch.ones(T, K))
        except RuntimeError as exc:
            return f"created, then the op failed: {str(exc)[:60]}"
        return "ran"


def test_fuseep_is_refused_on_atlas_a2(moe_rank_pools):
    """An A2 wheel builds csrc/deepep/ops2, which has no FusedDeepMoe / DispatchFFNCombine: probe() says
    so and create_dispatcher refuses, instead of the first fused_forward failing in EXEC_NPU_CMD."""
    for seen in moe_rank_pools.get(2).map(on_a2):
        assert seen.startswith("refused: backend=") and "Atlas A2" in seen, seen


def test_fuseep_takes_a_chip_it_cannot_name_as_a3():
    """ascend_deepep refuses HCCL_OP_EXPANSION_MODE on A2 and on a chip torch_npu cannot name; FuseEP's fused
    ops exist on A3 only (where deployments set HCCL_OP_EXPANSION_MODE=AIV), so its unknown chip is an A3, and
    FuseEPBackend takes no soc= to say so."""
    backend = FuseEPBackend(env={"HCCL_BUFFSIZE": "1024", "HCCL_OP_EXPANSION_MODE": "AIV"})  # no torch_npu: unknown
    assert backend.soc() is None
    assert backend.check_environment(SPEC, 2, {}, {}).mb == 1024


def test_a_deep_ep_before_fuse_mode_is_refused_with_the_reason():
    """fused_deep_moe took no fuse_mode before KN@0ac00159 (a keyword is a TypeError there), and
    builds before KN@8fe74692 pad an empty batch with a fake token the receivers count: the
    supported floor is the first build with fuse_mode, and probe() says why."""
    reason = fuseep_backend(FAKE_NO_FUSE_MODE).probe()
    assert reason is not None and "0ac00159" in reason and "8fe74692" in reason
    assert fuseep_backend(FAKE).probe() is None


# -- the group's window --------------------------------------------------------------------------------------


def sglang_window(rank: int, world: int) -> str:
    import torch.distributed as dist

    with fake_npu.group_hccl_config(dist.group.WORLD, {v.HCCL_BUFFER_SIZE_KEY: 2048}), \
            restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "2048", v.HCCL_BUFFSIZE: "400"}):
        try:
            fused_dispatcher(1)
        except md.MoEDispatchError as exc:
            return f"{type(exc).__name__} {exc.parameter}"
    return "created"


def test_fuseep_takes_the_groups_window(moe_rank_pools):
    """sglang's NPU layout (MoE group sized by DEEPEP_HCCL_BUFFSIZE, HCCL_BUFFSIZE smaller) is accepted."""
    assert moe_rank_pools.get(2).map(sglang_window) == ["created"] * 2


@pytest.mark.parametrize("raw", ["1_024", "\uff11\uff10\uff12\uff14"])
def test_fuseep_reads_the_window_variables_as_the_vendor_does(raw):
    with pytest.raises(md.InvalidSpecError) as info:
        fuseep_backend(FAKE, env={"HCCL_BUFFSIZE": raw}).check_window(SPEC, 2, {}, {})
    assert info.value.parameter == "HCCL_BUFFSIZE"
    assert fuseep_backend(FAKE, env={"HCCL_BUFFSIZE": "1024"}).check_window(SPEC, 2, {}, {}).mb == 1024


def test_fuseep_refuses_a_group_sharing_its_window_by_name():
    with pytest.raises(md.InvalidSpecError) as info:
        fuseep_backend(FAKE, env={"HCCL_BUFFSIZE": "1024"}).check_window(SPEC, 2, {"hccl_buffer_name": "moe"}, {})
    assert info.value.parameter == "process_group"


# -- what every rank agrees on --------------------------------------------------------------------------------


def mixed_fuse_modes(rank: int, world: int) -> str:
    try:
        fused_dispatcher(1 if rank == 0 else 2)
    except md.ConfigMismatchError as exc:
        return f"ConfigMismatchError {exc.parameter}"
    return "created"


def test_ranks_with_different_fuse_modes_get_a_config_mismatch(moe_rank_pools):
    """fuse_mode picks the collective op (aclnnFusedDeepMoe or aclnnDispatchFFNCombine): two ranks that differ
    would each wait in their own op on the device. The agreement refuses on every rank instead."""
    assert moe_rank_pools.get(2).map(mixed_fuse_modes) == ["ConfigMismatchError ascend_fuseep: fuse_mode"] * 2
