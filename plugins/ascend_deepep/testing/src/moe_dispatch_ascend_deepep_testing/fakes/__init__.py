"""CPU fakes of the vendor libraries, one module per behaviour range, selected by module name
(``moe_dispatch_ascend_deepep.vendor.FAKE``, ``FAKE_ENV_ONLY``, ``TORCH_NPU_FAKE``). They import
vendor facts from ``..vendor`` and helpers from the core, never the adapter modules."""
