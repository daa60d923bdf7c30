"""The checks of ``scripts/hardware_check.py``: the adapter on the real DeepEP and DeepGEMM of one GPU, against
their fakes on the same inputs, the vendor's size functions against the ports, and the recorded signatures
against the real callables. With ``fake=True`` the fakes stand in for the real libraries (on CPU), so the
same code runs in the tests.

Every check returns ``Row``s: what was compared, the two sides, and whether they agree. A vendor refusal
(DeepEP's normal mode on one rank) is recorded with its exact message. Probes that can end the process on a GPU
(a one-rank normal-mode Buffer throws from its noexcept destructor: ``std::terminate``; a second NVSHMEM Buffer in
one process; the V2 ``ElasticBuffer`` beside NVSHMEM; a V2 normal-mode dispatch of 0 tokens, whose host wait could
time out) run last, each in a subprocess (``python -m
moe_dispatch_cuda_deepep_testing.hardware <probe>``), after the adapter's Buffers were closed, and their exit status and
output are recorded: they can fail, the table is still printed. The records compared are the installed release's
(``vendor.deep_ep_signatures``: several where the release string cannot tell the builds apart, any one may match;
``DeepEPRelease.tuned_tables``; ``vendor.deep_gemm_signatures_of``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch import DispatchOutput
from moe_dispatch.backend import align_rows, dequantize_rows, make_codec, pack_ue8m0, restored_environ, row_experts
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch_testing.routing import random_expert_weights
from moe_dispatch_testing.streams import run_started

from . import DEEP_GEMM_EMULATOR, DEEP_GEMM_V1_EMULATOR, DEEP_GEMM_V1_PYPI_EMULATOR, EMULATOR


@dataclass(frozen=True)
class Row:
    """One comparison: ``real`` is what the installed library gave (or the fake with ``--fake``)."""

    section: str
    check: str
    real: str
    expected: str
    ok: bool

    def line(self) -> str:
        mark = "ok" if self.ok else "MISMATCH"
        return f"{self.section:<10} {self.check:<52} {self.real:<34} {self.expected:<34} {mark}"


@dataclass(frozen=True)
class Setup:
    """What the checks run on: module names, the device, the groups (one rank)."""

    deep_ep: str
    deep_gemm: str
    device: torch.device
    group: Any  # the group the real library uses (NCCL on a GPU)
    fake_group: Any  # a gloo group for the fakes
    fake: bool
    hidden: int = 2048
    tokens: int = 16
    gemm_hidden: int = 2048  # H of the DeepGEMM checks (any multiple of 128)


def _text(value: Any, width: int = 34) -> str:
    s = str(value)
    return s if len(s) <= width else s[: width - 1] + "…"


def _outcome(fn: Callable[[], Any]) -> str:
    """A call's result, or its exception as ``Type: message`` (the vendor's exact words)."""
    try:
        return f"ok: {fn()!r}"
    except Exception as exc:  # recording what the vendor says is the point
        return f"{type(exc).__name__}: {exc}"


# -- signatures -------------------------------------------------------------------------------------------------


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def pybind_params(fn: Any) -> list[tuple[str, Any]] | None:
    """(name, default) from a pybind11 function's docstring signature, ``self`` first for methods; None
    when there is no parsable docstring."""
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    first = next((line for line in doc if "(" in line), None)
    if first is None:
        return None
    body = first[first.index("(") + 1 : first.rindex(")")] if ")" in first else ""
    out: list[tuple[str, Any]] = []
    for part in _split_top(body):
        name, _, rest = part.partition(":")
        default: Any = "<required>"
        if "=" in rest:
            raw = rest.split("=", 1)[1].strip()
            try:
                default = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                default = raw
        out.append((name.strip(), default))
    return out


def signature_records(module: Any) -> tuple[vendor.VendorSignature, ...]:
    """The recorded signatures that apply to the installed library: DeepEP's per release (1.x has no
    ``enable_shrink``, hybrid-ep its own constructor and LL calls), DeepGEMM's per generation and version."""
    info = vendor.detect_deep_gemm(module)
    if info.generation is not None:
        return vendor.deep_gemm_signatures_of(info)
    return vendor.deep_ep_signatures(vendor.release_of(module))


def _installed_params(fn: Any) -> list[tuple[str, Any]]:
    try:
        got = [(p.name, "<required>" if p.default is inspect.Parameter.empty else p.default)
               for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):  # a pybind function: read its docstring
        got = pybind_params(fn) or []
    return [(n, d) for n, d in got if n not in ("/", "*")]


def signature_rows(module: Any, records: tuple, section: str) -> list[Row]:
    """One row per recorded callable; records sharing a qualname are alternatives (any one may match)."""
    rows = []
    by_name: dict[str, list[vendor.VendorSignature]] = {}
    for record in records:
        by_name.setdefault(record.qualname, []).append(record)
    for qualname, alternatives in by_name.items():
        try:
            fn = vendor.lookup(module, qualname)
        except AttributeError:
            rows.append(Row(section, f"signature {qualname}", "missing", _text(alternatives[0].text), False))
            continue
        got = _installed_params(fn)
        matched = None
        for record in alternatives:
            recorded = [(p.name, p.default) for p in record.params]
            mine = got
            if qualname.count(".") and mine and mine[0][0] != "self" and recorded and recorded[0][0] == "self":
                mine = [("self", "<required>")] + mine
            names_ok = [n for n, _ in mine] == [n for n, _ in recorded]
            if names_ok and all(_same(a, b) for (_, a), (_, b) in zip(mine, recorded)):
                matched = record
                break
        shown = matched or alternatives[0]
        expected = [p.name for p in shown.params][-3:]
        rows.append(Row(section, f"signature {qualname}" + (f" (1 of {len(alternatives)})" if len(alternatives) > 1
                                                            else ""),
                        _text([n for n, _ in got][-3:]), _text(expected), matched is not None))
    return rows


