"""DeepEP's low-latency signalling counts on a shared Buffer: where they sit (half i of E at ``align_up(4E, 128)·i``,
placed by E only since 42253d0), what dirties them (internode normal-mode kernels, LL kernels of another E; not
intranode normal mode, not another T), and the cleans the adapter makes for them (``buffers.SharedBuffer``), on the
fake that models them byte by byte.

Past 8 ranks the fakes cannot run normal mode: the fake Buffer's ``emulate_internode_normal_kernels`` writes what
those kernels write, and ``SharedBuffer.after_normal`` is called as a combine there calls it.
"""


import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR
from moe_dispatch_cuda_deepep_testing.fakes import _native
from moe_dispatch_cuda_deepep_testing.support import (
    H,
    batch,
    dispatch_and_combine,
    fake_module,
    ll_spec,
    normal_spec,
    outcome_of,
    short_outcome,
    world_group,
)

# -- where the counts sit -------------------------------------------------------------------------------------


def _fake_signalling(rank, world):
    fake = fake_module()
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 256)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(world_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=256)
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
        smaller_on_half_1 = outcome_of(lambda: dispatch(128) and "clean")  # E's half 1 = [512, 1024): E''s counts
    finally:
        _native.reset_context()
    return after_a_round, short_outcome(smaller_on_half_1), "stale" in str(smaller_on_half_1)


def test_the_fake_signalling_follows_deepeps_layout(moe_rank_pools):
    """Half i of E's signalling counts sits at ``align_up(4E, 128)·i`` (DeepEP@dd758ca csrc/legacy/config.hpp
    LowLatencyLayout): after an LL kernel of E' = 256 on half 0 (its counts written there), E = 128's half 1 ``[512,
    1024)`` lies inside E''s half 0, and DeepEP reads stale counts; after whole rounds both are clean."""
    assert moe_rank_pools.get(1).map(_fake_signalling) == [(("clean", "clean"), ("RuntimeError", None), True)]


def test_signalling_halves_and_the_docs():
    """Half i of E's counts at ``align_up(4E, 128)·i``: E_max = 272 leaves bytes 1088..1152 of E = 256's half 1 outside
    both of its halves, so no one clean covers every E, and the docs do not say it does."""
    import pathlib

    assert vendor.ll_signalling_halves(256) == ((0, 1024), (1024, 2048))
    assert vendor.ll_signalling_halves(272) == ((0, 1088), (1152, 2240))
    assert vendor.ll_data_offset(32) == 256 and vendor.ll_signalling_halves(40)[1] == (256, 416)
    root = pathlib.Path(__file__).parents[1]
    for doc in ("README.md", "VENDOR.md", "src/moe_dispatch_cuda_deepep/buffers.py",
                "testing/src/moe_dispatch_cuda_deepep_testing/fakes/deep_ep.py"):
        text = (root / doc).read_text()
        for wrong in ("the largest E covers all", "counts at offset 0", "for the largest E on it", "of a smaller E"):
            assert wrong not in text, (doc, wrong)


# -- what dirties them, and the cleans -------------------------------------------------------------------------


def _normal_then_low_latency(rank, world, clean_first=False):
    fake = fake_module()
    spec_n = md.DispatchSpec(H, 4 * world, 2, output_dtype="bf16")
    spec_l = md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency",
                             output_dtype="bf16")
    backend = DeepEPBackend(EMULATOR)
    nvl, _ = backend.nvl_rdma_bytes(spec_n, world)
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            shared = fake.Buffer(torch.distributed.group.WORLD, nvl,
                                 vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world),
                                 low_latency_mode=True, num_qps_per_rank=4)
            normal = md.create_dispatcher(backend, spec_n, env={}, options={"buffer": shared})
            low = md.create_dispatcher(backend, spec_l, env={}, options={"buffer": shared})
        x = torch.randn(4, H).to(torch.bfloat16)
        ids, w = torch.tensor([[0, 4]] * 4), torch.ones(4, 2)
        for d in (low, normal, low):
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        return "ok"
    except RuntimeError as exc:
        return str(exc)
    finally:
        _native.reset_context()


def test_low_latency_after_intranode_normal_mode_on_a_shared_buffer_runs(moe_rank_pools):
    """DeepEP's LL kernels read stale signalling counts after normal-mode kernels on the Buffer unless
    ``clean_low_latency_buffer`` runs first (legacy.py docstring); only internode normal-mode kernels write them, so
    within 8 ranks LL, normal, LL on one handed-in Buffer runs with no clean (past 8 ranks:
    ``test_internode_normal_mode_cleans_eagerly_for_replays``)."""
    assert moe_rank_pools.get(2).map(_normal_then_low_latency) == ["ok", "ok"]


