"""The plugin host: the backends, runners and commands the plugins registered, and lookup.

Plugins load one at a time (``_loading.load_plugin``); a plugin that failed is recorded with its error and left out,
and asking for one of its backends by name raises with the original error. The built-ins load first and their
backend names are theirs alone. A ``probe()`` that raises or passes its deadline leaves its backend unavailable;
a ``create()`` that raises is a ``BackendUnavailableError`` naming the backend (``Selection.create``)."""

from __future__ import annotations

import contextlib
import difflib
import os
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, TextIO

import pluggy

from . import _hookspecs as hookspecs
from ._contract import Backend, BackendDispatcher, DispatchContext, RunnerInfo
from ._errors import BackendUnavailableError, MoEDispatchError, PluginError
from ._hookspecs import Command
from ._loading import (
    DEFAULT_IMPORT_TIMEOUT_S,
    DEFAULT_PROBE_TIMEOUT_S,
    ENV_PLUGINS,
    ENV_TRACE,
    LoadedPlugin,
    PluginRecord,
    Prober,
    ProbeResult,
    builtin_sources,
    check_probe_timeout,
    entry_point_sources,
    load_plugin,
    module_sources,
    parse_allow_list,
    put_back,
    steering,
)
from ._reference import BUILTIN_PLUGINS

if TYPE_CHECKING:
    from ._listing import BackendInfo


