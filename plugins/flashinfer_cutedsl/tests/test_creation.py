"""Creating a ``flashinfer_a2a`` dispatcher, on fakes as strict as FlashInfer: every rank agrees on what decides
FlashInfer's collective constructors before any allocation, ``TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN=0`` is refused
where FlashInfer hangs, ``create`` runs under an "error" warnings filter (0.7.2's deprecation of
``MoeAlltoAll``, and only it, ignored), and ends with a barrier (FlashInfer barriers itself from 0.7.1)."""

import warnings

import pytest

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl_testing import (
    FAKE_0_6_7,
    FAKE_0_6_13,
    FAKE_0_6_14,
    FAKE_0_6_15,
    FAKE_0_6_17,
    FAKE_0_7_0,
    FAKE_0_7_1,
    FAKE_0_7_2,
)
from moe_dispatch_flashinfer_cutedsl_testing.support import E, H, OneRank, fake, raw_moe_alltoall

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")


# -- agreed before anything is allocated -------------------------------------------------------------


def run_mixed(rank: int, world: int, fakes: list[str], in_flight: list[int]) -> tuple[str, str]:
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=7)
    try:
        md.create_dispatcher(FlashInferA2ABackend(fakes[rank], in_flight=in_flight[rank]), spec, env={},
                             timeout_s=20)
    except md.ConfigMismatchError as exc:
        return exc.parameter, str(exc)
    return "created", ""


@pytest.mark.parametrize("fakes,in_flight,field", [
    ([FAKE_0_7_2, FAKE_0_7_1], [2, 2], "flashinfer_a2a: FlashInfer"),
    ([FAKE_0_7_2, FAKE_0_7_2], [2, 1], "flashinfer_a2a: in_flight"),
])
def test_every_rank_agrees_on_what_decides_flashinfers_constructor(moe_rank_pools, fakes, in_flight, field):
    """Another FlashInfer on one rank (another workspace layout), or another number of workspaces
    (another number of collective allocations): refused on every rank before any allocation."""
    for parameter, _ in moe_rank_pools.get(2).map(run_mixed, fakes, in_flight, timeout_s=60):
        assert parameter == field


def test_one_block_per_token_0_is_refused_where_flashinfer_hangs(monkeypatch):
    monkeypatch.setenv(vendor.ENV_ONE_BLOCK_PER_TOKEN, "0")
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    for fake_module in (FAKE_0_6_7, FAKE_0_6_13):
        with pytest.raises(md.InvalidSpecError) as info:
            md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
        assert info.value.parameter == vendor.ENV_ONE_BLOCK_PER_TOKEN and "0.6.14" in info.value.allowed
    md.create_dispatcher(FlashInferA2ABackend(FAKE_0_6_14), spec, env={})  # not read any more


# -- FlashInfer 0.7.2's DeprecationWarning under an "error" filter ----------------------------------------


@pytest.mark.parametrize("fake_module", [FAKE_0_7_1, FAKE_0_7_2])
def test_create_runs_under_an_error_warnings_filter(fake_module):
    before = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # python -W error, pytest filterwarnings = error
        inner = list(warnings.filters)
        md.create_dispatcher(FlashInferA2ABackend(fake_module),
                             md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=5), env={})
        assert warnings.filters == inner  # the adapter's filter was scoped to its constructors
    assert warnings.filters == before


def test_only_flashinfers_deprecation_of_moealltoall_is_filtered(monkeypatch):
    kernels = fake(FAKE_0_7_2).KERNELS
    initialize = kernels.moe_a2a_initialize

    def warns(*args, **kwargs):  # another DeprecationWarning raised during construction (injected)
        warnings.warn("moe_a2a_initialize: something else is deprecated", DeprecationWarning, stacklevel=2)
        return initialize(*args, **kwargs)

    monkeypatch.setattr(kernels, "moe_a2a_initialize", warns)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(md.BackendUnavailableError) as info:  # the core wraps what create raised
            md.create_dispatcher(FlashInferA2ABackend(FAKE_0_7_2),
                                 md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=6), env={})
    assert isinstance(info.value.__cause__, DeprecationWarning) and "something else" in str(info.value.__cause__)


# -- the barrier after the workspaces are initialized ---------------------------------------------------


def test_create_barriers_on_the_group_after_flashinfer_initializes_the_workspaces(monkeypatch):
    mod = fake(FAKE_0_6_17)
    seen = []
    barrier = mdb.Comm.barrier

    def spy(self, operation="barrier"):  # noqa: ANN001, ANN202 - records, then does the barrier
        seen.append((operation, mod.KERNELS.calls.count("moe_a2a_initialize")))
        return barrier(self, operation)

    monkeypatch.setattr(mdb.Comm, "barrier", spy)
    before = mod.KERNELS.calls.count("moe_a2a_initialize")
    md.create_dispatcher(FlashInferA2ABackend(FAKE_0_6_17), md.DispatchSpec(H, E, 2,
                         num_max_dispatch_tokens_per_rank=6), env={})
    assert [n for _, n in seen if n == before + 2], seen  # after both workspaces' moe_a2a_initialize


@pytest.mark.parametrize("fake_module,barriers", [(FAKE_0_6_15, 0), (FAKE_0_6_17, 0), (FAKE_0_7_0, 0),
                                                  (FAKE_0_7_2, 1)])
def test_flashinfer_barriers_after_initializing_a_workspace_from_0_7_1(fake_module, barriers):
    comm = OneRank()
    raw_moe_alltoall(fake(fake_module), 3, 2, comm)
    assert comm.barriers == barriers
