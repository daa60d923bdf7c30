"""CPU fakes of DeepEP-Ascend with ``fused_deep_moe``, selected by module name (``FAKE``,
``FAKE_NO_FUSE_MODE`` of this package). They build on moe-dispatch-ascend-deepep-testing's
``fakes.deep_ep`` and read the op's weight layouts from ``moe_dispatch_ascend_fuseep.vendor``,
never from this plugin's adapter modules."""
