"""Low-latency calls under CUDA-graph capture on the fake (``fakes.deep_ep.CUDAGraph``: under ``capture()`` the host
code runs and the kernels do not; ``replay()`` runs the captured kernels with the state they find, and none of the
Python around them). DeepEP picks the signalling half on the host (csrc/legacy/buffer.hpp ``low_latency_buffer_idx
^= 1``), so a captured kernel keeps its half at every replay; the adapter's clean bookkeeping is Python, which a
replay skips. What the adapter refuses, so that every replay finds the state it was captured with.
"""

import importlib

import torch

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR
from moe_dispatch_cuda_deepep_testing.fakes import _native
from moe_dispatch_cuda_deepep_testing.support import (
    H,
    dispatch_and_combine,
    fake_module,
    ll_spec,
    outcome_of,
    short_outcome,
    world_group,
)


def _refused(fn):
    """A step's value, or the (type, parameter) of the moe-dispatch error it raised."""
    try:
        return fn()
    except md.MoEDispatchError as exc:
        return type(exc).__name__, exc.parameter


# -- what a replay finds --------------------------------------------------------------------------------------


def _replays(rank, world, pair):
    fake = fake_module()
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        buf = fake.Buffer(world_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
    x, w, ids = torch.zeros(2, H, dtype=torch.bfloat16), torch.ones(2, 2), torch.tensor([[0, 1]] * 2)
    graph = fake.CUDAGraph()
    try:
        with graph.capture():
            recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, 8, 4 * world, use_fp8=False)
            if pair:
                buf.low_latency_combine(recv, ids, w, handle)
        return [short_outcome(outcome_of(lambda: graph.replay() or "replayed")) for _ in range(3)]
    finally:
        _native.reset_context()


def test_a_replayed_kernel_keeps_the_half_it_was_captured_with(moe_rank_pools):
    """A captured kernel keeps its signalling half for every replay: a graph holding a dispatch and its combine replays
    cleanly; one holding a dispatch without its combine reads, from its second replay on, the counts its last replay
    left."""
    pool = moe_rank_pools.get(1)
    assert pool.map(_replays, pair=True) == [["replayed"] * 3]
    assert pool.map(_replays, pair=False) == [["replayed", ("RuntimeError", None), ("RuntimeError", None)]]


def _graph_of_one_layer(rank, world, two_expert_counts):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    small, large = ll_spec(world), ll_spec(world, experts_per_rank=8)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        layer_a = md.create_dispatcher(backend, large, env={})  # the captured one
        layer_b = md.create_dispatcher(backend, small if two_expert_counts else large, env={})
    for d in (layer_b, layer_a):
        dispatch_and_combine(d)  # warm-up, eagerly: the Buffer is in layer A's state when A is captured
    graph = fake.CUDAGraph()

    def capture():
        with graph.capture():
            dispatch_and_combine(layer_a)

    try:
        captured = outcome_of(capture)
        if captured is not None:
            return captured[:2]
        # eagerly between two replays (another batch size, another model on the process's Buffer)
        dispatch_and_combine(layer_b)
        graph.replay()
        graph.replay()
        return "replayed"
    finally:
        backend.close()


def test_capture_on_a_buffer_of_two_expert_counts_is_refused(moe_rank_pools):
    """With two expert counts on the process's Buffer the state at a replay differs from the one at capture (DeepEP
    issue #93): capturing an LL dispatch on such a Buffer is an ``InvalidSpecError`` naming ``num_experts``. With one
    expert count, capture, eager use between replays and the replays agree."""
    pool = moe_rank_pools.get(2)
    assert pool.map(_graph_of_one_layer, True) == [("InvalidSpecError", "num_experts")] * 2
    assert pool.map(_graph_of_one_layer, False) == ["replayed", "replayed"]


# -- cleans never go into a graph -----------------------------------------------------------------------------


def _capture(d, graph):
    with graph.capture():
        dispatch_and_combine(d)
    return "captured"


def _capture_after_adopting_a_dirty_buffer(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    rdma = vendor.ported_low_latency_rdma_size_hint(8, H, world, 4 * world)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        mine = fake.Buffer(world_group(), 0, rdma, low_latency_mode=True, num_qps_per_rank=4)
    mine.emulate_internode_normal_kernels()  # the engine used it for internode normal mode before handing it in
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, ll_spec(world), env={}, options={"buffer": mine,
                                                                            "buffer_num_qps_per_rank": 4})
    first, second = fake.CUDAGraph(), fake.CUDAGraph()
    try:
        steps = [outcome_of(lambda: _capture(d, first)),
                 outcome_of(lambda: dispatch_and_combine(d) is not None and "eager"),  # before any replay
                 outcome_of(lambda: first.replay() or "replayed"),
                 outcome_of(lambda: _capture(d, second)),
                 outcome_of(lambda: second.replay() or "replayed")]
        return [short_outcome(o) for o in steps], first.kernels, second.kernels
    finally:
        _native.reset_context()
        backend.close()


def test_an_adopted_buffer_is_cleaned_at_creation_not_in_a_graph(moe_rank_pools):
    """The clean a handed-in Buffer needs (its history is unknown) runs at the layer's creation, which every rank
    reaches, not at its first LL call, which may be captured (the clean would then run only at that graph's replay, on
    the ranks replaying it): the graphs hold the dispatch and the combine only, and eager calls between them run."""
    steps, first, second = moe_rank_pools.get(1).map(_capture_after_adopting_a_dirty_buffer)[0]
    assert steps == ["captured", "eager", "replayed", "captured", "replayed"]
    assert first == second == ["low_latency_dispatch", "low_latency_combine"]


