"""The ``cuda_deepep_v2`` backend (DeepEP 2.x's ElasticBuffer) and its fake (fakes/deep_ep_elastic.py).

The kit runs on the fake at 2 and 4 ranks (test_conformance.py); here: the size formula against DeepEP's numbers,
the fake refusing what DeepEP refuses, the expanded layout's order not being fixed, the shared buffer growing and
closing, and the limits and the API named at creation and in ``explain``."""

import json

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.cli import main as cli_main
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.elastic import NAME, DeepEPV2Backend, _num_sms_option
from moe_dispatch_cuda_deepep_testing import EMULATOR, EMULATOR_V1_TOPK9, EMULATOR_V2_0
from moe_dispatch_cuda_deepep_testing.support import outcome_of

# -- sizes -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks,tokens,hidden,topk,fp8,expected", [
    # deepseek-ai/DeepEP@dd758ca csrc/elastic/buffer.hpp:586-686, direct kernels on one NVLink domain: dispatch
    # 14464 B/token · 4096 · 8 ranks = 473,956,352 (exactly 226 × 2 MiB); combine 14400 · 8 · 4096 is smaller.
    (8, 4096, 7168, 8, False, 473_956_352),
    (1, 256, 2048, 8, False, 2 << 20),  # 1,081,344 B rounded up to the 2 MiB alignment
    (8, 4096, 7168, 0, False, 484_442_112),  # num_topk=0 sizes for top-32 (buffer.hpp:663)
])
def test_the_ported_size_formula_gives_deepeps_numbers(ranks, tokens, hidden, topk, fp8, expected):
    assert vendor.ported_elastic_buffer_sizes(ranks, tokens, hidden, topk, fp8).total == expected
    assert expected % vendor.V2_BUFFER_ALIGNMENT == 0


def test_fp8_rows_shrink_dispatch_not_combine():
    bf16 = vendor.ported_elastic_buffer_sizes(8, 4096, 7168, 8, False)
    fp8 = vendor.ported_elastic_buffer_sizes(8, 4096, 7168, 8, True)
    assert fp8.dispatch < bf16.dispatch and fp8.combine == bf16.combine


# -- the fake on ranks -------------------------------------------------------------------------------------------


def _fake_buffer(num_bytes: int = 2 << 20):  # type: ignore[no-untyped-def]
    from moe_dispatch_cuda_deepep_testing.fakes.deep_ep import ElasticBuffer

    return ElasticBuffer(torch.distributed.group.WORLD, num_bytes=num_bytes, explicitly_destroy=True)


def _routing(rank: int, tokens: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, k, generator=g)


def _expanded_twice(rank, world):  # type: ignore[no-untyped-def]
    """Two identical expanded dispatches: each expert's rows, as sets and in the order they came."""
    buf = _fake_buffer()
    x, ids, w = _routing(rank, 16, 4 * world, 2)
    seen = []
    for _ in range(2):
        recv, none, recv_w, handle, _ = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_experts=4 * world,
                                                     num_max_tokens_per_rank=16, do_expand=True)
        counts = handle.num_unaligned_recv_tokens_per_expert.tolist()
        starts = [sum(counts[:e]) for e in range(len(counts))]
        seen.append([recv[s:s + c].float().sum(1).tolist() for s, c in zip(starts, counts)])
        assert none is None and recv.shape[0] == sum(counts) == recv_w.shape[0]
    buf.destroy()
    return seen


def test_expanded_rows_are_grouped_by_expert_in_no_fixed_order(moe_rank_pools):
    """DeepEP places a row by ``atomicAdd`` (dispatch_copy_epilogue.cuh:120-121): an adapter must not rely on the
    order within an expert, so the fake changes it from call to call; the rows themselves are the same."""
    reordered = False
    for first, second in moe_rank_pools.get(2).map(_expanded_twice):
        for a, b in zip(first, second):
            assert sorted(a) == sorted(b)
            reordered |= a != b
    assert reordered


def _refusals(rank, world):  # type: ignore[no-untyped-def]
    from moe_dispatch_cuda_deepep_testing.fakes import _native

    out = {}
    try:
        _fake_buffer(3 << 20)
    except RuntimeError as exc:
        out["unaligned"] = str(exc)
    buf = _fake_buffer()
    x, ids, w = _routing(rank, 8, 4 * world, 2)
    try:
        buf.dispatch(x, topk_idx=ids.to(torch.int32), topk_weights=w, num_experts=4 * world,
                     num_max_tokens_per_rank=8, do_expand=True)
    except RuntimeError as exc:
        out["int32 ids"] = str(exc)
    recv, _, _, handle, _ = buf.dispatch(x[:, :128].contiguous(), topk_idx=ids, topk_weights=w,
                                         num_experts=4 * world, num_max_tokens_per_rank=8, do_expand=True)
    try:
        buf.combine(recv, handle)
    except RuntimeError as exc:
        out["hidden 128"] = str(exc)
    twice = ids.clone()
    twice[0, 1] = twice[0, 0]
    try:
        buf.dispatch(x, topk_idx=twice, topk_weights=w, num_experts=4 * world, num_max_tokens_per_rank=8,
                     do_expand=True)
    except RuntimeError as exc:
        out["repeat"] = str(exc)
    try:
        _fake_buffer()
    except RuntimeError as exc:
        out["after a trap"] = str(exc)
    _native.reset_context()
    return out


