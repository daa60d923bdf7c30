"""moe-dispatch-ascend-deepep-testing: CPU fakes of DeepEP-Ascend and torch_npu, and what runs on them.

The adapter takes its vendor modules by name, so the fakes are named here:
``AscendDeepEPBackend(FAKE, torch_npu_module=TORCH_NPU_FAKE)`` (``ascend_backend()``), ``NpuExperts(scheme,
TORCH_NPU_FAKE)``. ``fakes`` holds them (they import vendor facts from ``moe_dispatch_ascend_deepep.vendor``,
never an adapter module); ``hardware`` is what ``scripts/hardware_check.py`` runs; ``layers.run_layer`` is a
whole layer through a torch_npu runner on every rank; ``support`` is what the tests share.
"""

from __future__ import annotations

from typing import Mapping

from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend

#: DeepEP-Ascend as of sgl-kernel-npu main f425bdf, with ``quant_mode``.
FAKE = "moe_dispatch_ascend_deepep_testing.fakes.deep_ep"
#: A DeepEP-Ascend before ``quant_mode`` (KN@be6b5e7f): INT8 only through the environment.
FAKE_ENV_ONLY = "moe_dispatch_ascend_deepep_testing.fakes.deep_ep_env_only"
#: torch_npu's ops, its chip and its groups' HCCL options, on CPU.
TORCH_NPU_FAKE = "moe_dispatch_ascend_deepep_testing.fakes.torch_npu"
#: What each fake's Buffer must equal: the recorded signatures of the build it fakes.
SIGNATURES = {FAKE: v.DEEP_EP_SIGNATURES, FAKE_ENV_ONLY: v.DEEP_EP_SIGNATURES_ENV_ONLY}


def torch_npu_for(vendor_module: str) -> str:
    """The torch_npu beside ``vendor_module``: the real one beside the real DeepEP-Ascend, else the fake."""
    return v.TORCH_NPU if vendor_module == v.REAL else TORCH_NPU_FAKE


def ascend_backend(vendor_module: str = FAKE, env: Mapping[str, str] | None = None, soc: str | None = None
            ) -> AscendDeepEPBackend:
    """The adapter on ``vendor_module`` with the torch_npu beside it (the fake one beside a fake)."""
    return AscendDeepEPBackend(vendor_module, env=env, soc=soc, torch_npu_module=torch_npu_for(vendor_module))


__all__ = ["FAKE", "FAKE_ENV_ONLY", "SIGNATURES", "TORCH_NPU_FAKE", "ascend_backend", "torch_npu_for"]
