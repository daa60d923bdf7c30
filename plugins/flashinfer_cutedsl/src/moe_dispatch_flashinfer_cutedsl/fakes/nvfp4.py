"""``fp4_quantize`` on CPU (flashinfer/fp4_quantization.py until v0.6.7, then
flashinfer/quantization/fp4_quantization.py): NVFP4 with the core codec's rounding (bit-equal to
FlashInfer's pure-torch reference; whether the CUDA kernel's fast-math path is too is a hardware
check), scales linear ``[M, K/16]`` or 128x4-swizzled ``[round_up(M,128), round_up(K/16,4)]``.

Environment, read on every call as the kernels do: FLASHINFER_NVFP4_4OVER6 from v0.6.12 (the fake
cannot compute the 4over6 search and says so; from 0.7.1 ``nvfp4_4over6=None`` ignores it), the
fast-math switches from v0.6.13 (no effect here).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.codecs import NVFP4Codec
from moe_dispatch.scale_layouts import swizzle_128x4
from moe_dispatch.wire import WireFormat

from .. import vendor


class _Unset:
    def __repr__(self) -> str:
        return "_UNSET"


#: The "argument omitted" sentinel of ``nvfp4_4over6`` (reads the environment).
UNSET: Any = _Unset()


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
        global_scale = global_scale.to(dtype=torch.float32)
    column_major = input.stride(-2) == 1
    if column_major:
        input = input.transpose(-2, -1)
    assert input.shape[-1] % sf_vec_size == 0
    if sf_vec_size != vendor.NVFP4_BLOCK or sf_use_ue8m0 or is_sf_8x4_layout or global_scale is None:
        raise NotImplementedError("fake fp4_quantize implements NVFP4 (16 elements, e4m3 scales, a global scale), "
                                  "linear or 128x4 scales")
    if input.dtype not in (torch.bfloat16, torch.float16) or input.dim() != 2:
        raise NotImplementedError("fake fp4_quantize takes 2-D half/bfloat16 input")
    gs = float(global_scale.reshape(-1)[0])
    if is_global_scale_inversed:
        gs = 1.0 / gs
    q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, input.shape[1]), gs).quantize(input)
    sf = q.scale.view(torch.uint8)
    if is_sf_swizzled_layout:
        sf = swizzle_128x4(sf)
    x_q = q.data
    if column_major:
        x_q, sf = x_q.transpose(-2, -1), sf.transpose(-2, -1)
    return x_q, sf


__all__ = ["UNSET", "quantize"]
