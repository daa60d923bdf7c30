"""The reference backends keep their buffers per dispatcher: nothing large is allocated per
call once the slots have grown, a slot serves one dispatch at a time, and an output dropped without its
combine gives its slot back."""

from __future__ import annotations

import gc

import pytest
import torch

import moe_dispatch as md
from moe_dispatch._reference.slots import SlotPool
from moe_dispatch_testing.routing import random_routing

H, E, K, T = 256, 8, 2, 16


def _dispatcher(mode: str, compact: bool = True) -> md.Dispatcher:
    d = md.create_dispatcher("torch", md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T, mode=mode,
                                                      output_dtype="fp8"), env={})
    d.backend_dispatcher.host_paths = compact  # False: the static path of accelerators
    return d


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, E, K, generator=g)
    return x, ids, w


def _round(d: md.Dispatcher, seed: int) -> torch.Tensor:
    out = d.dispatch(*_inputs(seed))
    return d.combine(torch.ones(out.hidden_states.shape, dtype=torch.bfloat16), out)


def test_alternating_calls_reuse_one_slot_and_allocate_nothing_new():
    for mode in ("normal", "low_latency"):
        d = _dispatcher(mode)
        pool: SlotPool = d.backend_dispatcher.slots
        _round(d, 0)
        held = {name: buf.data_ptr() for name, buf in pool.slots[0].buffers.items()}
        for seed in range(1, 6):
            _round(d, seed)
        assert len(pool.slots) == (2 if mode == "low_latency" else 1), mode  # low latency: in_flight planned
        assert {name: buf.data_ptr() for name, buf in pool.slots[0].buffers.items()} == held, mode


def test_outputs_in_flight_take_their_own_slots_and_a_dropped_one_is_given_back():
    d = _dispatcher("normal")
    pool: SlotPool = d.backend_dispatcher.slots
    first, second = d.dispatch(*_inputs(1)), d.dispatch(*_inputs(2))
    assert len(pool.slots) == 2 and not any(s.free for s in pool.slots)
    del first  # an engine that drops an output without its combine
    gc.collect()
    assert sum(s.free for s in pool.slots) == 1
    d.combine(torch.ones(second.hidden_states.shape, dtype=torch.bfloat16), second)
    _round(d, 3)
    assert len(pool.slots) == 2  # the freed slots served the later calls


def test_a_lease_ended_late_does_not_free_a_later_dispatchs_slot():
    pool = SlotPool()
    first = pool.acquire()
    first.release()  # its combine
    second = pool.acquire()  # the same slot, a new hold
    assert second.slot is first.slot and second.current and not first.current
    del first  # the first output's handle is collected only now
    gc.collect()
    assert not second.slot.free


@pytest.mark.parametrize("compact", [True, False])
def test_masked_padding_reads_zero_after_a_fuller_call_in_the_same_slot(compact):
    """Low-latency dispatch re-zeroes only the rows its slot's previous call wrote: after a full batch, a batch of
    three tokens with other experts must still show zero everywhere past each expert's count."""
    d = _dispatcher("low_latency", compact)
    _round(d, 0)  # every slot of the buffer written by a full batch
    x, ids, w = _inputs(1)
    out = d.dispatch(x[:3], ids[:3], w[:3])
    rows = out.hidden_states.view(torch.uint8)
    counts = out.expert_counts().tolist()
    padding = [rows[e, n:] for e, n in enumerate(counts)]
    assert sum(counts) == 3 * K and all(int(p.count_nonzero()) == 0 for p in padding)
    d.combine(torch.ones(out.hidden_states.shape, dtype=torch.bfloat16), out)


def test_the_rows_to_zero_again_stay_at_one_address_while_the_batch_keeps_its_size():
    """A CUDA graph replays the index tensor it captured: the slot keeps its own copy of the rows a call wrote,
    updated in place while the batch size stays (not the caller's tensor, freed after the warm-up), and the padding
    still reads zero after each call of that size with another routing."""
    d = _dispatcher("low_latency", compact=False)
    pool: SlotPool = d.backend_dispatcher.slots
    kept = set()
    for seed in range(4):
        x, ids, w = _inputs(seed)
        out = d.dispatch(x, ids, w)
        rows, counts = out.hidden_states.view(torch.uint8), out.expert_counts().tolist()
        assert all(int(rows[e, n:].count_nonzero()) == 0 for e, n in enumerate(counts)), seed
        d.combine(torch.ones(out.hidden_states.shape, dtype=torch.bfloat16), out)
        kept |= {w.data_ptr() for w in _rows_written(pool)}
    assert len(kept) == len(_rows_written(pool))  # one address per slot and buffer


def _rows_written(pool: SlotPool) -> list[torch.Tensor]:
    """The rows each slot's buffers last wrote on the static path (a slot planned at creation on host memory
    recorded its counts instead)."""
    return [w for slot in pool.slots for w, _ in slot.written.values() if isinstance(w, torch.Tensor)]


def test_low_latency_plans_in_flight_slots_at_creation_and_calls_use_them():
    for in_flight in (1, 2, 3):
        d = md.create_dispatcher("torch", md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T,
                                                          mode="low_latency", output_dtype="fp8"),
                                 env={}, in_flight=in_flight)
        pool: SlotPool = d.backend_dispatcher.slots
        assert len(pool.slots) == in_flight and all(s.free for s in pool.slots)
        planned = [{name: buf.data_ptr() for name, buf in s.buffers.items()} for s in pool.slots]
        assert all("rows" in p and "send" in p for p in planned)  # the large ones: the MASKED rows, the send rows
        assert d.traffic.payload_bytes == 0 and d.traffic.collectives == 0  # planning is not the engine's traffic
        outs = [d.dispatch(*_inputs(seed)) for seed in range(in_flight)]  # as many in flight as planned
        for out in outs:
            d.combine(torch.ones(out.hidden_states.shape, dtype=torch.bfloat16), out)
        assert len(pool.slots) == in_flight
        for p, s in zip(planned, pool.slots):
            assert all(s.buffers[name].data_ptr() == ptr for name, ptr in p.items()), "a planned buffer was replaced"


def test_in_flight_is_checked():
    for bad in (0, -1, 2.0, True, "2", 65):
        with pytest.raises(md.InvalidSpecError) as err:
            md.create_dispatcher("torch", md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=T), env={},
                                 in_flight=bad)
        assert err.value.parameter == "in_flight"
