"""Loading plugins one at a time (``load_plugin``), and probing their backends within deadlines (``Prober``), for the
plugin host (``_registry``). A plugin or probe that changes ``MOE_DISPATCH_*`` variables has them put back and fails."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
import threading
import time
import traceback
from concurrent.futures import Future, TimeoutError
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

import pluggy

from . import _hookspecs as hookspecs
from ._contract import Backend, Capabilities, RunnerInfo
from ._errors import PluginError
from ._hookspecs import Command

#: Seconds one ``probe()`` may take before its backend is reported unavailable. Generous: a cold CUDA or NPU driver
#: initialisation, or importing a large vendor library, on a loaded machine takes seconds; longer is stuck, not slow.
DEFAULT_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ProbeResult:
    """One ``probe()`` answer: ``reason`` is None when the backend runs here; ``error`` the traceback when it
    raised; ``timed_out`` when it did not answer within the deadline (``Prober``)."""

    reason: str | None
    seconds: float
    error: str | None = None
    timed_out: bool = False
    #: The variables ``probe()`` changed and left changed (none of them steers dispatch): reported.
    environ_changes: tuple[str, ...] = ()


#: Prefixes of the variables that steer every backend (this library's, and the sglang ones the resolution reads): a
#: plugin may not change them; nor the variables a registered backend's vendor reads (``Backend.vendor_environment``).
STEERING_PREFIXES = ("MOE_DISPATCH_", "SGLANG_DEEPEP_")


def environ_changes(before: Mapping[str, str]) -> dict[str, str | None]:
    """The variables set, changed or unset since ``before``, each with its value then (None: unset)."""
    now = os.environ
    return {k: before.get(k) for k in sorted({*before, *now}) if before.get(k) != now.get(k)}


def put_back(changes: Mapping[str, str | None]) -> None:
    """Each variable of ``changes`` back to its value before."""
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def steering(names: Iterable[str], vendor: frozenset[str] = frozenset()) -> list[str]:
    """The names among ``names`` that steer dispatch: ``STEERING_PREFIXES``, or one a backend's vendor reads."""
    return [n for n in names if n.startswith(STEERING_PREFIXES) or n in vendor]


def call_probe(backend: Backend, started: float, vendor: frozenset[str] = frozenset()) -> ProbeResult:
    """``backend.probe()``, its answer checked; a change to a steering variable (``steering``, with ``vendor``: the
    variables the registered backends' vendors read) is put back and makes the backend unavailable, any other
    change is kept and reported (``ProbeResult.environ_changes``)."""
    before = dict(os.environ)
    try:
        reason = backend.probe()
    except Exception as exc:  # a probe that raises is a reason, not a crash
        error = "".join(traceback.format_exception(exc)).rstrip()
        put_back(environ_changes(before))
        return ProbeResult(f"probe() raised {type(exc).__name__}: {exc}", time.perf_counter() - started, error)
    changes = environ_changes(before)
    if steered := steering(changes, vendor):
        put_back(changes)
        return ProbeResult(f"probe() changed the environment ({', '.join(steered)}; put back): these variables steer "
                           "dispatch (moe-dispatch's, sglang's, or read by a backend's vendor), a plugin must not set "
                           "them", time.perf_counter() - started)
    if reason is not None and not isinstance(reason, str):
        return ProbeResult(f"probe() returned {type(reason).__name__}, not None or a reason (str)",
                           time.perf_counter() - started)
    return ProbeResult(reason, time.perf_counter() - started, environ_changes=tuple(changes))