def _same(a: Any, b: Any) -> bool:
    return a == b or str(a) == str(b)


# -- sizes -------------------------------------------------------------------------------------------------------


def size_rows(deep_ep: Any, deep_gemm: Any, device: torch.device = torch.device("cpu")) -> list[Row]:
    """DeepEP's size functions against the ports (when DeepEP is installed), DeepGEMM's layout
    functions against theirs (when DeepGEMM is)."""
    rows: list[Row] = []
    if deep_ep is not None:
        rows += _deep_ep_size_rows(deep_ep)
    return rows + _deep_gemm_size_rows(deep_gemm, device)


def _deep_ep_size_rows(deep_ep: Any) -> list[Row]:
    rows = []
    for t, h, e in ((128, 7168, 256), (128, 7168, 288), (256, 4096, 128), (512, 2048, 64)):
        real = deep_ep.Buffer.get_low_latency_rdma_size_hint(t, h, 8, e)
        port = vendor.ported_low_latency_rdma_size_hint(t, h, 8, e)
        rows.append(Row("sizes", f"LL rdma hint T={t} H={h} E={e}", f"{real:,}", f"{port:,}", real == port))
    release = vendor.release_of(deep_ep)
    getters = {"dispatch": (vendor.dispatch_config, 0), "combine": (vendor.combine_config, 1)}
    for n in sorted(vendor.supported_world_sizes(deep_ep, release)):
        for which, (getter, side) in getters.items():
            cfg = getter(deep_ep, n)
            # The release's recorded tables (several where the release string cannot tell the builds apart).
            candidates = [tables[side][n] for tables in release.tuned_tables if n in tables[side]]
            for hb in (7168, 2 * 7168):
                real = (cfg.get_nvl_buffer_size_hint(hb, n), cfg.get_rdma_buffer_size_hint(hb, n))
                ports = [(vendor.ported_nvl_buffer_size_hint(f, hb, n), vendor.ported_rdma_buffer_size_hint(f, hb, n))
                         for f in (vendor.ConfigFields(deep_ep.Buffer.num_sms, *c) for c in candidates)]
                label = f"{which} config EP{n} hidden_bytes={hb} (nvl, rdma)"
                if not ports:
                    rows.append(Row("sizes", label, _text(real), "(no recorded table: the getter is used)", True))
                    continue
                match = next((p for p in ports if p == real), ports[0])
                rows.append(Row("sizes", label, _text(real), _text(match), match == real))
    return rows


def _deep_gemm_size_rows(deep_gemm: Any, device: torch.device) -> list[Row]:
    rows: list[Row] = []
    info = vendor.detect_deep_gemm(deep_gemm)
    if info.module is not None:
        alignment = vendor.mk_alignment(deep_gemm)
        rows.append(Row("sizes", "DeepGEMM mk alignment", str(alignment), str(vendor.DG_DEFAULT_MK_ALIGNMENT),
                        alignment == vendor.DG_DEFAULT_MK_ALIGNMENT))
        aligned = getattr(deep_gemm, vendor.DG_TMA_ALIGNED_SIZE, None)
        if aligned is not None:
            real_t = [aligned(x, 4) for x in (1, 5, 128, 130)]
            port_t = [vendor.tma_aligned_size(x, 4) for x in (1, 5, 128, 130)]
            rows.append(Row("sizes", "DeepGEMM get_tma_aligned_size(x, 4)", str(real_t), str(port_t), real_t == port_t))
        arch = vendor.device_capability(deep_gemm)
        if getattr(deep_gemm, vendor.DG_MN_MAJOR_PACKED_UE8M0, None) is not None and arch and arch[0] == 10:
            sf = torch.exp2(torch.randint(-8, 8, (2, 130, 8), generator=torch.Generator().manual_seed(0)).float())
            real_p = vendor.dg_packed_ue8m0_mn_major(deep_gemm, sf.to(device)).cpu()
            port_p = vendor.ported_packed_ue8m0_mn_major(sf)
            same = torch.equal(real_p, port_p) and real_p.stride() == port_p.stride()
            rows.append(Row("sizes", "DeepGEMM packed UE8M0 MN-major (values, strides)", _text(real_p.stride()),
                            _text(port_p.stride()), same))
        multiple = vendor.dg_masked_capacity_multiple(info, arch[0] if arch else None, alignment)
        rows.append(Row("sizes", "DeepGEMM masked capacity multiple (every BLOCK_M)", str(multiple),
                        str(sorted(vendor.dg_masked_block_ms(info, arch[0] if arch else None, alignment))), True))
    return rows


