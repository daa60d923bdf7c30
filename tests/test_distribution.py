"""The installed core distribution: console script, extras naming the plugins, typed package."""

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
    ]:
        assert any(r.startswith(plugin) and f'extra == "{extra}"' in r for r in requires), (extra, plugin)
    core_deps = {r.split(";")[0].split(">")[0].split("<")[0].strip() for r in requires if "extra ==" not in r}
    assert core_deps == {"torch", "pluggy"}


def test_package_is_typed():
    assert (Path(moe_dispatch.__file__).parent / "py.typed").exists()
