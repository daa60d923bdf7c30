"""moe-dispatch-vllm against vLLM's own code on CPU: vLLM's ``FusedMoEKernel`` in both formats (its
``NaiveBatchedExperts``; stand-in Standard experts) on a moe-dispatch prepare/finalize at 1 and 2 ranks on gloo,
blocking and on vLLM's own DBO micro-batch threads, against the same layer on vLLM's own single-process
``BatchedPrepareAndFinalize``. vLLM 0.33.0 is installed by ``bash .ci/engines``; a plain pytest skips. Stand-ins for
GPU-only calls are in ``vllm_ranks`` (labelled)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: `bash .ci/engines` runs these tests against vLLM 0.33.0",
                allow_module_level=True)

HERE = str(Path(__file__).parent)
sys.path.insert(0, HERE)
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])

import vllm_ranks

import moe_dispatch as md
from moe_dispatch_testing import run_local

pytestmark = pytest.mark.engine_code


def test_the_prepare_finalize_contract_is_vllms():
    """Guard: fails when vLLM changes the abstract methods or the batched format the adapter implements."""
    mk = vllm_ranks.mk
    abstract = mk.FusedMoEPrepareAndFinalizeModular.__abstractmethods__
    assert abstract <= set(vars(vllm_ranks.MoEDispatchPrepareAndFinalize)), abstract
    assert mk.FusedMoEActivationFormat.BatchedExperts.value == ("batched_experts",)
    assert mk.FusedMoEActivationFormat.Standard.value == ("standard",)
    assert [f.name for f in mk.ExpertTokensMetadata.__dataclass_fields__.values()][:2] == [
        "expert_num_tokens", "expert_num_tokens_cpu"]


FORMATS = {"low_latency": "BatchedExperts", "normal": "Standard"}


@pytest.mark.parametrize("backend", ["torch", "cuda_deepep"])
@pytest.mark.parametrize("mode", FORMATS)
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("overlapped", [False, True], ids=["blocking", "dual-batch overlap"])
def test_vllms_kernel_on_moe_dispatch_agrees_with_its_own_batched_prepare_finalize(world_size, overlapped, mode,
                                                                                   backend):
    """Low latency: vLLM's BatchedExperts format on MASKED rows; normal: its Standard format on TOKEN_MAJOR rows. On
    the reference backend and on the cuda_deepep plugin over DeepEP's CPU fake (normal mode: at 2 ranks, DeepEP's
    normal kernels have none for one)."""
    if backend != "torch" and importlib.util.find_spec("moe_dispatch_cuda_deepep_testing") is None:
        pytest.skip("moe-dispatch-cuda-deepep-testing is not installed (bash .ci/engines installs it)")
    if (backend, mode, world_size) == ("cuda_deepep", "normal", 1):
        pytest.skip("DeepEP's normal mode runs on 2, 4, 8, ... ranks")
    for r in run_local(vllm_ranks.forward, world_size, overlapped, mode, backend):
        assert (r["wire"], r["format"]) == ("bf16", FORMATS[mode])
        assert r["shared"]  # a second layer's for_layer takes the same dispatcher, as DeepEP's one buffer
        assert r["error"] < 2e-2, r  # two layers of bf16 rounding: 8e-3 to 9e-3 measured


@pytest.mark.parametrize("backend", ["torch", "cuda_deepep"])
@pytest.mark.parametrize("mode", FORMATS)
@pytest.mark.parametrize("overlapped", [False, True], ids=["blocking", "dual-batch overlap"])
def test_block_fp8_experts_get_fp8_rows_with_their_scales(mode, overlapped, backend):
    """Block-FP8 experts (128x128, DeepSeek's): FP8 on the wire, one fp32 scale per 128 columns, read by vLLM's
    NaiveBatchedExperts (batched) and the Standard stand-in; against BF16 on the dequantized weights."""
    if backend != "torch" and importlib.util.find_spec("moe_dispatch_cuda_deepep_testing") is None:
        pytest.skip("moe-dispatch-cuda-deepep-testing is not installed (bash .ci/engines installs it)")
    for r in run_local(vllm_ranks.forward, 2, overlapped, mode, backend, True, "fp8"):
        assert r["wire"] == "fp8"
        assert r["error"] < 0.12, r  # e4m3's rounding of the activations, about 4e-2 a layer


def test_the_experts_may_leave_the_weighting_to_finalize():
    """Standard experts that return TopKWeightAndReduceDelegate: finalize weights and sums each row's top-k."""
    for r in run_local(vllm_ranks.forward, 2, False, "normal", "torch", False):
        assert r["error"] < 2e-2, r


def test_a_dispatcher_in_a_layout_vllm_does_not_read_is_refused_naming_it():
    d = md.create_dispatcher("torch", md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=8), env={})
    with pytest.raises(md.InvalidSpecError) as e:  # normal mode's PACKED rows
        vllm_ranks.MoEDispatchPrepareAndFinalize(d)
    assert e.value.parameter == "spec.layout"


def test_an_expert_placement_other_than_moe_dispatchs_is_refused_naming_expert_map():
    """vLLM's round-robin placement would put expert e elsewhere than rank e // E_local: refused before any send."""
    import torch

    pf = vllm_ranks.MoEDispatchPrepareAndFinalize.for_layer("torch", vllm_ranks._config(vllm_ranks.E, 1, 0),
                                                            vllm_ranks.FUSED_MOE_UNQUANTIZED_CONFIG, env={})
    x = torch.zeros(2, vllm_ranks.H, dtype=torch.bfloat16)
    ids, w = torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    round_robin = torch.arange(vllm_ranks.E, dtype=torch.int32).flip(0)
    with pytest.raises(md.InvalidInputError) as e:
        pf.prepare(x, w, ids, vllm_ranks.E, round_robin, False, vllm_ranks.FUSED_MOE_UNQUANTIZED_CONFIG)
    assert e.value.parameter == "expert_map"
