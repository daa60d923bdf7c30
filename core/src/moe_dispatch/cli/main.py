"""The ``moe-dispatch`` command: backends, explain, plan, and the subcommands plugins register
(``moe_dispatch_register_commands``: ``demo`` and ``bench`` come with moe-dispatch-testing)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn, Sequence

from .. import _hookspecs as hookspecs
from .._dispatcher import plan_alignment
from .._errors import InvalidSpecError, MoEDispatchError
from .._loading import core_version
from .._registry import PluginHost, default_host
from .._spec import DispatchSpec, QuantHints
from . import flags
from .explain import explain
from .flags import positive_int
from .presets import PRESETS, get_preset

#: Version of ``moe-dispatch backends --json`` output; bumped only for an incompatible change.
BACKENDS_JSON_SCHEMA = 1


def backends_report(host: "PluginHost") -> dict[str, object]:
    """The ``backends --json`` document (schema in docs/cli.md)."""
    return {
        "schema": BACKENDS_JSON_SCHEMA,
        "core": {"version": core_version(), "api_version": hookspecs.API_VERSION},
        "backends": [i.to_dict() for i in host.available_backends()],
        "plugins": [
            {"name": p.name, "module": p.module, "distribution": p.distribution, "version": p.version,
             "builtin": p.builtin, "ok": p.ok, "error": p.error, "environ_changes": list(p.environ_changes)}
            for p in host.plugins
        ],
        "allow_list_unmatched": host.allow_list_unmatched,
        "runners": [info.to_dict() for _, info in sorted(host.runners().items())],
        "commands": [{"name": name, "help": command.help, "distribution": label}
                     for name, (command, label) in host.commands().items()],
        "command_conflicts": {name: [p.label() for p in owners] for name, owners in host.command_conflicts.items()},
    }


def _cmd_backends(args: argparse.Namespace) -> int:
    host = args.plugin_host
    if args.json:
        print(json.dumps(backends_report(host), indent=2, sort_keys=True))
        return 0
    infos = host.available_backends()
    dists = [f"{i.distribution or '-'} {i.version or ''}".strip() for i in infos]
    w = max([34, *(len(d) + 1 for d in dists)])
    print(f"{'name':<20} {'distribution':<{w}} {'status':<12} modes / why not")
    for info, dist in zip(infos, dists):
        if info.available and info.capabilities:
            detail = "; ".join(f"{m}: {', '.join(d)}" for m, d in info.capabilities["modes"].items())
        else:
            detail = info.reason or ""
        print(f"{info.name:<20} {dist:<{w}} {info.status:<12} {detail}")
        if info.install_hint:
            print(f"{'':<20} {'':<{w}} {'':<12} to install: {info.install_hint}")
    for name in host.allow_list_unmatched:
        near = host.allow_list_suggestion(name)
        hint = f" (did you mean {near}?)" if near else ""
        print(f"{name:<20} {'-':<{w}} {'missing':<12} named in MOE_DISPATCH_PLUGINS but not installed{hint}")
    if any(i.status == "broken" for i in infos):
        print("\nbroken plugins are skipped; `moe-dispatch backends --json` has their tracebacks")
    changed = [(f"plugin {p.label()}", p.environ_changes) for p in host.plugins if p.environ_changes] + [
        (f"backend {i.name} (probe)", i.environ_changes) for i in infos if i.environ_changes]
    if changed:
        print("\nthe environment, changed by plugins (kept: none steers dispatch):")
        for who, names in changed:
            print(f"  {who}: {', '.join(names)}")
    print(f"\n{'runner':<20} {'needs':<6} {'takes':<24} {'runs here':<10} behind")
    for name, runner in sorted(host.runners().items()):
        r = runner.to_dict()
        takes = ", ".join(r["accepts"]) if r["accepts"] else "any"
        behind = "; ".join(f"{b} ({'/'.join(m)})" for b, m in r["backends"].items()) if r["backends"] else "any backend"
        here = {True: "yes", False: "no", None: "-"}[r["available"]]
        print(f"{name:<20} {r['needs'] or 'any':<6} {takes:<24} {here:<10} {behind}")
        if r["reason"]:
            print(f"{'':<20} {'':<6} {'':<24} {'':<10} why not: {r['reason']}")
    if host.commands() or host.command_conflicts:
        print(f"\n{'command':<20} from")
        for name, (_, label) in host.commands().items():
            print(f"moe-dispatch {name:<7} {label}")
        for name, owners in host.command_conflicts.items():
            print(f"moe-dispatch {name:<7} left out: registered by both {' and '.join(p.label() for p in owners)}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    host = args.plugin_host
    preset = get_preset(args.preset)
    quant = QuantHints.from_dict(_json_object(args.quant, "--quant")) if args.quant else QuantHints()
    spec = DispatchSpec(  # an explicit 0 is refused by the spec, never replaced by the preset's value
        hidden_size=preset.hidden_size if args.hidden is None else args.hidden,
        num_experts=preset.num_experts if args.experts is None else args.experts,
        top_k=preset.top_k if args.top_k is None else args.top_k, num_max_dispatch_tokens_per_rank=args.tokens,
        mode=args.mode, output_dtype=args.dtype, quant=quant, runner=args.runner,
        expert_alignment=args.expert_alignment)
    layer = explain(spec, args.backend, args.world_size, strict=args.strict, host=host)
    backend, resolution, buffers = layer.backend, layer.resolution, layer.buffer_size
    wire = layer.spec.wire_format()
    reason = host.probe(backend)
    alignment = plan_alignment(backend, spec.mode, spec.expert_alignment)
    if args.json:
        print(json.dumps({
            "spec": spec.to_dict(),
            "world_size": args.world_size,
            "backend_description": backend.description,
            "resolution": resolution.to_dict(),
            "wire_bytes_per_token": wire.bytes_per_token,
            "buffer_size": buffers.to_dict(),
            "expert_alignment": {"alignment": alignment.alignment, "native": alignment.native, "note": alignment.note},
            "available": reason is None,
            "reason": reason,
        }, indent=2))
        return 0
    print(f"spec: H={spec.hidden_size} E={spec.num_experts} top-{spec.top_k} T={spec.num_max_dispatch_tokens_per_rank} "
          f"mode={spec.mode.value} on {args.world_size} ranks")
    if backend.description:
        print(f"backend {backend.name!r}: {backend.description}")
    print(resolution)
    print(f"wire: {wire.bytes_per_token:,} bytes per token ({wire.ratio_to_bf16:.3f} of bf16); "
          f"combine {wire.combine_bytes_per_token:,} bytes (bf16)")
    print(f"buffers: dispatch {buffers.dispatch_bytes:,} B, combine {buffers.combine_bytes:,} B, "
          f"total {buffers.total_bytes:,} B")
    for note in buffers.notes:
        print(f"  {note}")
    print(f"expert rows: {alignment.note}")
    if reason:
        print(f"note: backend {backend.name!r} cannot run on this machine: {reason}")
    runner = host.runners().get(spec.runner) if spec.runner else None
    why_not = runner.to_dict()["reason"] if runner is not None else None  # probes once
    if why_not:
        print(f"note: runner {spec.runner!r} cannot run on this machine: {why_not}")
    return 0


def _json_object(text: str, flag: str) -> dict:  # type: ignore[type-arg]
    """``text`` parsed as a JSON object, or an ``InvalidSpecError`` naming ``flag`` (one line, exit 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidSpecError(f"is not valid JSON ({exc.msg} at character {exc.pos})", parameter=flag, value=text,
                               allowed='a JSON object, e.g. \'{"dispatcher_output_dtype": "int8"}\'') from None
    if not isinstance(value, dict):
        raise InvalidSpecError("must be a JSON object", parameter=flag, value=text,
                               allowed='a JSON object, e.g. \'{"dispatcher_output_dtype": "int8"}\'')
    return value


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr and exit 2 (argparse prints its whole usage block first); ``-h`` shows it."""

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser(host: PluginHost | None = None) -> argparse.ArgumentParser:
    """The built-in subcommands, then those the plugins of ``host`` (the default one) register."""
    parser = _Parser(prog="moe-dispatch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"moe-dispatch {core_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list backends and expert runners, whether they run here, and why not")
    p.add_argument("--json", action="store_true", help="stable JSON for scripts (schema 1)")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("explain", help="show how the wire dtype is chosen and the buffer sizes")
    p.add_argument("--backend", required=True, help="the backend to explain (need not run here)")
    p.add_argument("--dtype", default="auto", type=flags.dtype_or_auto,
                   help=f"wire dtype asked for: auto, {flags.DTYPES} (default auto: the resolution decides)")
    p.add_argument("--quant", default=None, help='quant hints as JSON, e.g. \'{"dispatcher_output_dtype": "int8"}\'')
    p.add_argument("--mode", default="normal", type=flags.mode, help=f"{flags.MODES} (default normal)")
    p.add_argument("--runner", default=None,
                   help="the expert runner the dtype must suit (moe-dispatch backends lists them)")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS),
                   help="model shape (default deepseek-v3); --hidden/--experts/--top-k override its fields")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: the preset's)")
    p.add_argument("--experts", type=int, default=None, help="number of experts (default: the preset's)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: the preset's)")
    p.add_argument("--tokens", type=positive_int, default=128, help="num_max_dispatch_tokens_per_rank (default 128)")
    p.add_argument("--world-size", type=positive_int, default=8, help="EP ranks (default 8)")
    p.add_argument("--expert-alignment", type=positive_int, default=1,
                   help="each expert's PACKED rows at a multiple of this (DeepGEMM: 128; default 1, dense)")
    p.add_argument("--strict", action="store_true", help="a dtype fallback is an error")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.set_defaults(func=_cmd_explain)

    from .plan import add_plan_command
    add_plan_command(sub)
    for name, (command, label) in (host or default_host()).commands().items():
        p = sub.add_parser(name, help=f"{command.help} [{label}]")
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None, *, host: PluginHost | None = None) -> int:
    """The command line on ``host`` (the process's default one when None)."""
    host = host or default_host()
    args = build_parser(host).parse_args(argv)
    args.plugin_host = host  # every subcommand asks this host
    try:
        return int(args.func(args))
    except MoEDispatchError as exc:
        print(f"moe-dispatch: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`moe-dispatch plan | head`): not an error of ours
        _quiet_stdout()
        return 0


def _quiet_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush does not raise again
    (the recipe in Python's signal documentation)."""
    import os
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (captured output)
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
