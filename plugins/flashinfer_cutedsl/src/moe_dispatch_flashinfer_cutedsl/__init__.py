"""moe-dispatch-flashinfer-cutedsl: FlashInfer's CuTe-DSL MoE kernel (runner
``flashinfer_cutedsl``) and FlashInfer's MoE all-to-all (backend ``flashinfer_a2a``).

The entry point ``flashinfer_cutedsl`` names this module. The runner works behind the
dispatch backends ``RUNNER.backends`` declares (DeepEP, FlashInfer's all-to-all, the core's
``torch``). ``vendor`` is the one place FlashInfer facts live; the tests run both on the fakes of
the testing distribution (``moe_dispatch_flashinfer_cutedsl_testing.fakes``, one per FlashInfer
version range), which the adapter modules never import.
"""

import moe_dispatch.backend as mdb

from .backend import FlashInferA2ABackend
from .experts import RUNNER, CuteDslExperts
from .weights import CuteDslLayer

MOE_DISPATCH_API = 1


@mdb.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(FlashInferA2ABackend())


@mdb.hookimpl
def moe_dispatch_register_runners(register):  # type: ignore[no-untyped-def]
    register(RUNNER)


__all__ = ["CuteDslExperts", "CuteDslLayer", "FlashInferA2ABackend", "MOE_DISPATCH_API", "RUNNER"]
