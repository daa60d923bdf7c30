"""The vendor-audit findings on ``flashinfer_a2a`` (issue 13), each against a fake as strict as
FlashInfer: the class-level workspace cache (#3), the workspace size of each version (#4), the
MNNVL communicator (#5), -1 ids in the dispatch kernel (#8), version claims (#10), and what a
read of the vendor's code found beyond the list (kernel top-k values, kMaxRanks, the fabricated
experts-per-rank limit, contiguous payloads, the in_flight planning gap)."""

import importlib
import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch_testing.routing import random_routing
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")

H, E = 256, 8
ALL_FAKES = [name for name, _ in vendor.FAKES]


def _fake(name: str):  # noqa: ANN202
    return importlib.import_module(name)


def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Identity experts: the weighted sum of a token's valid copies."""
    keep = (ids >= 0).float() * w
    return x.float() * keep.sum(dim=1, keepdim=True)


def _layer(d: md.Dispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = d.dispatch(x, ids, w)
    return d.combine(out.hidden_states, out)


# -- #3: one workspace per cache key -------------------------------------------------------------


@pytest.mark.parametrize("fake", ALL_FAKES)
def test_identical_moealltoall_instances_share_one_workspace_like_flashinfer(fake):
    mod = _fake(fake)
    _quiet()
    mnnvl = mod.comm.mnnvl
    mapping = mod.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)
    config = mnnvl.MnnvlConfig(comm_backend=_OneRank())
    size = mod.moe_a2a_get_workspace_size_per_rank(1, 4, 2 * H + 16, 2 * H)
    a = mod.MoeAlltoAll(mapping, 4, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
    b = mod.MoeAlltoAll(mapping, 4, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
    assert a.workspace is b.workspace and a.metainfo is b.metainfo
    key = next(k for k, v in mod.MoeAlltoAll._WORKSPACE_CACHE.items() if v["workspace"] is a.workspace)
    assert len(key) == len(vendor.profile(mod.VERSION).cache_key)
    c = mod.MoeAlltoAll(mapping, 4, 2, E, workspace_size_per_rank=size + 128, mnnvl_config=config)
    assert c.workspace is not a.workspace


class _OneRank:
    def Get_rank(self): return 0  # noqa: E704, N802
    def Get_size(self): return 1  # noqa: E704, N802
    def allgather(self, data): return [data]  # noqa: E704
    def bcast(self, data, root): return data  # noqa: E704
    def barrier(self): return None  # noqa: E704
    def Split(self, color, key): return self  # noqa: E704, N802


def run_two_in_flight(rank: int, world: int, fake: str) -> dict:
    _quiet()
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=8)
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    other = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    g = torch.Generator().manual_seed(rank)
    xa, xb = (torch.randn(8, H, generator=g).to(torch.bfloat16) for _ in range(2))
    ia = torch.randint(0, E, (8, 1), generator=g).repeat(1, 2)
    ia[:, 1] = (ia[:, 0] + 1) % E
    ib = (ia + 3) % E
    w = torch.rand(8, 2, generator=g)
    first, second = d.dispatch(xa, ia, w), d.dispatch(xb, ib, w)
    yc = _layer(other, xb, ib, w)  # another dispatcher of the same shape, between them
    ya = d.combine(first.hidden_states, first)
    yb = d.combine(second.hidden_states, second)
    ptrs = {inst.workspace.data_ptr() for disp in (d, other) for inst in disp._impl.instances}  # noqa: SLF001
    return {"a": relative_error(ya, _reference(xa, ia, w)), "b": relative_error(yb, _reference(xb, ib, w)),
            "c": relative_error(yc, _reference(xb, ib, w)), "workspaces": len(ptrs)}


def test_in_flight_dispatches_and_other_dispatchers_own_distinct_workspaces(moe_rank_pools):
    for r in moe_rank_pools.get(2).map(run_two_in_flight, vendor.EMULATOR):
        assert r["workspaces"] == 4, r
        assert max(r["a"], r["b"], r["c"]) < 1e-2, r


# -- #4: the workspace size of each version ------------------------------------------------------


@pytest.mark.parametrize("fake", ALL_FAKES)
def test_ported_workspace_formula_equals_each_versions_size_function(fake):
    mod = _fake(fake)
    for ep, t, disp, comb in ((8, 128, 2 * 7168 + 64, 2 * 7168), (2, 16, 96, 512), (64, 1, 4, 2), (3, 7, 33, 17)):
        assert vendor.ported_workspace_size_per_rank(ep, t, disp, comb, mod.VERSION) == \
            mod.moe_a2a_get_workspace_size_per_rank(ep, t, disp, comb)


def test_workspace_numbers_the_audit_names():
    per_token = 2 * 7168 + 8 * 8  # bf16 row, int32 ids, fp32 weights (top-8)
    assert vendor.ported_workspace_size_per_rank(8, 128, per_token, 2 * 7168, (0, 6, 7)) == 29_434_240
    for version in ((0, 6, 8), (0, 6, 17), (0, 7, 2)):
        assert vendor.ported_workspace_size_per_rank(8, 128, per_token, 2 * 7168, version) == 29_448_576
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, output_dtype="bf16")
    size = FlashInferA2ABackend(vendor.FAKE_0_6_13).buffer_size(spec, 8)
    assert size.dispatch_bytes + size.combine_bytes == 29_448_576
    assert size.allocated_bytes == 2 * 29_448_576 + 64 + 192  # two workspaces, keys 64 B and 192 B larger


