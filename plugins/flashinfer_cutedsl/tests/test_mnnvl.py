"""FlashInfer's MNNVL memory under ``flashinfer_a2a``, on fakes as strict as FlashInfer: the communicator it
allocates over (the dispatcher's group, not MPI's one-rank world), its process-wide address reservation
(a larger group after a smaller one, ranges a failed allocation left), the once-per-process FABRIC
decision (0.6.16+), and the collectives of an allocation."""

import warnings

import pytest
import torch
import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend
from moe_dispatch_flashinfer_cutedsl_testing import (
    EMULATOR,
    FAKE_0_6_6,
    FAKE_0_6_13,
    FAKE_0_6_15,
    FAKE_0_6_17,
    FAKE_0_7_0,
    FAKE_0_7_2,
)
from moe_dispatch_flashinfer_cutedsl_testing.fakes import mnnvl
from moe_dispatch_flashinfer_cutedsl_testing.support import (
    MNNVL_COLLECTIVES,
    E,
    H,
    fake,
    mnnvl_collectives,
    one_rank,
    run_after_one_rank_allocated,
    run_layer,
)
from moe_dispatch_testing import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")


# -- the communicator ------------------------------------------------------------------------------


def run_without_mnnvl_config(rank: int, world: int, fake_module: str) -> str:
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = fake(fake_module)
    memory = mod.comm.mnnvl.MnnvlMemory
    saved, memory.comm = memory.comm, None  # a fresh process: nothing set the class-level comm yet
    try:
        mapping = mod.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
        try:  # a max-tokens no other test uses: no cached workspace of this key
            mod.MoeAlltoAll(mapping, 19, 2, E, hidden_size=H)
        except RuntimeError as exc:
            return str(exc)
        return "no error"
    finally:
        memory.comm = saved


def test_without_mnnvl_config_flashinfer_allocates_over_a_one_rank_mpi_world(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(run_without_mnnvl_config, FAKE_0_7_2):
        assert "workspace first dim must equal ep_size (1 vs. 2)" in message


def run_fresh_dispatcher(rank: int, world: int, fake_module: str) -> tuple[int, float]:
    warnings.simplefilter("ignore", DeprecationWarning)
    memory = fake(fake_module).comm.mnnvl.MnnvlMemory
    memory.comm = None  # as in a fresh torchrun process
    error = run_layer(rank, world, fake_module, 2, 0.0)
    return memory.comm.Get_size(), error


def test_the_dispatcher_hands_flashinfer_its_own_group(moe_rank_pools):
    for size, error in moe_rank_pools.get(2).map(run_fresh_dispatcher, EMULATOR):
        assert size == 2 and error < 1e-2


def run_split(rank: int, world: int, fake_module: str) -> tuple[int, int, int]:
    mod = fake(fake_module)
    calls = []
    barrier = dist.barrier

    def counted(*args, **kwargs):  # noqa: ANN202 - counts, then does the barrier
        calls.append(1)
        return barrier(*args, **kwargs)

    dist.barrier = counted
    try:
        split = mod.comm.mnnvl.TorchDistBackend().Split(0, world - 1 - rank)  # keys reversed
    finally:
        dist.barrier = barrier
    return split.Get_size(), split.allgather(rank)[0], len(calls)


def test_the_fake_torchdistbackend_splits_as_flashinfer_does(moe_rank_pools):
    for size, first, barriers in moe_rank_pools.get(2).map(run_split, FAKE_0_7_2):
        assert size == 2 and barriers == 0  # FlashInfer: new_group(ranks=...) and nothing else
        assert first == 0  # torch orders a group by global rank, whatever the keys


# -- the process-wide address reservation -------------------------------------------------------------


def run_larger_group_after_a_smaller_one(rank: int, world: int, fake_module: str) -> tuple:
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = fake(fake_module)
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    with mnnvl.fresh_address_range(mod.comm.mnnvl.MnnvlMemory):
        md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, groups[rank], env={})  # reserves for 1 rank
        try:
            md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})  # 2 ranks
            adapter = None
        except md.InvalidSpecError as exc:
            adapter = (exc.parameter, str(exc))
        # FlashInfer asked for the same directly: peer 1 maps outside the one-rank reservation.
        mapping = mod.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
        try:
            mod.MoeAlltoAll(mapping, 4, 2, E, hidden_size=H + 128,
                            mnnvl_config=mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend()))
            raw = "no error"
        except RuntimeError as exc:
            raw = str(exc)
    return adapter, raw


