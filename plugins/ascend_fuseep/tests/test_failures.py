"""A rank that fails or stalls at FuseEP's fused op: the fake's collectives wait with the dispatcher's
``timeout_s`` and hear its peers' failure notices, so bad input on one rank reaches the other at once and a
rank that never enters the op is named after ``timeout_s``."""

from __future__ import annotations

import time

import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8
from moe_dispatch_ascend_fuseep_testing import FAKE, fuseep_backend
from moe_dispatch_testing import on_a_fresh_pool, outcome, random_expert_weights, random_routing

H, I, TOKENS, TOP_K, PER_RANK = 1024, 512, 8, 2, 2
TIMEOUT_S = 2.0


def _spec(world: int) -> md.DispatchSpec:
    return md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, mode="low_latency")


def _inputs(rank: int, num_experts: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g)
    return x, ids, w


def _fused_forward(rank: int, world: int, timeout_s: float, bad_rank: int | None, stalled_rank: int | None):
    spec = _spec(world)
    weights = quantize_weights_w8a8(random_expert_weights(spec.num_experts, H, I,
                                                          generator=torch.Generator().manual_seed(0)))
    d = md.create_dispatcher(fuseep_backend(FAKE), spec, env={}, timeout_s=timeout_s)
    layer = d.process_weights(weights.slice(rank * PER_RANK, PER_RANK))
    x, ids, w = _inputs(rank, spec.num_experts)
    if rank == bad_rank:
        ids = ids.clone()
        ids[0, 0] = spec.num_experts  # out of range: this rank raises before the op
    if rank == stalled_rank:
        time.sleep(timeout_s + 0.5)  # never enters the op (returning to the pool reaches no peer)
        return None, {}, 0.0, ""
    return outcome(lambda: d.forward(None, layer, x, ids, w))


def test_bad_input_on_one_rank_reaches_the_other_inside_the_fused_op():
    (name0, attrs0, seconds0, message0), (name1, attrs1, _, _) = on_a_fresh_pool(_fused_forward, 30.0, 1, None)
    assert name1 == "InvalidInputError" and attrs1["parameter"] == "topk_ids"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert seconds0 < 5.0


def test_a_rank_that_never_enters_the_fused_op_is_named_after_the_timeout():
    name, attrs, seconds, message = on_a_fresh_pool(_fused_forward, TIMEOUT_S, None, 1)[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5
