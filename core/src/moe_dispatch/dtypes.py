"""The wire dtypes, dispatch modes and output layouts."""

from __future__ import annotations

import enum

from .errors import InvalidSpecError


class DispatchDtype(str, enum.Enum):
    """What the activations are when they cross the wire to the experts."""

    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    NVFP4 = "nvfp4"

    @classmethod
    def parse(cls, value: "str | DispatchDtype | None", parameter: str = "output_dtype") -> "DispatchDtype | None":
        """``"auto"`` (or None) gives None, meaning "let resolution decide"."""
        if value is None or isinstance(value, DispatchDtype):
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return None
        for member in cls:
            if member.value == text:
                return member
        raise InvalidSpecError(
            "unknown dispatch dtype",
            parameter=parameter,
            value=value,
            allowed="auto, " + ", ".join(m.value for m in cls),
        )

    def __str__(self) -> str:
        return self.value


class Mode(str, enum.Enum):
    """Normal mode sizes exchanges from the batch (one host sync); low-latency mode uses
    fixed capacity slots, needs no host sync and can be captured in a CUDA graph."""

    NORMAL = "normal"
    LOW_LATENCY = "low_latency"

    @classmethod
    def parse(cls, value: "str | Mode", parameter: str = "mode") -> "Mode":
        if isinstance(value, Mode):
            return value
        text = str(value).strip().lower().replace("-", "_")
        for member in cls:
            if member.value == text:
                return member
        raise InvalidSpecError(
            "unknown dispatch mode", parameter=parameter, value=value, allowed="normal, low_latency"
        )

    def __str__(self) -> str:
        return self.value


class Layout(str, enum.Enum):
    """PACKED: ``[rows, H]``, rows per (token, local expert) grouped by expert.
    MASKED: ``[E_local, capacity * world_size, H]``; expert ``e`` has ``group_list``-many
    valid rows at the front, the rest is padding."""

    PACKED = "packed"
    MASKED = "masked"

    def __str__(self) -> str:
        return self.value


__all__ = ["DispatchDtype", "Layout", "Mode"]