def test_the_fake_refuses_what_deepep_refuses(moe_rank_pools):
    for out in moe_rank_pools.get(2).map(_refusals):
        assert "kNumAlignmentBytes" in out["unaligned"]  # buffer.hpp:98
        assert "topk_idx_t" in out["int32 ids"]  # buffer.hpp:775-778
        assert "NVCC compilation failed" in out["hidden 128"]  # combine.cuh:109, a JIT compile error
        assert "unspecified launch failure" in out["repeat"]  # a device assert traps (dispatch_copy_epilogue.cuh:107)
        assert "context was lost" in out["after a trap"]  # and the process's context is gone


# -- the adapter -------------------------------------------------------------------------------------------------


def _spec(**kw):  # type: ignore[no-untyped-def]
    base = dict(hidden_size=512, num_experts=8, top_k=2, num_max_dispatch_tokens_per_rank=16, output_dtype="bf16")
    return md.DispatchSpec(**{**base, **kw})


@pytest.mark.parametrize("change,parameter", [
    (dict(hidden_size=640), "hidden_size"),  # combine needs a multiple of 256
    (dict(top_k=33, num_experts=64), "top_k"),  # kNumTopk <= 32
    (dict(num_experts=512), "num_experts"),  # at most 256 experts per rank (layout.cuh:37-40)
])
def test_limits_are_refused_at_creation_with_the_parameter(change, parameter):
    with pytest.raises(md.InvalidSpecError) as err:
        DeepEPV2Backend(vendor_module=EMULATOR).check_spec(_spec(**change), 1)
    assert err.value.parameter == parameter


def test_a_deepep_without_elasticbuffer_names_the_v1_backend():
    why = DeepEPV2Backend(vendor_module=EMULATOR_V1_TOPK9).probe()
    assert why is not None and "no ElasticBuffer" in why and "'cuda_deepep'" in why
    assert DeepEPV2Backend(vendor_module=EMULATOR).probe() is None


def _round_trip(d: md.Dispatcher, rank: int) -> float:
    x, ids, w = _routing(rank, 8, 8, 2)
    x = x.repeat(1, d.spec.hidden_size // 256)
    out = d.dispatch(x, ids, w)
    y = d.combine(out.hidden_states, out)  # identity experts: Σ_k w_k · x
    want = x.float() * w.sum(1, keepdim=True)
    return float((y.float() - want).norm() / want.norm())


def _two_layers_then_close(rank, world):  # type: ignore[no-untyped-def]
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    small = md.create_dispatcher(backend, _spec(num_max_dispatch_tokens_per_rank=8), env={})
    first = backend._buffers._by_group[id(torch.distributed.group.WORLD)].buffer.num_bytes
    large = md.create_dispatcher(backend, _spec(num_max_dispatch_tokens_per_rank=4096), env={})
    shared = backend._buffers._by_group[id(torch.distributed.group.WORLD)]
    errors = (_round_trip(small, rank), _round_trip(large, rank))
    grown = shared.buffer.num_bytes
    backend.close()
    try:
        _round_trip(small, rank)
        refused = None
    except md.MoEDispatchError as exc:
        refused = type(exc).__name__
    return first, grown, errors, refused


def test_layers_share_one_buffer_grown_to_the_largest_and_close_ends_them(moe_rank_pools):
    for first, grown, errors, refused in moe_rank_pools.get(2).map(_two_layers_then_close):
        assert grown > first  # the 4096-token layer replaced the buffer; the 8-token layer uses the new one
        assert max(errors) < 1e-2, errors
        assert refused == "BackendUnavailableError"


def test_explain_names_the_deepep_api(capsys):
    for name, api in ((NAME, "V2 ElasticBuffer"), ("cuda_deepep", "V1 Buffer")):
        assert cli_main(["explain", "--backend", name, "--json"]) == 0
        assert api in json.loads(capsys.readouterr().out)["backend_description"]


def _combine_past_the_buffer(rank, world):  # type: ignore[no-untyped-def]
    """FP8 rows: a 2 MiB buffer holds N=2048 tokens' dispatch (640 B each, ×2 ranks) but not their combine (BF16
    rows, 1088 B × min(R, K)): DeepEP checks combine's own size (buffer.hpp:1253-1256)."""
    buf = _fake_buffer()
    x, ids, w = _routing(rank, 8, 4 * world, 2)
    q = (x.to(torch.float8_e4m3fn), torch.ones(8, 2))
    recv, _, _, handle, _ = buf.dispatch(q, topk_idx=ids, topk_weights=w, num_experts=4 * world,
                                         num_max_tokens_per_rank=2048, do_expand=True)
    try:
        buf.combine(torch.zeros(recv[0].shape, dtype=torch.bfloat16), handle)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_combine_checks_its_own_buffer_size(moe_rank_pools):
    for error in moe_rank_pools.get(2).map(_combine_past_the_buffer):
        assert error and "get_combine_buffer_size(...) <= num_buffer_bytes" in error


def _order_of_first_calls(rank, world):  # type: ignore[no-untyped-def]
    """What ``create`` does on the group before DeepEP first sees it (a collective, then the hint, then the buffer)."""
    import torch.distributed as dist

    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic

    seen: list[str] = []
    real_reduce, real_hint = dist.all_reduce, deep_ep_elastic.ElasticBuffer.get_buffer_size_hint
    dist.all_reduce = lambda *a, **k: (seen.append("collective"), real_reduce(*a, **k))[1]
    deep_ep_elastic.ElasticBuffer.get_buffer_size_hint = staticmethod(
        lambda *a, **k: (seen.append("deepep hint"), real_hint(*a, **k))[1])
    try:
        backend = DeepEPV2Backend(vendor_module=EMULATOR)
        md.create_dispatcher(backend, _spec(), env={})
        backend.close()
    finally:
        dist.all_reduce, deep_ep_elastic.ElasticBuffer.get_buffer_size_hint = real_reduce, staticmethod(real_hint)
    return seen


def test_deepep_is_called_only_after_a_collective_on_the_group(moe_rank_pools):
    """DeepEP wraps the group's NCCL communicator, which PyTorch creates at the group's first collective; a DeepEP
    call before it caches a null one and crashes (DeepEP #726). The creation agreement uses the port."""
    for seen in moe_rank_pools.get(2).map(_order_of_first_calls):
        assert seen[:2] == ["collective", "deepep hint"], seen


def _without_gin(rank, world):  # type: ignore[no-untyped-def]
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic

    deep_ep_elastic.EMULATED_NETWORK_HAS_GIN = False
    try:
        md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR), _spec(), env={})
    except md.BackendUnavailableError as exc:
        return exc.parameter, str(exc)
    finally:
        deep_ep_elastic.EMULATED_NETWORK_HAS_GIN = True
    return None


