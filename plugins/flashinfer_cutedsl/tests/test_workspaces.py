"""FlashInfer's MoE all-to-all workspaces, on fakes as strict as FlashInfer: the class-level workspace
cache (identical ``MoeAlltoAll`` share one workspace), so a dispatcher's workspaces get sizes no other
``MoeAlltoAll`` has (FlashInfer's size + 64 B + 128 B × slot); each version's workspace size and the
ported formula; ``buffer_size`` and the ``in_flight`` pool."""

import warnings

import pytest
import torch

import moe_dispatch as md
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import LocalCommBackend
from moe_dispatch_flashinfer_cutedsl_testing import EMULATOR, FAKE_0_6_13, FAKE_0_7_2, FAKES
from moe_dispatch_flashinfer_cutedsl_testing.support import (
    E,
    H,
    OneRank,
    fake,
    flashinfer_sizes,
    one_rank,
    reference,
    round_trip,
    run_layer,
)
from moe_dispatch_testing import relative_error

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")

A2A_FAKES = [name for name, version in FAKES if version < vendor.EP_SINCE]  # the MoeAlltoAll generation


def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


# -- one workspace per cache key -----------------------------------------------------------------


@pytest.mark.parametrize("fake_module", A2A_FAKES)
def test_identical_moealltoall_instances_share_one_workspace_like_flashinfer(fake_module):
    mod = fake(fake_module)
    _quiet()
    mnnvl = mod.comm.mnnvl
    mapping = mod.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)
    config = mnnvl.MnnvlConfig(comm_backend=OneRank())
    size = mod.moe_a2a_get_workspace_size_per_rank(1, 4, 2 * H + 16, 2 * H)
    a = mod.MoeAlltoAll(mapping, 4, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
    b = mod.MoeAlltoAll(mapping, 4, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
    assert a.workspace is b.workspace and a.metainfo is b.metainfo
    key = next(k for k, v in mod.MoeAlltoAll._WORKSPACE_CACHE.items() if v["workspace"] is a.workspace)
    assert len(key) == len(vendor.profile(mod.VERSION).cache_key)
    c = mod.MoeAlltoAll(mapping, 4, 2, E, workspace_size_per_rank=size + 128, mnnvl_config=config)
    assert c.workspace is not a.workspace


def run_two_in_flight(rank: int, world: int, fake_module: str) -> dict:
    _quiet()
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=8)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    other = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    g = torch.Generator().manual_seed(rank)
    xa, xb = (torch.randn(8, H, generator=g).to(torch.bfloat16) for _ in range(2))
    ia = torch.randint(0, E, (8, 1), generator=g).repeat(1, 2)
    ia[:, 1] = (ia[:, 0] + 1) % E
    ib = (ia + 3) % E
    w = torch.rand(8, 2, generator=g)
    first, second = d.dispatch(xa, ia, w), d.dispatch(xb, ib, w)
    yc = round_trip(other, xb, ib, w)  # another dispatcher of the same shape, between them
    ya = d.combine(first.hidden_states, first)
    yb = d.combine(second.hidden_states, second)
    ptrs = {inst.workspace.data_ptr() for disp in (d, other) for inst in disp._impl.instances}  # noqa: SLF001
    return {"a": relative_error(ya, reference(xa, ia, w)), "b": relative_error(yb, reference(xb, ib, w)),
            "c": relative_error(yc, reference(xb, ib, w)), "workspaces": len(ptrs)}


def test_in_flight_dispatches_and_other_dispatchers_own_distinct_workspaces(moe_rank_pools):
    for r in moe_rank_pools.get(2).map(run_two_in_flight, EMULATOR):
        assert r["workspaces"] == 4, r
        assert max(r["a"], r["b"], r["c"]) < 1e-2, r


@pytest.mark.parametrize("fake_module", [FAKE_0_6_13, FAKE_0_7_2])
def test_a_default_sized_moealltoall_created_later_gets_its_own_workspace(fake_module):
    """FlashInfer's default size (``hidden_size=H``: 2H + 8k dispatch bytes, 2H combine) is the
    adapter's BF16 size; the cache key has no top-k, so the dispatcher's sizes are that + 64 B +
    128 B × slot."""
    mod, tokens = fake(fake_module), 29  # a max-tokens no other test uses: nothing cached for it
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=tokens)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    mine = {inst.workspace.data_ptr() for inst in d.backend_dispatcher.instances}
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend())
    other = mod.MoeAlltoAll(one_rank(mod), tokens, 2, 2 * E, hidden_size=H, mnnvl_config=config)  # other experts
    assert other.workspace.data_ptr() not in mine
    default = mod.moe_a2a_get_workspace_size_per_rank(1, tokens, 2 * H + 8 * 2, 2 * H)
    assert {inst.workspace_size_per_rank for inst in d.backend_dispatcher.instances} == {default + 64,
                                                                                           default + 192}
    x, ids, w = torch.randn(3, H).to(torch.bfloat16), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    out = d.dispatch(x, ids, w)
    assert relative_error(d.combine(out.hidden_states, out), x.float() * 2) < 1e-2


