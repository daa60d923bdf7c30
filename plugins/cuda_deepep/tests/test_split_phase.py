"""DeepEP in split phase (``dispatch_start``/``combine_start``), on the fake.

Low-latency mode starts with ``return_recv_hook=True`` and receives in ``wait()``; DeepEP lets one LL call per
Buffer await its receive (``vendor.LL_CALLS_AWAITING_RECEIVE``), so every call on the shared Buffer first runs the
receive still awaited, from whichever layer it is. Normal mode runs DeepEP's kernels on its comm stream
(``async_finish`` with ``previous_event``). The fake is as strict as DeepEP here: nothing of a hook-mode call (data,
counts, the handle combine needs) is there before its hook, a receive whose signalling a later LL call overwrote
loses the context, and a second hook adds the counts again.
"""

from __future__ import annotations

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR, EMULATOR_NVFP4
from moe_dispatch_cuda_deepep_testing.fakes._native import check_context
from moe_dispatch_testing import ScaledIdentityExperts, ScaledLayer, on_a_fresh_pool, outcome
from moe_dispatch_testing.routing import random_routing

H, TOKENS, TOP_K, PER_RANK = 2048, 8, 3, 4


def _dispatcher(world: int, mode: str, dtype: str = "bf16", per_rank: int = PER_RANK) -> md.Dispatcher:
    quant = md.QuantHints(input_global_scale=nvfp4_global_scale(8.0)) if dtype == "nvfp4" else md.QuantHints()
    spec = md.DispatchSpec(H, per_rank * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, mode=mode,
                           output_dtype=dtype, quant=quant)
    return md.create_dispatcher(DeepEPBackend(EMULATOR_NVFP4 if dtype == "nvfp4" else EMULATOR), spec, env={})


def _inputs(rank: int, num_experts: int, seed: int = 0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g)
    return x, ids, w


def _rows(out: md.DispatchOutput) -> torch.Tensor:
    """Scaled-identity experts (any wire dtype): rows that depend on what arrived."""
    layer = ScaledLayer.for_rank(H, out.group_list.numel() * 2, 0, out.group_list.numel())
    return ScaledIdentityExperts().apply_without_routing_weights(
        layer, out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16,
        global_scale=out.global_scale)


def _vendor_buffer(d: md.Dispatcher):
    return d.backend_dispatcher.buffer


# -- the fake, as strict as DeepEP -------------------------------------------------------------------------------------


def _raw_hook_calls(rank: int, world: int, case: str):
    d = _dispatcher(world, "low_latency")
    buf = _vendor_buffer(d)
    x, ids, w = _inputs(rank, d.spec.num_experts)
    ids = ids.to(torch.int64)
    _, plain_count, _, _, none_hook = buf.low_latency_dispatch(x, ids, TOKENS, d.spec.num_experts,
                                                                                use_fp8=False)
    recv_x, count, handle, _, hook = buf.low_latency_dispatch(x, ids, TOKENS, d.spec.num_experts, use_fp8=False,
                                                              return_recv_hook=True)

    def state() -> tuple[bool, bool]:  # the counts DeepEP's are; the layout's per-expert counts add up to them
        return (bool(torch.equal(count, plain_count)),
                bool(torch.equal((handle[1] & 0xFFFFFFFF).sum(1).to(torch.int32), plain_count)))

    before = state()
    if case == "overwritten":  # a second LL call before the first one's hook: its send zeroes what the first waits on
        buf.low_latency_dispatch(x, ids, TOKENS, d.spec.num_experts, use_fp8=False, return_recv_hook=True)
        try:
            hook()
        except RuntimeError as exc:
            return ("lost", str(exc))
        return ("received", "")
    hook()
    after = state()
    if case == "twice":
        hook()
        return ("twice", bool(torch.equal(count, 2 * plain_count)))
    return ("once", none_hook is None, before, after)


def test_the_fake_receives_only_at_the_hook(moe_rank_pools):
    """Counts and the handle's layout are DeepEP's only after the hook (before it: garbage, not the values); the hook
    is None without ``return_recv_hook``."""
    for _, no_hook, before, after in moe_rank_pools.get(2).map(_raw_hook_calls, "once"):
        assert no_hook
        assert before == (False, False) and after == (True, True)


def test_the_fake_adds_the_counts_again_at_a_second_hook(moe_rank_pools):
    for kind, doubled in moe_rank_pools.get(2).map(_raw_hook_calls, "twice"):
        assert kind == "twice" and doubled


def _overwritten_in_a_fresh_process(rank: int, world: int):
    result = _raw_hook_calls(rank, world, "overwritten")
    try:
        check_context()
        alive = True
    except RuntimeError:
        alive = False
    return result, alive