def test_a_network_without_gin_names_ep_disable_gin(moe_rank_pools):
    """On NVLink-only nodes DeepEP's constructor asserts "NCCL GIN is unavailable" unless EP_DISABLE_GIN=1 (DeepEP
    #629/#630): the adapter says so."""
    for parameter, message in moe_rank_pools.get(2).map(_without_gin):
        assert parameter == "EP_DISABLE_GIN" and "EP_DISABLE_GIN=1" in message


def _two_nvlink_domains(rank, world):  # type: ignore[no-untyped-def]
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic

    deep_ep_elastic.EMULATED_NVLINK_DOMAIN = world // 2  # two nodes: with hybrid mode allowed, DeepEP's hybrid kernels
    try:
        return _round_trip(md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR), _spec(), env={}), rank)
    finally:
        deep_ep_elastic.EMULATED_NVLINK_DOMAIN = deep_ep_elastic.NVLINK_DOMAIN


def test_a_group_over_two_nvlink_domains_runs_the_direct_kernels(moe_rank_pools):
    """2 nodes x 2 GPUs: DeepEP would switch to its hybrid kernels, which the adapter does not drive; it passes
    allow_hybrid_mode=False to the buffer and its size hint, so the direct kernels run over GIN."""
    assert max(moe_rank_pools.get(4).map(_two_nvlink_domains)) < 1e-2


def test_past_one_nvlink_domain_and_in_deterministic_mode_it_refuses_at_creation():
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    with pytest.raises(md.InvalidSpecError) as err:
        backend.check_spec(_spec(num_experts=16), 16)  # hybrid kernels: not run anywhere yet
    assert err.value.parameter == "world_size"
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(md.InvalidSpecError) as err:
            backend._check_torch_flags()  # DeepEP asserts in every call otherwise
        assert err.value.parameter == "torch.use_deterministic_algorithms"
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_bad_num_sms_option_is_refused_before_any_buffer():
    for bad in (-2, "8", True, vendor.H100_NUM_SMS + 1):
        with pytest.raises(md.InvalidSpecError) as err:
            _num_sms_option({"num_sms": bad}, vendor.H100_NUM_SMS)
        assert err.value.parameter == "options.num_sms"
    # odd counts launch with a cluster of 1 (dispatch.hpp:226); no device (planning): no upper bound
    assert _num_sms_option({"num_sms": 3}, vendor.H100_NUM_SMS) == 3
    assert _num_sms_option({"num_sms": 200}, None) == 200