@pytest.mark.parametrize("fake_module", [FAKE_0_6_13, FAKE_0_7_2])
def test_no_flashinfer_sized_moealltoall_shares_a_dispatcher_workspace(fake_module):
    """R=1, T=2, top-2: FlashInfer's default size for top-10 (and other top-k / dtypes) is
    FlashInfer's size of the dispatcher's shape + 128 B; the cache key has no top-k, so with sizes of
    FlashInfer's size + 128 B × slot such a MoeAlltoAll built later got the dispatcher's workspace.
    Every size FlashInfer's function gives is a multiple of 128."""
    mod, tokens = fake(fake_module), 2  # a max-tokens no other test uses: nothing cached for it
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=tokens)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    instances = d.backend_dispatcher.instances
    mine = {inst.workspace.data_ptr() for inst in instances}
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend())
    top_ks = vendor.top_k_values(mod.VERSION)
    others = [mod.MoeAlltoAll(one_rank(mod), tokens, k, E, hidden_size=H, mnnvl_config=config) for k in top_ks]
    others += [mod.MoeAlltoAll(one_rank(mod), tokens, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
               for size in flashinfer_sizes(mod.moe_a2a_get_workspace_size_per_rank, 1, tokens, top_ks)]
    shared = sorted({o.workspace_size_per_rank for o in others if o.workspace.data_ptr() in mine})
    assert not shared, f"FlashInfer-sized MoeAlltoAll of sizes {shared} share a dispatcher workspace"
    assert all(o.workspace_size_per_rank % vendor.CACHELINE == 0 for o in others)
    x, ids, w = torch.randn(2, H).to(torch.bfloat16), torch.tensor([[0, 1]] * 2), torch.ones(2, 2)
    out = d.dispatch(x, ids, w)
    assert relative_error(d.combine(out.hidden_states, out), x.float() * 2) < 1e-2


# -- the workspace size of each version ------------------------------------------------------------


@pytest.mark.parametrize("fake_module", A2A_FAKES)
def test_ported_workspace_formula_equals_each_versions_size_function(fake_module):
    mod = fake(fake_module)
    for ep, t, disp, comb in ((8, 128, 2 * 7168 + 64, 2 * 7168), (2, 16, 96, 512), (64, 1, 4, 2), (3, 7, 33, 17)):
        assert vendor.ported_workspace_size_per_rank(ep, t, disp, comb, mod.VERSION) == \
            mod.moe_a2a_get_workspace_size_per_rank(ep, t, disp, comb)


def test_workspace_size_at_ep8_t128_h7168_top8_grows_with_kmaxtopk_22():
    per_token = 2 * 7168 + 8 * 8  # bf16 row, int32 ids, fp32 weights (top-8)
    assert vendor.ported_workspace_size_per_rank(8, 128, per_token, 2 * 7168, (0, 6, 7)) == 29_434_240
    for version in ((0, 6, 8), (0, 6, 17), (0, 7, 2)):
        assert vendor.ported_workspace_size_per_rank(8, 128, per_token, 2 * 7168, version) == 29_448_576
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, output_dtype="bf16")
    size = FlashInferA2ABackend(FAKE_0_6_13).buffer_size(spec, 8)
    assert size.dispatch_bytes + size.combine_bytes == 29_448_576
    assert size.allocated_bytes == 2 * 29_448_576 + 64 + 192  # two workspaces, keys 64 B and 192 B larger


