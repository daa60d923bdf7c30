"""CPU fakes of FlashInfer, one module per version range where it behaves differently
(``FAKE_RANGES`` of the testing package):

- ``flashinfer_0_6_6``  v0.6.0-v0.6.6: kMaxTopK 8 (top-k 1, 2, 4, 8), 8 payloads, tuple MNNVL
  records, fp4_quantize's old swizzled-scale shape, CuteDslMoEWrapper (v0.6.4+) without enable_pdl
  and with uninitialised rows for tokens that have no local expert.
- ``flashinfer_0_6_7``  v0.6.7: CuteDslMoEWrapper(enable_pdl=), output zeroed densely.
- ``flashinfer_0_6_13`` v0.6.8-v0.6.13: kMaxTopK 22, 4 payloads, fp4_quantize(backend=,
  is_global_scale_inversed= from v0.6.11), FLASHINFER_NVFP4_4OVER6 (v0.6.12+), the warp token
  policy (TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN=0) that never publishes.
- ``flashinfer_0_6_14`` v0.6.14: combine's quant arguments, 6 payloads, activation='silu'.
- ``flashinfer_0_6_15`` v0.6.15: allocation records, the unmapped check, activation_type.
- ``flashinfer_0_6_17`` v0.6.16-v0.6.17: EPLB / rank-mask arguments, five-field cache key, uneven
  expert partition, fp32 combine sum, use_fused_finalize, run(per_token_scale=).
- ``flashinfer_0_7_0``  0.6.18-0.7.0: SiTU / quant_mode wrapper, the x dtype TypeError.
- ``flashinfer_0_7_1``  0.7.1: ``backend=``, six-field key, the init barrier, vector widths that
  respect plane alignment, fp4_quantize(nvfp4_4over6=).
- ``flashinfer_0_7_2``  0.7.2: as 0.7.1, and MoeAlltoAll deprecated (a DeprecationWarning at each
  construction).
- ``flashinfer_0_7_4``  0.7.4: no MoeAlltoAll; ``flashinfer.moe_ep``'s NVLinkOneSidedAlltoAll (``one_sided``: its
  Python layer and compiled module, the fence path), the CuTe-DSL and fp4_quantize keywords of 0.7.4.

Each is one ``release.export(globals(), version, ...)`` call over the shared pieces: ``kernels`` (the JIT module
``get_moe_alltoall_module()`` returns: the C++ checks, the workspace layout at calculateOffsets'
offsets, the dispatch and combine kernels' semantics, the function-static environment), ``mnnvl``
(MNNVL memory on CPU with FlashInfer's class-level address reservation, the communicators), ``a2a``
(the Python layer of ``trtllm_moe_alltoall.py``, one class per signature range), ``mapping``,
``nvfp4`` (fp4_quantize) and ``cute_dsl`` (the CuTe-DSL MoE, one class per signature range).
``kernels`` and ``mnnvl.patch_real_mnnvl`` also stand in for the compiled module and the
CUDA-driver memory under FlashInfer's real Python: ``real_python`` (the optional vendor-code tests).

They take vendor facts from ``moe_dispatch_flashinfer_cutedsl.vendor`` and helpers from the core;
never from the adapter modules.
"""
