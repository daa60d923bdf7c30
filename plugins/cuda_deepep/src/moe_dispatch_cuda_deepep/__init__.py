"""moe-dispatch-cuda-deepep: DeepEP (CUDA) as a moe-dispatch backend.

The entry point ``cuda_deepep`` names this module; it registers ``DeepEPBackend`` (``cuda_deepep``, DeepEP's V1
``Buffer``) and ``DeepEPV2Backend`` (``cuda_deepep_v2``, DeepEP 2.x's ``ElasticBuffer``) on the real ``deep_ep``
(unavailable, with the reason, where DeepEP or a GPU is missing) and the ``deep_gemm`` runner. Vendor facts live in
``vendor``; tests run the same adapter on the fakes of the ``moe-dispatch-cuda-deepep-testing`` distribution, named
by module path. The ``deep_ep.Buffer``s are the process's (``buffers.PROCESS_BUFFERS``, one with NVSHMEM per
process); ``DeepEPBackend.close()`` destroys them.
"""

import moe_dispatch as md
import moe_dispatch.backend as mdb

from .backend import DeepEPBackend
from .deep_gemm import RUNNER, DeepGemmExperts, DeepGemmLayer, runner_probe
from .elastic import NAME as V2_NAME
from .elastic import DeepEPV2Backend

MOE_DISPATCH_API = 1


@mdb.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(DeepEPBackend())
    register(DeepEPV2Backend())


@mdb.hookimpl
def moe_dispatch_register_runners(register):  # type: ignore[no-untyped-def]
    # Block-FP8 layers need FP8 rows (the default); a BF16 layer's DeepGemmExperts.quant_hints()
    # asks for BF16, which resolution takes before the runner's default.
    register(mdb.RunnerInfo(RUNNER, md.DispatchDtype.FP8, "DeepGEMM's grouped GEMMs take block-FP8 activations",
                           accepts=frozenset({md.DispatchDtype.FP8, md.DispatchDtype.BF16}),
                           backends={"cuda_deepep": frozenset({md.Mode.NORMAL, md.Mode.LOW_LATENCY}),
                                     V2_NAME: frozenset({md.Mode.NORMAL, md.Mode.LOW_LATENCY})},
                           probe=runner_probe))


__all__ = ["DeepEPBackend", "DeepEPV2Backend", "DeepGemmExperts", "DeepGemmLayer", "MOE_DISPATCH_API"]