def _ue8m0_scales(rank, world):  # type: ignore[no-untyped-def]
    spec = _spec(output_dtype="fp8", quant=md.QuantHints(fp8_ue8m0_scales=True))
    d = md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR), spec, env={})
    x, ids, w = _routing(rank, 8, 8, 2)
    out = d.dispatch(x.repeat(1, 2), ids, w)
    return out.hidden_states_scale.dtype, tuple(out.hidden_states_scale.shape), out.hidden_states.shape[0]


def test_ue8m0_scales_travel_packed_four_per_word(moe_rank_pools):
    """What DeepGEMM takes on SM100 (and DeepEP's V1 LL kernels emit): int32 words of four exponent bytes."""
    for dtype, shape, rows in moe_rank_pools.get(2).map(_ue8m0_scales):
        assert dtype == torch.int32 and shape == (rows, 1)  # H=512: 4 groups of 128 in one word


def test_deepep_2_0_is_refused_with_the_version_that_works():
    """DeepEP 2.0.0's ElasticBuffer.dispatch has no do_zero_padding (every call of the adapter would be a TypeError)
    and its EPHandle no per-expert counts: the probe says so and names 2.1.0."""
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_v2_0

    with pytest.raises(TypeError, match="do_zero_padding"):  # the 2.0.0 fake is as strict as 2.0.0
        deep_ep_v2_0.ElasticBuffer.dispatch(None, None, do_zero_padding=False)
    why = DeepEPV2Backend(EMULATOR_V2_0).probe()
    assert why is not None and "do_zero_padding" in why and vendor.V2_MIN_VERSION in why
    assert DeepEPV2Backend(EMULATOR).probe() is None


# -- split phase ------------------------------------------------------------------------------------------------


def _written_before_wait(rank, world):  # type: ignore[no-untyped-def]
    """A started dispatch's input overwritten before its wait(): DeepEP's comm stream still reads it (R1)."""
    d = md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR), _spec(), env={})
    x, ids, w = _routing(rank, 8, 8, 2)
    x = x.repeat(1, 2)
    pending = d.dispatch_start(x, ids, w)
    x.zero_()  # the engine's next step writes into its static input buffer too early
    try:
        pending.wait()
    except RuntimeError as exc:  # DeepEP would deliver a race, not an error: the fake refuses instead
        return str(exc)
    return None


def test_an_input_written_before_wait_is_refused_by_the_fake(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(_written_before_wait):
        assert message is not None and "written between the async call" in message and "x" in message


def _without_record_stream(rank, world):  # type: ignore[no-untyped-def]
    import os

    d = md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR), _spec(), env={})
    x, ids, w = _routing(rank, 8, 8, 2)
    x = x.repeat(1, 2)
    os.environ[vendor.EP_AVOID_RECORD_STREAM] = "1"
    try:
        started = d.dispatch_start(x, ids, w)
        out = started.wait()
        combined = d.combine_start(out.hidden_states, out)
        y = combined.wait()
    finally:
        del os.environ[vendor.EP_AVOID_RECORD_STREAM]
    split = d.dispatch_start(x, ids, w)
    want = d.combine(split.wait().hidden_states, split.wait())
    return started.overlapped, combined.overlapped, split.overlapped, torch.equal(y, want)


def test_with_ep_avoid_record_stream_the_calls_run_at_start(moe_rank_pools):
    """Under EP_AVOID_RECORD_STREAM DeepEP keeps the call's tensors alive only through the event, which a dropped
    Pending would lose: the adapter runs both calls to their end at start and says so (R2)."""
    for dispatch_split, combine_split, default_split, same in moe_rank_pools.get(2).map(_without_record_stream):
        assert (dispatch_split, combine_split, default_split, same) == (False, False, True, True)


@pytest.mark.parametrize("value,avoids", [(None, False), ("0", False), ("1", True), (" 2", True), ("yes", True),
                                          ("-0", False)])
def test_ep_avoid_record_stream_is_read_as_deepep_reads_it(value, avoids):
    """``std::getenv`` + ``sscanf("%d")`` (csrc/utils/system.hpp:19-35): unreadable text is taken as set."""
    env = {} if value is None else {vendor.EP_AVOID_RECORD_STREAM: value}
    assert vendor.avoids_record_stream(env) is avoids


def _padding_found(rank, world, stale):  # type: ignore[no-untyped-def]
    """``selfcheck.nonzero_padding`` on the fake; ``stale``: the padding DeepEP should zero keeps whatever shared
    memory held (NaN here), as an unfenced TMA store could leave it on a device."""
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic
    from moe_dispatch_cuda_deepep_testing.selfcheck import nonzero_padding

    garbage = deep_ep_elastic._garbage
    if stale:
        deep_ep_elastic._garbage = lambda rows, width, dtype, fill: garbage(rows, width, dtype, float("nan"))
    try:
        return nonzero_padding(rank, world, "fp8", DeepEPV2Backend(vendor_module=EMULATOR), EMULATOR, calls=2,
                               hidden=512)
    finally:
        deep_ep_elastic._garbage = garbage


