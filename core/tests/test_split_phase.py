"""The split-phase calls of the contract: ``Pending``, the core's fallback and refusals, the
reference backends' slots while a transfer is in flight, failures between start and wait, and the
default value checks that make no host sync on an accelerator."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch._checks import runs_value_checks
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch._reference.exchange import ReferenceDispatcher
from moe_dispatch._reference.receiver import Receiver
from moe_dispatch._reference.slots import SlotPool
from moe_dispatch_testing import on_a_fresh_pool, outcome
from moe_dispatch_testing.routing import random_routing

H, E, K, T = 256, 8, 2, 16


def _spec(mode: str = "normal") -> md.DispatchSpec:
    return md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode=mode, output_dtype="fp8")


def _inputs(seed: int, rank: int = 0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, E, K, generator=g)
    return x, ids, w


def _rows(out: md.DispatchOutput) -> torch.Tensor:
    return torch.ones(out.hidden_states.shape, dtype=torch.bfloat16)


# -- Pending -------------------------------------------------------------------------------------------------------


def test_pending_finishes_once_and_keeps_its_result_or_its_error():
    calls = []
    p = md.Pending(lambda: calls.append(1) or len(calls))
    assert not p.done and p.overlapped
    assert p.wait() == 1 and p.wait() == 1 and calls == [1] and p.done

    def boom() -> int:
        raise md.CommunicationError("peer gone")

    failed = md.Pending(boom)
    for _ in range(2):
        with pytest.raises(md.CommunicationError, match="peer gone"):
            failed.wait()
    done = md.Pending.completed("x")
    assert done.wait() == "x" and not done.overlapped


# -- the core around a backend ------------------------------------------------------------------------------------


class _SyncOnly(TorchBackend):
    """The torch backend without its split-phase declaration: what a vendor without one looks like."""

    name = "torch-sync-only"
    capabilities = mdb.Capabilities(dtypes=TorchBackend.capabilities.dtypes)


class _DeclaresWithoutMethods(TorchBackend):
    name = "torch-declares-split"

    def create(self, ctx: mdb.DispatchContext) -> mdb.BackendDispatcher:
        inner = ReferenceDispatcher(ctx, send_to_all_ranks=False)

        class Plain:  # dispatch and combine only
            dispatch, combine = inner.dispatch, inner.combine

        return Plain()


def test_without_a_split_phase_the_core_runs_each_call_at_start():
    d = md.create_dispatcher(_SyncOnly(), _spec(), env={})
    assert not d.split_phase
    started = d.dispatch_start(*_inputs(1))
    assert not started.overlapped and started.done  # ran to its end already
    out = started.wait()
    combined = d.combine_start(_rows(out), out)
    assert not combined.overlapped and combined.wait().shape == (T, H)


def test_a_backend_that_runs_one_call_whole_says_so_through_the_core(monkeypatch):
    """A split-phase backend may run a started call to its end (DeepEP under capture, or under
    EP_AVOID_RECORD_STREAM): its Pending's ``overlapped`` False reaches the engine."""
    d = md.create_dispatcher(TorchBackend(), _spec(), env={})
    impl = d.backend_dispatcher
    start = impl.dispatch_start
    monkeypatch.setattr(impl, "dispatch_start", lambda *a: md.Pending(start(*a).wait, overlapped=False))
    started = d.dispatch_start(*_inputs(1))
    assert d.split_phase and not started.overlapped
    assert started.wait().hidden_states.shape[1] == H


def test_the_tensors_a_call_hands_out_are_its_outputs_own():
    """``streams.tensors_of``: what a wait() on another stream records there (the rows, scales, routing and
    group list of a DispatchOutput; a combined tensor), never the backend's handle; off CUDA no stream."""
    from moe_dispatch._streams import tensors_of
    from moe_dispatch.backend import hand_over, handed_over, keep_on_current, start_mark

    d = md.create_dispatcher(TorchBackend(), _spec(), env={})
    out = d.dispatch(*_inputs(1))
    handed = tensors_of(out)
    for t in (out.hidden_states, out.hidden_states_scale, out.topk_ids, out.topk_weights, out.group_list):
        assert any(t is h for h in handed)
    assert not any(h is out.handle for h in handed)
    y = torch.zeros(2, 2)
    assert tensors_of(y) == [y] and tensors_of(None) == [] and start_mark(y) is None
    finish = lambda: y  # noqa: E731
    assert handed_over(finish, None) is finish
    hand_over(None, [y])  # off CUDA: nothing to order or record
    keep_on_current([y, None])


