"""The flashinfer_cutedsl plugin against the real FlashInfer on one GPU (H100/H200/B200), compared with its fakes.

    python plugins/flashinfer_cutedsl/scripts/hardware_check.py          # or: torchrun --nproc-per-node 1 ...
    python plugins/flashinfer_cutedsl/scripts/hardware_check.py --fake   # the same checks on the fakes, on CPU

Needs the testing distribution (the fakes it compares with): pip install -e plugins/flashinfer_cutedsl/testing.

Checks, one table row each:

- signatures: every recorded signature (``vendor.SIGNATURES``) against the installed callable
  (``inspect``), CuteDslMoEWrapper from its source (AST);
- workspace size: FlashInfer's ``moe_a2a_get_workspace_size_per_rank`` (its JIT module's
  ``moe_a2a_get_aux_data_size``) against the ported formula, at several shapes; from 0.7.4 the one-sided
  module's ``moe_a2a_get_workspace_layout`` and metainfo names against ``vendor.ep_workspace_layout``;
- a2a ep=1: ``flashinfer_a2a`` through the real MoeAlltoAll at one rank (MNNVL memory: fabric or
  POSIX fd handles) against the same inputs through the fake of that version, and against the
  reference, at the ``--tokens`` shape and at T=17 top-3 (R·T·k odd: the receive-plane alignment
  FlashInfer 0.6.0-0.7.0 needs), the rows starting 8 bytes into their allocation on the device
  (FlashInfer <= 0.7.0 loads them with vector loads too);
- fp4_quantize: on the GPU against the core NVFP4 codec, bit for bit (data and linear scales), with
  and without the exact-math variables the installed version reads (``vendor.fp4_fast_math_env``);
- cutedsl ...: the CuTe-DSL runner on the real kernel against the fake, only on compute capability
  10.x (skipped with the reason elsewhere): PACKED BF16; MASKED with -1 slots (valid rows compared,
  padding rows must be zero); MASKED with every count zero (all ids -1: every row must come back
  zero); an EP offset (experts 4..7 of 8); pre-quantized NVFP4 rows with their own
  global scale and an fc2 scale different from the layer's input scale; zero rows.

A row is REFUSED only when FlashInfer itself refuses the machine (``vendor.ENVIRONMENT_REFUSALS``:
the MNNVL handle exchange, the driver's handle type, the JIT build), and its message is printed;
anything else raised (by the adapter, a kernel, a shape check) is a FAIL. Exit status 1 when a row
FAILs; 0 otherwise (refusals and skips are printed, not failures).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_dispatch as md
from moe_dispatch.backend import NVFP4Codec, WireFormat, nvfp4_global_scale, restored_environ
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl.experts import CuteDslExperts
from moe_dispatch_flashinfer_cutedsl_testing import EMULATOR, fake_for
from moe_dispatch_testing import one_rank_group, relative_error
from moe_dispatch_testing.signatures import compare, differences, signature_from_source


@dataclass
class Row:
    check: str
    status: str  # PASS | FAIL | REFUSED | SKIP
    detail: str


@dataclass
class Setup:
    module: str  # the vendor under test: "flashinfer", or a fake with --fake
    fake: str  # the fake of the same version range
    device: torch.device
    hidden: int
    tokens: int


# -- the checks ----------------------------------------------------------------------------------


def check_signatures(s: Setup) -> list[Row]:
    info = vendor.detect(s.module)
    if info.api is None or info.version is None:
        return [Row("signatures", "FAIL", info.describe())]
    module = importlib.import_module(s.module)
    api = info.api
    live: dict[str, Callable[..., Any]] = {"MnnvlConfig": api.MnnvlConfig.__init__}
    if info.a2a_profile().one_sided:
        live.update({"create_communication": api.create_communication, "BootstrapConfig": api.BootstrapConfig.__init__,
                     "MoEEpCommParams": api.MoEEpCommParams.__init__,
                     "NVLinkOneSidedConfig": api.NVLinkOneSidedConfig.__init__})
        live.update({f"NVLinkOneSidedAlltoAll.{m}": getattr(api.NVLinkOneSidedAlltoAll, m)
                     for m in ("__init__", "dispatch", "combine")})
    else:
        live.update({"MoeAlltoAll.__init__": api.MoeAlltoAll.__init__, "MoeAlltoAll.dispatch": api.MoeAlltoAll.dispatch,
                     "MoeAlltoAll.combine": api.MoeAlltoAll.combine,
                     "moe_a2a_get_workspace_size_per_rank": api.moe_a2a_get_workspace_size_per_rank,
                     "Mapping.__init__": api.Mapping.__init__})
    if info.api.fp4_quantize is not None:
        live["fp4_quantize"] = info.api.fp4_quantize
    problems, checked = [], 0
    for qualname, fn in live.items():
        recorded = vendor.signature(qualname, info.version)
        if recorded is not None:
            problems += differences(recorded, inspect.unwrap(fn))
            checked += 1
    cute = getattr(module, "CuteDslMoEWrapper", None)
    spec = importlib.util.find_spec("flashinfer")
    source = Path(spec.submodule_search_locations[0]) / "fused_moe" / "cute_dsl" / "fused_moe.py" if spec else None
    for qualname in ("CuteDslMoEWrapper.__init__", "CuteDslMoEWrapper.run"):
        recorded = vendor.signature(qualname, info.version)
        if recorded is None:
            continue
        if cute is not None and info.fake:
            problems += differences(recorded, getattr(cute, qualname.split(".")[1]))
        elif source is not None and source.is_file():  # importing it needs nvidia-cutlass-dsl (and triton)
            problems += compare(recorded.params, signature_from_source(source, qualname), qualname)
        else:
            continue
        checked += 1
    if problems:
        return [Row("signatures", "FAIL", "; ".join(problems))]
    return [Row("signatures", "PASS", f"{checked} callables of {info.describe()} match the records")]


def check_workspace_size(s: Setup) -> list[Row]:
    info = vendor.detect(s.module)
    assert info.api is not None and info.version is not None
    if info.a2a_profile().one_sided:
        return _check_ep_layout(info)
    rows = []
    for ep, t, disp, comb in ((1, 16, 2 * 2048 + 24, 2 * 2048), (8, 128, 2 * 7168 + 64, 2 * 7168),
                              (64, 1, 7168 // 2 + 448 + 64, 2 * 7168)):
        try:
            real = int(info.api.moe_a2a_get_workspace_size_per_rank(ep, t, disp, comb))
        except Exception as exc:  # noqa: BLE001 - a JIT build failure is FlashInfer's refusal; anything else fails
            rows.append(_failure(f"workspace size ep={ep} T={t}", exc))
            continue
        ported = vendor.ported_workspace_size_per_rank(ep, t, disp, comb, info.version)
        rows.append(Row(f"workspace size ep={ep} T={t}", "PASS" if real == ported else "FAIL",
                        f"FlashInfer {real:,} B, ported {ported:,} B (kMaxTopK {vendor.max_top_k(info.version)})"))
    return rows


def _check_ep_layout(info: vendor.VendorInfo) -> list[Row]:
    """The one-sided module's metainfo names and ``moe_a2a_get_workspace_layout`` against the port."""
    try:
        module = info.api.get_nvlink_one_sided_alltoall_module()
        names, _ = module.moe_a2a_get_metainfo_index_pairs()
    except Exception as exc:  # noqa: BLE001 - the JIT build refusing the machine is FlashInfer's refusal
        return [_failure("one-sided module", exc)]
    fields = [str(n).removeprefix("MOE_A2A_").removesuffix("_INDEX") for n in names][:len(vendor.EP_METAINFO_NAMES)]
    rows = [Row("one-sided metainfo names", "PASS" if tuple(fields) == vendor.EP_METAINFO_NAMES else "FAIL",
                f"{len(fields)} fields" if tuple(fields) == vendor.EP_METAINFO_NAMES else f"FlashInfer {fields}")]
    for ep, t, k, disp, comb in ((1, 16, 3, 16 * 4200, 16 * 4096), (8, 128, 8, 8 * 128 * 14400, 8 * 128 * 14336),
                                 (64, 1, 22, 64 * 4000, 64 * 14336)):
        metainfo = torch.zeros(len(vendor.EP_METAINFO_NAMES), dtype=torch.int64)
        module.moe_a2a_get_workspace_layout(ep, t, k, disp, comb, 0, 0, False, metainfo)
        ported = vendor.ep_workspace_layout(ep, t, k, disp, comb)
        real = dict(zip(vendor.EP_METAINFO_NAMES, metainfo.tolist()))
        wrong = [f"{n} {real[n]} vs {ported[n]}" for n in vendor.EP_METAINFO_NAMES if real[n] != ported[n]]
        rows.append(Row(f"one-sided layout ep={ep} T={t} k={k}", "FAIL" if wrong else "PASS",
                        "; ".join(wrong) or f"{real['WORKSPACE_SIZE']:,} B per rank, every field equal"))
    return rows


