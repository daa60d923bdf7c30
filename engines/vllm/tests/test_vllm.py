"""moe-dispatch-vllm against vLLM's own code on CPU: vLLM's ``FusedMoEKernel`` with its ``NaiveBatchedExperts`` on a
moe-dispatch prepare/finalize at 1 and 2 ranks on gloo, blocking and on vLLM's own DBO micro-batch threads, against the same kernel on vLLM's own single-process
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
    assert [f.name for f in mk.ExpertTokensMetadata.__dataclass_fields__.values()][:2] == [
        "expert_num_tokens", "expert_num_tokens_cpu"]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("overlapped", [False, True], ids=["blocking", "dual-batch overlap"])
def test_vllms_kernel_on_moe_dispatch_agrees_with_its_own_batched_prepare_finalize(world_size, overlapped):
    for r in run_local(vllm_ranks.forward, world_size, overlapped):
        assert r["wire"] == "bf16"
        assert r["shared"]  # a second layer's for_layer takes the same dispatcher, as DeepEP's one buffer
        assert r["error"] < 2e-2, r  # two layers of bf16 rounding: 8e-3 to 9e-3 measured


def test_a_normal_mode_dispatcher_is_refused_naming_the_mode():
    d = md.create_dispatcher("torch", md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=8), env={})
    with pytest.raises(md.InvalidSpecError) as e:
        vllm_ranks.MoEDispatchPrepareAndFinalize(d)
    assert e.value.parameter == "spec.mode"
