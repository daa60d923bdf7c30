"""What ``moe-dispatch backends`` and ``available_backends`` show of a plugin host: one ``BackendInfo`` per backend,
probed. Loaded by the listing only (creating a dispatcher probes its one backend itself)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PluginHost = Any  # the host these read (``_registry.PluginHost``, which imports this module)


@dataclass(frozen=True)
class BackendInfo:
    """What ``moe-dispatch backends`` shows for one backend (stable JSON via ``to_dict``).

    :param status: ``available`` (runs here), ``unavailable`` (``probe()`` gave ``reason``, raised (``error`` has the
        traceback) or did not answer within the deadline; ``install_hint`` says what to install), ``broken`` (its plugin
        failed to load; ``error`` has the traceback) or ``conflict`` (two distributions register the name).
    """

    name: str
    distribution: str | None
    version: str | None
    status: str
    reason: str | None
    capabilities: dict[str, Any] | None
    install_hint: str = ""
    description: str = ""
    error: str | None = None
    #: The variables its ``probe()`` changed and left changed (reported; none of them steers dispatch).
    environ_changes: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return self.status == "available"

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "available": self.available,
                "install_hint": self.install_hint or None, "environ_changes": list(self.environ_changes)}


def backend_info(host: PluginHost, name: str, probe_timeout_s: float | None) -> BackendInfo:
    """The registered backend ``name``, probed within ``probe_timeout_s`` (None: the host's)."""
    if name in host._conflicts:
        return BackendInfo(name, None, None, "conflict", f"registered by both {host._owners(name)}", None)
    backend, record = host._backends[name]
    probed = host.probe_result(backend, timeout_s=probe_timeout_s)
    reason = probed.reason
    try:
        capabilities = backend.capabilities.to_dict()
    except Exception as exc:  # checked at registration; a property may still fail later
        return BackendInfo(name, record.distribution, record.version, "broken",
                           f"capabilities raised {type(exc).__name__}: {exc}", None)
    return BackendInfo(name=name, distribution=record.distribution, version=record.version,
                       status="available" if reason is None else "unavailable", reason=reason,
                       capabilities=capabilities, install_hint=backend.install_hint if reason is not None else "",
                       description=backend.description, error=probed.error, environ_changes=probed.environ_changes)


def list_backends(host: PluginHost, probe_timeout_s: float | None) -> list[BackendInfo]:
    """Every registered backend, then every plugin that failed to load (as broken)."""
    infos = [backend_info(host, name, probe_timeout_s) for name in host.backend_names()]
    for failed in host.failures():
        last = (failed.error or "").strip().splitlines()[-1:] or ["unknown error"]
        infos.append(BackendInfo(name=failed.name, distribution=failed.distribution, version=failed.version,
                                 status="broken", reason=f"plugin failed to load: {last[0]}", capabilities=None,
                                 error=failed.error))
    return infos
