"""The checks ``scripts/hardware_check.py`` runs: the adapter on the real DeepEP-Ascend and
torch_npu against the same adapter on the CPU fakes, the recorded signatures against the
installed vendor, the HCCL window formulas, and the open questions only an NPU can settle.

Every check is a ``Row``: ``ok`` True/False, or None for a measurement or a vendor message to
read. The fakes are chosen by module-name string (``FAKE``, ``TORCH_NPU_FAKE``), as the adapter
takes the vendor's. With ``Options(fake=True)`` the fakes stand in for the vendor too
(CPU, gloo): the same code runs, which is how the tests know the script works.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import dequantize_rows, restored_environ
from moe_dispatch_ascend_deepep import sizes, vendor as v
from moe_dispatch_ascend_deepep.experts import SCHEMES, NpuExperts, pack_int4
from moe_dispatch_testing import random_expert_weights, relative_error

from . import FAKE, SIGNATURES, TORCH_NPU_FAKE, ascend_backend


@dataclass(frozen=True)
class Row:
    part: str
    check: str
    ok: bool | None
    detail: str = ""


@dataclass(frozen=True)
class Options:
    fake: bool = False
    hidden: int = 7168
    tokens: int = 64
    experts_per_rank: int = 8
    top_k: int = 8
    intermediate: int = 512
    parts: tuple[str, ...] = ("platform", "signatures", "windows", "deepep", "runners", "fuseep")
    #: Opt-in probes that may fail on the device or corrupt its memory (see VENDOR.md).
    probe_neg_one_unset: bool = False
    probe_mode2_tokens: bool = False
    probe_fused_neg_one: bool = False
    tolerance: dict[str, float] = field(default_factory=lambda: {"bf16": 1e-2, "int8": 3e-2})

    @property
    def deep_ep(self) -> str:
        return FAKE if self.fake else v.REAL

    @property
    def torch_npu(self) -> str:
        return TORCH_NPU_FAKE if self.fake else v.TORCH_NPU

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.fake else "npu")


def _guard(part: str, check: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """A check that raises is a failed row with the exception, not a crashed script."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return [Row(part, check, False, last[:300])]


