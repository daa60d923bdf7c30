"""``Dispatcher.forward``: one call runs a MoE layer, unfused (dispatch → experts → combine) or
through the backend's fused op, checks its inputs either way, and announces a failure on this
rank (the expert kernel's included) so the peers stop waiting."""

from __future__ import annotations

import time

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_testing.accuracy import TOLERANCES, relative_error
from moe_dispatch._reference.builtin import TorchBackend
from moe_dispatch_testing.local import RankPool
from moe_dispatch_testing import reference_moe
from moe_dispatch_testing.routing import random_expert_weights, random_routing

H, E, K = 128, 8, 2
TIMEOUT_S = 20.0


def _inputs(rank: int, tokens: int = 8):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(tokens, E, K, generator=g)
    return x, ids, w


class _Broken(md.TorchExperts):
    def apply_without_routing_weights(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("the expert kernel failed on this rank")


def _one_rank_experts_fail(rank: int, world: int):
    d = md.create_dispatcher("torch", md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=16,
                                                      output_dtype="bf16"), env={}, timeout_s=TIMEOUT_S)
    weights = random_expert_weights(E, H, 64, generator=torch.Generator().manual_seed(0))
    local = weights.slice(rank * (E // world), E // world)
    experts = _Broken() if rank == 1 else md.TorchExperts()
    start = time.monotonic()
    try:
        d.forward(experts, local, *_inputs(rank))
    except Exception as exc:  # the type is what the test compares
        return type(exc).__name__, time.monotonic() - start
    return None, time.monotonic() - start


def test_an_expert_kernel_failure_reaches_the_peers():
    """Rank 1's kernel raises between dispatch and combine; rank 0, waiting in combine, gets a
    typed error at once instead of the collective timeout."""
    with RankPool(2) as pool:
        outcomes = pool.map(_one_rank_experts_fail)
    assert outcomes[1][0] == "RuntimeError"
    assert outcomes[0][0] == "PeerFailedError"
    assert outcomes[0][1] < TIMEOUT_S / 2


def test_forward_equals_the_reference():
    spec = md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=16, output_dtype="bf16")
    d = md.create_dispatcher("torch", spec, env={})
    weights = random_expert_weights(E, H, 64, generator=torch.Generator().manual_seed(0))
    x, ids, w = _inputs(0)
    layer = d.process_weights(weights)  # unfused: the weights as they are
    assert layer is weights
    y = d.forward(md.TorchExperts(), layer, x, ids, w)
    assert relative_error(y, reference_moe(x, ids, w, weights)) < TOLERANCES[md.DispatchDtype.BF16]


def test_forward_checks_its_inputs_and_its_kernel():
    d = md.create_dispatcher("torch", md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=4), env={})
    x, ids, w = _inputs(0, tokens=8)
    with pytest.raises(md.CapacityError):  # 8 tokens > 4: the dispatch checks run
        d.forward(md.TorchExperts(), None, x, ids, w)
    with pytest.raises(md.InvalidInputError) as info:
        d.forward(None, None, *_inputs(0, tokens=4))
    assert info.value.parameter == "experts"


class _FusedWithoutTheOp(TorchBackend):
    """Declares a fused forward but its dispatcher has none: a plugin bug, named."""

    name = "fused_without_op"
    capabilities = mdb.Capabilities(**{**TorchBackend.capabilities.__dict__, "fused_forward": True})


def test_a_fused_backend_whose_dispatcher_has_no_fused_forward_is_a_plugin_error():
    d = md.create_dispatcher(_FusedWithoutTheOp(), md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=16),
                             env={}, host=md.PluginHost(env={}))
    with pytest.raises(md.PluginError, match="fused_forward"):
        d.process_weights(None)
    with pytest.raises(md.PluginError, match="FusedBackendDispatcher"):
        d.forward(None, None, *_inputs(0))


def _layer_in_both_layouts(rank: int, world: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    weights = random_expert_weights(E, H, 64, generator=torch.Generator().manual_seed(0)).slice(rank * (E // world),
                                                                                                E // world)
    results = []
    for layout in (None, "token_major"):
        d = md.create_dispatcher("torch", md.DispatchSpec(H, E, K, num_max_dispatch_tokens_per_rank=16,
                                                          output_dtype=dtype, layout=layout), env={})
        results.append(d.forward(md.TorchExperts(), weights, *_inputs(rank)))
    return results[0], results[1]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_token_major_rows_give_packed_rows_bits(dtype):
    """Each received token once (``layout="token_major"``), its local experts weighted and added by ``run_experts``:
    the same bits as PACKED rows weighted by combine, on every rank."""
    with RankPool(2) as pool:
        for packed, token_major in pool.map(_layer_in_both_layouts, dtype):
            assert torch.equal(packed, token_major)


def test_a_layout_the_backend_does_not_write_is_refused_naming_it():
    for spec in (md.DispatchSpec(H, E, K, mode="low_latency", layout="packed"),
                 md.DispatchSpec(H, E, K, layout="masked")):
        with pytest.raises(md.InvalidSpecError) as info:
            md.create_dispatcher("torch", spec, env={})
        assert info.value.parameter == "layout"
    with pytest.raises(md.InvalidSpecError, match="normal mode") as info:
        md.DispatchSpec(H, E, K, mode="low_latency", layout="token_major")
    assert info.value.parameter == "layout"
