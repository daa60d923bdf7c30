"""The third independent audit of 2026-11 (VENDOR.md, "Independent audit", round three): one test per non-OK row.

Names: ``test_r3_n<row>_...`` (``test_r3_new_...``: found while fixing them). Each test failed before its fix (the
failing output is in the report of that change). Past 8 ranks the fakes cannot run normal mode (a CPU pool of 16 ranks is too slow
for this suite): those rules are checked on the functions that decide them, with the fake Buffer executing what
they call, as in round two.
"""

import importlib
import sys
import types

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch_testing.accuracy import TOLERANCES, relative_error
from moe_dispatch.backend import make_codec
from moe_dispatch.backend import Comm
from moe_dispatch.backend import restored_environ
from moe_dispatch_testing.routing import random_expert_weights
from moe_dispatch_testing.signatures import differences
from moe_dispatch_cuda_deepep import buffers, selfcheck, vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts

H = 2048
LL = md.Mode.LOW_LATENCY


def _fake(name=vendor.EMULATOR):
    return importlib.import_module(name)


def _group():
    return torch.distributed.group.WORLD


def _ll_spec(world, tokens=8, experts_per_rank=4):
    return md.DispatchSpec(H, experts_per_rank * world, 2, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency",
                           output_dtype="bf16")


def _batch(d, n=4):
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return x, torch.tensor([[0, d.spec.num_experts - 1]] * n), torch.ones(n, 2)


def _round(d):
    x, ids, w = _batch(d)
    out = d.dispatch(x, ids, w)
    return d.combine(out.hidden_states, out)


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # the type and the parameter are what the tests compare
        return type(exc).__name__, getattr(exc, "parameter", None), str(exc)[:300]


def _short(outcome):
    """A step's outcome: its value (a string), or (exception type, parameter)."""
    return outcome if isinstance(outcome, str) else outcome[:2]


def _reset_context():
    importlib.import_module("moe_dispatch_cuda_deepep.fakes._native").reset_context()


# =====================================================================================================
# N3 (FAKE) and N1 (WRONG): the LL signalling layout
# =====================================================================================================


def _fake_signalling(rank, world):
    fake = _fake()
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 256)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=256)
    x, w = torch.zeros(2, H, dtype=torch.bfloat16), torch.ones(2, 2)
    ids = torch.tensor([[0, 1]] * 2)

    def dispatch(experts):
        return buf.low_latency_dispatch(x, ids, 8, experts, use_fp8=False)

    def round_trip(experts):
        recv, _, handle, _, _ = dispatch(experts)
        buf.low_latency_combine(recv, ids, w, handle)
        return "clean"

    try:
        # A whole round of E' = 256 leaves half 0 zero ([0, 1024)); E = 128's halves [0, 512) and [512, 1024) are
        # then clean on DeepEP too.
        after_a_round = (round_trip(256), round_trip(128))
        buf.clean_low_latency_buffer(8, H, 256)
        buf.clean_low_latency_buffer(8, H, 128)
        dispatch(256)  # E' on half 0: its counts [0, 1024) written; DeepEP's buffer index now 1
        smaller_on_half_1 = _outcome(lambda: dispatch(128) and "clean")  # E's half 1 = [512, 1024): E''s counts
    finally:
        _reset_context()
    return after_a_round, _short(smaller_on_half_1), "stale" in str(smaller_on_half_1)


def test_r3_n3_the_fake_signalling_follows_deepeps_layout(moe_rank_pools):
    """N3: half i of E's signalling counts sits at ``align_up(4E, 128)·i`` (DeepEP@dd758ca csrc/legacy/config.hpp
    LowLatencyLayout). After an LL kernel of E' = 256 on half 0 (its counts written there), E = 128's half 1
    ``[512, 1024)`` lies inside E''s half 0: DeepEP reads stale counts. The fake said "E <= the last E is clean"."""
    assert moe_rank_pools.get(1).map(_fake_signalling) == [(("clean", "clean"), ("RuntimeError", None), True)]


def _two_expert_counts_after_internode_normal(rank, world):
    backend = DeepEPBackend(vendor.EMULATOR)
    large, small = _ll_spec(world, experts_per_rank=40), _ll_spec(world, experts_per_rank=32)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        a = md.create_dispatcher(backend, large, env={})
        b = md.create_dispatcher(backend, small, env={})
    try:
        _round(a)
        b.dispatch(*_batch(b))  # a dispatch whose combine never ran (an aborted step): DeepEP's buffer index is 1
        shared = a.backend_dispatcher.shared
        shared.internode = True  # as past 8 ranks, where normal-mode kernels write the RDMA region
        shared.buffer.emulate_internode_normal_kernels()
        shared.after_normal()  # the end of a normal-mode combine on the Buffer
        outcome = _outcome(lambda: _round(b) is not None and "clean")
        return _short(outcome), "stale" in str(outcome)
    finally:
        _reset_context()
        backend.close()


