"""The independent audit (2026-11) of this plugin against sgl-kernel-npu f425bdf, op-plugin, CANN
ops-transformer and torch-npu 2.13.0: one test per non-OK row. ``a<N>`` rows are the DeepEP-Ascend
audit's (docs/vendor-audits/2026-11/round1/ascend_deepep_fuseep.md), ``b<N>`` the torch_npu runners' (ascend_npu_ops.md).
Every CRASH/WRONG test failed on the adapter before its fix, with the fakes made as strict as the
vendor (VENDOR.md "Independent audit (2026-11)")."""

from __future__ import annotations

import importlib
import os
import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.backend import restored_environ
from moe_dispatch_testing.routing import random_expert_weights
from moe_dispatch_testing.signatures import differences
from moe_dispatch_ascend_deepep import sizes, vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.experts import EMULATOR, NpuExperts, unpack_int4, uint64_as_fp32
from moe_dispatch_ascend_deepep.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep.fakes import torch_npu as fake_npu

H = 1024
A2 = 220  # torch_npu.npu.get_soc_version() of an Ascend910B1 (Atlas A2)


def _dispatcher(mode: str, tokens: int = 8, experts: int = 4, top_k: int = 2, dtype: str = "bf16",
                backend: AscendDeepEPBackend | None = None) -> md.Dispatcher:
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode, output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(backend or AscendDeepEPBackend(v.FAKE), spec, env={})


def _batch(seed: int, tokens: int, experts: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, 2, dtype=torch.int64)
    return x, ids, torch.rand(tokens, 2, generator=g)


def _expected(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)  # identity experts


# -- a13 CRASH: the combine reads the LAST normal dispatch's real_max_bs ----------------------------------


def in_flight(rank: int, world: int) -> list[float]:
    d = _dispatcher("normal")
    first, second = _batch(10 + rank, 8), _batch(20 + rank, 2)  # the second's largest batch (2) < the first's (8)
    out1 = d.dispatch(*first)
    out2 = d.dispatch(*second)
    y1 = d.combine(out1.hidden_states, out1)  # after the second dispatch: real_max_bs is the second's
    y2 = d.combine(out2.hidden_states, out2)
    return [relative_error(y1, _expected(*first)), relative_error(y2, _expected(*second))]


def test_a13_normal_dispatches_in_flight_combine_after_a_smaller_one(moe_rank_pools):
    """deep_ep.cpp keeps real_max_bs = max(batch over ranks, num_worst_tokens) on the Buffer and the next
    combine passes it to the op, whose tiling refuses it below its own batch: the adapter passes
    num_worst_tokens=T so every dispatch leaves the same value."""
    for errors in moe_rank_pools.get(2).map(in_flight):
        assert max(errors) < 0.01, errors


def fake_in_flight_without_worst_tokens(rank: int, world: int) -> str:
    """The fake itself keeps the vendor's state: without num_worst_tokens the first combine fails."""
    import torch.distributed as dist

    buffer = fake.Buffer(dist.group.WORLD)
    handles = []
    for tokens in (8, 2):
        x, ids, w = _batch(rank + tokens, tokens)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
        _, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w)
        handles.append((handle, handle[3].rows))
    handle, rows = handles[0]
    try:
        buffer.combine(torch.zeros(rows, H, dtype=torch.bfloat16), handle)
    except RuntimeError as exc:
        return str(exc)
    return "combined"


