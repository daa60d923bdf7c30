"""The conformance kit on the DeepEP-Ascend adapter, on both emulated generations."""

from moe_dispatch.testing import BackendConformance, KitShape
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.vendor import EMULATOR, EMULATOR_ENV_ONLY

# The CPU run has no HCCL window to size; the default 200 MB covers the kit's shapes.
_ENV: dict[str, str] = {}


def emulated() -> AscendDeepEPBackend:
    return AscendDeepEPBackend(EMULATOR, env=_ENV)


def emulated_env_only() -> AscendDeepEPBackend:
    return AscendDeepEPBackend(EMULATOR_ENV_ONLY, env=_ENV)


class TestAscendDeepEPOnEmulator(BackendConformance):
    backend_name = "ascend_deepep"
    backend_factory = emulated
    kit_shape = KitShape(hidden_size=1024)


class TestOlderAscendDeepEPOnEmulator(BackendConformance):
    """A DeepEP-Ascend without ``quant_mode``: INT8 through the scoped environment variable."""

    backend_name = "ascend_deepep"
    backend_factory = emulated_env_only
    kit_shape = KitShape(hidden_size=1024)
