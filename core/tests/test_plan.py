"""The buffer planner (``moe_dispatch.planning``) and the ``plan`` command (``moe_dispatch.cli.plan``)."""

import argparse
import dataclasses
import io
import json
import time
import warnings

import pytest

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch.cli.plan import add_plan_command, run_plan_command
from moe_dispatch.backend import EnvRequirement
from moe_dispatch.planning import plan_buffers
from moe_dispatch import PluginHost

B, F8, I8 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8


@pytest.fixture(scope="module")
def host():
    return PluginHost(env={})


def spec(h=7168, e=256, k=8, t=128, mode="normal", dtype="fp8", **kw):
    return md.DispatchSpec(h, e, k, t, mode=mode, output_dtype=dtype, **kw)


# -- planning ---------------------------------------------------------------------------------


def test_dispatch_and_combine_peaks_come_from_different_layers(host):
    """A narrow BF16 layer has the widest dispatch rows, a wide FP8 layer the widest combine
    rows: each peak names its own layer, and separate buffers need both peaks at once."""
    torch_backend = host.get_backend("torch")
    layers = {"narrow_bf16": spec(h=4096, e=64, dtype="bf16"), "wide_fp8": spec(h=7168, e=64, dtype="fp8")}
    plan = plan_buffers(torch_backend, layers, 8, env={}, host=host)
    sizes = {name: torch_backend.buffer_size(s.with_dtype(md.DispatchDtype.parse(s.output_dtype)), 8)
             for name, s in layers.items()}
    assert sizes["narrow_bf16"].dispatch_bytes > sizes["wide_fp8"].dispatch_bytes
    assert sizes["wide_fp8"].combine_bytes > sizes["narrow_bf16"].combine_bytes
    assert (plan.dispatch.name, plan.dispatch.layer, plan.dispatch.bytes) == (
        "narrow_bf16", 0, sizes["narrow_bf16"].dispatch_bytes)
    assert (plan.combine.name, plan.combine.layer, plan.combine.bytes) == (
        "wide_fp8", 1, sizes["wide_fp8"].combine_bytes)
    assert not plan.shared
    assert plan.total_bytes == plan.dispatch.bytes + plan.combine.bytes > max(s.total_bytes for s in sizes.values())
    # A sequence names layers by position.
    assert plan_buffers(torch_backend, list(layers.values()), 8, env={}, host=host).combine.name == "layer 1"


def test_fp8_shrinks_dispatch_but_not_combine(host):
    plan = plan_buffers("torch", [spec(dtype="fp8")], 16, env={}, host=host)
    layer = plan.layers[0]
    assert layer.dtype is F8
    assert layer.size.dispatch_bytes < layer.bf16_size.dispatch_bytes
    assert layer.size.combine_bytes == layer.bf16_size.combine_bytes
    assert 0 < plan.saving_fraction < 0.5
    assert plan.bf16_total_bytes - plan.total_bytes == layer.saving_bytes


def test_the_dtype_is_resolved_as_create_dispatcher_does(host):
    torch_backend = host.get_backend("torch")
    auto = spec(dtype="auto")
    assert plan_buffers(torch_backend, [auto], 8, env={}, host=host).layers[0].dtype is F8  # library default
    from_env = plan_buffers(torch_backend, [auto], 8, env={"MOE_DISPATCH_OUTPUT_DTYPE": "int8"}, host=host)
    assert from_env.layers[0].dtype is I8
    hinted = spec(dtype="auto", quant=md.QuantHints(dispatcher_output_dtype="bf16"))
    assert plan_buffers(torch_backend, [hinted], 8, env={}, host=host).layers[0].dtype is B


def test_a_fallback_is_recorded_without_a_warning_and_strict_raises(host):
    ascend = pytest.importorskip("moe_dispatch_ascend_deepep.backend").AscendDeepEPBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_buffers(ascend, [spec(dtype="fp8")], 16, env={}, host=host)
    res = plan.layers[0].resolution
    assert (res.requested, res.dtype) == (F8, I8) and "FP8" in res.fallback_reason
    with pytest.raises(md.UnsupportedDtypeError) as err:
        plan_buffers(ascend, [spec(dtype="fp8")], 16, env={}, host=host, strict=True)
    assert err.value.parameter == "output_dtype"