def test_r3_n1_after_internode_normal_every_expert_count_is_cleaned(moe_rank_pools):
    """N1: after an internode normal-mode combine the adapter cleaned only the largest E ("the counts of E sit at
    offset 0"). E_max = 40 zeroes [0, 160) and [256, 416); E = 32's half 1 is [128, 256), so [160, 256) stayed
    stale while the adapter recorded every layout clean. Now every E on the Buffer is cleaned."""
    assert moe_rank_pools.get(1).map(_two_expert_counts_after_internode_normal) == [("clean", False)]


def _replays(rank, world, pair):
    fake = _fake()
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
    x, w, ids = torch.zeros(2, H, dtype=torch.bfloat16), torch.ones(2, 2), torch.tensor([[0, 1]] * 2)
    graph = fake.CUDAGraph()
    try:
        with graph.capture():
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, 8, 4 * world, use_fp8=False)
            if pair:
                buf.low_latency_combine(recv, ids, w, handle)
        return [_short(_outcome(lambda: graph.replay() or "replayed")) for _ in range(3)]
    finally:
        _reset_context()


def test_r3_new_a_replayed_kernel_keeps_the_half_it_was_captured_with(moe_rank_pools):
    """NEW (FAKE, with N3): DeepEP picks the signalling half on the host (``low_latency_buffer_idx ^= 1``), so a captured
    kernel keeps its half for every replay: a graph holding a dispatch without its combine reads, at its second replay,
    the counts its first replay left. The fake's replay re-ran the host code (a fresh half each time)."""
    pool = moe_rank_pools.get(1)
    assert pool.map(_replays, pair=True) == [["replayed"] * 3]
    assert pool.map(_replays, pair=False) == [["replayed", ("RuntimeError", None), ("RuntimeError", None)]]


# =====================================================================================================
# N2 (WRONG): a clean due while a CUDA graph is captured
# =====================================================================================================


def _capture(d, graph):
    with graph.capture():
        _round(d)
    return "captured"


def _capture_after_adopting_a_dirty_buffer(rank, world):
    fake = _fake()
    backend = DeepEPBackend(vendor.EMULATOR)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        mine = fake.Buffer(_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
    mine.emulate_internode_normal_kernels()  # the engine used it for internode normal mode before handing it in
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, _ll_spec(world), env={}, options={"buffer": mine,
                                                                             "buffer_num_qps_per_rank": 4})
    first, second = fake.CUDAGraph(), fake.CUDAGraph()
    try:
        steps = [_outcome(lambda: _capture(d, first)),
                 _outcome(lambda: _round(d) is not None and "eager"),  # before any replay
                 _outcome(lambda: first.replay() or "replayed"),
                 _outcome(lambda: _capture(d, second)),
                 _outcome(lambda: second.replay() or "replayed")]
        return [_short(o) for o in steps], first.kernels, second.kernels
    finally:
        _reset_context()
        backend.close()


def test_r3_n2_an_adopted_buffer_is_cleaned_at_creation_not_in_a_graph(moe_rank_pools):
    """N2 (a, b): the clean an adopted Buffer needs was issued at its first LL call, which was captured: it ran only at
    that graph's first replay, and the adapter recorded the Buffer clean at capture, so an eager call before the replay
    read stale counts; only that graph held the collective. Now the clean runs at creation (collective, eager)."""
    steps, first, second = moe_rank_pools.get(1).map(_capture_after_adopting_a_dirty_buffer)[0]
    assert steps == ["captured", "eager", "replayed", "captured", "replayed"]
    assert first == second == ["low_latency_dispatch", "low_latency_combine"]


def _capture_with_a_normal_dispatch_pending(rank, world):
    fake = _fake()
    backend = DeepEPBackend(vendor.EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, _ll_spec(world), env={}, options={"buffer_num_qps_per_rank": 4})
    shared = d.backend_dispatcher.shared
    graph, again = fake.CUDAGraph(), fake.CUDAGraph()
    try:
        _round(d)
        shared.internode = True  # as past 8 ranks: a normal-mode dispatch wrote the RDMA region ...
        shared.buffer.emulate_internode_normal_kernels()
        shared.after_normal_dispatch()  # ... and its combine never ran (an aborted step)
        steps = [_outcome(lambda: _capture(d, graph)),
                 _outcome(lambda: _round(d) is not None and "eager"),
                 _outcome(lambda: _capture(d, again)),
                 _outcome(lambda: again.replay() or "replayed")]
        return [_short(o) for o in steps], graph.kernels, again.kernels
    finally:
        _reset_context()
        backend.close()