def test_the_fake_loses_the_context_when_a_later_call_overwrites_a_pending_receive():
    from moe_dispatch_testing import on_a_fresh_pool

    for (kind, message), alive in on_a_fresh_pool(_overwritten_in_a_fresh_process):
        assert kind == "lost" and "one LL call per Buffer may await its receive" in message
        assert not alive


# -- the adapter ---------------------------------------------------------------------------------------------------


def _two_layers_interleaved(rank: int, world: int, dtype: str):
    """Two LL layers on the process's one Buffer, micro-batches interleaved across them: each start settles the
    receive the other layer's start left awaited (else the fake loses the context); results equal blocking calls."""
    a, b = _dispatcher(world, "low_latency", dtype), _dispatcher(world, "low_latency", dtype)
    assert _vendor_buffer(a) is _vendor_buffer(b)
    xa, xb = _inputs(rank, a.spec.num_experts, 1), _inputs(rank, b.spec.num_experts, 2)
    alone = []
    for d, x in ((a, xa), (b, xb)):
        out = d.dispatch(*x)
        alone.append(d.combine(_rows(out), out))
    pa, pb = a.dispatch_start(*xa), b.dispatch_start(*xb)
    awaiting = _vendor_buffer(a)._pending_receive is not None
    oa = pa.wait()
    ca = a.combine_start(_rows(oa), oa)
    ob = pb.wait()
    cb = b.combine_start(_rows(ob), ob)
    got = [ca.wait(), cb.wait()]
    return awaiting, [bool(torch.equal(x, y)) for x, y in zip(alone, got)], _vendor_buffer(a)._pending_receive is None


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_layers_sharing_the_buffer_interleave_their_micro_batches(dtype):
    for awaiting, same, settled in on_a_fresh_pool(_two_layers_interleaved, dtype):
        assert awaiting, "dispatch_start did not leave its receive to wait() (no return_recv_hook)"
        assert same == [True, True]
        assert settled


def _dropped_pending(rank: int, world: int):
    d = _dispatcher(world, "low_latency")
    x, ids, w = _inputs(rank, d.spec.num_experts)
    d.dispatch_start(x, ids, w)  # dropped without wait(): its receive still runs, at the next call
    out = d.dispatch(x, ids, w)
    return bool(torch.isfinite(d.combine(_rows(out), out).float()).all())


def test_a_dropped_pending_is_received_by_the_next_call(moe_rank_pools):
    assert moe_rank_pools.get(2).map(_dropped_pending) == [True, True]


def _normal_kwargs(rank: int, world: int):
    d = _dispatcher(world, "normal")
    buf = _vendor_buffer(d)
    seen: list[tuple[str, bool, bool, bool]] = []
    for name in ("dispatch", "combine"):
        method = getattr(buf, name)

        def spy(*args, _method=method, _name=name, **kwargs):  # forwards to the fake: records what the adapter asked
            seen.append((_name, kwargs.get("previous_event") is not None, bool(kwargs.get("async_finish")),
                         bool(kwargs.get("allocate_on_comm_stream"))))
            return _method(*args, **kwargs)

        setattr(buf, name, spy)
    x, ids, w = _inputs(rank, d.spec.num_experts)
    out = d.dispatch_start(x, ids, w).wait()
    d.combine_start(_rows(out), out).wait()
    out = d.dispatch(x, ids, w)
    d.combine(_rows(out), out)
    return seen


def test_normal_mode_starts_on_the_comm_stream(moe_rank_pools):
    for seen in moe_rank_pools.get(2).map(_normal_kwargs):
        assert seen == [("dispatch", True, True, True), ("combine", True, True, True),
                        ("dispatch", False, False, False), ("combine", False, False, False)]


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_split_phase_is_declared_for_both_modes(mode):
    assert md.Mode.parse(mode) in DeepEPBackend(EMULATOR).capabilities.split_phase


# -- receives awaited across layers, captures and close() ----------------------------------------------------------


def _capture_with_a_receive_awaited(rank: int, world: int):
    """An eager dispatch_start, then a capture: the awaited hook would be captured into the graph."""
    import importlib

    fake = importlib.import_module(EMULATOR)
    d = _dispatcher(world, "low_latency")
    x, ids, w = _inputs(rank, d.spec.num_experts)
    warm = d.dispatch(x, ids, w)
    d.combine(_rows(warm), warm)
    pending = d.dispatch_start(x, ids, w)
    graph = fake.CUDAGraph()
    with graph.capture():
        refused = outcome(lambda: d.dispatch(x, ids, w))
    out = pending.wait()  # received eagerly, after the capture (the refusal, like the other capture refusals, ends
    return refused.error, refused.attrs.get("parameter"), bool(out.expert_counts().sum() > 0)  # the dispatcher)


