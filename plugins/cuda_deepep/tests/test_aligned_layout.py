"""``DispatchSpec(expert_alignment=...)`` feeding DeepGEMM's contiguous GEMM without the runner's pad copy:
aligned rows go to the GEMM as they are (PSUM layout on DeepGEMM 2.3+, per-row ``m_indices``
before), on the CPU fakes of DeepGEMM (SM90, SM100, 2.2) and DeepEP V2; and a whole layer on two gloo ranks
with V2 writing the layout itself and with V1 through the core's copy."""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch import DispatchOutput
from moe_dispatch.backend import align_rows, make_codec, pack_ue8m0, row_experts
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts
from moe_dispatch_cuda_deepep_testing import DEEP_GEMM_EMULATOR, EMULATOR
from moe_dispatch_cuda_deepep_testing.fakes import deep_gemm as emu
from moe_dispatch_cuda_deepep_testing.selfcheck import run_layer
from moe_dispatch_testing.accuracy import TOLERANCES
from moe_dispatch_testing.routing import random_expert_weights

H, I, E = 256, 128, 4
COUNTS = [5, 0, 130, 1]  # an empty expert, one past a 128-row block
FP8, BF16 = md.DispatchDtype.FP8, md.DispatchDtype.BF16


def _dense(kind: str, ue8m0: bool = False, group_list_type: int = 1, packed: bool = True) -> DispatchOutput:
    """Dense PACKED rows as a backend returns them (UE8M0 scales packed four per word, or fp32 powers of two)."""
    x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(3))
    counts = torch.tensor(COUNTS)
    group_list = counts if group_list_type == 1 else torch.cumsum(counts, 0)
    routing = torch.zeros(0, 1, dtype=torch.int64)
    if kind == "bf16":
        return DispatchOutput(x.to(torch.bfloat16), None, routing, routing.float(), group_list, group_list_type,
                              md.Layout.PACKED, BF16, None)
    q = make_codec(mdb.WireFormat(FP8, H, ue8m0=ue8m0)).quantize(x)
    scale = pack_ue8m0(q.scale) if ue8m0 and packed else q.scale
    return DispatchOutput(q.data, scale, routing, routing.float(), group_list, group_list_type, md.Layout.PACKED,
                          FP8, None)


class _Spy:
    """A DeepGEMM module whose contiguous GEMMs record the rows and group layout they were given."""

    def __init__(self, module: object) -> None:
        self._module, self.calls = module, []

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._module, name)
        if not (name.startswith("m_grouped") and "contiguous" in name):
            return fn

        def recorded(a, b, d, grouped_layout, *args, **kwargs):  # noqa: ANN001, ANN202
            self.calls.append((a[0] if isinstance(a, tuple) else a, grouped_layout, kwargs))
            return fn(a, b, d, grouped_layout, *args, **kwargs)

        return recorded


@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("kind, capability, version, psum", [
    ("block_fp8", (9, 0), "2.6.1", True), ("bf16", (9, 0), "2.6.1", True), ("block_fp8", (10, 0), "2.6.1", True),
    ("block_fp8", (9, 0), "2.4.2", True), ("block_fp8", (10, 0), "2.3.0", True), ("block_fp8", (9, 0), "2.3.0", False),
    ("block_fp8", (9, 0), "2.2.0", False), ("bf16", (9, 0), "2.2.0", False),
])
def test_aligned_rows_reach_the_gemm_as_they_are(kind, capability, version, psum, group_list_type):
    """Rows at the kernel's ``expert_alignment`` are the very tensor the first GEMM reads (no pad copy),
    with DeepGEMM's PSUM group layout where the version has it (each expert's end row) and per-row expert ids
    (-1 for padding) before; the valid rows match the dense path's, bit for bit."""
    spy = _Spy(emu.emulate(capability, version))
    experts = DeepGemmExperts(kind, md.Mode.NORMAL, spy)
    assert experts.psum_layout is psum and experts.expert_alignment == 128
    layer = experts.process_weights(random_expert_weights(E, H, I, generator=torch.Generator().manual_seed(0)))
    dense = _dense(kind, ue8m0=experts.ue8m0, group_list_type=group_list_type)
    aligned = align_rows(dense, experts.expert_alignment)
    out = md.run_experts(experts, layer, aligned)
    gemm_rows, groups, kwargs = spy.calls[0]
    assert gemm_rows.data_ptr() == aligned.hidden_states.data_ptr(), "the runner copied aligned rows"
    ends = torch.tensor([5, 128, 258, 385], dtype=torch.int32)  # starts 0, 128, 128, 384
    if psum:
        assert kwargs == {vendor.DG_USE_PSUM_LAYOUT: True} and torch.equal(groups, ends)
    else:
        assert kwargs == {} and torch.equal(groups, row_experts(torch.tensor(COUNTS), 128, 512).int())
    assert out.shape == (512, H)
    valid = row_experts(torch.tensor(COUNTS), 128, 512) >= 0
    spy.calls.clear()
    want = md.run_experts(experts, layer, dense)  # the dense path: the runner's own pad copy
    assert torch.equal(out[valid], want)


@pytest.mark.parametrize("version", ["2.6.1", "2.5.0", "2.3.0"])
def test_aligned_rows_with_fp32_ue8m0_scales_on_sm100(version):
    """SM100 with fp32 power-of-two scales: the runner packs them itself (DeepGEMM's pack, no psum layout), which
    holds because the padding scales are +0.0, what 2.6.1's power-of-two assert accepts;
    the valid rows match the dense path's, bit for bit."""
    experts = DeepGemmExperts("block_fp8", md.Mode.NORMAL, emu.emulate((10, 0), version))
    assert experts.ue8m0
    layer = experts.process_weights(random_expert_weights(E, H, I, generator=torch.Generator().manual_seed(0)))
    dense = _dense("block_fp8", ue8m0=True, packed=False)
    assert dense.hidden_states_scale.dtype == torch.float32
    out = md.run_experts(experts, layer, align_rows(dense, experts.expert_alignment))
    valid = row_experts(torch.tensor(COUNTS), 128, 512) >= 0
    assert torch.equal(out[valid], md.run_experts(experts, layer, dense))


def test_an_alignment_deepgemm_cannot_read_is_a_typed_error():
    experts = DeepGemmExperts("block_fp8", md.Mode.NORMAL, emu.emulate((9, 0), "2.6.1"))
    layer = experts.process_weights(random_expert_weights(E, H, I, generator=torch.Generator().manual_seed(0)))
    aligned = align_rows(_dense("block_fp8"), 64)
    with pytest.raises(md.InvalidInputError) as info:
        md.run_experts(experts, layer, aligned)
    assert info.value.parameter == "expert_alignment" and "multiple of 128" in str(info.value)


@pytest.mark.parametrize("v2", [True, False], ids=["v2-native", "v1-core-copy"])
@pytest.mark.parametrize("weights", ["block_fp8", "bf16"])
def test_a_whole_layer_with_aligned_rows(moe_rank_pools, v2, weights):
    """DeepEP (V2 writing the aligned layout itself; V1 through the core's copy) → DeepGEMM on the aligned rows
    → combine, on two gloo ranks, within the wire dtype's bound of the dense fp32 reference."""
    results = moe_rank_pools.get(2).map(run_layer, weights, "normal", DEEP_GEMM_EMULATOR, EMULATOR,
                                        2048, 256, 2, 2, 128, v2=v2, aligned=True)
    dtype = FP8 if weights == "block_fp8" else BF16
    assert max(r.relative_error for r in results) < TOLERANCES[dtype], results
