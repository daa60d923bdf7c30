"""CPU fakes of the vendor libraries, one module per behaviour range, selected by module name
(``FAKE``, ``FAKE_ENV_ONLY``, ``TORCH_NPU_FAKE`` of this package). They import vendor facts from
``moe_dispatch_ascend_deepep.vendor`` and helpers from the core, never the adapter modules."""