def test_the_padding_check_sees_bytes_deepep_left_unzeroed(moe_rank_pools):
    import functools

    ((zeroed,),) = [moe_rank_pools.get(1).map(functools.partial(_padding_found, stale=False))]
    ((stale,),) = [moe_rank_pools.get(1).map(functools.partial(_padding_found, stale=True))]
    assert zeroed == {"data": 0, "scales": 0, "weights": 0}
    assert stale["data"] > 0 and stale["scales"] > 0 and stale["weights"] > 0, stale


# -- low-latency mode: no host sync, DeepEP's worst-case rows ----------------------------------------------------


def _low_latency_against_normal(rank, world, alignment):  # type: ignore[no-untyped-def]
    x, ids, w = _routing(rank, 12, 8, 3)
    x = x.repeat(1, 2)
    got = {}
    for mode in ("normal", "low_latency"):
        d = md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR),
                                 _spec(mode=mode, top_k=3, expert_alignment=alignment), env={})
        out = d.dispatch(x, ids, w)
        got[mode] = (out.hidden_states.shape[0], out.expert_counts().tolist(),
                     bool(out.hidden_states.float().isnan().any()), d.combine(out.hidden_states, out))
        other = d.dispatch(x[:5], ids[:5].flip(1), w[:5])  # another routing, fewer tokens
        got[mode + " again"] = other.hidden_states.shape[0]
        d.combine(other.hidden_states, other)
    return got