def test_a_declared_split_phase_without_the_methods_is_a_plugin_error():
    d = md.create_dispatcher(_DeclaresWithoutMethods(), _spec(), env={})
    with pytest.raises(md.PluginError, match="dispatch_start/combine_start"):
        d.dispatch_start(*_inputs(1))


def test_bad_input_is_refused_at_start_before_anything_is_sent():
    d = md.create_dispatcher("torch", _spec(), env={})
    x, ids, w = _inputs(1)
    ids[0, 0] = E
    before = d.traffic.copy()
    with pytest.raises(md.InvalidInputError) as err:
        d.dispatch_start(x, ids, w)
    assert err.value.parameter == "topk_ids" and d.traffic.to_dict() == before.to_dict()


# -- slots while a transfer is in flight ---------------------------------------------------------------------------


class _InFlight:
    def __init__(self) -> None:
        self.done = False


def test_a_slot_stays_held_while_its_transfer_is_in_flight_even_if_everything_else_is_dropped():
    pool = SlotPool()
    transfer = _InFlight()
    lease = pool.acquire()
    pool.keep_until_done(lease, transfer)
    del lease  # the engine dropped the Pending and the output
    gc.collect()
    assert not pool.slots[0].free
    assert pool.acquire().slot is not pool.slots[0]  # a second slot, never the one a transfer still writes
    transfer.done = True
    later = pool.acquire()  # prunes the finished transfer: its slot is free again
    assert pool.slots[0].free or later.slot is pool.slots[0]


def _dropped_pendings(rank: int, world: int, mode: str):
    d = md.create_dispatcher("torch", _spec(mode), env={})
    expected = d.combine(_rows(out := d.dispatch(*_inputs(1, rank))), out)
    for _ in range(3):
        d.dispatch_start(*_inputs(2, rank))  # started and dropped: its collective still completes
    pending = d.dispatch_start(*_inputs(1, rank))
    out = pending.wait()
    return bool(torch.equal(d.combine(_rows(out), out), expected)), len(d.backend_dispatcher.slots.slots)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_dropped_pendings_never_corrupt_a_later_call(moe_rank_pools, mode):
    for same, slots in moe_rank_pools.get(2).map(_dropped_pendings, mode):
        assert same
        assert slots <= 5


# -- the started calls on gloo: off the caller's thread and off its group ------------------------------------------


def _start_while_the_peer_is_late(rank: int, world: int, mode: str):
    d = md.create_dispatcher("torch", _spec(mode), env={}, timeout_s=30)
    before = d.traffic.copy()
    expected = d.combine(_rows(out := d.dispatch(*_inputs(1, rank))), out)
    blocking = (d.traffic - before).to_dict()
    d.comm.barrier()
    if rank == 1:
        time.sleep(1.0)  # rank 0 starts alone: its start must not wait for this rank's counts or rows
    t0 = time.monotonic()
    before = d.traffic.copy()
    pending = d.dispatch_start(*_inputs(1, rank))
    start_s = time.monotonic() - t0
    out = pending.wait()
    if rank == 1:
        time.sleep(1.0)  # late again: a combine start that checked the call with the peers would wait for it
    t0 = time.monotonic()
    pending = d.combine_start(_rows(out), out)
    combine_start_s = time.monotonic() - t0
    same = bool(torch.equal(pending.wait(), expected))
    return start_s, combine_start_s, same, (d.traffic - before).to_dict() == blocking


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_a_start_on_gloo_returns_before_the_peers_arrive(moe_rank_pools, mode):
    """The whole call runs on the receiver thread: a start holds the caller for none of its collectives (normal mode's
    counts exchange, the call check, combine's partial sums), so a late peer does not hold it either."""
    (start0, combine0, same0, counted0), (_, _, same1, counted1) = moe_rank_pools.get(2).map(
        _start_while_the_peer_is_late, mode)
    assert same0 and same1
    assert counted0 and counted1  # counted in the dispatcher's traffic as the blocking calls are
    assert start0 < 0.5 and combine0 < 0.5  # the peer comes 1 s later; a start that exchanged anything would wait


def _engine_collectives_between_start_and_wait(rank: int, world: int, mode: str):
    import torch.distributed as dist

    d = md.create_dispatcher("torch", _spec(mode), env={}, timeout_s=30)
    expected = d.combine(_rows(out := d.dispatch(*_inputs(1, rank))), out)
    pending = d.dispatch_start(*_inputs(1, rank))
    sums = []
    for i in range(20):  # the engine's own collectives on the same (default) group while the call is on its way
        t = torch.full((1000 + 37 * i,), float(rank + i))
        dist.all_reduce(t)
        sums.append(float(t[0]))
    out = pending.wait()
    got = d.combine_start(_rows(out), out)
    dist.all_reduce(t)
    return sums == [float(2 * i + 1) for i in range(20)], bool(torch.equal(got.wait(), expected))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_the_engines_collectives_between_start_and_wait_do_not_mix_with_the_call(moe_rank_pools, mode):
    """The receiver thread issues the started calls' collectives on a group of their own: were they on the engine's
    group, gloo would pair them with the engine's all-reduces in whatever order the two threads reached it."""
    assert moe_rank_pools.get(2).map(_engine_collectives_between_start_and_wait, mode) == [(True, True)] * 2


