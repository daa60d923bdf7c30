"""What ``flashinfer_a2a`` hands FlashInfer's dispatch and combine kernels, on fakes as strict as FlashInfer:
ids without -1 (the kernel sends -1 to rank 0, or out of bounds) padded to a top-k the kernels are built
for, contiguous payloads in an order that keeps every receive plane aligned for FlashInfer < 0.7.1's
vector stores, and what the kernels do (the warp policy that never publishes, the combine's summation
and round); combine uses the routing its dispatch was given."""

import warnings

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch_flashinfer_cutedsl import alltoall, vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend
from moe_dispatch_flashinfer_cutedsl_testing import (
    EMULATOR,
    FAKE_0_6_7,
    FAKE_0_6_13,
    FAKE_0_6_15,
    FAKE_0_6_17,
    FAKE_0_7_0,
    FAKE_0_7_2,
    FAKE_0_7_4,
)
from moe_dispatch_flashinfer_cutedsl_testing.support import (
    E,
    H,
    fake,
    metainfo_word,
    raw_moe_alltoall,
    reference,
    round_trip,
    run_layer,
)
from moe_dispatch_testing import ScaledLayer, random_routing, relative_error, routing_reuse

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")


# -- -1 ids ------------------------------------------------------------------------------------------


def run_kernel_with_invalid_ids(rank: int, world: int, fake_module: str, experts: int) -> str:
    """FlashInfer's kernel given -1 ids directly (what the adapter must never do)."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = fake(fake_module)
    mapping = mod.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)
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
    one_per_rank = moe_rank_pools.get(2).map(run_kernel_with_invalid_ids, FAKE_0_7_2, 2)
    assert all("maps to target rank -1" in m for m in one_per_rank), one_per_rank
    four_per_rank = moe_rank_pools.get(2).map(run_kernel_with_invalid_ids, FAKE_0_7_2, 8)
    assert four_per_rank == ["rows received per source: [4, 4]", "rows received per source: [0, 4]"]


@pytest.mark.parametrize("experts", [2, 8])
def test_the_adapter_never_sends_minus_one(moe_rank_pools, experts):
    # drop_prob 0.5 with top-1 and top-2 leaves tokens with no expert at all.
    for top_k in (1, 2):
        assert max(moe_rank_pools.get(2).map(run_layer, EMULATOR, top_k, 0.5, experts)) < 1e-2


def run_count_received(rank: int, world: int, fake_module: str) -> tuple[list[int], list[int]]:
    """Slots each rank received from each source, against the tokens that route there."""
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=8)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    local = E // world
    ids = torch.full((world, 8, 2), -1)
    ids[:, :4, 0] = local  # tokens 0-3 of every rank: one expert, on rank 1; tokens 4-7: none at all
    out = d.dispatch(torch.zeros(8, H, dtype=torch.bfloat16), ids[rank], torch.ones(8, 2))
    inst = d._impl.instances[out.handle.instance]  # noqa: SLF001
    names = vendor.profile(fake(fake_module).VERSION).metainfo_names
    at = int(inst.metainfo[names.index("RECV_COUNTERS")])
    got = inst.workspace[rank][at : at + 4 * world].view(torch.int32).tolist()
    d.combine(out.hidden_states, out)
    expected = [4 if rank == 1 else 0 for _ in range(world)]
    expected[rank] += 4  # this rank's own expert-less tokens, which combine to zero
    return got, expected


def test_minus_one_ids_add_no_copies_to_rank_0(moe_rank_pools):
    for got, expected in moe_rank_pools.get(2).map(run_count_received, FAKE_0_7_2):
        assert got == expected


# -- top-k, ranks, contiguity --------------------------------------------------------------------------


@pytest.mark.parametrize("fake_module,top_k", [(FAKE_0_6_7, 3), (FAKE_0_6_7, 5), (FAKE_0_6_13, 7), (FAKE_0_7_2, 11),
                                               (FAKE_0_7_4, 5), (FAKE_0_7_4, 9)])
def test_top_k_between_the_kernels_values_is_padded(moe_rank_pools, fake_module, top_k):
    assert max(moe_rank_pools.get(2).map(run_layer, fake_module, top_k, 0.2, 16)) < 1e-2


def test_top_k_beyond_kmaxtopk_and_more_than_64_ranks_are_refused():
    spec = md.DispatchSpec(H, 512, 9, num_max_dispatch_tokens_per_rank=4)
    with pytest.raises(md.InvalidSpecError) as info:
        FlashInferA2ABackend(FAKE_0_6_7).check_spec(spec, 2)
    assert info.value.parameter == "top_k" and info.value.allowed == "1..8"
    FlashInferA2ABackend(FAKE_0_6_13).check_spec(spec, 2)
    with pytest.raises(md.InvalidSpecError) as info:
        FlashInferA2ABackend(FAKE_0_7_2).check_spec(md.DispatchSpec(H, 128, 2), 128)
    assert info.value.parameter == "world_size" and info.value.allowed == "1..64"
    with pytest.raises(md.InvalidSpecError) as info:  # NVLinkOneSidedAlltoAll: kMaxRanks 256
        FlashInferA2ABackend(EMULATOR).check_spec(md.DispatchSpec(H, 512, 2), 512)
    assert info.value.parameter == "world_size" and info.value.allowed == "1..256"
    FlashInferA2ABackend(EMULATOR).check_spec(md.DispatchSpec(H, 512, 2), 1)  # 512 experts on one rank


def run_strided_inputs(rank: int, world: int, fake_module: str) -> float:
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=8)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.arange(8) % E, (torch.arange(8) + 1) % E]).t()  # [8, 2], not contiguous
    w = torch.rand(2, 8, generator=g).t()
    return relative_error(round_trip(d, x, ids, w), reference(x, ids, w))


def test_non_contiguous_routing_tensors_reach_the_kernels_contiguous(moe_rank_pools):
    assert max(moe_rank_pools.get(2).map(run_strided_inputs, EMULATOR)) < 1e-2


# -- receive planes aligned for FlashInfer < 0.7.1's vector stores ----------------------------------------


@pytest.mark.parametrize("fake_module,faults", [(FAKE_0_6_17, True), (FAKE_0_7_0, True), (FAKE_0_7_2, False)])
def test_the_fake_kernels_fault_on_a_plane_the_vector_store_cannot_reach(fake_module, faults):
    """weights (12 B per token) then bf16 rows (512 B, 16-byte stores): with 17 tokens the row
    plane starts at 204 ≡ 12 (mod 16); FlashInfer < 0.7.1 picks the width from the row size only."""
    mod = fake(fake_module)
    a2a = raw_moe_alltoall(mod, 17, 4)
    ids = torch.zeros(17, 4, dtype=torch.int32)
    try:
        a2a.dispatch(ids, [torch.ones(17, 3), torch.ones(17, H, dtype=torch.bfloat16)], 17)
        got = "no fault"
    except RuntimeError as exc:
        got = str(exc)
    finally:
        if a2a._state.phase == "dispatched":  # noqa: SLF001
            a2a.combine(torch.zeros(1, 17, H, dtype=torch.bfloat16), 17)
    assert ("misaligned address" in got) == faults, got


def test_every_receive_plane_is_aligned_for_every_shape():
    """The adapter's payload order keeps each plane at a multiple of the vector width FlashInfer
    < 0.7.1 stores it with, for every R·T·k and every wire dtype."""
    for dtype in ("bf16", "fp8", "nvfp4"):
        for hidden in (128, 256, 384, 7168):
            wire = md.DispatchSpec(hidden, 8, 1, output_dtype=dtype).wire_format()
            q = mdb.make_codec(wire, 100.0).quantize(torch.zeros(1, hidden, dtype=torch.bfloat16))
            for k in range(1, 10):
                per_token = {"data": (q.data.shape[1] * q.data.element_size(), q.data.element_size()),
                             "weights": (4 * k, 4), "ids": (4 * k, 4)}
                if q.scale is not None:
                    per_token["scale"] = (q.scale.shape[1] * q.scale.element_size(), q.scale.element_size())
                order = alltoall.payload_order(per_token)
                for slots in range(1, 40):  # R·T
                    at = 0
                    for name in order:
                        width = vendor.dispatch_vector_width(per_token[name][0])
                        assert at % width == 0, (dtype, hidden, k, slots, order, name)
                        at += slots * per_token[name][0]
                        assert at % per_token[name][1] == 0  # FlashInfer's host check


def run_odd_shape(rank: int, world: int, fake_module: str, dtype: str, tokens: int, top_k: int, hidden: int) -> str:
    warnings.simplefilter("ignore", DeprecationWarning)
    gs = nvfp4_global_scale(6.0) if dtype == "nvfp4" else None
    spec = md.DispatchSpec(hidden, E, top_k, num_max_dispatch_tokens_per_rank=tokens, output_dtype=dtype,
                           quant=md.QuantHints(input_global_scale=gs))
    try:
        d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
        g = torch.Generator().manual_seed(tokens)
        buf = torch.randn(tokens * hidden + 4, generator=g).to(torch.bfloat16)
        x = buf[4:].view(tokens, hidden)  # 8 bytes past an allocation: not 16-byte aligned
        ids, w = random_routing(tokens, E, top_k, generator=g, drop_prob=0.2)
        out = d.dispatch(x, ids, w)
        codec = mdb.make_codec(spec.wire_format(), gs)
        rows = out.hidden_states if dtype == "bf16" else codec.dequantize(
            mdb.Quantized(out.hidden_states, out.hidden_states_scale)).to(torch.bfloat16)
        y = d.combine(rows, out)
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        return f"{type(exc).__name__}: {exc}"
    ref = codec.dequantize(codec.quantize(x)).float() * ((ids >= 0).float() * w).sum(dim=1, keepdim=True)
    return "ok" if relative_error(y, ref) < 2e-2 else f"wrong result {relative_error(y, ref):.3e}"


@pytest.mark.parametrize("dtype,tokens,top_k,hidden", [("bf16", 17, 3, H), ("nvfp4", 5, 1, H), ("fp8", 7, 1, 640)])
def test_odd_token_counts_dispatch_on_flashinfer_before_0_7_1(moe_rank_pools, dtype, tokens, top_k, hidden):
    """R·T·k odd: the weight/id planes are 4 mod 8 bytes long; the source rows start 8 bytes off."""
    assert moe_rank_pools.get(1).map(run_odd_shape, FAKE_0_6_17, dtype, tokens, top_k, hidden) == ["ok"]


# -- what the kernels do ---------------------------------------------------------------------------------


@pytest.mark.parametrize("env,published", [({"TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN": "0"}, False),
                                           ({"TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN": "0",
                                             "TLLM_MOE_A2A_DISPATCH_BLOCK_SIZE": "32"}, True),
                                           ({"TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN": "1"}, True)])
def test_the_warp_policy_of_flashinfer_before_0_6_14_never_publishes(monkeypatch, env, published):
    """With 8 warps per block the kernel's token counter counts blocks: no block is "last", so
    the receive counters and completion flags are never written (peers that did publish trap)."""
    mod = fake(FAKE_0_6_13)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    mod.KERNELS.reset_function_statics()  # fake-only: as in a fresh process
    a2a = raw_moe_alltoall(mod, 4, 2, size_extra=len(env) + int(published))
    try:
        ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
        recv = a2a.dispatch(ids, [ids], 4, invalid_token_expert_id=-1, expert_id_payload_index=0)
        received = int((recv[0] >= 0).any(dim=-1).sum())
        a2a.combine(torch.zeros(1, 4, H, dtype=torch.bfloat16), 4)
    finally:
        mod.KERNELS.reset_function_statics()  # fake-only: a new process reads the variables anew
    assert received == (4 if published else 0)


@pytest.mark.parametrize("fake_module,expected", [(FAKE_0_6_13, 1.0), (FAKE_0_6_15, 1.0), (FAKE_0_6_17, 1.0078125)])
def test_combine_adds_bf16_pairwise_until_0_6_16_then_in_fp32(fake_module, expected):
    """Three copies of a token (1, 2^-8, 2^-8) summed by the top-4 kernel: ((a0+a1)+(a2+a3)). In
    bf16 each add rounds (1 + 2^-8 ties to 1); in fp32 the sum is 1 + 2^-7, exact in bf16."""
    mod = fake(fake_module)
    a2a = raw_moe_alltoall(mod, 3, 4)
    a2a.dispatch(torch.zeros(1, 4, dtype=torch.int32), [torch.zeros(1, 4, dtype=torch.int32)], 3)
    # The routing state of a token sent to three ranks' slots 0, 1, 2 (hand-written; one rank here).
    for k, (target, slot) in enumerate([(0, 0), (0, 1), (0, 2), (-1, -1)]):
        metainfo_word(mod, a2a, "TOPK_TARGET_RANKS", k).fill_(target)
        metainfo_word(mod, a2a, "TOPK_SEND_INDICES", k).fill_(slot)
    metainfo_word(mod, a2a, "RECV_COUNTERS", 0).fill_(3)
    payload = torch.tensor([1.0, 2.0**-8, 2.0**-8]).view(1, 3, 1).expand(1, 3, H).to(torch.bfloat16).contiguous()
    out = a2a.combine(payload, 3)
    assert out.dtype == torch.bfloat16 and float(out[0, 0]) == expected


def test_combine_advances_the_round_counter_and_writes_its_completion_flags():
    mod = fake(FAKE_0_6_17)
    a2a = raw_moe_alltoall(mod, 2, 2, size_extra=7)
    start = int(metainfo_word(mod, a2a, "FLAG_VAL"))
    ids = torch.zeros(2, 2, dtype=torch.int32)
    a2a.dispatch(ids, [ids], 2)
    assert int(metainfo_word(mod, a2a, "FLAG_VAL")) == start + 1
    assert int(metainfo_word(mod, a2a, "DISPATCH_COMPLETION_FLAGS")) == start + 1
    a2a.combine(torch.zeros(1, 2, H, dtype=torch.bfloat16), 2)
    assert int(metainfo_word(mod, a2a, "FLAG_VAL")) == start + 2
    assert int(metainfo_word(mod, a2a, "COMBINE_COMPLETION_FLAGS")) == start + 2


# -- combine uses the routing given to its dispatch ----------------------------------------------------------

TOKENS, TOP_K, PER_RANK = 8, 3, 4


def _combine_after_the_router_buffers_change(rank: int, world: int, fake_module: str, dtype: str):
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, output_dtype=dtype)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, d.spec.num_experts, TOP_K, generator=g, drop_prob=0.1)
    other_ids, _ = random_routing(TOKENS, d.spec.num_experts, TOP_K, generator=g)
    layer = ScaledLayer.for_rank(H, d.spec.num_experts, rank, PER_RANK)
    return tuple(routing_reuse(d, layer, x, ids, w, other_ids))


@pytest.mark.parametrize("fake_module", [FAKE_0_6_13, FAKE_0_7_2])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_combine_uses_the_routing_given_to_its_dispatch(moe_rank_pools, fake_module, dtype):
    """The caller's ids and weights are overwritten in place after dispatch (the kit's ``routing_reuse``: ids copied
    from another routing, w.mul_(0.5).add_(0.25)): combine's result is bit for bit the one without the overwrite. The
    adapter keeps what combine needs in its handle; the test keeps it so."""
    for repeatable, same, diff in moe_rank_pools.get(2).map(_combine_after_the_router_buffers_change, fake_module,
                                                            dtype):
        assert repeatable, "the round trip itself is not repeatable: the comparison below would mean nothing"
        assert same, f"combine read the overwritten routing (max difference {diff})"
