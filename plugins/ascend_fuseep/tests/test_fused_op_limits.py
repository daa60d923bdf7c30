"""What the fused ops refuse at their first call, refused at creation or at process_weights instead (an
independent read of DeepEP-Ascend KN@f425bdf and torch-npu 2.13.0): mode 1's local experts per vector core,
a chip that is not an Atlas A3, the FRACTAL_NZ cast torch_npu may quietly turn into ND, mode 2's 32-bit
workspace products and intermediate size, and the window variable of builds before KN@f7455efe; and the
per-call workspace mode 2 allocates, reported."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8, restored_environ
from moe_dispatch_ascend_deepep_testing.fakes import torch_npu as fake_npu
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep.backend import nz_cast
from moe_dispatch_ascend_fuseep.weights import process_fuseep_weights
from moe_dispatch_ascend_fuseep_testing import FAKE_BEFORE_F7455EFE, fuseep_backend
from moe_dispatch_ascend_fuseep_testing.support import LOCAL, H, I, K, T, fused_dispatcher
from moe_dispatch_testing import random_expert_weights


def _weights(experts: int, intermediate: int = I) -> md.ExpertWeights:
    return quantize_weights_w8a8(random_expert_weights(experts, H, intermediate,
                                                       generator=torch.Generator().manual_seed(0)))


def _create(fuse_mode: int, soc: tuple[int, str] | None = None, cores: int | None = None) -> str:
    with fake_npu.soc_version(*soc) if soc else fake_npu.soc_version(fake_npu.SOC_VERSION), \
            fake_npu.vector_cores(cores or fake_npu.VECTOR_CORES):
        try:
            fused_dispatcher(fuse_mode)
        except md.MoEDispatchError as exc:
            return f"{type(exc).__name__} {exc.parameter}: {exc}"
    return "created"


def mode1_with_few_cores(rank: int, world: int) -> tuple[str, str]:
    refused = _create(1, cores=2 * LOCAL - 2)  # LOCAL experts need 2·LOCAL vector cores
    return refused, _create(1, cores=2 * LOCAL)


def test_mode_1_takes_at_most_half_the_vector_cores_of_local_experts(moe_rank_pools):
    """fused_deep_moe_tiling.cpp:183-188: moeExpertNumPerRank <= aivNum/2 (24 on a 48-core A3); a spec past it
    failed every rank's first fused_forward."""
    for refused, created in moe_rank_pools.get(2).map(mode1_with_few_cores):
        assert refused.startswith("InvalidSpecError num_experts") and "vector cores" in refused, refused
        assert created == "created"


def on_a5(rank: int, world: int) -> str:
    return _create(2, soc=(260, "Ascend950PR_9599"))


def test_a_chip_torch_npu_names_but_is_not_an_a3_is_refused(moe_rank_pools):
    """The op definitions are AddConfig("ascend910_93") only; an Ascend950 (code 260, a name neither table knows)
    was taken as an A3."""
    for seen in moe_rank_pools.get(2).map(on_a5):
        assert seen.startswith("BackendUnavailableError backend") and "Ascend950PR_9599" in seen, seen


def test_the_nz_cast_refuses_the_nd_torch_npu_falls_back_to():
    w = torch.zeros(2, 64, 64, dtype=torch.int8)
    with pytest.raises(md.InvalidSpecError) as info:
        nz_cast(fake_npu, w)  # allow_internal_format: False, the Atlas A3 default
    assert info.value.parameter == v.ALLOW_INTERNAL_FORMAT
    fake_npu.npu.config.allow_internal_format = True
    try:
        assert fake_npu.get_npu_format(nz_cast(fake_npu, w)) == v.ACL_FORMAT_FRACTAL_NZ
    finally:
        fake_npu.npu.config.allow_internal_format = False


def test_mode_2_refuses_workspace_products_that_wrap_and_an_intermediate_nz_cannot_tile():
    weights = _weights(2)
    limit = v.MODE2_PRODUCT_LIMIT // max(2 * I, H)
    with pytest.raises(md.InvalidSpecError) as info:
        process_fuseep_weights(weights, 2, max_output_size=limit)
    assert info.value.parameter == "max_output_size"
    process_fuseep_weights(weights, 2, max_output_size=limit - 1)
    with pytest.raises(md.InvalidSpecError) as info:
        process_fuseep_weights(_weights(2, 520), 2)
    assert info.value.parameter == "intermediate_size"
    spec = md.DispatchSpec(H, 4, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    with pytest.raises(md.InvalidSpecError) as info:
        fuseep_backend().check_options(spec, {"fuse_mode": 2, "max_output_size": v.MODE2_ATTR_LIMIT}, 2)
    assert info.value.parameter == "max_output_size"
    # The default is what can arrive, T·R·min(k, E_local), not the vendor tests' T·R·k.
    assert fuseep_backend().check_options(spec, {"fuse_mode": 2}, 2) == (2, T * 2 * min(K, 2))


def test_mode_2_reports_the_workspace_it_allocates_at_each_call():
    """dispatch_ffn_combine_tiling.cpp:261-275 by hand at T 256, R 16, E_l 16, k 8, H 7168, I 2048, 32768 rows:
    coc = 256·8·4 + 3·16²·16·4 + 32768·(8 + 4·2048 + 2·7168 + 7168 + 2048) + 64·16 + 64·32 = 1,040,509,952 beats the
    routing's 16,843,072; plus 16 MiB."""
    assert v.mode2_workspace_bytes(256, 8, 16, 16, 7168, 2048, 32768) == 1_040_509_952 + 16 * v.MIB
    layer = process_fuseep_weights(_weights(2), 2, max_output_size=64, tokens=T, top_k=K, world_size=2)
    assert layer.workspace_bytes == v.mode2_workspace_bytes(T, K, 2, 2, H, I, 64)
    assert process_fuseep_weights(_weights(2), 1).workspace_bytes is None


def old_build_window(rank: int, world: int) -> str:
    spec = md.DispatchSpec(H, LOCAL * 2, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    with restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "1024", v.HCCL_BUFFSIZE: "5"}):
        backend = fuseep_backend(FAKE_BEFORE_F7455EFE)
        needs = [r.variable for r in backend.env_requirements(spec, world)]
        try:
            md.create_dispatcher(backend, spec, env={}, options={"fuse_mode": 2})
        except md.InvalidSpecError as exc:
            return f"{exc.parameter} {needs}"
    return f"created {needs}"


def test_mode_2_on_a_build_before_f7455efe_checks_the_variable_it_reads(moe_rank_pools):
    """Its tiling reads HCCL_BUFFSIZE only: with DEEPEP_HCCL_BUFFSIZE set for the other ops and HCCL_BUFFSIZE
    too small, creation passed and the op refused its first call."""
    for seen in moe_rank_pools.get(2).map(old_build_window):
        assert seen == f"{v.HCCL_BUFFSIZE} [{v.DEEPEP_HCCL_BUFFSIZE!r}, {v.HCCL_BUFFSIZE!r}]", seen
