"""Exactly what one token costs on the wire for each dispatch dtype."""

from __future__ import annotations

from dataclasses import dataclass

from .dtypes import DispatchDtype
from .errors import InvalidSpecError
from .formats import WIRE_DTYPES, WireDtype, wire_dtype

FP8_BLOCK = wire_dtype(DispatchDtype.FP8).scale_group  # channels per fp32 scale (DeepEP / DeepGEMM)
NVFP4_BLOCK = wire_dtype(DispatchDtype.NVFP4).scale_group  # elements per e4m3 block scale (FlashInfer NVFP4)


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
                allowed=f"multiples of {block}, or " + "/".join(d.value for d, w in WIRE_DTYPES.items()
                                                                if not w.scale_group) + " dispatch",
            )
        if self.ue8m0 and not self.format.ue8m0_scale_bytes:
            raise InvalidSpecError(
                f"UE8M0 scales do not exist for {self.dtype.value}", parameter="fp8_ue8m0_scales", value=True,
                allowed=", ".join(d.value for d, w in WIRE_DTYPES.items() if w.ue8m0_scale_bytes) + " only")

    @property
    def format(self) -> WireDtype:
        """Everything dtype-specific (``formats.WIRE_DTYPES``)."""
        return wire_dtype(self.dtype)

    @property
    def block(self) -> int:
        """The hidden size must be a multiple of this (0: any)."""
        return self.format.scale_group

    @property
    def data_bytes(self) -> int:
        return self.format.data_bytes(self.hidden)

    @property
    def scale_bytes(self) -> int:
        return self.format.scale_bytes_per_token(self.hidden, self.ue8m0)

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
