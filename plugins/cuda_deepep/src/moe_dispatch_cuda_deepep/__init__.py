"""moe-dispatch-cuda-deepep: DeepEP (CUDA) as a moe-dispatch backend.

The entry point ``cuda_deepep`` names this module; it registers ``DeepEPBackend`` on the real
``deep_ep`` (unavailable, with the reason, where DeepEP or a GPU is missing). Tests run the
same adapter on ``moe_dispatch_cuda_deepep.emulator``.
"""

import moe_dispatch as md

from .backend import DeepEPBackend

MOE_DISPATCH_API = 1


@md.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(DeepEPBackend())


@md.hookimpl
def moe_dispatch_register_runners(register):  # type: ignore[no-untyped-def]
    register(md.RunnerInfo("deep_gemm", md.DispatchDtype.FP8, "DeepGEMM's grouped GEMMs take block-FP8 activations"))


__all__ = ["DeepEPBackend", "MOE_DISPATCH_API"]
