"""The conformance kit on the DeepEP-Ascend adapter, on both emulated generations."""

from moe_dispatch_testing import BackendConformance, KitShape
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.vendor import EMULATOR, EMULATOR_ENV_ONLY


_ENV = None  # the process environment (conftest exports HCCL_BUFFSIZE, as a launcher must)


def emulated() -> AscendDeepEPBackend:
    return AscendDeepEPBackend(EMULATOR, env=_ENV)


def emulated_env_only() -> AscendDeepEPBackend:
    return AscendDeepEPBackend(EMULATOR_ENV_ONLY, env=_ENV)


class TestAscendDeepEPOnEmulator(BackendConformance):
    backend_name = "ascend_deepep"
    backend_factory = emulated
    kit_shape = KitShape(hidden_size=1024)


class TestOlderAscendDeepEPOnEmulator(BackendConformance):
    """A DeepEP-Ascend without ``quant_mode``: INT8 through the scoped environment variable
    (the same adapter and fake otherwise: two ranks are enough)."""

    backend_name = "ascend_deepep"
    backend_factory = emulated_env_only
    kit_shape = KitShape(hidden_size=1024)
    world_sizes = (2,)
