"""Windows bounded from above: DeepEP-Ascend's kernels keep window offsets and sizes in 32 bits, so
past a size they wrap onto other areas of the window. What creation refuses, and where the fakes
wrap as the kernels do ("(fake)": silent corruption on the device).

The expected numbers are derived here from the kernels' arithmetic, not from the plugin's functions:
the normal dispatch keeps ``dataState·(W/2) + min(T, 8192)·k·ceil512(2H)`` in a uint32 (A2's op halves
``W − 8 MB``), so the largest safe ops' window is ``(2³² − c − 1) >> 19`` MB (A2: + 8)."""

from __future__ import annotations

import dataclasses

import pytest

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep_testing import FAKE, ascend_backend
from moe_dispatch_ascend_deepep_testing.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep_testing.support import LAYERED, MiB, make_spec, on_a2, on_a3

HCCL, DEEPEP = "HCCL_BUFFSIZE", "DEEPEP_HCCL_BUFFSIZE"


# -- A2 beyond 8 ranks, normal mode: the notify op's and the combine's offsets ----------------------------------


def test_the_a2_internode_group_window_is_at_most_4495_mb():
    """notify_dispatch_a2.h: ``uint32_t notifyMemoryOffset = winSize − 2·200 MB``: from 4496 MB it wraps into the
    dispatch/combine's 0..804 MB, so 4496..5299 MB are refused too (below the combine's own bound)."""
    for window in ("4496", "5299"):
        with pytest.raises(md.InvalidSpecError) as info:
            on_a2({**LAYERED, HCCL: window}).check_window(make_spec(), 16, {}, {})
        assert info.value.parameter == HCCL and info.value.allowed == "1219..4495"
    on_a2({**LAYERED, HCCL: "4495"}).check_window(make_spec(), 16, {}, {})
    with pytest.raises(md.InvalidSpecError) as info:  # the group's own hccl_buffer_size
        on_a2({**LAYERED, HCCL: "2048"}).check_window(make_spec(), 16, {"hccl_buffer_size": 4496}, {})
    assert info.value.parameter == "hccl_buffer_size"


def test_the_a2_internode_combine_ipc_size_wraps_from_5300_mb():
    """MoeDistributeCombineA2 keeps IPC_DATA_SIZE = winSize − 1204 MiB in a uint32: from 5300 MB it wraps.
    The notify op's uint32 offset wraps earlier, from 4496 MB, which is the bound."""
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2({**LAYERED, HCCL: "5400"}).check_window(make_spec(), 16, {}, {})
    assert info.value.parameter == v.HCCL_BUFFSIZE and info.value.allowed == "1219..4495"
    assert v.A2_INTERNODE_COMBINE_MAX_WINDOW_MB == 5299 > v.A2_INTERNODE_MAX_WINDOW_MB


def test_the_fake_notify_area_wraps_from_4496_mb():
    with pytest.raises(RuntimeError, match=r"\(fake\).*notifyMemoryOffset"):
        fake.a2_internode_notify_kernel(16, 4496 * MiB)
    fake.a2_internode_notify_kernel(16, 4495 * MiB)


# -- A2 low latency: the layered kernels' IPC area, the multi-server kernels' halves ----------------------------


def test_the_a2_layered_low_latency_group_window_is_at_most_4896_mb():
    """moe_distribute_dispatch_v2_layered.h ``uint32_t totalSize_ = winSize``; combine_v2_layered.h
    ``uint32_t IPC_DATA_SIZE = winSize − 804 MB`` and ``dstRankId·ipcSliceSize + 4 MB`` in uint32: the IPC area
    and its offset fit below 4 GiB up to 4896 MB; beyond, they wrap."""
    ll = make_spec("low_latency")
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2({**LAYERED, HCCL: "4897"}).check_window(ll, 16, {}, {})
    assert info.value.parameter == HCCL and info.value.allowed.endswith("..4896")
    on_a2({**LAYERED, HCCL: "4896"}).check_window(ll, 16, {}, {})
    with pytest.raises(md.InvalidSpecError) as info:  # a group option is not even capped at 65535
        on_a2({**LAYERED, HCCL: "2048"}).check_window(ll, 16, {"hccl_buffer_size": 100000}, {})
    assert info.value.parameter == "hccl_buffer_size"
    on_a3({**LAYERED, HCCL: "6000"}).check_window(ll, 16, {}, {})  # the layered kernels are A2's