@pytest.mark.parametrize("fake_module", [FAKE_0_6_13, FAKE_0_7_2])
def test_a_dispatcher_on_a_larger_group_than_the_mnnvl_reservation_is_refused(moe_rank_pools, fake_module):
    for adapter, raw in moe_rank_pools.get(2).map(run_larger_group_after_a_smaller_one, fake_module):
        assert "CUDA_ERROR_INVALID_VALUE" in raw, raw  # what FlashInfer's cuMemMap does
        assert adapter is not None and adapter[0] == "group", adapter  # the adapter refuses first, typed
        assert "reserved for 1 rank" in adapter[1], adapter


def run_after_a_failed_allocation(rank: int, world: int, fake_module: str, by: str) -> tuple:
    """An allocation over a one-rank group fails after reserving its range (``by`` the adapter, or
    by another user of FlashInfer's MoeAlltoAll); then a dispatcher on the 2-rank group."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = fake(fake_module)
    memory = mod.comm.mnnvl.MnnvlMemory
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    with mnnvl.fresh_address_range(memory):
        mnnvl.DRIVER.free_bytes = 0  # cuMemCreate fails after new_mnnvl_memory_address reserved the range
        try:
            if by == "adapter":
                md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, groups[rank], env={})
            else:
                config = mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend(mdb.Comm(groups[rank])))
                mod.MoeAlltoAll(one_rank(mod), 4, 2, E, hidden_size=H, mnnvl_config=config)
            failed = "no error"
        except md.BackendUnavailableError as exc:  # the core's wrapping of a vendor failure in create
            failed = str(exc.__cause__)
        except RuntimeError as exc:
            failed = str(exc)
        finally:
            mnnvl.DRIVER.free_bytes = None
        orphan = vendor.mnnvl_reservation(memory)
        try:
            d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})  # the 2-rank group
            x, ids, w = torch.randn(4, H).to(torch.bfloat16), torch.tensor([[0, 7]] * 4), torch.ones(4, 2)
            out = d.dispatch(x, ids, w)
            larger = relative_error(d.combine(out.hidden_states, out), x.float() * 2)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            larger = f"{type(exc).__name__}: {exc}"
    return failed, orphan, larger


@pytest.mark.parametrize("fake_module,by", [(FAKE_0_6_13, "flashinfer"), (FAKE_0_7_2, "flashinfer"),
                                            (FAKE_0_7_2, "adapter")])
def test_a_range_a_failed_allocation_reserved_is_not_reused_by_a_larger_group(moe_rank_pools, fake_module, by):
    """FlashInfer keeps the range a failed allocation reserved (over one rank here) with no record
    of its size; the adapter sees it from the class state (or marked it full itself when its own
    creation failed) and has FlashInfer reserve a new one."""
    for failed, orphan, larger in moe_rank_pools.get(2).map(run_after_a_failed_allocation, fake_module, by):
        assert "CUDA_ERROR_OUT_OF_MEMORY" in failed, failed
        assert isinstance(larger, float) and larger < 1e-2, larger
        assert orphan is not None and orphan.comm_size is None, orphan  # no allocation made it
        assert (orphan.room == 0) == (by == "adapter"), orphan


def test_a_failed_creation_leaves_no_allocation_at_the_offset_it_failed_at():
    """An allocation that fails inside a range that already holds workspaces leaves whatever it
    mapped at the range's current offset, and FlashInfer neither unmaps it nor advances the offset;
    the adapter marks that range full, so the next creation gets a new one."""
    fake_module = FAKE_0_7_0
    memory = fake(fake_module).comm.mnnvl.MnnvlMemory
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=3)
    md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})  # a range holding two workspaces
    before = vendor.mnnvl_reservation(memory)
    assert before is not None and before.comm_size == 1 and before.room > 0
    mnnvl.DRIVER.free_bytes = 0
    try:
        with pytest.raises(md.BackendUnavailableError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    finally:
        mnnvl.DRIVER.free_bytes = None
    assert vendor.mnnvl_reservation(memory).room == 0  # nothing goes at the failed offset again
    start = memory.current_start_address
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    assert memory.current_start_address != start  # a new range
    x, ids, w = torch.randn(3, H).to(torch.bfloat16), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    out = d.dispatch(x, ids, w)
    assert relative_error(d.combine(out.hidden_states, out), x.float() * 2) < 1e-2


# -- the FABRIC decision and the collectives of an allocation ------------------------------------------


@pytest.mark.parametrize("fake_module,fabric", [(FAKE_0_7_2, False), (FAKE_0_6_17, True), (FAKE_0_6_15, True)])
def test_ranks_that_differ_in_flashinfers_cached_fabric_decision_create_a_dispatcher(moe_rank_pools, fake_module,
                                                                                    fabric):
    """From v0.6.16 ``open_mnnvl_memory`` AND-reduces the ranks' FABRIC support (an allgather) only
    where the per-process ``MnnvlMemory._fabric_supported`` is unset: rank 0 skipped it, rank 1 ran
    it, and their next collectives paired wrongly (a raise on one rank, a hang on the other). The
    adapter has every rank decide again when they differ; the decision is then this group's AND."""
    got = moe_rank_pools.get(2).map(run_after_one_rank_allocated, fake_module, fabric, timeout_s=40)
    expected = "absent" if vendor.parse_version(fake(fake_module).__version__) < vendor.MNNVL_FABRIC_AGREEMENT_SINCE \
        else fabric
    for result, decided in got:
        assert isinstance(result, float) and result < 1e-2, result
        assert decided == expected, decided


