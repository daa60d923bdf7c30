"""``moe-dispatch plan``: buffer sizes over a grid of models, backends, EP sizes, modes and wire dtypes, beside what the
same backend asks for a BF16 wire (sglang's ``params_bytes = 2``), and whether each fits its limits and environment."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TextIO

from .._contract import Backend
from .._errors import InvalidSpecError, MoEDispatchError
from .._registry import PluginHost, default_host
from .._spec import DispatchSpec, QuantHints
from .._wire import DispatchDtype, Mode
from ..planning import BufferPlan, plan_buffers
from ..planning import _human as human_bytes
from . import flags
from .presets import model_shapes

#: Version of ``moe-dispatch plan --json``; bumped only for an incompatible change.
PLAN_JSON_SCHEMA = 1
#: One model on one node and on eight: a screenful per backend (the whole grid is hundreds of lines); --preset/--ep.
DEFAULT_PRESETS = ("deepseek-v3",)
DEFAULT_EP_SIZES = (8, 64)
#: An NVFP4 row needs a global scale to resolve; its value does not change any size.
_PLACEHOLDER_GLOBAL_SCALE = 1.0

_NO_SGLANG = "no sglang counterpart; the BF16 column is this backend sized for a BF16 wire."


@dataclass(frozen=True)
class ModelShape:
    """The layer shape a row is planned for (a preset, or ``--hidden/--experts/--top-k``)."""

    name: str
    hidden_size: int
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class PlanRow:
    """One (model, backend, EP size, mode, requested dtype): its plan, or why it cannot be created.

    :param requested: the dtype asked for; None is ``auto`` (the backend's default).
    :param error: set instead of ``plan`` when ``create_dispatcher`` would refuse the combination.
    """

    model: ModelShape
    backend: str
    world_size: int
    mode: Mode
    requested: DispatchDtype | None
    tokens: int
    plan: BufferPlan | None = None
    error: str | None = None
    #: What the BF16 column means for this backend (``Backend.engine_sizing``).
    sizing: str = _NO_SGLANG

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        layer = plan.layers[0] if plan is not None else None
        return {
            "model": self.model.name,
            "hidden_size": self.model.hidden_size,
            "num_experts": self.model.num_experts,
            "top_k": self.model.top_k,
            "backend": self.backend,
            "ep": self.world_size,
            "mode": self.mode.value,
            "tokens": self.tokens,
            "requested_dtype": "auto" if self.requested is None else self.requested.value,
            "dtype": None if layer is None else layer.dtype.value,
            "fallback_reason": None if layer is None else layer.resolution.fallback_reason,
            "dispatch_bytes": None if layer is None else layer.size.dispatch_bytes,
            "combine_bytes": None if layer is None else layer.size.combine_bytes,
            "total_bytes": None if plan is None else plan.total_bytes,
            "bf16_total_bytes": None if plan is None else plan.bf16_total_bytes,
            "saving_fraction": None if plan is None else round(plan.saving_fraction, 6),
            "shared": None if plan is None else plan.shared,
            "fits": None if plan is None else plan.fits,
            "misfits": [] if plan is None else [m.to_dict() for m in plan.misfits],
            "notes": [] if layer is None else list(layer.size.notes),
            "error": self.error,
        }


def plan_grid(models: Sequence[ModelShape], backends: Sequence[Backend], world_sizes: Sequence[int], *,
              modes: Sequence[Mode] | None = None, dtypes: Sequence[DispatchDtype | None] | None = None,
              tokens: int = 128, env: Mapping[str, str] | None = None, host: PluginHost | None = None) -> list[PlanRow]:
    """Plan one layer per grid point. ``modes`` None: each backend's modes; ``dtypes`` None: each mode's accepted
    dtypes. A combination named explicitly that the backend refuses (a mode it lacks, a rejected dtype, an EP size it
    does not support) becomes a row with the error; a fallback becomes a row with the dtype actually sent."""
    host = host or default_host()
    env = os.environ if env is None else env
    rows: list[PlanRow] = []
    for model in models:
        for backend in backends:
            caps = backend.capabilities
            for ep in world_sizes:
                for mode in modes if modes is not None else caps.modes:
                    # A mode the backend lacks, asked for by name: one row that says so.
                    wanted = dtypes if dtypes is not None else sorted(
                        caps.dtypes.get(mode, ()), key=list(DispatchDtype).index) or [None]
                    for dtype in wanted:
                        rows.append(_plan_row(model, backend, ep, mode, dtype, tokens, env, host))
    return rows


def _plan_row(model: ModelShape, backend: Backend, ep: int, mode: Mode, dtype: DispatchDtype | None, tokens: int,
              env: Mapping[str, str], host: PluginHost) -> PlanRow:
    sizing = backend.engine_sizing or _NO_SGLANG
    try:
        nvfp4 = dtype is DispatchDtype.NVFP4
        quant = QuantHints(input_global_scale=_PLACEHOLDER_GLOBAL_SCALE) if nvfp4 else QuantHints()
        spec = DispatchSpec(model.hidden_size, model.num_experts, model.top_k, tokens, mode=mode, output_dtype=dtype,
                            quant=quant)
        plan = plan_buffers(backend, {model.name: spec}, ep, env=env, host=host)
    except MoEDispatchError as exc:  # what create_dispatcher would refuse: a row that says why
        return PlanRow(model, backend.name, ep, mode, dtype, tokens, error=str(exc).splitlines()[0], sizing=sizing)
    return PlanRow(model, backend.name, ep, mode, dtype, tokens, plan=plan, sizing=sizing)


def _human(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def _dtype_cell(row: PlanRow) -> str:
    if row.plan is None:
        return "auto" if row.requested is None else row.requested.value
    got = row.plan.layers[0].dtype.value
    if row.requested is None:
        return f"{got} (auto)"
    if row.plan.layers[0].resolution.is_fallback:
        return f"{got} (from {row.requested.value})"
    return got


def _fits_cell(row: PlanRow) -> str:
    if row.plan is None:
        return f"n/a: {row.error}"
    if row.plan.fits:
        return "yes"
    return "no: " + "; ".join(m.summary or m.message for m in row.plan.misfits)


def format_plan_table(rows: Sequence[PlanRow]) -> str:
    """The table ``moe-dispatch plan`` prints, then what the BF16 column means per backend."""
    head = ("model", "backend", "EP", "mode", "dtype", "dispatch", "combine", "total", "BF16 total", "saving", "fits")
    cells = []
    for r in rows:
        p = r.plan
        cells.append((
            r.model.name, r.backend, str(r.world_size), r.mode.value, _dtype_cell(r),
            _human(p.dispatch.bytes if p else None), _human(p.combine.bytes if p else None),
            _human(p.total_bytes if p else None), _human(p.bf16_total_bytes if p else None),
            f"{100 * p.saving_fraction:.1f}%" if p else "-", _fits_cell(r)))
    widths = [max([len(h), *(len(c[i]) for c in cells)]) for i, h in enumerate(head[:-1])]
    right = {2, 5, 6, 7, 8, 9}  # numbers

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join([*parts, values[-1]]).rstrip()

    out = [line(head)]
    previous = None
    for r, c in zip(rows, cells):
        if previous is not None and (r.model, r.backend) != previous:
            out.append("")
        previous = (r.model, r.backend)
        out.append(line(c))
    tokens = sorted({r.tokens for r in rows})
    out += ["", f"num_max_dispatch_tokens_per_rank = {', '.join(map(str, tokens))}; total is what one allocation "
                "for the layer takes (a shared buffer counts once); saving = 1 - total / BF16 total.",
            "BF16 total, per backend:"]
    for name, sizing in sorted({(r.backend, r.sizing) for r in rows}):
        out.append(f"  {name}: {sizing}")
    return "\n".join(out)


def plan_report(rows: Sequence[PlanRow]) -> dict[str, Any]:
    """The ``plan --json`` document: every row with the table's fields in bytes."""
    return {
        "schema": PLAN_JSON_SCHEMA,
        "rows": [r.to_dict() for r in rows],
        "bf16_sizing": dict(sorted({(r.backend, r.sizing) for r in rows})),
    }


def add_plan_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``moe-dispatch`` subcommands (``subparsers`` from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "plan", help="buffer sizes per model, backend, EP size, mode and wire dtype, against sglang's BF16 sizing",
        description="Buffer sizes over a grid of models, backends, EP sizes, modes and wire dtypes, beside what the "
                    "same backend asks for a BF16 wire (sglang's fixed params_bytes = 2), and whether each fits the "
                    "backend's limits and the environment. Nothing is allocated; backends need not run here.")
    p.add_argument("--preset", action="append", default=None,
                   help=f"model preset (repeatable; default {', '.join(DEFAULT_PRESETS)}); --hidden/--experts/"
                        "--top-k override its fields, all three without --preset are a custom shape")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: each preset's)")
    p.add_argument("--experts", type=int, default=None, help="number of experts (default: each preset's)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: each preset's)")
    p.add_argument("--ep", type=int, action="append", default=None,
                   help=f"EP size (repeatable; default {' '.join(map(str, DEFAULT_EP_SIZES))})")
    p.add_argument("--dtype", action="append", default=None, type=flags.dtype_or_auto,
                   help=f"wire dtype ({flags.DTYPES}) or auto (repeatable; default every dtype the backend accepts "
                        "in the mode)")
    p.add_argument("--backend", action="append", default=None,
                   help="backend (repeatable; default every registered one)")
    p.add_argument("--mode", action="append", default=None, type=flags.mode,
                   help=f"{flags.MODES} (repeatable; default each mode the backend has)")
    p.add_argument("--tokens", type=int, default=128, help="num_max_dispatch_tokens_per_rank (default 128)")
    p.add_argument("--env", action="append", default=None, metavar="NAME=VALUE",
                   help="plan as if NAME were set to VALUE, e.g. HCCL_BUFFSIZE=1536 (repeatable)")
    p.add_argument("--json", action="store_true", help=f"JSON for scripts (schema {PLAN_JSON_SCHEMA})")
    p.set_defaults(func=run_plan_command)
    return p


def run_plan_command(args: argparse.Namespace, *, host: PluginHost | None = None,
                     env: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    """What ``moe-dispatch plan`` runs, for ``env`` (None: ``os.environ``; never written) overlaid with ``--env``."""
    host = host or getattr(args, "plugin_host", None) or default_host()
    models = _models(args)
    backends = [host.get_backend(name) for name in args.backend] if args.backend else [
        host.get_backend(name) for name in host.backend_names() if _registered(host, name)]
    for ep in args.ep or ():
        if ep <= 0:
            raise InvalidSpecError("must be a positive EP size", parameter="--ep", value=ep, allowed="1, 2, 3, ...")
    if args.tokens <= 0:
        raise InvalidSpecError("must be positive", parameter="--tokens", value=args.tokens, allowed="1, 2, 3, ...")
    modes = [Mode.parse(m, parameter="--mode") for m in args.mode] if args.mode else None
    dtypes = [DispatchDtype.parse(d, parameter="--dtype") for d in args.dtype] if args.dtype else None
    eps = args.ep or DEFAULT_EP_SIZES
    _check_env_names(args.env or (), backends, models, eps, modes or list(Mode), args.tokens)
    rows = plan_grid(models, backends, eps, modes=modes, dtypes=dtypes, tokens=args.tokens,
                     env=_overlay(os.environ if env is None else env, args.env or ()), host=host)
    print(json.dumps(plan_report(rows), indent=2) if args.json else format_plan_table(rows), file=out)  # None: stdout
    misfits = sum(1 for r in rows if r.plan is not None and not r.plan.fits)
    invalid = sum(1 for r in rows if r.plan is None)
    if misfits or invalid:  # a script (or CI) planning a deployment must not read "no" as success
        what = [f"{n} {why}" for n, why in ((misfits, "do not fit (the fits column)"),
                                           (invalid, "cannot be created (the error column)")) if n]
        print(f"moe-dispatch plan: of {len(rows)} rows, {' and '.join(what)}", file=sys.stderr)
        return 1
    return 0


def _check_env_names(assignments: Sequence[str], backends: Sequence[Backend], models: Sequence[ModelShape],
                     eps: Sequence[int], modes: Sequence[Mode], tokens: int) -> None:
    """``--env`` names a variable some planned backend reads (``Backend.env_requirements``): a misspelt one would
    change nothing and the table would look planned for it."""
    if not assignments:
        return
    known: set[str] = set()
    for backend in backends:
        for model in models:
            for mode in modes:
                spec = DispatchSpec(model.hidden_size, model.num_experts, model.top_k,
                                    num_max_dispatch_tokens_per_rank=tokens, mode=mode)
                for ep in eps:
                    try:
                        known |= {r.variable for r in backend.env_requirements(spec, ep)}
                    except MoEDispatchError:  # a shape this backend refuses: it reads nothing for it
                        continue
    for item in assignments:
        name = item.partition("=")[0]
        if name and name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=1)
            raise InvalidSpecError(
                "no planned backend reads this variable" + (f" (did you mean {near[0]}?)" if near else ""),
                parameter="--env", value=name, allowed=", ".join(sorted(known)) or "none: no planned backend reads one")


def _registered(host: PluginHost, name: str) -> bool:
    """Skip a name two distributions both register: it has no one backend to plan."""
    try:
        host.get_backend(name)
    except MoEDispatchError:
        return False
    return True


def _models(args: argparse.Namespace) -> list[ModelShape]:
    return [ModelShape(*shape) for shape in model_shapes(args.preset, list(DEFAULT_PRESETS), args.hidden,
                                                         args.experts, args.top_k)]


def _overlay(env: Mapping[str, str], assignments: Sequence[str]) -> Mapping[str, str]:
    if not assignments:
        return env
    merged = dict(env)
    for item in assignments:
        name, sep, value = item.partition("=")
        if not sep or not name or not (value.isascii() and value.isdigit()):  # whole numbers all (EnvRequirement)
            raise InvalidSpecError("must be NAME=VALUE with a whole number >= 0 in the variable's unit",
                                   parameter="--env", value=item, allowed="e.g. HCCL_BUFFSIZE=1536")
        merged[name] = value
    return merged


__all__ = ["DEFAULT_EP_SIZES", "DEFAULT_PRESETS", "ModelShape", "PLAN_JSON_SCHEMA", "PlanRow",
           "add_plan_command", "format_plan_table", "plan_grid", "plan_report", "run_plan_command"]