@pytest.mark.parametrize("call, parameter", [
    (lambda h: plan_buffers("torch", [spec(e=100)], 8, env={}, host=h), "num_experts"),
    (lambda h: plan_buffers("torch", [], 8, env={}, host=h), "specs"),
    (lambda h: plan_buffers("torch", [spec()], 0, env={}, host=h), "world_size"),
    (lambda h: plan_buffers("torch", [{"hidden_size": 7168}], 8, env={}, host=h), "specs['layer 0']"),
    (lambda h: plan_buffers("no_such_backend", [spec()], 8, env={}, host=h), "backend"),
])
def test_what_create_dispatcher_would_refuse_raises_typed(host, call, parameter):
    with pytest.raises(md.MoEDispatchError) as err:
        call(host)
    assert err.value.parameter == parameter


class _SmallLimit(TorchBackend):
    """The torch backend with a 64 MiB ceiling and an environment variable it needs."""

    name = "small_limit"
    capabilities = dataclasses.replace(
        TorchBackend.capabilities, limits={md.Mode.NORMAL: mdb.Limits(max_buffer_bytes=64 << 20)})

    def env_requirements(self, spec, world_size):
        return [EnvRequirement("FAKE_WINDOW_MB", spec.num_max_dispatch_tokens_per_rank, "MB", None, "test")]


def test_a_buffer_over_max_buffer_bytes_is_a_misfit_with_the_tokens_that_fit(host):
    backend = _SmallLimit()
    plan = plan_buffers(backend, {"big": spec(dtype="bf16", t=1024)}, 8, env={"FAKE_WINDOW_MB": "4096"}, host=host)
    (misfit,) = plan.misfits
    assert (misfit.parameter, misfit.value, misfit.layer) == ("num_max_dispatch_tokens_per_rank", 1024, "big")
    fit = int(misfit.allowed.split("..")[1])

    def largest(t):
        return max(backend.buffer_size(spec(dtype="bf16", t=t), 8).dispatch_bytes,
                   backend.buffer_size(spec(dtype="bf16", t=t), 8).combine_bytes)

    assert largest(fit) <= 64 << 20 < largest(fit + 1)
    with pytest.raises(md.CapacityError) as err:
        plan.check()
    assert err.value.parameter == "num_max_dispatch_tokens_per_rank" and f"to {fit}" in str(err.value)


def test_env_requirements_are_read_from_the_env_given_and_never_written(host, monkeypatch):
    monkeypatch.setenv("FAKE_WINDOW_MB", "100000")  # os.environ must not be consulted when env is given
    env = {"FAKE_WINDOW_MB": "64"}
    plan = plan_buffers(_SmallLimit(), [spec(t=128)], 8, env=env, host=host)
    (misfit,) = plan.misfits
    assert (misfit.parameter, misfit.needed, misfit.value) == ("FAKE_WINDOW_MB", 128, 64)
    assert misfit.summary == "needs FAKE_WINDOW_MB >= 128 MB, have 64"
    assert env == {"FAKE_WINDOW_MB": "64"}
    unset = plan_buffers(_SmallLimit(), [spec(t=128)], 8, env={}, host=host)
    assert unset.misfits[0].summary == "needs FAKE_WINDOW_MB >= 128 MB, unset, no default"
    assert plan_buffers(_SmallLimit(), [spec(t=64)], 8, env={"FAKE_WINDOW_MB": "64"}, host=host).fits


# -- the vendor ceilings ----------------------------------------------------------------------


def test_deepep_32_gib_ceiling_is_reported(host):
    deepep = pytest.importorskip("moe_dispatch_cuda_deepep.backend")
    backend = deepep.DeepEPBackend()
    assert backend.capabilities.limits_for(md.Mode.LOW_LATENCY).max_buffer_bytes == 16 * (2**31 - 1) - 1
    # 1024 experts of 8192: the low-latency RDMA buffer passes 32 GiB at 511 tokens per rank.
    huge = spec(h=8192, e=1024, t=511, mode="low_latency")
    plan = plan_buffers(backend, [huge], 64, env={}, host=host)
    assert plan.total_bytes == deepep.sizes.low_latency_rdma_size_hint(511, 8192, 64, 1024) > 32 << 30
    (misfit,) = plan.misfits
    fit = int(misfit.allowed.split("..")[1])
    hint = deepep.sizes.low_latency_rdma_size_hint
    assert hint(fit, 8192, 64, 1024) <= misfit.limit < hint(fit + 1, 8192, 64, 1024)
    assert "32.00 GiB" in misfit.summary
    # DeepSeek-V3 at the default capacity is far below it, in both modes.
    for mode in ("normal", "low_latency"):
        assert plan_buffers(backend, [spec(mode=mode)], 64, env={}, host=host).fits