def _failure(check: str, exc: BaseException) -> Row:
    """REFUSED for FlashInfer's own refusal of the machine, FAIL for anything else."""
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return Row(check, "REFUSED" if vendor.is_environment_refusal(exc) else "FAIL", last)


def _source_rows(buf: torch.Tensor, device: torch.device, tokens: int, hidden: int) -> torch.Tensor:
    """``[tokens, hidden]`` rows 8 bytes into their allocation ON ``device``: the buffer is moved and
    then viewed (a view moved with ``.to(device)`` would land at the start of a fresh allocation)."""
    return buf.to(device)[4:].view(tokens, hidden)


def _a2a_run(module: str, device: torch.device, hidden: int, tokens: int, group: Any) -> tuple[torch.Tensor, float]:
    spec = md.DispatchSpec(hidden, 8, 3, num_max_dispatch_tokens_per_rank=tokens, output_dtype="bf16")
    d = md.create_dispatcher(FlashInferA2ABackend(module), spec, group, env={})
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(tokens * hidden + 4, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(tokens)])
    ids[::3, 1] = -1
    ids[1::5] = -1  # tokens with no expert
    w = torch.rand(tokens, 3, generator=g)
    out = d.dispatch(_source_rows(buf, device, tokens, hidden), ids.to(device), w.to(device))
    y = d.combine(out.hidden_states, out).float().cpu()
    x = buf[4:].view(tokens, hidden)  # the same rows on the CPU, for the reference
    ref = x.float() * ((ids >= 0).float() * w).sum(dim=1, keepdim=True)
    return y, relative_error(y, ref)


