"""The CuTe-DSL runner and the FlashInfer plugin beyond the kit: weight layouts, the kernel
against a reference, every declared (backend, mode, dtype) pairing end to end, the pairings
that are refused, the explain trail, and the plugin as installed."""

import functools
import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch.backend import (
    NVFP4Codec,
    WireFormat,
    from_mma_view,
    nvfp4_global_scale,
    swiglu,
    swizzle_128x4,
    to_mma_view,
)
from moe_dispatch.cli import main
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR as DEEPEP_EMULATOR
from moe_dispatch_cuda_deepep_testing import EMULATOR_NVFP4 as HYBRID_DEEPEP_EMULATOR
from moe_dispatch_flashinfer_cutedsl import RUNNER, CuteDslExperts, FlashInferA2ABackend, vendor
from moe_dispatch_flashinfer_cutedsl.vendor import sm100_reason
from moe_dispatch_flashinfer_cutedsl.weights import deinterleave_up_gate, interleave_up_gate
from moe_dispatch_flashinfer_cutedsl_testing import EMULATOR, FAKE_0_6_13, FAKE_0_6_17, FAKE_0_7_2
from moe_dispatch_flashinfer_cutedsl_testing.fakes import flashinfer_0_7_2 as fi
from moe_dispatch_testing import random_routing, relative_error

H, I, E = 256, 128, 8
#: The pairings' hidden size: one DeepEP's low-latency kernels are built for (the kernel tests need none).
PAIRING_H = 2048
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY


def _weights(seed: int = 0, hidden: int = H) -> md.ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    return md.ExpertWeights(torch.randn(E, 2 * I, hidden, generator=g) / hidden**0.5,
                            torch.randn(E, hidden, I, generator=g) / I**0.5)


def _layer(first: int, count: int, gs_in: float, seed: int = 0, hidden: int = H):  # noqa: ANN202
    return CuteDslExperts(EMULATOR).process_weights(_weights(seed, hidden).slice(first, count), first_expert=first,
                                                    num_experts=E, input_global_scale=gs_in,
                                                    fc2_input_scale=nvfp4_global_scale(4.0))


def _nvfp4_reference(x: torch.Tensor, weights: md.ExpertWeights, experts: torch.Tensor, gs_in: float,
                     fc2: float) -> torch.Tensor:
    """What W4A4 computes for rows with one expert each: NVFP4 input, fp32 GEMMs on the
    dequantized weights, the intermediate re-quantized to NVFP4."""
    hidden = x.shape[1]
    xin = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, hidden), gs_in)
    mid = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, I), fc2)
    xq = xin.dequantize(xin.quantize(x))
    out = torch.zeros(x.shape[0], hidden)
    for e in experts.unique().tolist():
        rows = (experts == e).nonzero().squeeze(1)
        h = swiglu(xq[rows] @ weights.w13_weight[e].float().t())
        out[rows] = mid.dequantize(mid.quantize(h)) @ weights.w2_weight[e].float().t()
    return out


# -- weight layouts ----------------------------------------------------------------------------------


def test_up_gate_interleave_is_groups_of_64_up_first_and_inverts():
    w13 = torch.arange(2 * 2 * I, dtype=torch.float32).view(2, 2 * I, 1)  # row r holds r (+offset per expert)
    w1 = interleave_up_gate(w13)
    assert w1[0, :64, 0].tolist() == list(range(I, I + 64))  # up rows first
    assert w1[0, 64:128, 0].tolist() == list(range(64))  # then the gate rows of the same group
    up, gate = deinterleave_up_gate(w1)
    assert torch.equal(torch.cat([gate, up], dim=1), w13)


