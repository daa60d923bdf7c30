"""Low-latency mode makes no host sync on the payload path and moves exactly its capacity.

A host sync is a device-to-host read of tensor data (``moe_dispatch_testing.host_reads``): on CPU
nothing blocks, so the test records every aten op that dispatch and combine run and fails on any
of those: the same code on CUDA would stall the stream and could not be captured in a CUDA graph.
"""

from __future__ import annotations

import types

import pytest
import torch

import moe_dispatch as md
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch_testing.host_reads import RecordedOps
from moe_dispatch_testing.routing import random_routing


@pytest.mark.parametrize("dtype", [d.value for d in md.DispatchDtype])
@pytest.mark.parametrize("backend", ["torch", "allgather"])
def test_low_latency_dispatch_and_combine_never_read_data_on_the_host(backend, dtype):
    g = torch.Generator().manual_seed(0)
    T, H, E, k, C = 5, 256, 8, 3, 8
    quant = md.QuantHints(input_global_scale=nvfp4_global_scale(6.0)) if dtype == "nvfp4" else md.QuantHints()
    spec = md.DispatchSpec(H, E, k, num_max_dispatch_tokens_per_rank=C, mode="low_latency", output_dtype=dtype,
                           quant=quant)
    d = md.create_dispatcher(backend, spec, env={}, check_inputs=False)  # the value checks do sync, by design
    d.backend_dispatcher.host_paths = False  # the accelerator's path (on host memory, the counts are read)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(T, E, k, generator=g, drop_prob=0.2)
    y = None
    with RecordedOps() as seen:
        out = d.dispatch(x, ids, w)
        y = torch.ones(*out.hidden_states.shape[:-1], H, dtype=torch.bfloat16)
        d.combine(y, out)
    assert seen.ops, "no aten op was recorded: the mode did not see the calls"
    synced = seen.host_reads()
    assert not synced, f"low-latency {backend}/{dtype} reads data on the host: {synced}"


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "nvfp4"])
def test_on_host_memory_only_the_entries_that_exist_are_expanded_to_the_same_bits(dtype):
    """On CPU, low-latency mode reads the counts and expands only the entries that exist (``host_paths``): the
    rows, scales, counts, padding and combine bits of the static path, over several calls through one slot."""
    T, H, E, k, C = 7, 256, 8, 3, 8
    quant = md.QuantHints(input_global_scale=nvfp4_global_scale(6.0)) if dtype == "nvfp4" else md.QuantHints()
    spec = md.DispatchSpec(H, E, k, num_max_dispatch_tokens_per_rank=C, mode="low_latency", output_dtype=dtype,
                           quant=quant)
    static, compact = (md.create_dispatcher("torch", spec, env={}) for _ in range(2))
    static.backend_dispatcher.host_paths = False
    for seed, tokens in enumerate([T, 2, 0, T]):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        ids, w = random_routing(tokens, E, k, generator=g, drop_prob=0.3)
        a, b = static.dispatch(x, ids, w), compact.dispatch(x, ids, w)
        for name in ("hidden_states", "hidden_states_scale", "group_list"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None), name
            assert ta is None or torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name
        y = torch.randn(a.hidden_states.shape[:-1] + (H,), generator=g).to(torch.bfloat16)
        assert torch.equal(static.combine(y, a), compact.combine(y, b)), seed


def test_normal_mode_is_seen_to_sync_so_the_detector_works():
    """The same detector on normal mode finds its one documented host sync (the counts)."""
    spec = md.DispatchSpec(256, 8, 3, num_max_dispatch_tokens_per_rank=8, output_dtype="bf16")
    d = md.create_dispatcher("torch", spec, env={}, check_inputs=False)
    x = torch.randn(5, 256).to(torch.bfloat16)
    ids, w = random_routing(5, 8, 3)
    with RecordedOps() as seen:
        d.dispatch(x, ids, w)
    assert seen.host_reads()


@pytest.mark.parametrize("dtype", [d.value for d in md.DispatchDtype])
def test_low_latency_moves_exactly_the_capacity(dtype):
    """Per call: capacity slots × wire format (payload) and × 8·top_k (routing), no more."""
    T, H, E, k, C = 3, 256, 8, 2, 16
    quant = md.QuantHints(input_global_scale=nvfp4_global_scale(6.0)) if dtype == "nvfp4" else md.QuantHints()
    spec = md.DispatchSpec(H, E, k, num_max_dispatch_tokens_per_rank=C, mode="low_latency", output_dtype=dtype,
                           quant=quant)
    d = md.create_dispatcher("torch", spec, env={}, check_inputs=False)
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, w = random_routing(T, E, k)
    d.dispatch(x, ids, w)
    assert d.traffic.payload_bytes == C * spec.wire_format().bytes_per_token
    assert d.traffic.metadata_bytes == C * 8 * k
    assert d.traffic.collectives == 1  # one all-gather, no count exchange


def _as_if_in(module: str, fn):
    """``fn`` as if it were defined in ``module``: its frames name that module."""
    return types.FunctionType(fn.__code__, {"__name__": module}, fn.__name__)


def _kernel(t):
    return t.tolist()


def _call(t, kernel):
    kernel(t)
    return t.tolist()


def test_the_detector_sees_tolist_and_leaves_the_vendors_calls_out():
    """``tolist()`` reaches no aten op on CPU and is seen all the same; with ``packages``, a read inside a call into
    another package (a vendor library, or its fake) is left out, the same read in the code under test is kept, with
    where it was made; ``leave_out`` drops a module's reads."""
    vendor, adapter = _as_if_in("some_vendor", _kernel), _as_if_in("my_backend.dispatcher", _call)
    t = torch.arange(4)
    with RecordedOps() as everything:
        adapter(t, vendor)
    assert [r.op for r in everything.reads] == ["tolist", "tolist"]
    with RecordedOps(packages={"my_backend"}) as mine:
        adapter(t, vendor)
    assert [r.op for r in mine.reads] == ["tolist"]
    assert mine.reads[0].where.startswith("my_backend.dispatcher:") and mine.reads[0].where.endswith(" in _call")
    with RecordedOps(packages={"my_backend"}, leave_out={"my_backend.dispatcher"}) as none:
        adapter(t, vendor)
    assert none.reads == []