def test_a13_the_fake_keeps_real_max_bs_like_the_buffer(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(fake_in_flight_without_worst_tokens):
        assert "realMaxBs is invalid" in message


# -- a14 CRASH: every rank empty in normal mode ---------------------------------------------------------------


def all_idle(rank: int, world: int) -> tuple[int, int]:
    d = _dispatcher("normal")
    x, ids, w = _batch(rank, 0)
    out = d.dispatch(x, ids, w)
    y = d.combine(out.hidden_states, out)
    return out.hidden_states.shape[0], y.shape[0]


def test_a14_an_all_idle_normal_step(moe_rank_pools):
    """max_bs = 0 on every rank gives global_bs = 0, which CamMoeDispatchNormal's tiling refuses ("globalBS
    is invalid, should be positive"); with num_worst_tokens=T it is T·R."""
    assert moe_rank_pools.get(2).map(all_idle) == [(0, 0), (0, 0)]


# -- a16 CRASH: Atlas A2's normal-mode window and multi-node limits ------------------------------------------


def _normal_spec(tokens: int = 8, top_k: int = 2, mode: str = "normal") -> md.DispatchSpec:
    return md.DispatchSpec(H, 16, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode)


def test_a16_planning_without_the_chip_takes_the_a2_normal_window():
    """The A2 build's CamMoeDispatchNormal (ops2) checks (maxBs·k·(…) + 412 MB)·2 + 8 MB: at least 833 MB,
    against 213 MB on A3. Where the chip cannot be known (planning on a CPU machine), the larger."""
    assert v.window_mb(v.normal_op_window_bytes_a2(8, H, 2)) == 833
    (req,) = AscendDeepEPBackend(env={}).env_requirements(_normal_spec(), 2)  # the real vendor, not on an NPU here
    assert req.minimum == 833
    (a3,) = AscendDeepEPBackend(env={}, soc="A3").env_requirements(_normal_spec(), 2)
    assert a3.minimum == 213
    (wide,) = AscendDeepEPBackend(env={}).env_requirements(_normal_spec(), 16)  # planning beyond 8 ranks: A3's
    assert wide.minimum == 213  # figure; create takes an unknown chip as A2 (round two #13)


def a2_create(rank: int, world: int) -> str:
    with fake_npu.soc_version(A2), restored_environ({v.HCCL_BUFFSIZE: "400"}):
        try:
            d = _dispatcher("normal", backend=AscendDeepEPBackend(v.FAKE, env=None))
        except md.CapacityError as exc:
            return f"CapacityError {exc.parameter} {exc.allowed}"
        x, ids, w = _batch(rank, 8)
        try:
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        except RuntimeError as exc:
            return f"RuntimeError at the first dispatch: {str(exc)[:80]}"
        return "ran"


def test_a16_an_a2_window_below_833_mb_is_refused_at_creation(moe_rank_pools):
    assert moe_rank_pools.get(2).map(a2_create) == ["CapacityError HCCL_BUFFSIZE >= 833"] * 2


@pytest.mark.parametrize("soc", [A2, None], ids=["a2", "unknown"])
def test_a16_a2_multi_node_limits(soc):
    """More than 8 ranks on A2 take the internode kernels: bs <= 4096 in normal mode, EP a multiple of 8
    up to 256 (and top-k >= 2); where the chip is unknown, the same (safe) bound; A3 is not limited."""
    if soc is None:
        backend = AscendDeepEPBackend(env={})  # the real vendor: torch_npu not imported here, chip unknown
    else:
        backend = AscendDeepEPBackend(v.FAKE, env={})
    with fake_npu.soc_version(soc or 250):
        with pytest.raises(md.CapacityError) as info:
            backend.check_spec(_normal_spec(tokens=8192), 16)
        assert info.value.parameter == "num_max_dispatch_tokens_per_rank"
        with pytest.raises(md.InvalidSpecError) as info:  # a28: A2 multi-server low latency
            backend.check_spec(md.DispatchSpec(H, 12 * 4, 2, num_max_dispatch_tokens_per_rank=8,
                                               mode="low_latency"), 12)
        assert info.value.parameter == "world_size"
        backend.check_spec(_normal_spec(tokens=4096), 16)
    AscendDeepEPBackend(v.FAKE, env={}).check_spec(_normal_spec(tokens=8192), 16)  # the fake's default chip: A3


# -- a17 WRONG: DEEPEP_HCCL_BUFFSIZE above the real window ---------------------------------------------------


def test_a17_deepep_hccl_buffsize_must_not_exceed_hccl_buffsize():
    """The normal kernels put their second half at DEEPEP_HCCL_BUFFSIZE/2: above HCCL_BUFFSIZE they write
    past the window. Both at least the need, and DEEPEP_HCCL_BUFFSIZE <= HCCL_BUFFSIZE (default 200)."""
    with pytest.raises(md.InvalidSpecError) as info:
        sizes.check_hccl_window(300, {v.HCCL_BUFFSIZE: "1024", v.DEEPEP_HCCL_BUFFSIZE: "4096"})
    assert info.value.parameter == v.DEEPEP_HCCL_BUFFSIZE and info.value.allowed == "300..1024"
    with pytest.raises(md.InvalidSpecError):
        sizes.check_hccl_window(150, {v.DEEPEP_HCCL_BUFFSIZE: "300"})  # HCCL_BUFFSIZE unset: 200
    sizes.check_hccl_window(300, {v.HCCL_BUFFSIZE: "1024", v.DEEPEP_HCCL_BUFFSIZE: "512"})


def oversized_deepep_window(rank: int, world: int) -> str:
    d = _dispatcher("normal")  # constructed with HCCL_BUFFSIZE=1024 (conftest): the window HCCL allocated
    x, ids, w = _batch(rank, 8)
    with restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "4096"}):
        try:
            d.dispatch(x, ids, w)
        except RuntimeError as exc:
            return str(exc)
    return "dispatched"


