"""The conformance kit on FlashInfer's MoE all-to-all adapter, driving the CPU emulator."""

from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl_testing import EMULATOR
from moe_dispatch_testing import BackendConformance


def emulated_flashinfer_a2a() -> FlashInferA2ABackend:
    return FlashInferA2ABackend(vendor_module=EMULATOR)


class TestFlashInferA2AOnEmulator(BackendConformance):
    backend_name = "flashinfer_a2a"
    backend_factory = emulated_flashinfer_a2a