class PluginHost:
    """Loads built-in and entry-point plugins into one pluggy manager and keeps what they registered. Each host is
    independent; ``PluginHost.default()`` is the process's shared one.

    :param env: read once for ``MOE_DISPATCH_PLUGINS`` (a comma-separated allow-list of entry-point or distribution
        names; empty: no external plugin; unset: all; the built-ins always load) and ``MOE_DISPATCH_TRACE_PLUGINS=1``
        (trace every hook call and probe to stderr); ``os.environ`` when None, never written.
    :param extra_plugins: / :param trace: plugin modules to load besides the entry points; where to trace instead.
    :param probe_timeout_s: seconds each ``probe()`` may take (``DEFAULT_PROBE_TIMEOUT_S``); one that takes longer
        leaves its backend unavailable for the life of this host. ``math.inf`` calls ``probe()`` on the calling
        thread without a deadline, for a vendor library that must be initialised on the main thread.
    :param import_timeout_s: seconds each external plugin's import may take (``DEFAULT_IMPORT_TIMEOUT_S``); one that
        takes longer is recorded as failed. ``math.inf`` imports on the calling thread.
    """

    def __init__(self, *, env: Mapping[str, str] | None = None, load_entry_points: bool = True,
                 extra_plugins: Iterable[ModuleType] = (), trace: TextIO | None = None,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S) -> None:
        self.probe_timeout_s = check_probe_timeout(probe_timeout_s)
        import_timeout_s = check_probe_timeout(import_timeout_s, parameter="import_timeout_s")
        env = os.environ if env is None else env
        allow = parse_allow_list(env.get(ENV_PLUGINS))
        self._trace_to = trace if trace is not None else (
            sys.stderr if env.get(ENV_TRACE, "") not in ("", "0") else None)
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginRecord] = []
        self._backends: dict[str, tuple[Backend, PluginRecord]] = {}
        self._conflicts: dict[str, list[PluginRecord]] = {}
        self._runners: dict[str, tuple[RunnerInfo, PluginRecord]] = {}
        self._commands: dict[str, tuple[Command, PluginRecord]] = {}
        self.command_conflicts: dict[str, list[PluginRecord]] = {}
        self._probes: dict[str, ProbeResult] = {}  # the registered backends' answers, for the host's life
        self._prober = Prober(self._trace)
        for source in builtin_sources(BUILTIN_PLUGINS):
            self._commit(load_plugin(self.pm, source, self._trace))
        reserved = frozenset(self._backends)
        sources = module_sources(extra_plugins)
        self.allow_list_unmatched: list[str] = []
        self._installed_names: list[str] = []
        if load_entry_points:
            found, self.allow_list_unmatched, self._installed_names = entry_point_sources(allow, self._trace)
            sources += found
        loaded = [load_plugin(self.pm, source, self._trace, reserved_backends=reserved,
                              import_timeout_s=import_timeout_s) for source in sources]
        # Only now is every backend's vendor known: a plugin that changed a variable one of them reads is left out
        # (its change put back), whichever loaded first; what other changes remain is reported.
        backends = [*(b for b, _ in self._backends.values()), *(b for plugin in loaded for b in plugin.backends)]
        vendor = self._prober.vendor = frozenset(n for backend in backends for n in _vendor_environment(backend))
        for i in reversed(range(len(loaded))):
            if steered := steering(loaded[i].environ, vendor):
                put_back({name: loaded[i].environ[name] for name in steered})
                self.pm.unregister(name=loaded[i].record.name)
                loaded[i] = LoadedPlugin(loaded[i].record.failed(PluginError(
                    "the plugin changed variables a backend's vendor reads while loading (put back): they would "
                    "steer that backend unseen", parameter="os.environ", value=steered,
                    allowed="no change to a variable listed in any Backend.vendor_environment")))
        for plugin in loaded:
            self._commit(plugin)
            if plugin.record.ok and plugin.record.environ_changes:
                warnings.warn(f"moe-dispatch: plugin {plugin.record.label()} changed the environment while loading: "
                              f"{', '.join(plugin.record.environ_changes)}", RuntimeWarning, stacklevel=2)

    @staticmethod
    def default() -> "PluginHost":
        """The process's shared host (``default_host``): what ``create_dispatcher`` and ``available_backends`` use."""
        return default_host()

    def _commit(self, loaded: LoadedPlugin) -> None:
        """Keep what one plugin registered; it loaded whole or not at all (``load_plugin``)."""
        record = loaded.record
        self.plugins.append(record)
        for backend in loaded.backends:
            _claim(self._backends, self._conflicts, backend.name, backend, record)
        for runner in loaded.runners:
            self._runners[runner.name] = (runner, record)
        for command in loaded.commands:
            _claim(self._commands, self.command_conflicts, command.name, command, record)

    def failures(self) -> list[PluginRecord]:
        return [p for p in self.plugins if not p.ok]

    def backend_names(self) -> list[str]:
        return sorted({*self._backends, *self._conflicts})

    def runners(self) -> dict[str, RunnerInfo]:
        return {name: info for name, (info, _) in self._runners.items()}

    def commands(self) -> dict[str, tuple[Command, str]]:
        """The plugins' subcommands of ``moe-dispatch``, each with the label of its distribution."""
        return {name: (command, record.label()) for name, (command, record) in sorted(self._commands.items())}

    def select(self, backend: "str | Backend", *, must_run_here: bool = True) -> "Selection":
        """Everything creating a dispatcher needs from the host, asked once: the backend (looked up when given by
        name), the runners, its distribution's label, and (``must_run_here``) its probe, which raises
        ``BackendUnavailableError`` with the reason and install hint."""
        backend_obj = self.get_backend(backend) if isinstance(backend, str) else backend
        if must_run_here and (reason := self.probe(backend_obj)) is not None:
            hint = f"; {backend_obj.install_hint}" if backend_obj.install_hint else ""
            raise BackendUnavailableError(f"cannot run here: {reason}{hint}", parameter="backend",
                                          value=backend_obj.name)
        return Selection(backend_obj, self.runners(), self.label(backend_obj), self._trace)

    def get_backend(self, name: str) -> Backend:
        """The backend registered as ``name``, or a ``BackendUnavailableError`` that says why not."""
        entry = self._backends.get(name)
        if entry is not None:
            return entry[0]
        if name in self._conflicts:
            raise PluginError(f"two distributions register this backend name: {self._owners(name)}; uninstall one, "
                              f"or limit {ENV_PLUGINS} to one of them", parameter="backend", value=name)
        for failed in self.failures():
            if failed.name == name or failed.module.split(":")[0].endswith(name):
                raise BackendUnavailableError(f"the plugin {failed.label()} that provides it failed to load:\n"
                                              f"{failed.error}", parameter="backend", value=name) from failed.exception
        known = self.backend_names()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        broken = [p.name for p in self.failures()]
        extra = f"; plugins that failed to load: {', '.join(broken)}" if broken else ""
        raise BackendUnavailableError(f"unknown backend{hint}{extra}", parameter="backend", value=name,
                                      allowed=", ".join(known) or "none")

    def _owners(self, name: str) -> str:
        return " and ".join(sorted(p.label() for p in self._conflicts[name]))

    def probe(self, backend: Backend, *, timeout_s: float | None = None) -> str | None:
        """Why ``backend`` cannot run here, or None; see ``probe_result``."""
        return self.probe_result(backend, timeout_s=timeout_s).reason

    def probe_result(self, backend: Backend, *, timeout_s: float | None = None) -> ProbeResult:
        """``backend.probe()`` within ``timeout_s`` (None: this host's ``probe_timeout_s``); an exception becomes the
        reason. Cached for the registered backends, a timeout included, so a probe that hangs costs one deadline per
        host; another object with the same name is probed on its own."""
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
        if result.environ_changes:
            warnings.warn(f"moe-dispatch: backend {backend.name!r}'s probe() changed the environment: "
                          f"{', '.join(result.environ_changes)}", RuntimeWarning, stacklevel=2)
        return result

    def label(self, backend: Backend) -> str:
        """"distribution version" of the plugin that registered ``backend`` (its module otherwise)."""
        registered = self._backends.get(backend.name)
        if registered is not None and registered[0] is backend:
            return registered[1].label()
        return type(backend).__module__.split(".")[0]

    def info(self, name: str, *, probe_timeout_s: float | None = None) -> "BackendInfo":
        from ._listing import backend_info  # what ``moe-dispatch backends`` shows: not on creation's path
        return backend_info(self, name, probe_timeout_s)

    def allow_list_suggestion(self, name: str) -> str | None:
        """The installed plugin or distribution name nearest to an unmatched ``MOE_DISPATCH_PLUGINS`` entry."""
        near = difflib.get_close_matches(name, self._installed_names, n=1)
        return near[0] if near else None

    def available_backends(self, *, probe_timeout_s: float | None = None) -> list["BackendInfo"]:
        """Every registered backend, then every plugin that failed to load (as broken). Probes run one after another,
        each within ``probe_timeout_s`` (None: the host's): at most backends × deadline, whatever the plugins do."""
        from ._listing import list_backends
        return list_backends(self, probe_timeout_s)

    def _trace(self, message: str) -> None:
        if self._trace_to is not None:
            print(f"moe-dispatch trace: {message}", file=self._trace_to, flush=True)