def test_the_fake_layered_ipc_size_wraps_above_4896_mb():
    with pytest.raises(RuntimeError, match=r"\(fake\)"):
        fake.a2_layered_ipc_layout(5000 * MiB, 16, 8)
    fake.a2_layered_ipc_layout(4896 * MiB, 16, 8)


def test_the_a2_multi_server_low_latency_halves_are_uint32():
    """ops2 moe_distribute_dispatch_v2.h ``uint32_t totalSize_ = winSize / 2``, moe_distribute_combine_v2.h
    ``uint32_t halfWinSize_ = winSize / 2`` (A2 beyond 8 ranks, not layered): from 8192 MB they wrap."""
    ll = make_spec("low_latency")
    with pytest.raises(md.InvalidSpecError) as info:
        on_a2({HCCL: "8192"}).check_window(ll, 16, {}, {})
    assert info.value.parameter == HCCL and info.value.allowed.endswith("..8191")
    on_a2({HCCL: "8191"}).check_window(ll, 16, {}, {})
    on_a3({HCCL: "8192"}).check_window(ll, 16, {}, {})
    on_a2({HCCL: "8192"}).check_window(make_spec("low_latency", experts=64), 8, {}, {})  # one node: uint64 offsets


def test_the_fake_a2_multi_server_low_latency_halves_wrap():
    with pytest.raises(RuntimeError, match=r"\(fake\)"):
        fake.a2_ll_half_window(8192 * MiB)
    fake.a2_ll_half_window(8191 * MiB)


# -- the normal dispatch op: its state-1 data offset ------------------------------------------------------------


def test_the_normal_ops_window_is_capped_where_the_half_offset_wraps():
    """cam_moe_dispatch_normal.h ``uint32_t winDataSizeOffset = dataState·(totalWinSize/2) + min(realMaxBs, 8192)
    ·k·ceil512(2H)``; ops2 halves ``totalWinSize − 4·2 MB``. T=8192, k=8, H=7168: c = 896 MiB, so the A3 op's
    window must stay below (4096 − 896)·2 = 6400 MB, A2's (one node) below 6408 MB."""
    spec = make_spec(tokens=8192, experts=16)
    with pytest.raises(md.InvalidSpecError) as info:
        on_a3({HCCL: "6400"}).check_window(spec, 2, {}, {})
    assert info.value.parameter == HCCL and info.value.allowed == "3860..6399"
    on_a3({HCCL: "6399"}).check_window(spec, 2, {}, {})
    with pytest.raises(md.InvalidSpecError) as info:  # DEEPEP_HCCL_BUFFSIZE is the window the kernel halves
        on_a3({HCCL: "8000", DEEPEP: "6400"}).check_window(spec, 2, {}, {})
    assert info.value.parameter == DEEPEP and info.value.allowed == "3860..6399"
    with pytest.raises(md.InvalidSpecError) as info:
        ascend_backend(FAKE, env={HCCL: "6408"}, soc="A2").check_window(spec, 2, {}, {})
    assert info.value.allowed == "4480..6407"
    ascend_backend(FAKE, env={HCCL: "6407"}, soc="A2").check_window(spec, 2, {}, {})
    with pytest.raises(md.InvalidSpecError) as info:  # creation with an unnamed chip: A3's (the smaller) bound
        AscendDeepEPBackend(env={HCCL: "6400"}).check_window(spec, 2, {}, {})
    assert info.value.allowed == "4480..6399"


