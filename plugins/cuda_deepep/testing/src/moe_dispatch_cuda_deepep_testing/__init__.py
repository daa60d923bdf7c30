"""moe-dispatch-cuda-deepep-testing: the CPU fakes of DeepEP and DeepGEMM (``fakes``, one module per version range
where they behave differently), the checks the tests and ``scripts/`` share (``selfcheck``: on every rank;
``hardware``: the one-GPU check) and the helpers the tests share (``support``). Pass a fake's module path where the
plugin takes a vendor module::

    DeepEPBackend(EMULATOR), DeepEPV2Backend(EMULATOR), DeepGemmExperts("block_fp8", mode, DEEP_GEMM_EMULATOR)

Importing this package imports no fake.
"""

from __future__ import annotations

FAKES = f"{__name__}.fakes"
#: DeepEP 2.x (main @ dd758ca): the V1 ``Buffer`` in ``deep_ep/buffers/legacy.py``.
EMULATOR = f"{FAKES}.deep_ep"
#: A DeepEP built from the hybrid-ep branch (@ 94a9f8f): NVFP4 low-latency dispatch.
EMULATOR_NVFP4 = f"{FAKES}.deep_ep_hybrid"
#: DeepEP 1.2.1 before 2025-09-15 (@ e9d053c): low-latency top-k at most 9.
EMULATOR_V1_TOPK9 = f"{FAKES}.deep_ep_v121_topk9"
#: DeepEP 2.x built with ``EP_NUM_TOPK_IDX_BITS=32``: ``deep_ep.topk_idx_t`` is int32.
EMULATOR_TOPK_INT32 = f"{FAKES}.deep_ep_topk_int32"
#: DeepEP 2.0.0 (b306af0): V2's ElasticBuffer without do_zero_padding or the unaligned per-expert counts.
EMULATOR_V2_0 = f"{FAKES}.deep_ep_v2_0"
#: DeepGEMM 2.6.1 (@ 54e2261) on an SM90 device.
DEEP_GEMM_EMULATOR = f"{FAKES}.deep_gemm"
#: DeepGEMM 2.6.1 (@ 54e2261) on an SM100 device.
DEEP_GEMM_EMULATOR_SM100 = f"{FAKES}.deep_gemm_sm100"
#: DeepGEMM v1 (main @ 0c88cd0: #113, -1 blocks skipped; v1 went on to 03d0be3).
DEEP_GEMM_V1_EMULATOR = f"{FAKES}.deep_gemm_v1"
#: DeepGEMM v1 as PyPI's deep_gemm 1.0.0 has it (@ b05ed2f, 2025-02-27).
DEEP_GEMM_V1_PYPI_EMULATOR = f"{FAKES}.deep_gemm_v1_pypi"
#: v1's JIT kernels on CPU, for driving DeepGEMM v1's own Python layer.
DEEP_GEMM_V1_KERNELS = f"{FAKES}.deep_gemm_v1_kernels"

__all__ = ["DEEP_GEMM_EMULATOR", "DEEP_GEMM_EMULATOR_SM100", "DEEP_GEMM_V1_EMULATOR", "DEEP_GEMM_V1_KERNELS",
           "DEEP_GEMM_V1_PYPI_EMULATOR", "EMULATOR", "EMULATOR_NVFP4", "EMULATOR_TOPK_INT32", "EMULATOR_V1_TOPK9",
           "EMULATOR_V2_0", "FAKES"]
