"""Typed errors. Every message names the parameter, the value seen and what is allowed."""

from __future__ import annotations

import sys
from typing import Any


class MoEDispatchError(Exception):
    """Base class of every error this library raises on purpose.

    ``parameter``, ``value`` and ``allowed`` are kept as attributes so an engine can turn them into its own flag
    names; ``str()`` reads as one sentence. Pickled (to another process), a tensor ``value`` becomes its description.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None,
                 allowed: str | None = None) -> None:
        self.parameter, self.value, self.allowed = parameter, value, allowed
        text = message if parameter is None else f"{parameter}={_short(value)}: {message}"
        super().__init__(f"{text}; allowed: {allowed}" if allowed else text)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Keep the attributes across processes; a tensor value travels as its description, not its data (a refused
        # batch's activations would otherwise be pickled to every rank that reports the error).
        state = dict(self.__dict__)
        if _is_tensor(state.get("value")):
            state["value"] = _short(state["value"])
        return (_restore, (type(self), self.args, state))


def _restore(cls: type, args: tuple, state: dict) -> "MoEDispatchError":  # type: ignore[type-arg]
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # this module must not import torch (_torch_import uses it first)
    return torch is not None and isinstance(value, torch.Tensor)


def _short(value: Any) -> str:
    if _is_tensor(value):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class InvalidSpecError(MoEDispatchError, ValueError):
    """A ``DispatchSpec`` (or a CLI flag that builds one) is inconsistent."""


class InvalidInputError(MoEDispatchError, ValueError):
    """A tensor handed to dispatch, combine or the experts has the wrong shape, dtype, device or values. Raised
    before any data is touched or any collective entered."""


class UnsupportedDtypeError(MoEDispatchError):
    """The backend rejects the wire dtype, or a fallback happened under ``strict=True``."""


class CapacityError(MoEDispatchError):
    """A batch or a spec exceeds ``num_max_dispatch_tokens_per_rank`` or a backend limit (hidden size, top-k, bytes)."""


class BackendUnavailableError(MoEDispatchError):
    """The backend is unknown, its plugin failed to load, or it cannot run here."""


class PluginError(MoEDispatchError):
    """A plugin is malformed: misspelt hook, incompatible API version, duplicate name."""


class ConfigMismatchError(MoEDispatchError):
    """Ranks of one group were configured differently."""


class CommunicationError(MoEDispatchError, RuntimeError):
    """A collective failed or timed out, usually because another rank failed or stalled."""


class PeerFailedError(CommunicationError):
    """Another rank of the group raised (bad input on that rank, a bug, a vendor error) while this one waited for it
    in a collective. ``rank`` is the failed rank, ``reason`` its error. The process group is unusable: rebuild it."""

    def __init__(self, message: str, *, rank: int, reason: str, operation: str) -> None:
        super().__init__(message)
        self.rank, self.reason, self.operation = rank, reason, operation


class CallOrderError(CommunicationError):
    """The ranks of a group reached different calls: another dispatcher, dispatch against combine, or another call
    number of the same dispatcher. Raised on every rank at the first exchange of the call, before any data moves.
    ``calls`` is each rank's call, in rank order, as ``(dispatcher uid, phase, number)``, and ``refused`` how many
    calls each rank had refused before it (ranks that refused a call alone differ there even at the same number).
    The dispatcher is unusable afterwards (its ranks disagree on how many calls were made): create it again."""

    def __init__(self, message: str, *, calls: tuple[tuple[str, str, int], ...],
                 refused: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.calls, self.refused = calls, refused


class CollectiveTimeoutError(CommunicationError):
    """A collective did not complete within the dispatcher's ``timeout_s``. ``ranks`` are the ranks that never
    arrived (stalled or dead) when that could be established, else empty. The process group is unusable: rebuild it."""

    def __init__(self, message: str, *, ranks: tuple[int, ...], operation: str, timeout_s: float) -> None:
        super().__init__(message, parameter="timeout_s", value=timeout_s)
        self.ranks, self.operation, self.timeout_s = ranks, operation, timeout_s
