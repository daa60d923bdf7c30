"""``moe-dispatch demo`` and ``moe-dispatch bench``, registered as any plugin registers a command
(``moe_dispatch_register_commands``). Cheap to import: what runs a command loads when it runs."""

from __future__ import annotations

import argparse

import moe_dispatch as md
from moe_dispatch.backend import Command, hookimpl
from moe_dispatch.cli import flags
from moe_dispatch.cli.presets import PRESETS

from .bench import cli as bench_cli

MOE_DISPATCH_API = 1

#: How much each preset is scaled down for the CPU demo.
DEMO_SCALE = {"qwen3-30b-a3b": 4, "deepseek-v3": 8, "kimi-k2": 8, "mixtral-8x7b": 8}


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=flags.positive_int, default=4, help="local ranks (default 4)")
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS),
                   help="model shape (default qwen3-30b-a3b), scaled down for a CPU (--scale)")
    p.add_argument("--scale", type=flags.positive_int, default=None,
                   help="divide the preset's sizes by this (default per preset; 1: full size)")
    p.add_argument("--tokens", type=flags.positive_int, default=64, help="tokens per rank (default 64)")
    p.add_argument("--backend", default="torch", help="the backend to run (default torch)")
    p.add_argument("--dtype", action="append", type=flags.dtype,
                   help=f"only this dtype: {flags.DTYPES} (repeatable; default every one the backend accepts)")
    p.add_argument("--mode", action="append", type=flags.mode,
                   help=f"only this mode: {flags.MODES} (repeatable; default both)")
    p.add_argument("--launcher", default="local", choices=["local", "torchrun"],
                   help="local: spawn --world-size gloo ranks; torchrun: this process is one rank")


def _demo(args: argparse.Namespace) -> int:
    from moe_dispatch.cli.presets import get_preset

    from .demo import run_demo, run_torchrun

    preset = get_preset(args.preset)
    scale = args.scale if args.scale is not None else DEMO_SCALE.get(preset.name, 1)
    if scale > 1:
        preset = preset.scaled(scale)
    dtypes = [md.DispatchDtype.parse(d) for d in args.dtype] if args.dtype else None
    modes = [md.Mode.parse(m) for m in args.mode] if args.mode else None
    if args.launcher == "torchrun":
        _require_torchrun()
        return run_torchrun(preset, args.tokens, args.backend, dtypes, modes)
    results = run_demo(preset, world_size=args.world_size, tokens_per_rank=args.tokens, dtypes=dtypes, modes=modes,
                       backend=args.backend)
    return 0 if all(r.ok for r in results) else 1


#: What torchrun sets for every worker (env:// rendezvous).
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _require_torchrun() -> None:
    import os

    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise md.InvalidSpecError(f"this process is not a torchrun worker ({', '.join(missing)} not set)",
                                  parameter="--launcher", value="torchrun",
                                  allowed="torchrun: torchrun --nproc-per-node N -m moe_dispatch demo --launcher torchrun;"
                                          " or --launcher local")


@hookimpl
def moe_dispatch_register_commands(register) -> None:  # type: ignore[no-untyped-def]
    register(Command("demo", "run a MoE layer on local CPU ranks for every dtype and mode the backend accepts",
                     _demo_arguments, _demo))
    register(Command("bench", "measure dispatch and combine on local ranks: latency, bytes, ratios to the transport "
                     "floor", bench_cli.add_arguments, bench_cli.run))
