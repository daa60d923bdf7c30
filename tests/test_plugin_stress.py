"""Plugins under stress: a broken plugin, a probe that hangs, a probe that raises and
a backend whose ``create`` raises, all installed at once. The engine's start-up (load the
plugins, list the backends, create a dispatcher) completes, reports each, and the other
backends keep working.

The plugins are real distributions on ``sys.path`` (``make_dist`` from core/tests/test_plugins.py),
found through their entry points like installed ones; nothing here is mocked.
"""

from __future__ import annotations

import io
import math
import sys
import threading
import time

import pytest
from test_plugins import GOOD, make_dist

import moe_dispatch as md
from moe_dispatch._registry import DEFAULT_PROBE_TIMEOUT_S
from moe_dispatch import PluginHost

DEADLINE_S = 0.2

# A probe stuck in a driver call. It waits on an event the tests set when they finish, so
# its thread ends with the test instead of lingering in the session.
SLOW = GOOD.format(name="stress-slow") + '''
import threading

RELEASE = threading.Event()
CALLS = []

def _probe(self):
    CALLS.append(threading.current_thread().name)
    RELEASE.wait(10)
    return None

Renamed.probe = _probe
'''

RAISING = GOOD.format(name="stress-raising") + '''
def _probe(self):
    raise RuntimeError("driver 470 is older than the 535 this plugin needs")

Renamed.probe = _probe
'''

CRASHY = GOOD.format(name="stress-crashy") + '''
def _create(self, ctx):
    if ctx.options.get("typed"):  # a deliberate, typed error passes through as it is
        raise md.CapacityError("the vendor buffer is too small", parameter="num_max_dispatch_tokens_per_rank",
                               value=ctx.spec.num_max_dispatch_tokens_per_rank)
    raise OSError("cannot allocate the symmetric heap: 0 bytes free")

Renamed.create = _create
'''

