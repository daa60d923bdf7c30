"""A fake of DeepGEMM 2.6.1 (deepseek-ai/DeepGEMM@54e2261) on an SM100 (compute capability 10.0) device:
packed UE8M0 scale factors; fp32 scales are cast to UE8M0 and must be powers of two (device assert).
See ``fakes.deep_gemm`` for what is checked; ``fakes.deep_gemm.emulate`` builds other versions."""

from __future__ import annotations

from moe_dispatch_cuda_deepep import vendor

from .deep_gemm import emulate

__version__ = "2.6.1"
EMULATED_DEVICE_CAPABILITY = (10, 0)

_SM100 = emulate(EMULATED_DEVICE_CAPABILITY, __version__, __name__)
m_grouped_fp8_gemm_nt_contiguous = getattr(_SM100, vendor.DG_FP8_CONTIGUOUS)
m_grouped_fp8_gemm_nt_masked = getattr(_SM100, vendor.DG_FP8_MASKED)
fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
m_grouped_bf16_gemm_nt_contiguous = getattr(_SM100, vendor.DG_BF16_CONTIGUOUS)
m_grouped_bf16_gemm_nt_masked = getattr(_SM100, vendor.DG_BF16_MASKED)
get_mk_alignment_for_contiguous_layout = getattr(_SM100, vendor.DG_MK_ALIGNMENT)
set_mk_alignment_for_contiguous_layout = getattr(_SM100, vendor.DG_SET_MK_ALIGNMENT)
get_tma_aligned_size = getattr(_SM100, vendor.DG_TMA_ALIGNED_SIZE)
get_mn_major_tma_aligned_tensor = getattr(_SM100, vendor.DG_MN_MAJOR_TMA_ALIGNED)
get_mn_major_tma_aligned_packed_ue8m0_tensor = getattr(_SM100, vendor.DG_MN_MAJOR_PACKED_UE8M0)
sf_transforms = _SM100.sf_transforms
emulated_stream_capturing = getattr(_SM100, vendor.EMULATED_STREAM_CAPTURING_ATTRIBUTE)