def check_probe_timeout(value: object, parameter: str = "probe_timeout_s") -> float:
    """``value`` as a deadline in seconds, or a ``PluginError`` naming ``parameter``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise PluginError("the deadline must be a positive number of seconds", parameter=parameter, value=value,
                          allowed="a number > 0, or math.inf to call the plugin on the calling thread, no deadline")
    return float(value)


class Prober:
    """Runs probes within deadlines, each on a daemon thread, so a probe that hangs (a driver that never answers, a
    vendor import stuck on a lock) costs one deadline instead of stalling an engine's start-up. A probe still
    running past its deadline is kept (by ``id(backend)``), so asking again waits for the same call instead of
    starting another thread; ``trace`` gets a line when it answers late, which tells how far to raise the deadline."""

    def __init__(self, trace: Callable[[str], None]) -> None:
        self._trace = trace
        self._running: dict[int, tuple[Backend, Future[ProbeResult], float]] = {}
        #: The variables the registered backends' vendors read (set by the host once every plugin has loaded).
        self.vendor: frozenset[str] = frozenset()

    def run(self, backend: Backend, deadline: float) -> ProbeResult:
        """``backend.probe()`` within ``deadline`` seconds (``math.inf``: on this thread)."""
        if math.isinf(deadline):
            return call_probe(backend, time.perf_counter(), self.vendor)
        entry = self._running.pop(id(backend), None)
        if entry is None or entry[0] is not backend:
            entry = (backend, Future(), time.perf_counter())
            threading.Thread(target=lambda b, f, t: f.set_result(call_probe(b, t, self.vendor)), args=entry,
                             daemon=True, name=f"moe-dispatch-probe-{backend.name}").start()
        try:
            return entry[1].result(deadline)
        except TimeoutError:
            if id(backend) not in self._running:  # the first time it is given up on: trace its late answer
                entry[1].add_done_callback(lambda f, t=entry[2]: self._trace(
                    f"probe {backend.name} answered past its deadline, {time.perf_counter() - t:.1f} s after it "
                    f"started: {f.result().reason or 'available'}"))
            self._running[id(backend)] = entry
            return ProbeResult(f"probe did not answer within {deadline:g} s", time.perf_counter() - entry[2],
                               timed_out=True)


ENTRY_POINT_GROUP = "moe_dispatch.backends"
ENV_PLUGINS = "MOE_DISPATCH_PLUGINS"
ENV_TRACE = "MOE_DISPATCH_TRACE_PLUGINS"
HOOK_NAMES = ("moe_dispatch_register_backends", "moe_dispatch_register_runners", "moe_dispatch_register_commands")

Trace = Callable[[str], None]


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
    #: The variables the plugin's import and hooks changed and left changed: reported (none of them steers).
    environ_changes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None

    def label(self) -> str:
        dist = self.distribution or self.module
        return f"{dist} {self.version}" if self.version else dist

    def failed(self, exc: BaseException) -> "PluginRecord":
        return dataclasses.replace(self, error="".join(traceback.format_exception(exc)).rstrip(), exception=exc)


@dataclass(frozen=True)
class PluginSource:
    """A plugin not yet imported: its record and how to import it."""

    record: PluginRecord
    load: Callable[[], Any]


@dataclass(frozen=True)
class LoadedPlugin:
    """What one plugin registered; empty when ``record`` carries an error."""

    record: PluginRecord
    backends: tuple[Backend, ...] = ()
    runners: tuple[RunnerInfo, ...] = ()
    commands: tuple[Command, ...] = ()
    #: The variables it changed and left changed, with their values before (put back if a backend's vendor reads one).
    environ: Mapping[str, str | None] = field(default_factory=dict)


def builtin_sources(modules: Iterable[str]) -> list[PluginSource]:
    version = core_version()
    return [PluginSource(PluginRecord(m, m, "moe-dispatch", version, builtin=True),
                         lambda m=m: importlib.import_module(m)) for m in modules]


def module_sources(modules: Iterable[ModuleType]) -> list[PluginSource]:
    return [PluginSource(PluginRecord(m.__name__, m.__name__, None, None), lambda m=m: m) for m in modules]


def parse_allow_list(raw: str | None) -> set[str] | None:
    return None if raw is None else {part.strip() for part in raw.split(",") if part.strip()}


def entry_point_sources(allow: set[str] | None, trace: Trace) -> tuple[list[PluginSource], list[str], list[str]]:
    """The ``moe_dispatch.backends`` entry points the allow-list admits, the allow-list's names that matched none, and
    every name it could have matched (plugins and their distributions)."""
    sources: list[PluginSource] = []
    seen: set[str] = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        seen.update({ep.name, dist or ""})
        if allow is not None and ep.name not in allow and (dist or "") not in allow:
            trace(f"skip {ep.name} ({dist}): not in {ENV_PLUGINS}")
            continue
        sources.append(PluginSource(PluginRecord(ep.name, ep.value, dist, version), ep.load))
    return sources, sorted((allow or set()) - seen), sorted(seen - {""})


#: Seconds one plugin's import may take before it is recorded as failed (``import_timeout_s``).
DEFAULT_IMPORT_TIMEOUT_S = 60.0


def load_plugin(pm: pluggy.PluginManager, source: PluginSource, trace: Trace, *,
                reserved_backends: frozenset[str] = frozenset(),
                import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S) -> LoadedPlugin:
    """Import one plugin, check its API version and hook names, and run its registration hooks into lists of its
    own: nothing reaches the host unless it loaded whole, and any failure (even ``SystemExit``) comes back as a
    record with its error. ``reserved_backends`` are the built-ins' names, which no other plugin may register. An
    import that does not finish within ``import_timeout_s`` (on a daemon thread; ``math.inf``: on this one) fails."""
    record = source.record
    started = time.perf_counter()
    found = _Registrations(record, reserved_backends)
    module = None
    before = dict(os.environ)
    try:
        module = _import_within(source, import_timeout_s)
        _check_api(record, module)
        pm.register(module, name=record.name)
        _check_hook_names(record, pm, module)
        for hook_name in HOOK_NAMES:
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                if impl.plugin is module:
                    trace(f"call {record.name}.{hook_name}(register)")
                    impl.function(register=getattr(found, hook_name))
        changes = environ_changes(before)
        if steered := steering(changes):
            raise PluginError("the plugin changed variables that steer every backend while loading (put back); a "
                              "plugin must not set them", parameter="os.environ", value=steered,
                              allowed=f"no change to {', '.join(p + '*' for p in STEERING_PREFIXES)} variables")
        for backend in found.backends:
            if not isinstance(backend.capabilities, Capabilities):  # a property that raises fails the plugin here
                raise PluginError(f"backend {backend.name!r} has capabilities that are not a Capabilities",
                                  parameter="capabilities", value=type(backend.capabilities).__name__,
                                  allowed="Capabilities")
    except BaseException as exc:  # one bad plugin must not stop the others, not even with SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        put_back(environ_changes(before))  # a plugin that did not load leaves nothing behind
        if module is not None and pm.is_registered(module):
            pm.unregister(module)
        trace(f"plugin {record.label()} FAILED: {type(exc).__name__}: {exc}")
        return LoadedPlugin(record.failed(exc))
    elapsed = (time.perf_counter() - started) * 1e3
    trace(f"plugin {record.label()} loaded in {elapsed:.1f} ms: backends {[b.name for b in found.backends]}, "
          f"runners {[r.name for r in found.runners]}, commands {[c.name for c in found.commands]}")
    if changes:
        trace(f"plugin {record.label()} changed the environment: {', '.join(changes)}")
    return LoadedPlugin(dataclasses.replace(record, environ_changes=tuple(changes)), tuple(found.backends),
                        tuple(found.runners), tuple(found.commands), changes)


def _import_within(source: PluginSource, timeout_s: float) -> Any:
    if math.isinf(timeout_s):
        return source.load()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["module"] = source.load()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"moe-dispatch-import-{source.record.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PluginError(f"importing the plugin did not finish within {timeout_s:g} s (its thread is left blocked); "
                          "a plugin must import vendor libraries lazily, in probe() or create()",
                          parameter="import_timeout_s", value=timeout_s,
                          allowed="a plugin module that imports quickly, or a larger PluginHost(import_timeout_s=)")
    if "error" in box:
        raise box["error"]
    return box["module"]


class _Registrations:
    """The ``register`` callbacks handed to one plugin's hooks (one method per hook)."""

    def __init__(self, record: PluginRecord, reserved_backends: frozenset[str]) -> None:
        self.record = record
        self.reserved = reserved_backends
        self.backends: list[Backend] = []
        self.runners: list[RunnerInfo] = []
        self.commands: list[Command] = []

    def moe_dispatch_register_backends(self, backend: Backend) -> None:
        name = getattr(backend, "name", None)
        if not isinstance(backend, Backend) or not isinstance(name, str) or not name:
            raise PluginError("register() takes a named Backend instance", parameter="backend", value=backend,
                              allowed="an instance of a moe_dispatch.backend.Backend subclass with a non-empty name")
        if name in self.reserved and not self.record.builtin:
            raise PluginError(
                "this backend name belongs to a moe-dispatch built-in; register it under a name of your own",
                parameter="backend", value=name, allowed=f"any name but {', '.join(sorted(self.reserved))}")
        self.backends.append(backend)

    def moe_dispatch_register_runners(self, runner: RunnerInfo) -> None:
        if not isinstance(runner, RunnerInfo):
            raise PluginError("register() takes a RunnerInfo", parameter="runner", value=runner,
                              allowed="moe_dispatch.backend.RunnerInfo")
        self.runners.append(runner)

    def moe_dispatch_register_commands(self, command: Command) -> None:
        if not isinstance(command, Command):
            raise PluginError("register() takes a Command", parameter="command", value=command,
                              allowed="moe_dispatch.backend.Command")
        self.commands.append(command)


