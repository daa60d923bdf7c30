"""The process's DeepEP Buffers (``buffers.PROCESS_BUFFERS``): one with NVSHMEM per process, shared by every layer,
backend object and adopted Buffer; what a shared Buffer must hold for each layer (bytes, mode, QPs, group); the
options every rank must agree on; and their lifetime (``close()`` destroys them, their destructors run no
collective).

Past 8 ranks the fakes cannot run normal mode (a CPU pool of 16 ranks is too slow for this suite): those rules are
checked on the functions that decide them (``buffers.check_serves``), with the fake Buffer executing what they call.
"""

import os

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_cuda_deepep import buffers, vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR, selfcheck
from moe_dispatch_cuda_deepep_testing.support import (
    H,
    dispatch_and_combine,
    fake_module,
    ll_spec,
    normal_spec,
    outcome_of,
    short_outcome,
    world_group,
)

# -- one Buffer per process -----------------------------------------------------------------------------------


def _two_layers(rank, world, tokens_first, tokens_second, options_first=None):
    backend = DeepEPBackend(EMULATOR)
    specs = [md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=t, mode="low_latency",
                             output_dtype="bf16") for t in (tokens_first, tokens_second)]
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        first = md.create_dispatcher(backend, specs[0], env={}, options=options_first)
        try:
            second = md.create_dispatcher(backend, specs[1], env={})
        except md.MoEDispatchError as exc:
            backend.close()
            return type(exc).__name__, exc.parameter, str(exc)
    same = first.backend_dispatcher.buffer is second.backend_dispatcher.buffer
    x = torch.randn(4, H).to(torch.bfloat16)
    ids, w = torch.tensor([[0, 1]] * 4), torch.ones(4, 2)
    for d in (first, second, first):  # both layers, interleaved, on the one Buffer
        out = d.dispatch(x, ids, w)
        d.combine(out.hidden_states, out)
    backend.close()  # the Buffer is the process's: closed, the next call starts from none
    return same


def test_layers_share_the_process_buffer(moe_rank_pools):
    """Every layer uses the process's Buffer (one ``deep_ep.Buffer`` per dispatcher would start NVSHMEM per layer; past
    8 ranks a second LL Buffer fails DeepEP's team assert, and a collected one finalizes NVSHMEM under the others). A
    later, larger layer is a ``CapacityError`` that says how to pre-size, and ``options["buffer_bytes"]`` does."""
    pool = moe_rank_pools.get(2)
    assert pool.map(_two_layers, 8, 8) == [True, True]
    errors = pool.map(_two_layers, 8, 64)
    assert all(e[:2] == ("CapacityError", "options.buffer_bytes") and "largest layer first" in e[2] for e in errors)
    planned = vendor.ported_low_latency_rdma_size_hint(64, H, 2, 8)
    assert pool.map(_two_layers, 8, 64, {"buffer_bytes": planned}) == [True, True]


