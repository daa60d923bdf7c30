"""What the installed DeepEP offers, found without touching a GPU."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType

REAL = "deep_ep"
EMULATOR = "moe_dispatch_cuda_deepep.emulator"
#: The emulator of a DeepEP built from the hybrid-ep branch (NVFP4 low-latency dispatch).
EMULATOR_NVFP4 = "moe_dispatch_cuda_deepep.emulator_nvfp4"
INSTALL_HINT = ("DeepEP builds from source with NVSHMEM: see https://github.com/deepseek-ai/DeepEP "
                "(`pip install --no-build-isolation .` in its checkout), on a CUDA machine")


@dataclass(frozen=True)
class VendorInfo:
    """The DeepEP found: its module (None when missing), API generations, and features."""

    module_name: str
    module: ModuleType | None
    error: str | None
    has_v1_buffer: bool = False
    has_elastic_buffer: bool = False
    has_nvfp4: bool = False
    emulated: bool = False

    def describe(self) -> str:
        if self.module is None:
            return f"{self.module_name} is not importable ({self.error})"
        apis = [n for n, ok in (("V1 Buffer", self.has_v1_buffer), ("V2 ElasticBuffer", self.has_elastic_buffer)) if ok]
        what = "emulated DeepEP" if self.emulated else f"DeepEP {getattr(self.module, '__version__', '')}".strip()
        return f"{what}: {', '.join(apis) or 'no known buffer API'}; NVFP4 low-latency dispatch: {'yes' if self.has_nvfp4 else 'no'}"


def detect(module_name: str = REAL) -> VendorInfo:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
        return VendorInfo(module_name, None, f"{type(exc).__name__}: {exc}")
    buffer = getattr(module, "Buffer", None)
    nvfp4 = False
    if buffer is not None and hasattr(buffer, "low_latency_dispatch"):
        # The hybrid-ep branch adds use_nvfp4 / x_global_scale to low_latency_dispatch.
        nvfp4 = "use_nvfp4" in inspect.signature(buffer.low_latency_dispatch).parameters
    return VendorInfo(module_name, module, None, has_v1_buffer=buffer is not None,
                      has_elastic_buffer=hasattr(module, "ElasticBuffer"), has_nvfp4=nvfp4,
                      emulated=module_name in (EMULATOR, EMULATOR_NVFP4))
