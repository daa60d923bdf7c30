"""Typed hints a layer's quantization method gives the dispatcher (instead of a dict)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .codecs import check_global_scale
from .dtypes import DispatchDtype
from .errors import InvalidSpecError


@dataclass(frozen=True)
class QuantHints:
    """What the quantization method of a layer tells the dispatcher.

    :param dispatcher_output_dtype: the wire dtype the layer's expert kernel needs
        (e.g. INT8 for W8A8, BF16 for W4A16); None lets later steps decide.
    :param input_global_scale: NVFP4 activation global scale (FlashInfer: 448·6/amax).
        Its presence asks for NVFP4 dispatch.
    :param fp8_ue8m0_scales: FP8 scales rounded to powers of two and sent as one exponent
        byte (DeepGEMM on Blackwell wants UE8M0).
    """

    dispatcher_output_dtype: DispatchDtype | None = None
    input_global_scale: float | None = None
    fp8_ue8m0_scales: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "dispatcher_output_dtype",
            DispatchDtype.parse(self.dispatcher_output_dtype, "quant.dispatcher_output_dtype"),
        )
        if self.input_global_scale is not None:
            object.__setattr__(
                self, "input_global_scale", check_global_scale(self.input_global_scale, "quant.input_global_scale")
            )
        if not isinstance(self.fp8_ue8m0_scales, bool):
            raise InvalidSpecError(
                "must be a bool", parameter="quant.fp8_ue8m0_scales", value=self.fp8_ue8m0_scales, allowed="True, False"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QuantHints":
        """Build from the dict an engine's quant method used to hand over; an unknown key
        is an error with the nearest known key suggested."""
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {close[0]}?" if close else "no similar key"
                raise InvalidSpecError(
                    f"unknown quant hint ({hint})", parameter="quant", value=key, allowed=", ".join(known)
                )
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return {
            "dispatcher_output_dtype": None if self.dispatcher_output_dtype is None else self.dispatcher_output_dtype.value,
            "input_global_scale": self.input_global_scale,
            "fp8_ue8m0_scales": self.fp8_ue8m0_scales,
        }


__all__ = ["QuantHints"]
