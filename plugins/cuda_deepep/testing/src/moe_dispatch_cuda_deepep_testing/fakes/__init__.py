"""CPU fakes of the vendor libraries this plugin drives: one module per version range where behaviour
differs. They import vendor facts from ``moe_dispatch_cuda_deepep.vendor`` and helpers from the core, never
the adapter. The adapter takes them by module path (``moe_dispatch_cuda_deepep_testing.EMULATOR``,
``DEEP_GEMM_EMULATOR``, ...).

- ``deep_ep``: DeepEP 2.x main @ dd758ca (the V1 ``Buffer``); ``deep_ep_v121_topk9``: DeepEP 1.2.1 before
  9af0e0d (low-latency top-k ≤ 9); ``deep_ep_hybrid``: the hybrid-ep branch @ 94a9f8f (NVFP4);
  ``deep_ep_topk_int32``: a 2.x build with 32-bit top-k indices; ``deep_ep_elastic``: 2.x's V2 ``ElasticBuffer``
  (exported by ``deep_ep``); ``deep_ep_v2_0``: DeepEP 2.0.0's (no ``do_zero_padding``).
- ``deep_gemm``: DeepGEMM 2.6.1 @ 54e2261 on SM90; ``deep_gemm_sm100``: the same on SM100 (``emulate()``
  builds other versions/architectures); ``deep_gemm_v1``: DeepGEMM v1 @ 0c88cd0; ``deep_gemm_v1_pypi``: PyPI's
  deep_gemm 1.0.0 (@ b05ed2f); ``deep_gemm_v1_kernels``: v1's JIT kernels on CPU, for driving DeepGEMM v1's own
  Python layer.
- ``_native``: pybind11's conversions, the vendors' exception types, and the process's emulated CUDA context
  (lost at a device assert, for the rest of the process; ``reset_context`` for the tests).
"""