def test_workspace_size_follows_flashinfers_layout():
    # calculateOffsets(8, 128), kMaxTopK 8 (<= v0.6.7): 72 →128 +32 →256 +32 →384 +4096 =4480 +4096 =8576.
    assert vendor.aux_data_size(8, 128, (0, 6, 7)) == 8576
    # kMaxTopK 22 (v0.6.8+): 384 + 11264 = 11648 (aligned) + 11264 = 22912.
    assert vendor.aux_data_size(8, 128, (0, 7, 2)) == 22912
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, output_dtype="bf16")
    size = FlashInferA2ABackend(FAKE_0_7_2).buffer_size(spec, 8)
    per_token = 2 * 7168 + 8 * 8  # bf16 row, int32 ids, fp32 weights
    assert size.dispatch_bytes == 22912 + 8 * 128 * per_token and size.combine_bytes == 8 * 128 * 2 * 7168
    nvfp4 = FlashInferA2ABackend(FAKE_0_7_2).buffer_size(spec.with_dtype(md.DispatchDtype.NVFP4), 8)
    assert nvfp4.dispatch_bytes == 22912 + 8 * 128 * (4032 + 64) and nvfp4.combine_bytes == size.combine_bytes


def test_one_sided_workspace_follows_calculate_workspace_layout():
    """0.7.4's calculateWorkspaceLayout (csrc/nvlink_one_sided_alltoall.cu:125-208) by hand at R 8, T 128, top-8,
    bf16 H 7168: counters and flags to 160, the two top-k tables (4096 B each) from 256 and 4352 (128-aligned),
    the dispatch region at 8448 holding 1024 rows x (14336 + 64) + 4 x 256 = 14,746,624 B, the combine flags,
    the combine flags (32 B, to 14,755,104), the combine region 256-aligned at 14,755,328 holding 1024 x 14336 B."""
    layout = vendor.ep_workspace_layout(8, 128, 8, vendor.ep_dispatch_bytes(1024, 14336, 8), 1024 * 14336)
    assert (layout["TOPK_TARGET_RANKS_OFFSET"], layout["TOPK_TARGET_INDICES_OFFSET"]) == (256, 4352)
    assert (layout["DISPATCH_PAYLOAD_OFFSET"], layout["DISPATCH_PAYLOAD_SIZE"]) == (8448, 14_746_624)
    assert (layout["COMBINE_INPUT_OFFSET"], layout["WORKSPACE_SIZE"]) == (14_755_328, 29_435_392)
    # The dispatcher's first workspace asks for 1 extra byte per token (1024 rows fill a 256-byte alignment), so that
    # no FlashInfer user's default instance shares it: 1024 more bytes before the combine region.
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, output_dtype="bf16")
    size = FlashInferA2ABackend(EMULATOR).buffer_size(spec, 8)
    assert vendor.ep_distinct_extra(0, 8, 128) == 1
    assert (size.dispatch_bytes, size.combine_bytes) == (14_755_328 + 1024, 1024 * 14336)
    fp8 = FlashInferA2ABackend(EMULATOR).buffer_size(spec.with_dtype(md.DispatchDtype.FP8), 8)
    assert fp8.dispatch_bytes == 8448 + vendor.ep_dispatch_bytes(1024, 7168 + 4 * 56, 8, 1) + 256  # DeepSeekFp8 rows


@pytest.mark.parametrize("fake_module", [FAKE_0_6_13, FAKE_0_7_2])
def test_a_full_workspace_fits_dispatch_and_combine_with_kmaxtopk_22(moe_rank_pools, fake_module):
    errors = moe_rank_pools.get(2).map(run_layer, fake_module, 8, 0.0)
    assert max(errors) < 1e-2


def test_the_fake_all_to_all_refuses_a_small_workspace():
    mod = fake(FAKE_0_7_2)
    m = mod.Mapping(world_size=1, rank=0, moe_ep_size=1)
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=mod.comm.mnnvl.MPIBackend())  # a one-rank world
    a2a = mod.MoeAlltoAll(m, 4, 2, 4, workspace_size_per_rank=5000, mnnvl_config=config)
    with pytest.raises(RuntimeError, match="workspace size per rank insufficient"):
        a2a.dispatch(torch.zeros(4, 2, dtype=torch.int32), [torch.zeros(4, 2048, dtype=torch.bfloat16)], 4)


# -- buffer_size and the in_flight pool -----------------------------------------------------------------


@pytest.mark.parametrize("fake_module,extra", [(FAKE_0_7_2, 128 * 3), (EMULATOR, 3 * 256)])
def test_buffer_size_counts_the_in_flight_workspaces(fake_module, extra):
    """Three workspaces: each slot 128 B larger (MoeAlltoAll), or 8 extra bytes for each of R·T = 32 rows
    (0.7.4: slots 1 and 2 add 256 and 512 B to the dispatch region)."""
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=16, output_dtype="bf16")
    one = FlashInferA2ABackend(fake_module, in_flight=1).buffer_size(spec, 2)
    three = FlashInferA2ABackend(fake_module, in_flight=3).buffer_size(spec, 2)
    assert three.total_bytes == 3 * one.total_bytes + extra
    with pytest.raises(md.InvalidSpecError) as info:
        md.create_dispatcher(FlashInferA2ABackend(EMULATOR), spec, env={}, options={"in_flight": 3})
    assert info.value.parameter == "options.in_flight"


