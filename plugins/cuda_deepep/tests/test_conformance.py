"""The conformance kit on the DeepEP adapter, driving the CPU emulator of ``deep_ep.Buffer``."""

from moe_dispatch.testing import BackendConformance
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.vendor import EMULATOR


def emulated_deepep() -> DeepEPBackend:
    return DeepEPBackend(vendor_module=EMULATOR)


class TestDeepEPOnEmulator(BackendConformance):
    backend_name = "cuda_deepep"
    backend_factory = emulated_deepep
    # DeepEP sizes its buffers from tuned chunk configs, not from the batch: no upper bound.
    buffer_size_ratio = None
