"""moe-dispatch-sglang against sglang's own code on CPU: sglang's plugin loader installs the adapter, sglang builds its
``DeepEPMoE`` from its server arguments at --tp 2 --ep 2 on gloo, and the layer's forward is compared with sglang's
``moe_forward_native`` on the full experts. sglang 0.5.23 is installed by ``bash .ci/engines``; a plain pytest skips.

Stand-ins for GPU-only code, labelled where they are: torchvision (``stand_ins/``: its wheel links libtorch_cuda,
sglang's configs import it, the MoE path never calls it), the runner's expert kernels (``sglang_ranks.experts``),
DeepGEMM's JIT switched on as on an SM90 GPU (``sglang_ranks.DEEP_GEMM``: normal mode then sends FP8, its counts
rounded to 128) and, for the cuda_deepep plugin, DeepEP's CPU fake as ``deep_ep`` (``sglang_ranks.DEEP_EP``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed: `bash .ci/engines` runs these tests against sglang 0.5.23",
                allow_module_level=True)

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).parent
PATH = [str(HERE)] + ([] if importlib.util.find_spec("torchvision") else [str(HERE / "stand_ins")])
sys.path[:0] = PATH
os.environ["PYTHONPATH"] = os.pathsep.join([*PATH, os.environ.get("PYTHONPATH", "")])

import moe_dispatch_sglang as mds
import sglang_ranks

pytestmark = pytest.mark.engine_code
OFF = {"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "16", sglang_ranks.DEEP_GEMM: "1"}
ON = {mds.BACKEND_VARIABLE: "torch", **OFF}
#: The backends the layers run on: the reference, and the cuda_deepep plugin on DeepEP's CPU fake.
BACKENDS = {"torch": ON, "cuda_deepep": {**ON, mds.BACKEND_VARIABLE: "cuda_deepep", sglang_ranks.DEEP_EP: "1"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_two_ranks(tmp_path: Path, env: dict[str, str], micro_batches: int = 1, **server_args: Any) -> list[dict]:
    mp.start_processes(sglang_ranks.forward, args=(_free_port(), tmp_path, env, server_args, micro_batches),
                       nprocs=2, start_method="spawn")
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]


def test_the_hook_target_and_formats_are_sglangs():
    """Guard: fails when sglang moves what the adapter replaces or changes the LL format's fields."""
    from sglang.srt.layers.moe.token_dispatcher import deepep

    module, name = mds.HOOK_TARGET.rsplit(".", 1)
    assert module == deepep.__name__ and isinstance(getattr(deepep, name), type)
    assert deepep.DeepEPLLDispatchOutput._fields == ("hidden_states", "hidden_states_scale", "topk_ids",
                                                     "topk_weights", "masked_m", "expected_m")
    assert deepep.DeepEPLLCombineInput._fields == ("hidden_states", "topk_ids", "topk_weights")
    assert deepep.DeepEPNormalDispatchOutput._fields == ("hidden_states", "hidden_states_scale", "topk_ids",
                                                         "topk_weights", "num_recv_tokens_per_expert")
    assert deepep.DeepEPNormalCombineInput._fields == ("hidden_states", "topk_ids", "topk_weights")
    from sglang.srt.batch_overlap import two_batch_overlap  # builds its inner dispatchers from this module binding

    assert two_batch_overlap.DeepEPDispatcher is deepep.DeepEPDispatcher


MODES = {"low_latency": ["low_latency"], "normal": ["normal"], "auto": ["low_latency", "normal"]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("micro_batches", [1, 2], ids=["blocking", "two-batch overlap"])
def test_sglangs_deepep_layer_runs_on_moe_dispatch_as_its_native_forward(tmp_path, mode, dtype, micro_batches,
                                                                         backend):
    """Low latency on MASKED rows, normal on TOKEN_MAJOR rows, auto on both (a prefill, then a decode batch)."""
    if backend != "torch" and importlib.util.find_spec("moe_dispatch_cuda_deepep_testing") is None:
        pytest.skip("moe-dispatch-cuda-deepep-testing is not installed (bash .ci/engines installs it)")
    results = _on_two_ranks(tmp_path, BACKENDS[backend], micro_batches, deepep_mode=mode,
                            deepep_dispatcher_output_dtype=dtype, enable_two_batch_overlap=micro_batches == 2)
    for r in results:
        assert "raised" not in r, r.get("traceback")
        assert r["inners"] == ["MoEDispatchDeepEPDispatcher"] * micro_batches
        # every layer and micro-batch on one per mode, as sglang's one DeepEP buffer
        assert (r["modes"], r["dispatchers"]) == (MODES[mode], len(MODES[mode]))
        assert r["wire"] == [dtype]
        # Two layers: bf16 rounding (8.4e-3 measured), or e4m3's own, about 4e-2 a layer (8.5e-2 measured); a wrong
        # scale or row would be off by the order of the values.
        assert r["error"] < (1.5e-2 if dtype == "bf16" else 0.12), r


def test_without_the_setting_sglang_keeps_its_own_dispatcher(tmp_path):
    """Off by default: sglang's DeepEPDispatcher stays, and asks for DeepEP (not installed here)."""
    for r in _on_two_ranks(tmp_path, OFF, deepep_mode="low_latency"):
        assert r["raised"] == "ImportError" and "DeepEP is not available" in r["message"]


def test_without_deep_gemm_normal_mode_sends_bf16_as_sglang_does(tmp_path):
    """sglang quantizes normal mode's rows for its DeepGEMM runner only; the others read BF16."""
    env = {k: v for k, v in ON.items() if k != sglang_ranks.DEEP_GEMM}
    for r in _on_two_ranks(tmp_path, env, deepep_mode="normal", deepep_dispatcher_output_dtype="fp8"):
        assert "raised" not in r, r.get("traceback")
        assert r["wire"] == ["bf16"] and r["error"] < 1.5e-2, r


@pytest.mark.parametrize(("setting", "parameter"), [
    *[({"deepep_mode": mode, "deepep_dispatcher_output_dtype": "int8"}, "--deepep-dispatcher-output-dtype")
      for mode in MODES],
    ({"deepep_mode": "normal", "chunked_prefill_size": -1}, "--chunked-prefill-size")])
def test_what_is_not_served_is_refused_when_the_layer_is_built_naming_the_setting(tmp_path, setting, parameter):
    for r in _on_two_ranks(tmp_path, ON, **setting):
        assert (r["raised"], r["parameter"]) == ("InvalidSpecError", parameter), r