def check_a2a(s: Setup) -> list[Row]:
    rows = []
    gloo = dist.new_group(backend="gloo") if s.device.type != "cpu" else None  # the fake runs on CPU
    for label, tokens in (("a2a ep=1", s.tokens), ("a2a ep=1 T=17 top-3 (plane alignment)", 17)):
        try:
            got, err = _a2a_run(s.module, s.device, s.hidden, tokens, None)
        except Exception as exc:  # noqa: BLE001 - FlashInfer's refusal is the record; anything else fails
            rows.append(_failure(label, exc))
            continue
        fake, fake_err = _a2a_run(s.fake, torch.device("cpu"), s.hidden, tokens, gloo)
        diff = relative_error(got, fake)
        ok = err < 1e-2 and diff < 1e-2
        rows.append(Row(label, "PASS" if ok else "FAIL", f"vs reference {err:.2e}, vs {s.fake.rsplit('.', 1)[-1]} "
                                                         f"{diff:.2e} (fake vs reference {fake_err:.2e})"))
    return rows


def check_fp4(s: Setup) -> list[Row]:
    info = vendor.detect(s.module)
    if info.api is None or info.api.fp4_quantize is None:
        return [Row("fp4_quantize", "SKIP", "no fp4_quantize")]
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(130, 512, generator=g) * 3).to(torch.bfloat16)
    gs = nvfp4_global_scale(float(x.float().abs().max()))
    q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, 512), gs).quantize(x)
    rows = []
    settings = [("", {})]
    exact = vendor.fp4_fast_math_env(info.version or vendor.VERIFIED_UNTIL)
    if exact:  # only the variables this version reads
        settings.append((" exact math", {name: vendor.ENV_TRUE for name in exact}))
    for label, env in settings:
        try:
            with restored_environ(env):
                data, sf = info.api.fp4_quantize(x.to(s.device), torch.tensor([gs], device=s.device),
                                                 is_sf_swizzled_layout=False)
        except Exception as exc:  # noqa: BLE001
            rows.append(_failure(f"fp4_quantize{label}", exc))
            continue
        same_data = torch.equal(data.cpu().view(torch.uint8), q.data.view(torch.uint8))
        same_sf = torch.equal(sf.cpu().view(torch.uint8).reshape(q.scale.shape), q.scale.view(torch.uint8))
        mismatched = int((data.cpu().view(torch.uint8) != q.data.view(torch.uint8)).sum())
        rows.append(Row(f"fp4_quantize{label}", "PASS" if same_data and same_sf else "FAIL",
                        f"vs the core NVFP4 codec: data {'equal' if same_data else f'{mismatched} bytes differ'}, "
                        f"scales {'equal' if same_sf else 'differ'}"))
    return rows


@dataclass(frozen=True)
class CuteCase:
    """One CuTe-DSL runner call, run on the real kernel and on the fake."""

    check: str
    masked: bool = False
    first_expert: int = 0
    num_experts: int = 4
    nvfp4_rows: bool = False
    fc2: float = 4.0  # amax of the intermediate the fc2 global scale is made for
    counts: tuple[int, ...] = (3, 0, 5, 1)  # rows per local expert


CUTE_CASES = (
    CuteCase("cutedsl packed bf16"),
    CuteCase("cutedsl masked, -1 slots", masked=True),
    # Every count zero: the usual low-latency decode state of a rank whose experts got no token.
    CuteCase("cutedsl masked, no routed row (all ids -1)", masked=True, counts=(0, 0, 0, 0)),
    CuteCase("cutedsl ep offset (experts 4..7 of 8)", first_expert=4, num_experts=8),
    CuteCase("cutedsl nvfp4 rows, own global scale, fc2 != input scale", nvfp4_rows=True, fc2=2.0),
    CuteCase("cutedsl zero rows", counts=(0, 0, 0, 0)),
)