def test_deepep_normal_fp8_leaves_the_shared_buffer_as_sglang_sizes_it(host):
    backend = pytest.importorskip("moe_dispatch_cuda_deepep.backend").DeepEPBackend()
    plan = plan_buffers(backend, [spec(dtype="fp8")], 8, env={}, host=host)
    layer = plan.layers[0]
    assert plan.shared and layer.size.dispatch_bytes < layer.bf16_size.dispatch_bytes
    # Combine is BF16 and shares the buffer: the allocation is sglang's params_bytes = 2 one.
    nvl, rdma = backend.nvl_rdma_bytes(spec(dtype="bf16"), 8)
    assert plan.total_bytes == plan.bf16_total_bytes == nvl + rdma


@pytest.mark.parametrize("backend_name", ["ascend_deepep", "ascend_fuseep"])
def test_a_small_hccl_buffsize_is_reported_as_the_plugin_checks_it(host, backend_name):
    sizes = pytest.importorskip("moe_dispatch_ascend_deepep.sizes")
    vendor = pytest.importorskip("moe_dispatch_ascend_deepep.vendor")
    pytest.importorskip(f"moe_dispatch_{backend_name}")
    backend = host.get_backend(backend_name)
    layer = spec(dtype="int8", mode="low_latency")
    # The DeepEP-Ascend README's worked number is 452 MB; the op's own tiling check, sized by
    # every local expert rather than min(E_local, k), asks for more, and that is what counts.
    assert vendor.window_mb(vendor.readme_window_bytes(128, 7168, 16, 16, 8)) == 452
    needed = sizes.required_window_mb(layer, 16, {})
    assert needed == 956
    default = plan_buffers(backend, [layer], 16, env={}, host=host)
    (misfit,) = default.misfits
    assert misfit.summary == "needs HCCL_BUFFSIZE >= 956 MB, have 200 (the default)"
    assert (misfit.parameter, misfit.value, misfit.allowed) == ("HCCL_BUFFSIZE", 200, ">= 956")
    assert "have 300" in plan_buffers(backend, [layer], 16, env={"HCCL_BUFFSIZE": "300"}, host=host).misfits[0].summary
    # The planner agrees with the check the backend runs at creation, at the boundary.
    for value, fits in (("955", False), ("956", True), ("1536", True)):
        env = {"HCCL_BUFFSIZE": value}
        assert plan_buffers(backend, [layer], 16, env=env, host=host).fits is fits
        if fits:
            sizes.check_hccl_window(needed, env)
        else:
            with pytest.raises(md.CapacityError):
                sizes.check_hccl_window(needed, env)
    with pytest.raises(md.InvalidSpecError) as err:
        plan_buffers(backend, [layer], 16, env={"HCCL_BUFFSIZE": "lots"}, host=host)
    assert err.value.parameter == "HCCL_BUFFSIZE"


# -- the command ------------------------------------------------------------------------------


def plan_cli(host, *argv, env=None):
    parser = argparse.ArgumentParser(prog="moe-dispatch")
    add_plan_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    out = io.StringIO()
    assert args.func is run_plan_command
    rc = run_plan_command(args, host=host, env={} if env is None else env, out=out)
    return rc, out.getvalue()


def test_plan_table_shows_sizes_saving_and_fit(host):
    rc, text = plan_cli(host, "--preset", "deepseek-v3", "--backend", "torch", "--ep", "8", "--mode", "normal",
                        "--dtype", "bf16", "--dtype", "fp8")
    assert rc == 0
    header, bf16_row, fp8_row = text.splitlines()[:3]
    for column in ("model", "backend", "EP", "mode", "dtype", "dispatch", "combine", "total", "BF16 total", "saving",
                   "fits"):
        assert column in header
    assert bf16_row.split()[:5] == ["deepseek-v3", "torch", "8", "normal", "bf16"] and "0.0%" in bf16_row
    assert fp8_row.split()[4] == "fp8" and "24.2%" in fp8_row and fp8_row.endswith("yes")
    assert "torch: no sglang counterpart" in text


