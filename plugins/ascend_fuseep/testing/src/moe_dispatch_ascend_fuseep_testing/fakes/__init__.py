"""CPU fakes of DeepEP-Ascend with ``fused_deep_moe``, selected by module name
(``moe_dispatch_ascend_fuseep.vendor.FAKE``, ``FAKE_NO_FUSE_MODE``). They build on
``moe_dispatch_ascend_deepep.fakes.deep_ep`` and read the op's weight layouts from the vendor
facts, never from this plugin's adapter modules."""