def _threads_on_two_groups_start_in_opposite_orders(rank: int, world: int):
    import threading

    import torch.distributed as dist

    groups = [dist.new_group(list(range(world))) for _ in range(2)]  # same ranks, two groups, made in program order
    dispatchers = [md.create_dispatcher("torch", _spec(), group=g, env={}, timeout_s=20) for g in groups]
    expected = [d.combine(_rows(out := d.dispatch(*_inputs(1, rank))), out) for d in dispatchers]
    got: dict[int, bool] = {}

    def engine_thread(i: int) -> None:  # rank 0 starts on group 0 first, rank 1 on group 1 first
        time.sleep(0.0 if i == rank else 0.3)
        d = dispatchers[i]
        out = d.dispatch_start(*_inputs(1, rank)).wait()
        got[i] = bool(torch.equal(d.combine_start(_rows(out), out).wait(), expected[i]))

    t0 = time.monotonic()
    threads = [threading.Thread(target=engine_thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got == {0: True, 1: True}, time.monotonic() - t0


def test_threads_on_their_own_groups_start_in_any_order_across_ranks():
    """Each group's started calls have a receiver thread of their own: on one thread per process, rank 0 would queue
    group 0's start before group 1's and rank 1 the reverse, each waiting for the other until the timeout."""
    for same, seconds in on_a_fresh_pool(_threads_on_two_groups_start_in_opposite_orders):
        assert same and seconds < 10


def test_the_receiver_runs_a_receive_before_the_starts_queued_ahead_of_it():
    """The engine waits for its oldest call first: that call's receive must not sit behind the next micro-batch's
    start (measured: the overlap bench's wait grew by a whole start)."""
    receiver = Receiver("test receiver")
    hold, ran = threading.Event(), []
    first = receiver.submit(lambda: hold.wait(10))
    later = [receiver.submit(lambda: ran.append("start B")), receiver.submit_receive(lambda: ran.append("receive A")),
             receiver.submit(lambda: ran.append("start C")), receiver.submit_receive(lambda: ran.append("receive B"))]
    hold.set()
    assert first.result(10)
    for future in later:
        future.result(10)
    assert ran == ["receive A", "receive B", "start B", "start C"]


def _started_on_a_subgroup_then_on_every_rank(rank: int, world: int):
    import torch.distributed as dist

    spec = md.DispatchSpec(H, 12, K, num_max_dispatch_tokens_per_rank=T, output_dtype="fp8")  # 12 over 2 and 3 ranks

    def inputs(seed: int):
        g = torch.Generator().manual_seed(100 * seed + rank)
        return (torch.randn(T, H, generator=g).to(torch.bfloat16), *random_routing(T, 12, K, generator=g))

    pair = dist.new_group([0, 1])  # every rank makes it (dist.new_group's rule); only 0 and 1 use it
    same = []
    if rank in (0, 1):
        d = md.create_dispatcher("torch", spec, group=pair, env={}, timeout_s=20)
        expected = d.combine(_rows(out := d.dispatch(*inputs(1))), out)
        out = d.dispatch_start(*inputs(1)).wait()
        same.append(bool(torch.equal(d.combine_start(_rows(out), out).wait(), expected)))
    d = md.create_dispatcher("torch", spec, env={}, timeout_s=20)  # every rank, after different histories
    expected = d.combine(_rows(out := d.dispatch(*inputs(2))), out)
    out = d.dispatch_start(*inputs(2)).wait()
    same.append(bool(torch.equal(d.combine_start(_rows(out), out).wait(), expected)))
    return same


def test_started_calls_on_a_subgroup_then_on_every_rank():
    """Ranks 0 and 1 make started calls on a group of the two, then all three on the default group. The started
    calls' own group is made on a group of every rank only: made on the pair by its members alone
    (``use_local_synchronization``), torch names a later group by the groups each process has made, which then differ
    between ranks, and the three ranks met under different names until the timeout."""
    assert on_a_fresh_pool(_started_on_a_subgroup_then_on_every_rank, world_size=3, timeout_s=60) == [
        [True, True], [True, True], [True]]


# -- failures between start and wait --------------------------------------------------------------------------------


def _bad_input_at_rank_1s_start(rank: int, world: int, mode: str):
    d = md.create_dispatcher("torch", _spec(mode), env={}, timeout_s=30)
    x, ids, w = _inputs(1, rank)
    if rank == 1:
        ids = ids.clone()
        ids[0, 0] = E
    start = time.monotonic()
    got = outcome(lambda: d.dispatch_start(x, ids, w).wait())
    return got.error, time.monotonic() - start


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_bad_input_on_one_rank_at_start_reaches_the_other(mode):
    (err0, waited), (err1, _) = on_a_fresh_pool(_bad_input_at_rank_1s_start, mode)
    assert err1 == "InvalidInputError"
    assert err0 == "PeerFailedError" and waited < 10


# -- the default value checks ------------------------------------------------------------------------------------


def test_default_value_checks_run_on_host_memory_and_not_on_an_accelerator():
    d = md.create_dispatcher("torch", _spec(), env={})
    assert d.check_inputs is None
    x, ids, w = _inputs(1)
    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(md.InvalidInputError):  # host memory: checked
        d.dispatch(x, bad, w)
    device_rows = torch.empty(1, H, device="meta")
    # an accelerator's tensors: no sync by default
    assert runs_value_checks(d.check_inputs, x) and not runs_value_checks(d.check_inputs, device_rows)
    d.check_inputs = True
    assert runs_value_checks(d.check_inputs, device_rows)
    d.check_inputs = False
    assert not runs_value_checks(d.check_inputs, x)


def _dispatchers_collected_after_split_calls(rank: int, world: int):
    import threading
    import weakref

    threads = threading.active_count()
    backends = []
    for _ in range(3):  # three layers: one receiver thread for the process, not one each
        d = md.create_dispatcher("torch", _spec("low_latency"), env={})
        out = d.dispatch_start(*_inputs(1, rank)).wait()
        d.combine_start(_rows(out), out).wait()
        backends.append(weakref.ref(d.backend_dispatcher))
        del d, out
    extra_threads = threading.active_count() - threads
    gc.collect()
    time.sleep(0.2)
    return all(b() is None for b in backends), extra_threads


def test_dispatchers_used_in_split_phase_are_collected_and_share_one_receiver_thread(moe_rank_pools):
    """The receiver thread holds nothing of a finished call (else a dispatcher and its slots stay alive: the overlap
    bench ran out of memory that way), and one thread serves every dispatcher of the process."""
    for collected, extra_threads in moe_rank_pools.get(2).map(_dispatchers_collected_after_split_calls):
        assert collected and extra_threads <= 1


def _under_inference_mode(rank: int, world: int, mode: str):
    d = md.create_dispatcher("torch", _spec(mode), env={})
    expected = d.combine(_rows(out := d.dispatch(*_inputs(1, rank))), out)
    with torch.inference_mode():  # how engines serve: tensors made here refuse in-place ops outside it
        out = d.dispatch_start(*_inputs(1, rank)).wait()
        got = d.combine_start(_rows(out), out).wait()
    return bool(torch.equal(got, expected))


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_split_phase_under_inference_mode(moe_rank_pools, mode):
    assert moe_rank_pools.get(2).map(_under_inference_mode, mode) == [True, True]


def _layout_fails_on_rank_1_after_a_dropped_start(rank: int, world: int):
    d = md.create_dispatcher("torch", _spec("normal"), env={}, timeout_s=30)
    impl = d.backend_dispatcher
    if rank == 1:  # a bug in the receiving half, on one rank
        def broken(*args):  # noqa: ANN002, ANN202
            raise RuntimeError("layout bug")
        impl._finish_packed = broken
    d.dispatch_start(*_inputs(1, rank))  # dropped: nobody waits for it, nobody sees its error there
    time.sleep(0.5)
    start = time.monotonic()
    nxt = outcome(lambda: d.dispatch(*_inputs(2, rank)))
    return nxt.error, time.monotonic() - start


def test_a_failure_on_the_receiver_is_not_lost_when_nobody_waits():
    (err0, waited0), (err1, _) = on_a_fresh_pool(_layout_fails_on_rank_1_after_a_dropped_start)
    assert err1 == "CommunicationError"  # rank 1 refuses its next call: the started one failed in the background
    assert err0 == "PeerFailedError" and waited0 < 10  # rank 0 was told, instead of waiting for a timeout


def _in_flight_differs(rank: int, world: int):
    return outcome(lambda: md.create_dispatcher("torch", _spec("low_latency"), env={}, timeout_s=30,
                                                in_flight=2 + rank)).error


def test_ranks_that_plan_different_in_flight_get_a_configuration_error():
    assert on_a_fresh_pool(_in_flight_differs) == ["ConfigMismatchError", "ConfigMismatchError"]
