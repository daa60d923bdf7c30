"""Exactly what one token costs on the wire for each dispatch dtype."""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import DispatchDtype
from .errors import InvalidSpecError

FP8_BLOCK = 128  # channels per fp32 scale (DeepEP / DeepGEMM per-token-group quantization)
NVFP4_BLOCK = 16  # elements per e4m3 block scale (FlashInfer NVFP4)


@dataclass(frozen=True)
class WireFormat:
    """Bytes per token for ``dtype`` at hidden size ``hidden``.

    BF16 = 2H; FP8 = H + 4·H/128 (UE8M0 scales: H + H/128); INT8 = H + 4;
    NVFP4 = H/2 + H/16. The NVFP4 global scale is a per-dispatcher constant from the
    quant hints, known to every rank, so it does not travel per token.
    """

    dtype: DispatchDtype
    hidden: int
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, int) or self.hidden <= 0:
            raise InvalidSpecError("must be a positive int", parameter="hidden_size", value=self.hidden)
        block = self.block
        if block and self.hidden % block:
            raise InvalidSpecError(
                f"{self.dtype.value} dispatch needs the hidden size to be a multiple of {block}",
                parameter="hidden_size",
                value=self.hidden,
                allowed=f"multiples of {block}, or bf16/int8 dispatch",
            )
        if self.ue8m0 and self.dtype is not DispatchDtype.FP8:
            raise InvalidSpecError(
                "UE8M0 scales exist only for fp8", parameter="fp8_ue8m0_scales", value=True, allowed="fp8 only"
            )

    @property
    def block(self) -> int:
        """The hidden size must be a multiple of this (0: any)."""
        return {DispatchDtype.FP8: FP8_BLOCK, DispatchDtype.NVFP4: NVFP4_BLOCK}.get(self.dtype, 0)

    @property
    def data_bytes(self) -> int:
        if self.dtype is DispatchDtype.BF16:
            return 2 * self.hidden
        if self.dtype is DispatchDtype.NVFP4:
            return self.hidden // 2
        return self.hidden

    @property
    def scale_bytes(self) -> int:
        if self.dtype is DispatchDtype.FP8:
            groups = self.hidden // FP8_BLOCK
            return groups if self.ue8m0 else 4 * groups
        if self.dtype is DispatchDtype.INT8:
            return 4
        if self.dtype is DispatchDtype.NVFP4:
            return self.hidden // NVFP4_BLOCK
        return 0

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def combine_bytes_per_token(self) -> int:
        """Combine always sends BF16 back."""
        return 2 * self.hidden

    @property
    def ratio_to_bf16(self) -> float:
        return self.bytes_per_token / (2 * self.hidden)


__all__ = ["FP8_BLOCK", "NVFP4_BLOCK", "WireFormat"]
