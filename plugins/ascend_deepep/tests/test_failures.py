"""A rank that fails or stalls inside DeepEP-Ascend's fake: the fake's collectives wait with the
dispatcher's ``timeout_s`` and hear its peers' failure notices (the core's ``Comm`` on gloo), so bad
input on one rank reaches the other at once and a rank that never arrives is named after ``timeout_s``."""

from __future__ import annotations

import pytest

from moe_dispatch_ascend_deepep_testing import FAKE
from moe_dispatch_ascend_deepep_testing.support import routed_inputs, timed_dispatcher
from moe_dispatch_testing import combine_unless_stalled, dispatch_with_a_bad_id, on_a_fresh_pool

TIMEOUT_S = 2.0


def _bad_input_on_rank_1(rank: int, world: int, vendor: str, mode: str):
    d = timed_dispatcher(vendor, world, mode, "bf16", timeout_s=TIMEOUT_S * 15)
    x, ids, w, _ = routed_inputs(rank, d.spec.num_experts)
    return dispatch_with_a_bad_id(d, x, ids, w, bad=rank == 1)


def _stalls_before_combine(rank: int, world: int, vendor: str, mode: str):
    d = timed_dispatcher(vendor, world, mode, "bf16", timeout_s=TIMEOUT_S)
    x, ids, w, _ = routed_inputs(rank, d.spec.num_experts)
    # rank 1 never combines; once it has returned to its pool nothing it does reaches rank 0's wait
    return combine_unless_stalled(d, x, ids, w, stall_s=TIMEOUT_S + 0.5 if rank == 1 else None)


# The older build (FAKE_ENV_ONLY) dispatches through the same collectives as FAKE's normal mode.
@pytest.mark.parametrize("vendor,mode", [(FAKE, "low_latency"), (FAKE, "normal")])
def test_bad_input_on_one_rank_reaches_the_other_inside_the_fake(vendor, mode):
    """Rank 1's dispatch raises its InvalidInputError (and posts it); rank 0, waiting in the fake's collective, gets
    PeerFailedError naming rank 1 within a few seconds, though the timeout is 30 s (a fake waiting with a Watch of
    its own would wait 300 s and hear no notice: until the process group's own timeout)."""
    (name0, attrs0, seconds0, message0), (name1, attrs1, _, _) = on_a_fresh_pool(_bad_input_on_rank_1, vendor, mode)
    assert name1 == "InvalidInputError" and attrs1["parameter"] == "topk_ids"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert "expert id out of range" in message0
    assert seconds0 < 5.0


def test_a_rank_that_never_combines_is_named_after_the_dispatchers_timeout():
    """Rank 1 never calls combine; rank 0 waits in the fake's combine collective and raises CollectiveTimeoutError
    naming rank 1 after about ``timeout_s`` (2 s), not after the fake's own 300 s. Low latency only: the normal
    combine sends its rows back through the same collective (the fake's ``Buffer._return``)."""
    outcomes = on_a_fresh_pool(_stalls_before_combine, FAKE, "low_latency")
    name, attrs, seconds, message = outcomes[0]
    assert name == "CollectiveTimeoutError", message
    assert attrs["ranks"] == (1,)
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 2.5