def test_buffer_size_counts_the_slots():
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, output_dtype="bf16")
    for in_flight in (1, 2, 3):
        size = FlashInferA2ABackend(FAKE_0_6_13, in_flight=in_flight).buffer_size(spec, 8)
        one = size.dispatch_bytes + size.combine_bytes
        assert size.allocated_bytes == in_flight * (one + 64) + 128 * in_flight * (in_flight - 1) // 2


def _three_in_flight(rank: int, world: int) -> str | None:
    d = md.create_dispatcher(FlashInferA2ABackend(EMULATOR), md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4),
                             env={})
    x, ids, w = torch.zeros(4, H, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    ids[:, 1] = 1
    first, second = d.dispatch(x, ids, w), d.dispatch(x, ids, w)
    try:
        d.dispatch(x, ids, w)
    except md.CapacityError as exc:
        d.combine(torch.zeros_like(first.hidden_states), first)
        d.combine(torch.zeros_like(second.hidden_states), second)
        d.dispatch(x, ids, w)  # a workspace is free again
        return exc.parameter
    return None


def test_a_third_dispatch_in_flight_names_the_option(moe_rank_pools):
    errors = moe_rank_pools.get(1).map(_three_in_flight)
    assert errors == ["in_flight"]


# -- 0.7.4: NVLinkOneSidedAlltoAll's workspaces, shared per layout ------------------------------------------------


def run_default_instance_after(rank: int, world: int) -> tuple[bool, int]:
    mod = fake(EMULATOR)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    d = md.create_dispatcher(FlashInferA2ABackend(EMULATOR), spec, env={})
    ep = mod.moe_ep
    default = ep.create_communication(ep.BootstrapConfig(world_size=world, rank=rank),
                                      ep.MoEEpCommParams(num_experts=E, top_k=2, max_tokens_per_rank=4, hidden_size=H),
                                      ep.NVLinkOneSidedConfig(comm_backend=LocalCommBackend() if world == 1 else
                                                              mod.comm.mnnvl.TorchDistBackend()))
    mine = {inst.workspace.data_ptr() for inst in d._impl.instances}  # noqa: SLF001
    return default.workspace.data_ptr() in mine, len(mine)


def test_no_default_flashinfer_instance_shares_a_dispatchers_workspace(moe_rank_pools):
    """FlashInfer 0.7.4 shares a workspace per layout: a default instance (extra bytes 0, what vLLM and sglang build)
    of the dispatcher's shape made later gets its own (every slot asks for extra bytes)."""
    for shared, count in moe_rank_pools.get(2).map(run_default_instance_after):
        assert not shared and count == 2


def test_the_first_free_slot_is_past_every_held_one_however_far():
    from moe_dispatch_flashinfer_cutedsl.backend import _first_free_ep_slot

    backend = FlashInferA2ABackend(EMULATOR)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4, output_dtype="bf16")

    def layout_of(j: int) -> dict:
        return backend._ep_layout(spec, 2, j)  # noqa: SLF001

    class Held:
        _WORKSPACES = {(0, 2, tuple(layout_of(j)[n] for n in vendor.EP_METAINFO_NAMES)): {} for j in (0, 40)}

    assert _first_free_ep_slot(Held, 0, 2, layout_of) == 41
    assert _first_free_ep_slot(Held, 1, 2, layout_of) == 0  # another rank's workspaces


def test_a_top_k_padded_past_the_experts_and_a_gpu_without_nvlink_are_refused_before_flashinfer(monkeypatch):
    with pytest.raises(md.InvalidSpecError) as info:  # top-5 runs as top-6: MoEEpCommParams' ValueError
        FlashInferA2ABackend(EMULATOR).check_spec(md.DispatchSpec(H, 5, 5), 1)
    assert info.value.parameter == "top_k"
    FlashInferA2ABackend(EMULATOR).check_spec(md.DispatchSpec(H, 6, 5), 1)
    monkeypatch.setattr(fake(EMULATOR).moe_ep.NVLinkOneSidedAlltoAll, "is_platform_supported", classmethod(
        lambda cls: False))
    with pytest.raises(md.BackendUnavailableError, match="NVLink"):  # agreement(), on the rank's own thread
        md.create_dispatcher(FlashInferA2ABackend(EMULATOR), md.DispatchSpec(H, E, 2), env={})