def test_plan_json_has_the_table_fields_in_bytes(host):
    rc, text = plan_cli(host, "--hidden", "4096", "--experts", "64", "--top-k", "4", "--backend", "torch",
                        "--ep", "8", "--ep", "16", "--mode", "low_latency", "--dtype", "fp8", "--tokens", "64",
                        "--json")
    assert rc == 0
    data = json.loads(text)
    assert data["schema"] == 1 and [r["ep"] for r in data["rows"]] == [8, 16]
    row = data["rows"][0]
    expected = TorchBackend().buffer_size(spec(h=4096, e=64, k=4, t=64, mode="low_latency"), 8)
    assert (row["model"], row["mode"], row["dtype"], row["tokens"]) == ("H4096/E64/k4", "low_latency", "fp8", 64)
    assert (row["dispatch_bytes"], row["combine_bytes"], row["total_bytes"]) == (
        expected.dispatch_bytes, expected.combine_bytes, expected.total_bytes)
    assert row["bf16_total_bytes"] > row["total_bytes"] and row["fits"] is True and row["error"] is None


def test_plan_shows_fallbacks_rejections_and_hccl_fit(host):
    pytest.importorskip("moe_dispatch_ascend_deepep")
    rc, text = plan_cli(host, "--preset", "deepseek-v3", "--backend", "ascend_deepep", "--ep", "16", "--mode", "normal",
                        "--dtype", "fp8", "--dtype", "nvfp4", "--json")
    fallback, rejected = json.loads(text)["rows"]
    assert (fallback["requested_dtype"], fallback["dtype"]) == ("fp8", "int8") and fallback["fallback_reason"]
    assert fallback["fits"] is False and fallback["misfits"][0]["summary"].startswith("needs HCCL_BUFFSIZE >= 269 MB")
    assert rejected["error"] and "nvfp4" in rejected["error"] and rejected["total_bytes"] is None
    _, table = plan_cli(host, "--preset", "deepseek-v3", "--backend", "ascend_deepep", "--ep", "16", "--mode", "normal",
                        "--dtype", "fp8", "--dtype", "nvfp4", "--env", "HCCL_BUFFSIZE=1536")
    fp8_line, nvfp4_line = table.splitlines()[1:3]
    assert "int8 (from fp8)" in fp8_line and fp8_line.endswith("yes")
    assert "n/a: output_dtype='nvfp4'" in nvfp4_line


def test_a_mode_the_backend_lacks_is_a_row_that_says_so_and_the_plan_fails(host):
    """A grid whose rows cannot be created is not a plan that fits: exit 1, as for a row that does not fit."""
    pytest.importorskip("moe_dispatch_flashinfer_cutedsl")
    rc, text = plan_cli(host, "--preset", "qwen3-30b-a3b", "--backend", "flashinfer_a2a", "--mode", "low_latency",
                        "--ep", "8", "--json")
    (row,) = json.loads(text)["rows"]
    assert rc == 1 and row["requested_dtype"] == "auto" and row["error"].startswith("mode='low_latency'")


@pytest.mark.parametrize("argv", [["--mode", "sideways"], ["--dtype", "fp16"]])
def test_plan_refuses_an_unknown_dtype_or_mode_when_it_parses_its_flags(host, argv, capsys):
    """One spelling rule for every subcommand (cli/flags.py): argparse's one-line error, exit 2."""
    with pytest.raises(SystemExit) as done:
        plan_cli(host, *argv)
    assert done.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv, error, parameter", [
    (["--hidden", "0"], md.InvalidSpecError, "--hidden"),
    (["--ep", "0"], md.InvalidSpecError, "--ep"),
    (["--env", "HCCL_BUFFSIZE"], md.InvalidSpecError, "--env"),
    (["--env", "HCCL_BUFFSIZE=abc"], md.InvalidSpecError, "--env"),
    (["--env", "HCCL_BUFFSIZE=-5"], md.InvalidSpecError, "--env"),
    (["--preset", "gpt-5"], md.InvalidSpecError, "preset"),
    (["--backend", "no_such_backend"], md.BackendUnavailableError, "backend"),
])
def test_plan_flags_are_checked_with_typed_errors(host, argv, error, parameter):
    with pytest.raises(error) as err:
        plan_cli(host, *argv)
    assert err.value.parameter == parameter and err.value.allowed


