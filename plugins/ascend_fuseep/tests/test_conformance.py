"""The conformance kit on FuseEP: the unfused INT8 path, and the fused forward on W8A8 weights."""

from moe_dispatch.experts import quantize_weights_w8a8
from moe_dispatch.testing import BackendConformance, KitShape
from moe_dispatch_ascend_fuseep.backend import FuseEPBackend

EMULATOR = "moe_dispatch_ascend_fuseep.emulator"


def emulated_fuseep() -> FuseEPBackend:
    return FuseEPBackend(EMULATOR, env={})


class TestFuseEPOnEmulator(BackendConformance):
    backend_name = "ascend_fuseep"
    backend_factory = emulated_fuseep
    kit_shape = KitShape(hidden_size=1024)
    kit_weights = quantize_weights_w8a8  # the fused op takes nothing else


class TestFuseEPMode2OnEmulator(TestFuseEPOnEmulator):
    backend_options = {"fuse_mode": 2}