def _capture_with_a_normal_dispatch_pending(rank, world):
    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, ll_spec(world), env={}, options={"buffer_num_qps_per_rank": 4})
    shared = d.backend_dispatcher.shared
    graph, again = fake.CUDAGraph(), fake.CUDAGraph()
    try:
        dispatch_and_combine(d)
        shared.internode = True  # as past 8 ranks: a normal-mode dispatch wrote the RDMA region ...
        shared.buffer.emulate_internode_normal_kernels()
        shared.after_normal_dispatch()  # ... and its combine never ran (an aborted step)
        steps = [outcome_of(lambda: _capture(d, graph)),
                 outcome_of(lambda: dispatch_and_combine(d) is not None and "eager"),
                 outcome_of(lambda: _capture(d, again)),
                 outcome_of(lambda: again.replay() or "replayed")]
        return [short_outcome(o) for o in steps], graph.kernels, again.kernels
    finally:
        _native.reset_context()
        backend.close()


def test_a_clean_due_at_capture_refuses_the_capture(moe_rank_pools):
    """A clean still due when an LL call is captured (a normal-mode dispatch past 8 ranks whose combine did not run)
    would go into the graph: the capture is an ``InvalidSpecError`` naming ``cuda_graph_capture`` until one eager LL
    step has cleaned."""
    steps, refused, captured = moe_rank_pools.get(1).map(_capture_with_a_normal_dispatch_pending)[0]
    assert steps == [("InvalidSpecError", "cuda_graph_capture"), "eager", "captured", "replayed"]
    assert refused == [] and captured == ["low_latency_dispatch", "low_latency_combine"]


# -- the signalling half at capture, at eager calls -------------------------------------------------------------


def _layer(rank: int, world: int):  # noqa: ANN202
    """The DeepEP fake, a backend on it, one low-latency layer and a batch for it."""
    fake = importlib.import_module(EMULATOR)
    backend = DeepEPBackend(EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, ll_spec(world), env={}, options={"buffer_num_qps_per_rank": 4})
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
        steps.append(_refused(lambda: d.dispatch(x, ids, w) is not None and "eager"))
        return steps
    finally:
        _native.reset_context()
        backend.close()


def test_an_eager_low_latency_call_after_an_odd_capture_is_refused(moe_rank_pools):
    """A graph holding a dispatch without its combine keeps its half at every replay while eager calls keep toggling, so
    a later eager kernel would read the flags a replay left: the eager LL call after an odd count of captured calls is
    an ``InvalidSpecError`` naming ``cuda_graph_capture``. Whole layers in one graph, or a dispatch graph and a combine
    graph captured back to back (even in total), stay allowed."""
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
        steps.append(_refused(capture))
        d.combine(pending.hidden_states, pending)
        steps.append(_refused(capture))
        dropped = d.dispatch(x, ids, w)
        del dropped  # an aborted step: its output dropped, its combine never made
        steps.append(_refused(capture))
        for _ in range(2):  # the fake checks each kernel's signalling half
            steps.append(_refused(lambda: graphs[-1].replay() or "replayed"))
            steps.append(_refused(eager_round))
        return steps
    finally:
        _native.reset_context()
        backend.close()


def test_a_capture_while_an_eager_dispatch_awaits_its_combine_is_refused(moe_rank_pools):
    """An eager dispatch, a whole layer captured, then the eager combine: the graph would be captured on the other half
    from the one its replays find after that combine. The capture is refused while an eager LL dispatch's output awaits
    its combine; once combined, or dropped (the host index moved before the capture, so the graph and its replays
    agree), it is allowed."""
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
        steps.append(_refused(lambda: capture(True)))
        steps.append(_refused(lambda: graphs[-1].replay() or "replayed"))
        steps.append(aborted())
        steps.append(_refused(lambda: capture(False)))
        return steps
    finally:
        _native.reset_context()
        backend.close()


def test_a_capture_after_an_aborted_capture_is_refused(moe_rank_pools):
    """A capture that died between a captured dispatch and its combine leaves DeepEP's host half moved for good, so
    every later graph would start on the other half from the GPU's state: a captured dispatch at an odd count with none
    awaiting its combine is refused; a graph with two micro-batches' dispatches before their combines (sglang's
    two-batch overlap) stays allowed."""
    assert moe_rank_pools.get(1).map(_capture_after_an_aborted_capture) == [
        ["captured", "replayed", "aborted", ("InvalidSpecError", "cuda_graph_capture")]]


# -- close() ------------------------------------------------------------------------------------------------


def _close_after_capture(rank, world):
    import warnings

    fake = fake_module()
    backend = DeepEPBackend(EMULATOR)
    with restored_environ(names=vendor.NVSHMEM_WRITTEN):
        d = md.create_dispatcher(backend, ll_spec(world), env={}, options={"buffer_num_qps_per_rank": 4})
    graph = fake.CUDAGraph()
    try:
        with graph.capture():
            dispatch_and_combine(d)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend.close()
        replayed = outcome_of(lambda: graph.replay() or "replayed")
        return [str(w.message)[:40] for w in caught if w.category is RuntimeWarning], short_outcome(replayed)
    finally:
        _native.reset_context()
        backend.close()


def test_close_warns_about_graphs_that_captured_low_latency_kernels(moe_rank_pools):
    """``close()`` frees the Buffer's NVSHMEM memory, while a graph that captured LL kernels on it may still be replayed
    (kernels on freed memory; README "Lifetime": drop such graphs first): ``close()`` warns, and the fake's replay
    fails."""
    warned, replayed = moe_rank_pools.get(1).map(_close_after_capture)[0]
    assert len(warned) == 1 and warned[0].startswith("CUDA graphs captured DeepEP low-latency")
    assert replayed == ("RuntimeError", None)  # the fake's destroyed runtime (on a GPU: freed memory)