def _vendor_environment(backend: Backend) -> tuple[str, ...]:
    names = getattr(backend, "vendor_environment", ())
    return tuple(n for n in names if isinstance(n, str)) if isinstance(names, (tuple, list, frozenset, set)) else ()


@dataclass(frozen=True)
class Selection:
    """One backend taken from a host with what creation needs from it (``PluginHost.select``)."""

    backend: Backend
    runners: Mapping[str, RunnerInfo]
    label: str  # "distribution version" of the plugin that registered it
    trace: Callable[[str], None] = lambda message: None

    def create(self, ctx: DispatchContext) -> BackendDispatcher:
        """``backend.create(ctx)``, its untyped exceptions (a vendor library failing to initialise, a plugin bug) as
        ``typed_errors`` makes them, so the engine can report one and choose another backend."""
        with self.typed_errors("create()"):
            return self.backend.create(ctx)

    @contextlib.contextmanager
    def typed_errors(self, where: str) -> Iterator[None]:
        """Inside: an untyped exception from the backend's code becomes ``BackendUnavailableError`` naming the
        backend, its distribution and ``where``, chained to the original; a typed error passes as it is."""
        try:
            yield
        except MoEDispatchError:
            raise
        except Exception as exc:
            name = self.backend.name
            self.trace(f"{where} {name} ({self.label}) FAILED: {type(exc).__name__}: {exc}")
            raise BackendUnavailableError(f"backend {name!r} from {self.label} failed in {where}: "
                                          f"{type(exc).__name__}: {exc}", parameter="backend", value=name) from exc


def _claim(owned: dict[str, tuple[Any, PluginRecord]], conflicts: dict[str, list[PluginRecord]], name: str,
           item: Any, record: PluginRecord) -> None:
    """Give ``name`` to ``record``'s ``item``; a name two modules register belongs to neither."""
    if name in conflicts:
        conflicts[name].append(record)
        return
    existing = owned.get(name)
    if existing is not None and existing[1].module != record.module:
        del owned[name]
        conflicts[name] = [existing[1], record]
        return
    owned[name] = (item, record)


_DEFAULT: PluginHost | None = None


def default_host() -> PluginHost:
    """The process's plugin host, created on first use from ``os.environ``."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PluginHost()
    return _DEFAULT


def available_backends(*, probe_timeout_s: float | None = None) -> list["BackendInfo"]:
    """Every backend the default host knows, with availability and the reason; each probe not yet cached gets
    ``probe_timeout_s`` (None: ``DEFAULT_PROBE_TIMEOUT_S``)."""
    return default_host().available_backends(probe_timeout_s=probe_timeout_s)
