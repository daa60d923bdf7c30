"""moe-dispatch-ascend-deepep: DeepEP-Ascend (sgl-kernel-npu) as a moe-dispatch backend.

The entry point ``ascend_deepep`` names this module; it registers ``AscendDeepEPBackend`` on
the real ``deep_ep`` (unavailable, with the reason, without DeepEP-Ascend, torch-npu or an NPU),
and the torch_npu expert runners ``npu_w8a8``, ``npu_w4a8``, ``npu_w4a4``, ``npu_w4a16`` and
``npu_bf16`` (``experts.NpuExperts``). Every vendor fact is in ``vendor.py``; the tests run the same
adapter on the CPU fakes of moe-dispatch-ascend-deepep-testing. See VENDOR.md.
"""

import moe_dispatch as md
import moe_dispatch.backend as mdb

from .backend import AscendDeepEPBackend
from .experts import REASONS, SCHEMES, NpuExperts, NpuExpertLayer, runner_name, runner_probe

MOE_DISPATCH_API = 1


@mdb.hookimpl
def moe_dispatch_register_backends(register):  # type: ignore[no-untyped-def]
    register(AscendDeepEPBackend())


@mdb.hookimpl
def moe_dispatch_register_runners(register):  # type: ignore[no-untyped-def]
    # One runner per torch_npu scheme: W8A8/W4A8 need INT8 rows, W4A4/W4A16/BF16 BF16 rows
    # (NpuExperts(scheme).quant_hints() asks for the same dtype, ahead of the runner step).
    for scheme in SCHEMES:
        needs = md.DispatchDtype.INT8 if scheme in ("w8a8", "w4a8") else md.DispatchDtype.BF16
        register(mdb.RunnerInfo(runner_name(scheme), needs, REASONS[scheme], accepts=frozenset({needs}),
                               backends={"ascend_deepep": frozenset({md.Mode.NORMAL, md.Mode.LOW_LATENCY})},
                               probe=runner_probe))


__all__ = ["AscendDeepEPBackend", "MOE_DISPATCH_API", "NpuExpertLayer", "NpuExperts"]
