"""moe-dispatch-ascend-fuseep-testing: CPU fakes of DeepEP-Ascend with ``fused_deep_moe``, and FuseEP's part
of the hardware check (``hardware.fuseep_rows``, run by ascend_deepep's ``scripts/hardware_check.py``).

The fakes (``fakes``) build on moe-dispatch-ascend-deepep-testing's and read the op's facts from
``moe_dispatch_ascend_fuseep.vendor``; ``fuseep_backend()`` is the adapter on one, with the fake torch_npu beside it;
``support`` is what the tests share.
"""

from __future__ import annotations

from typing import Mapping

from moe_dispatch_ascend_deepep_testing import torch_npu_for
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep.backend import FuseEPBackend

#: DeepEP-Ascend main f425bdf: ``fused_deep_moe`` with ``fuse_mode`` and ``profile_enable``.
FAKE = "moe_dispatch_ascend_fuseep_testing.fakes.deep_ep"
#: A DeepEP-Ascend between KN@c4e7608f and KN@0ac00159: ``fused_deep_moe`` without ``fuse_mode``
#: (below the supported floor: the fake lets the tests check that probe() says so).
FAKE_NO_FUSE_MODE = "moe_dispatch_ascend_fuseep_testing.fakes.deep_ep_no_fuse_mode"
#: A DeepEP-Ascend between KN@0ac00159 and KN@f7455efe: fuse mode 2 reads HCCL_BUFFSIZE only; no dispatch(quant_mode=).
FAKE_BEFORE_F7455EFE = "moe_dispatch_ascend_fuseep_testing.fakes.deep_ep_before_f7455efe"
#: What each fake's ``fused_deep_moe`` must equal.
SIGNATURES = {FAKE: v.SIG_FUSED_DEEP_MOE, FAKE_NO_FUSE_MODE: v.SIG_FUSED_DEEP_MOE_NO_FUSE_MODE,
              FAKE_BEFORE_F7455EFE: v.SIG_FUSED_DEEP_MOE}


def fuseep_backend(vendor_module: str = FAKE, env: Mapping[str, str] | None = None) -> FuseEPBackend:
    """The adapter on ``vendor_module`` with the torch_npu beside it (the fake one beside a fake)."""
    return FuseEPBackend(vendor_module, env=env, torch_npu_module=torch_npu_for(vendor_module))


__all__ = ["FAKE", "FAKE_BEFORE_F7455EFE", "FAKE_NO_FUSE_MODE", "SIGNATURES", "fuseep_backend"]