def test_default_grid_covers_every_backend_quickly(host):
    started = time.perf_counter()
    rc, text = plan_cli(host, "--json")
    elapsed = time.perf_counter() - started
    rows = json.loads(text)["rows"]
    assert rc == (1 if any(r["fits"] is False or r["error"] for r in rows) else 0) and elapsed < 3.0
    assert {r["backend"] for r in rows} == set(host.backend_names())
    assert {r["model"] for r in rows} == {"deepseek-v3"} and {r["ep"] for r in rows} == {8, 64}
    assert len(text.splitlines()) and len(plan_cli(host)[1].splitlines()) < 100  # a screenful or two, not 391 lines
    # The only rows that say "n/a": an EP size a backend declares it does not run on (cuda_deepep_v2 stays in one
    # NVLink domain), refused with the reason rather than left out.
    sizes = {name: host.get_backend(name).capabilities.world_sizes_for(md.Mode.NORMAL)
             for name in host.backend_names()}
    refused = [r for r in rows if r["error"] is not None]
    assert all(sizes.get(r["backend"]) is not None and r["ep"] not in sizes[r["backend"]] for r in refused), refused


def test_plan_exits_1_when_a_row_does_not_fit_and_refuses_an_unknown_env_name(host):
    """A script planning a deployment must not read "no" as success; a misspelt --env changes nothing."""
    rc, _ = plan_cli(host, "--preset", "deepseek-v3", "--backend", "torch", "--ep", "8")
    assert rc == 0
    # DeepEP-Ascend's normal mode at BF16 needs more HCCL window than the default 200 MB
    rc, text = plan_cli(host, "--preset", "deepseek-v3", "--backend", "ascend_deepep", "--ep", "8", "--mode", "normal",
                        "--dtype", "bf16", "--json")
    assert rc == 1 and [r["fits"] for r in json.loads(text)["rows"]] == [False]
    with pytest.raises(md.InvalidSpecError) as err:
        plan_cli(host, "--backend", "ascend_deepep", "--env", "HCCL_BUFSIZE=2000")
    assert (err.value.parameter, err.value.value) == ("--env", "HCCL_BUFSIZE") and "HCCL_BUFFSIZE?" in str(err.value)


def test_one_rule_for_a_preset_and_explicit_sizes(host):
    """--hidden/--experts/--top-k override the fields of each preset (the same in explain, bench and plan); all three
    without --preset are one custom shape."""
    rc, text = plan_cli(host, "--preset", "deepseek-v3", "--preset", "kimi-k2", "--top-k", "4", "--backend", "torch",
                        "--ep", "8", "--mode", "normal", "--dtype", "bf16", "--json")
    rows = json.loads(text)["rows"]
    assert rc == 0 and [(r["model"], r["top_k"]) for r in rows] == [("deepseek-v3*", 4), ("kimi-k2*", 4)]
    assert [r["hidden_size"] for r in rows] == [7168, 7168] and [r["num_experts"] for r in rows] == [256, 384]
    rc, text = plan_cli(host, "--hidden", "1024", "--experts", "32", "--top-k", "2", "--backend", "torch", "--ep", "8",
                        "--mode", "normal", "--dtype", "bf16", "--json")
    assert [r["model"] for r in json.loads(text)["rows"]] == ["H1024/E32/k2"]


def test_buffers_past_the_machines_memory_do_not_fit(host):
    """What create_dispatcher refuses on this machine (buffers larger than the device's whole memory) is a row that
    does not fit, not "fits: yes"."""
    rc, text = plan_cli(host, "--backend", "torch", "--tokens", "100000000", "--ep", "8", "--mode", "normal",
                        "--dtype", "bf16", "--json")
    (row,) = json.loads(text)["rows"]
    assert rc == 1 and row["fits"] is False
    assert [m["parameter"] for m in row["misfits"]] == ["num_max_dispatch_tokens_per_rank"]
    assert row["misfits"][0]["needed"] > row["misfits"][0]["limit"]
