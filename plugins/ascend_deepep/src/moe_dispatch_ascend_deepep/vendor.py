"""What the installed DeepEP-Ascend offers, found without touching an NPU."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from types import ModuleType

REAL = "deep_ep"
EMULATOR = "moe_dispatch_ascend_deepep.emulator"
#: An older DeepEP-Ascend whose ``dispatch`` has no ``quant_mode``: INT8 only via the env var.
EMULATOR_ENV_ONLY = "moe_dispatch_ascend_deepep.emulator_env_only"
INSTALL_HINT = ("DeepEP-Ascend builds from source with CANN: see https://github.com/sgl-project/sgl-kernel-npu "
                "(python/deep_ep), on an Atlas A2/A3 machine, with torch-npu matching torch "
                "(pip install \"moe-dispatch-ascend-deepep[npu]\" \"torch==<your torch>\")")


@dataclass(frozen=True)
class VendorInfo:
    module_name: str
    module: ModuleType | None
    error: str | None
    is_ascend: bool = False
    has_quant_mode: bool = False
    emulated: bool = False

    def describe(self) -> str:
        if self.module is None:
            return f"{self.module_name} is not importable ({self.error})"
        if not self.is_ascend:
            return f"{self.module_name} is CUDA DeepEP, not DeepEP-Ascend (both install as deep_ep)"
        what = "emulated DeepEP-Ascend" if self.emulated else "DeepEP-Ascend"
        how = "quant_mode argument" if self.has_quant_mode else "DEEP_NORMAL_MODE_USE_INT8_QUANT only"
        return f"{what}: INT8 dispatch chosen by {how}"


def detect(module_name: str = REAL) -> VendorInfo:
    emulated = module_name.startswith("moe_dispatch_")  # the plugins' own emulators of deep_ep
    if not emulated and importlib.util.find_spec("torch_npu") is None:
        return VendorInfo(module_name, None, "torch_npu is not installed")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
        return VendorInfo(module_name, None, f"{type(exc).__name__}: {exc}")
    buffer = getattr(module, "Buffer", None)
    # Both builds install as deep_ep. DeepEP-Ascend's LL size hint is a dummy that returns T
    # (sgl-kernel-npu csrc/deepep/config.cpp); CUDA DeepEP's is ~1.9 GB for this shape.
    try:
        is_ascend = buffer is not None and buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == 128
    except Exception:  # noqa: BLE001 - an unexpected build is "not DeepEP-Ascend"
        is_ascend = False
    has_quant_mode = is_ascend and "quant_mode" in inspect.signature(buffer.dispatch).parameters
    return VendorInfo(module_name, module, None, is_ascend, has_quant_mode, emulated)


__all__ = ["EMULATOR", "EMULATOR_ENV_ONLY", "INSTALL_HINT", "REAL", "VendorInfo", "detect"]