# -- DeepGEMM runner: real vs fake ----------------------------------------------------------------------------


def _fake_deep_gemm_for(real: Any) -> Any:
    """The fake of the same generation, version and architecture as ``real``."""
    info = vendor.detect_deep_gemm(real)
    if info.generation == "v1":
        return importlib.import_module(DEEP_GEMM_V1_EMULATOR if info.compiles_odd_k_blocks
                                       else DEEP_GEMM_V1_PYPI_EMULATOR)
    fakes = importlib.import_module(DEEP_GEMM_EMULATOR)
    capability = vendor.device_capability(real) or (9, 0)
    if info.version is None:  # 2.0.0 or 2.1.0 (no __version__); PR #112's API before f85ec64
        return fakes.emulate(capability, "2.0.0", before_f85ec64=not hasattr(real, vendor.DG_FP8_MASKED))
    return fakes.emulate(capability, info.version)


def scale_layout_rows(setup: Setup) -> list[Row]:
    """Whether DeepGEMM takes the runner's SM90 activation scales as they are: ``get_mn_major_tma_aligned_tensor``, which
    SM90's scale transform calls (deepseek-ai/DeepGEMM@54e2261 csrc/apis/layout.hpp:41-42), given ``vendor.dg_mn_major``'s
    layout returns the same memory (csrc/jit_kernels/impls/smxx_layout.hpp:123-125: no copy, no ``transpose_fp32``
    kernel) for the contiguous GEMM's ``[rows, H/128]`` and the masked GEMM's ``[E, rows, H/128]``, rows 130 (a
    TMA-aligned stride of 132); real against the fake. SM100 (packed UE8M0: the GEMM itself checks the layout) and v1
    (no such function) get one row saying so."""
    real_module = importlib.import_module(setup.deep_gemm)
    fn = getattr(real_module, vendor.DG_MN_MAJOR_TMA_ALIGNED, None)
    arch = vendor.device_capability(real_module)
    if fn is None or (arch is not None and arch[0] != vendor.DG_ARCH_SM90):
        return [Row("DeepGEMM", "SM90 scales as the runner lays them out", "not this DeepGEMM or GPU",
                    "SM90 DeepGEMM 2.x", True)]
    fake = _fake_deep_gemm_for(real_module)
    fake.sf_transforms.clear()
    rows = []
    for shape in ((130, setup.gemm_hidden // vendor.DG_BLOCK), (4, 130, setup.gemm_hidden // vendor.DG_BLOCK)):
        sf = torch.rand(*shape, generator=torch.Generator().manual_seed(2))
        seen = []
        for module, device in ((real_module, setup.device), (fake, torch.device("cpu"))):
            laid = vendor.dg_mn_major(module, sf.to(device))
            kept = getattr(module, vendor.DG_MN_MAJOR_TMA_ALIGNED)(laid)
            same = kept.data_ptr() == laid.data_ptr() and kept.stride() == laid.stride()
            seen.append((same and torch.equal(kept.cpu(), sf), laid.stride()))
        (real_kept, real_strides), (fake_kept, fake_strides) = seen
        rows.append(Row("DeepGEMM", f"scales {list(shape)} as laid out: kept, no transpose",
                        f"kept {real_kept}, strides {real_strides}", f"kept {fake_kept}, strides {fake_strides}",
                        real_kept and fake_kept and real_strides == fake_strides and not fake.sf_transforms))
    return rows


def deep_gemm_rows(setup: Setup, first_only: bool = False) -> list[Row]:
    """The runner on the real DeepGEMM against its fake, case by case; ``first_only``: its first call alone (block-FP8
    PACKED, counts [5, 0, 130, 1]: the call that segfaulted on the H100), for ``benchmarks/gpu/dg_probe.py``."""
    real_module = importlib.import_module(setup.deep_gemm)
    fake_module = _fake_deep_gemm_for(real_module)
    info = vendor.detect_deep_gemm(real_module)
    rows = []
    h, inter, experts = setup.gemm_hidden, 256, 4
    weights = random_expert_weights(experts, h, inter, generator=torch.Generator().manual_seed(0))
    # The masked capacity: a multiple of every BLOCK_M the installed DeepGEMM may pick; the counts
    # end mid-tile so a tile spilling into the next expert would show.
    capacity = DeepGemmExperts("block_fp8", "low_latency", real_module).masked_capacity_multiple
    counts_packed, counts_masked = [5, 0, 130, 1], [3, 0, capacity - 1, 1]
    for kind in ("block_fp8", "bf16"):
        if kind == "bf16" and not info.has_bf16:
            rows.append(Row("DeepGEMM", f"{kind}: BF16 grouped GEMMs", "absent", f"{info.generation} has none", True))
            continue
        # ALIGNED: rows at the runner's expert_alignment (no pad copy; the PSUM layout where the version has it),
        # with empty experts first, in the middle and last, and one past a 128-row block; once more with per-row
        # m_indices where PSUM exists, and on SM100 with fp32 UE8M0 scales the runner packs.
        cases = [("PACKED", "normal", counts_packed, {}, False), ("ALIGNED", "normal", [0, 130, 0, 5], {}, False),
                 ("ALIGNED tail", "normal", [5, 0, 130, 0], {}, False),
                 ("ALIGNED m_indices", "normal", [0, 130, 0, 5], {"psum_layout": False}, False),
                 ("MASKED", "low_latency", counts_masked, {}, False)]
        if kind == "block_fp8" and (vendor.device_capability(real_module) or (9, 0))[0] >= 10:
            cases.append(("ALIGNED fp32 scales", "normal", [0, 130, 0, 5], {}, True))
        if first_only:
            cases = cases[:1]
        for layout, mode, counts, options, fp32_scales in cases:
            label = f"{kind} {layout}"
            aligned_case = layout.startswith("ALIGNED")
            try:
                real = DeepGemmExperts(kind, mode, real_module, **options)
                fake = DeepGemmExperts(kind, mode, fake_module, ue8m0=real.ue8m0, **options)
            except md.MoEDispatchError as exc:
                rows.append(Row("DeepGEMM", label, _text(f"{type(exc).__name__}: {exc}"), "a runner", False))
                continue
            layer = fake.process_weights(weights)
            shape = (sum(counts),) if mode == "normal" else (experts, capacity)
            x = torch.randn(*shape, h, generator=torch.Generator().manual_seed(1))
            if kind == "bf16":
                data, scale = x.to(torch.bfloat16), None
            else:
                q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, h, ue8m0=real.ue8m0)).quantize(x)
                packed = real.ue8m0 and aligned_case and not fp32_scales
                data, scale = q.data, (pack_ue8m0(q.scale) if packed else q.scale)
            group_list = torch.tensor(counts)
            alignment, valid = 1, slice(None)
            if aligned_case:
                dtype = md.DispatchDtype.BF16 if kind == "bf16" else md.DispatchDtype.FP8
                none = torch.zeros(0, 1, dtype=torch.int64)
                aligned = align_rows(DispatchOutput(data, scale, none, none.float(), group_list, 1, md.Layout.PACKED,
                                                    dtype, None), real.expert_alignment)
                data, scale, alignment = aligned.hidden_states, aligned.hidden_states_scale, real.expert_alignment
                valid = row_experts(group_list, alignment, data.shape[0]) >= 0  # padding rows' values: unspecified
            want = fake.apply_without_routing_weights(layer, data, scale, 1, group_list, torch.float32,
                                                      expert_alignment=alignment)
            got = real.apply_without_routing_weights(
                layer.to(setup.device), data.to(setup.device), None if scale is None else scale.to(setup.device), 1,
                group_list.to(setup.device), torch.float32, expert_alignment=alignment).cpu()
            err = relative_error(got[valid], want[valid])
            tol = 2e-2 if kind == "block_fp8" else 1e-2
            rows.append(Row("DeepGEMM", f"{label} real vs fake (relative error)", f"{err:.2e}", f"< {tol}", err < tol))
        if first_only:
            break
    return rows


