"""The installed distributions: the core's console script, extras and typed package; the kit as its own distribution
(an engine that installs only the core gets no pytest plugin); the template found through its entry point."""

from importlib import metadata
from pathlib import Path

import moe_dispatch


def test_console_script_and_extras():
    dist = metadata.distribution("moe-dispatch")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["moe-dispatch"] == "moe_dispatch.cli:main"
    requires = dist.requires or []
    for extra, plugin in [
        ("cuda-deepep", "moe-dispatch-cuda-deepep"),
        ("ascend", "moe-dispatch-ascend-deepep"),
        ("ascend", "moe-dispatch-ascend-fuseep"),
        ("flashinfer-cutedsl", "moe-dispatch-flashinfer-cutedsl"),
        ("all", "moe-dispatch-cuda-deepep"),
        ("testing", "moe-dispatch-testing"),
        ("transformers", "moe-dispatch-transformers"),
    ]:
        assert any(r.startswith(plugin) and f'extra == "{extra}"' in r for r in requires), (extra, plugin)
    core_deps = {r.split(";")[0].split(">")[0].split("<")[0].strip() for r in requires if "extra ==" not in r}
    assert core_deps == {"torch", "pluggy"}


def test_package_is_typed():
    assert (Path(moe_dispatch.__file__).parent / "py.typed").exists()


ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "plugins" / "_template"


def test_the_kit_and_its_commands_come_with_their_own_distribution_not_the_core():
    assert [ep for ep in metadata.distribution("moe-dispatch").entry_points if ep.group == "pytest11"] == []
    eps = metadata.distribution("moe-dispatch-testing").entry_points
    assert {(ep.group, ep.value) for ep in eps} == {("pytest11", "moe_dispatch_testing.plugin"),
                                                     ("moe_dispatch.backends", "moe_dispatch_testing.commands")}


def test_the_template_is_installed_and_discovered_through_its_entry_point():
    dist = metadata.distribution("moe-dispatch-example")
    assert [(ep.group, ep.name) for ep in dist.entry_points] == [("moe_dispatch.backends", "example")]
    host = moe_dispatch.PluginHost(env={})
    record = next(p for p in host.plugins if p.name == "example")
    assert record.ok and record.distribution == "moe-dispatch-example" and not record.builtin
    assert host.info("example").status == "available"


def test_the_walkthrough_shows_the_template_verbatim():
    doc = (ROOT / "docs" / "writing-a-backend.md").read_text()
    for path in ["pyproject.toml", "src/moe_dispatch_example/__init__.py", "src/moe_dispatch_example/backend.py",
                 "src/moe_dispatch_example/dispatcher.py", "tests/test_conformance.py"]:
        assert (TEMPLATE / path).read_text().rstrip("\n") in doc, f"docs/writing-a-backend.md is out of date for {path}"