MODULES = ["fx_stress_good", "fx_stress_broken", "fx_stress_slow", "fx_stress_raising", "fx_stress_crashy"]


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """All five plugins installed side by side; afterwards the hung probe is released and the
    modules forgotten, so the next test imports its own copies."""
    make_dist(tmp_path, "fx-stress-good", "fx_stress_good", GOOD.format(name="stress-good"))
    make_dist(tmp_path, "fx-stress-broken", "fx_stress_broken", "raise ImportError('libfrob.so: cannot open shared object')\n")
    make_dist(tmp_path, "fx-stress-slow", "fx_stress_slow", SLOW)
    make_dist(tmp_path, "fx-stress-raising", "fx_stress_raising", RAISING)
    make_dist(tmp_path, "fx-stress-crashy", "fx_stress_crashy", CRASHY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    slow = sys.modules.get("fx_stress_slow")
    if slow is not None:
        slow.RELEASE.set()
    for name in MODULES:
        sys.modules.pop(name, None)


def _spec() -> md.DispatchSpec:
    return md.DispatchSpec(128, 8, 2, num_max_dispatch_tokens_per_rank=4)


def test_startup_completes_and_reports_every_failure(installed):
    started = time.perf_counter()
    host = PluginHost(env={}, probe_timeout_s=DEADLINE_S)
    infos = {i.name: i for i in host.available_backends()}
    elapsed = time.perf_counter() - started
    assert elapsed < 1.5, f"start-up took {elapsed:.2f} s with a {DEADLINE_S} s probe deadline"

    assert infos["fx_stress_broken"].status == "broken" and "libfrob.so" in infos["fx_stress_broken"].reason
    slow = infos["stress-slow"]
    assert slow.status == "unavailable" and slow.reason == f"probe did not answer within {DEADLINE_S:g} s"
    raising = infos["stress-raising"]
    assert raising.status == "unavailable"
    assert raising.reason == "probe() raised RuntimeError: driver 470 is older than the 535 this plugin needs"
    assert "Traceback" in raising.error and "_probe" in raising.error
    for name in ("stress-good", "stress-crashy", "torch", "allgather"):
        assert infos[name].status == "available", infos[name]

    # Asking for the failed ones raises typed errors that say why, quickly.
    for name, match in [("fx_stress_broken", "failed to load"), ("stress-slow", "did not answer within"),
                        ("stress-raising", "driver 470")]:
        with pytest.raises(md.BackendUnavailableError, match=match):
            md.create_dispatcher(name, _spec(), host=host, env={})
    # ... and the others keep working in the same host.
    for name in ("stress-good", "torch", "allgather"):
        assert md.create_dispatcher(name, _spec(), host=host, env={}).backend.name == name


def test_a_backend_whose_create_raises_is_a_typed_error_naming_it(installed):
    host = PluginHost(env={}, probe_timeout_s=DEADLINE_S)
    with pytest.raises(md.BackendUnavailableError) as info:
        md.create_dispatcher("stress-crashy", _spec(), host=host, env={})
    error = info.value
    assert error.parameter == "backend" and error.value == "stress-crashy"
    assert "fx-stress-crashy 1.0" in str(error) and "create()" in str(error)
    assert "OSError: cannot allocate the symmetric heap" in str(error)
    assert isinstance(error.__cause__, OSError)
    # A typed error from create() is the plugin's own answer: it passes through unchanged.
    with pytest.raises(md.CapacityError, match="vendor buffer is too small"):
        md.create_dispatcher("stress-crashy", _spec(), host=host, env={}, options={"typed": True})
    assert md.create_dispatcher("torch", _spec(), host=host, env={}).backend.name == "torch"
    assert host.info("stress-crashy").status == "available"  # create failing says nothing about probe()


def test_a_slow_probe_costs_one_deadline_per_host_not_one_per_call(installed):
    trace = io.StringIO()
    host = PluginHost(env={}, probe_timeout_s=DEADLINE_S, trace=trace)
    host.available_backends()
    started = time.perf_counter()
    for _ in range(3):
        assert host.info("stress-slow").reason == f"probe did not answer within {DEADLINE_S:g} s"
        with pytest.raises(md.BackendUnavailableError):
            md.create_dispatcher("stress-slow", _spec(), host=host, env={})
    assert time.perf_counter() - started < DEADLINE_S, "the timeout was not cached"
    module = sys.modules["fx_stress_slow"]
    assert len(module.CALLS) == 1 and module.CALLS[0] == "moe-dispatch-probe-stress-slow"

    # Another object with the same name is probed on its own, but a probe of it still hanging
    # from an earlier call is waited for again, not started a second time.
    other = type(host.get_backend("stress-slow"))()
    assert host.probe(other, timeout_s=0.05) == "probe did not answer within 0.05 s"
    assert host.probe(other, timeout_s=0.05) == "probe did not answer within 0.05 s"
    assert len(module.CALLS) == 2

    # When the driver finally answers, the trace says so (and how long it took); the host keeps
    # the answer it already gave.
    module.RELEASE.set()
    deadline = time.monotonic() + 5
    while trace.getvalue().count("answered past its deadline") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "probe stress-slow answered past its deadline" in trace.getvalue()
    assert f"probe stress-slow: did not answer within {DEADLINE_S:g} s" in trace.getvalue()
    assert host.info("stress-slow").status == "unavailable"
    assert host.probe(other, timeout_s=0.05) is None  # the finished run's answer, no new call
    assert len(module.CALLS) == 2


def test_the_deadline_is_a_parameter_per_call(installed):
    host = PluginHost(env={})
    assert host.probe_timeout_s == DEFAULT_PROBE_TIMEOUT_S
    started = time.perf_counter()
    infos = {i.name: i for i in host.available_backends(probe_timeout_s=0.1)}
    assert time.perf_counter() - started < 1.0
    assert infos["stress-slow"].reason == "probe did not answer within 0.1 s"


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "5", True, None])
def test_a_bad_deadline_is_refused_naming_the_parameter(bad):
    with pytest.raises(md.PluginError) as info:
        PluginHost(load_entry_points=False, probe_timeout_s=bad)
    assert info.value.parameter == "probe_timeout_s" and "math.inf" in info.value.allowed
    if bad is not None:  # None on a call means "the host's deadline"
        with pytest.raises(md.PluginError, match="probe_timeout_s"):
            PluginHost(load_entry_points=False).available_backends(probe_timeout_s=bad)


def test_no_deadline_probes_on_the_calling_thread(installed):
    """``math.inf``: for a vendor library that must be initialised on the main thread."""
    module_probe = []
    host = PluginHost(env={}, probe_timeout_s=math.inf)

    class HereOnly(type(host.get_backend("stress-good"))):
        def probe(self) -> str | None:
            module_probe.append(threading.current_thread())
            return None

    assert host.probe(HereOnly()) is None
    assert module_probe == [threading.current_thread()]