# -- DeepEP: one rank ---------------------------------------------------------------------------------------------


def _ll_round(backend: DeepEPBackend, group: Any, device: torch.device, dtype: str, hidden: int, tokens: int,
              side_stream: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Low-latency dispatch → (rows sorted by source token per expert) → combine of scaled rows. ``side_stream``:
    both calls in split phase, started on a side stream and waited on the current one (``run_started``)."""
    spec = md.DispatchSpec(hidden, 8, 4, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency",
                           output_dtype=dtype)
    d = md.create_dispatcher(backend, spec, group=group, env={})
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(tokens)])
    w = torch.rand(tokens, 4, generator=g)
    x, ids, w = x.to(device), ids.to(device), w.to(device)
    out = run_started(lambda: d.dispatch_start(x, ids, w), device, True) if side_stream else d.dispatch(x, ids, w)
    rows = out.hidden_states.float() if out.hidden_states_scale is None else \
        dequantize_rows(out.hidden_states, out.hidden_states_scale, hidden)
    src = out.handle.vendor_handle[0].long().cpu()  # each row's source token (DeepEP's order is arbitrary)
    counts = out.group_list.cpu()
    ordered = torch.zeros(8, tokens, hidden)
    for e in range(8):
        n = int(counts[e])
        ordered[e, src[e, :n]] = rows[e, :n].cpu().float()
    expert_rows = (out.hidden_states.float() if out.hidden_states_scale is None else rows).to(torch.bfloat16) * 2
    y = (run_started(lambda: d.combine_start(expert_rows, out), device, True) if side_stream
         else d.combine(expert_rows, out))
    return ordered, counts, y.float().cpu()


def deep_ep_rows(setup: Setup) -> list[Row]:
    rows = []
    real_module = importlib.import_module(setup.deep_ep)
    info = vendor.detect(setup.deep_ep)
    rows.append(Row("DeepEP", "detected", _text(info.describe()), _text(info.release.reason), info.has_v1_buffer))
    real_backend, fake_backend = DeepEPBackend(setup.deep_ep), DeepEPBackend(EMULATOR)
    for dtype, side in (("bf16", False), ("fp8", False), ("bf16", True)):
        label = f"LL {dtype} one rank" + (", side stream" if side else "")
        try:
            with restored_environ(names=vendor.NVSHMEM_WRITTEN):
                r_rows, r_counts, r_y = _ll_round(real_backend, setup.group, setup.device, dtype, setup.hidden,
                                                  setup.tokens, side)
                f_rows, f_counts, f_y = _ll_round(fake_backend, setup.fake_group, torch.device("cpu"), dtype,
                                                  setup.hidden, setup.tokens)
        except Exception as exc:  # the vendor's refusal, recorded
            rows.append(Row("DeepEP", label, _text(f"{type(exc).__name__}: {exc}", 60), "dispatch + combine", False))
            continue
        rows.append(Row("DeepEP", f"{label}: recv_count", _text(r_counts.tolist()), _text(f_counts.tolist()),
                        torch.equal(r_counts, f_counts)))
        err_rows, err_y = relative_error(r_rows, f_rows), relative_error(r_y, f_y)
        rows.append(Row("DeepEP", f"{label}: received rows (relative error)", f"{err_rows:.2e}", "< 1e-2",
                        err_rows < 1e-2))
        rows.append(Row("DeepEP", f"{label}: combine (relative error)", f"{err_y:.2e}", "< 1e-2", err_y < 1e-2))
    # The Buffers live as long as the process unless closed (a collective; one rank here): close them before the
    # subprocess probes, as an engine's orderly shutdown does.
    real_backend.close()
    fake_backend.close()
    # Normal mode on one rank: the adapter refuses (typed); what DeepEP itself says, recorded (probe_rows).
    spec = md.DispatchSpec(setup.hidden, 8, 4, output_dtype="bf16")
    adapter = _outcome(lambda: real_backend.check_spec(spec, 1))
    rows.append(Row("DeepEP", "normal one rank: adapter", _text(adapter, 60), "InvalidSpecError world_size",
                    adapter.startswith("InvalidSpecError")))
    tuned = _outcome(lambda: real_module.Buffer.get_dispatch_config(1))
    one_rank_table = any(1 in tables[0] for tables in info.release.tuned_tables)  # 1.0: any R <= 8
    rows.append(Row("DeepEP", "normal one rank: get_dispatch_config(1)", _text(tuned, 60),
                    "a Config (1.0)" if one_rank_table else "AssertionError Unsupported",
                    tuned.startswith("ok") if one_rank_table else "Unsupported number of EP ranks" in tuned))
    return rows


# -- probes that may end the process: run in a subprocess each --------------------------------------------------

PROBE_NORMAL_ONE_RANK = "normal-one-rank"
PROBE_TWO_LL_BUFFERS = "two-ll-buffers"
PROBE_ELASTIC = "elastic-buffer"
PROBE_V2_ZERO_TOKENS = "v2-zero-tokens"
PROBE_TIMEOUT_S = 300
#: The zero-token probe's host wait for the counts (its dispatchers' ``timeout_s``, DeepEP's ``num_cpu_timeout_secs``):
#: a wait that never ends becomes DeepEP's "Dispatch CPU wait" error, well inside ``PROBE_TIMEOUT_S``.
ZERO_TOKENS_WAIT_S = 60


@dataclass(frozen=True)
class ProbeResult:
    """A probe's subprocess: its exit status (negative: killed by that signal, e.g. -6 for ``std::terminate``'s
    abort) and what it printed."""

    name: str
    exit_code: int
    output: str


def _two_low_latency_buffers(module: Any, group: Any, device: torch.device) -> str:
    """Two LL Buffers alive in one process (NVSHMEM started twice), both used, then one destroyed (NVSHMEM
    finalized) and the other used again: what DeepEP does with each step."""
    steps = []
    size = vendor.low_latency_rdma_size_hint(module, 16, 2048, 1, 8)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        first = module.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=8)
        steps.append("first Buffer made")
        second = module.Buffer(group, 0, size, low_latency_mode=True, num_qps_per_rank=8, explicitly_destroy=True)
        steps.append("second Buffer made")
    x = torch.zeros(2, 2048, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([[0, 1, 2, 3]] * 2, dtype=vendor.topk_idx_dtype(module), device=device)
    w = torch.ones(2, 4, device=device)
    for name, buf in (("first", first), ("second", second)):
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, 16, 8, use_fp8=False)
        buf.low_latency_combine(recv, ids, w, handle)
        steps.append(f"{name} dispatched and combined")
    second.destroy()
    steps.append("second destroyed (nvshmem finalize)")
    recv, _, handle, _, _ = first.low_latency_dispatch(x, ids, 16, 8, use_fp8=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    steps.append("first dispatched after the finalize")
    return "; ".join(steps)


def _elastic_buffer(module: Any, group: Any, device: torch.device) -> str:
    """DeepEP V2's ``ElasticBuffer`` on a group of one, driven by the ``cuda_deepep_v2`` adapter: dispatch +
    scaled-identity experts + combine against the ``torch`` backend, BF16, FP8, and FP8 with the rows at 128-row
    expert starts (``do_zero_padding``) in split phase (``async_with_compute_stream``), in normal mode and in
    low-latency mode (``do_cpu_sync=False``: worst-case rows), and low-latency mode captured in a CUDA graph and
    replayed against eager (BF16; FP8 aligned to 128); then whether the padding
    rows DeepEP zeroes are all zero bits over 20 dispatches: BF16, FP8, and FP8 with UE8M0 scales in split phase
    (``selfcheck.nonzero_padding``). In a process of its own: V2's buffer beside a live V1 LL Buffer is not a setup
    DeepEP documents."""
    from moe_dispatch_cuda_deepep.elastic import DeepEPV2Backend

    from .selfcheck import agree_with_torch, captured_against_eager, nonzero_padding

    if not vendor.has_elastic_buffer(module):
        return "no ElasticBuffer in this DeepEP"
    backend = DeepEPV2Backend(module.__name__)
    parts = []
    try:
        for mode, dtype, alignment, split, side in (
                ("normal", "bf16", 1, False, False), ("normal", "fp8", 1, False, False),
                ("normal", "fp8", 128, True, False), ("normal", "bf16", 128, True, True),
                # no host sync: DeepEP's worst-case rows, unwritten past the experts' segments
                ("low_latency", "bf16", 1, False, False), ("low_latency", "fp8", 128, True, False)):
            r = agree_with_torch(0, 1, mode, dtype, module.__name__, hidden=2048, experts_per_rank=4, top_k=4,
                                 tokens=16, iterations=3, backend=backend, expert_alignment=alignment, split=split,
                                 side_stream=side)
            verdict = "agree" if r["relative_difference"] < 1e-2 else "DIFFER"
            how = ((" low latency" if mode == "low_latency" else "") + (f" aligned {alignment} split" if split else "")
                   + (" side stream" if side else ""))
            parts.append(f"{dtype}{how} {verdict} rel {r['relative_difference']:.1e} "
                         f"({r['seconds']['cuda_deepep'] * 1e3:.2f} ms, torch {r['seconds']['torch'] * 1e3:.2f} ms; "
                         f"created in {r['created_s'] * 1e3:.0f} ms, first call {r['first_s'] * 1e3:.0f} ms)")
        # low latency's claim of CUDA-graph capture (cuda_graph_modes), with the defaults
        for dtype, alignment in (("bf16", 1), ("fp8", 128)):
            found = captured_against_eager(0, 1, dtype, backend, module.__name__, expert_alignment=alignment)
            parts.append(f"low latency {dtype} aligned {alignment} in a CUDA graph: {found}")
        # DeepEP's zero padding, unfenced TMA stores
        for dtype, ue8m0, split in (("bf16", False, False), ("fp8", False, False), ("fp8", True, True)):
            found = nonzero_padding(0, 1, dtype, backend, module.__name__, ue8m0=ue8m0, split=split)
            verdict = "zero" if not any(found.values()) else "NONZERO"
            how = " ue8m0 split" if split else ""
            parts.append(f"{dtype}{how} padding rows {verdict} over 20 calls {found}")
    finally:
        backend.close()
    return "cuda_deepep_v2 at one rank: " + "; ".join(parts)


def _described(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _v2_zero_tokens(module: Any, group: Any, device: torch.device) -> str:
    """A normal-mode rank with 0 tokens on DeepEP V2 (``cuda_deepep_v2`` at one rank): dispatch + combine of an empty
    batch, BF16 then FP8, then 16 tokens against the ``torch`` backend. sglang pads empty batches because DeepEP's host
    wait for the counts can time out; DeepEP's own tests never send 0 tokens (deepseek-ai/DeepEP@dd758ca
    tests/elastic/test_ep.py:62, ``max(1, ...)``). Its source passes them as they are: no host assert on the token count
    but ``num_tokens <= num_max_tokens_per_rank`` (csrc/elastic/buffer.hpp:751-756), grids of ``num_sms`` blocks
    (csrc/kernels/elastic/dispatch.hpp:226, 336, combine.hpp:174, 282), token loops that run no iteration
    (deep_ep/include/deep_ep/impls/dispatch.cuh:95, 280), zero counts written for the host (:224-229, encoded ready:
    common/math.cuh:26-33) and read by its wait (buffer.hpp:1017-1064); the adapter passes them too (elastic.py). Each
    step is printed as it ends (a hang or a crash keeps the steps before it); ``zero_tokens_row`` compares them with the
    fake's."""
    from moe_dispatch_cuda_deepep.elastic import DeepEPV2Backend

    from .selfcheck import agree_with_torch, layer_spec

    if not vendor.has_elastic_buffer(module):
        return "no ElasticBuffer in this DeepEP"
    backend = DeepEPV2Backend(module.__name__)
    try:
        for dtype in ("bf16", "fp8"):
            spec = layer_spec(1, "normal", dtype, hidden=2048, experts_per_rank=4, top_k=4, tokens=16)
            d = md.create_dispatcher(backend, spec, env={}, timeout_s=ZERO_TOKENS_WAIT_S)
            x = torch.zeros(0, spec.hidden_size, dtype=torch.bfloat16, device=device)
            ids = torch.zeros(0, spec.top_k, dtype=torch.int64, device=device)
            out = d.dispatch(x, ids, torch.zeros(0, spec.top_k, device=device))
            y = d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16, device=device), out)
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"{dtype} 0 tokens: rows {_described(out.hidden_states)}, scales {_described(out.hidden_states_scale)}"
                  f", counts {out.expert_counts().tolist()}, combined {_described(y)}", flush=True)
        r = agree_with_torch(0, 1, "normal", "bf16", module.__name__, hidden=2048, experts_per_rank=4, top_k=4,
                             tokens=16, iterations=1, backend=backend)
        verdict = "agree" if r["relative_difference"] < 1e-2 else "DIFFER"
        print(f"then 16 tokens bf16 {verdict} rel {r['relative_difference']:.1e}", flush=True)
    finally:
        backend.close()
    return "done"


