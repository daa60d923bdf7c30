"""The plugin host: finds backends through entry points, one plugin at a time.

A plugin that fails to import, declares an unsupported API version, implements a hook
that does not exist, or raises while registering is recorded with its error and left out;
the others load. Asking for one of its backends by name raises with the original error.

Probes run with a deadline (``probe_timeout_s``, default ``DEFAULT_PROBE_TIMEOUT_S``): a
``probe()`` that hangs (a driver that never answers, a vendor import stuck on a lock) makes
its backend unavailable, "probe did not answer within X s", instead of stalling the engine's
start-up. A probe that raises makes its backend unavailable with the error. A ``create()``
that raises is a ``BackendUnavailableError`` naming the backend (``PluginHost.call_create``).

Environment (read once, when a host is created; never written):

- ``MOE_DISPATCH_PLUGINS``: comma-separated allow-list of entry-point or distribution
  names; empty loads no external plugin; unset loads all. Built-in backends always load.
- ``MOE_DISPATCH_TRACE_PLUGINS=1``: trace every hook call and probe to stderr.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, Mapping, TextIO

import pluggy

from . import hookspecs
from .backend import Backend, BackendDispatcher, DispatchContext, RunnerInfo
from .reference import BUILTIN_PLUGINS
from .errors import BackendUnavailableError, MoEDispatchError, PluginError
from .probes import DEFAULT_PROBE_TIMEOUT_S, Prober, ProbeResult, check_probe_timeout

ENTRY_POINT_GROUP = "moe_dispatch.backends"
ENV_PLUGINS = "MOE_DISPATCH_PLUGINS"
ENV_TRACE = "MOE_DISPATCH_TRACE_PLUGINS"
_HOOK_NAMES = ("moe_dispatch_register_backends", "moe_dispatch_register_runners")



def core_version() -> str:
    try:
        return metadata.version("moe-dispatch")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


@dataclass(frozen=True)
class PluginRecord:
    """One plugin module: where it came from and, if it failed, why."""

    name: str
    module: str
    distribution: str | None
    version: str | None
    builtin: bool = False
    error: str | None = None
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def label(self) -> str:
        dist = self.distribution or self.module
        return f"{dist} {self.version}" if self.version else dist


@dataclass(frozen=True)
class BackendInfo:
    """What ``moe-dispatch backends`` shows for one backend (stable JSON via ``to_dict``).

    :param status: ``available`` (runs here), ``unavailable`` (``probe()`` gave ``reason``,
        raised (``error`` has the traceback) or did not answer within the deadline;
        ``install_hint`` says what to install), ``broken`` (its plugin failed to load;
        ``error`` has the traceback) or ``conflict`` (two distributions register the name).
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

    @property
    def available(self) -> bool:
        return self.status == "available"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "available": self.available,
            "reason": self.reason,
            "install_hint": self.install_hint or None,
            "description": self.description,
            "capabilities": self.capabilities,
            "error": self.error,
        }