def test_weight_scales_take_the_mma_view_of_the_128x4_swizzle():
    scales = (torch.rand(3, 2 * I, H // 16) * 8).to(torch.float8_e4m3fn)
    mma = to_mma_view(scales)
    assert tuple(mma.shape) == (32, 4, 2 * I // 128, 4, H // 64, 3)
    # The MMA view is a view of the per-expert swizzled bytes: same storage order.
    storage = mma.permute(5, 2, 4, 0, 1, 3).reshape(3, -1).view(torch.uint8)
    assert torch.equal(storage, swizzle_128x4(scales).reshape(3, -1).view(torch.uint8))
    assert torch.equal(from_mma_view(mma, 2 * I, H // 16).view(torch.uint8), scales.view(torch.uint8))


def test_fp4_quantize_scales_are_linear_or_swizzled_on_request():
    x = torch.randn(130, H).to(torch.bfloat16)
    gs = torch.tensor([nvfp4_global_scale(float(x.float().abs().max()))])
    data, linear = fi.fp4_quantize(x, gs, is_sf_swizzled_layout=False)
    _, swizzled = fi.fp4_quantize(x, gs)
    assert data.shape == (130, H // 2) and linear.shape == (130, H // 16)
    assert torch.equal(swizzled, swizzle_128x4(linear)) and swizzled.shape == (256, H // 16)


# -- the kernel ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed-counts", "packed-cumsum", "masked"])
@pytest.mark.parametrize("wire", ["bf16", "nvfp4"])
def test_runner_matches_the_w4a4_reference_and_leaves_padding_zero(layout, wire):
    gs_in = nvfp4_global_scale(4.0)
    layer = _layer(2, 4, gs_in)
    deq = layer.dequantized()
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(int(counts.sum()), H).to(torch.bfloat16)
    experts = torch.repeat_interleave(torch.arange(4), counts)
    ref = _nvfp4_reference(x, deq, experts, gs_in, layer.fc2_input_scale)
    codec = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, H), gs_in)
    q = codec.quantize(x)
    rows, scale, gs = (x, None, None) if wire == "bf16" else (q.data, q.scale, gs_in)
    kernel = CuteDslExperts(EMULATOR)
    if layout == "masked":
        cap = 6
        hidden = torch.zeros(4, cap, rows.shape[1], dtype=rows.dtype)
        hs = None if scale is None else torch.zeros(4, cap, H // 16, dtype=scale.dtype)
        start = 0
        for e, n in enumerate(counts.tolist()):
            hidden[e, :n] = rows[start : start + n]
            if hs is not None:
                hs[e, :n] = scale[start : start + n]
            start += n
        out = kernel.apply_without_routing_weights(layer, hidden, hs, 1, counts, torch.bfloat16, global_scale=gs)
        assert out.shape == (4, cap, H)
        valid = torch.arange(cap).unsqueeze(0) < counts.unsqueeze(1)
        assert not out[~valid].any()  # slots past a count are skipped, zero
        got = out[valid]
    else:
        group_list = counts if layout == "packed-counts" else torch.cumsum(counts, 0)
        got = kernel.apply_without_routing_weights(layer, rows, scale, 1 if layout == "packed-counts" else 0,
                                                   group_list, torch.bfloat16, global_scale=gs)
    assert relative_error(got, ref) < 1e-2  # the same quantization steps; bf16 output rounding


def test_runner_rejects_what_it_cannot_consume():
    layer = _layer(0, 4, 100.0)
    kernel = CuteDslExperts(EMULATOR)
    fp8 = torch.zeros(3, H, dtype=torch.float8_e4m3fn)
    with pytest.raises(md.InvalidInputError) as info:
        kernel.apply_without_routing_weights(layer, fp8, None, 1, torch.tensor([3, 0, 0, 0]), torch.bfloat16)
    assert info.value.parameter == "hidden_states"
    with pytest.raises(md.InvalidInputError, match="global scale"):
        kernel.apply_without_routing_weights(layer, torch.zeros(3, H // 2, dtype=torch.uint8), None, 1,
                                             torch.tensor([3, 0, 0, 0]), torch.bfloat16)
    with pytest.raises(md.InvalidInputError) as info:
        kernel.apply_without_routing_weights(layer, torch.zeros(3, H, dtype=torch.bfloat16), None, 1,
                                             torch.tensor([2, 0, 0, 0]), torch.bfloat16)
    assert info.value.parameter == "group_list"


def test_the_kernel_reads_activation_scales_linear_only():
    layer = _layer(0, 4, 100.0)
    x = torch.randn(5, H).to(torch.bfloat16)
    data, swizzled = fi.fp4_quantize(x, torch.tensor([100.0]))
    ids = torch.zeros(5, 1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="linear"):
        layer.wrapper.run(data, swizzled, ids, torch.ones(5, 1), layer.w1_weight, layer.w1_weight_sf,
                          torch.ones(4), torch.tensor([1.0]), layer.w2_weight, layer.w2_weight_sf, torch.ones(4))


def test_the_runner_hands_the_kernels_aligned_contiguous_rows():
    """make_ptr asserts 32-byte aligned activations and 16-byte aligned scales: NVFP4 rows that
    are a view at an odd offset (a slice of a receive buffer) are copied first."""
    gs = nvfp4_global_scale(4.0)
    layer = _layer(0, 4, gs)
    q = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, H), gs).quantize(torch.randn(5, H).to(torch.bfloat16))
    data = torch.zeros(5 * H // 2 + 16, dtype=torch.uint8)
    data[16:] = q.data.reshape(-1)
    scales = torch.zeros(5 * H // 16 + 8, dtype=torch.uint8)
    scales[8:] = q.scale.view(torch.uint8).reshape(-1)
    rows, sf = data[16:].view(5, H // 2), scales[8:].view(5, H // 16).view(torch.float8_e4m3fn)
    assert rows.data_ptr() % 32 and sf.data_ptr() % 16
    kernel = CuteDslExperts(EMULATOR)
    out = kernel.apply_without_routing_weights(layer, rows, sf, 1, torch.tensor([5, 0, 0, 0]), torch.bfloat16,
                                               global_scale=gs)
    ref = kernel.apply_without_routing_weights(layer, q.data, q.scale, 1, torch.tensor([5, 0, 0, 0]), torch.bfloat16,
                                               global_scale=gs)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("fake", [FAKE_0_6_13, FAKE_0_6_17, FAKE_0_7_2])
def test_nvfp4_4over6_never_changes_the_runners_quantization(monkeypatch, fake):
    """From v0.6.12 FLASHINFER_NVFP4_4OVER6=1 switches fp4_quantize to the 4over6 search; the
    runner passes nvfp4_4over6=None where FlashInfer takes it (0.7.1+) and refuses before."""
    kernel = CuteDslExperts(fake)
    layer = kernel.process_weights(_weights().slice(0, 4), first_expert=0, num_experts=E,
                                   input_global_scale=nvfp4_global_scale(4.0), fc2_input_scale=nvfp4_global_scale(4.0))
    rows = torch.randn(3, H).to(torch.bfloat16)
    plain = kernel.apply_without_routing_weights(layer, rows, None, 1, torch.tensor([3, 0, 0, 0]), torch.bfloat16)
    monkeypatch.setenv(vendor.ENV_NVFP4_4OVER6, "1")
    if vendor.detect(fake).version >= vendor.NVFP4_4OVER6_ARG_SINCE:
        assert torch.equal(kernel.apply_without_routing_weights(layer, rows, None, 1, torch.tensor([3, 0, 0, 0]),
                                                                torch.bfloat16), plain)
    else:
        with pytest.raises(md.InvalidSpecError) as info:
            kernel.apply_without_routing_weights(layer, rows, None, 1, torch.tensor([3, 0, 0, 0]), torch.bfloat16)
        assert info.value.parameter == vendor.ENV_NVFP4_4OVER6


# -- every declared pairing, end to end ------------------------------------------------------------------


def _backend(name: str) -> mdb.Backend:
    # DeepEP as built from its hybrid-ep branch: the V1 paths plus NVFP4 low-latency dispatch.
    return {"cuda_deepep": DeepEPBackend(HYBRID_DEEPEP_EMULATOR), "flashinfer_a2a": FlashInferA2ABackend(EMULATOR)}.get(
        name) or md.PluginHost.default().get_backend(name)


def _pairings() -> list[tuple[str, str, str]]:
    out = []
    for name, modes in sorted(RUNNER.backends.items()):
        for mode in sorted(m.value for m in modes):
            caps = _backend(name).capabilities.dtypes[md.Mode(mode)]
            out += [(name, mode, dtype) for dtype in ("bf16", "nvfp4") if md.DispatchDtype(dtype) in caps]
    return out


@functools.cache
def _dequantized_model(gs_in: float) -> md.ExpertWeights:
    """All experts as the kernel computes with them: the same for every rank and pairing, so made once per rank."""
    return _layer(0, E, gs_in, hidden=PAIRING_H).dequantized()


def run_cutedsl_layer(rank: int, world: int, backend: str, mode: str, dtype: str) -> dict:
    """One MoE layer: dispatch on ``backend`` → CuTe-DSL runner (emulated) → combine, against
    the W4A4 reference computed densely on this rank."""
    tokens, k = 16, 3
    gs_in = nvfp4_global_scale(4.0)
    local = E // world
    layer = _layer(rank * local, local, gs_in, hidden=PAIRING_H)
    kernel = CuteDslExperts(EMULATOR)
    quant = kernel.quant_hints(nvfp4_dispatch=dtype == "nvfp4", layer=layer)
    spec = md.DispatchSpec(PAIRING_H, E, k, num_max_dispatch_tokens_per_rank=tokens, mode=mode, runner=RUNNER.name,
                           quant=quant)
    d = md.create_dispatcher(_backend(backend), spec, env={})
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(world * tokens, PAIRING_H, generator=g) * 1.5).to(torch.bfloat16)
    ids, w = random_routing(world * tokens, E, k, generator=g, drop_prob=0.1)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    out = d.dispatch(x[mine], ids[mine], w[mine])
    rows = kernel.apply_without_routing_weights(layer, out.hidden_states, out.hidden_states_scale,
                                                out.group_list_type, out.group_list, torch.bfloat16,
                                                global_scale=out.global_scale)
    y = d.combine(rows, out)
    full = _dequantized_model(gs_in)
    ref = torch.zeros(tokens, PAIRING_H)
    for j in range(k):
        e = ids[mine][:, j]
        keep = e >= 0
        part = _nvfp4_reference(x[mine][keep], full, e[keep], gs_in, layer.fc2_input_scale)
        ref[keep] += part * w[mine][keep, j].unsqueeze(1)
    return {"error": relative_error(y, ref), "wire": d.output_dtype.value, "trail": str(d.resolution)}


@pytest.mark.parametrize("backend,mode,dtype", _pairings())
def test_every_declared_pairing_runs_the_layer(moe_rank_pools, backend, mode, dtype):
    for r in moe_rank_pools.get(2).map(run_cutedsl_layer, backend, mode, dtype):
        assert r["wire"] == dtype
        assert r["error"] < 2e-2, r  # bf16 partial sums on the way back
        assert ("quant.input_global_scale" if dtype == "nvfp4" else "quant.dispatcher_output_dtype") in r["trail"]


def test_pairings_cover_deepep_flashinfers_all_to_all_and_torch():
    assert {b for b, _, _ in _pairings()} == {"cuda_deepep", "flashinfer_a2a", "torch"}
    for pairing in (("torch", "low_latency", "nvfp4"), ("flashinfer_a2a", "normal", "nvfp4"),
                    ("cuda_deepep", "low_latency", "nvfp4"), ("cuda_deepep", "low_latency", "bf16")):
        assert pairing in _pairings()
    assert ("cuda_deepep", "normal", "nvfp4") not in _pairings()


def test_undeclared_pairings_and_dtypes_are_refused_at_creation():
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher("allgather", md.DispatchSpec(PAIRING_H, E, 2, runner=RUNNER.name), env={})
    assert info.value.parameter == "runner" and "flashinfer_a2a (normal)" in info.value.allowed
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher("torch", md.DispatchSpec(PAIRING_H, E, 2, runner=RUNNER.name, output_dtype="fp8"), env={})
    assert info.value.parameter == "output_dtype" and info.value.allowed == "bf16, nvfp4"
    with warnings.catch_warnings():  # INT8 on CUDA falls back to FP8, which the runner cannot take
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        with pytest.raises(md.InvalidSpecError, match="cannot consume fp8"):
            mdp.resolve_output_dtype(md.DispatchSpec(7168, 256, 8, mode="low_latency", runner=RUNNER.name,
                                                    output_dtype="int8"), DeepEPBackend(DEEPEP_EMULATOR), env={})


# -- trail, install -----------------------------------------------------------------------------


def test_explain_shows_the_cutedsl_trail():
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["explain", "--backend", "torch", "--runner", "flashinfer_cutedsl", "--mode", "low_latency",
                     "--preset", "deepseek-v3", "--tokens", "128", "--world-size", "8"]) == 0
    text = out.getvalue()
    assert "runner flashinfer_cutedsl" in text and "CuTe-DSL MoE quantizes BF16 rows to NVFP4 itself" in text
    assert "wire dtype bf16" in text
    assert "consumes bf16 behind torch (low_latency)" in text
    assert "note: runner 'flashinfer_cutedsl' cannot run on this machine: flashinfer is not usable" in text


def test_installed_plugin_is_listed_unavailable_with_what_to_install():
    host = md.PluginHost(env={})
    info = host.info("flashinfer_a2a")
    assert info.distribution == "moe-dispatch-flashinfer-cutedsl" and info.status == "unavailable"
    assert "flashinfer" in info.reason and "moe-dispatch-flashinfer-cutedsl[flashinfer]" in info.install_hint
    runner = host.runners()["flashinfer_cutedsl"].to_dict()
    assert runner["available"] is False and "flashinfer" in runner["reason"]
    out = io.StringIO()
    with redirect_stdout(out):
        main(["backends"])
    assert "flashinfer_cutedsl" in out.getvalue() and "why not: flashinfer is not usable" in out.getvalue()


def test_probe_requires_an_sm100_class_gpu():
    reason = sm100_reason()
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        assert reason is None
    else:
        assert reason is not None and "SM100" in reason
    assert CuteDslExperts(EMULATOR).probe() is None  # the fake runs anywhere