def _normal_one_rank(module: Any, group: Any, device: torch.device) -> str:
    """DeepEP's own answer to normal mode on one rank; the Buffer's destructor then runs on exit."""
    cfg = module.Config(vendor.DEFAULT_NUM_SMS, 6, 256, 6, 128)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = module.Buffer(group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(4096, 1))
    ids = torch.tensor([[0, 1]] * 4, dtype=vendor.topk_idx_dtype(module), device=device)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 8)
    x = torch.zeros(4, 2048, dtype=torch.bfloat16, device=device)
    said = _outcome(lambda: buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=ids,
                                         topk_weights=torch.ones(4, 2, device=device), config=cfg)[3])
    print(f"dispatch: {said}", flush=True)
    del buf  # ~Buffer: destroy() → intranode::barrier on one rank
    return "the Buffer was freed"


_PROBES: dict[str, Callable[[Any, Any, torch.device], str]] = {
    PROBE_NORMAL_ONE_RANK: _normal_one_rank,
    PROBE_TWO_LL_BUFFERS: _two_low_latency_buffers,
    PROBE_ELASTIC: _elastic_buffer,
    PROBE_V2_ZERO_TOKENS: _v2_zero_tokens,
}


def probe_names() -> tuple[str, ...]:
    """The probes that run in subprocesses."""
    return tuple(_PROBES)


