"""A rank that fails or never comes, on DeepEP's fake: the fake's collectives (gloo, through the core's ``Comm``) wait
inside a dispatcher's call with that dispatcher's ``timeout_s`` and hear its peers' failure notices, and
``DeepEPBackend.close()`` meets the peers in a watched barrier before DeepEP's teardown. The real DeepEP's kernels
spin on flags and trap after a compiled-in cycle count (about 100 s): these prove the fake's behaviour, and the
adapter's barrier in ``close()``.
"""

from __future__ import annotations

import time

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR
from moe_dispatch_cuda_deepep_testing.support import routed_inputs, routed_spec
from moe_dispatch_testing import combine_unless_stalled, dispatch_with_a_bad_id, on_a_fresh_pool, outcome

TIMEOUT_S = 2.0
#: How long rank 1 stays away: past rank 0's timeout (it returns to the pool idle, which rank 0 cannot tell apart).
STALL_S = TIMEOUT_S + 1


def _bad_input_on_rank_1(rank: int, world: int, mode: str):
    d = md.create_dispatcher(DeepEPBackend(EMULATOR), routed_spec(world, mode, "bf16"), env={},
                             timeout_s=TIMEOUT_S * 15)
    x, ids, w, _ = routed_inputs(rank, d.spec.num_experts)
    return dispatch_with_a_bad_id(d, x, ids, w, bad=rank == 1)


def _stalls_before_combine(rank: int, world: int, mode: str):
    d = md.create_dispatcher(DeepEPBackend(EMULATOR), routed_spec(world, mode, "bf16"), env={}, timeout_s=TIMEOUT_S)
    x, ids, w, _ = routed_inputs(rank, d.spec.num_experts)
    return combine_unless_stalled(d, x, ids, w, stall_s=STALL_S if rank == 1 else None)  # rank 1 never combines


@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_bad_input_on_one_rank_reaches_the_other_inside_the_fake(mode):
    """Rank 1's dispatch raises its InvalidInputError (and posts it); rank 0, waiting in the fake's collective, gets
    PeerFailedError naming rank 1 within a few seconds, though the timeout is 30 s (a fake waiting with a Watch of its
    own would wait 300 s and hear no notice)."""
    (name0, attrs0, seconds0, message0), (name1, attrs1, _, _) = on_a_fresh_pool(_bad_input_on_rank_1, mode)
    assert name1 == "InvalidInputError" and attrs1["parameter"] == "topk_ids"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert "expert id out of range" in message0
    assert seconds0 < 5.0


@pytest.mark.parametrize("mode", ["low_latency", "normal"])
def test_a_rank_that_never_combines_is_named_after_the_dispatchers_timeout(mode):
    """Rank 1 never calls combine; rank 0 waits in the fake's combine collective and raises CollectiveTimeoutError
    naming rank 1 after about ``timeout_s`` (2 s), not after the fake's own 300 s."""
    outcomes = on_a_fresh_pool(_stalls_before_combine, mode)
    name, attrs, seconds, message = outcomes[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5


def _one_rank_never_closes(rank: int, world: int):
    backend = DeepEPBackend(EMULATOR)
    d = md.create_dispatcher(backend, routed_spec(world, "normal", "bf16"), env={})
    x, ids, w, _ = routed_inputs(rank, d.spec.num_experts)
    out = d.dispatch(x, ids, w)
    d.combine(torch.zeros(out.hidden_states.shape, dtype=torch.bfloat16), out)
    if rank == 1:
        time.sleep(STALL_S)  # an engine whose rank 1 is stuck elsewhere at shutdown
        return None, {}, 0.0, ""
    result = outcome(lambda: backend.close(timeout_s=TIMEOUT_S))
    after = outcome(lambda: d.dispatch(x, ids, w))
    return (*result, after[0])


def test_close_names_a_rank_that_does_not_come_instead_of_waiting_in_the_teardown():
    """``DeepEPBackend.close()`` destroys the Buffers, a collective (DeepEP's barriers). Rank 1 never calls it: the
    ranks meet in a barrier with ``timeout_s`` first, so rank 0 raises CollectiveTimeoutError naming rank 1 after about
    2 s instead of waiting in the teardown until the process group's own timeout, and its dispatcher refuses calls
    afterwards (the Buffer is closed, not destroyed)."""
    name, attrs, seconds, message, after = on_a_fresh_pool(_one_rank_never_closes)[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5
    assert after == "BackendUnavailableError"


def test_close_refuses_a_timeout_that_cannot_work():
    """``close(timeout_s=)`` is checked as a dispatcher's is: a negative one is an ``InvalidSpecError`` naming
    ``timeout_s``."""
    with pytest.raises(md.InvalidSpecError) as info:
        DeepEPBackend(EMULATOR).close(timeout_s=-1)
    assert info.value.parameter == "timeout_s"