def test_r3_n2_a_clean_due_at_capture_refuses_the_capture(moe_rank_pools):
    """N2: a clean still due when an LL call is captured (a normal-mode dispatch past 8 ranks whose combine did not
    run) went into the graph. Now the capture is refused (typed) until one eager LL step cleaned."""
    steps, refused, captured = moe_rank_pools.get(1).map(_capture_with_a_normal_dispatch_pending)[0]
    assert steps == [("InvalidSpecError", "cuda_graph_capture"), "eager", "captured", "replayed"]
    assert refused == [] and captured == ["low_latency_dispatch", "low_latency_combine"]


# =====================================================================================================
# N4 (CRASH): DeepEP before 21efbe9
# =====================================================================================================


def _deep_ep_before_ue8m0(monkeypatch, v10):
    """DeepEP 1.0 (ebfe47e) or 1.1.0 before 21efbe9 (9ec0612): ``low_latency_dispatch`` without round_scale/use_ue8m0
    (and, on 1.0, without use_fp8)."""
    base = _fake()

    class Buffer(base.Buffer):
        if v10:
            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     async_finish=False, return_recv_hook=False):
                return base.Buffer.low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                        num_experts, async_finish=async_finish,
                                                        return_recv_hook=return_recv_hook)
        else:
            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     cumulative_local_expert_recv_stats=None, use_fp8=True, async_finish=False,
                                     return_recv_hook=False):
                return base.Buffer.low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                        num_experts, cumulative_local_expert_recv_stats,
                                                        use_fp8=use_fp8, async_finish=async_finish,
                                                        return_recv_hook=return_recv_hook)

    recorded = vendor.V10_LL_DISPATCH if v10 else vendor.V11_BEFORE_UE8M0_LL_DISPATCH
    assert differences(recorded, Buffer.low_latency_dispatch) == []
    name = f"{vendor.FAKES}.deep_ep_before_21efbe9_{'v10' if v10 else 'v11'}"  # a fake's name: no CUDA device needed
    module = types.ModuleType(name)
    module.__version__, module.Buffer, module.Config = "1.0.0" if v10 else "1.1.0", Buffer, base.Config
    monkeypatch.setitem(sys.modules, name, module)
    return name


@pytest.mark.parametrize("v10", [True, False], ids=["1.0", "1.1-before-21efbe9"])
def test_r3_n4_deepep_without_round_scale_is_refused(monkeypatch, v10):
    """N4: DeepEP 1.0.x and 1.1.0 before 21efbe9 have no ``round_scale``/``use_ue8m0`` (no ``use_fp8`` before
    ed7487c), and their normal mode asserts float32 scales: every LL dispatch raised ``TypeError``. The supported
    floor is now 21efbe9: ``probe()`` and ``create`` refuse older builds, naming why."""
    name = _deep_ep_before_ue8m0(monkeypatch, v10)
    backend = DeepEPBackend(name)
    reason = backend.probe()
    assert reason is not None and "round_scale" in reason and vendor.COMMIT_UE8M0 in reason
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency", output_dtype="bf16")
    with pytest.raises(md.BackendUnavailableError, match="round_scale"):
        md.create_dispatcher(backend, spec, env={})
    resolution = mdp.resolve_output_dtype(spec, DeepEPBackend(vendor.EMULATOR), env={})
    ctx = mdb.DispatchContext(spec, resolution, Comm(None), make_codec(spec.wire_format()),
                             DeepEPBackend(vendor.EMULATOR).buffer_size(spec, 1), torch.device("cpu"))
    with pytest.raises(md.BackendUnavailableError, match="round_scale") as info:
        backend.create(ctx)
    assert info.value.parameter == vendor.REAL
    assert DeepEPBackend(vendor.EMULATOR).probe() is None


# =====================================================================================================
# N5 (CRASH), N6 (DOC): bytes DeepEP's constructor and internode notify refuse
# =====================================================================================================