def run_probe(name: str, fake: bool, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Run one probe in a fresh process (the real DeepEP on this GPU, or the fake on CPU)."""
    command = [sys.executable, "-m", __name__, name] + (["--fake"] if fake else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return ProbeResult(name, -1, f"timed out after {timeout_s} s (a hang): {exc.stdout or ''}{exc.stderr or ''}")
    return ProbeResult(name, done.returncode, (done.stdout + done.stderr).strip())


def _zero_token_steps(result: ProbeResult) -> list[str]:
    """The zero-token probe's steps, without the relative difference (it varies with the hardware)."""
    return [re.sub(r" rel \S+$", "", line) for line in result.output.splitlines()
            if line.startswith(("bf16 0 tokens", "fp8 0 tokens", "then 16 tokens"))]


def zero_tokens_row(real: ProbeResult, fake: ProbeResult) -> Row:
    """The zero-token probe on DeepEP against the same probe on the fake: the empty outputs' shapes, dtypes and counts,
    and the 16 tokens after them agreeing with torch, in a process that ended normally (or no ElasticBuffer). Shows
    the first step that differs from the fake's, else where the process stopped, else the steps."""
    steps, want = _zero_token_steps(real), _zero_token_steps(fake)
    ok = real.exit_code == 0 and ("no ElasticBuffer" in real.output or (
        len(steps) == 3 and steps == want and steps[-1].endswith(" agree")))
    last = real.output.strip().splitlines()[-1] if real.output.strip() else ""
    shown, expected = f"{real.exit_code}: " + (" | ".join(steps) or last), "the fake's steps; agree"
    differ = next(((a, b) for a, b in zip(steps, want) if a != b), None)
    if differ is not None:  # its first field that differs ("rows [0, 2048] bfloat16", "counts [...]", ...)
        name, fields = differ[0].split(":")[0], [re.split(r", (?=[a-z])", step) for step in differ]
        shown, expected = next(((a, b) for a, b in zip(*fields) if a != b), differ)
        shown = shown if shown.startswith(name) else f"{name}: {shown}"
    elif not ok and (real.exit_code != 0 or len(steps) < len(want)):  # "Dispatch CPU wait", a crash, a hang
        shown, expected = f"{real.exit_code} after {len(steps)} steps: {last}", (want + ["exit 0"])[len(steps)]
    return Row("DeepEP", "V2 normal one rank, 0 tokens (subprocess)", _text(shown, 60), _text(expected), ok)


def probe_rows(fake: bool) -> list[Row]:
    """The subprocess probes, started together (they are independent) and recorded; on the hardware the zero-token
    probe runs on the fake too (on CPU), to compare with."""
    commands = {name: [sys.executable, "-m", __name__, name] + (["--fake"] if fake else []) for name in _PROBES}
    if not fake:
        commands[f"{PROBE_V2_ZERO_TOKENS} --fake"] = [sys.executable, "-m", __name__, PROBE_V2_ZERO_TOKENS, "--fake"]
    running = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for name, cmd in commands.items()}
    results = {}
    for name, proc in running.items():
        try:
            out, _ = proc.communicate(timeout=PROBE_TIMEOUT_S)
            results[name] = ProbeResult(name, proc.returncode, (out or "").strip())
        except subprocess.TimeoutExpired:
            proc.kill()
            results[name] = ProbeResult(name, -1, f"timed out after {PROBE_TIMEOUT_S} s (a hang)")
    one = results[PROBE_NORMAL_ONE_RANK]
    two = results[PROBE_TWO_LL_BUFFERS]
    elastic = results[PROBE_ELASTIC]
    flat = lambda text: " | ".join(line for line in text.splitlines() if line.strip())  # noqa: E731
    return [
        Row("DeepEP", "normal one rank: DeepEP's dispatch (subprocess)", _text(flat(one.output), 60),
            "…Unsupported ranks", "Unsupported ranks" in one.output),
        Row("DeepEP", "normal one rank: exit status (terminate = -6/134)", str(one.exit_code), "(recorded)", True),
        Row("DeepEP", "two LL Buffers in one process (subprocess)", _text(f"{two.exit_code}: {flat(two.output)}", 60),
            "(recorded)", True),
        Row("DeepEP", "V2 cuda_deepep_v2 vs torch, one rank (subprocess)",
            _text(f"{elastic.exit_code}: {flat(elastic.output)}", 60), "agree (or no ElasticBuffer)",
            elastic.exit_code == 0 and ("no ElasticBuffer" in elastic.output
                                        or (elastic.output.count(" agree ") == 6 and "DIFFER" not in elastic.output
                                            and "capture failed" not in elastic.output
                                            and elastic.output.count(" padding rows zero ") == 3))),
        zero_tokens_row(results[PROBE_V2_ZERO_TOKENS],
                        results.get(f"{PROBE_V2_ZERO_TOKENS} --fake", results[PROBE_V2_ZERO_TOKENS])),
    ]


