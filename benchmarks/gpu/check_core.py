"""The core on one accelerator: codecs, reference backends and low-latency mode in a CUDA graph.

The first checks of ``shared/GPU.md``, in one process (world size 1, NCCL on CUDA)::

    python benchmarks/gpu/check_core.py [--json out.json]

1. **codecs**: every wire format quantized on the device gives the same bytes (data and scales)
   as on the CPU, and dequantizes to the same values;
2. **layers**: dispatch → reference experts → combine on the ``torch`` and ``allgather``
   backends, every mode and dtype, against the dense fp32 reference (the kit's tolerance);
3. **graph**: low-latency dispatch + combine captured once in a CUDA graph and replayed with new
   inputs copied into the same static tensors, against eager runs on those inputs, with the
   value checks off and with them on (they stand aside during a capture);
4. **nosync**: low-latency dispatch + combine, blocking and in split phase, with the default
   ``check_inputs`` under ``torch.cuda.set_sync_debug_mode("warn")`` (every line that syncs is named),
   and the time per pair with the default against ``check_inputs=True`` (what the value checks'
   sync costs: the measurement behind the default, issue 16);
5. **streams**: dispatch and combine started on a side stream (spinning ~10 ms first: ``moe_dispatch_testing.streams``)
   and waited on the default one (``Pending``'s promise: ``wait()`` orders the stream current at the wait, and hands
   it the result), against the blocking calls.

``--device cpu`` runs 1 and 2 on gloo (how this script is tested without a GPU); 3 needs CUDA.
Prints a table; the exit status is 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.backend import as_bytes, make_codec, nvfp4_global_scale
from moe_dispatch_testing.local import one_rank_group
from moe_dispatch_testing.routing import random_expert_weights, random_routing
from moe_dispatch_testing import ScaledIdentityExperts, ScaledLayer, check_layer
from moe_dispatch_testing.streams import captured, run_started

H, E, K, T = 512, 16, 4, 32
BACKENDS = ("torch", "allgather")


@dataclass(frozen=True)
class Check:
    group: str
    name: str
    ok: bool
    detail: str


def _wire_formats() -> list[tuple[str, mdb.WireFormat, float | None]]:
    gs = nvfp4_global_scale(8.0)
    return [("bf16", mdb.WireFormat(md.DispatchDtype.BF16, H), None),
            ("fp8", mdb.WireFormat(md.DispatchDtype.FP8, H), None),
            ("fp8/ue8m0", mdb.WireFormat(md.DispatchDtype.FP8, H, ue8m0=True), None),
            ("int8", mdb.WireFormat(md.DispatchDtype.INT8, H), None),
            ("nvfp4", mdb.WireFormat(md.DispatchDtype.NVFP4, H), gs)]


def check_codecs(device: torch.device) -> list[Check]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    x[0, :7] = torch.tensor([0.0, 1e-6, -1e-6, 7.5, -7.5, 3e-3, 448.0 / 64])  # zeros, tiny values, ties, block maxima
    x = x.to(torch.bfloat16)
    checks = []
    for name, wire, gs in _wire_formats():
        codec = make_codec(wire, gs)
        on_cpu, on_dev = codec.quantize(x), codec.quantize(x.to(device))
        problems = []
        for part, a, b in (("data", on_cpu.data, on_dev.data), ("scale", on_cpu.scale, on_dev.scale)):
            if (a is None) != (b is None):
                problems.append(f"{part}: present on one device only")
            elif a is not None and not torch.equal(as_bytes(a.contiguous()), as_bytes(b.cpu().contiguous())):
                differ = int((as_bytes(a.contiguous()) != as_bytes(b.cpu().contiguous())).sum())
                problems.append(f"{part}: {differ} bytes differ")
        deq_cpu, deq_dev = codec.dequantize(on_cpu), codec.dequantize(on_dev).cpu()
        if not torch.equal(deq_cpu, deq_dev):
            problems.append(f"dequantized values differ (max {float((deq_cpu - deq_dev).abs().max()):.3g})")
        checks.append(Check("codecs", f"{name} on {device.type} == cpu", not problems,
                            "; ".join(problems) or "bit-equal"))
    return checks


def check_layers(device: torch.device) -> list[Check]:
    checks = []
    weights = random_expert_weights(E, H, 256, generator=torch.Generator().manual_seed(1))
    for backend in BACKENDS:
        for mode in md.Mode:
            for dtype in md.DispatchDtype:
                quant = md.QuantHints(input_global_scale=nvfp4_global_scale(8.0)) if dtype is md.DispatchDtype.NVFP4 \
                    else md.QuantHints()
                spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode=mode, output_dtype=dtype,
                                       quant=quant)
                name = f"{backend} {mode.value} {dtype.value}"
                try:
                    d = md.create_dispatcher(backend, spec, env={})
                    on_device = md.ExpertWeights(weights.w13_weight.to(device), weights.w2_weight.to(device))
                    got = check_layer(0, 1, d, md.TorchExperts(), on_device, weights, tokens=T,
                                      generator=torch.Generator().manual_seed(2), device=device)
                except Exception as exc:  # noqa: BLE001 - a failure is a result here
                    checks.append(Check("layers", name, False, f"{type(exc).__name__}: {exc}"))
                    continue
                checks.append(Check("layers", name, got.relative_error < got.tolerance,
                                    f"rel err {got.relative_error:.2e} (limit {got.tolerance})"))
    return checks


def _graph_step(d: md.Dispatcher, layer: ScaledLayer, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
                ) -> torch.Tensor:
    out = d.dispatch(x, ids, w)
    rows = ScaledIdentityExperts().apply_without_routing_weights(layer, out.hidden_states, out.hidden_states_scale,
                                                                 out.group_list_type, out.group_list, torch.bfloat16,
                                                                 global_scale=out.global_scale)
    return d.combine(rows, out)


def _inputs(seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, E, K, generator=g, drop_prob=0.1)
    return x.to(device), ids.to(device), w.to(device)


def check_graph(device: torch.device) -> list[Check]:
    if device.type != "cuda":
        return [Check("graph", "low_latency in a CUDA graph", True, "skipped: needs CUDA")]
    checks = []
    layer = _layer_on(device)
    for backend in BACKENDS:
        for dtype in md.DispatchDtype:
            for check_inputs in (None, False, True):  # None: the default (no value checks on a device)
                name = f"{backend} {dtype.value} checks {({None: 'default', False: 'off', True: 'on'})[check_inputs]}"
                quant = md.QuantHints(input_global_scale=nvfp4_global_scale(8.0)) \
                    if dtype is md.DispatchDtype.NVFP4 else md.QuantHints()
                spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency",
                                       output_dtype=dtype, quant=quant)
                d = md.create_dispatcher(backend, spec, env={}, check_inputs=check_inputs)
                x, ids, w = _inputs(10, device)
                checks.append(_capture_and_replay(name, lambda: _graph_step(d, layer, x, ids, w), (x, ids, w),
                                                  device))
    return checks


def check_nosync(device: torch.device) -> list[Check]:
    if device.type != "cuda":
        return [Check("nosync", "low_latency without a host sync", True, "skipped: needs CUDA")]
    import time

    checks = []
    layer = _layer_on(device)
    for backend in BACKENDS:
        spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency", output_dtype="fp8")
        default, checked = (md.create_dispatcher(backend, spec, env={}, check_inputs=c) for c in (None, True))
        x, ids, w = _inputs(20, device)

        def split_step(d: md.Dispatcher = default) -> torch.Tensor:
            out = d.dispatch_start(x, ids, w).wait()
            rows = ScaledIdentityExperts().apply_without_routing_weights(
                layer, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16)
            return d.combine_start(rows, out).wait()

        for name, step in (("blocking", lambda: _graph_step(default, layer, x, ids, w)), ("split phase", split_step)):
            step()  # warm-up outside the debug mode (first-call allocations)
            torch.cuda.synchronize()
            sites = _sync_sites(step)
            ok, detail = not sites, "no host sync" if not sites else f"synced at {'; '.join(sites)}"
            checks.append(Check("nosync", f"{backend} fp8 {name}, default checks", ok, detail))
        per_pair = {}
        for label, d in (("default", default), ("check_inputs=True", checked)):
            for _ in range(3):
                _graph_step(d, layer, x, ids, w)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50):
                _graph_step(d, layer, x, ids, w)
            torch.cuda.synchronize()
            per_pair[label] = (time.perf_counter() - start) / 50 * 1e6
        checks.append(Check("nosync", f"{backend} fp8 time per pair", True,
                            ", ".join(f"{k} {v:.0f} us" for k, v in per_pair.items())))
    return checks


def check_streams(device: torch.device) -> list[Check]:
    if device.type != "cuda":
        return [Check("streams", "start on one stream, wait on another", True, "skipped: needs CUDA")]
    checks = []
    layer = _layer_on(device)
    for backend in BACKENDS:
        for mode in md.Mode:
            spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode=mode, output_dtype="fp8")
            d = md.create_dispatcher(backend, spec, env={})
            x, ids, w = _inputs(30, device)
            want = _graph_step(d, layer, x, ids, w)
            out = run_started(lambda: d.dispatch_start(x, ids, w), device, side_stream=True)
            rows = ScaledIdentityExperts().apply_without_routing_weights(
                layer, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16)
            got = run_started(lambda: d.combine_start(rows, out), device, side_stream=True)
            same = torch.equal(got, want)
            checks.append(Check("streams", f"{backend} {mode.value} fp8 side stream", same,
                                "bit-equal to the blocking calls" if same else
                                f"differs: max {float((got.float() - want.float()).abs().max()):.3g}"))
    return checks


def _layer_on(device: torch.device) -> ScaledLayer:
    """The experts' factors on the device: a host tensor copied in every step would sync, and
    break a capture, in the test's own code (as it did on the first H100 run)."""
    layer = ScaledLayer.for_rank(H, E, 0, E)
    return ScaledLayer(layer.hidden_size, layer.factors.to(device))