def _probe(part: str, check: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """A question for the vendor: its answer, a result or an exception, is information."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the vendor's answer
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return [Row(part, check, None, f"raised: {last[:300]}")]


# -- signatures ----------------------------------------------------------------------------------------


def deep_ep_source_rows(buffer_py: Path) -> list[Row]:
    """Each method the adapter calls, read by AST from an installed ``deep_ep/buffer.py``, against every
    signature a supported build has (``vendor.RECORDED_VERSIONS``)."""
    from moe_dispatch_testing.signatures import compare, signature_from_source

    rows = []
    for qualname, recs in v.RECORDED_VERSIONS.items():
        got = signature_from_source(buffer_py, qualname)
        ok = any(not compare(r.params, got) for r in recs)
        rows.append(Row("signatures", f"deep_ep {qualname} = a recorded version", ok,
                        str(buffer_py) if ok else f"{[p.name for p in got]} is none of the {len(recs)} recorded"))
    return rows


def _signature_rows(opts: Options) -> list[Row]:
    from moe_dispatch.backend import VendorSignature
    from moe_dispatch_testing.signatures import compare, differences

    rows: list[Row] = []
    fake_npu = importlib.import_module(TORCH_NPU_FAKE)
    for rec in v.TORCH_NPU_SIGNATURES:  # the callables' registered schemas
        rows.append(Row("signatures", f"fake {rec.qualname} = registered schema",
                        not differences(rec, getattr(fake_npu, rec.qualname))))
    library = v.torch_npu_library_path()
    blob = Path(library).read_bytes() if library else None
    for rec in v.TORCH_NPU_SIGNATURES:  # the installed libtorch_npu.so, read without loading it (no CANN needed)
        if blob is None:
            rows.append(Row("signatures", f"torch_npu {rec.qualname} schema (.so)", None, "torch_npu not installed"))
            continue
        schema = v.registered_schema(blob, rec.qualname)
        problems = ["not registered"] if schema is None else compare(
            rec.params, VendorSignature(rec.qualname, v.schema_params(schema), library or "").params)
        rows.append(Row("signatures", f"torch_npu {rec.qualname} schema (.so) = recorded", not problems,
                        "; ".join(problems)))
    docs = v.torch_npu_docs_path()
    text = Path(docs).read_text(encoding="utf-8") if docs else None
    for rec in v.TORCH_NPU_DOC_SIGNATURES:  # what the docs say (they differ from the callables: information)
        if text is None:
            continue
        documented = v.documented_signature(text, rec.qualname)
        problems = ["not documented"] if documented is None else compare(
            rec.params, VendorSignature(rec.qualname, documented, docs or "").params)
        rows.append(Row("signatures", f"torch_npu {rec.qualname} docstring = recorded docs", None,
                        "; ".join(problems) or "as recorded"))
    if not opts.fake:  # the registered op schemas of the imported torch_npu (CANN present)
        rows += _guard("signatures", "torch_npu op schemas", lambda: _schema_rows())
    for fake_module, records in SIGNATURES.items():
        buffer = importlib.import_module(fake_module).Buffer
        bad = [p for rec in records for p in differences(rec, getattr(buffer, rec.qualname.split(".")[1]))]
        rows.append(Row("signatures", f"{fake_module.rsplit('.', 1)[1]} Buffer = recorded", not bad, "; ".join(bad)))
    spec = importlib.util.find_spec(v.REAL)
    buffer_py = (Path(list(spec.submodule_search_locations)[0]) / "buffer.py"
                 if spec is not None and spec.submodule_search_locations else None)
    if buffer_py is None or not buffer_py.exists():
        rows.append(Row("signatures", "deep_ep buffer.py = a recorded version", None, "deep_ep not installed"))
    else:
        rows += _guard("signatures", "deep_ep buffer.py", lambda: deep_ep_source_rows(buffer_py))
    return rows


def _schema_rows() -> list[Row]:
    """``torch.ops.npu.<op>`` (what ``torch_npu.npu_<op>`` is) against the record: names, kinds, defaults."""
    from moe_dispatch.backend import VendorSignature
    from moe_dispatch_testing.signatures import compare

    importlib.import_module(v.TORCH_NPU)
    rows = []
    for rec in v.TORCH_NPU_SIGNATURES:
        schema = str(getattr(torch.ops.npu, rec.qualname).default._schema)
        problems = compare(rec.params, VendorSignature(rec.qualname, v.schema_params(schema), "torch.ops").params)
        rows.append(Row("signatures", f"torch.ops.npu.{rec.qualname} = recorded", not problems,
                        "; ".join(problems) or schema[:120]))
    return rows


def _platform_rows(opts: Options) -> list[Row]:
    """The chip, CANN's version and which aclnn variants the installed CANN has (op-plugin picks
    aclnnGroupedMatmulV5/V4, aclnnDequantSwigluQuantV2/V1, aclnnDynamicQuantV2.. by availability; their
    host checks and rounding differ: audit b30/b34/b41)."""
    module = importlib.import_module(opts.torch_npu)
    try:
        name = module.npu.get_device_name()
    except Exception as exc:  # noqa: BLE001 - information
        name = f"unknown ({exc})"
    chip = (f"{module.npu.get_soc_version()} ({name}) -> {v.current_soc(module)}: by code "
            f"{v.soc_family(module.npu.get_soc_version())}, by name {v.soc_family_from_name(name)}")
    rows = [Row("platform", "chip (torch_npu.npu.get_soc_version, get_device_name)", None,
                chip + (" (fake)" if opts.fake else ""))]
    if opts.fake:
        return rows
    try:
        rows.append(Row("platform", "CANN version", None, str(module.npu.utils.get_cann_version())))
    except Exception as exc:  # noqa: BLE001 - information
        rows.append(Row("platform", "CANN version", None, f"unknown ({exc})"))
    import ctypes

    try:
        lib = ctypes.CDLL("libopapi.so")
        found = {name: hasattr(lib, f"{name}GetWorkspaceSize") for name in (
            "aclnnGroupedMatmulV5", "aclnnGroupedMatmulV4", "aclnnDequantSwigluQuantV2", "aclnnDequantSwigluQuant",
            "aclnnDynamicQuantV4", "aclnnDynamicQuantV3", "aclnnDynamicQuantV2")}
        rows.append(Row("platform", "aclnn variants in libopapi.so", None,
                        ", ".join(f"{k}={'yes' if ok else 'no'}" for k, ok in found.items())))
    except OSError as exc:
        rows.append(Row("platform", "aclnn variants in libopapi.so", None, f"libopapi.so not loadable ({exc})"))
    return rows


# -- sizes ---------------------------------------------------------------------------------------------


def _window_rows(opts: Options, world: int, group: Any) -> list[Row]:
    """The windows: what the group was given (its hccl_config, read as the backend reads it), what the ops see,
    and what each mode needs; whether the backend's creation check passes."""
    rows: list[Row] = []
    E = opts.experts_per_rank * world
    adapter = ascend_backend(opts.deep_ep)
    config = adapter.group_hccl_config(group)
    seen = (f"hccl_config read: {config}; {v.HCCL_BUFFSIZE}={os.environ.get(v.HCCL_BUFFSIZE)!r}, "
            f"{v.OP_EXPANSION_ENV}={os.environ.get(v.OP_EXPANSION_ENV)!r}")
    try:
        window = sizes.group_window(config, os.environ)
    except md.MoEDispatchError as exc:  # a shared-buffer group, an unreadable variable: the backend refuses it
        rows.append(Row("windows", "the group's HCCL window (its hccl_config, else HCCL_BUFFSIZE)", None,
                        f"refused: {type(exc).__name__} {exc.parameter}: {str(exc)[:160]}; {seen}"))
        return rows
    rows.append(Row("windows", "the group's HCCL window (its hccl_config, else HCCL_BUFFSIZE)", None,
                    f"{window.mb} MB: {window.source}; {seen}"))
    for mode in (md.Mode.NORMAL, md.Mode.LOW_LATENCY):
        spec = md.DispatchSpec(opts.hidden, E, opts.top_k, num_max_dispatch_tokens_per_rank=opts.tokens, mode=mode)
        soc = adapter.soc()
        need = sizes.required_window_mb(spec, world, os.environ, soc)
        have = v.ops_window_mb(os.environ)
        try:
            adapter.check_environment(spec, world, config, {})
            verdict = "the creation check passes"
        except md.MoEDispatchError as exc:
            verdict = f"the creation check refuses: {type(exc).__name__} {exc.parameter}: {str(exc)[:160]}"
        rows.append(Row("windows", f"HCCL window {mode.value}", None,
                        f"need {need} MB (chip {soc or 'unknown: both'}), the ops see {have} MB, the group has "
                        f"{window.mb} MB; {verdict}"))
    module = importlib.import_module(opts.deep_ep)
    hint = v.low_latency_rdma_size_hint(module, opts.tokens, opts.hidden, world, E)
    rows.append(Row("windows", "get_low_latency_rdma_size_hint is the dummy (returns T)", hint == opts.tokens,
                    f"returned {hint}"))
    return rows


