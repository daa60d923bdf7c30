"""Probing a backend with a deadline: ``probe()`` on a daemon thread, so a probe that hangs (a
driver that never answers, a vendor import stuck on a lock) costs its caller one deadline and
leaves the backend unavailable instead of stalling an engine's start-up. The plugin host
(``registry.PluginHost``) caches the registered backends' answers.
"""

from __future__ import annotations

import math
import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from .backend import Backend
from .errors import PluginError

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


__all__ = ["DEFAULT_PROBE_TIMEOUT_S", "ProbeResult", "Prober", "call_probe", "check_probe_timeout", "own_environ",
           "undo_environ_changes"]