def _probe_main(argv: list[str]) -> int:
    """``python -m moe_dispatch_cuda_deepep_testing.hardware <probe> [--fake]``: one probe on a one-rank group."""
    parser = argparse.ArgumentParser(description="one cuda_deepep hardware probe, in its own process")
    parser.add_argument("probe", choices=sorted(_PROBES))
    parser.add_argument("--fake", action="store_true")
    args = parser.parse_args(argv)
    store = os.path.join(tempfile.mkdtemp(prefix="cuda_deepep_probe_"), "store")
    if args.fake:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        module, device = importlib.import_module(EMULATOR), torch.device("cpu")
    else:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))  # the communicator made now (DeepEP #726)
        module, device = importlib.import_module(vendor.REAL), torch.device("cuda")
    print(_outcome(lambda: _PROBES[args.probe](module, dist.group.WORLD, device)), flush=True)
    return 0


# -- all --------------------------------------------------------------------------------------------------------


def _section(name: str, rows: Callable[[], list[Row]]) -> list[Row]:
    """A section's rows, or one failing row with the exception where the library raised: on the
    hardware a raise is a finding to record, and the sections after it still run."""
    try:
        return rows()
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden: the row fails
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return [Row(name, "raised", _text(f"{type(exc).__name__}: {exc}", 60),
                    f"at {os.path.basename(where.filename)}:{where.lineno}", False)]