@pytest.mark.parametrize("fake_module", [FAKE_0_6_6, FAKE_0_6_15, FAKE_0_6_17, FAKE_0_7_2])
@pytest.mark.parametrize("fabric", [False, True])
def test_the_fake_mnnvl_allocation_makes_flashinfers_collectives(fake_module, fabric):
    mod = fake(fake_module)
    era = "0_6_16" if mod.VERSION >= vendor.MNNVL_FABRIC_AGREEMENT_SINCE else "0_6_15"
    expected = MNNVL_COLLECTIVES[f"{era} {'fabric' if fabric else 'posix'}"]
    assert mnnvl_collectives(mod, fabric, "aarch64" if fabric else "x86_64") == expected


def run_over_torchdistbackend(rank: int, world: int, fake_module: str) -> tuple[list[float], list[float]]:
    """A MoeAlltoAll over FlashInfer's own TorchDistBackend (another user's, outside any dispatcher): the fake
    kernels' stores travel over that communicator's process group."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = fake(fake_module)
    mapping = mod.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=mod.comm.mnnvl.TorchDistBackend())
    a2a = mod.MoeAlltoAll(mapping, 4, 2, E, hidden_size=H + 384, mnnvl_config=config)
    x = torch.full((4, H + 384), float(rank + 1), dtype=torch.bfloat16)
    recv = a2a.dispatch(torch.tensor([[0, 4]] * 4, dtype=torch.int32), [x], 4)
    return recv[0].float().sum(dim=-1).flatten().tolist(), a2a.combine(recv[0], 4).float()[:, 0].tolist()


def test_the_fake_kernels_stores_travel_over_a_torchdistbackend_group(moe_rank_pools):
    for rank, (received, combined) in enumerate(moe_rank_pools.get(2).map(run_over_torchdistbackend, FAKE_0_7_2)):
        assert received == [640.0] * 4 + [1280.0] * 4  # rank r's rows hold r + 1, 640 wide
        assert combined == [2.0 * (rank + 1)] * 4  # each token's two copies, added
