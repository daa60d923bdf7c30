"""The ``moe-dispatch`` command as a user runs it."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

EXE = [sys.executable, "-m", "moe_dispatch"]


def run(*args, env=None, timeout=120):
    """The command in a process of its own (what a user runs: exit status, stdout, stderr)."""
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def run_here(capsys, *args, env=None):
    """The command's ``main`` in this process (a process each costs a second and a half of torch's import), on
    its own plugin host when ``env`` is given."""
    from moe_dispatch import PluginHost
    from moe_dispatch.cli import main

    try:
        status = main(list(args), host=None if env is None else PluginHost(env=env))
    except SystemExit as exc:  # argparse's own exits (--version, a bad flag)
        status = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out.out, out.err)


def test_backends_json_is_parseable_and_lists_the_builtins(capsys):
    p = run_here(capsys, "backends", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["schema"] == 1
    names = {b["name"]: b for b in data["backends"]}
    assert names["torch"]["available"] and names["allgather"]["available"]
    assert set(names["torch"]["capabilities"]["modes"]) == {"normal", "low_latency"}


def test_explain_prints_the_trail_and_buffers(capsys):
    p = run_here(capsys, "explain", "--backend", "torch", "--quant", '{"dispatcher_output_dtype": "int8"}', "--mode", "low_latency")
    assert p.returncode == 0, p.stderr
    assert "quant.dispatcher_output_dtype" in p.stdout and "int8" in p.stdout
    assert "7,172 bytes per token" in p.stdout and "buffers: dispatch" in p.stdout


def test_explain_reports_a_typo_as_an_error_not_a_traceback(capsys):
    p = run_here(capsys, "explain", "--backend", "torch", "--quant", '{"dispather_output_dtype": "int8"}')
    assert p.returncode == 2 and "did you mean dispatcher_output_dtype" in p.stderr
    assert "Traceback" not in p.stderr


def test_demo_runs_on_local_ranks():
    p = run("demo", "--world-size", "2", "--dtype", "int8", "--mode", "low_latency", "--tokens", "16")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all cases within tolerance: True" in p.stdout


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
                    reason="torchrun is not installed")
def test_demo_under_torchrun_uses_env_rendezvous_and_only_rank_0_reports():
    """(Across two nodes, the same launcher and rendezvous: tests/test_multinode.py's kit check.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    p = subprocess.run(
        [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "moe_dispatch", "demo", "--launcher", "torchrun", "--dtype", "fp8", "--tokens", "16"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all cases within tolerance: True" in p.stdout and p.stdout.count("all cases within tolerance") == 1
    assert "2 ranks" in p.stdout
    rows = [line for line in p.stdout.splitlines() if re.match(r"fp8\s+(normal|low_latency)\s", line)]
    assert len(rows) == 2 and all(row.endswith("yes") for row in rows), p.stdout


# -- one line and exit 2 for every bad flag -------------------------------------------------------------


@pytest.mark.parametrize("argv,names", [
    (["explain", "--backend", "torch", "--quant", "{bad"], "--quant"),
    (["explain", "--backend", "torch", "--quant", "[1, 2]"], "--quant"),
    (["explain", "--backend", "torch", "--top-k", "0"], "top_k"),
    (["explain", "--backend", "torch", "--experts", "0"], "num_experts"),
    (["explain", "--backend", "torch", "--hidden", "0"], "hidden_size"),
    (["explain", "--backend", "torch", "--world-size", "0"], "--world-size"),
    (["demo", "--world-size", "0"], "--world-size"),
    (["demo", "--tokens", "-3"], "--tokens"),
    (["demo", "--backend", "cuda_deepep"], "cuda_deepep"),
    (["bench", "--dtype", "xx"], "--dtype"),
    (["bench", "--hidden", "500", "--experts", "8", "--top-k", "2", "--dtype", "fp8", "--only", "cases"], "hidden_size"),
    (["demo", "--world-size", "3"], "num_experts"),
    (["explain"], "--backend"),
    (["demo", "--scale", "0"], "--scale"),
    (["demo", "--scale", "-2"], "--scale"),
    (["bench", "--plot", "/nonexistent/dir/x.png", "--only", "overhead"], "--plot"),
    (["bench", "--plot", "x.txt", "--only", "overhead"], "--plot"),
    (["demo", "--launcher", "torchrun"], "--launcher"),
    # buffers past the machine's memory: what create_dispatcher refuses, refused before any rank starts
    (["explain", "--backend", "torch", "--tokens", "100000000"], "num_max_dispatch_tokens_per_rank"),
    (["demo", "--tokens", "100000000"], "num_max_dispatch_tokens_per_rank"),
    (["bench", "--tokens", "100000000", "--only", "cases", "--dtype", "bf16", "--mode", "normal"],
     "num_max_dispatch_tokens_per_rank"),
])
def test_a_bad_flag_is_one_line_and_exit_2(argv, names, capsys):
    """In process (the command's ``main``; a process each cost 36 s of the suite); the process itself: below."""
    from moe_dispatch.cli.main import main

    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's refusals
        status = exc.code
    out = capsys.readouterr()
    assert status == 2, out.out + out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in out.err, out.err
    assert "started" not in out.out  # refused before any rank starts


@pytest.mark.parametrize("argv,names", [
    (["explain", "--backend", "torch", "--quant", "{bad"], "--quant"),  # argparse's refusal
    (["explain", "--backend", "torch", "--top-k", "0"], "top_k"),  # the spec's (MoEDispatchError)
])
def test_a_bad_flag_ends_the_process_with_one_line_and_exit_2(argv, names):
    p = run(*argv)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_version(capsys):
    from moe_dispatch import __version__

    p = run_here(capsys, "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"moe-dispatch {__version__}" and __version__[0].isdigit()


def test_a_reader_that_leaves_early_is_not_an_error():
    """`moe-dispatch plan | head`: the reader is gone before the writer writes (its end of the pipe closed)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        writer = subprocess.run([*EXE, "plan", "--backend", "torch"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert writer.returncode == 0 and "BrokenPipeError" not in writer.stderr and writer.stderr == "", writer.stderr


def test_a_misspelt_plugin_in_the_allow_list_gets_a_suggestion(capsys):
    p = run_here(capsys, "backends", env={**os.environ, "MOE_DISPATCH_PLUGINS": "cuda_depep"})
    assert p.returncode == 0
    line = next(line for line in p.stdout.splitlines() if line.startswith("cuda_depep"))
    assert "missing" in line and "did you mean cuda_deepep?" in line


@pytest.mark.parametrize("argv", [
    ["explain", "--backend", "torch"],
    ["plan", "--backend", "torch", "--ep", "8", "--preset", "deepseek-v3"],
])
def test_every_subcommand_takes_the_same_spellings_of_dtypes_and_modes(argv, capsys):
    """One rule (``DispatchDtype.parse``/``Mode.parse``): any case, low-latency or low_latency. In process
    (the command's ``main``): the parsing is the point, and a process per spelling cost 20 s of the suite."""
    from moe_dispatch.cli.main import main

    for dtype, mode in (("FP8", "low-latency"), ("fp8", "low_latency"), ("Fp8", "LOW_LATENCY")):
        status = main([*argv, "--dtype", dtype, "--mode", mode])
        out = capsys.readouterr()
        assert status == 0, out.err
        assert "low_latency" in out.out and "fp8" in out.out
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--mode", "fast"])
    assert exited.value.code == 2 and "one of: normal, low_latency" in capsys.readouterr().err


def test_the_flag_types_are_the_api_spellings():
    from moe_dispatch.cli import flags

    assert flags.dtype("NVFP4") == "nvfp4" and flags.dtype_or_auto("Auto") == "auto" and flags.mode("Normal") == "normal"
    for bad in ("auto", "fp4"):
        with pytest.raises(Exception) as err:
            flags.dtype(bad)
        assert type(err.value).__name__ == "ArgumentTypeError"


def test_every_option_of_every_builtin_subcommand_has_help():
    import argparse

    from moe_dispatch.cli.main import build_parser

    parser = build_parser()
    missing = [(name, action.option_strings)
               for name, sub in parser._subparsers._group_actions[0].choices.items()  # noqa: SLF001 - argparse's own
               for action in sub._actions  # noqa: SLF001
               if not isinstance(action, argparse._HelpAction) and not action.help]  # noqa: SLF001
    assert missing == []