def _cutedsl_run(case: CuteCase, module: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The runner's output on ``module`` (float, on the CPU) and the MASKED validity mask."""
    hidden, inter, local = 256, 128, 4
    g = torch.Generator().manual_seed(2)
    weights = md.ExpertWeights(torch.randn(case.num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5,
                               torch.randn(case.num_experts, hidden, inter, generator=g) / inter ** 0.5)
    gs = nvfp4_global_scale(4.0)
    kernel = CuteDslExperts(module)
    layer = kernel.process_weights(weights.slice(case.first_expert, local), first_expert=case.first_expert,
                                   num_experts=case.num_experts, input_global_scale=gs,
                                   fc2_input_scale=nvfp4_global_scale(case.fc2))
    layer.to(device)
    counts = torch.tensor(case.counts, dtype=torch.int64)
    rows = int(counts.sum())
    x = (torch.randn(max(rows, 1), hidden, generator=g) * 1.5).to(torch.bfloat16)[:rows]
    valid = None
    scale, global_scale = None, None
    if case.masked:
        cap = 6
        hidden_states = torch.zeros(local, cap, hidden, dtype=torch.bfloat16)
        valid = torch.arange(cap).unsqueeze(0) < counts.unsqueeze(1)
        hidden_states[valid] = x
    elif case.nvfp4_rows:
        global_scale = nvfp4_global_scale(float(x.float().abs().max()))  # not the layer's input scale
        q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, hidden), global_scale).quantize(x)
        hidden_states, scale = q.data, q.scale.to(device)
    else:
        hidden_states = x
    out = kernel.apply_without_routing_weights(layer, hidden_states.to(device), scale, 1, counts.to(device),
                                               torch.bfloat16, global_scale=global_scale)
    return out.float().cpu(), valid


def check_cutedsl(s: Setup) -> list[Row]:
    reason = CuteDslExperts(s.module).probe()
    if reason is not None:
        return [Row("cutedsl", "SKIP", reason)]
    rows = []
    for case in CUTE_CASES:
        try:
            got, valid = _cutedsl_run(case, s.module, s.device)
        except Exception as exc:  # noqa: BLE001 - the adapter or the kernel failed
            rows.append(_failure(case.check, exc))
            continue
        want, _ = _cutedsl_run(case, s.fake, torch.device("cpu"))
        if tuple(got.shape) != tuple(want.shape):
            rows.append(Row(case.check, "FAIL", f"shape {tuple(got.shape)}, the fake's {tuple(want.shape)}"))
            continue
        detail, ok = [], True
        if valid is not None:
            padding = got[~valid]
            ok = bool(torch.isfinite(padding).all() and not padding.any())
            detail.append(f"padding rows {'zero' if ok else 'NOT zero'}")
            got, want = got[valid], want[valid]
        if got.numel():
            diff = relative_error(got, want)
            ok = ok and diff < 2e-2
            detail.insert(0, f"runner on {s.module} vs the fake: {diff:.2e}")
        elif valid is None:
            detail.insert(0, f"{tuple(got.shape)} as the fake, no kernel launched")
        else:
            detail.insert(0, f"no routed row in {int(valid.numel())} slots (every id -1)")
        rows.append(Row(case.check, "PASS" if ok else "FAIL", "; ".join(detail)))
    return rows


CHECKS = (check_signatures, check_workspace_size, check_a2a, check_fp4, check_cutedsl)


def run(s: Setup) -> list[Row]:
    rows = []
    for check in CHECKS:
        try:
            rows += check(s)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            rows.append(Row(check.__name__, "FAIL", "".join(traceback.format_exception_only(type(exc), exc)).strip()))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="run the checks on the fakes, on CPU")
    parser.add_argument("--fake-module", default=EMULATOR, help="the fake standing in for FlashInfer")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.fake:
        started = one_rank_group("gloo")
        setup = Setup(args.fake_module, args.fake_module, torch.device("cpu"), args.hidden, args.tokens)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --fake to check the fakes on CPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        started = one_rank_group("nccl")
        info = vendor.detect(vendor.REAL)
        if info.api is None or info.version is None:
            print(info.describe(), file=sys.stderr)
            return 2
        setup = Setup(vendor.REAL, fake_for(info.version), torch.device("cuda"), args.hidden, args.tokens)
    if dist.get_world_size() != 1:
        print("run on one rank (torchrun --nproc-per-node 1)", file=sys.stderr)
        return 2
    try:
        rows = run(setup)
    finally:
        if started:
            dist.destroy_process_group()
    width = max(len(r.check) for r in rows)
    print(f"flashinfer_cutedsl hardware check: {setup.module} on {setup.device} (fake: {setup.fake})")
    for r in rows:
        print(f"{r.check:<{width}}  {r.status:<7}  {r.detail}")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
