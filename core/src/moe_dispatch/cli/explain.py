"""What the commands check before any rank starts: ``create_dispatcher``'s own preparation of a spec, so that
``explain`` shows, and ``demo``/``bench`` refuse in one line, exactly what a dispatcher would refuse."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Mapping

from .._registry import PluginHost, default_host
from .._resolution import PreparedLayer, prepare_layer
from .._trail import DtypeFallbackWarning
from ..planning import device_here

if TYPE_CHECKING:
    from .._contract import Backend
    from .._spec import DispatchSpec


def explain(spec: "DispatchSpec", backend: "str | Backend", world_size: int, *, strict: bool = False,
            host: PluginHost | None = None, env: "Mapping[str, str] | None" = None) -> "PreparedLayer":
    """What ``moe-dispatch explain`` shows: ``create_dispatcher``'s own ``prepare_layer`` (the buffers against the
    memory of the device the backend would run on here), its typed errors; a dtype fallback is on the trail instead."""
    chosen = (host or default_host()).select(backend, must_run_here=False)  # explain works for any backend
    with warnings.catch_warnings():  # the trail shows the fallback
        warnings.simplefilter("ignore", DtypeFallbackWarning)
        return prepare_layer(chosen.backend, spec, world_size, runners=chosen.runners, env=env, strict=strict,
                             device=device_here(chosen.backend))


__all__ = ["explain"]
