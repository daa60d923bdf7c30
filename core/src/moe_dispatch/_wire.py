"""The wire dtypes, dispatch modes and output layouts, and exactly what one token costs on the wire.

One declaration per wire dtype (``WIRE_DTYPES``): everything the core's tables, checks and codecs need to know about
it. A new wire format is one ``DispatchDtype`` member, one ``WIRE_DTYPES`` entry and one ``Codec`` subclass
(``_codecs.py``, registered by its ``WIRE_DTYPE``); every other module reads these fields instead of naming the dtype.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import InvalidSpecError


class _ValueEnum(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    @classmethod
    def _named(cls, value: object, parameter: str, what: str, none: str = "") -> Any:
        """``value`` as a member: a member, or its value in any case, ``-`` for ``_``; ``none`` (e.g. "auto") and
        None give None where the field allows it."""
        if isinstance(value, cls) or (none and value is None):
            return value
        text = str(value).strip().lower().replace("-", "_")
        if none and text == none:
            return None
        if text in cls._value2member_map_:
            return cls(text)
        raise InvalidSpecError(f"unknown {what}", parameter=parameter, value=value,
                               allowed=", ".join([none] * bool(none) + [m.value for m in cls]))


class DispatchDtype(_ValueEnum):
    """What the activations are when they cross the wire to the experts."""

    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    NVFP4 = "nvfp4"

    @classmethod
    def parse(cls, value: "str | DispatchDtype | None", parameter: str = "output_dtype") -> "DispatchDtype | None":
        """``"auto"`` (or None) gives None, meaning "let resolution decide"."""
        return cls._named(value, parameter, "dispatch dtype", none="auto")


class Mode(_ValueEnum):
    """Normal mode sizes exchanges from the batch (one host sync); low-latency mode uses fixed capacity slots, needs
    no host sync and can be captured in a CUDA graph."""

    NORMAL = "normal"
    LOW_LATENCY = "low_latency"

    @classmethod
    def parse(cls, value: "str | Mode", parameter: str = "mode") -> "Mode":
        return cls._named(value, parameter, "dispatch mode")


class Layout(_ValueEnum):
    """PACKED: ``[rows, H]``, rows per (token, local expert) grouped by expert. MASKED:
    ``[E_local, capacity * world_size, H]``; expert ``e`` has ``group_list``-many valid rows at the front, the rest
    is padding. TOKEN_MAJOR (normal mode, where a backend declares it; DeepEP's normal layout): ``[rows, H]``, each
    received token once, with its local top-k (``DispatchOutput.row_topk_ids``); the expert output is one row per
    received row, weighted and summed over its local experts."""

    PACKED = "packed"
    MASKED = "masked"
    TOKEN_MAJOR = "token_major"

    @classmethod
    def parse(cls, value: "str | Layout | None", parameter: str = "layout") -> "Layout | None":
        """None: the backend's layout for the mode."""
        return None if value is None else cls._named(value, parameter, "output layout")


@dataclass(frozen=True)
class WireDtype:
    """What one wire dtype is.

    :param element: the tensor dtype of dispatched rows (NVFP4: two e2m1 values per uint8).
    :param bits: bits per hidden value on the wire (a row has ``H·bits/8`` bytes, and as many columns as bytes for
        packed formats: ``row_columns``).
    :param scale_group: hidden values per scale, which the hidden size must be a multiple of (0: one scale per
        token, or none).
    :param scale_bytes: bytes per scale (0: no scales).
    :param ue8m0_scale_bytes: bytes per scale when the scales are UE8M0 powers of two (0: no UE8M0 form).
    :param global_scale: a per-dispatcher global scale is part of the format (NVFP4's).
    :param tolerance: the relative L2 error a whole MoE layer may show against the dense fp32 reference with this
        dtype on the wire (the conformance kit's bound).
    """

    dtype: DispatchDtype
    element: torch.dtype
    bits: int
    scale_group: int
    scale_bytes: int
    ue8m0_scale_bytes: int
    global_scale: bool
    tolerance: float

    @property
    def scaled(self) -> bool:
        """Dispatched rows come with scales."""
        return self.scale_bytes > 0

    def data_bytes(self, hidden: int) -> int:
        return hidden * self.bits // 8

    def scale_bytes_per_token(self, hidden: int, ue8m0: bool = False) -> int:
        per_scale = self.ue8m0_scale_bytes if ue8m0 else self.scale_bytes
        return per_scale * (hidden // self.scale_group if self.scale_group else 1) if self.scaled else 0

    def row_columns(self, hidden: int) -> int:
        """Columns of one dispatched row: ``H``, or the packed bytes (``H/2`` for NVFP4)."""
        return hidden if self.bits >= 8 else self.data_bytes(hidden)


WIRE_DTYPES: dict[DispatchDtype, WireDtype] = {w.dtype: w for w in (
    WireDtype(DispatchDtype.BF16, torch.bfloat16, 16, 0, 0, 0, False, 0.01),
    # per 128-channel group, fp32 scales (DeepEP / DeepGEMM per-token-group quantization)
    WireDtype(DispatchDtype.FP8, torch.float8_e4m3fn, 8, 128, 4, 1, False, 0.06),
    # one fp32 scale per token
    WireDtype(DispatchDtype.INT8, torch.int8, 8, 0, 4, 0, False, 0.03),
    # e2m1 pairs, an e4m3 scale per 16 values, and the dispatcher's global scale (FlashInfer)
    WireDtype(DispatchDtype.NVFP4, torch.uint8, 4, 16, 1, 0, True, 0.20),
)}


def wire_dtype(dtype: DispatchDtype) -> WireDtype:
    return WIRE_DTYPES[dtype]


FP8_BLOCK = wire_dtype(DispatchDtype.FP8).scale_group  # channels per fp32 scale (DeepEP / DeepGEMM)
NVFP4_BLOCK = wire_dtype(DispatchDtype.NVFP4).scale_group  # elements per e4m3 block scale (FlashInfer NVFP4)


@dataclass(frozen=True)
class WireFormat:
    """Bytes per token for ``dtype`` at hidden size ``hidden``: BF16 = 2H; FP8 = H + 4·H/128 (UE8M0 scales:
    H + H/128); INT8 = H + 4; NVFP4 = H/2 + H/16. The NVFP4 global scale is a per-dispatcher constant from the quant
    hints, known to every rank, so it does not travel per token."""

    dtype: DispatchDtype
    hidden: int
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.hidden, int) or self.hidden <= 0:
            raise InvalidSpecError("must be a positive int", parameter="hidden_size", value=self.hidden)
        block = self.block
        if block and self.hidden % block:
            unblocked = "/".join(d.value for d, w in WIRE_DTYPES.items() if not w.scale_group)
            raise InvalidSpecError(f"{self.dtype.value} dispatch needs the hidden size to be a multiple of {block}",
                                   parameter="hidden_size", value=self.hidden,
                                   allowed=f"multiples of {block}, or {unblocked} dispatch")
        if self.ue8m0 and not self.format.ue8m0_scale_bytes:
            raise InvalidSpecError(
                f"UE8M0 scales do not exist for {self.dtype.value}", parameter="fp8_ue8m0_scales", value=True,
                allowed=", ".join(d.value for d, w in WIRE_DTYPES.items() if w.ue8m0_scale_bytes) + " only")

    @property
    def format(self) -> WireDtype:
        """Everything dtype-specific (``WIRE_DTYPES``)."""
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
