"""CPU fakes of FlashInfer, one module per version range where it behaves differently.

- ``flashinfer_0_6_7``  v0.6.0-v0.6.7: kMaxTopK 8, top-k in {1, 2, 4, 8}, 8 payloads,
  CuteDslMoEWrapper from v0.6.4 (no activation argument).
- ``flashinfer_0_6_13`` v0.6.8-v0.6.15: kMaxTopK 22, 4 payloads (6 from v0.6.14), fp4_quantize
  reads FLASHINFER_NVFP4_4OVER6 (from v0.6.12).
- ``flashinfer_0_6_17`` v0.6.16-v0.7.0: EPLB and rank-mask arguments, a five-field workspace-cache
  key, uneven expert partition, activation_type.
- ``flashinfer_0_7_2``  v0.7.1-v0.7.2: ``backend=`` keyword, six-field key, MoeAlltoAll deprecated,
  fp4_quantize(nvfp4_4over6=).

Each is built from the shared pieces: ``kernels`` (the JIT module ``get_moe_alltoall_module()``
returns: the C++ checks, the workspace layout at calculateOffsets' offsets, the dispatch and combine
kernels' semantics), ``mnnvl`` (MNNVL memory on CPU and the class-level communicator), ``a2a``
(the Python layer of ``trtllm_moe_alltoall.py``), ``mapping``, ``fp4`` and ``cute_dsl``. ``kernels``
and ``mnnvl.patch_real_mnnvl`` also stand in for the compiled module and the CUDA-driver memory
under FlashInfer's real Python (the optional vendor-code tests).

``real_python`` is FlashInfer's own installed Python on those fake kernels and memory (the optional
vendor-code tests); ``signature_check`` compares a callable with its recorded signature.

They take vendor facts from ``moe_dispatch_flashinfer_cutedsl.vendor`` and helpers from the core;
never from the adapter modules.
"""
