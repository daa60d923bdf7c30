"""Reference quantize / dequantize for every wire dtype, and their byte encoding: what the vendor kernels produce,
so a plugin can compare its kernel's output against these bit for bit.

- FP8: e4m3 per token per 128 channels, as DeepEP's low-latency dispatch (deepseek-ai/DeepEP@dd758ca
  ``csrc/kernels/legacy/utils.cuh`` ``calculate_fp8_scales``): block amax floored at 1e-4, scale ``amax·(1/448)``
  (a product with the fp32 constant), values times ``448/amax``; with UE8M0 the scale rounded up to a power of two
  and the values divided by it (exact).
- INT8: symmetric per token, scale amax/127, round half to even (torch_npu ``npu_dynamic_quant``).
- NVFP4: FlashInfer's (``flashinfer/fp4_quantization.py``, ``tests/utils_fp4.py`` at fb28d72): block scale
  ``gs·amax/6`` cast to e4m3, values scaled by ``gs/scale``, clamped to ±6, rounded to the e2m1 grid; two values
  per byte, element 2i in the low nibble.

Every step is one IEEE operation on tensors, so a codec gives the same bits on every device: divisions divide by a
tensor (CUDA computes ``t / c`` for a Python number as ``t·(1/c)``), and constants are 0-dim tensors made on the
device (a host copy would sync and break CUDA-graph capture); checked on an H100 by ``benchmarks/gpu/check_core.py``
(docs/evidence/hardware-runs.md). On the wire a token is one row of bytes: the data, then the scales (fp32
little-endian; one byte for UE8M0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from ._errors import InvalidInputError, InvalidSpecError
from ._spec import check_global_scale
from ._wire import FP8_BLOCK, NVFP4_BLOCK, WIRE_DTYPES, DispatchDtype, WireFormat

FP8_MAX = 448.0
#: DeepEP's ``kFinfoAmaxInvE4M3 = 1 / 448.0f`` once torch has rounded this Python number to the tensor's fp32.
FP8_MAX_INV = 1.0 / 448.0
FP8_AMAX_FLOOR = 1e-4
INT8_MAX = 127.0
INT8_AMAX_FLOOR = 1e-10
E2M1_MAX = 6.0


@dataclass(frozen=True)
class Quantized:
    """Activations in a wire dtype. ``scale`` is None for BF16; NVFP4's are e4m3 block scales (global: the codec's)."""

    data: torch.Tensor
    scale: torch.Tensor | None


class Codec:
    """Quantizes ``[..., H]`` activations to one wire format and back. A subclass names its format in ``WIRE_DTYPE``
    (``make_codec`` picks it by that; ``WIRE_DTYPES`` declares the rest); a global scale, if any, comes second."""

    WIRE_DTYPE: ClassVar[DispatchDtype]

    def __init__(self, wire: WireFormat) -> None:
        self.wire = wire

    @property
    def dtype(self) -> DispatchDtype:
        return self.wire.dtype

    def quantize(self, x: torch.Tensor) -> Quantized:
        raise NotImplementedError

    def dequantize(self, q: Quantized) -> torch.Tensor:
        """Back to fp32."""
        raise NotImplementedError

    def data_dtype(self) -> torch.dtype:
        """The tensor dtype of the quantized data (``WireDtype.element``)."""
        return self.wire.format.element

    def scale_shape(self, lead: tuple[int, ...]) -> tuple[int, ...] | None:
        return None

    def encode(self, x: torch.Tensor, trailer: torch.Tensor | Sequence[torch.Tensor] = (),
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize and lay out as wire rows ``[..., bytes_per_token]`` of uint8, followed by ``trailer``'s uint8
        tensor or tensors (routing metadata: one copy instead of two), in ``out`` when given."""
        return self.to_bytes(self.quantize(x), (trailer,) if isinstance(trailer, torch.Tensor) else trailer, out)

    def to_bytes(self, q: Quantized, trailer: Sequence[torch.Tensor] = (),
                 out: torch.Tensor | None = None) -> torch.Tensor:
        parts = [as_bytes(q.data)]
        if q.scale is not None:
            parts.append(self._scale_to_bytes(q.scale))
        parts.extend(trailer)
        if out is not None:
            return torch.cat(parts, dim=-1, out=out)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def from_bytes(self, rows: torch.Tensor) -> Quantized:
        data_bytes = self.wire.data_bytes
        data = from_bytes(rows[..., :data_bytes], self.data_dtype())
        return Quantized(data, self._scale_from_bytes(rows[..., data_bytes:]) if self.wire.scale_bytes else None)

    def _scale_to_bytes(self, scale: torch.Tensor) -> torch.Tensor:
        return as_bytes(scale)

    def _scale_from_bytes(self, raw: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class BF16Codec(Codec):
    WIRE_DTYPE = DispatchDtype.BF16

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(x.to(torch.bfloat16), None)

    def dequantize(self, q: Quantized) -> torch.Tensor:
        return q.data.float()


class FP8Codec(Codec):
    """e4m3 data ``[..., H]`` and fp32 scales ``[..., H/128]`` (powers of two with UE8M0)."""

    WIRE_DTYPE = DispatchDtype.FP8

    def quantize(self, x: torch.Tensor) -> Quantized:
        # abs and max are exact in x's dtype, so the amax comes before the widening (one fp32 pass fewer); the
        # product then stays within 448·(1 + 2 ulp), which the cast rounds to 448 (NaN only from 464): no clamp.
        amax = x.unflatten(-1, (-1, FP8_BLOCK)).abs().amax(dim=-1, keepdim=True).float().clamp_min(FP8_AMAX_FLOOR)
        blocks = x.to(torch.float32, copy=True).unflatten(-1, (-1, FP8_BLOCK))
        scale = amax * FP8_MAX_INV
        if self.wire.ue8m0:
            scale = pow2_ceil(scale)
            return Quantized(blocks.div_(scale).to(torch.float8_e4m3fn).flatten(-2), scale.squeeze(-1))  # exact
        scaled = blocks.mul_(torch.full_like(amax, FP8_MAX) / amax)
        return Quantized(scaled.to(torch.float8_e4m3fn).flatten(-2), scale.squeeze(-1))

    def dequantize(self, q: Quantized) -> torch.Tensor:
        assert q.scale is not None
        scale = q.scale
        if scale.dtype == torch.int32:  # UE8M0 packed four per word, as DeepEP/DeepGEMM hand it over
            scale = unpack_ue8m0(scale, self.wire.hidden // FP8_BLOCK)
        blocks = q.data.float().unflatten(-1, (-1, FP8_BLOCK))
        return (blocks * scale.unsqueeze(-1)).flatten(-2)

    def scale_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, self.wire.hidden // FP8_BLOCK)

    def _scale_to_bytes(self, scale: torch.Tensor) -> torch.Tensor:
        if not self.wire.ue8m0:
            return super()._scale_to_bytes(scale)
        # UE8M0: the biased exponent of a power-of-two scale, one byte per 128 channels.
        return (torch.frexp(scale).exponent - 1 + 127).clamp(0, 254).to(torch.uint8)

    def _scale_from_bytes(self, raw: torch.Tensor) -> torch.Tensor:
        return ue8m0_value(raw) if self.wire.ue8m0 else from_bytes(raw, torch.float32)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each positive fp32 value, exactly: the mantissa rounded up into the exponent
    bits, as DeepGEMM's ``ceil_to_ue8m0`` and DeepEP's ``fast_log2_ceil`` do (``exp2(ceil(log2(x)))`` can return the
    power below just above a power of two, which makes a block's largest value clip)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of ``pack_ue8m0``: int32 ``[..., ceil(G/4)]`` → fp32 ``[..., G]``; column-major (MN-major) views too."""
    words = -(-groups // 4)
    if packed.dtype != torch.int32 or packed.shape[-1] != words:
        raise InvalidInputError(f"packed UE8M0 scales for {groups} groups need {words} int32 words per row",
                                parameter="hidden_states_scale", value=packed, allowed=f"int32 [..., {words}]")
    return ue8m0_value(as_bytes(packed)[..., :groups])


def ue8m0_value(exponent: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (biased exponents, uint8) → fp32 powers of two, built from the bits so the value is exact on
    every device (``exp2`` need not be): byte e is 2^(e-127); 0 is 2^-127, a subnormal; 255 is NaN (OCP E8M0)."""
    e = exponent.to(torch.int32)
    value = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23).view(torch.float32)
    return torch.where(e == 255, torch.full_like(value, float("nan")), value)


class INT8Codec(Codec):
    """int8 data ``[..., H]`` and one fp32 scale per token ``[...]``."""

    WIRE_DTYPE = DispatchDtype.INT8

    def quantize(self, x: torch.Tensor) -> Quantized:
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(INT8_AMAX_FLOOR)
        scale = amax / torch.full_like(amax, INT8_MAX)  # a true division on every device
        q = torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return Quantized(q, scale.squeeze(-1))

    def dequantize(self, q: Quantized) -> torch.Tensor:
        assert q.scale is not None
        return q.data.float() * q.scale.unsqueeze(-1)

    def scale_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return lead

    def _scale_to_bytes(self, scale: torch.Tensor) -> torch.Tensor:
        return as_bytes(scale.unsqueeze(-1))  # one scale per token: a width-1 last dim

    def _scale_from_bytes(self, raw: torch.Tensor) -> torch.Tensor:
        return from_bytes(raw, torch.float32).squeeze(-1)


class NVFP4Codec(Codec):
    """Packed e2m1 ``[..., H/2]`` uint8, e4m3 block scales ``[..., H/16]`` (linear), one fp32 global scale per dispatcher."""

    WIRE_DTYPE = DispatchDtype.NVFP4

    def __init__(self, wire: WireFormat, global_scale: float) -> None:
        super().__init__(wire)
        self.global_scale = check_global_scale(global_scale)

    def quantize(self, x: torch.Tensor) -> Quantized:
        gs = torch.full((), self.global_scale, dtype=torch.float32, device=x.device)
        blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK))
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        # FlashInfer's order of operations, for bit-equal results: sf = gs·(amax·(1/6)), then the quantizing
        # multiplier 1/(sf·(1/gs)). Clamp before the e4m3 cast: a too-large global scale must not give NaN scales.
        scale = (gs * (amax * _reciprocal(torch.tensor(E2M1_MAX)))).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
        inv = _reciprocal(scale.float() * _reciprocal(gs))
        codes = _e2m1_codes((blocks * inv).clamp(-E2M1_MAX, E2M1_MAX)).flatten(-2)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        return Quantized(packed, scale.squeeze(-1))

    def dequantize(self, q: Quantized) -> torch.Tensor:
        assert q.scale is not None
        blocks = e2m1_unpack(q.data).unflatten(-1, (-1, NVFP4_BLOCK))
        return (blocks * (q.scale.float().unsqueeze(-1) / self.global_scale)).flatten(-2)

    def scale_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, self.wire.hidden // NVFP4_BLOCK)

    def _scale_from_bytes(self, raw: torch.Tensor) -> torch.Tensor:
        return from_bytes(raw, torch.float8_e4m3fn)


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1/x in fp32, 0 where x is 0 (an all-zero block quantizes to zeros)."""
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / x)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The last dim of ``t`` reinterpreted as uint8 (empty tensors included)."""
    if t.numel() == 0:
        return torch.empty(*t.shape[:-1], t.shape[-1] * t.element_size(), dtype=torch.uint8, device=t.device)
    return _view(t, torch.uint8)


def from_bytes(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows reinterpreted as ``dtype`` along the last dim (empty tensors included)."""
    if raw.numel() == 0:
        return torch.empty(*raw.shape[:-1], raw.shape[-1] // dtype.itemsize, dtype=dtype, device=raw.device)
    return _view(raw, dtype)


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.view(dtype)`` without a copy where the strides allow it (a column slice of wire rows does: a received
    buffer's payload is not copied out before use)."""
    if t.dtype == dtype:
        return t
    if t.stride(-1) == 1:
        try:
            return t.view(dtype)
        except RuntimeError:  # strides or offset not a multiple of the new element size
            pass
    return t.clone(memory_format=torch.contiguous_format).view(dtype)  # fresh storage: aligned


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid, ties to even (FlashInfer's ``cast_to_fp4``), as 4-bit codes."""
    a = scaled.abs()
    magnitude = ((a > 0.25).to(torch.int32) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
                 + (a > 5.0))
    return magnitude | ((scaled < 0).to(torch.int32) << 3)


def e2m1_unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n]`` → fp32 ``[..., 2n]``, low nibble first. Decoded from the bits (sign, 2-bit exponent, 1-bit
    mantissa; exponent 0 is subnormal), with no table to copy to the device."""
    p = packed.to(torch.int32)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).to(torch.float32)
    magnitude = torch.where(exponent == 0, mantissa * 0.5, torch.ldexp(1.0 + mantissa * 0.5, exponent - 1))
    return torch.where(codes >= 8, -magnitude, magnitude)


_CODECS: dict[DispatchDtype, type[Codec]] = {c.WIRE_DTYPE: c for c in (BF16Codec, FP8Codec, INT8Codec, NVFP4Codec)}


def make_codec(wire: WireFormat, global_scale: float | None = None) -> Codec:
    codec = _CODECS[wire.dtype]
    if not wire.format.global_scale:
        return codec(wire)
    if global_scale is None:
        raise InvalidSpecError(f"{wire.dtype.value} dispatch needs a global scale",
                               parameter="quant.input_global_scale", value=None,
                               allowed="a positive finite float (FlashInfer's convention: 448*6/amax of the "
                                       "activations)")
    return codec(wire, global_scale)  # type: ignore[call-arg]


def dispatch_dtype_of(tensor: torch.Tensor, parameter: str = "hidden_states") -> DispatchDtype:
    """Which wire dtype a dispatched activation tensor is in, from its tensor dtype."""
    for dtype, w in WIRE_DTYPES.items():
        if tensor.dtype == w.element:
            return dtype
    raise InvalidInputError("is not a dispatched activation dtype", parameter=parameter, value=tensor,
                            allowed="bfloat16, float8_e4m3fn, int8, uint8 (packed NVFP4)")
