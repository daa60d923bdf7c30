"""moe-dispatch-ascend-fuseep: Ascend FuseEP (``fused_deep_moe``) as a moe-dispatch backend.

The entry point ``ascend_fuseep`` names this module; it registers ``FuseEPBackend`` on the real
DeepEP-Ascend (unavailable, with the reason, without it, torch-npu or an NPU). The tests run it on
the CPU fakes of moe-dispatch-ascend-fuseep-testing. Vendor facts: ``vendor.py``; see VENDOR.md.
"""

import moe_dispatch.backend as mdb

from .backend import FuseEPBackend
from .weights import FuseEPWeights, process_fuseep_weights

MOE_DISPATCH_API = 1


@mdb.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(FuseEPBackend())


__all__ = ["FuseEPBackend", "FuseEPWeights", "MOE_DISPATCH_API", "process_fuseep_weights"]
