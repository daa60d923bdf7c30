"""Probing a backend with a deadline: ``probe()`` on a daemon thread, so a probe that hangs (a
driver that never answers, a vendor import stuck on a lock) costs its caller one deadline and
leaves the backend unavailable instead of stalling an engine's start-up. The plugin host
(``registry.PluginHost``) caches the registered backends' answers.

Loading plugins, one at a time: where each comes from, its API check, its hooks.

``load_plugin`` imports one plugin module, checks the API version it declares and the names of
the hooks it implements, and runs its registration hooks into lists of its own. Nothing reaches
the host until the plugin has loaded whole: a plugin that fails to import, declares an
unsupported API, implements a hook that does not exist, or raises while registering (even
``SystemExit``) comes back as a record with its error and nothing registered.

Environment (read by the host, once; never written):

- ``MOE_DISPATCH_PLUGINS``: comma-separated allow-list of entry-point or distribution
  names; empty loads no external plugin; unset loads all. Built-in backends always load.
- ``MOE_DISPATCH_TRACE_PLUGINS=1``: trace every hook call and probe to stderr.
"""


from __future__ import annotations

import difflib
import importlib
import math
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Iterable

import pluggy

from . import _hookspecs as hookspecs
from ._contract import Backend, Capabilities, RunnerInfo
from ._errors import PluginError
from ._hookspecs import Command

#: Seconds one ``probe()`` may take before its backend is reported unavailable. Generous: a
#: cold CUDA or NPU driver initialisation, or importing a large vendor library, on a loaded
#: machine takes seconds; a probe that takes longer than this is stuck, not slow.
DEFAULT_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ProbeResult:
    """One ``probe()`` answer: ``reason`` is None when the backend runs here.

    :param error: the traceback when ``probe()`` raised (``reason`` names the exception).
    :param timed_out: ``probe()`` did not return within the deadline. Its thread is left to
        finish on its own (a thread cannot be stopped); a registered backend keeps the timeout
        as its answer for the life of the host, so start-up and later calls agree.
    """

    reason: str | None
    seconds: float
    error: str | None = None
    timed_out: bool = False