def test_r3_n5_constructor_byte_limits_are_typed():
    """N5: DeepEP's constructor asserts ``num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0`` and each region
    ``/ sizeof(int4) < INT_MAX`` (csrc/legacy/buffer.hpp Buffer::Buffer): a reservation breaking them was an untyped
    ``RuntimeError`` at creation."""
    backend = DeepEPBackend(vendor.EMULATOR)
    ll = _ll_spec(8)
    need = backend.buffer_request(ll, 8)
    for reserve in ((2**31, need.num_rdma_bytes), 16 * vendor.INT_MAX):
        with pytest.raises(md.CapacityError) as info:
            buffers.planned_request(need, {"buffer_bytes": reserve}, 8)
        assert info.value.parameter == "options.buffer_bytes"
    normal = md.DispatchSpec(H, 32, 2, output_dtype="bf16")
    with pytest.raises(md.CapacityError):
        buffers.planned_request(backend.buffer_request(normal, 8), {"buffer_bytes": 16 * vendor.INT_MAX}, 8)
    buffers.planned_request(need, {"buffer_bytes": (vendor.INT_MAX - 127, need.num_rdma_bytes)}, 8)


def test_r3_n6_both_modes_options_refuse_int_max_and_the_script_fits():
    """N6: past 8 ranks ``both_modes_options`` returned a 3.8 GB LL Buffer for run_on_gpu.py's default shape (32
    experts per rank on 16 ranks), which every normal-mode layer then refused (internode notify: < INT_MAX). It now
    refuses up front, and the script picks experts per rank that fit (``selfcheck.fitting_experts_per_rank``)."""
    backend = DeepEPBackend(vendor.EMULATOR)
    shape = dict(hidden=7168, top_k=8, tokens=128)
    with pytest.raises(md.CapacityError) as info:
        backend.both_modes_options(selfcheck.layer_spec(16, "normal", "bf16", experts_per_rank=32, **shape),
                                   selfcheck.layer_spec(16, "low_latency", "bf16", experts_per_rank=32, **shape), 16)
    assert "INT_MAX" in str(info.value)
    per_rank = selfcheck.fitting_experts_per_rank(backend, 16, **shape)
    assert per_rank == 16 and selfcheck.fitting_experts_per_rank(backend, 8, **shape) == 32
    ll = selfcheck.layer_spec(16, "low_latency", "bf16", experts_per_rank=per_rank, **shape)
    options = backend.both_modes_options(selfcheck.layer_spec(16, "normal", "bf16", experts_per_rank=per_rank,
                                                              **shape), ll, 16)
    held = buffers.planned_request(backend.buffer_request(ll, 16), options, 16)
    for mode, dtype in (("low_latency", "fp8"), ("normal", "bf16"), ("normal", "fp8")):
        spec = selfcheck.layer_spec(16, mode, dtype, experts_per_rank=per_rank, **shape)
        buffers.check_serves(held, 16, backend.buffer_request(spec, 16), spec, parameter="options.buffer_bytes")


# =====================================================================================================
# N8 (CRASH): SM100 fp32 activation scales
# =====================================================================================================


def _sm100_masked(garbage_past_counts):
    module = _fake(vendor.DEEP_GEMM_EMULATOR).emulate((10, 0), "2.6.1")
    experts = DeepGemmExperts("block_fp8", LL, module)
    layer = experts.process_weights(random_expert_weights(4, 256, 128, generator=torch.Generator().manual_seed(0)))
    capacity = experts.masked_capacity_multiple
    x = torch.randn(4, capacity, 256, generator=torch.Generator().manual_seed(1))
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, 256, ue8m0=True)).quantize(x)
    counts = torch.tensor([3, 0, capacity - 1, 1])
    data, scale = q.data.clone(), q.scale.clone()
    if garbage_past_counts:  # DeepEP's torch::empty past each expert's count
        past = (torch.arange(capacity).unsqueeze(0) >= counts.unsqueeze(1))
        scale[past] = float("nan")
        data.view(torch.uint8)[past] = 0x7F
    mn_major = scale.transpose(1, 2).contiguous().transpose(1, 2)  # DeepEP's LL scale layout
    return experts, layer, q, data, mn_major, counts


def test_r3_n8_sm100_fp32_scales_ignore_the_rows_past_the_counts():
    """N8 (eager): DeepEP's masked scales past each expert's count are ``torch::empty``; the runner checked and
    packed them as rows, refusing real power-of-two scales (or, on DeepGEMM 2.6.1, tripping its device assert)."""
    experts, layer, q, data, scale, counts = _sm100_masked(True)
    got = experts.apply_without_routing_weights(layer, data, scale, 1, counts, torch.float32)
    want = md.TorchExperts().apply_without_routing_weights(layer.dequantized(), q.data, q.scale, 1, counts,
                                                           torch.float32)
    assert relative_error(got, want) < TOLERANCES[md.DispatchDtype.FP8]