# -- DeepEP-Ascend: the adapter on the vendor vs on the fake --------------------------------------------


def _batch(rank: int, opts: Options, world: int, minus_one: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    E = opts.experts_per_rank * world
    x = torch.randn(opts.tokens, opts.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:opts.top_k] for _ in range(opts.tokens)])
    if minus_one:
        ids[::3, -1] = -1
    return x, ids, torch.rand(opts.tokens, opts.top_k, generator=g)


def _roundtrip(d: md.Dispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, device: torch.device
               ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    out = d.dispatch(x.to(device), ids.to(device), w.to(device))
    rows = dequantize_rows(out.hidden_states, out.hidden_states_scale, x.shape[1])
    y = d.combine(rows.to(torch.bfloat16), out)  # identity experts
    return out.expert_counts().cpu().tolist(), rows.float().cpu(), y.float().cpu()


def _deepep_rows(rank: int, world: int, opts: Options, group: Any, reference_group: Any) -> list[Row]:
    rows: list[Row] = []
    E = opts.experts_per_rank * world
    for mode in ("normal", "low_latency"):
        for dtype in ("bf16", "int8"):
            for minus_one in (False, True):
                name = f"{mode} {dtype}{' with -1 ids' if minus_one else ''}"

                def check(mode: str = mode, dtype: str = dtype, minus_one: bool = minus_one, name: str = name
                          ) -> list[Row]:
                    spec = md.DispatchSpec(opts.hidden, E, opts.top_k, num_max_dispatch_tokens_per_rank=opts.tokens,
                                           mode=mode, output_dtype=dtype)
                    try:
                        real = md.create_dispatcher(ascend_backend(opts.deep_ep), spec, group, env={})
                    except md.InvalidSpecError as exc:  # A2 beyond 8 ranks: no INT8 kernel (every rank refuses)
                        if exc.parameter != "output_dtype":
                            raise
                        return [Row("deepep", f"{name}: refused at creation", None, str(exc)[:200])]
                    fake = md.create_dispatcher(ascend_backend(FAKE), spec, reference_group, env={})
                    x, ids, w = _batch(rank, opts, world, minus_one)
                    c_real, r_real, y_real = _roundtrip(real, x, ids, w, opts.device)
                    c_fake, r_fake, y_fake = _roundtrip(fake, x, ids, w, torch.device("cpu"))
                    err = relative_error(y_real, y_fake)
                    same_order = r_real.shape == r_fake.shape and bool(torch.allclose(r_real, r_fake, atol=0, rtol=0.05))
                    ok = c_real == c_fake and err < opts.tolerance[dtype]
                    return [Row("deepep", f"{name}: counts and combine = fake", ok,
                                f"counts {'equal' if c_real == c_fake else f'{c_real} != {c_fake}'}, combine rel err "
                                f"{err:.2e}; rows in the fake's order: {same_order}")]

                rows += _guard("deepep", name, check)
    for mode in ("normal", "low_latency"):
        name = f"{mode}: two dispatches in flight (8 then 2 tokens), combined first-first and last-first"
        rows += _guard("deepep", name, lambda mode=mode, name=name: _in_flight_rows(rank, world, opts, group,
                                                                                    reference_group, mode, name))
    name = "two dispatchers on one group (normal int8, low_latency bf16) interleaved"
    rows += _guard("deepep", name, lambda: _two_dispatchers_rows(rank, world, opts, group, reference_group, name))
    if opts.probe_neg_one_unset:
        rows += _probe("deepep", "probe: -1 ids without MOE_ENABLE_TOPK_NEG_ONE",
                       lambda: _probe_neg_one_unset(rank, world, opts, group))
    return rows


def _in_flight(d: md.Dispatcher, opts: Options, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
               order: tuple[int, ...], device: torch.device) -> list[torch.Tensor]:
    outs = [d.dispatch(x.to(device), ids.to(device), w.to(device)) for x, ids, w in batches]
    ys: dict[int, torch.Tensor] = {}
    for i in order:  # identity experts: combine what arrived
        rows = dequantize_rows(outs[i].hidden_states, outs[i].hidden_states_scale, opts.hidden)
        ys[i] = d.combine(rows.to(torch.bfloat16), outs[i]).float().cpu()
    return [ys[i] for i in range(len(batches))]


def _in_flight_rows(rank: int, world: int, opts: Options, group: Any, reference_group: Any, mode: str, name: str
                    ) -> list[Row]:
    """The Buffer keeps per-call state (real_max_bs, the window halves the kernels flip): dispatches in
    flight of different sizes, combined in either order, must give what the fake gives."""
    E = opts.experts_per_rank * world
    spec = md.DispatchSpec(opts.hidden, E, opts.top_k, num_max_dispatch_tokens_per_rank=opts.tokens, mode=mode)
    real = md.create_dispatcher(ascend_backend(opts.deep_ep), spec, group, env={})
    fake = md.create_dispatcher(ascend_backend(FAKE), spec, reference_group, env={})
    small = Options(**{**opts.__dict__, "tokens": max(1, opts.tokens // 4)})
    batches = [_batch(rank, opts, world, False), _batch(rank + 50, small, world, False)]
    worst = 0.0
    for order in ((0, 1), (1, 0)):
        got = _in_flight(real, opts, batches, order, opts.device)
        want = _in_flight(fake, opts, batches, order, torch.device("cpu"))
        worst = max(worst, *(relative_error(g, w) for g, w in zip(got, want)))
    return [Row("deepep", name, worst < opts.tolerance["bf16"], f"worst combine rel err {worst:.2e}")]


def _two_dispatchers_rows(rank: int, world: int, opts: Options, group: Any, reference_group: Any, name: str
                          ) -> list[Row]:
    """Two Buffers on one HCCL communicator share its window: interleaved calls must not disturb each other."""
    E = opts.experts_per_rank * world
    specs = [md.DispatchSpec(opts.hidden, E, opts.top_k, num_max_dispatch_tokens_per_rank=opts.tokens, mode=m,
                             output_dtype=dt) for m, dt in (("normal", "int8"), ("low_latency", "bf16"))]
    results = []
    for module, grp, device in ((opts.deep_ep, group, opts.device), (FAKE, reference_group, torch.device("cpu"))):
        ds = [md.create_dispatcher(ascend_backend(module), s, grp, env={}) for s in specs]
        x, ids, w = _batch(rank, opts, world, False)
        outs = [d.dispatch(x.to(device), ids.to(device), w.to(device)) for d in ds]
        ys = [d.combine(dequantize_rows(o.hidden_states, o.hidden_states_scale, opts.hidden).to(torch.bfloat16), o)
              .float().cpu() for d, o in reversed(list(zip(ds, outs)))]
        results.append(ys)
    err = max(relative_error(g, w) for g, w in zip(*results))
    return [Row("deepep", name, err < opts.tolerance["int8"], f"worst combine rel err {err:.2e}")]


def _probe_neg_one_unset(rank: int, world: int, opts: Options, group: Any) -> list[Row]:
    """What the vendor's low-latency op does with -1 ids and no active mask (the adapter never
    does this). May fail in the kernel; run it last."""
    module = importlib.import_module(opts.deep_ep)
    E = opts.experts_per_rank * world
    with restored_environ({v.NEG_ONE_ENV: "0", v.SHARED_RANKS_ENV: "0", v.STRATEGY_ENV: "default"}):
        buffer = module.Buffer(group, low_latency_mode=True)
        x, ids, _ = _batch(rank, opts, world, True)
        recv, counts, _, _, _ = buffer.low_latency_dispatch(x.to(opts.device), ids.to(opts.device), opts.tokens, E,
                                                            use_fp8=False)
    sent = int((ids >= 0).sum())
    return [Row("deepep", "probe: -1 ids without MOE_ENABLE_TOPK_NEG_ONE", None,
                f"no error; received {int(counts.sum())} rows on this rank (this rank sent {sent} valid pairs)")]


def _world_one_rows(opts: Options) -> list[Row]:
    """At one rank DeepEP-Ascend refuses: its own messages."""
    module = importlib.import_module(opts.deep_ep)
    rows = []
    try:
        module.Buffer.get_dispatch_config(1)
        rows.append(Row("deepep", "vendor at 1 rank: get_dispatch_config(1)", None, "accepted"))
    except AssertionError as exc:
        rows.append(Row("deepep", "vendor at 1 rank: get_dispatch_config(1)", None, f"AssertionError: {exc}"))
    rows.append(Row("deepep", "vendor at 1 rank: the ops' tiling", None,
                    "MIN_EP_WORLD_SIZE = 2 (moe_distribute_dispatch_v2_tiling.cpp, cam_moe_dispatch_normal_tiling.cc):"
                    " run with torchrun --nproc-per-node 2 (or more)"))
    return rows


# -- torch_npu runners: the kernel on the vendor's ops vs on the fake ops -------------------------------------


def _runner_rows(opts: Options) -> list[Row]:
    rows = []
    counts = [5, 0, 13, 2]
    for scheme in SCHEMES:
        def check(scheme: str = scheme) -> list[Row]:
            g = torch.Generator().manual_seed(7)
            fake = NpuExperts(scheme, TORCH_NPU_FAKE)
            real = NpuExperts(scheme, opts.torch_npu)
            layer = fake.process_weights(random_expert_weights(len(counts), 1024, opts.intermediate, generator=g))
            x = torch.randn(sum(counts), 1024, generator=g)
            if fake.needs_dispatch_dtype is md.DispatchDtype.INT8:
                q = mdb.make_codec(mdb.WireFormat(md.DispatchDtype.INT8, 1024)).quantize(x)
                rows_x, scale = q.data, q.scale
            else:
                rows_x, scale = x.to(torch.bfloat16), None
            gl = torch.tensor(counts, dtype=torch.int64)
            want = fake.apply_without_routing_weights(layer, rows_x, scale, 1, gl, torch.bfloat16)
            dev = opts.device
            got = real.apply_without_routing_weights(layer.to(dev), rows_x.to(dev), None if scale is None else
                                                     scale.to(dev), 1, gl.to(dev), torch.bfloat16).cpu()
            err = relative_error(got, want)
            return [Row("runners", f"npu_{scheme}: torch_npu = fake", err < 2e-2, f"rel err {err:.2e}")]

        rows += _guard("runners", f"npu_{scheme}", check)
    rows += _guard("runners", "npu_convert_weight_to_int4pack", lambda: _int4pack_rows(opts))
    return rows


def _int4pack_rows(opts: Options) -> list[Row]:
    """The W4A16 runner packs on the host (``pack_int4``); the op, on the NPU, must give the same words."""
    if opts.fake:
        return [Row("runners", "npu_convert_weight_to_int4pack(npu) = pack_int4", None,
                    "the op has an NPU kernel only (the fake refuses CPU tensors as torch_npu does)")]
    values = torch.randint(-8, 8, (64, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    got = importlib.import_module(v.TORCH_NPU).npu_convert_weight_to_int4pack(values.to(opts.device)).cpu()
    ok = torch.equal(got, pack_int4(values))
    return [Row("runners", "npu_convert_weight_to_int4pack(npu) = pack_int4", ok, "" if ok else "words differ")]


# -- one rank's share -------------------------------------------------------------------------------------


def run_rank(rank: int, world: int, opts: Options, fuseep: Callable[..., list[Row]] | None = None) -> list[Row]:
    """Everything one rank checks (rank 0 also the process-local parts). Under torchrun on the
    NPU the default group is HCCL and the fake runs on a gloo group beside it; with ``fake`` both
    are the gloo group of the local ranks."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() else None
    reference = group if opts.fake or not dist.is_initialized() else dist.new_group(backend="gloo")
    rows: list[Row] = []
    if rank == 0 and "platform" in opts.parts:
        rows += _guard("platform", "platform", lambda: _platform_rows(opts))
    if rank == 0 and "signatures" in opts.parts:
        rows += _guard("signatures", "signatures", lambda: _signature_rows(opts))
    if rank == 0 and "windows" in opts.parts:
        rows += _guard("windows", "windows", lambda: _window_rows(opts, world, group))
    if "deepep" in opts.parts:
        if world < v.MIN_EP_WORLD_SIZE:
            rows += _guard("deepep", "one rank", lambda: _world_one_rows(opts))
        else:
            rows += _deepep_rows(rank, world, opts, group, reference)
    if rank == 0 and "runners" in opts.parts:
        rows += _runner_rows(opts)
    if "fuseep" in opts.parts and fuseep is not None and world >= v.MIN_EP_WORLD_SIZE:
        rows += fuseep(rank, world, opts, group, reference)
    return rows


def summarize(per_rank: list[list[Row]]) -> tuple[str, bool]:
    """A table (one line per check, the worst rank's verdict) and whether nothing failed."""
    merged: dict[tuple[str, str], Row] = {}
    for rows in per_rank:
        for row in rows:
            key = (row.part, row.check)
            old = merged.get(key)
            if old is None or (row.ok is False and old.ok is not False):
                merged[key] = row
    width = max([len(c) for _, c in merged] + [10])
    lines = [f"{'part':<11} {'check':<{width}} {'result':<6} detail"]
    for (part, check), row in merged.items():
        verdict = {True: "ok", False: "FAIL", None: "info"}[row.ok]
        lines.append(f"{part:<11} {check:<{width}} {verdict:<6} {row.detail}")
    ok = all(row.ok is not False for row in merged.values())
    return "\n".join(lines), ok


__all__ = ["Options", "Row", "run_rank", "summarize"]  # _guard/_probe: used by the FuseEP part
