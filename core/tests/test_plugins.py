"""The plugin host: built-ins through the hook, entry points one at a time, typed failures.

Fixture plugins are real distributions: a module plus a ``.dist-info`` with METADATA and
``entry_points.txt`` on ``sys.path``, found by ``importlib.metadata`` like any installed one.
"""

import contextlib
import importlib
import io
import json
import os
import subprocess
import textwrap
import warnings

import pytest

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch import PluginHost

GOOD = '''
import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch._reference.builtin import TorchBackend

MOE_DISPATCH_API = 1

class Renamed(TorchBackend):
    name = "{name}"

@mdb.hookimpl
def moe_dispatch_register_backends(register):
    register(Renamed())
'''


def make_dist(root, dist, module, source, ep_name=None):
    """Install ``module`` as distribution ``dist`` the way pip lays it out in site-packages:
    the module, and a ``.dist-info`` with METADATA, entry points, RECORD and INSTALLER."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
        "entry_points.txt": f"[moe_dispatch.backends]\n{ep_name or module} = {module}\n",
        "top_level.txt": f"{module}\n",
        "INSTALLER": "pip\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{module}.py,,"] + [f"{info.name}/{name},," for name in [*files, "RECORD"]]
    (info / "RECORD").write_text("\n".join(record) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def test_builtins_register_through_the_hook():
    host = PluginHost(load_entry_points=False)
    assert {"torch", "allgather"} <= set(host.backend_names())
    record = next(p for p in host.plugins if p.builtin)
    assert record.ok and record.distribution == "moe-dispatch"
    assert set(host.runners()) == {"torch"} and host.runners()["torch"].needs is None  # no vendor kernel in the core


def test_a_broken_plugin_is_listed_and_the_others_load(site):
    make_dist(site, "fx-good", "fx_good", GOOD.format(name="fx-good"))
    make_dist(site, "fx-broken", "fx_broken", "import not_a_module_anywhere\n")
    host = PluginHost(env={})
    assert "fx-good" in host.backend_names()
    infos = {i.name: i for i in host.available_backends()}
    assert infos["fx_broken"].available is False and "not_a_module_anywhere" in infos["fx_broken"].reason
    with pytest.raises(md.BackendUnavailableError, match="failed to load") as info:
        host.get_backend("fx_broken")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_two_distributions_with_one_name_is_an_error_naming_both(site):
    make_dist(site, "fx-one", "fx_one", GOOD.format(name="dup"))
    make_dist(site, "fx-two", "fx_two", GOOD.format(name="dup"))
    host = PluginHost(env={})
    with pytest.raises(md.PluginError, match="fx-one 1.0 and fx-two 1.0"):
        host.get_backend("dup")
    assert not {i.name: i for i in host.available_backends()}["dup"].available


def test_incompatible_api_version_names_both_versions(site):
    make_dist(site, "fx-old", "fx_old", GOOD.format(name="old").replace("MOE_DISPATCH_API = 1", "MOE_DISPATCH_API = 99"))
    host = PluginHost(env={})
    failure = next(p for p in host.failures() if p.name == "fx_old")
    assert "core API 99" in failure.error and "implements API 1" in failure.error
    assert "old" not in host.backend_names()


def test_misspelt_hook_is_rejected_with_a_suggestion(site):
    source = GOOD.format(name="typo").replace("def moe_dispatch_register_backends", "def moe_dispatch_register_backend")
    make_dist(site, "fx-typo", "fx_typo", source)
    host = PluginHost(env={})
    failure = next(p for p in host.failures() if p.name == "fx_typo")
    assert "did you mean moe_dispatch_register_backends" in failure.error


def test_a_plugin_raising_while_registering_leaves_nothing_behind(site):
    source = GOOD.format(name="half") + "\n@mdb.hookimpl\ndef moe_dispatch_register_runners(register):\n    raise RuntimeError('boom')\n"
    make_dist(site, "fx-half", "fx_half", source)
    host = PluginHost(env={})
    assert "half" not in host.backend_names()
    assert "boom" in next(p for p in host.failures() if p.name == "fx_half").error


def test_a_probe_that_raises_makes_the_backend_unavailable_not_the_host(site):
    source = GOOD.format(name="probing") + "\nRenamed.probe = lambda self: 1 / 0\n"
    make_dist(site, "fx-probe", "fx_probe", source)
    host = PluginHost(env={})
    info = {i.name: i for i in host.available_backends()}["probing"]
    assert not info.available and "ZeroDivisionError" in info.reason
    with pytest.raises(md.BackendUnavailableError, match="ZeroDivisionError"):
        md.create_dispatcher("probing", md.DispatchSpec(128, 8, 2), host=host)


def test_allow_list_limits_external_plugins(site):
    make_dist(site, "fx-a", "fx_a", GOOD.format(name="a"))
    make_dist(site, "fx-b", "fx_b", GOOD.format(name="b"))
    only_a = PluginHost(env={"MOE_DISPATCH_PLUGINS": "fx-a,not-installed"})
    assert "a" in only_a.backend_names() and "b" not in only_a.backend_names()
    assert only_a.allow_list_unmatched == ["not-installed"]
    none = PluginHost(env={"MOE_DISPATCH_PLUGINS": ""})
    assert {"torch", "allgather"} == set(none.backend_names())


def test_trace_shows_hook_calls(site):
    make_dist(site, "fx-t", "fx_t", GOOD.format(name="traced"))
    out = io.StringIO()
    PluginHost(env={}, trace=out)
    assert "call fx_t.moe_dispatch_register_backends" in out.getvalue()


def test_unknown_backend_suggests_the_nearest():
    with pytest.raises(md.BackendUnavailableError, match="did you mean 'torch'"):
        PluginHost(load_entry_points=False).get_backend("torhc")


def test_host_does_not_touch_the_environment(site):
    before = dict(os.environ)
    make_dist(site, "fx-env", "fx_env", GOOD.format(name="env"))
    PluginHost(env={"MOE_DISPATCH_PLUGINS": "fx-env"})
    assert dict(os.environ) == before


UNAVAILABLE = GOOD + """
Renamed.probe = lambda self: "needs the frobnicator accelerator"
Renamed.install_hint = "pip install frobnicator-runtime"
"""


def _cli(site, *args, env_extra=None):
    """``moe-dispatch *args`` with ``site`` installed, in this process (its ``main`` on a host of its own, as a
    fresh process builds one from its environment): exit status, stdout, stderr."""
    from moe_dispatch.cli import main

    env = {k: v for k, v in {**os.environ, **(env_extra or {})}.items() if k != "MOE_DISPATCH_PLUGINS"}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(list(args), host=PluginHost(env=env))
        except SystemExit as exc:  # argparse's own exits (--help, a bad flag)
            status = exc.code
    return subprocess.CompletedProcess(args, status, out.getvalue(), err.getvalue())


def test_backends_command_survives_a_broken_plugin_and_says_what_to_install(site):
    make_dist(site, "fx-broken-cli", "fx_broken_cli", "raise ImportError('libfrob.so: cannot open shared object')\n")
    make_dist(site, "fx-missing-hw", "fx_missing_hw", UNAVAILABLE.format(name="frob"))
    run = _cli(site, "backends")
    assert run.returncode == 0, run.stderr
    backends, runners = run.stdout.split("\nrunner ")
    lines = {line.split()[0]: line for line in backends.splitlines() if line.strip()}
    assert "broken" in lines["fx_broken_cli"] and "libfrob.so" in lines["fx_broken_cli"]
    assert "unavailable" in lines["frob"] and "needs the frobnicator accelerator" in lines["frob"]
    assert "to install: pip install frobnicator-runtime" in run.stdout
    assert "available" in lines["torch"]
    runner_lines = {line.split()[0]: line for line in runners.splitlines()[1:] if line.strip()}
    assert runner_lines["torch"].split()[1] == "any" and "any backend" in runner_lines["torch"]


def test_backends_json_is_the_documented_schema(site):
    make_dist(site, "fx-broken-json", "fx_broken_json", "import not_a_module_anywhere\n")
    make_dist(site, "fx-missing-json", "fx_missing_json", UNAVAILABLE.format(name="frob-json"))
    run = _cli(site, "backends", "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert set(doc) == {"schema", "core", "backends", "plugins", "allow_list_unmatched", "runners", "commands",
                        "command_conflicts"}
    assert {c["name"]: c["distribution"].split()[0] for c in doc["commands"]} == {
        "demo": "moe-dispatch-testing", "bench": "moe-dispatch-testing"} and doc["command_conflicts"] == {}
    assert doc["schema"] == 1
    torch_runner = next(r for r in doc["runners"] if r["name"] == "torch")
    assert torch_runner == {"name": "torch", "needs": None, "accepts": None, "backends": None, "available": None,
                            "reason": None}
    assert set(doc["core"]) == {"version", "api_version"}
    keys = {"name", "distribution", "version", "status", "available", "reason", "install_hint", "description",
            "capabilities", "error", "environ_changes"}
    by_name = {b["name"]: b for b in doc["backends"]}
    assert all(set(b) == keys for b in doc["backends"])
    assert by_name["fx_broken_json"]["status"] == "broken" and "ModuleNotFoundError" in by_name["fx_broken_json"]["error"]
    assert by_name["frob-json"]["status"] == "unavailable"
    assert by_name["frob-json"]["install_hint"] == "pip install frobnicator-runtime"
    assert by_name["torch"]["status"] == "available" and by_name["torch"]["capabilities"]["modes"]["normal"]
    plugins = {p["name"]: p for p in doc["plugins"]}
    assert plugins["fx_broken_json"]["ok"] is False and plugins["fx_missing_json"]["distribution"] == "fx-missing-json"
    assert all(p["environ_changes"] == [] for p in doc["plugins"])


def test_trace_variable_traces_the_command(site):
    make_dist(site, "fx-trace-cli", "fx_trace_cli", GOOD.format(name="traced-cli"))
    run = _cli(site, "backends", env_extra={"MOE_DISPATCH_TRACE_PLUGINS": "1"})
    assert run.returncode == 0
    assert "moe-dispatch trace: call fx_trace_cli.moe_dispatch_register_backends" in run.stderr
    assert "moe-dispatch trace: probe traced-cli: available" in run.stderr


def test_a_broken_plugin_named_at_creation_raises_with_its_traceback(site):
    make_dist(site, "fx-broken-create", "fx_broken_create", "def f():\n    raise OSError('driver mismatch')\nf()\n")
    host = PluginHost(env={})
    with pytest.raises(md.BackendUnavailableError) as info:
        md.create_dispatcher("fx_broken_create", md.DispatchSpec(128, 8, 2), host=host)
    assert "Traceback" in str(info.value) and "driver mismatch" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


def test_probe_cache_is_per_registered_object_not_per_name():
    """A second object with a registered name (a backend driving an emulator, say) gets its own
    probe, not the cached answer for the registered one."""
    host = md.PluginHost(env={})
    registered = host.get_backend("torch")

    class Elsewhere(type(registered)):  # same name, cannot run here
        def probe(self) -> str | None:
            return "not on this machine"

    assert host.probe(registered) is None
    assert host.probe(Elsewhere()) == "not on this machine"
    assert host.probe(registered) is None


def test_torch_npu_without_cann_does_not_break_importing_torch(tmp_path, monkeypatch):
    """torch autoloads installed device backends and raises when torch-npu lacks CANN; the core
    then imports torch with autoload off, in a scoped block, only in exactly that situation."""
    from moe_dispatch._torch_import import npu_autoload_would_fail

    assert not npu_autoload_would_fail({})  # no torch_npu here
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise ImportError('libhccl.so')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert npu_autoload_would_fail({})
    assert not npu_autoload_would_fail({"ASCEND_HOME_PATH": "/usr/local/Ascend"})  # CANN is set up
    assert not npu_autoload_would_fail({"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})  # the user chose


def test_a_plugin_may_not_take_a_builtin_backend_name(site):
    make_dist(site, "fx-torch", "fx_torch", GOOD.format(name="torch") + "\nRenamed.probe = lambda self: 'impostor'\n")
    host = PluginHost(env={})
    assert host.get_backend("torch").probe() is None  # the built-in, still there and available
    failure = next(p for p in host.failures() if p.name == "fx_torch")
    assert "belongs to a moe-dispatch built-in" in failure.error


@pytest.mark.parametrize("raising", ["SystemExit(3)", "GeneratorExit()", "type('Odd', (BaseException,), {})()"])
def test_a_plugin_raising_a_base_exception_is_a_failure_not_an_exit(site, raising):
    make_dist(site, "fx-exit", "fx_exit", f"raise {raising}\n")
    make_dist(site, "fx-fine", "fx_fine", GOOD.format(name="fine"))
    host = PluginHost(env={})
    assert "fine" in host.backend_names()
    assert next(p for p in host.failures() if p.name == "fx_exit").error


def test_a_plugin_is_registered_whole_or_not_at_all(site):
    # fx-late registers "shared" then fails: fx-early keeps "shared", with no conflict left behind.
    make_dist(site, "fx-early", "fx_early", GOOD.format(name="shared"))
    late = GOOD.format(name="shared") + "\n@mdb.hookimpl\ndef moe_dispatch_register_runners(register):\n    raise RuntimeError('late')\n"
    make_dist(site, "fx-late", "fx_late", late)
    host = PluginHost(env={})
    assert host.get_backend("shared").name == "shared"
    assert {i.name: i.status for i in host.available_backends()}["shared"] == "available"


@pytest.mark.parametrize("name", ["torch", "", 3, None])
def test_a_backend_whose_name_is_not_a_new_str_is_refused_at_registration(site, name):
    source = GOOD.replace('name = "{name}"', f"name = {name!r}")
    make_dist(site, "fx-badname", "fx_badname", source)
    host = PluginHost(env={})
    assert next(p for p in host.failures() if p.name == "fx_badname").error
    assert all(isinstance(info.name, str) for info in host.available_backends())


COMMAND = '''
import moe_dispatch as md
import moe_dispatch.backend as mdb

MOE_DISPATCH_API = 1

def _arguments(parser):
    parser.add_argument("--times", type=int, default=1)

def _run(args):
    if args.times < 1:
        raise md.InvalidSpecError("must be positive", parameter="--times", value=args.times, allowed=">= 1")
    print("{name} ran " * args.times)
    return 0

@mdb.hookimpl
def moe_dispatch_register_commands(register):
    register(mdb.Command("{name}", "says it ran", _arguments, _run))
'''


def test_a_plugin_adds_a_subcommand_to_the_command_line(site):
    make_dist(site, "fx-cmd", "fx_cmd", COMMAND.replace("{name}", "fx-hello"))
    run = _cli(site, "fx-hello", "--times", "2")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["fx-hello", "ran", "fx-hello", "ran"]
    helped = _cli(site, "--help")
    assert "fx-hello" in helped.stdout and "says it ran [fx-cmd 1.0]" in " ".join(helped.stdout.split())
    listed = _cli(site, "backends")
    assert "moe-dispatch fx-hello fx-cmd 1.0" in " ".join(listed.stdout.split())
    bad = _cli(site, "fx-hello", "--times", "0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "moe-dispatch: error: --times=0: must be positive; allowed: >= 1"
    ]


def test_plugin_commands_cannot_take_a_builtin_name_and_two_owners_lose_theirs(site):
    make_dist(site, "fx-cmd-plan", "fx_cmd_plan", COMMAND.replace("{name}", "plan"))
    make_dist(site, "fx-cmd-a", "fx_cmd_a", COMMAND.replace("{name}", "fx-same"))
    make_dist(site, "fx-cmd-b", "fx_cmd_b", COMMAND.replace("{name}", "fx-same"))
    host = PluginHost(env={})
    assert "belongs to moe-dispatch itself" in next(p for p in host.failures() if p.name == "fx_cmd_plan").error
    assert "fx-same" not in host.commands()
    assert [p.distribution for p in host.command_conflicts["fx-same"]] == ["fx-cmd-a", "fx-cmd-b"]


def test_every_builtin_subcommand_name_is_reserved():
    from moe_dispatch.cli.main import build_parser
    from moe_dispatch._hookspecs import RESERVED_COMMAND_NAMES

    sub = next(a for a in build_parser(PluginHost(load_entry_points=False))._actions if a.dest == "command")
    assert set(sub.choices) <= RESERVED_COMMAND_NAMES


@pytest.mark.parametrize("kwargs, parameter", [
    ({"name": "Bad Name"}, "name"), ({"name": "explain"}, "name"), ({"run": "not callable"}, "run"),
    ({"help": None}, "help"),
])
def test_a_malformed_command_is_a_typed_error(kwargs, parameter):
    fields = {"name": "fx-ok", "help": "h", "add_arguments": lambda p: None, "run": lambda a: 0, **kwargs}
    with pytest.raises(md.PluginError) as info:
        mdb.Command(**fields)
    assert info.value.parameter == parameter


def test_a_plugin_that_sets_moe_dispatch_variables_at_import_fails_and_they_are_put_back(site, monkeypatch):
    monkeypatch.delenv("MOE_DISPATCH_OUTPUT_DTYPE", raising=False)
    source = "import os\nos.environ['MOE_DISPATCH_OUTPUT_DTYPE'] = 'int8'\n" + GOOD.format(name="meddler")
    make_dist(site, "fx-meddler", "fx_meddler", source)
    host = PluginHost(env={})
    assert "MOE_DISPATCH_OUTPUT_DTYPE" not in os.environ
    assert "meddler" not in host.backend_names()
    assert "MOE_DISPATCH_OUTPUT_DTYPE" in next(p for p in host.failures() if p.name == "fx_meddler").error


def test_a_probe_that_sets_moe_dispatch_variables_makes_its_backend_unavailable(site, monkeypatch):
    monkeypatch.setenv("MOE_DISPATCH_OUTPUT_DTYPE", "bf16")
    source = GOOD.format(name="meddling-probe") + (
        "\nimport os\ndef _probe(self):\n    os.environ['MOE_DISPATCH_OUTPUT_DTYPE'] = 'nvfp4'\n    return None\n"
        "Renamed.probe = _probe\n")
    make_dist(site, "fx-meddling-probe", "fx_meddling_probe", source)
    host = PluginHost(env={})
    info = {i.name: i for i in host.available_backends()}["meddling-probe"]
    assert not info.available and "MOE_DISPATCH_OUTPUT_DTYPE" in info.reason
    assert os.environ["MOE_DISPATCH_OUTPUT_DTYPE"] == "bf16"


def test_a_backend_whose_capabilities_raise_fails_its_plugin_not_the_listing(site):
    source = GOOD.format(name="nocaps") + "\nRenamed.capabilities = property(lambda self: 1 / 0)\n"
    make_dist(site, "fx-nocaps", "fx_nocaps", source)
    host = PluginHost(env={})
    infos = {i.name: i for i in host.available_backends()}
    assert infos["torch"].available and "nocaps" not in infos
    assert "ZeroDivisionError" in next(p for p in host.failures() if p.name == "fx_nocaps").error


def test_a_plugin_whose_import_blocks_is_a_failure_after_the_deadline(site):
    make_dist(site, "fx-blocks", "fx_blocks", "import threading\nthreading.Event().wait()\n")
    make_dist(site, "fx-after", "fx_after", GOOD.format(name="after-blocker"))
    host = PluginHost(env={}, import_timeout_s=0.5)
    assert "after-blocker" in host.backend_names()
    assert "did not finish within 0.5 s" in next(p for p in host.failures() if p.name == "fx_blocks").error


@pytest.mark.parametrize("value", [0, -1, True, float("nan"), "5"])
def test_the_import_deadline_is_checked(value):
    with pytest.raises(md.PluginError) as info:
        PluginHost(load_entry_points=False, import_timeout_s=value)
    assert info.value.parameter == "import_timeout_s"


WRITES_AT_IMPORT = '''
import os
import moe_dispatch.backend as mdb
from moe_dispatch._reference.builtin import TorchBackend

MOE_DISPATCH_API = 1
os.environ["{variable}"] = "1"

class Reads(TorchBackend):
    name = "{name}"
    vendor_environment = ("FX_VENDOR_READS_THIS",)

@mdb.hookimpl
def moe_dispatch_register_backends(register):
    register(Reads())
'''

WRITES_IN_PROBE = '''
import os
import moe_dispatch.backend as mdb
from moe_dispatch._reference.builtin import TorchBackend

MOE_DISPATCH_API = 1

class Probes(TorchBackend):
    name = "{name}"

    def probe(self):
        os.environ["{variable}"] = "1"
        return None

@mdb.hookimpl
def moe_dispatch_register_backends(register):
    register(Probes())
'''


@pytest.mark.parametrize("variable, steers", [("FX_HARMLESS_SETTING", False), ("SGLANG_DEEPEP_FX", True),
                                              ("FX_VENDOR_READS_THIS", True)])
def test_a_plugin_that_changes_the_environment_at_import_is_reported_or_left_out(site, monkeypatch, variable,
                                                                                  steers):
    """A change to a variable that steers dispatch (sglang's, or one any backend's vendor reads, whichever plugin
    loaded first) is put back and leaves the plugin out; any other is kept, warned about and listed."""
    monkeypatch.delenv(variable, raising=False)
    module = f"fx_env_writer_{variable.lower()}"  # a module imports once per process
    make_dist(site, "fx-env-writer", module, WRITES_AT_IMPORT.format(variable=variable, name="fx-env"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        host = PluginHost(env={})
    record = next(p for p in host.plugins if p.name == module)
    if steers:
        assert not record.ok and variable in record.error and variable not in os.environ
        assert "fx-env" not in host.backend_names()
    else:
        assert record.ok and record.environ_changes == (variable,) and os.environ[variable] == "1"
        assert any(variable in str(w.message) and w.category is RuntimeWarning for w in seen)
        from moe_dispatch.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(["backends"], host=host)
            main(["backends", "--json"], host=host)
        text, doc = out.getvalue().split("\n{", 1)
        assert f"plugin fx-env-writer 1.0: {variable}" in text
        assert next(p for p in json.loads("{" + doc)["plugins"] if p["name"] == module)["environ_changes"] == [variable]
    monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize("variable, steers", [("FX_PROBE_SETTING", False), ("DEEP_NORMAL_MODE_USE_INT8_QUANT", True)])
def test_a_probe_that_changes_the_environment_is_reported_or_makes_its_backend_unavailable(site, monkeypatch,
                                                                                           variable, steers):
    """The mission's first lesson: a write to a variable another backend's vendor reads (ascend_deepep's
    ``DEEP_NORMAL_MODE_USE_INT8_QUANT``) would steer that backend unseen."""
    pytest.importorskip("moe_dispatch_ascend_deepep")  # it declares that variable as read by its vendor
    monkeypatch.delenv(variable, raising=False)
    make_dist(site, "fx-env-probe", f"fx_env_probe_{variable.lower()}",
              WRITES_IN_PROBE.format(variable=variable, name="fx-probe"))
    host = PluginHost(env={})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        info = host.info("fx-probe")
    if steers:
        assert info.status == "unavailable" and variable in info.reason and variable not in os.environ
    else:
        assert info.status == "available" and info.environ_changes == (variable,)
        assert any(variable in str(w.message) for w in seen)
    monkeypatch.delenv(variable, raising=False)
