"""``flashinfer_a2a`` when something fails, on fakes as strict as FlashInfer: a combine or dispatch that raises keeps
its workspace out of the pool while FlashInfer holds it dispatched; a failure of FlashInfer's size function on one
rank is a typed error on every rank; the fake kernels' exchanges and FlashInfer's start-up exchanges wait with the
dispatcher's ``timeout_s`` and hear its peers' failure notices."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl_testing import FAKE_0_6_15, FAKE_0_6_17, FAKE_0_7_2
from moe_dispatch_flashinfer_cutedsl_testing.support import E, H, fake
from moe_dispatch_testing import (
    combine_unless_stalled,
    dispatch_with_a_bad_id,
    on_a_fresh_pool,
    outcome,
    random_routing,
    relative_error,
)

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")

TOKENS, TOP_K, PER_RANK = 8, 3, 4
TIMEOUT_S = 2.0


# -- a vendor call that raises -------------------------------------------------------------------------


def test_a_failed_combine_keeps_its_workspace_out_of_the_pool():
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    d = md.create_dispatcher(FlashInferA2ABackend(FAKE_0_6_17), spec, env={})
    x, w = torch.randn(4, H).to(torch.bfloat16), torch.ones(4, 2)
    ids = torch.tensor([[0, 1]] * 4)
    first = d.dispatch(x, ids, w)
    kernels = fake(FAKE_0_6_17).KERNELS

    def faults_once(*args, **kwargs):  # the compiled combine traps once (a vendor failure, injected)
        del kernels.moe_a2a_combine
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kernels.moe_a2a_combine = faults_once
    with pytest.raises(RuntimeError, match="illegal memory access"):
        d.combine(first.hidden_states, first)
    assert vendor.a2a_phase(d.backend_dispatcher.instances[first.handle.instance]) == "dispatched"
    second = d.dispatch(x, ids, w)  # the other workspace, not the one FlashInfer still holds dispatched
    assert second.handle.instance != first.handle.instance
    with pytest.raises(md.CapacityError) as info:
        d.dispatch(x, ids, w)
    assert info.value.parameter == "in_flight" and "combine raised" in str(info.value)
    assert relative_error(d.combine(first.hidden_states, first), x.float() * 2) < 1e-2  # a retry completes it
    d.combine(second.hidden_states, second)
    with pytest.raises(md.InvalidInputError):
        d.combine(second.hidden_states, second)  # its round is over: FlashInfer would assert
    third = d.dispatch(x, ids, w)  # both free again; reuses the first workspace
    assert third.handle.instance == first.handle.instance
    with pytest.raises(md.InvalidInputError):
        d.combine(first.hidden_states, first)  # a stale handle must not combine the new round
    d.combine(third.hidden_states, third)


def test_a_dispatch_that_fails_after_flashinfer_set_its_phase_stays_out_of_the_pool():
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=3)
    d = md.create_dispatcher(FlashInferA2ABackend(FAKE_0_6_15), spec, env={})
    x, w, ids = torch.randn(3, H).to(torch.bfloat16), torch.ones(3, 2), torch.tensor([[0, 1]] * 3)
    kernels = fake(FAKE_0_6_15).KERNELS

    def faults_once(*args, **kwargs):  # sanitize runs after FlashInfer set "dispatched"
        del kernels.moe_a2a_sanitize_expert_ids
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kernels.moe_a2a_sanitize_expert_ids = faults_once
    with pytest.raises(RuntimeError):
        d.dispatch(x, ids, w)
    assert list(d.backend_dispatcher.failed) == [0]
    out = d.dispatch(x, ids, w)  # the other workspace
    assert out.handle.instance == 1
    d.combine(out.hidden_states, out)


def run_size_function_fails(rank: int, world: int) -> str:
    kernels = fake(FAKE_0_7_2).KERNELS

    def jit_fails(*args, **kwargs):  # FlashInfer's JIT build of the all-to-all module fails (injected)
        raise RuntimeError("Ninja build failed. Ninja output: ...")

    if rank == 1:
        kernels.moe_a2a_get_aux_data_size = jit_fails
    try:
        md.create_dispatcher(FlashInferA2ABackend(FAKE_0_7_2),
                             md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=11), env={}, timeout_s=5)
    except md.MoEDispatchError as exc:
        return f"{type(exc).__name__}: {vendor.is_environment_refusal(exc)}"
    finally:
        kernels.__dict__.pop("moe_a2a_get_aux_data_size", None)
    return "created"


def test_a_failing_size_function_on_one_rank_is_a_typed_error_on_every_rank(moe_rank_pools):
    """FlashInfer's size function (its JIT module) is called while the ranks plan and agree; raised as it is, the
    peers were left waiting in the agreement until the timeout."""
    got = moe_rank_pools.get(2).map(run_size_function_fails, timeout_s=60)
    assert got == ["PeerFailedError: True", "BackendUnavailableError: True"], got  # both name the JIT failure


# -- waits: the dispatcher's timeout_s and its peers' failure notices ------------------------------------------


def _dispatcher(fake_module: str, world: int, timeout_s: float) -> md.Dispatcher:
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype="bf16")
    return md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={}, timeout_s=timeout_s)


def _inputs(rank: int, num_experts: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g, drop_prob=0.1)
    return x, ids, w


def _bad_input_on_rank_1(rank: int, world: int, fake_module: str):  # noqa: ANN202
    d = _dispatcher(fake_module, world, timeout_s=TIMEOUT_S * 15)
    x, ids, w = _inputs(rank, d.spec.num_experts)
    return dispatch_with_a_bad_id(d, x, ids, w, bad=rank == 1)


def _stalls_before_combine(rank: int, world: int, fake_module: str):  # noqa: ANN202
    d = _dispatcher(fake_module, world, timeout_s=TIMEOUT_S)
    x, ids, w = _inputs(rank, d.spec.num_experts)
    return combine_unless_stalled(d, x, ids, w, stall_s=TIMEOUT_S + 2 if rank == 1 else None)  # rank 1 never combines


def test_bad_input_on_one_rank_reaches_the_other_inside_the_fake():
    """Rank 1's dispatch raises its InvalidInputError (and posts it); rank 0, waiting in the fake kernel's exchange,
    gets PeerFailedError naming rank 1 within a few seconds, though the timeout is 30 s, not after the process
    group's own timeout."""
    (name0, attrs0, seconds0, message0), (name1, attrs1, _, _) = on_a_fresh_pool(_bad_input_on_rank_1, FAKE_0_7_2)
    assert name1 == "InvalidInputError" and attrs1["parameter"] == "topk_ids"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert "expert id out of range" in message0
    assert seconds0 < 5.0