def _one_nvshmem_buffer(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    ll, normal = ll_spec(world), normal_spec(world)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    nvl, _ = backend.nvl_rdma_bytes(normal, world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        mine = fake.Buffer(world_group(), nvl, rdma, low_latency_mode=True, num_qps_per_rank=4)
        md.create_dispatcher(backend, normal, env={}, options={"buffer": mine, "buffer_num_qps_per_rank": 4})
        low = md.create_dispatcher(backend, ll, env={})  # no options: the process's NVSHMEM Buffer
        other_backend = md.create_dispatcher(DeepEPBackend(EMULATOR), ll, env={})
        same = low.backend_dispatcher.buffer is mine and other_backend.backend_dispatcher.buffer is mine
        inits = fake.NVSHMEM.live_inits
        second = fake.Buffer(world_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
        refused = outcome_of(lambda: md.create_dispatcher(backend, ll, env={}, options={
            "buffer": second, "buffer_num_qps_per_rank": 4}) and ("created", None, ""))
    dispatch_and_combine(low, copy=True)
    return same, inits, refused[:2], "one" in refused[2]


def test_one_nvshmem_buffer_per_process(moe_rank_pools):
    """NVSHMEM is per process: an LL layer beside an adopted LL Buffer, or through another backend object, uses that one
    Buffer (NVSHMEM started once), and a second NVSHMEM Buffer handed in is an ``InvalidSpecError`` naming
    ``options.buffer`` that says there is one."""
    for same, inits, refused, names_one in moe_rank_pools.get(2).map(_one_nvshmem_buffer):
        assert same and inits == 1
        assert refused == ("InvalidSpecError", "options.buffer") and names_one


def _rewrapped(rank, world):
    backend = DeepEPBackend(EMULATOR)
    ll, normal = ll_spec(world), normal_spec(world)
    nvl, _ = backend.nvl_rdma_bytes(normal, world)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        low = md.create_dispatcher(backend, ll, env={}, options={"buffer_bytes": (nvl, rdma)})
        normal_d = md.create_dispatcher(backend, normal, env={}, options={"buffer": low.backend_dispatcher.buffer})
    for d in (low, normal_d, low):
        dispatch_and_combine(d, copy=True)
    return normal_d.backend_dispatcher.shared is low.backend_dispatcher.shared


def test_a_buffer_handed_back_keeps_one_wrapper_and_one_clean_state(moe_rank_pools):
    """An owned Buffer passed back as ``options["buffer"]`` is the same registered Buffer, with one clean state (a
    second wrapper would let the normal layers mark only that one dirty past 8 ranks, and the LL layers skip the
    clean)."""
    assert moe_rank_pools.get(2).map(_rewrapped) == [True, True]


def _buffer_of_another_group(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    other = torch.distributed.new_group(list(range(world)))  # the same size, another group
    spec = ll_spec(world)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    options = {"buffer_num_qps_per_rank": 4}
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            mine = fake.Buffer(world_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
            adopted = outcome_of(lambda: md.create_dispatcher(backend, spec, other, env={},
                                                              options={**options, "buffer": mine}) and "created")
            own = md.create_dispatcher(backend, spec, env={}, options={**options, "buffer": mine})
            rewrapped = outcome_of(lambda: md.create_dispatcher(backend, spec, other, env={},
                                                                options={**options, "buffer": mine}) and "created")
        dispatch_and_combine(own, copy=True)
        return short_outcome(adopted), short_outcome(rewrapped)
    finally:
        backend.close()


def test_a_handed_in_buffer_must_be_on_the_layers_group(moe_rank_pools):
    """DeepEP routes by the ranks of the group a Buffer was made on (``Buffer.group``): a Buffer handed in, or its
    registered wrapper, on another group of the same size is an ``InvalidSpecError`` naming ``options.buffer``."""
    refused = ("InvalidSpecError", "options.buffer")
    assert moe_rank_pools.get(1).map(_buffer_of_another_group) == [(refused, refused)]


def _disagree(rank, world):
    backend = DeepEPBackend(EMULATOR)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        return outcome_of(lambda: md.create_dispatcher(backend, ll_spec(world), env={}, options={
            "buffer_bytes": rdma + 128 * rank}) and "created")[:2]


def test_ranks_agree_on_the_buffer_options(moe_rank_pools):
    """Options decide whether and how DeepEP's collective constructor runs (NVSHMEM's symmetric allocation): ranks that
    differ would hang there or allocate different sizes. They are part of the creation agreement: a
    ``ConfigMismatchError`` naming the buffer."""
    got = moe_rank_pools.get(2).map(_disagree)
    assert all(g[0] == "ConfigMismatchError" and "buffer" in (g[1] or "") for g in got), got


# -- what a shared Buffer must hold ---------------------------------------------------------------------------


def test_what_a_shared_buffer_must_hold_past_8_ranks():
    """Internode normal mode asserts both buffers below INT_MAX (an LL Buffer may hold more) and QPs per peer ==
    channels or >= SMs; LL kernels need QPs >= local experts. Adopted and reused Buffers are checked as created ones
    are; the fake's internode checks assert the same."""
    normal = md.DispatchSpec(7168, 16 * 8, 8, output_dtype="bf16")
    backend = DeepEPBackend(EMULATOR)
    need = backend.buffer_request(normal, 16)
    big_ll = buffers.BufferRequest(need.num_nvl_bytes, 2**31, True, 64)
    with pytest.raises(md.CapacityError) as info:
        buffers.check_serves(big_ll, 16, need, normal, parameter="options.buffer")
    assert info.value.parameter == "options.buffer" and "INT_MAX" in str(info.value)
    few_qps = buffers.BufferRequest(need.num_nvl_bytes, need.num_rdma_bytes, True, 16)  # sglang's LL-only E/R
    with pytest.raises(md.InvalidSpecError) as info:
        buffers.check_serves(few_qps, 16, need, normal, parameter="options.buffer")
    assert "num_rc_per_pe" in str(info.value)
    buffers.check_serves(buffers.BufferRequest(need.num_nvl_bytes, need.num_rdma_bytes, True, 24), 16, need, normal,
                         parameter="options.buffer")
    fake = fake_module()
    fields = vendor.ConfigFields(20, 6, 288, 12, 128)
    with pytest.raises(RuntimeError, match="num_rdma_bytes < std::numeric_limits<int>::max"):
        fake.internode_dispatch_checks(16, 24, fields, 7168 * 2, 0, 8, num_rdma_bytes=2**31)
    with pytest.raises(RuntimeError, match="num_rdma_bytes < std::numeric_limits<int>::max"):
        fake.internode_combine_checks(16, fields, 7168, 8, num_rdma_bytes=2**31)


def _adopted_qps(rank, world, option):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        mine = fake.Buffer(world_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=1)  # 1 QP, 4 local experts
    options = {"buffer": mine} if option is None else {"buffer": mine, "buffer_num_qps_per_rank": option}

    def create_and_run():
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            os.environ.pop(vendor.NVSHMEM_IBGDA_NUM_RC_PER_PE, None)  # what DeepEP wrote for it is gone
            d = md.create_dispatcher(backend, ll_spec(world), env={}, options=options)
        dispatch_and_combine(d, copy=True)
        return "ran"

    try:
        return outcome_of(create_and_run)[:2]
    finally:
        backend.close()


def test_an_adopted_buffers_qps_are_checked(moe_rank_pools):
    """Too few QPs per peer for the LL kernels is a device trap: an adopted Buffer's QPs come from
    ``options["buffer_num_qps_per_rank"]`` (or the ``NVSHMEM_IBGDA_NUM_RC_PER_PE`` DeepEP wrote for it), and too few, or
    unknown, is an ``InvalidSpecError`` naming ``options.buffer_num_qps_per_rank``."""
    pool = moe_rank_pools.get(2)
    assert pool.map(_adopted_qps, 1) == [("InvalidSpecError", "options.buffer_num_qps_per_rank")] * 2
    assert pool.map(_adopted_qps, None) == [("InvalidSpecError", "options.buffer_num_qps_per_rank")] * 2


def test_one_buffer_serves_both_modes_past_8_ranks():
    """Past 8 ranks both modes need one LL-mode Buffer (NVSHMEM starts once per process): ``run_on_gpu.py`` creates its
    low-latency layer first with ``DeepEPBackend.both_modes_options``, which size and QP it for the normal layers too.
    Normal mode there asserts both regions below INT_MAX (internode notify), so a 3.8 GB LL region (32 experts per rank
    on 16 ranks, the script's first choice) is refused up front, and the script picks the experts per rank that fit
    (``selfcheck.fitting_experts_per_rank``)."""
    backend = DeepEPBackend(EMULATOR)
    shape = dict(hidden=7168, top_k=8, tokens=128)  # run_on_gpu.py's defaults on 16 ranks
    with pytest.raises(md.CapacityError) as info:
        backend.both_modes_options(selfcheck.layer_spec(16, "normal", "bf16", experts_per_rank=32, **shape),
                                   selfcheck.layer_spec(16, "low_latency", "bf16", experts_per_rank=32, **shape), 16)
    assert "INT_MAX" in str(info.value)
    per_rank = selfcheck.fitting_experts_per_rank(backend, 16, **shape)
    assert per_rank == 16 and selfcheck.fitting_experts_per_rank(backend, 8, **shape) == 32
    ll = selfcheck.layer_spec(16, "low_latency", "bf16", experts_per_rank=per_rank, **shape)
    options = backend.both_modes_options(selfcheck.layer_spec(16, "normal", "bf16", experts_per_rank=per_rank,
                                                              **shape), ll, 16)
    backend.check_options(ll, 16, options)
    held = buffers.planned_request(backend.buffer_request(ll, 16), options, 16)
    assert held.low_latency_mode and held.num_qps_per_rank == 24  # max(16 local experts, 24 QPs for 20 SMs)
    for mode, dtype in (("low_latency", "fp8"), ("normal", "bf16"), ("normal", "fp8")):
        spec = selfcheck.layer_spec(16, mode, dtype, experts_per_rank=per_rank, **shape)
        buffers.check_serves(held, 16, backend.buffer_request(spec, 16), spec, parameter="options.buffer_bytes")


# -- lifetime ------------------------------------------------------------------------------------------------


def _close(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        low = md.create_dispatcher(backend, ll_spec(world), env={})
        normal = md.create_dispatcher(backend, normal_spec(world), env={})
    made = [low.backend_dispatcher.buffer, normal.backend_dispatcher.buffer]
    explicit = [b.explicitly_destroy for b in made]
    dispatch_and_combine(low, copy=True), dispatch_and_combine(normal, copy=True)
    backend.close()
    after = outcome_of(lambda: dispatch_and_combine(low, copy=True))[:2]
    return explicit, [b.runtime is None for b in made], fake.NVSHMEM.live, after, list(fake.DESTRUCTOR_TEARDOWNS)


def test_buffers_are_destroyed_by_close_not_by_their_destructors(moe_rank_pools):
    """Buffers live as long as the process; with ``explicitly_destroy=False`` their destructor would run DeepEP's
    collective teardown at exit, where a dead peer makes the survivors hang. The adapter creates them with
    ``explicitly_destroy=True`` and ``DeepEPBackend.close()`` (collective) destroys them: NVSHMEM finalized, no
    destructor teardown, the dispatchers then refused."""
    for explicit, destroyed, live, after, teardowns in moe_rank_pools.get(2).map(_close):
        assert explicit == [True, True] and destroyed == [True, True] and live is None
        assert after == ("BackendUnavailableError", "dispatcher") and teardowns == []
