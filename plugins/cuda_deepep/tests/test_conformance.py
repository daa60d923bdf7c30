"""The conformance kit on the DeepEP adapter, driving the CPU emulator of ``deep_ep.Buffer``."""

from moe_dispatch.testing import BackendConformance
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.vendor import EMULATOR, EMULATOR_NVFP4


def emulated_deepep() -> DeepEPBackend:
    return DeepEPBackend(vendor_module=EMULATOR)


class TestDeepEPOnEmulator(BackendConformance):
    backend_name = "cuda_deepep"
    backend_factory = emulated_deepep
    # DeepEP sizes its buffers from tuned chunk configs, not from the batch: no upper bound.
    buffer_size_ratio = None


def emulated_hybrid_deepep() -> DeepEPBackend:
    return DeepEPBackend(vendor_module=EMULATOR_NVFP4)


class TestHybridDeepEPOnEmulator(BackendConformance):
    """A DeepEP from the hybrid-ep branch: low-latency mode also sends NVFP4."""

    backend_name = "cuda_deepep"
    backend_factory = emulated_hybrid_deepep
    buffer_size_ratio = None
