"""Checks that run on every rank: ``wire_seen`` (the fakes only: it reads their ``Buffer.calls`` record of what
reached DeepEP), ``agree_with_torch`` (the fakes in the tests, the real DeepEP on GPUs through
``scripts/run_on_gpu.py``: agreement with the core ``torch`` backend and round-trip times) and ``run_layer`` (the
``deep_gemm`` runner between dispatch and combine, against the dense reference)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import row_experts
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import RUNNER, DeepGemmExperts, sglang_expected_m
from moe_dispatch_cuda_deepep.elastic import DeepEPV2Backend
from moe_dispatch_cuda_deepep.vendor import DEEP_GEMM, NUM_MAX_NVL_PEERS, REAL
from moe_dispatch_testing import LayerCheck, ScaledIdentityExperts, ScaledLayer, check_layer
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch_testing.routing import random_expert_weights, random_routing
from moe_dispatch_testing.streams import captured, run_started

from . import EMULATOR


@dataclass(frozen=True)
class WireCheck:
    """One rank's view of one dispatch: the dtype the dispatcher resolved, what the vendor
    call received, and the payload bytes expected for that dtype."""

    resolved: str
    vendor_x_dtype: str
    vendor_use_fp8: bool | None
    vendor_payload_bytes: int
    expected_payload_bytes: int
    output_scale_dtype: str | None


def _batch(spec: md.DispatchSpec, rank: int, world: int, tokens: int, device: torch.device, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * tokens, spec.hidden_size, generator=g).to(torch.bfloat16)
    ids, w = random_routing(world * tokens, spec.num_experts, spec.top_k, generator=g, drop_prob=0.1)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    return x[mine].to(device), ids[mine].to(device), w[mine].to(device), ids


def wire_seen(rank: int, world: int, mode: str, dtype: str, vendor_module: str = EMULATOR, hidden: int = 2048,
              tokens: int = 8, ue8m0: bool = False) -> WireCheck:
    """Dispatch once and report what the vendor call got, from a fake's ``Buffer.calls`` (the real DeepEP keeps
    no such record)."""
    gs = 448.0 * 6.0 / 5.0 if dtype == "nvfp4" else None  # NVFP4's global scale for activations up to ~5
    spec = md.DispatchSpec(hidden, 4 * world, 3, num_max_dispatch_tokens_per_rank=tokens, mode=mode, output_dtype=dtype,
                           quant=md.QuantHints(fp8_ue8m0_scales=ue8m0, input_global_scale=gs))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)  # INT8 → FP8 is the point of one case
        d = md.create_dispatcher(DeepEPBackend(vendor_module), spec, env={})
    device = torch.device("cuda" if vendor_module == REAL else "cpu")
    x, ids, w, all_ids = _batch(d.spec, rank, world, tokens, device)
    out = d.dispatch(x, ids, w)
    call = d.backend_dispatcher.buffer.calls[-1]
    wire = d.spec.wire_format().bytes_per_token
    local = d.spec.local_experts(world)
    if d.spec.mode is md.Mode.LOW_LATENCY:
        # Every token slot to every rank (the emulator's all-gather). LL messages carry fp32
        # scales even with UE8M0: the kernel packs the exponents on the receiving side.
        wire = mdb.WireFormat(d.output_dtype, hidden).bytes_per_token
        expected = tokens * world * wire
    else:
        pairs = sum(len({int(e) // local for e in row if e >= 0}) for row in ids.tolist())
        expected = pairs * wire
    scale = out.hidden_states_scale
    return WireCheck(d.output_dtype.value, str(call.x_dtype), call.use_fp8, call.payload_bytes, expected,
                     None if scale is None else str(scale.dtype))


def layer_spec(world: int, mode: str, dtype: str, hidden: int = 7168, experts_per_rank: int = 8, top_k: int = 8,
               tokens: int = 128, ue8m0: bool = False, expert_alignment: int = 1) -> md.DispatchSpec:
    """The spec ``agree_with_torch`` runs."""
    return md.DispatchSpec(hidden, experts_per_rank * world, top_k, num_max_dispatch_tokens_per_rank=tokens,
                           mode=mode, output_dtype=dtype, quant=md.QuantHints(fp8_ue8m0_scales=ue8m0),
                           expert_alignment=expert_alignment)


def fitting_experts_per_rank(backend: DeepEPBackend, world: int, hidden: int = 7168, top_k: int = 8,
                             tokens: int = 128, most: int = 32) -> int:
    """The experts per rank ``scripts/run_on_gpu.py`` runs: ``most``, halved past 8 ranks until one low-latency Buffer
    serves both modes (``DeepEPBackend.both_modes_options``: normal mode asserts both regions below INT_MAX)."""
    per_rank = most
    while world > NUM_MAX_NVL_PEERS and per_rank > 1:
        shape = dict(hidden=hidden, experts_per_rank=per_rank, top_k=top_k, tokens=tokens)
        try:
            backend.both_modes_options(layer_spec(world, "normal", "bf16", **shape),
                                       layer_spec(world, "low_latency", "bf16", **shape), world)
            break
        except md.CapacityError:
            per_rank //= 2
    return per_rank


def agree_with_torch(rank: int, world: int, mode: str, dtype: str, vendor_module: str = REAL, hidden: int = 7168,
                     experts_per_rank: int = 8, top_k: int = 8, tokens: int = 128, iterations: int = 20,
                     ue8m0: bool = False, backend: mdb.Backend | None = None,
                     options: dict | None = None, expert_alignment: int = 1, split: bool = False,
                     side_stream: bool = False) -> dict:
    """Dispatch + scaled-identity experts + combine on DeepEP and on the ``torch`` backend:
    the relative difference, the median time per round trip of each (``seconds``), and, for deciding whether creation
    should warm DeepEP's JIT up, the DeepEP dispatcher's creation and its first round trip (``created_s``,
    ``first_s``: DeepEP 2.x compiles its kernels at the first call of a shape). ``backend``: the one to create through
    (a new one by default; the Buffers are the process's either way). ``options``: ``create_dispatcher``'s.
    ``expert_alignment``: the spec's; ``split``: both calls in split phase (``dispatch_start``, ``wait``, ...);
    ``side_stream``: each started on a side stream and waited on the current one (``run_started``)."""
    device = torch.device("cuda" if vendor_module == REAL else "cpu")
    spec = layer_spec(world, mode, dtype, hidden, experts_per_rank, top_k, tokens, ue8m0, expert_alignment)
    begun = time.perf_counter()
    deepep = md.create_dispatcher(backend or DeepEPBackend(vendor_module), spec, env={}, options=options)
    created_s = time.perf_counter() - begun
    reference = md.create_dispatcher("torch", spec, env={})
    x, ids, w, _ = _batch(spec, rank, world, tokens, device, seed=1)
    layer = ScaledLayer.for_rank(hidden, spec.num_experts, rank, experts_per_rank)
    experts = ScaledIdentityExperts()

    def round_trip(d: md.Dispatcher) -> torch.Tensor:
        if not split:
            out = d.dispatch(x, ids, w)
            return d.combine(md.run_experts(experts, layer, out), out)
        out = run_started(lambda: d.dispatch_start(x, ids, w), device, side_stream)
        rows = md.run_experts(experts, layer, out)
        return run_started(lambda: d.combine_start(rows, out), device, side_stream)

    def timed(d: md.Dispatcher) -> tuple[torch.Tensor, float]:
        """One round trip and its seconds, the device's queue drained on both sides."""
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = round_trip(d)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - start

    results, times, first = {}, {}, {}
    for name, d in (("cuda_deepep", deepep), ("torch", reference)):
        results[name], first[name] = timed(d)
        samples = sorted(timed(d)[1] for _ in range(iterations))
        times[name] = samples[len(samples) // 2] if samples else 0.0
    return {"relative_difference": relative_error(results["cuda_deepep"], results["torch"]), "seconds": times,
            "created_s": created_s, "first_s": first["cuda_deepep"]}


def captured_against_eager(rank: int, world: int, dtype: str, backend: mdb.Backend, vendor_module: str = REAL,
                           hidden: int = 2048, experts_per_rank: int = 4, top_k: int = 4, tokens: int = 16,
                           expert_alignment: int = 1) -> str:
    """Low-latency dispatch + scaled-identity experts + combine, with the dispatcher's defaults, captured once in a
    CUDA graph after a warm-up (DeepEP's JIT compiles at the first call of a shape) and replayed on new inputs copied
    into the captured ones: ``"replay agrees ..."``, ``"replay DIFFERS ..."`` or ``"capture failed ..."`` (what the
    backend's ``cuda_graph_modes`` claims); ``"skipped (needs CUDA)"`` off CUDA (the fakes)."""
    device = torch.device("cuda" if vendor_module == REAL else "cpu")
    if device.type != "cuda":
        return "skipped (needs CUDA)"
    spec = layer_spec(world, "low_latency", dtype, hidden, experts_per_rank, top_k, tokens,
                      expert_alignment=expert_alignment)
    d = md.create_dispatcher(backend, spec, env={})
    layer = ScaledLayer.for_rank(hidden, spec.num_experts, rank, experts_per_rank)
    static = _batch(spec, rank, world, tokens, device, seed=1)[:3]

    def step() -> torch.Tensor:
        out = d.dispatch(*static)
        return d.combine(md.run_experts(ScaledIdentityExperts(), layer, out), out)

    try:
        graph, result = captured(step)
    except Exception as exc:  # noqa: BLE001 - a capture failure is the finding
        return f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    worst = 0.0
    for seed in (2, 3, 4):
        for into, new in zip(static, _batch(spec, rank, world, tokens, device, seed=seed)[:3]):
            into.copy_(new)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        worst = max(worst, relative_error(result, eager))
    return f"replay {'agrees' if worst < 1e-2 else 'DIFFERS'} with eager (rel {worst:.1e})"


def nonzero_padding(rank: int, world: int, dtype: str, backend: mdb.Backend, vendor_module: str = REAL,
                    expert_alignment: int = 128, calls: int = 20, hidden: int = 2048, ue8m0: bool = False,
                    split: bool = False) -> dict[str, int]:
    """Dispatch ``calls`` batches with the rows at ``expert_alignment``: how many padding rows are not all zero bits,
    per tensor (``data``, ``scales``, and ``weights``: the handle's per-row weights where it keeps them).
    DeepEP V2 zeroes its padding with a TMA store from shared memory written without a proxy fence
    (dispatch_copy_epilogue.cuh:232-238, 288-293): only a device can say whether stale bytes get through. Every
    rank's four local experts get 128 rows (a multiple of the alignment: no padding),
    none, 160 (one past a block) and 32, in a shuffled order each call; ``split``: ``dispatch_start`` + ``wait``."""
    device = torch.device("cuda" if vendor_module == REAL else "cpu")
    tokens = 160
    spec = layer_spec(world, "normal", dtype, hidden, 4, 2, tokens, ue8m0, expert_alignment)
    d = md.create_dispatcher(backend, spec, env={})
    local = torch.tensor([[0, 2]] * 128 + [[2, 3]] * 32)  # counts per local expert: 128, 0, 160, 32
    found = {"data": 0, "scales": 0, "weights": 0}
    for call in range(calls):
        g = torch.Generator().manual_seed(100 + call)
        order = torch.randperm(tokens, generator=g)
        ids = (local[order] + 4 * ((rank + call) % world)).to(device)  # this call's destination rank
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)
        w = torch.rand(tokens, 2, generator=g).to(device)
        out = d.dispatch_start(x, ids, w).wait() if split else d.dispatch(x, ids, w)
        padding = row_experts(out.expert_counts(), expert_alignment, out.hidden_states.shape[0]) < 0
        weights = getattr(out.handle, "weights", None)
        for name, t in (("data", out.hidden_states), ("scales", out.hidden_states_scale), ("weights", weights)):
            if t is not None and bool(padding.any()):
                bits = t[padding].contiguous().view(torch.uint8).reshape(int(padding.sum()), -1)
                found[name] += int((bits != 0).any(1).sum())
    return found


def run_layer(rank: int, world: int, weights: str, mode: str, kernel_module: str = DEEP_GEMM,
              vendor_module: str | None = None, hidden: int = 2048, intermediate: int = 256,
              experts_per_rank: int = 2, top_k: int = 2, tokens: int = 128, ue8m0: bool | None = None,
              seed: int = 0, v2: bool = False, aligned: bool = False) -> LayerCheck:
    """Run on every rank (``RankPool.map`` in the tests, torchrun on a GPU): a DeepEP dispatcher
    whose spec takes the kernel's quant hints, the kernel on this rank's experts, combine, and
    the relative error against the dense fp32 reference on the dequantized weights. ``v2``: the dispatcher is
    ``cuda_deepep_v2`` (DeepEP 2.x's ElasticBuffer; low latency: its worst-case rows).
    ``aligned``: the spec asks for the kernel's
    ``expert_alignment`` (V2 writes that layout itself; V1 through the core's copy), so the runner copies nothing."""
    experts = DeepGemmExperts(weights, mode, kernel_module, ue8m0=ue8m0)
    spec = md.DispatchSpec(hidden, experts_per_rank * world, top_k, num_max_dispatch_tokens_per_rank=tokens,
                           mode=mode, quant=experts.quant_hints(), runner=RUNNER,
                           expert_alignment=experts.expert_alignment if aligned else 1)
    backend = (DeepEPV2Backend if v2 else DeepEPBackend)(vendor_module or REAL)
    dispatcher = md.create_dispatcher(backend, spec, env={})
    device = torch.device("cuda" if kernel_module == DEEP_GEMM else "cpu")
    g = torch.Generator().manual_seed(seed)
    global_layer = experts.process_weights(random_expert_weights(spec.num_experts, hidden, intermediate, generator=g))
    layer = dataclasses.replace(global_layer.slice(rank * experts_per_rank, experts_per_rank),
                                expected_m=sglang_expected_m(spec, world)).to(device)
    return check_layer(rank, world, dispatcher, experts, layer, global_layer.dequantized(), tokens=tokens,
                       generator=g, device=device)


__all__ = ["WireCheck", "agree_with_torch", "fitting_experts_per_rank", "layer_spec", "nonzero_padding", "run_layer",
           "wire_seen"]
