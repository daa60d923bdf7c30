"""Issue 15 (an adversarial trial of the library), on FlashInfer's fakes:

- class 6: combine uses the routing given to its dispatch. The adapter sends the top-k ids and weights as
  payloads and weights the rows at combine from what arrived (the handle's ``row_weight``, FlashInfer's workspace):
  an engine that overwrites its router buffers after dispatch returns changes nothing.
- class 7: the fake's collectives (the MNNVL emulation's exchanges) honour the dispatcher's ``timeout_s`` and its
  peers' failure notices.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_testing.routing import random_routing
from moe_dispatch_testing import ScaledLayer, combine_unless_stalled, dispatch_with_a_bad_id, on_a_fresh_pool, outcome, routing_reuse
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")

H, TOKENS, TOP_K, PER_RANK = 256, 8, 3, 4


def _dispatcher(fake: str, world: int, dtype: str, timeout_s: float = 300.0) -> md.Dispatcher:
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype=dtype)
    return md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={}, timeout_s=timeout_s)


def _inputs(rank: int, num_experts: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g, drop_prob=0.1)
    other_ids, _ = random_routing(TOKENS, num_experts, TOP_K, generator=g)
    return x, ids, w, other_ids


# -- class 6 -------------------------------------------------------------------------------------------------------


def _combine_after_the_router_buffers_change(rank: int, world: int, fake: str, dtype: str):
    d = _dispatcher(fake, world, dtype)
    x, ids, w, other_ids = _inputs(rank, d.spec.num_experts)
    layer = ScaledLayer.for_rank(H, d.spec.num_experts, rank, PER_RANK)
    return tuple(routing_reuse(d, layer, x, ids, w, other_ids))


@pytest.mark.parametrize("fake", [vendor.FAKE_0_6_13, vendor.FAKE_0_7_2])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_combine_uses_the_routing_given_to_its_dispatch(moe_rank_pools, fake, dtype):
    """The caller's ids and weights are overwritten in place after dispatch (the kit's ``routing_reuse``: ids copied
    from another routing, w.mul_(0.5).add_(0.25)): combine's result is bit for bit the one without the overwrite. (This adapter already kept what combine needs in
    its handle; the test keeps it so.)"""
    for repeatable, same, diff in moe_rank_pools.get(2).map(_combine_after_the_router_buffers_change, fake, dtype):
        assert repeatable, "the round trip itself is not repeatable: the comparison below would mean nothing"
        assert same, f"combine read the overwritten routing (max difference {diff})"


# -- class 7 -------------------------------------------------------------------------------------------------------

TIMEOUT_S = 2.0


def _bad_input_on_rank_1(rank: int, world: int, fake: str):
    d = _dispatcher(fake, world, "bf16", timeout_s=TIMEOUT_S * 15)
    x, ids, w, _ = _inputs(rank, d.spec.num_experts)
    return dispatch_with_a_bad_id(d, x, ids, w, bad=rank == 1)


def _stalls_before_combine(rank: int, world: int, fake: str):
    d = _dispatcher(fake, world, "bf16", timeout_s=TIMEOUT_S)
    x, ids, w, _ = _inputs(rank, d.spec.num_experts)
    return combine_unless_stalled(d, x, ids, w, stall_s=TIMEOUT_S + 2 if rank == 1 else None)  # rank 1 never combines


def test_bad_input_on_one_rank_reaches_the_other_inside_the_fake():
    """Rank 1's dispatch raises its InvalidInputError (and posts it); rank 0, waiting in the fake kernel's exchange,
    gets PeerFailedError naming rank 1 within a few seconds, though the timeout is 30 s. Before the fix the exchange
    blocked in gloo until the process group's own timeout."""
    (name0, attrs0, seconds0, message0), (name1, attrs1, _, _) = on_a_fresh_pool(_bad_input_on_rank_1,
                                                                                   vendor.FAKE_0_7_2)
    assert name1 == "InvalidInputError" and attrs1["parameter"] == "topk_ids"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert "expert id out of range" in message0
    assert seconds0 < 5.0


def test_a_rank_that_never_combines_is_named_after_the_dispatchers_timeout():
    name, attrs, seconds, message = on_a_fresh_pool(_stalls_before_combine, vendor.FAKE_0_7_2)[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5


class _RankOneLateOrFailingAtCreation(FlashInferA2ABackend):
    """Rank 1 stalls (``how="stall"``) or raises (``how="raise"``) in ``create``, after the agreement and before
    FlashInfer's start-up exchanges, which rank 0 is already in."""

    def __init__(self, fake: str, how: str) -> None:
        super().__init__(fake)
        self.how = how

    def create(self, ctx: mdb.DispatchContext):  # noqa: ANN201
        if ctx.rank == 1:
            if self.how == "raise":
                raise RuntimeError("rank 1's device is gone")
            time.sleep(TIMEOUT_S + 2)
        return super().create(ctx)


def _created_beside_a_peer_that(rank: int, world: int, how: str):
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return outcome(lambda: md.create_dispatcher(_RankOneLateOrFailingAtCreation(vendor.FAKE_0_7_2, how), spec,
                                                    env={}, timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("how,error", [("stall", "CollectiveTimeoutError"), ("raise", "PeerFailedError")])
def test_flashinfers_start_up_exchanges_wait_with_the_dispatchers_watch(how, error):
    """FlashInfer's MNNVL allocation exchanges handles through the adapter's CommBackend while the dispatcher is being
    created. It called torch.distributed directly: rank 0 waited for a stalled rank 1 until the process group's own
    timeout (the pool's 40 s here). Now it goes through the dispatcher's Comm: rank 0 names rank 1 after timeout_s,
    or at once when rank 1 has announced its failure."""
    name, attrs, seconds, message = on_a_fresh_pool(_created_beside_a_peer_that, how)[0]
    assert name == error, message
    assert 1 in (attrs.get("ranks") or (attrs.get("rank"),)), attrs
    assert seconds < TIMEOUT_S + 2.5
