"""The record of a wire-dtype choice (``Resolution``, written by ``_resolution``): every source consulted and what
became of it. ``Dispatcher.resolution`` shows it, ``DispatchContext.resolution`` carries it to a backend."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ._wire import DispatchDtype


class DtypeFallbackWarning(UserWarning):
    """The backend replaced the requested wire dtype by another one."""


@dataclass(frozen=True)
class Step:
    """One consulted source: what it said and what became of it."""

    source: str
    value: str
    note: str
    decided: bool = False

    def __str__(self) -> str:
        return f"{'→' if self.decided else ' '} {self.source:<34} {self.value:<8} {self.note}"


@dataclass(frozen=True)
class Resolution:
    """The chosen wire dtype and how it was chosen.

    :param dtype: what crosses the wire.
    :param requested: what the chain chose before the backend validated it.
    :param steps: every source consulted, in order, and the validation.
    :param fallback_reason: set when the backend replaced ``requested``.
    """

    dtype: DispatchDtype
    requested: DispatchDtype
    backend: str
    steps: tuple[Step, ...]
    fallback_reason: str | None = None

    @property
    def is_fallback(self) -> bool:
        return self.fallback_reason is not None

    def __str__(self) -> str:
        head = f"wire dtype {self.dtype.value} for backend {self.backend!r}"
        if self.is_fallback:
            head += f" (fallback from {self.requested.value})"
        return "\n".join([head, *(f"  {s}" for s in self.steps)])

    def to_dict(self) -> dict[str, object]:
        return {"dtype": self.dtype.value, "requested": self.requested.value, "backend": self.backend,
                "fallback_reason": self.fallback_reason, "steps": [asdict(s) for s in self.steps]}
