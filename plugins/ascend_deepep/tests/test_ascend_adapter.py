"""The DeepEP-Ascend adapter beyond the kit: the dtype each vendor call receives, the Buffer's state
between calls (dispatches in flight, an all-idle step), what the vendor asserts that the adapter
refuses with a typed error or avoids, the routing combine uses, the fakes' own vendor rules, and the
trails (``moe-dispatch explain``, the plugin listing)."""

import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import dequantize_rows
from moe_dispatch.cli import main
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep_testing import FAKE, FAKE_ENV_ONLY, ascend_backend
from moe_dispatch_ascend_deepep_testing.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep_testing.support import H, batch, dispatcher, identity_reference
from moe_dispatch_testing import ScaledLayer, random_routing, relative_error, routing_reuse

# -- the dtype each vendor call receives -------------------------------------------------------------------------


def wire_seen(rank: int, world: int, vendor: str, mode: str, dtype: str) -> dict:
    d = dispatcher(vendor, dtype, mode, experts=8)
    x, ids, w = batch(rank, experts=8, drop=True)
    out = d.dispatch(x, ids, w)
    call = d.backend_dispatcher.buffer.calls[-1]
    pairs = int((ids >= 0).sum())  # DeepEP-Ascend sends one row per (token, expert)
    rows = dequantize_rows(out.hidden_states, out.hidden_states_scale, H).to(torch.bfloat16)  # identity experts
    y = d.combine(rows, out)
    ref = identity_reference(x, ids, w)
    return {"resolved": d.output_dtype.value, "int8": call.int8, "out": str(out.hidden_states.dtype),
            "bytes": call.payload_bytes, "expected": pairs * d.spec.wire_format().bytes_per_token,
            "error": relative_error(y, ref)}


@pytest.mark.parametrize("vendor", [FAKE, FAKE_ENV_ONLY])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp8"])
def test_the_resolved_dtype_is_what_reaches_the_kernel(moe_rank_pools, vendor, mode, dtype):
    """sglang #23815: the low-latency path ignored a BF16 choice and sent INT8; check both modes."""
    for seen in moe_rank_pools.get(2).map(wire_seen, vendor, mode, dtype):
        assert seen["resolved"] == ("int8" if dtype == "fp8" else dtype)
        assert seen["int8"] is (seen["resolved"] == "int8")
        assert seen["out"] == ("torch.int8" if seen["resolved"] == "int8" else "torch.bfloat16")
        assert seen["bytes"] == seen["expected"]
        assert seen["error"] < (0.03 if seen["resolved"] == "int8" else 0.01)


# -- the Buffer's state between calls --------------------------------------------------------------------------


def in_flight(rank: int, world: int) -> list[float]:
    d = dispatcher(FAKE, "bf16", "normal", experts=4)
    # the second's largest batch (2) < the first's (8)
    first, second = batch(10 + rank, 8, 4, False), batch(20 + rank, 2, 4, False)
    out1 = d.dispatch(*first)
    out2 = d.dispatch(*second)
    y1 = d.combine(out1.hidden_states, out1)  # after the second dispatch: real_max_bs is the second's
    y2 = d.combine(out2.hidden_states, out2)
    return [relative_error(y1, identity_reference(*first)), relative_error(y2, identity_reference(*second))]


def test_normal_dispatches_in_flight_combine_after_a_smaller_one(moe_rank_pools):
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
        x, ids, w = batch(rank + tokens, tokens, 4, False)
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