def _check_api(record: PluginRecord, module: Any) -> None:
    declared = getattr(module, "MOE_DISPATCH_API", None)
    supported = ", ".join(map(str, sorted(hookspecs.SUPPORTED_API_VERSIONS)))
    if declared is None:
        raise PluginError(f"plugin {record.label()} does not declare MOE_DISPATCH_API; add `MOE_DISPATCH_API = "
                          f"{hookspecs.API_VERSION}` to {record.module.split(':')[0]}", parameter="MOE_DISPATCH_API",
                          value=None, allowed=supported)
    if declared not in hookspecs.SUPPORTED_API_VERSIONS:
        raise PluginError(f"plugin {record.label()} was written for core API {declared}, but moe-dispatch "
                          f"{core_version()} implements API {hookspecs.API_VERSION}; install a plugin release built "
                          "for it", parameter="MOE_DISPATCH_API", value=declared, allowed=supported)


def _check_hook_names(record: PluginRecord, pm: pluggy.PluginManager, module: Any) -> None:
    """pluggy's ``check_pending`` for this plugin alone: a hookimpl without a spec is a typo."""
    for caller in pm.get_hookcallers(module) or []:
        if caller.spec is None:
            close = difflib.get_close_matches(caller.name, list(HOOK_NAMES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise PluginError(f"plugin {record.label()} implements a hook that does not exist{hint}", parameter="hook",
                              value=caller.name, allowed=", ".join(HOOK_NAMES))
