"""The fourth independent audit (2026-11, docs/vendor-audits/2026-11/round4/cuda_deepep.md): one test per non-OK row
that code can settle. A4-1 (WRONG): a CUDA graph holding an odd count of low-latency calls, then eager ones."""

from __future__ import annotations

import importlib

import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend

H = 2048


def _spec(world: int) -> md.DispatchSpec:
    return md.DispatchSpec(H, 4 * world, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency",
                           output_dtype="bf16")


def _outcome(fn):
    try:
        return fn()
    except md.MoEDispatchError as exc:
        return type(exc).__name__, exc.parameter


def _layer(rank: int, world: int):  # noqa: ANN202
    """The DeepEP fake, a backend on it, one low-latency layer and a batch for it."""
    fake = importlib.import_module(vendor.EMULATOR)
    backend = DeepEPBackend(vendor.EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, _spec(world), env={}, options={"buffer_num_qps_per_rank": 4})
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    return fake, backend, d, (x, torch.tensor([[0, d.spec.num_experts - 1]] * 4), torch.ones(4, 2))


def _graphs_then_eager(rank: int, world: int, split: bool) -> list:
    """Capture one layer's dispatch and combine (together, or in two graphs when ``split``), or the dispatch alone;
    replay; then an eager step."""
    fake, backend, d, (x, ids, w) = _layer(rank, world)
    steps = []
    try:
        out = d.dispatch(x, ids, w)  # one eager step first: the Buffer is clean
        d.combine(out.hidden_states, out)
        first, second = fake.CUDAGraph(), fake.CUDAGraph()
        with first.capture():
            out = d.dispatch(x, ids, w)
            if split is None:
                d.combine(out.hidden_states, out)
        if split:
            with second.capture():
                d.combine(out.hidden_states, out)
        first.replay()
        if split:
            second.replay()
        steps.append(_outcome(lambda: d.dispatch(x, ids, w) is not None and "eager"))
        return steps
    finally:
        importlib.import_module("moe_dispatch_cuda_deepep.fakes._native").reset_context()
        backend.close()


def test_a4_1_an_eager_low_latency_call_after_an_odd_capture_is_refused(moe_rank_pools):
    """A4-1 (WRONG): DeepEP picks the signalling half on the host at capture (deepseek-ai/DeepEP@dd758ca
    csrc/legacy/buffer.hpp ``low_latency_buffer_idx ^= 1``), so a graph holding a dispatch without its combine keeps
    its half at every replay while eager calls keep toggling: a later eager kernel reads the flags a replay left. The
    adapter accepted it; now the eager call after an odd capture is a typed error. Whole layers in one graph, or a
    dispatch graph and a combine graph captured back to back (even in total), stay allowed."""
    pool = moe_rank_pools.get(1)
    assert pool.map(_graphs_then_eager, None) == [["eager"]]  # dispatch + combine in one graph
    assert pool.map(_graphs_then_eager, True) == [["eager"]]  # two graphs, even in total
    assert pool.map(_graphs_then_eager, False) == [[("InvalidSpecError", "cuda_graph_capture")]]


def _capture_while_an_eager_dispatch_is_pending(rank: int, world: int) -> list:
    fake, backend, d, (x, ids, w) = _layer(rank, world)

    graphs = []

    def capture() -> str:
        graphs.append(fake.CUDAGraph())
        with graphs[-1].capture():
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        return "captured"

    def eager_round() -> str:
        out = d.dispatch(x, ids, w)
        d.combine(out.hidden_states, out)
        return "eager"

    steps = []
    try:
        pending = d.dispatch(x, ids, w)  # an eager dispatch awaiting its combine (another micro-batch's)
        steps.append(_outcome(capture))
        d.combine(pending.hidden_states, pending)
        steps.append(_outcome(capture))
        dropped = d.dispatch(x, ids, w)
        del dropped  # an aborted step: its output dropped, its combine never made
        steps.append(_outcome(capture))
        for _ in range(2):  # the fake checks each kernel's signalling half
            steps.append(_outcome(lambda: graphs[-1].replay() or "replayed"))
            steps.append(_outcome(eager_round))
        return steps
    finally:
        importlib.import_module("moe_dispatch_cuda_deepep.fakes._native").reset_context()
        backend.close()


def test_a4_1_a_capture_while_an_eager_dispatch_awaits_its_combine_is_refused(moe_rank_pools):
    """A4-1, the review of its fix: an eager dispatch, then a whole layer captured, then the eager combine: the graph
    was captured on the other half from the one its replays find after that combine (the replay reads the flags the
    combine left). Now the capture is refused while an eager LL dispatch's output awaits its combine; once combined,
    or dropped (the host index moved before the capture, so the graph and its replays agree), it is allowed."""
    assert moe_rank_pools.get(1).map(_capture_while_an_eager_dispatch_is_pending) == [
        [("InvalidSpecError", "cuda_graph_capture"), "captured", "captured", "replayed", "eager", "replayed", "eager"]]


def _capture_after_an_aborted_capture(rank: int, world: int) -> list:
    fake, backend, d, (x, ids, w) = _layer(rank, world)
    graphs = []

    def capture(two_batches: bool) -> str:
        graphs.append(fake.CUDAGraph())
        with graphs[-1].capture():  # two-batch overlap: both dispatches before both combines
            outs = [d.dispatch(x, ids, w) for _ in range(2 if two_batches else 1)]
            for out in outs:
                d.combine(out.hidden_states, out)
        return "captured"

    def aborted() -> str:
        try:
            with fake.CUDAGraph().capture():
                d.dispatch(x, ids, w)
                raise KeyboardInterrupt  # the capture dies between the dispatch and its combine
        except KeyboardInterrupt:
            return "aborted"

    steps = []
    try:
        out = d.dispatch(x, ids, w)
        d.combine(out.hidden_states, out)
        steps.append(_outcome(lambda: capture(True)))
        steps.append(_outcome(lambda: graphs[-1].replay() or "replayed"))
        steps.append(aborted())
        steps.append(_outcome(lambda: capture(False)))
        return steps
    finally:
        importlib.import_module("moe_dispatch_cuda_deepep.fakes._native").reset_context()
        backend.close()


def test_c7_a_capture_after_an_aborted_capture_is_refused(moe_rank_pools):
    """Round five, C7 (WRONG): a capture that died after its dispatch moved DeepEP's host-side half for good, so every
    later graph starts on the other half from the GPU's state (each replay reads the counts the last kernel left). A
    captured dispatch at an odd count with no captured dispatch awaiting its combine is now refused; a graph with two
    micro-batches' dispatches before their combines (sglang's two-batch overlap) stays allowed."""
    assert moe_rank_pools.get(1).map(_capture_after_an_aborted_capture) == [
        ["captured", "replayed", "aborted", ("InvalidSpecError", "cuda_graph_capture")]]