def _what_dirties(rank, world):
    fake = fake_module()
    cfg = fake.Buffer.get_dispatch_config(world)
    nvl = cfg.get_nvl_buffer_size_hint(2 * H, world)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 40 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(world_group(), nvl, rdma, low_latency_mode=True, num_qps_per_rank=40)
    x, w = torch.zeros(2, H, dtype=torch.bfloat16), torch.ones(2, 2)
    ids = torch.tensor([[0, 1]] * 2)

    def ll(tokens, experts):
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, tokens, experts, use_fp8=False)
        buf.low_latency_combine(recv, ids, w, handle)

    ll(8, 4 * world)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 4 * world)
    _, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w, config=cfg)
    try:
        intranode_normal = outcome_of(lambda: ll(8, 4 * world) or "clean")
        other_t = outcome_of(lambda: ll(4, 4 * world) or "clean")  # same E, another T: the counts did not move
        # A larger E whose counts lie where E = 4R's kernels wrote data (from 2·align_up(16R, 128); round three).
        larger_e = outcome_of(lambda: ll(8, 40 * world) or "clean")
    finally:
        _native.reset_context()
    return intranode_normal, other_t, "stale" in larger_e[2]


def _adapter_cleans(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    ll, normal = ll_spec(world), normal_spec(world)
    nvl, _ = backend.nvl_rdma_bytes(normal, world)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        mine = fake.Buffer(world_group(), nvl, rdma, low_latency_mode=True, num_qps_per_rank=4)
        options = {"buffer": mine, "buffer_num_qps_per_rank": 4}
        low = md.create_dispatcher(backend, ll, env={}, options=options)
        normal_d = md.create_dispatcher(backend, normal, env={}, options=options)
    dispatch_and_combine(low)  # an adopted Buffer's history is unknown: one clean first
    first = sum(c.method == "clean_low_latency_buffer" for c in mine.calls)
    for d in (normal_d, low, normal_d, low):
        dispatch_and_combine(d)
    backend.close()
    return first, sum(c.method == "clean_low_latency_buffer" for c in mine.calls) - first


def test_only_internode_normal_mode_and_another_expert_count_dirty_the_signalling(moe_rank_pools):
    """The counts sit at the start of the RDMA region and move with E only (since 42253d0); intranode normal kernels use
    the NVL region. So on the fake an LL call after intranode normal mode, or with another T, finds them clean, one of a
    larger E finds stale counts where E = 4R's kernels wrote data, and the adapter makes only the one clean an adopted
    Buffer needs (each clean is two NVSHMEM barriers)."""
    pool = moe_rank_pools.get(2)
    for intranode_normal, other_t, larger_e_stale in pool.map(_what_dirties):
        assert intranode_normal == "clean" and other_t == "clean" and larger_e_stale
    assert pool.map(_adapter_cleans) == [(1, 0), (1, 0)]


def _internode_normal_between_replays(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        low = md.create_dispatcher(backend, ll_spec(world), env={})
    dispatch_and_combine(low)
    graph = fake.CUDAGraph()
    with graph.capture():
        dispatch_and_combine(low)
    shared = low.backend_dispatcher.shared
    shared.internode = True  # as on a group past 8 ranks, whose normal-mode kernels write the RDMA region
    shared.buffer.emulate_internode_normal_kernels()
    shared.after_normal()  # the end of a normal-mode combine on the Buffer (eager: normal mode is never captured)
    graph.replay()
    cleans = sum(c.method == "clean_low_latency_buffer" for c in shared.buffer.calls)
    return cleans


def test_internode_normal_mode_cleans_eagerly_for_replays(moe_rank_pools):
    """Past 8 ranks normal-mode kernels on the LL Buffer (sglang's auto mode) leave its signalling counts stale, and a
    replayed decode graph has no clean in it: the adapter cleans right after each normal-mode combine on such a Buffer,
    so the next LL kernel, eager or replayed, finds them clean."""
    assert moe_rank_pools.get(1).map(_internode_normal_between_replays) == [1]


def _two_expert_counts_after_internode_normal(rank, world):
    backend = DeepEPBackend(EMULATOR)
    large, small = ll_spec(world, experts_per_rank=40), ll_spec(world, experts_per_rank=32)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        a = md.create_dispatcher(backend, large, env={})
        b = md.create_dispatcher(backend, small, env={})
    try:
        dispatch_and_combine(a)
        b.dispatch(*batch(b))  # a dispatch whose combine never ran (an aborted step): DeepEP's buffer index is 1
        shared = a.backend_dispatcher.shared
        shared.internode = True  # as past 8 ranks, where normal-mode kernels write the RDMA region
        shared.buffer.emulate_internode_normal_kernels()
        shared.after_normal()  # the end of a normal-mode combine on the Buffer
        outcome = outcome_of(lambda: dispatch_and_combine(b) is not None and "clean")
        return short_outcome(outcome), "stale" in str(outcome)
    finally:
        _native.reset_context()
        backend.close()


def test_after_internode_normal_mode_every_expert_count_is_cleaned(moe_rank_pools):
    """After an internode normal-mode combine every E on the Buffer is cleaned, not only the largest: E_max = 40 zeroes
    [0, 160) and [256, 416), and E = 32's half 1 is [128, 256), so [160, 256) would stay stale."""
    assert moe_rank_pools.get(1).map(_two_expert_counts_after_internode_normal) == [("clean", False)]