def run_layer(rank: int, world: int, fake: str, top_k: int, drop: float, experts: int = E) -> float:
    _quiet()
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=16)
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(16, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(16, experts, top_k, generator=g, drop_prob=drop)
    return relative_error(_layer(d, x, ids, w), _reference(x, ids, w))


@pytest.mark.parametrize("fake", [vendor.FAKE_0_6_13, vendor.FAKE_0_7_2])
def test_a_full_workspace_fits_dispatch_and_combine_with_kmaxtopk_22(moe_rank_pools, fake):
    errors = moe_rank_pools.get(2).map(run_layer, fake, 8, 0.0)
    assert max(errors) < 1e-2


def test_buffer_size_counts_the_in_flight_workspaces():
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=16, output_dtype="bf16")
    one = FlashInferA2ABackend(vendor.EMULATOR, in_flight=1).buffer_size(spec, 2)
    three = FlashInferA2ABackend(vendor.EMULATOR, in_flight=3).buffer_size(spec, 2)
    assert three.total_bytes == 3 * one.total_bytes + 128 * 3
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher(FlashInferA2ABackend(vendor.EMULATOR), spec, env={}, options={"in_flight": 3})
    assert info.value.parameter == "options.in_flight"


# -- #5: the MNNVL communicator --------------------------------------------------------------------


def run_without_mnnvl_config(rank: int, world: int, fake: str) -> str:
    _quiet()
    mod = _fake(fake)
    mnnvl = mod.comm.mnnvl.MnnvlMemory
    saved, mnnvl.comm = mnnvl.comm, None  # a fresh process: nothing set the class-level comm yet
    try:
        mapping = mod.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
        try:
            mod.MoeAlltoAll(mapping, 4, 2, E, hidden_size=H)
        except RuntimeError as exc:
            return str(exc)
        return "no error"
    finally:
        mnnvl.comm = saved


def test_without_mnnvl_config_flashinfer_allocates_over_a_one_rank_mpi_world(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(run_without_mnnvl_config, vendor.EMULATOR):
        assert "workspace first dim must equal ep_size (1 vs. 2)" in message


def run_fresh_dispatcher(rank: int, world: int, fake: str) -> tuple[int, float]:
    _quiet()
    mnnvl = _fake(fake).comm.mnnvl.MnnvlMemory
    mnnvl.comm = None  # as in a fresh torchrun process
    error = run_layer(rank, world, fake, 2, 0.0)
    return mnnvl.comm.Get_size(), error


def test_the_dispatcher_hands_flashinfer_its_own_group(moe_rank_pools):
    for size, error in moe_rank_pools.get(2).map(run_fresh_dispatcher, vendor.EMULATOR):
        assert size == 2 and error < 1e-2


# -- #8: -1 ids in the dispatch kernel --------------------------------------------------------------


def run_kernel_with_invalid_ids(rank: int, world: int, fake: str, experts: int) -> str:
    """FlashInfer's kernel given -1 ids directly (what the adapter must never do)."""
    _quiet()
    mod = _fake(fake)
    mapping = mod.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
    from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend
    a2a = mod.MoeAlltoAll(mapping, 4, 2, experts, hidden_size=H,
                          mnnvl_config=mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend()))
    ids = torch.tensor([[rank, -1]] * 4, dtype=torch.int32) * (experts // world)
    ids[:, 1] = -1
    try:
        recv = a2a.dispatch(ids, [torch.ones(4, 8, dtype=torch.float32)], 4)
    except RuntimeError as exc:
        return str(exc)
    counts = [int((recv[0][src] != 0).any(dim=1).sum()) for src in range(world)]
    a2a.combine(torch.zeros(world, 4, 8, dtype=torch.bfloat16), 4)
    return f"rows received per source: {counts}"


def test_flashinfers_kernel_sends_minus_one_to_rank_0_or_out_of_bounds(moe_rank_pools):
    one_per_rank = moe_rank_pools.get(2).map(run_kernel_with_invalid_ids, vendor.EMULATOR, 2)
    assert all("maps to target rank -1" in m for m in one_per_rank), one_per_rank
    four_per_rank = moe_rank_pools.get(2).map(run_kernel_with_invalid_ids, vendor.EMULATOR, 8)
    assert four_per_rank == ["rows received per source: [4, 4]", "rows received per source: [0, 4]"]


@pytest.mark.parametrize("experts", [2, 8])
def test_the_adapter_never_sends_minus_one(moe_rank_pools, experts):
    # drop_prob 0.5 with top-1 and top-2 leaves tokens with no expert at all.
    for top_k in (1, 2):
        assert max(moe_rank_pools.get(2).map(run_layer, vendor.EMULATOR, top_k, 0.5, experts)) < 1e-2


def run_count_received(rank: int, world: int, fake: str) -> tuple[list[int], list[int]]:
    """Slots each rank received from each source, against the tokens that route there."""
    _quiet()
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=8)
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    local = E // world
    ids = torch.full((world, 8, 2), -1)
    ids[:, :4, 0] = local  # tokens 0-3 of every rank: one expert, on rank 1; tokens 4-7: none at all
    out = d.dispatch(torch.zeros(8, H, dtype=torch.bfloat16), ids[rank], torch.ones(8, 2))
    inst = d._impl.instances[out.handle.instance]  # noqa: SLF001
    names = vendor.profile(_fake(fake).VERSION).metainfo_names
    at = int(inst.metainfo[names.index("RECV_COUNTERS")])
    got = inst.workspace[rank][at : at + 4 * world].view(torch.int32).tolist()
    d.combine(out.hidden_states, out)
    expected = [4 if rank == 1 else 0 for _ in range(world)]
    expected[rank] += 4  # this rank's own expert-less tokens, which combine to zero
    return got, expected