class ProbeRun:
    """One ``probe()`` call on a daemon thread, so the caller can stop waiting for it.

    A thread cannot be killed, so a probe that hangs keeps its thread until it returns or the
    process exits; being a daemon, it never holds up interpreter exit.
    """

    def __init__(self, backend: Backend, on_late: Callable[["ProbeRun"], None]) -> None:
        self.backend = backend  # held so id(backend) stays unique while the run is tracked
        self.started = time.perf_counter()
        self.result: ProbeResult | None = None
        self._abandoned = False
        self._done = threading.Event()
        # Orders "the probe answered" against "the caller gave up", so exactly one of the two
        # sees the other: the caller uses the answer, or the late answer is only traced.
        self._lock = threading.Lock()
        self._on_late = on_late
        self._thread = threading.Thread(target=self._run, name=f"moe-dispatch-probe-{backend.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        result = call_probe(self.backend, self.started)
        with self._lock:
            self.result = result
            self._done.set()
            late = self._abandoned
        if late:
            self._on_late(self)

    def wait(self, timeout_s: float) -> ProbeResult | None:
        """The answer; None (and the run marked abandoned) if there is none within ``timeout_s``."""
        self._done.wait(timeout_s)
        with self._lock:
            if not self._done.is_set():
                self._abandoned = True
            return self.result


#: Variables a plugin may not change: they steer every backend's resolution and the host.
OWN_VARIABLES = "MOE_DISPATCH_"


def own_environ() -> dict[str, str]:
    """This library's variables as they are now (``MOE_DISPATCH_*``)."""
    return {k: v for k, v in os.environ.items() if k.startswith(OWN_VARIABLES)}


def undo_environ_changes(before: dict[str, str]) -> list[str]:
    """Put this library's variables back as in ``before``; the names that had changed. A plugin
    that sets ``MOE_DISPATCH_OUTPUT_DTYPE`` would otherwise change every other backend's choice."""
    now = own_environ()
    changed = sorted(k for k in {*before, *now} if before.get(k) != now.get(k))
    for key in changed:
        if key in before:
            os.environ[key] = before[key]
        else:
            os.environ.pop(key, None)
    return changed


def call_probe(backend: Backend, started: float) -> ProbeResult:
    before = own_environ()
    try:
        reason = backend.probe()
    except Exception as exc:  # a probe that raises is a reason, not a crash
        error = "".join(traceback.format_exception(exc)).rstrip()
        undo_environ_changes(before)
        return ProbeResult(f"probe() raised {type(exc).__name__}: {exc}", time.perf_counter() - started, error)
    changed = undo_environ_changes(before)
    if changed:
        return ProbeResult(f"probe() changed the environment ({', '.join(changed)}; put back): a plugin must not set "
                           "moe-dispatch's variables", time.perf_counter() - started)
    if reason is not None and not isinstance(reason, str):
        return ProbeResult(f"probe() returned {type(reason).__name__}, not None or a reason (str)",
                           time.perf_counter() - started)
    return ProbeResult(reason, time.perf_counter() - started)


def check_probe_timeout(value: object, parameter: str = "probe_timeout_s") -> float:
    """``value`` as a deadline in seconds, or a ``PluginError`` naming ``parameter``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise PluginError(
            "the deadline must be a positive number of seconds",
            parameter=parameter,
            value=value,
            allowed="a number > 0, or math.inf to call the plugin on the calling thread without a deadline",
        )
    return float(value)


class Prober:
    """Runs probes within deadlines; a probe still running past its deadline is kept, by
    ``id(backend)``, so asking again waits for the same call instead of starting another thread
    on a probe that hangs. ``trace`` gets a line when such a probe answers late."""

    def __init__(self, trace: Callable[[str], None]) -> None:
        self._trace = trace
        self._running: dict[int, ProbeRun] = {}

    def run(self, backend: Backend, deadline: float) -> ProbeResult:
        """``backend.probe()`` within ``deadline`` seconds (``math.inf``: on this thread)."""
        if math.isinf(deadline):
            return call_probe(backend, time.perf_counter())
        run = self._running.pop(id(backend), None)
        if run is None or run.backend is not backend:
            run = ProbeRun(backend, self._late_answer)
        result = run.wait(deadline)
        if result is not None:
            return result
        self._running[id(backend)] = run
        return ProbeResult(f"probe did not answer within {deadline:g} s", time.perf_counter() - run.started,
                           timed_out=True)

    def _late_answer(self, run: ProbeRun) -> None:
        answer = run.result.reason if run.result is not None else None
        # A registered backend keeps its timeout for the host's life (start-up already reported
        # it); the trace still shows the answer, which tells how far to raise the deadline.
        self._trace(f"probe {run.backend.name} answered past its deadline, {time.perf_counter() - run.started:.1f} s "
                    f"after it started: {answer or 'available'}")





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

    @property
    def ok(self) -> bool:
        return self.error is None

    def label(self) -> str:
        dist = self.distribution or self.module
        return f"{dist} {self.version}" if self.version else dist

    def failed(self, exc: BaseException) -> "PluginRecord":
        error = "".join(traceback.format_exception(exc)).rstrip()
        return PluginRecord(self.name, self.module, self.distribution, self.version, self.builtin, error, exc)


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


def builtin_sources(modules: Iterable[str]) -> list[PluginSource]:
    version = core_version()
    return [
        PluginSource(PluginRecord(m, m, "moe-dispatch", version, builtin=True), lambda m=m: importlib.import_module(m))
        for m in modules
    ]


def module_sources(modules: Iterable[ModuleType]) -> list[PluginSource]:
    return [PluginSource(PluginRecord(m.__name__, m.__name__, None, None), lambda m=m: m) for m in modules]


def parse_allow_list(raw: str | None) -> set[str] | None:
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def entry_point_sources(allow: set[str] | None, trace: Trace) -> tuple[list[PluginSource], list[str], list[str]]:
    """The ``moe_dispatch.backends`` entry points the allow-list admits, the allow-list's names
    that matched none, and every name it could have matched (plugins and their distributions)."""
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
    unmatched = sorted((allow or set()) - seen)
    return sources, unmatched, sorted(seen - {""})


#: Seconds one plugin's import may take before it is recorded as failed (``import_timeout_s``).
DEFAULT_IMPORT_TIMEOUT_S = 60.0


def load_plugin(pm: pluggy.PluginManager, source: PluginSource, trace: Trace, *,
                reserved_backends: frozenset[str] = frozenset(),
                import_timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S) -> LoadedPlugin:
    """Import, check and run the hooks of one plugin; on any failure nothing of it stays in
    ``pm`` and the record carries the error. ``reserved_backends`` are the built-ins' names,
    which no other plugin may register. The import runs on a daemon thread within
    ``import_timeout_s`` (``math.inf``: on the calling thread); one that does not finish is a
    failure, and its thread is left blocked (a thread cannot be stopped)."""
    record = source.record
    started = time.perf_counter()
    found = _Registrations(record, reserved_backends)
    module = None
    before = own_environ()
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
        changed = undo_environ_changes(before)
        if changed:
            raise PluginError(
                "the plugin changed moe-dispatch's environment variables while loading (put back); they steer every "
                "backend, so a plugin must not set them", parameter="os.environ", value=changed,
                allowed="no change to MOE_DISPATCH_* variables",
            )
        for backend in found.backends:
            if not isinstance(backend.capabilities, Capabilities):  # a property that raises fails the plugin here
                raise PluginError(f"backend {backend.name!r} has capabilities that are not a moe_dispatch.Capabilities",
                                  parameter="capabilities", value=type(backend.capabilities).__name__,
                                  allowed="Capabilities")
    except BaseException as exc:  # one bad plugin must not stop the others, not even with SystemExit
        if isinstance(exc, KeyboardInterrupt):
            raise
        undo_environ_changes(before)
        if module is not None and pm.is_registered(module):
            pm.unregister(module)
        trace(f"plugin {record.label()} FAILED: {type(exc).__name__}: {exc}")
        return LoadedPlugin(record.failed(exc))
    elapsed = (time.perf_counter() - started) * 1e3
    trace(f"plugin {record.label()} loaded in {elapsed:.1f} ms: backends {[b.name for b in found.backends]}, "
          f"runners {[r.name for r in found.runners]}, commands {[c.name for c in found.commands]}")
    return LoadedPlugin(record, tuple(found.backends), tuple(found.runners), tuple(found.commands))


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
        raise PluginError(
            f"importing the plugin did not finish within {timeout_s:g} s (its thread is left blocked); a plugin "
            "must import vendor libraries lazily, in probe() or create()", parameter="import_timeout_s",
            value=timeout_s, allowed="a plugin module that imports quickly, or a larger PluginHost(import_timeout_s=)",
        )
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
            raise PluginError(
                "register() takes a named moe_dispatch.Backend instance",
                parameter="backend",
                value=backend,
                allowed="an instance of a moe_dispatch.Backend subclass whose name is a non-empty str",
            )
        if name in self.reserved and not self.record.builtin:
            raise PluginError(
                "this backend name belongs to a moe-dispatch built-in; register it under a name of your own",
                parameter="backend", value=name, allowed=f"any name but {', '.join(sorted(self.reserved))}",
            )
        self.backends.append(backend)

    def moe_dispatch_register_runners(self, runner: RunnerInfo) -> None:
        if not isinstance(runner, RunnerInfo):
            raise PluginError(
                "register() takes a moe_dispatch.RunnerInfo", parameter="runner", value=runner, allowed="RunnerInfo"
            )
        self.runners.append(runner)

    def moe_dispatch_register_commands(self, command: Command) -> None:
        if not isinstance(command, Command):
            raise PluginError(
                "register() takes a moe_dispatch.Command", parameter="command", value=command, allowed="Command"
            )
        self.commands.append(command)


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
            close = difflib.get_close_matches(caller.name, list(HOOK_NAMES), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise PluginError(
                f"plugin {record.label()} implements a hook that does not exist{hint}",
                parameter="hook",
                value=caller.name,
                allowed=", ".join(HOOK_NAMES),
            )