class PluginHost:
    """Loads built-in and entry-point plugins into one pluggy manager and keeps what they
    registered. Each host is independent; ``default_host()`` is the process's shared one.

    :param probe_timeout_s: seconds each ``probe()`` may take (``DEFAULT_PROBE_TIMEOUT_S``);
        one that takes longer leaves its backend unavailable for the life of this host.
        ``math.inf`` calls ``probe()`` on the calling thread without a deadline, for a vendor
        library that must be initialised on the main thread.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        load_entry_points: bool = True,
        extra_plugins: Iterable[ModuleType] = (),
        trace: TextIO | None = None,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> None:
        self.probe_timeout_s = check_probe_timeout(probe_timeout_s)
        env = os.environ if env is None else env
        self._allow = _parse_allow_list(env.get(ENV_PLUGINS))
        self._trace_to = trace if trace is not None else (sys.stderr if env.get(ENV_TRACE, "") not in ("", "0") else None)
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginRecord] = []
        self._backends: dict[str, tuple[Backend, PluginRecord]] = {}
        self._conflicts: dict[str, list[PluginRecord]] = {}
        self._runners: dict[str, tuple[RunnerInfo, PluginRecord]] = {}
        self._probes: dict[str, ProbeResult] = {}  # the registered backends' answers, for the host's life
        self._prober = Prober(self._trace)
        self.allow_list_unmatched: list[str] = []
        version = core_version()
        for module_name in BUILTIN_PLUGINS:
            record = PluginRecord(module_name, module_name, "moe-dispatch", version, builtin=True)
            self._add(record, lambda m=module_name: importlib.import_module(m))
        for module in extra_plugins:
            record = PluginRecord(module.__name__, module.__name__, None, None)
            self._add(record, lambda m=module: m)
        if load_entry_points:
            self._load_entry_points()

    # -- loading ------------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        seen: set[str] = set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            if self._allow is not None and ep.name not in self._allow and (dist or "") not in self._allow:
                self._trace(f"skip {ep.name} ({dist}): not in {ENV_PLUGINS}")
                continue
            seen.update({ep.name, dist or ""})
            record = PluginRecord(ep.name, ep.value, dist, version)
            self._add(record, ep.load)
        if self._allow is not None:
            self.allow_list_unmatched = sorted(self._allow - seen)

    def _add(self, record: PluginRecord, load: Callable[[], Any]) -> None:
        """Import, check and register one plugin, then run its hooks; any failure leaves
        nothing of it behind and is kept on the record."""
        started = time.perf_counter()
        registered: list[str] = []
        runners: list[str] = []
        module = None
        try:
            module = load()
            _check_api(record, module)
            self.pm.register(module, name=record.name)
            _check_hook_names(record, self.pm, module)
            self._run_hooks(record, module, registered, runners)
        except Exception as exc:  # one bad plugin must not stop the others
            for name in registered:
                self._unregister_backend(name, record)
            for name in runners:
                self._runners.pop(name, None)
            if module is not None and self.pm.is_registered(module):
                self.pm.unregister(module)
            error = "".join(traceback.format_exception(exc)).rstrip()
            self.plugins.append(
                PluginRecord(record.name, record.module, record.distribution, record.version, record.builtin, error, exc)
            )
            self._trace(f"plugin {record.label()} FAILED: {type(exc).__name__}: {exc}")
            return
        self.plugins.append(record)
        elapsed = (time.perf_counter() - started) * 1e3
        self._trace(f"plugin {record.label()} loaded in {elapsed:.1f} ms: backends {registered}, runners {runners}")

    def _run_hooks(self, record: PluginRecord, module: Any, backends: list[str], runners: list[str]) -> None:
        def register_backend(backend: Backend) -> None:
            if not isinstance(backend, Backend) or not getattr(backend, "name", ""):
                raise PluginError(
                    "register() takes a named moe_dispatch.Backend instance",
                    parameter="backend",
                    value=backend,
                    allowed="an instance of a moe_dispatch.Backend subclass with a non-empty name",
                )
            self._register_backend(backend, record)
            backends.append(backend.name)

        def register_runner(runner: RunnerInfo) -> None:
            if not isinstance(runner, RunnerInfo):
                raise PluginError(
                    "register() takes a moe_dispatch.RunnerInfo", parameter="runner", value=runner, allowed="RunnerInfo"
                )
            self._runners[runner.name] = (runner, record)
            runners.append(runner.name)

        callbacks = {"moe_dispatch_register_backends": register_backend, "moe_dispatch_register_runners": register_runner}
        for hook_name in _HOOK_NAMES:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin is module:
                    self._trace(f"call {record.name}.{hook_name}(register)")
                    impl.function(register=callbacks[hook_name])

    def _register_backend(self, backend: Backend, record: PluginRecord) -> None:
        name = backend.name
        if name in self._conflicts:
            self._conflicts[name].append(record)
            return
        existing = self._backends.get(name)
        if existing is not None and existing[1].module != record.module:
            del self._backends[name]
            self._conflicts[name] = [existing[1], record]
            return
        self._backends[name] = (backend, record)

    def _unregister_backend(self, name: str, record: PluginRecord) -> None:
        entry = self._backends.get(name)
        if entry is not None and entry[1] is record:
            del self._backends[name]
        owners = self._conflicts.get(name)
        if owners and record in owners:
            owners.remove(record)
            if len(owners) == 1:
                survivor = owners[0]
                del self._conflicts[name]
                self._trace(f"conflict on {name!r} resolved: only {survivor.label()} remains, but it must register again")

    # -- queries ------------------------------------------------------------------------------

    def failures(self) -> list[PluginRecord]:
        return [p for p in self.plugins if not p.ok]

    def backend_names(self) -> list[str]:
        return sorted({*self._backends, *self._conflicts})

    def runners(self) -> dict[str, RunnerInfo]:
        return {name: info for name, (info, _) in self._runners.items()}

    def get_backend(self, name: str) -> Backend:
        """The backend registered as ``name``, or a ``BackendUnavailableError`` that says why not."""
        entry = self._backends.get(name)
        if entry is not None:
            return entry[0]
        if name in self._conflicts:
            owners = self._owners(name)
            raise PluginError(
                f"two distributions register this backend name: {owners}; uninstall one, or limit "
                f"{ENV_PLUGINS} to one of them",
                parameter="backend",
                value=name,
            )
        for failed in self.failures():
            if failed.name == name or failed.module.split(":")[0].endswith(name):
                raise BackendUnavailableError(
                    f"the plugin {failed.label()} that provides it failed to load:\n{failed.error}",
                    parameter="backend",
                    value=name,
                ) from failed.exception
        known = self.backend_names()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        broken = [p.name for p in self.failures()]
        extra = f"; plugins that failed to load: {', '.join(broken)}" if broken else ""
        raise BackendUnavailableError(
            f"unknown backend{hint}{extra}", parameter="backend", value=name, allowed=", ".join(known) or "none"
        )

    def _owners(self, name: str) -> str:
        return " and ".join(sorted(p.label() for p in self._conflicts[name]))

    def probe(self, backend: Backend, *, timeout_s: float | None = None) -> str | None:
        """Why ``backend`` cannot run here, or None; see ``probe_result``."""
        return self.probe_result(backend, timeout_s=timeout_s).reason

    def probe_result(self, backend: Backend, *, timeout_s: float | None = None) -> ProbeResult:
        """``backend.probe()`` within ``timeout_s`` (None: this host's ``probe_timeout_s``).

        Cached for the registered backends, a timeout included, so a probe that hangs costs
        one deadline per host, not one per call; another object with the same name (e.g. one
        driving an emulator) is probed on its own. An exception becomes the reason.
        """
        registered = self._backends.get(backend.name)
        is_registered = registered is not None and registered[0] is backend
        if is_registered and backend.name in self._probes:
            return self._probes[backend.name]
        deadline = self.probe_timeout_s if timeout_s is None else check_probe_timeout(timeout_s)
        result = self._prober.run(backend, deadline)
        detail = f"did not answer within {deadline:g} s" if result.timed_out else (result.reason or "available")
        self._trace(f"probe {backend.name}: {detail} ({result.seconds * 1e3:.1f} ms)")
        if is_registered:
            self._probes[backend.name] = result
        return result

    def call_create(self, backend: Backend, ctx: DispatchContext) -> BackendDispatcher:
        """``backend.create(ctx)``. A typed error from it passes through as it is; any other
        exception (a vendor library failing to initialise, a bug in the plugin) becomes a
        ``BackendUnavailableError`` naming the backend and its distribution, chained to the
        original, so the engine can report it and choose another backend."""
        with self.typed_errors(backend, "create()"):
            return backend.create(ctx)

    @contextlib.contextmanager
    def typed_errors(self, backend: Backend, where: str) -> Iterator[None]:
        """Inside: an untyped exception from the backend's code becomes ``BackendUnavailableError``
        naming the backend, its distribution and ``where``, chained to the original (what
        ``create_dispatcher`` reports to the peers and the engine)."""
        try:
            yield
        except MoEDispatchError:
            raise
        except Exception as exc:
            label = self.label(backend)
            self._trace(f"{where} {backend.name} ({label}) FAILED: {type(exc).__name__}: {exc}")
            raise BackendUnavailableError(
                f"backend {backend.name!r} from {label} failed in {where}: {type(exc).__name__}: {exc}",
                parameter="backend",
                value=backend.name,
            ) from exc

    def label(self, backend: Backend) -> str:
        """"distribution version" of the plugin that registered ``backend`` (its module otherwise)."""
        registered = self._backends.get(backend.name)
        if registered is not None and registered[0] is backend:
            return registered[1].label()
        return type(backend).__module__.split(".")[0]

    def info(self, name: str, *, probe_timeout_s: float | None = None) -> BackendInfo:
        if name in self._conflicts:
            owners = self._owners(name)
            return BackendInfo(name, None, None, "conflict", f"registered by both {owners}", None)
        backend, record = self._backends[name]
        probed = self.probe_result(backend, timeout_s=probe_timeout_s)
        reason = probed.reason
        return BackendInfo(
            name=name,
            distribution=record.distribution,
            version=record.version,
            status="available" if reason is None else "unavailable",
            reason=reason,
            capabilities=backend.capabilities.to_dict(),
            install_hint=backend.install_hint if reason is not None else "",
            description=backend.description,
            error=probed.error,
        )

    def available_backends(self, *, probe_timeout_s: float | None = None) -> list[BackendInfo]:
        """Every registered backend, then every plugin that failed to load (as broken).

        Probes run one after another, each within ``probe_timeout_s`` (None: the host's), so
        this returns within (number of backends) × the deadline whatever the plugins do.
        """
        infos = [self.info(name, probe_timeout_s=probe_timeout_s) for name in self.backend_names()]
        for failed in self.failures():
            last = (failed.error or "").strip().splitlines()[-1:] or ["unknown error"]
            infos.append(
                BackendInfo(
                    name=failed.name,
                    distribution=failed.distribution,
                    version=failed.version,
                    status="broken",
                    reason=f"plugin failed to load: {last[0]}",
                    capabilities=None,
                    error=failed.error,
                )
            )
        return infos

    def _trace(self, message: str) -> None:
        if self._trace_to is not None:
            print(f"moe-dispatch trace: {message}", file=self._trace_to, flush=True)


def _parse_allow_list(raw: str | None) -> set[str] | None:
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _check_api(record: PluginRecord, module: Any) -> None:
    declared = getattr(module, "MOE_DISPATCH_API", None)
    if declared is None:
        raise PluginError(
            f"plugin {record.label()} does not declare MOE_DISPATCH_API; add `MOE_DISPATCH_API = "
            f"{hookspecs.API_VERSION}` to {record.module.split(':')[0]}",
            parameter="MOE_DISPATCH_API",
            value=None,
            allowed=", ".join(map(str, sorted(hookspecs.SUPPORTED_API_VERSIONS))),
        )
    if declared not in hookspecs.SUPPORTED_API_VERSIONS:
        raise PluginError(
            f"plugin {record.label()} was written for core API {declared}, but moe-dispatch {core_version()} "
            f"implements API {hookspecs.API_VERSION}; install a plugin release built for it",
            parameter="MOE_DISPATCH_API",
            value=declared,
            allowed=", ".join(map(str, sorted(hookspecs.SUPPORTED_API_VERSIONS))),
        )


def _check_hook_names(record: PluginRecord, pm: pluggy.PluginManager, module: Any) -> None:
    """pluggy's ``check_pending`` for this plugin alone: a hookimpl without a spec is a typo."""
    for caller in pm.get_hookcallers(module) or []:
        if caller.spec is None:
            close = difflib.get_close_matches(caller.name, list(_HOOK_NAMES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise PluginError(
                f"plugin {record.label()} implements a hook that does not exist{hint}",
                parameter="hook",
                value=caller.name,
                allowed=", ".join(_HOOK_NAMES),
            )


_DEFAULT: PluginHost | None = None


def default_host() -> PluginHost:
    """The process's plugin host, created on first use from ``os.environ``."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PluginHost()
    return _DEFAULT


def available_backends(*, probe_timeout_s: float | None = None) -> list[BackendInfo]:
    """Every backend the default host knows, with availability and the reason; each probe
    not yet cached gets ``probe_timeout_s`` (None: ``DEFAULT_PROBE_TIMEOUT_S``)."""
    return default_host().available_backends(probe_timeout_s=probe_timeout_s)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name`` in the default host."""
    return default_host().get_backend(name)


__all__ = [
    "DEFAULT_PROBE_TIMEOUT_S",
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "PluginHost",
    "PluginRecord",
    "ProbeResult",
    "available_backends",
    "default_host",
    "get_backend",
]