def _where(exc: BaseException) -> str:
    """The innermost frame of the project's own code in ``exc``'s traceback: where to look."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "moe_dispatch" in f.filename or "check_core" in f.filename] or frames
    f = ours[-1]
    return f"{_short(f.filename)}:{f.lineno} ({f.name})"


def _short(path: str) -> str:
    return "/".join(path.split("/")[-2:])


def _sync_sites(step: Callable[[], torch.Tensor]) -> list[str]:
    """Every line of Python that made a host sync in ``step``: torch's sync debug mode "warn"
    turns each into a warning whose location is the calling line (the "error" mode stops at the
    first)."""
    sites: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "called a synchronizing" in str(w.message):  # not the mode's own "prototype feature" notice
            site = f"{_short(w.filename)}:{w.lineno}"
            if site not in sites:
                sites.append(site)
    return sites


def _capture_and_replay(name: str, step: Callable[[], torch.Tensor], static: tuple[torch.Tensor, ...],
                        device: torch.device) -> Check:
    try:
        graph, y_static = captured(step)
    except Exception as exc:  # noqa: BLE001 - a capture failure is the finding
        return Check("graph", name, False, f"capture failed at {_where(exc)}: {type(exc).__name__}: "
                                           f"{str(exc).splitlines()[0]}")
    worst, bit_equal = 0.0, True
    for seed in (11, 12, 13):
        for dst, src in zip(static, _inputs(seed, device)):
            dst.copy_(src)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        bit_equal &= torch.equal(y_static, eager)
        worst = max(worst, relative_error(y_static.float().cpu(), eager.float().cpu()))
    return Check("graph", name, worst < 1e-2, f"replay vs eager: rel {worst:.2e}, bit-equal {bit_equal}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--only", choices=["codecs", "layers", "graph", "nosync", "streams"], action="append")
    p.add_argument("--json", help="write the checks as JSON to this path")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    started = one_rank_group("nccl" if device.type == "cuda" else "gloo")
    groups = {"codecs": check_codecs, "layers": check_layers, "graph": check_graph, "nosync": check_nosync,
              "streams": check_streams}
    checks: list[Check] = []
    try:
        for group, run in groups.items():
            if args.only is None or group in args.only:
                checks += run(device)
    finally:
        if started:
            dist.destroy_process_group()
    about = f"torch {torch.__version__}"
    if device.type == "cuda":
        about += f", CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"
    print(f"moe-dispatch core on {device.type} ({about})")
    print(f"{'group':<7} {'check':<36} {'ok':<4} detail")
    for c in checks:
        print(f"{c.group:<7} {c.name:<36} {'yes' if c.ok else 'NO':<4} {c.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": about, "checks": [asdict(c) for c in checks]}, f, indent=1)
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