def test_the_fake_keeps_real_max_bs_like_the_buffer(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(fake_in_flight_without_worst_tokens):
        assert "realMaxBs is invalid" in message


def all_idle(rank: int, world: int) -> tuple[int, int]:
    d = dispatcher(FAKE, "bf16", "normal", experts=4)
    x, ids, w = batch(rank, 0, 4, False)
    out = d.dispatch(x, ids, w)
    y = d.combine(out.hidden_states, out)
    return out.hidden_states.shape[0], y.shape[0]


def test_an_all_idle_normal_step(moe_rank_pools):
    """max_bs = 0 on every rank gives global_bs = 0, which CamMoeDispatchNormal's tiling refuses ("globalBS
    is invalid, should be positive"); with num_worst_tokens=T it is T·R."""
    assert moe_rank_pools.get(2).map(all_idle) == [(0, 0), (0, 0)]


# -- what the vendor asserts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,world", [("normal", 1), ("normal", 3), ("normal", 12), ("low_latency", 1)])
def test_world_sizes_the_vendor_refuses_are_typed_errors(mode, world):
    """dispatch/combine with config=None assert num_ranks in get_dispatch_config's map
    (2, 4, 8, 16, 24, 32, 64, 128, 144, 160); the ops' tiling needs at least 2 ranks."""
    spec = md.DispatchSpec(H, 12 * 16, 2, num_max_dispatch_tokens_per_rank=8, mode=mode)
    with pytest.raises(md.InvalidSpecError) as info:
        ascend_backend(FAKE, env={}).check_spec(spec, world)
    assert info.value.parameter == "world_size"


def non_hccl_group(rank: int, world: int) -> str:
    import torch.distributed as dist

    from moe_dispatch_ascend_deepep.backend import check_hccl_group

    try:
        check_hccl_group(dist.group.WORLD)
    except md.InvalidSpecError as exc:
        return f"{exc.parameter}: {exc.value}"
    return "accepted"


def test_a_process_group_without_hccl_is_a_typed_error(moe_rank_pools):
    """The vendor prints and carries on with "" (every rank its own communicator); the adapter refuses
    a non-HCCL group on the real vendor at creation."""
    assert moe_rank_pools.get(2).map(non_hccl_group) == ["process_group: gloo"] * 2


def non_contiguous(rank: int, world: int, mode: str) -> str:
    d = dispatcher(FAKE, "bf16", mode, experts=4)
    x, ids, w = batch(rank, experts=4, drop=True)
    ids_t, w_t = ids.t().contiguous().t(), w.t().contiguous().t()  # column-major views
    assert not ids_t.is_contiguous()
    out = d.dispatch(x, ids_t, w_t)
    d.combine(out.hidden_states, out)
    return "ok"


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_non_contiguous_routing_reaches_the_vendor_contiguous(moe_rank_pools, mode):
    """get_dispatch_layout and intranode_dispatch EP_HOST_ASSERT contiguous topk_idx/topk_weights."""
    assert moe_rank_pools.get(2).map(non_contiguous, mode) == ["ok", "ok"]


# -- combine uses the routing given to its dispatch ------------------------------------------------------------


def _world_dispatcher(vendor: str, world: int, mode: str, dtype: str) -> md.Dispatcher:
    spec = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode=mode, output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(ascend_backend(vendor), spec, env={})


def _combine_after_the_router_buffers_change(rank: int, world: int, vendor: str, mode: str, dtype: str):
    d = _world_dispatcher(vendor, world, mode, dtype)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(8, d.spec.num_experts, 2, generator=g, drop_prob=0.1)
    other_ids, _ = random_routing(8, d.spec.num_experts, 2, generator=g)
    layer = ScaledLayer.for_rank(H, d.spec.num_experts, rank, 4)
    return tuple(routing_reuse(d, layer, x, ids, w, other_ids))


@pytest.mark.parametrize("vendor", [FAKE, FAKE_ENV_ONLY])
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_combine_uses_the_routing_given_to_its_dispatch(moe_rank_pools, vendor, mode, dtype):
    """The caller's ids and weights are overwritten in place after dispatch (the kit's ``routing_reuse``: ids copied
    from another routing, w.mul_(0.5).add_(0.25)): combine's result is bit for bit the one without the overwrite.
    The vendor keeps the normal-mode routing in its handle and the low-latency combine takes it again, so the
    adapter hands both copies of its own."""
    for repeatable, same, diff in moe_rank_pools.get(2).map(_combine_after_the_router_buffers_change, vendor, mode,
                                                             dtype):
        assert repeatable, "the round trip itself is not repeatable: the comparison below would mean nothing"
        assert same, f"combine read the overwritten routing (max difference {diff})"


# -- the fakes' own vendor rules ---------------------------------------------------------------------------------


def test_the_fake_int8_is_the_kernels():
    """Normal: s = 127/(amax + 1e-12), q = rint(x·s), scale 1/s; low latency: s = 127/amax, a zero row
    has scale 0; not the codec's x/(amax/127) (it differs at rounding ties)."""
    x = torch.tensor([[0.1, -0.3, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = fake.quant_normal(x)
    want_s = torch.tensor(127.0) / (x.abs().amax(-1, keepdim=True) + torch.tensor(1e-12))
    assert torch.equal(q, torch.round(x * want_s).to(torch.int8)) and torch.equal(s, (1 / want_s).squeeze(-1))
    q, s = fake.quant_low_latency(x)
    assert s[1] == 0 and (q[1] == 0).all()
    assert torch.equal(q[0], torch.round(x[0] * (torch.tensor(127.0) / x[0].abs().max())).to(torch.int8))


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


def test_the_fake_checks_the_normal_op_tiling(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(bad_hidden):
        assert "H) should be in [1024" in message


# -- the trails -----------------------------------------------------------------------------------------------


def _explain(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["explain", "--backend", "ascend_deepep", "--preset", "deepseek-v3", "--tokens", "128",
                     "--world-size", "16", *args])
    return code, out.getvalue()


def test_explain_on_ascend_fp8_falls_back_to_int8_and_nvfp4_is_refused(capsys):
    code, text = _explain("--dtype", "fp8", "--mode", "low_latency")
    assert code == 0 and "wire dtype int8 for backend 'ascend_deepep' (fallback from fp8)" in text
    assert "Atlas A2/A3 have no FP8" in text and "HCCL_BUFFSIZE" in text
    code, _ = _explain("--dtype", "nvfp4", "--quant", '{"input_global_scale": 100.0}')
    assert code == 2 and "no FP4 dispatch" in capsys.readouterr().err
    code, text = _explain()
    assert code == 0 and "backend default (ascend_deepep)" in text and "wire dtype bf16" in text


def test_installed_plugin_is_listed_unavailable_with_what_to_install():
    info = md.PluginHost(env={}).info("ascend_deepep")
    assert info.distribution == "moe-dispatch-ascend-deepep" and info.status == "unavailable"
    assert info.reason and "sgl-kernel-npu" in info.install_hint


@pytest.mark.parametrize("runner,wire,why", [
    ("npu_w8a8", "int8", "W8A8 int8 grouped matmuls take per-token INT8 rows"),
    ("npu_w4a4", "bf16", "W4A4 quantizes BF16 rows to int4 itself"),
])
def test_explain_follows_the_layers_kernel(runner, wire, why):
    code, text = _explain("--runner", runner, "--mode", "low_latency")
    assert code == 0 and f"wire dtype {wire} for backend 'ascend_deepep'" in text
    assert f"runner {runner}" in text and why in text
    assert f"consumes {wire} behind ascend_deepep (low_latency)" in text


def test_a_stand_in_deep_ep_without_its_torch_npu_is_refused_not_planned_for_another_chip():
    """A stand-in Buffer beside the real torch_npu would plan for a chip and an HCCL window that are not the
    stand-in's: the backend refuses it, naming the missing parameter."""
    from moe_dispatch_ascend_deepep_testing import TORCH_NPU_FAKE

    with pytest.raises(md.InvalidSpecError) as info:
        AscendDeepEPBackend(FAKE)
    assert info.value.parameter == "torch_npu_module"
    assert AscendDeepEPBackend(FAKE, torch_npu_module=TORCH_NPU_FAKE).torch_npu_module == TORCH_NPU_FAKE
