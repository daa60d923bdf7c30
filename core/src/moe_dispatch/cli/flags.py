"""The spellings every subcommand accepts for dtypes, modes and counts, argparse's one-line error otherwise. Dtypes
and modes go through ``DispatchDtype.parse``/``Mode.parse`` (any case; ``low-latency`` or ``low_latency``)."""

from __future__ import annotations

import argparse

from .._errors import InvalidSpecError
from .._wire import DispatchDtype, Mode

DTYPES = ", ".join(d.value for d in DispatchDtype)
MODES = ", ".join(m.value for m in Mode)


def dtype(text: str) -> str:
    """A wire dtype (``bf16``, ``FP8``, ...), as its canonical value."""
    value = dtype_or_auto(text)
    if value == "auto":
        raise argparse.ArgumentTypeError(f"'auto' is not allowed here (one of: {DTYPES})")
    return value


def dtype_or_auto(text: str) -> str:
    """A wire dtype or ``auto`` (let the resolution decide)."""
    try:
        parsed = DispatchDtype.parse(text)
    except InvalidSpecError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype (one of: auto, {DTYPES})") from None
    return "auto" if parsed is None else parsed.value


def mode(text: str) -> str:
    """``normal`` or ``low_latency`` (``low-latency`` too), as its canonical value."""
    try:
        return Mode.parse(text).value
    except InvalidSpecError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mode (one of: {MODES})") from None


def positive_int(text: str) -> int:
    """A count (ranks, tokens, sizes): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: must be at least 1")
    return value


__all__ = ["DTYPES", "MODES", "dtype", "dtype_or_auto", "mode", "positive_int"]
