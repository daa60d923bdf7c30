"""What the installed FlashInfer offers, found without touching a GPU."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

REAL = "flashinfer"
EMULATOR = "moe_dispatch_flashinfer_cutedsl.emulator"
INSTALL_HINT = 'pip install "moe-dispatch-flashinfer-cutedsl[flashinfer]" (flashinfer-python), on a CUDA machine'
#: CuTe-DSL MoE kernels: ``@supported_compute_capability([100, 103])`` (later also 107).
CUTEDSL_MAJOR = 10


@dataclass(frozen=True)
class FlashInferAPI:
    """The vendor entry points the plugin calls, wherever this FlashInfer version keeps them."""

    fp4_quantize: Any
    CuteDslMoEWrapper: Any
    MoeAlltoAll: Any
    Mapping: Any


@dataclass(frozen=True)
class VendorInfo:
    module_name: str
    api: FlashInferAPI | None
    version: str
    error: str | None
    emulated: bool

    def describe(self) -> str:
        if self.api is None:
            return f"{self.module_name} is not usable ({self.error})"
        what = "emulated FlashInfer" if self.emulated else f"FlashInfer {self.version}"
        parts = [n for n, ok in (("CuTe-DSL MoE", self.api.CuteDslMoEWrapper), ("MoE all-to-all", self.api.MoeAlltoAll))
                 if ok is not None]
        return f"{what}: {', '.join(parts) or 'neither CuTe-DSL MoE nor MoE all-to-all'}"


def _find(module: ModuleType, *paths: str) -> Any:
    """The first of ``paths`` (dotted, relative to ``module``) that resolves."""
    for path in paths:
        obj: Any = module
        try:
            for part in path.split("."):
                obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(f"{obj.__name__}.{part}")
        except Exception:  # noqa: BLE001 - a missing submodule is "not there"
            continue
        return obj
    return None


def detect(module_name: str = REAL) -> VendorInfo:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a missing or broken vendor library is a reason, not a crash
        return VendorInfo(module_name, None, "", f"{type(exc).__name__}: {exc}", module_name == EMULATOR)
    api = FlashInferAPI(
        fp4_quantize=_find(module, "fp4_quantize"),
        CuteDslMoEWrapper=_find(module, "CuteDslMoEWrapper", "fused_moe.CuteDslMoEWrapper"),
        MoeAlltoAll=_find(module, "comm.MoeAlltoAll", "comm.trtllm_moe_alltoall.MoeAlltoAll"),
        Mapping=_find(module, "comm.Mapping", "comm.mapping.Mapping"),
    )
    return VendorInfo(module_name, api, str(getattr(module, "__version__", "")), None, module_name == EMULATOR)


def sm100_reason() -> str | None:
    """None on an SM100-class GPU (compute capability 10.x), else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (the CuTe-DSL MoE kernels need an SM100-class GPU: B200, GB200, B300)"
    major, minor = torch.cuda.get_device_capability()
    if major != CUTEDSL_MAJOR:
        return f"the CuTe-DSL MoE kernels need an SM100-class GPU (compute capability 10.x); this one is {major}.{minor}"
    return None


__all__ = ["EMULATOR", "FlashInferAPI", "INSTALL_HINT", "REAL", "VendorInfo", "detect", "sm100_reason"]
