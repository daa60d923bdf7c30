"""One declaration per wire dtype: everything about a dtype that the core's tables, checks and
codecs need, in one place. A new wire format is one ``DispatchDtype`` member, one ``WIRE_DTYPES``
entry here and one ``Codec`` subclass (``codecs.py``, registered by its ``dtype``); every other
module reads these fields instead of naming the dtype.

The numbers per token at hidden size H (``WireFormat`` computes them from the fields):
BF16 = 2H; FP8 = H + 4·H/128 (UE8M0 scales: H + H/128); INT8 = H + 4; NVFP4 = H/2 + H/16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import DispatchDtype


@dataclass(frozen=True)
class WireDtype:
    """What one wire dtype is.

    :param element: the tensor dtype of dispatched rows (NVFP4: two e2m1 values per uint8).
    :param bits: bits per hidden value on the wire (a row has ``H·bits/8`` bytes, and as many
        columns as bytes for packed formats: ``row_columns``).
    :param scale_group: hidden values per scale, which the hidden size must be a multiple of
        (0: one scale per token, or none).
    :param scale_bytes: bytes per scale (0: no scales).
    :param ue8m0_scale_bytes: bytes per scale when the scales are UE8M0 powers of two (0: this
        dtype has no UE8M0 form).
    :param global_scale: a per-dispatcher global scale is part of the format (NVFP4's).
    :param tolerance: the relative L2 error a whole MoE layer may show against the dense fp32
        reference with this dtype on the wire (the conformance kit's bound).
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


WIRE_DTYPES: dict[DispatchDtype, WireDtype] = {
    w.dtype: w
    for w in (
        WireDtype(DispatchDtype.BF16, torch.bfloat16, 16, 0, 0, 0, False, 0.01),
        # per 128-channel group, fp32 scales (DeepEP / DeepGEMM per-token-group quantization)
        WireDtype(DispatchDtype.FP8, torch.float8_e4m3fn, 8, 128, 4, 1, False, 0.06),
        # one fp32 scale per token
        WireDtype(DispatchDtype.INT8, torch.int8, 8, 0, 4, 0, False, 0.03),
        # e2m1 pairs, an e4m3 scale per 16 values, and the dispatcher's global scale (FlashInfer)
        WireDtype(DispatchDtype.NVFP4, torch.uint8, 4, 16, 1, 0, True, 0.20),
    )
}


def wire_dtype(dtype: DispatchDtype) -> WireDtype:
    return WIRE_DTYPES[dtype]


__all__ = ["WIRE_DTYPES", "WireDtype", "wire_dtype"]