@pytest.mark.parametrize("alignment", [1, 8])
def test_low_latency_rows_are_deepeps_worst_case_and_combine_gives_normal_modes_bits(moe_rank_pools, alignment):
    """``do_cpu_sync=False``: as many rows as DeepEP allocates for the worst case (buffer.hpp:1065-1071), the rows past
    the experts' segments unwritten (NaN in the fake), which the experts' output keeps and combine never reads: the
    same counts and the same combined bits as normal mode's exact rows."""
    world, local, k, n_max = 2, 4, 3, 16
    worst = -(-(world * n_max * min(k, local) + (alignment - 1) * local) // alignment) * alignment
    for got in moe_rank_pools.get(world).map(_low_latency_against_normal, alignment):
        rows, counts, nan, combined = got["low_latency"]
        exact_rows, exact_counts, exact_nan, exact = got["normal"]
        assert rows == worst == got["low_latency again"] and exact_rows < worst  # the same shape every call
        assert got["normal again"] < exact_rows
        assert counts == exact_counts and nan and not exact_nan
        assert torch.equal(combined, exact)


def _adapter_ops_in_low_latency(rank, world):  # type: ignore[no-untyped-def]
    """The aten ops the adapter runs around DeepEP's calls (the fake's own, a CPU emulation, are not recorded), and
    the ``do_cpu_sync`` it passed."""
    from torch.utils._python_dispatch import _disable_current_modes

    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic
    from moe_dispatch_testing.host_reads import RecordedOps

    synced = []
    real = deep_ep_elastic.ElasticBuffer.dispatch, deep_ep_elastic.ElasticBuffer.combine

    def dispatch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        synced.append(kwargs.get("do_cpu_sync"))
        with _disable_current_modes():
            return real[0](self, *args, **kwargs)

    def combine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        with _disable_current_modes():
            return real[1](self, *args, **kwargs)

    d = md.create_dispatcher(DeepEPV2Backend(vendor_module=EMULATOR), _spec(mode="low_latency", output_dtype="fp8"),
                             env={}, check_inputs=False)
    x, ids, w = _routing(rank, 8, 8, 2)
    x = x.repeat(1, 2)
    deep_ep_elastic.ElasticBuffer.dispatch, deep_ep_elastic.ElasticBuffer.combine = dispatch, combine
    try:
        with RecordedOps() as seen:
            out = d.dispatch(x, ids, w)
            d.combine(torch.ones(out.hidden_states.shape, dtype=torch.bfloat16), out)
    finally:
        deep_ep_elastic.ElasticBuffer.dispatch, deep_ep_elastic.ElasticBuffer.combine = real
    return synced, seen.ops, seen.host_reads()


def test_low_latency_makes_no_host_sync_around_deepep(moe_rank_pools):
    """The adapter's own ops in low-latency mode (the FP8 cast, the routing copies, the group list, the weighting)
    read no data on the host, and DeepEP is asked not to wait for the counts: what CUDA-graph capture needs."""
    for synced, ops, host_reads in moe_rank_pools.get(2).map(_adapter_ops_in_low_latency):
        assert synced == [False]
        assert ops and not host_reads, host_reads


# -- the independent audit of 2026-12-02 (VENDOR.md) -------------------------------------------------------------


def _fake():  # type: ignore[no-untyped-def]
    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep

    return deep_ep


def _outcome(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
        return "made"
    except md.MoEDispatchError as exc:
        return type(exc).__name__, exc.parameter


def _replacement_while_read(rank, world):  # type: ignore[no-untyped-def]
    """A larger layer after the group's buffer may still be read: captured calls, a dispatch awaiting its combine, a
    started call awaiting wait(); each refused while it holds, allowed once it is gone (or within a reservation)."""
    import warnings

    fake = _fake()
    x, ids, w = _routing(rank, 8, 8, 2)
    x = x.repeat(1, 2)
    bigger, biggest = _spec(num_max_dispatch_tokens_per_rank=1024), _spec(num_max_dispatch_tokens_per_rank=4096)
    out = {}
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    small = md.create_dispatcher(backend, _spec(mode="low_latency"), env={})
    shared = backend._buffers._by_group[id(torch.distributed.group.WORLD)]
    pending = small.dispatch(x, ids, w)  # not combined yet
    out["awaiting combine"] = _outcome(lambda: md.create_dispatcher(backend, bigger, env={}))
    small.combine(pending.hidden_states, pending)
    started = small.dispatch_start(x, ids, w)
    out["started"] = _outcome(lambda: md.create_dispatcher(backend, bigger, env={}))
    del started  # dropped unwaited: its objects go with it
    out["after both"] = _outcome(lambda: md.create_dispatcher(backend, bigger, env={}))
    grown = shared.buffer
    layer = md.create_dispatcher(backend, _spec(mode="low_latency", num_max_dispatch_tokens_per_rank=1024), env={})
    first = layer.dispatch(x, ids, w)
    layer.combine(first.hidden_states, first)  # warm-up, eagerly
    with fake.CUDAGraph().capture():
        o = layer.dispatch(x, ids, w)
        layer.combine(o.hidden_states, o)
    out["after capture"] = _outcome(lambda: md.create_dispatcher(backend, biggest, env={}))
    out["same buffer"] = shared.buffer is grown and not grown._destroyed
    out["smaller"] = _outcome(lambda: md.create_dispatcher(backend, _spec(), env={}))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        backend.close()
    out["close warns"] = any("CUDA graphs captured" in str(m.message) for m in seen)
    # A reservation on the first layer: later, larger layers fit, captured or not.
    reserving = DeepEPV2Backend(vendor_module=EMULATOR)
    want = vendor.ported_elastic_buffer_sizes(world, 4096, 512, 2, allow_hybrid_mode=False).total
    first = md.create_dispatcher(reserving, _spec(mode="low_latency"), env={}, options={"buffer_bytes": want - 1})
    with fake.CUDAGraph().capture():
        o = first.dispatch(x, ids, w)
        first.combine(o.hidden_states, o)
    out["reserved"] = _outcome(lambda: md.create_dispatcher(reserving, biggest, env={}))
    out["reserved bytes"] = reserving._buffers._by_group[id(torch.distributed.group.WORLD)].buffer.num_bytes == want
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reserving.close()
    return out


def test_a_larger_layer_never_destroys_a_buffer_that_may_still_be_read(moe_rank_pools):
    """Audit finding 1 (CRASH): replacing the group's ElasticBuffer destroys it, which deregisters its NCCL window and
    frees its memory (csrc/elastic/buffer.hpp:152-166; nccl.cu:155-163). After a capture (a replay reads that window),
    with a dispatch awaiting its combine or a started call its wait(), a larger layer is a CapacityError naming the
    reservation, as V1's Buffer refuses; ``options["buffer_bytes"]`` on the first layer sizes it for every layer."""
    refused = ("CapacityError", "options.buffer_bytes")
    for out in moe_rank_pools.get(2).map(_replacement_while_read):
        assert out["awaiting combine"] == refused and out["started"] == refused and out["after both"] == "made"
        assert out["after capture"] == refused and out["same buffer"] and out["smaller"] == "made"
        assert out["close warns"]
        assert out["reserved"] == "made" and out["reserved bytes"]


def test_a_bad_buffer_bytes_option_is_refused():
    from moe_dispatch_cuda_deepep.elastic import _buffer_bytes_option

    for bad in (-1, 1.5, "1", True):
        with pytest.raises(md.InvalidSpecError) as err:
            _buffer_bytes_option({"buffer_bytes": bad})
        assert err.value.parameter == "options.buffer_bytes"
    assert _buffer_bytes_option({"buffer_bytes": 1}) == vendor.V2_BUFFER_ALIGNMENT  # the constructor's 2 MiB rule
    assert _buffer_bytes_option({}) == 0


def _num_sms_at_creation(rank, world):  # type: ignore[no-untyped-def]
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    past = _outcome(lambda: md.create_dispatcher(backend, _spec(), env={},
                                                 options={"num_sms": vendor.H100_NUM_SMS + 2}))
    odd = md.create_dispatcher(backend, _spec(), env={}, options={"num_sms": 3})
    error = _round_trip(odd, rank)
    backend.close()
    return past, error


def test_num_sms_is_bounded_by_the_device_at_creation_and_may_be_odd(moe_rank_pools):
    """Audit finding 2: DeepEP asserts ``num_sms <= get_num_sms()`` at the first dispatch (buffer.hpp:979), so a
    count past the device's is refused at creation; an odd one launches with a cluster of 1 (dispatch.hpp:226)."""
    for past, error in moe_rank_pools.get(2).map(_num_sms_at_creation):
        assert past == ("InvalidSpecError", "options.num_sms")
        assert error < 1e-2


def _pcie_elastic(rank, world):  # type: ignore[no-untyped-def]
    fake = _fake()
    saved, fake.EMULATED_DEVICE_NAME = fake.EMULATED_DEVICE_NAME, "NVIDIA A100-PCIE-40GB"
    try:
        return outcome_of(lambda: _fake_buffer() and "made")[:1]
    finally:
        fake.EMULATED_DEVICE_NAME = saved


def test_v2_refuses_more_than_two_ranks_on_pcie_gpus(moe_rank_pools):
    """Audit finding 3: ``ElasticBuffer.__init__`` runs ``check_nvlink_connections`` (deep_ep/buffers/elastic.py:320),
    an AssertionError past 2 ranks on a "PCIE" GPU: the fake asserts it, ``check_spec`` refuses it (V1's rule)."""
    assert moe_rank_pools.get(4).map(_pcie_elastic) == [("AssertionError",)] * 4
    fake = _fake()
    saved, fake.EMULATED_DEVICE_NAME = fake.EMULATED_DEVICE_NAME, "NVIDIA A100-PCIE-40GB"
    try:
        with pytest.raises(md.InvalidSpecError) as err:
            DeepEPV2Backend(vendor_module=EMULATOR).check_spec(_spec(), 4)
        assert err.value.parameter == "world_size"
        DeepEPV2Backend(vendor_module=EMULATOR).check_spec(_spec(), 2)
    finally:
        fake.EMULATED_DEVICE_NAME = saved


def test_the_runners_alignment_is_checked_at_creation():
    """Audit finding 4: the DeepGEMM runner takes aligned PACKED rows only at a multiple of its mk alignment (128
    without DeepGEMM installed: ``DeepGemmExperts._aligned``); both backends refuse another at ``check_spec``."""
    from moe_dispatch_cuda_deepep.backend import DeepEPBackend

    for backend, mode in ((DeepEPV2Backend(vendor_module=EMULATOR), "normal"),
                          (DeepEPV2Backend(vendor_module=EMULATOR), "low_latency"),
                          (DeepEPBackend(EMULATOR), "normal")):
        spec = _spec(mode=mode, num_experts=16, top_k=8, hidden_size=2048, runner="deep_gemm", expert_alignment=64)
        with pytest.raises(md.InvalidSpecError) as err:
            backend.check_spec(spec, 2)
        assert err.value.parameter == "expert_alignment" and "128" in err.value.allowed
        for fine in ({"expert_alignment": 128}, {"expert_alignment": 1}, {"expert_alignment": 64, "runner": None}):
            backend.check_spec(_spec(mode=mode, num_experts=16, top_k=8, hidden_size=2048,
                                     **{"runner": "deep_gemm", **fine}), 2)


def test_the_probe_names_a_gpu_deepep_2_does_not_target():
    """Audit finding 5: DeepEP 2.x targets SM90 and SM100 (README.md:64; device_runtime.hpp:49-57)."""
    fake = _fake()
    saved = fake.EMULATED_DEVICE_CAPABILITY
    try:
        fake.EMULATED_DEVICE_CAPABILITY = (8, 0)
        why = DeepEPV2Backend(vendor_module=EMULATOR).probe()
        assert why is not None and "8.0" in why and "SM90" in why
        fake.EMULATED_DEVICE_CAPABILITY = (10, 0)
        assert DeepEPV2Backend(vendor_module=EMULATOR).probe() is None
    finally:
        fake.EMULATED_DEVICE_CAPABILITY = saved


def _gin_disabled(rank, world, domain):  # type: ignore[no-untyped-def]
    import os

    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic

    deep_ep_elastic.EMULATED_NVLINK_DOMAIN = domain
    os.environ[vendor.EP_DISABLE_GIN] = "1"
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    try:
        return _outcome(lambda: _round_trip(md.create_dispatcher(backend, _spec(), env={}), rank))
    finally:
        del os.environ[vendor.EP_DISABLE_GIN]
        deep_ep_elastic.EMULATED_NVLINK_DOMAIN = deep_ep_elastic.NVLINK_DOMAIN
        backend.close()


def test_ep_disable_gin_over_several_nvlink_domains_is_refused(moe_rank_pools):
    """Audit finding 6: with EP_DISABLE_GIN the device communicator has no GIN contexts (nccl.cu:86-97), which the
    direct kernels need across NVLink domains (the fake traps at the first dispatch): refused at creation, from
    DeepEP's own ``get_physical_domain_size``; within one domain it runs."""
    pool = moe_rank_pools.get(4)
    assert pool.map(_gin_disabled, 2) == [("InvalidSpecError", vendor.EP_DISABLE_GIN)] * 4
    assert pool.map(_gin_disabled, 8) == ["made"] * 4


def _cpu_only_group(rank, world):  # type: ignore[no-untyped-def]
    import dataclasses

    import moe_dispatch.backend as mdb

    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    d = md.create_dispatcher(backend, _spec(), env={})
    cpu_only = torch.distributed.new_group(list(range(world)), backend="cpu:gloo")
    ctx = dataclasses.replace(d._impl.ctx, device=torch.device("cuda"), comm=mdb.Comm(cpu_only))
    try:
        backend.create(ctx)
        refused = None
    except Exception as exc:  # noqa: BLE001 - the type is what the test compares
        refused = type(exc).__name__, getattr(exc, "parameter", None)
    backend.close()
    return refused


def _device_backends(rank, world):  # type: ignore[no-untyped-def]
    cpu_only = torch.distributed.new_group(list(range(world)), backend="cpu:gloo")
    return (vendor.group_backend_problem(cpu_only, torch.device("cuda")),
            vendor.group_backend_problem(torch.distributed.group.WORLD, torch.device("cuda")))  # gloo: cpu and cuda


def test_a_group_without_a_backend_for_the_device_is_refused_typed(moe_rank_pools):
    """Audit finding 7: DeepEP takes ``group._get_backend(torch.device('cuda'))`` (deep_ep/utils/comm.py:61), and the
    adapter's first collective runs on the device: a group with no backend for it (``backend="cpu:gloo"``) is a
    typed error before either, not torch's RuntimeError. A plain gloo group has a CUDA backend (DeepEP then makes
    its own NCCL communicator, comm.py:66-75): taken."""
    pool = moe_rank_pools.get(2)
    assert pool.map(_cpu_only_group) == [("InvalidSpecError", "group")] * 2
    for problem, both in pool.map(_device_backends):
        assert problem is not None and "No backend type associated with device type cuda" in problem
        assert both is None


def _written_by_the_constructor(rank, world):  # type: ignore[no-untyped-def]
    import os

    from moe_dispatch_cuda_deepep_testing.fakes import deep_ep_elastic

    seen = []
    real_init = deep_ep_elastic.ElasticBuffer.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_init(self, *args, **kwargs)
        seen.append(os.environ.get(vendor.NCCL_SYM_REUSE_SYSMEM_HANDLES))

    os.environ[vendor.NCCL_GIN_CROSS_NIC] = "0"
    deep_ep_elastic.ElasticBuffer.__init__ = init
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    try:
        md.create_dispatcher(backend, _spec(), env={})
        after = os.environ.get(vendor.NCCL_SYM_REUSE_SYSMEM_HANDLES, "unset")
    finally:
        deep_ep_elastic.ElasticBuffer.__init__ = real_init
        del os.environ[vendor.NCCL_GIN_CROSS_NIC]
        os.environ.pop(vendor.NCCL_SYM_REUSE_SYSMEM_HANDLES, None)
        backend.close()
    return seen, after


def test_what_the_elastic_constructor_writes_is_put_back(moe_rank_pools):
    """Audit finding 8: with NCCL_GIN_CROSS_NIC=0 the constructor sets NCCL_SYM_REUSE_SYSMEM_HANDLES=1
    (deep_ep/buffers/elastic.py:279-282); the adapter restores it afterwards, as it does V1's NVSHMEM writes."""
    for seen, after in moe_rank_pools.get(2).map(_written_by_the_constructor):
        assert seen == ["1"] and after == "unset"
    assert vendor.NCCL_SYM_REUSE_SYSMEM_HANDLES in vendor.V2_WRITTEN


def _replacement_refused_on_one_rank(rank: int, world: int) -> object:
    x, ids, w = _routing(rank, 8, 8, 2)
    x = x.repeat(1, 2)
    backend = DeepEPV2Backend(vendor_module=EMULATOR)
    small = md.create_dispatcher(backend, _spec(mode="low_latency"), env={})
    kept = small.dispatch(x, ids, w)
    if rank == 1:
        del kept  # dropped on rank 1 only: only rank 0 would refuse to destroy the buffer
    outcome = _outcome(lambda: md.create_dispatcher(backend, _spec(num_max_dispatch_tokens_per_rank=1024), env={}))
    backend.close()
    return outcome


def test_ranks_refuse_a_buffer_replacement_together(moe_rank_pools):
    """The refusal is max-reduced over the group before DeepEP's collective destroy(): a rank that may still read the
    buffer does not leave the others waiting in its barrier (a second audit's finding)."""
    assert moe_rank_pools.get(2).map(_replacement_refused_on_one_rank) == [("CapacityError", "options.buffer_bytes")] * 2
