"""The conformance kit on the DeepEP-Ascend adapter, on the fakes of both generations."""

from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep_testing import FAKE, FAKE_ENV_ONLY, ascend_backend
from moe_dispatch_testing import BackendConformance, KitShape


_ENV = None  # the process environment (conftest exports HCCL_BUFFSIZE, as a launcher must)


def on_the_fake() -> AscendDeepEPBackend:
    return ascend_backend(FAKE, env=_ENV)


def on_the_env_only_fake() -> AscendDeepEPBackend:
    return ascend_backend(FAKE_ENV_ONLY, env=_ENV)


class TestAscendDeepEPOnTheFake(BackendConformance):
    backend_name = "ascend_deepep"
    backend_factory = on_the_fake
    kit_shape = KitShape(hidden_size=1024)


class TestOlderAscendDeepEPOnTheFake(BackendConformance):
    """A DeepEP-Ascend without ``quant_mode``: INT8 through the scoped environment variable
    (the same adapter and fake otherwise: two ranks are enough)."""

    backend_name = "ascend_deepep"
    backend_factory = on_the_env_only_fake
    kit_shape = KitShape(hidden_size=1024)
    world_sizes = (2,)
