"""``fp4_quantize`` on CPU (flashinfer/fp4_quantization.py until v0.6.6, then
flashinfer/quantization/fp4_quantization.py): NVFP4 with the core codec's rounding (bit-equal to
FlashInfer's pure-torch reference; whether the CUDA kernel's fast-math path is too is a hardware
check), scales linear ``[M, K/16]`` or 128x4-swizzled.

As each version checks and shapes (``vendor.FP4_*``, thop/fp4Quantize.cpp): a column-major input
is transposed, anything else non-contiguous fails ``CHECK_CONTIGUOUS``; leading dims are flattened
into M; swizzled scales come back ``reshape(-1, K/16)`` until v0.6.7 (a torch error when the
padding makes that impossible) and ``(-1, round_up(K/16, 4))`` from v0.6.8; the global scale is
cast in Python from v0.6.13, read as raw fp32 bytes on the input's device before (fake: asserted).
Zero rows: the kernel launches a 0-block grid whose error nobody checks (fake: asserted, so a
caller that passes 0 rows is caught here).

Environment, read on every call as the kernels do: FLASHINFER_NVFP4_4OVER6 from v0.6.12 (the fake
cannot compute the 4over6 search and says so; from 0.7.1 ``nvfp4_4over6=None`` ignores it), the
fast-math switches (``vendor.fp4_fast_math_env``; no effect here).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

import moe_dispatch as md
from moe_dispatch.backend import NVFP4Codec, WireFormat, swizzle_128x4
from moe_dispatch_flashinfer_cutedsl import vendor

from . import tvm


class _Unset:
    def __repr__(self) -> str:
        return "_UNSET"


#: The "argument omitted" sentinel of ``nvfp4_4over6`` (reads the environment).
UNSET: Any = _Unset()
_UNSET = UNSET  # the name FlashInfer's signature writes


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def quantize(version: vendor.Version, input: torch.Tensor, global_scale: torch.Tensor | None,  # noqa: A002
             sf_vec_size: int, sf_use_ue8m0: bool, is_sf_swizzled_layout: bool, is_sf_8x4_layout: bool,
             is_global_scale_inversed: bool = False, backend: str = "cuda",
             nvfp4_4over6: Any = UNSET) -> tuple[torch.Tensor, torch.Tensor]:
    if sf_vec_size != 16 and sf_vec_size != 32:
        raise NotImplementedError("sf_vec_size can only be 16 or 32")
    if version >= vendor.NVFP4_4OVER6_SINCE:
        explicit = version >= vendor.NVFP4_4OVER6_ARG_SINCE and nvfp4_4over6 is not UNSET
        on = (nvfp4_4over6 is not None) if explicit else vendor.env_flag(os.environ, vendor.ENV_NVFP4_4OVER6)
        if on:
            raise NotImplementedError(f"fake fp4_quantize: the NVFP4 4over6 scale search ({vendor.ENV_NVFP4_4OVER6}=1 "
                                      "or nvfp4_4over6=...) is not emulated")
    if backend not in ("cuda", "cute-dsl"):
        raise ValueError(f"Unknown backend: {backend}. Must be 'cuda' or 'cute-dsl'.")
    if global_scale is not None:
        if version >= vendor.FP4_GLOBAL_SCALE_CAST_SINCE:
            global_scale = global_scale.to(device=input.device, dtype=torch.float32)
        else:  # fp4Quantize.cpp reads it through a float* on the kernel's device
            assert global_scale.dtype == torch.float32 and global_scale.device == input.device, (
                "fake: the kernel reads global_scale as float32 on the input's device "
                f"(got {global_scale.dtype} on {global_scale.device}); FlashInfer < 0.6.13 does not convert it")
    column_major = input.stride(-2) == 1
    if column_major:
        input = input.transpose(-2, -1)
    assert input.shape[-1] % sf_vec_size == 0
    # thop/fp4Quantize.cpp
    tvm.icheck(input.is_contiguous(), "self.IsContiguous()", "self must be contiguous")
    if not sf_use_ue8m0:
        tvm.icheck(global_scale is not None, "globalScale.has_value()",
                   "globalScale is required when sfUseUE8M0 is false")
    tvm.icheck(input.dim() >= 2, "rank >= 2", "Input should be >=2D tensor.")
    if sf_vec_size != vendor.NVFP4_BLOCK or sf_use_ue8m0 or is_sf_8x4_layout:
        raise NotImplementedError("fake fp4_quantize implements NVFP4 (16 elements, e4m3 scales, a global scale), "
                                  "linear or 128x4 scales")
    if input.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError("fake fp4_quantize takes half/bfloat16 input")
    k = input.shape[-1]
    rows = input.reshape(-1, k)
    assert rows.shape[0] > 0, ("fake: 0 rows: the quantize kernel launches a 0-block grid "
                               "(cudaErrorInvalidConfiguration, not checked there)")
    assert global_scale is not None
    gs = float(global_scale.reshape(-1)[0])
    if is_global_scale_inversed:
        gs = 1.0 / gs
    q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, k), gs).quantize(rows)
    x_q = q.data.reshape(*input.shape[:-1], k // 2)
    sf = q.scale.view(torch.uint8)
    if is_sf_swizzled_layout:
        padded = swizzle_128x4(sf).reshape(-1)  # the kernel's buffer: round_up(M,128) x round_up(K/16,4)
        cols = _round_up(k // sf_vec_size, 4) if version >= vendor.FP4_SF_PADDED_COLS_SINCE else k // sf_vec_size
        sf = padded.reshape(-1, cols)  # torch raises when the padding does not divide (<= 0.6.7)
    if column_major:
        x_q, sf = x_q.transpose(-2, -1), sf.transpose(-2, -1)
    return x_q, sf


def fp4_quantize_for(version: vendor.Version) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``fp4_quantize`` with the signature of ``version`` (``vendor.SIGNATURES``)."""
    if version >= vendor.EP_SINCE:  # backend "auto": the CUDA kernel unless batch_invariant
        def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                         is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None, backend="auto",
                         nvfp4_4over6=_UNSET, *, batch_invariant=False):  # noqa: A002
            if batch_invariant:
                raise NotImplementedError("fake fp4_quantize: batch_invariant=True is not emulated")
            return quantize(version, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                            is_sf_8x4_layout, is_global_scale_inversed, "cuda" if backend == "auto" else backend,
                            nvfp4_4over6)
    elif version >= vendor.NVFP4_4OVER6_ARG_SINCE:
        def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                         is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None, backend="cuda",
                         nvfp4_4over6=_UNSET):  # noqa: A002
            return quantize(version, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                            is_sf_8x4_layout, is_global_scale_inversed, backend, nvfp4_4over6)
    elif version >= (0, 6, 11):
        def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                         is_sf_8x4_layout=False, is_global_scale_inversed=False, enable_pdl=None,
                         backend="cuda"):  # noqa: A002
            return quantize(version, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                            is_sf_8x4_layout, is_global_scale_inversed, backend)
    elif version >= (0, 6, 8):
        def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                         is_sf_8x4_layout=False, enable_pdl=None, backend="cuda"):  # noqa: A002
            return quantize(version, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                            is_sf_8x4_layout, False, backend)
    else:
        def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True,
                         is_sf_8x4_layout=False, enable_pdl=None):  # noqa: A002
            return quantize(version, input, global_scale, sf_vec_size, sf_use_ue8m0, is_sf_swizzled_layout,
                            is_sf_8x4_layout)
    return fp4_quantize


__all__ = ["UNSET", "fp4_quantize_for", "quantize"]