def test_r3_n8_sm100_fp32_scales_are_refused_under_capture():
    """N8 (capture): under CUDA-graph capture the power-of-two check (a host read) was skipped and the scales packed:
    DeepGEMM 2.6.1 device-asserts (the context is lost), earlier versions pack garbage exponents. fp32 activation
    scales on SM100 are now refused under capture (typed): dispatch must send packed UE8M0."""
    experts, layer, q, data, scale, counts = _sm100_masked(False)
    graph = _fake().CUDAGraph()
    try:
        with pytest.raises(md.InvalidInputError) as info:
            with graph.capture():
                experts.apply_without_routing_weights(layer, data, scale * 1.5, 1, counts, torch.float32)
        assert info.value.parameter == "hidden_states_scale" and "capture" in str(info.value)
    finally:
        _reset_context()


# =====================================================================================================
# N9 (WRONG): a handed-in Buffer on another group
# =====================================================================================================


def _buffer_of_another_group(rank, world):
    fake = _fake()
    backend = DeepEPBackend(vendor.EMULATOR)
    other = torch.distributed.new_group(list(range(world)))  # the same size, another group
    spec = _ll_spec(world)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    options = {"buffer_num_qps_per_rank": 4}
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            mine = fake.Buffer(_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
            adopted = _outcome(lambda: md.create_dispatcher(backend, spec, other, env={},
                                                            options={**options, "buffer": mine}) and "created")
            own = md.create_dispatcher(backend, spec, env={}, options={**options, "buffer": mine})
            rewrapped = _outcome(lambda: md.create_dispatcher(backend, spec, other, env={},
                                                              options={**options, "buffer": mine}) and "created")
        _round(own)
        return _short(adopted), _short(rewrapped)
    finally:
        backend.close()


def test_r3_n9_a_handed_in_buffer_must_be_on_the_layers_group(moe_rank_pools):
    """N9: only the group's size was compared for ``options["buffer"]``: a Buffer made on another group of the same
    size was used, and DeepEP routes by its own group's ranks. Now the group itself must be the layer's."""
    refused = ("InvalidSpecError", "options.buffer")
    assert moe_rank_pools.get(1).map(_buffer_of_another_group) == [(refused, refused)]


# =====================================================================================================
# N7 (DOC), N10 (DOC): graphs after close(); the signalling layout in the docs
# =====================================================================================================


def _close_after_capture(rank, world):
    import warnings

    fake = _fake()
    backend = DeepEPBackend(vendor.EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, _ll_spec(world), env={}, options={"buffer_num_qps_per_rank": 4})
    graph = fake.CUDAGraph()
    try:
        with graph.capture():
            _round(d)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.close()
        replayed = _outcome(lambda: graph.replay() or "replayed")
        return [str(w.message)[:40] for w in caught if w.category is RuntimeWarning], _short(replayed)
    finally:
        _reset_context()
        backend.close()


def test_r3_n7_close_warns_about_graphs_that_captured_ll_kernels(moe_rank_pools):
    """N7: ``close()`` frees the Buffer's NVSHMEM memory while a graph that captured LL kernels on it may still be
    replayed (kernels on freed memory). README "Lifetime" says to drop such graphs first; ``close()`` warns."""
    warned, replayed = moe_rank_pools.get(1).map(_close_after_capture)[0]
    assert len(warned) == 1 and warned[0].startswith("CUDA graphs captured DeepEP low-latency")
    assert replayed == ("RuntimeError", None)  # the fake's destroyed runtime (on a GPU: freed memory)


def test_r3_n10_signalling_halves_and_the_docs():
    """N10 (and N1's layout): half i of E's counts at ``align_up(4E, 128)·i``; E_max = 272 leaves bytes 1088..1152 of
    E = 256's half 1 outside both of its halves. The docs no longer say "the largest E covers all"."""
    import pathlib

    assert vendor.ll_signalling_halves(256) == ((0, 1024), (1024, 2048))
    assert vendor.ll_signalling_halves(272) == ((0, 1088), (1152, 2240))
    assert vendor.ll_data_offset(32) == 256 and vendor.ll_signalling_halves(40)[1] == (256, 416)
    root = pathlib.Path(__file__).parents[1]
    for doc in ("README.md", "VENDOR.md", "src/moe_dispatch_cuda_deepep/buffers.py",
                "src/moe_dispatch_cuda_deepep/fakes/deep_ep.py"):
        text = (root / doc).read_text()
        for wrong in ("the largest E covers all", "counts at offset 0", "for the largest E on it", "of a smaller E"):
            assert wrong not in text, (doc, wrong)