def test_minus_one_ids_add_no_copies_to_rank_0(moe_rank_pools):
    for got, expected in moe_rank_pools.get(2).map(run_count_received, vendor.EMULATOR):
        assert got == expected


# -- new: the kernels' top-k values, kMaxRanks, no experts-per-rank limit, contiguity ---------------


@pytest.mark.parametrize("fake,top_k", [(vendor.FAKE_0_6_7, 3), (vendor.FAKE_0_6_7, 5), (vendor.FAKE_0_6_13, 7),
                                        (vendor.FAKE_0_7_2, 11)])
def test_top_k_between_the_kernels_values_is_padded(moe_rank_pools, fake, top_k):
    assert max(moe_rank_pools.get(2).map(run_layer, fake, top_k, 0.2, 16)) < 1e-2


def test_top_k_beyond_kmaxtopk_and_more_than_64_ranks_are_refused():
    spec = md.DispatchSpec(H, 512, 9, num_max_dispatch_tokens_per_rank=4)
    with pytest.raises(md.InvalidSpecError) as info:
        FlashInferA2ABackend(vendor.FAKE_0_6_7).check_spec(spec, 2)
    assert info.value.parameter == "top_k" and info.value.allowed == "1..8"
    FlashInferA2ABackend(vendor.FAKE_0_6_13).check_spec(spec, 2)
    with pytest.raises(md.InvalidSpecError) as info:
        FlashInferA2ABackend(vendor.EMULATOR).check_spec(md.DispatchSpec(H, 128, 2), 128)
    assert info.value.parameter == "world_size"
    FlashInferA2ABackend(vendor.EMULATOR).check_spec(md.DispatchSpec(H, 512, 2), 1)  # 512 experts on one rank


def run_strided_inputs(rank: int, world: int, fake: str) -> float:
    _quiet()
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=8)
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.arange(8) % E, (torch.arange(8) + 1) % E]).t()  # [8, 2], not contiguous
    w = torch.rand(2, 8, generator=g).t()
    return relative_error(_layer(d, x, ids, w), _reference(x, ids, w))


def test_non_contiguous_routing_tensors_reach_the_kernels_contiguous(moe_rank_pools):
    assert max(moe_rank_pools.get(2).map(run_strided_inputs, vendor.EMULATOR)) < 1e-2


# -- #10: versions ---------------------------------------------------------------------------------


def test_detect_knows_which_versions_have_each_api():
    for name, version in vendor.FAKES:
        info = vendor.detect(name)
        assert info.fake and info.version == version and info.a2a_reason() is None and info.cutedsl_reason() is None
    api = vendor.detect(vendor.EMULATOR).api
    old = vendor.VendorInfo("flashinfer", api, "0.5.3", None, False)
    assert "MoeAlltoAll needs FlashInfer >= 0.6.0" in old.a2a_reason()
    assert "CuteDslMoEWrapper needs FlashInfer >= 0.6.4" in vendor.VendorInfo("flashinfer", api, "0.6.3", None,
                                                                                False).cutedsl_reason()
    assert "newer than 0.7.2" in vendor.VendorInfo("flashinfer", api, "0.8.0", None, False).describe()
    assert vendor.parse_version("0.7.2.post1") == (0, 7, 2) and vendor.parse_version("0.6.18rc7") == (0, 6, 18)
