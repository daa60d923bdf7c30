"""moe-dispatch-ascend-deepep: DeepEP-Ascend (sgl-kernel-npu) as a moe-dispatch backend.

The entry point ``ascend_deepep`` names this module; it registers ``AscendDeepEPBackend`` on
the real ``deep_ep`` (unavailable, with the reason, without DeepEP-Ascend, torch-npu or an NPU).
Tests run the same adapter on ``moe_dispatch_ascend_deepep.emulator`` (a DeepEP-Ascend with
``quant_mode``) and ``emulator_env_only`` (an older one that reads the environment).
"""

import moe_dispatch as md

from .backend import AscendDeepEPBackend

MOE_DISPATCH_API = 1


@md.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(AscendDeepEPBackend())


__all__ = ["AscendDeepEPBackend", "MOE_DISPATCH_API"]