def test_a_capture_with_a_receive_awaited_is_refused():
    for error, parameter, received in on_a_fresh_pool(_capture_with_a_receive_awaited):
        assert (error, parameter) == ("InvalidSpecError", "cuda_graph_capture")
        assert received


def _new_layer_while_a_receive_is_awaited(rank: int, world: int):
    """Creating an LL layer of another E cleans the Buffer (both signalling halves): it must receive the
    awaited call first (else that receive spins until the trap: the fake loses the context)."""
    d = _dispatcher(world, "low_latency", per_rank=8)  # the largest layer first: it sizes the process's Buffer
    x, ids, w = _inputs(rank, d.spec.num_experts)
    pending = d.dispatch_start(x, ids, w)
    _dispatcher(world, "low_latency", per_rank=2)  # another E on the same Buffer: a clean at creation
    out = pending.wait()
    return bool(torch.isfinite(d.combine(_rows(out), out).float()).all())


def test_a_new_layer_receives_the_awaited_call_before_its_clean():
    assert on_a_fresh_pool(_new_layer_while_a_receive_is_awaited) == [True, True]


def _close_with_a_receive_awaited(rank: int, world: int):
    """close() receives the awaited call while the Buffer lives; a call after close() is the typed
    refusal, not a stale hook."""
    backend = DeepEPBackend(EMULATOR)
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, mode="low_latency",
                           output_dtype="bf16")
    d = md.create_dispatcher(backend, spec, env={})
    x, ids, w = _inputs(rank, d.spec.num_experts)
    pending = d.dispatch_start(x, ids, w)
    backend.close()
    after = outcome(lambda: d.dispatch(x, ids, w))
    return pending.done, after.error


def test_close_receives_the_awaited_call_and_later_calls_are_refused():
    for waited_by_close, error in on_a_fresh_pool(_close_with_a_receive_awaited):
        assert not waited_by_close  # the engine never waited; close ran the hook itself without raising
        assert error == "BackendUnavailableError"


def _combine_hook_reads_the_routing_late(rank: int, world: int):
    """The fake's combine receive reads topk_idx/topk_weights when the hook runs (internode_ll.cu receive phase)."""
    d = _dispatcher(world, "low_latency")
    buf = _vendor_buffer(d)
    x, ids, w = _inputs(rank, d.spec.num_experts)
    ids = ids.to(torch.int64)
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, ids, TOKENS, d.spec.num_experts, use_fp8=False)
    rows = recv_x.contiguous()
    plain, _, _ = buf.low_latency_combine(rows, ids, w, handle)
    weights = w.clone()
    late, _, hook = buf.low_latency_combine(rows, ids, weights, handle, return_recv_hook=True)
    weights.mul_(2)  # changed after the call, before the hook
    hook()
    return bool(torch.equal(late.float(), (plain.float() * 2).to(torch.bfloat16).float()))


def test_the_fake_combine_reads_the_routing_when_the_hook_runs(moe_rank_pools):
    assert moe_rank_pools.get(2).map(_combine_hook_reads_the_routing_late) == [True, True]


def _normal_outputs_before_the_event(rank: int, world: int):
    """The fake's async normal dispatch: outputs are garbage until current_stream_wait (DeepEP writes them on its comm
    stream)."""
    d = _dispatcher(world, "normal")
    buf = _vendor_buffer(d)
    x, ids, w = _inputs(rank, d.spec.num_experts)
    ids = ids.to(torch.int64)
    layout = buf.get_dispatch_layout(ids, d.spec.num_experts)
    kwargs = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                  topk_idx=ids, topk_weights=w)
    plain = buf.dispatch(x, **kwargs)[0]
    recv, _, _, _, _, event = buf.dispatch(x, previous_event=buf.capture(), async_finish=True,
                                           allocate_on_comm_stream=True, **kwargs)
    before = bool(torch.equal(recv, plain))
    event.current_stream_wait()
    return before, bool(torch.equal(recv, plain))


def test_the_fake_fills_async_normal_outputs_at_the_event(moe_rank_pools):
    assert moe_rank_pools.get(2).map(_normal_outputs_before_the_event) == [(False, True), (False, True)]


def _normal_input_written_before_wait(rank: int, world: int):
    """Normal mode's data kernel reads the inputs on DeepEP's comm stream after the start returns (legacy
    buffer.hpp:638-695): the fake refuses a write into them before the wait."""
    d = _dispatcher(world, "normal")
    x, ids, w = _inputs(rank, d.spec.num_experts)
    pending = d.dispatch_start(x, ids, w)
    x.zero_()
    try:
        pending.wait()
    except RuntimeError as exc:  # DeepEP would race, not raise
        return str(exc)
    return None


def test_a_normal_mode_input_written_before_wait_is_refused_by_the_fake(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(_normal_input_written_before_wait):
        assert message is not None and "x was written between the async call" in message, message
