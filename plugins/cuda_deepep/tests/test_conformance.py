"""The conformance kit on the DeepEP adapter, driving the CPU fakes of ``deep_ep.Buffer``.

DeepEP's normal mode has no kernel for one rank (``SWITCH_RANKS``: 2, 4, 8): the kit runs on 2 and 4 ranks;
low-latency mode on one rank is covered in test_deepep_adapter.py."""

from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR, EMULATOR_NVFP4
from moe_dispatch_testing import BackendConformance


def emulated_deepep() -> DeepEPBackend:
    return DeepEPBackend(vendor_module=EMULATOR)


class TestDeepEPOnEmulator(BackendConformance):
    backend_name = "cuda_deepep"
    backend_factory = emulated_deepep
    # DeepEP sizes its buffers from tuned chunk configs, not from the batch: no upper bound.
    buffer_size_ratio = None
    world_sizes = (2, 4)


def emulated_hybrid_deepep() -> DeepEPBackend:
    return DeepEPBackend(vendor_module=EMULATOR_NVFP4)


class TestHybridDeepEPOnEmulator(BackendConformance):
    """A DeepEP from the hybrid-ep branch: low-latency mode also sends NVFP4."""

    backend_name = "cuda_deepep"
    backend_factory = emulated_hybrid_deepep
    buffer_size_ratio = None
    world_sizes = (2, 4)


def emulated_deepep_v2():  # type: ignore[no-untyped-def]
    from moe_dispatch_cuda_deepep.elastic import DeepEPV2Backend

    return DeepEPV2Backend(vendor_module=EMULATOR)


class TestDeepEPV2OnEmulator(BackendConformance):
    """DeepEP 2.x's ElasticBuffer (fakes/deep_ep_elastic.py): expanded rows, exact (normal mode) and worst-case (low
    latency, no host sync), on 2 and 4 ranks."""

    backend_name = "cuda_deepep_v2"
    backend_factory = emulated_deepep_v2
    buffer_size_ratio = None  # sized by DeepEP's formula for the worst case, not by the batch
    world_sizes = (2, 4)