def test_a17_the_fake_refuses_a_window_larger_than_hccl_allocated(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(oversized_deepep_window):
        assert "write past the window" in message


# -- a5 DOC: every supported build's signatures are recorded ----------------------------------------------------


def test_a5_every_supported_build_has_a_recorded_signature(tmp_path):
    """KN@0ac00159..9aa6257c (no topk_weights) and 9aa6257c..be6b5e7f (no use_mxfp4) have their own
    low_latency_dispatch; builds before 9aa6257c the old __init__: the hardware check accepts them."""
    from moe_dispatch_ascend_deepep.hardware import deep_ep_source_rows

    recorded = {rec.text for rec in v.RECORDED_VERSIONS["Buffer.low_latency_dispatch"]}
    assert {v.SIG_LOW_LATENCY_DISPATCH_OLD.text, v.SIG_LOW_LATENCY_DISPATCH_TOPK_WEIGHTS.text} <= recorded
    oldest = {**{q: recs[0] for q, recs in v.RECORDED_VERSIONS.items()},
              "Buffer.__init__": v.SIG_BUFFER_INIT_OLD, "Buffer.low_latency_dispatch": v.SIG_LOW_LATENCY_DISPATCH_OLD,
              "Buffer.dispatch": v.SIG_DISPATCH_ENV_ONLY, "Buffer.fused_deep_moe": v.SIG_FUSED_DEEP_MOE_NO_PROFILE}
    body = "\n".join(f"    def {q.split('.')[1]}{rec.text}:\n        pass" for q, rec in oldest.items())
    path = tmp_path / "buffer.py"
    path.write_text(f"class Buffer:\n{body}\n", encoding="utf-8")
    rows = deep_ep_source_rows(path)
    assert rows and all(row.ok for row in rows), rows


# -- FAKE rows -------------------------------------------------------------------------------------------------


def test_a6_the_fake_config_is_pybinds():
    assert differences(v.SIG_CONFIG_INIT, fake.Config.__init__) == []
    assert fake.Config().num_max_rdma_chunked_recv_tokens == 256 and fake.Config(num_sms=24).num_sms == 24
    with pytest.raises(TypeError, match="incompatible"):
        fake.Config(20.0)


def test_a19_the_fake_int8_is_the_kernels():
    """Normal: s = 127/(amax + 1e-12), q = rint(x·s), scale 1/s; low latency: s = 127/amax, a zero row
    has scale 0; not the codec's x/(amax/127) (it differs at rounding ties)."""
    x = torch.tensor([[0.1, -0.3, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = fake.quant_normal(x)
    want_s = torch.tensor(127.0) / (x.abs().amax(-1, keepdim=True) + torch.tensor(1e-12))
    assert torch.equal(q, torch.round(x * want_s).to(torch.int8)) and torch.equal(s, (1 / want_s).squeeze(-1))
    q, s = fake.quant_low_latency(x)
    assert s[1] == 0 and (q[1] == 0).all()
    assert torch.equal(q[0], torch.round(x[0] * (torch.tensor(127.0) / x[0].abs().max())).to(torch.int8))


def window_by_max_batch(rank: int, world: int) -> str:
    import torch.distributed as dist

    with restored_environ({v.HCCL_BUFFSIZE: "215"}):  # 213 MB for one token, 222 MB for 512
        buffer = fake.Buffer(dist.group.WORLD)
        x, ids, w = _batch(rank, 512 if rank == 0 else 1)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
        try:
            buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=ids, topk_weights=w)
        except RuntimeError as exc:
            return str(exc)[:90]
    return "dispatched"


def test_a20_the_fake_sizes_the_normal_window_by_the_largest_batch_over_ranks(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(window_by_max_batch):
        assert "HCCL_BUFFSIZE is too SMALL" in message


def bad_hidden(rank: int, world: int) -> str:
    import torch.distributed as dist

    buffer = fake.Buffer(dist.group.WORLD)
    ids = torch.tensor([[0, 1]])
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
    try:
        buffer.dispatch(torch.zeros(1, 512, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
                        topk_weights=torch.ones(1, 2))
    except RuntimeError as exc:
        return str(exc)
    return "dispatched"


def test_a20_the_fake_checks_the_normal_op_tiling(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(bad_hidden):
        assert "H) should be in [1024" in message


@pytest.mark.parametrize("raw,want", [("1", 1), ("1 ", 7), ("1_0", 7), ("+1", 7), (" 1", 7), ("\u0661", 7),
                                      ("4294967297", 1), ("99999999999999999999", 7)])
def test_a21_env_integers_are_strtol(raw, want):
    assert v.parse_env_int(raw, 7) == want


@pytest.mark.parametrize("raw,want", [("1024MB", 1024), (" 300", 300), ("lots", 200), ("70000", 70000 % 65536),
                                      ("-1", 65535), ("99999999999", 200)])
def test_a21_the_window_is_stoi_into_a_uint16(raw, want):
    assert v.ops_window_mb({v.HCCL_BUFFSIZE: raw}) == want


# -- RISK rows with a safe behaviour ----------------------------------------------------------------------


def non_hccl_group(rank: int, world: int) -> str:
    import torch.distributed as dist

    from moe_dispatch_ascend_deepep.backend import check_hccl_group

    try:
        check_hccl_group(dist.group.WORLD)
    except md.InvalidSpecError as exc:
        return f"{exc.parameter}: {exc.value}"
    return "accepted"


def test_a2_a_process_group_without_hccl_is_a_typed_error(moe_rank_pools):
    """The vendor prints and carries on with "" (every rank its own communicator); the adapter refuses
    a non-HCCL group on the real vendor at creation."""
    assert moe_rank_pools.get(2).map(non_hccl_group) == ["process_group: gloo"] * 2


def ccu_set(rank: int, world: int) -> float:
    with restored_environ({v.CCU_ENV: "1"}):
        d = _dispatcher("low_latency")
        x, ids, w = _batch(rank, 8)
        out = d.dispatch(x, ids, w)
        y = d.combine(out.hidden_states, out)
        assert os.environ[v.CCU_ENV] == "1"
    return relative_error(y, _expected(x, ids, w))


def test_a25_moe_enable_ccu_is_pinned_off_for_the_adapters_calls(moe_rank_pools):
    """MOE_ENABLE_CCU=1 sends A3 low-latency calls to the A5 CCU op; the adapter pins 0 for its calls."""
    assert max(moe_rank_pools.get(2).map(ccu_set)) < 0.01


# -- b: the torch_npu runners ---------------------------------------------------------------------------------

E_, HB, IB = 2, 512, 256


def _w4a8_layer() -> tuple[NpuExperts, object]:
    experts = NpuExperts("w4a8", EMULATOR)
    return experts, experts.process_weights(random_expert_weights(E_, HB, IB, generator=torch.Generator().manual_seed(0)))


def test_b16_w4a8_scale_bias_is_8_times_the_k_sum_of_w_times_s():
    """CANN A8W4 computes ((x − 8)@(w·s) + bias)·pts with bias = 8·Σ_k(w·s) required: zeros are wrong
    by 8·pts·Σ_k(w·s) on every output."""
    _, layer = _w4a8_layer()
    for w, s, b in ((layer.w13_weight, layer.w13_weight_scale, layer.w13_scale_bias),
                    (layer.w2_weight, layer.w2_weight_scale, layer.w2_scale_bias)):
        values = unpack_int4(w).double()  # [E, K, N]
        scale = uint64_as_fp32(s).double().repeat_interleave(values.shape[1] // s.shape[1], dim=1)
        assert torch.allclose(b.double(), 8 * (values * scale).sum(1), rtol=1e-6, atol=1e-6)


def test_b16_the_fake_a8w4_gmm_needs_the_bias():
    experts, layer = _w4a8_layer()
    x = torch.randint(-127, 128, (6, HB), dtype=torch.int8)
    pts = torch.rand(6) * 0.01
    gl = torch.tensor([3, 3])

    def gmm(bias):  # type: ignore[no-untyped-def]
        return fake_npu.npu_grouped_matmul([x], [layer.w13_weight], scale=[layer.w13_weight_scale], bias=bias,
                                           per_token_scale=[pts], group_list=gl, split_item=2, group_type=0,
                                           group_list_type=1, output_dtype=torch.bfloat16)[0]

    w = layer.dequantized(torch.float64).w13_weight  # [E, 2I, H]
    want = torch.cat([(x[:3].double() @ w[0].t()) * pts[:3, None].double(),
                      (x[3:].double() @ w[1].t()) * pts[3:, None].double()]).float()
    assert relative_error(gmm([layer.w13_scale_bias]), want) < 1e-2
    assert relative_error(gmm([torch.zeros_like(layer.w13_scale_bias)]), want) > 0.05
    with pytest.raises(AssertionError, match="bias"):
        gmm(None)


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_b17_w4a8_passes_counts_whatever_the_callers_type(group_list_type):
    """CANN's A8W4 reads group_list as counts whatever group_list_type says: cumulative ends read as counts
    multiply the wrong rows and read past x."""
    experts, layer = _w4a8_layer()
    counts = [5, 3]
    q = torch.randint(-127, 128, (8, HB), dtype=torch.int8)
    scale = torch.rand(8) * 0.01
    gl = torch.tensor(counts) if group_list_type else torch.cumsum(torch.tensor(counts), 0)
    out = experts.apply_without_routing_weights(layer, q, scale, group_list_type, gl, torch.bfloat16)
    ref = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), q, scale, group_list_type, gl,
                                                          torch.float32)
    assert relative_error(out, ref) < 0.03


def test_b18_w4a8_group_size_and_k_limits():
    """CANN's A8W4 supports quantGroupSize 256 only, k % 64 == 0 and k <= 18432 (tiling GRAPH_FAILED)."""
    with pytest.raises(md.InvalidSpecError) as info:
        NpuExperts("w4a8", EMULATOR, group_size=128)
    assert info.value.parameter == "group_size" and info.value.allowed == "256"
    with pytest.raises(md.InvalidInputError) as info:
        NpuExperts("w4a8", EMULATOR).process_weights(random_expert_weights(1, 18688, 256))
    assert info.value.parameter == "hidden_size"


def test_b18_the_fake_a8w4_tiling_limits():
    w = torch.zeros(1, 192, 8, dtype=torch.int32)  # K = 192: k % 64 == 0 but groups of 64
    x = torch.zeros(2, 192, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="quantGroupSize must be 256"):
        fake_npu.npu_grouped_matmul([x], [w], scale=[torch.zeros(1, 3, 64, dtype=torch.int64)],
                                    bias=[torch.zeros(1, 64)], per_token_scale=[torch.ones(2)],
                                    group_list=torch.tensor([2]), split_item=2, group_type=0, group_list_type=0,
                                    output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="divisible by 64"):
        fake_npu.npu_grouped_matmul([torch.zeros(2, 96, dtype=torch.int8)], [torch.zeros(1, 96, 8, dtype=torch.int32)],
                                    scale=[torch.zeros(1, 1, 64, dtype=torch.int64)], bias=[torch.zeros(1, 64)],
                                    per_token_scale=[torch.ones(2)], group_list=torch.tensor([2]), split_item=2,
                                    group_type=0, group_list_type=0, output_dtype=torch.bfloat16)


def test_b26_w4a16_never_runs_the_npu_only_op_on_cpu_weights():
    """npu_convert_weight_to_int4pack has an NPU kernel only: process_weights on CPU weights packed with
    it raised "Could not run 'npu::npu_convert_weight_to_int4pack' ... 'CPU' backend"."""
    with pytest.raises(NotImplementedError, match="CPU"):
        fake_npu.npu_convert_weight_to_int4pack(torch.zeros(8, 8, dtype=torch.int32))
    layer = NpuExperts("w4a16", EMULATOR).process_weights(
        random_expert_weights(2, HB, IB, generator=torch.Generator().manual_seed(0)))
    assert layer.w13_weight.dtype == torch.int32 and layer.w13_weight.device.type == "cpu"


# -- b FAKE rows: the torch_npu callables ----------------------------------------------------------------------


def test_b2_b3_the_fakes_take_the_registered_schemas():
    """torch_npu.npu_X is torch.ops.npu.npu_X: `input`, not `self`/`x`, and the schemas' extra keywords."""
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert fake_npu.npu_swiglu(input=x).shape == (2, 4)
    with pytest.raises(TypeError):
        fake_npu.npu_swiglu(self=x)
    with pytest.raises(TypeError):
        fake_npu.npu_dynamic_quant(x=x)
    fake_npu.npu_dynamic_quant(x, quant_mode="pertoken", dst_type_max=0.0)
    with pytest.raises(NotImplementedError, match=r"\(fake\) round_mode"):
        fake_npu.npu_dequant_swiglu_quant(torch.zeros(2, 128, dtype=torch.int32), weight_scale=torch.ones(1, 128),
                                          activation_scale=torch.ones(2), group_index=torch.tensor([2]),
                                          quant_mode=1, round_mode=1)
    assert v.schema_params(v.TORCH_NPU_SCHEMAS["npu_swiglu"]) == "(input, dim=-1)"
    blob = b"junk\x00" + v.TORCH_NPU_SCHEMAS["npu_swiglu"].encode() + b"\x00more"
    assert v.registered_schema(blob, "npu_swiglu") == v.TORCH_NPU_SCHEMAS["npu_swiglu"]


def test_b32_a_group_list_covering_fewer_rows_leaves_the_rest_unwritten():
    x = torch.randn(5, 16).to(torch.bfloat16)
    w = torch.randn(2, 16, 8).to(torch.bfloat16)
    y = fake_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 1]), split_item=2, group_type=0,
                                    group_list_type=1)[0]
    assert torch.isfinite(y[:3].float()).all() and torch.isnan(y[3:].float()).all()
    with pytest.raises(RuntimeError, match="reads past x"):
        fake_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 2]), split_item=2, group_type=0,
                                    group_list_type=1)


def test_b34_b35_what_cann_and_the_docs_refuse():
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.zeros(1, 32, 1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="antiquantOffset"):
        fake_npu.npu_grouped_matmul([x], [w], antiquant_scale=[torch.ones(1, 1, 8, dtype=torch.bfloat16)],
                                    group_list=torch.tensor([4]), split_item=2, group_type=0, group_list_type=0)
    with pytest.raises(AssertionError, match="contiguous"):
        fake_npu.npu_swiglu(torch.randn(8, 4).t().to(torch.bfloat16))
    with pytest.raises(AssertionError, match="smooth_scales"):
        fake_npu.npu_dynamic_quant(x, smooth_scales=torch.ones(32, dtype=torch.float16))


def test_the_fake_torch_npu_says_which_chip():
    assert v.current_soc(fake_npu) == "A3"
    with fake_npu.soc_version(A2):
        assert v.current_soc(fake_npu) == "A2"
        assert fake.Buffer.__init__ is not None and importlib.import_module(v.TORCH_NPU_FAKE).SOC_VERSION == A2