def run_checks(setup: Setup, emit: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Every section; DeepGEMM's run without DeepEP installed and DeepEP's without DeepGEMM. ``emit``
    gets each section's rows as soon as they are in, so a crash of the vendor's code (a segfault
    ends the process) leaves the sections before it on record."""
    rows: list[Row] = []

    def add(new: list[Row]) -> None:
        rows.extend(new)
        emit(new)

    try:
        deep_ep = importlib.import_module(setup.deep_ep)
    except ImportError as exc:
        deep_ep = None
        add([Row("DeepEP", "import", _text(f"{type(exc).__name__}: {exc}"), "installed", False)])
    deep_gemm = vendor.detect_deep_gemm(setup.deep_gemm)
    if deep_ep is not None:
        add(_section("signature", lambda: signature_rows(deep_ep, signature_records(deep_ep), "signature")))
    if deep_gemm.module is not None:
        add(_section("signature", lambda: signature_rows(deep_gemm.module, signature_records(deep_gemm.module),
                                                         "signature")))
    add(_section("sizes", lambda: size_rows(deep_ep, deep_gemm.module, setup.device)))
    if deep_gemm.module is not None:
        add(_section("DeepGEMM", lambda: scale_layout_rows(setup)))
        add(_section("DeepGEMM", lambda: deep_gemm_rows(setup)))
    else:
        add([Row("DeepGEMM", "import", _text(deep_gemm.describe()), "installed", False)])
    if deep_ep is not None:
        add(_section("DeepEP", lambda: deep_ep_rows(setup)))
        add(_section("DeepEP", lambda: probe_rows(setup.fake)))
    return rows


def fake_setup(hidden: int = 2048, tokens: int = 16, gemm_hidden: int = 2048) -> Setup:
    """The fakes in place of the real libraries, on CPU; needs a torch.distributed group of one."""
    group = dist.group.WORLD
    return Setup(EMULATOR, DEEP_GEMM_EMULATOR, torch.device("cpu"), group, group, True, hidden, tokens,
                 gemm_hidden)


__all__ = ["PROBE_ELASTIC", "PROBE_NORMAL_ONE_RANK", "PROBE_TWO_LL_BUFFERS", "PROBE_V2_ZERO_TOKENS", "ProbeResult", "Row",
           "Setup", "fake_setup", "probe_names", "probe_rows", "pybind_params", "run_checks", "run_probe",
           "scale_layout_rows", "signature_records", "signature_rows", "zero_tokens_row"]


if __name__ == "__main__":
    sys.exit(_probe_main(sys.argv[1:]))