def test_a_rank_that_never_combines_is_named_after_the_dispatchers_timeout():
    name, attrs, seconds, message = on_a_fresh_pool(_stalls_before_combine, FAKE_0_7_2)[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5


class _RankOneLateOrFailingAtCreation(FlashInferA2ABackend):
    """Rank 1 stalls (``how="stall"``) or raises (``how="raise"``) in ``create``, after the agreement and before
    FlashInfer's start-up exchanges, which rank 0 is already in."""

    def __init__(self, fake_module: str, how: str) -> None:
        super().__init__(fake_module)
        self.how = how

    def create(self, ctx: mdb.DispatchContext):  # noqa: ANN201
        if ctx.rank == 1:
            if self.how == "raise":
                raise RuntimeError("rank 1's device is gone")
            time.sleep(TIMEOUT_S + 2)
        return super().create(ctx)


def _created_beside_a_peer_that(rank: int, world: int, how: str):  # noqa: ANN202
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return outcome(lambda: md.create_dispatcher(_RankOneLateOrFailingAtCreation(FAKE_0_7_2, how), spec,
                                                    env={}, timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("how,error", [("stall", "CollectiveTimeoutError"), ("raise", "PeerFailedError")])
def test_flashinfers_start_up_exchanges_wait_with_the_dispatchers_watch(how, error):
    """FlashInfer's MNNVL allocation exchanges handles through the adapter's CommBackend while the dispatcher is being
    created; it goes through the dispatcher's Comm, so rank 0 names rank 1 after timeout_s, or at once when rank 1
    has announced its failure, instead of waiting for the process group's own timeout (the pool's 40 s here)."""
    name, attrs, seconds, message = on_a_fresh_pool(_created_beside_a_peer_that, how)[0]
    assert name == error, message
    assert 1 in (attrs.get("ranks") or (attrs.get("rank"),)), attrs
    assert seconds < TIMEOUT_S + 2.5