def _largest_tokens(top_k: int, hidden: int, chips: tuple[str, ...], ceiling_chip: str) -> int:
    def c512(n: int) -> int:
        return -(-n // 512) * 512

    def need(t: int, chip: str) -> int:
        row = c512(2 * hidden) + c512(-(-2 * hidden // 32) * 32 + 44)
        fixed, extra = (106, 0) if chip == "A3" else (412, 8)
        return -(-((t * top_k * row + fixed * MiB) * 2 + extra * MiB) // MiB)

    def ceiling(t: int) -> int:
        return (((1 << 32) - t * top_k * c512(2 * hidden) - 1) >> 19) + (8 if ceiling_chip == "A2" else 0)

    return max(t for t in range(1, 8193) if max(need(t, c) for c in chips) <= ceiling(t))


def test_a_spec_no_ops_window_fits_is_refused_with_the_largest_tokens():
    """T=8192, k=16, H=7168 needs 7508 MB on A3 but the offset wraps from 4608 MB: no window works."""
    spec = make_spec(tokens=8192, experts=16, top_k=16)
    cases = [(on_a3({}), _largest_tokens(16, 7168, ("A3",), "A3")),
             (ascend_backend(FAKE, env={}, soc="A2"), _largest_tokens(16, 7168, ("A3", "A2"), "A2")),
             (AscendDeepEPBackend(env={}), _largest_tokens(16, 7168, ("A3", "A2"), "A3"))]  # planning, no chip
    assert [t for _, t in cases] == [6008, 5547, 5541]
    for backend, most in cases:
        with pytest.raises(md.CapacityError) as info:
            backend.check_spec(spec, 2)
        assert info.value.parameter == "num_max_dispatch_tokens_per_rank" and info.value.allowed == f"1..{most}"
        backend.check_spec(dataclasses.replace(spec, num_max_dispatch_tokens_per_rank=most), 2)


def fake_normal_half_offset(rank: int, world: int, window: str, buffers: int = 1) -> list[str]:
    """Two normal dispatches, by turns on ``buffers`` Buffers of the default group."""
    import torch
    import torch.distributed as dist

    results = []
    with restored_environ({HCCL: window}):
        made = [fake.Buffer(dist.group.WORLD) for _ in range(buffers)]  # HCCL allocates the group this window
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(8, 1024, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
        w = torch.rand(8, 2, generator=g)
        for call in range(2):  # the kernel flips its window half (dataState) each call
            buffer = made[call % buffers]
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
            try:
                buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w, num_worst_tokens=8192)
                results.append("ok")
            except RuntimeError as exc:
                results.append(str(exc))
    return results


def _wrapped(results: list[str]) -> list[bool]:
    for r in results:
        assert r == "ok" or ("(fake)" in r and "winDataSizeOffset" in r), r
    return [r != "ok" for r in results]


@pytest.mark.parametrize("buffers", [1, 2])
def test_the_fake_normal_dispatch_wraps_its_half_offset(moe_rank_pools, buffers):
    """real_max_bs = num_worst_tokens = 8192, k = 2, H = 1024: c = 32 MiB; W = 8128 MB puts the state-1 data at
    4064 + 32 MiB = 2³²: in the uint32 it lands on the first half. The state lives in the group's window, so
    of two calls exactly one is in state 1, whichever Buffer of the group makes it, and
    whatever state earlier work in the process left."""
    pool = moe_rank_pools.get(2)
    assert pool.map(fake_normal_half_offset, "8127", buffers) == [["ok", "ok"]] * 2
    for results in pool.map(fake_normal_half_offset, "8128", buffers):
        assert sorted(_wrapped(results)) == [False, True], results


def fake_low_latency_shares_the_state_word(rank: int, world: int) -> list[str]:
    """On a new group (fresh window state): normal, low latency (another Buffer of the group), normal, normal at
    W = 8128 MB."""
    import torch
    import torch.distributed as dist

    results = []
    with restored_environ({HCCL: "8128"}):
        group = dist.new_group(list(range(world)))
        buffer, ll_buffer = fake.Buffer(group), fake.Buffer(group, low_latency_mode=True)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(8, 1024, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
        w = torch.rand(8, 2, generator=g)
        for step in ("normal", "low_latency", "normal", "normal"):
            try:
                if step == "low_latency":
                    ll_buffer.low_latency_dispatch(x, ids, 8, 4, use_fp8=False)
                else:
                    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
                    buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w,
                                    num_worst_tokens=8192)
                results.append("ok")
            except RuntimeError as exc:
                results.append(str(exc))
        dist.destroy_process_group(group)
    return results


def test_the_fake_low_latency_dispatch_flips_the_same_state_word_on_a3(moe_rank_pools):
    """On A3 MoeDistributeDispatchV2 flips the word at ``localWindowsExp + 950 KB`` the
    normal op keeps ``dataState`` in (KN@f425bdf ops/op_kernel/moe_distribute_dispatch_v2.h ``STATE_WIN_OFFSET``,
    ``InitWinState``), so after one low-latency dispatch the next normal one runs in state 0 again."""
    for results in moe_rank_pools.get(2).map(fake_low_latency_shares_the_state_word):
        assert _wrapped(results) == [False, False, False, True], results
