"""The independent audit of ``flashinfer_a2a`` (VENDOR.md, "Independent audit (2026-11)"): one test
per non-OK row, each against a fake as strict as FlashInfer's source on that point. Row numbers
are the audit's (``docs/vendor-audits/2026-11/round1/flashinfer_a2a.md``)."""

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch.backend import nvfp4_global_scale
from moe_dispatch_testing.routing import random_routing
from moe_dispatch_flashinfer_cutedsl import alltoall, vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")

H, E = 256, 8


def _fake(name: str):  # noqa: ANN202
    return importlib.import_module(name)


class _OneRank:
    """A one-rank CommBackend that counts barriers."""

    def __init__(self) -> None:
        self.barriers = 0

    def Get_rank(self): return 0  # noqa: E704, N802
    def Get_size(self): return 1  # noqa: E704, N802
    def allgather(self, data): return [data]  # noqa: E704
    def bcast(self, data, root): return data  # noqa: E704
    def Split(self, color, key): return self  # noqa: E704, N802

    def barrier(self) -> None:
        self.barriers += 1


def _raw(mod, tokens: int, top_k: int, comm: _OneRank | None = None, size_extra: int = 0):  # noqa: ANN001, ANN202
    """FlashInfer's MoeAlltoAll of ``mod`` on one rank, on a workspace no other test shares."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mapping = mod.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=comm or _OneRank())
    size = mod.moe_a2a_get_workspace_size_per_rank(1, tokens, 4 * H + 8 * top_k, 2 * H) + 128 * (977 + size_extra)
    return mod.MoeAlltoAll(mapping, tokens, top_k, E, workspace_size_per_rank=size, mnnvl_config=config)


def _word(mod, inst, name: str, index: int = 0) -> torch.Tensor:  # noqa: ANN001
    """The int32 at ``metainfo[name] + 4·index`` of this rank's workspace row (a view)."""
    at = int(inst.metainfo[vendor.profile(mod.VERSION).metainfo_names.index(name)])
    return inst.workspace[inst.ep_rank][at + 4 * index : at + 4 * index + 4].view(torch.int32)


# -- #8 CRASH: a larger EP group after a smaller one in one process ---------------------------------


def run_larger_group_after_a_smaller_one(rank: int, world: int, fake: str) -> tuple:
    from moe_dispatch_flashinfer_cutedsl.fakes.mnnvl import fresh_address_range
    from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = _fake(fake)
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    with fresh_address_range(mod.comm.mnnvl.MnnvlMemory):
        md.create_dispatcher(FlashInferA2ABackend(fake), spec, groups[rank], env={})  # reserves for 1 rank
        try:
            md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})  # 2 ranks
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


@pytest.mark.parametrize("fake", [vendor.FAKE_0_6_13, vendor.FAKE_0_7_2])
def test_8_a_dispatcher_on_a_larger_group_than_the_mnnvl_reservation_is_refused(moe_rank_pools, fake):
    for adapter, raw in moe_rank_pools.get(2).map(run_larger_group_after_a_smaller_one, fake):
        assert "CUDA_ERROR_INVALID_VALUE" in raw, raw  # what FlashInfer's cuMemMap does
        assert adapter is not None and adapter[0] == "group", adapter  # the adapter refuses first, typed
        assert "reserved for 1 rank" in adapter[1], adapter


# -- #12 CRASH: misaligned receive planes (FlashInfer 0.6.0-0.7.0) ---------------------------------


@pytest.mark.parametrize("fake,faults", [(vendor.FAKE_0_6_17, True), (vendor.FAKE_0_7_0, True),
                                         (vendor.FAKE_0_7_2, False)])
def test_40_the_fake_kernels_fault_on_a_plane_the_vector_store_cannot_reach(fake, faults):
    """weights (12 B per token) then bf16 rows (512 B, 16-byte stores): with 17 tokens the row
    plane starts at 204 ≡ 12 (mod 16); FlashInfer < 0.7.1 picks the width from the row size only."""
    mod = _fake(fake)
    a2a = _raw(mod, 17, 4)
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


def test_12_every_receive_plane_is_aligned_for_every_shape():
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


def run_odd_shape(rank: int, world: int, fake: str, dtype: str, tokens: int, top_k: int, hidden: int) -> str:
    warnings.simplefilter("ignore", DeprecationWarning)
    gs = nvfp4_global_scale(6.0) if dtype == "nvfp4" else None
    spec = md.DispatchSpec(hidden, E, top_k, num_max_dispatch_tokens_per_rank=tokens, output_dtype=dtype,
                           quant=md.QuantHints(input_global_scale=gs))
    try:
        d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
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
def test_12_odd_token_counts_dispatch_on_flashinfer_before_0_7_1(moe_rank_pools, dtype, tokens, top_k, hidden):
    """R·T·k odd: the weight/id planes are 4 mod 8 bytes long; the source rows start 8 bytes off."""
    assert moe_rank_pools.get(1).map(run_odd_shape, vendor.FAKE_0_6_17, dtype, tokens, top_k, hidden) == ["ok"]


# -- #22 RISK: a combine that raises ----------------------------------------------------------------


def test_22_a_failed_combine_keeps_its_workspace_out_of_the_pool():
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    d = md.create_dispatcher(FlashInferA2ABackend(vendor.FAKE_0_6_17), spec, env={})
    x, w = torch.randn(4, H).to(torch.bfloat16), torch.ones(4, 2)
    ids = torch.tensor([[0, 1]] * 4)
    first = d.dispatch(x, ids, w)
    kernels = _fake(vendor.FAKE_0_6_17).KERNELS

    def faults_once(*args, **kwargs):  # the compiled combine traps once (a vendor failure, injected)
        del kernels.moe_a2a_combine
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kernels.moe_a2a_combine = faults_once
    with pytest.raises(RuntimeError, match="illegal memory access"):
        d.combine(first.hidden_states, first)
    assert vendor.a2a_phase(d.backend_dispatcher.instances[first.handle.instance]) == "dispatched"
    second = d.dispatch(x, ids, w)  # the other workspace, not the one FlashInfer still holds dispatched
    assert second.handle.instance != first.handle.instance
    with pytest.raises(md.CapacityError) as info:
        d.dispatch(x, ids, w)
    assert info.value.parameter == "in_flight" and "combine raised" in str(info.value)
    assert relative_error(d.combine(first.hidden_states, first), x.float() * 2) < 1e-2  # a retry completes it
    d.combine(second.hidden_states, second)
    with pytest.raises(md.InvalidInputError):
        d.combine(second.hidden_states, second)  # its round is over: FlashInfer would assert
    third = d.dispatch(x, ids, w)  # both free again; reuses the first workspace
    assert third.handle.instance == first.handle.instance
    with pytest.raises(md.InvalidInputError):
        d.combine(first.hidden_states, first)  # a stale handle must not combine the new round
    d.combine(third.hidden_states, third)


def test_22_a_dispatch_that_fails_after_flashinfer_set_its_phase_stays_out_of_the_pool():
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=3)
    d = md.create_dispatcher(FlashInferA2ABackend(vendor.FAKE_0_6_15), spec, env={})
    x, w, ids = torch.randn(3, H).to(torch.bfloat16), torch.ones(3, 2), torch.tensor([[0, 1]] * 3)
    kernels = _fake(vendor.FAKE_0_6_15).KERNELS

    def faults_once(*args, **kwargs):  # sanitize runs after FlashInfer set "dispatched"
        del kernels.moe_a2a_sanitize_expert_ids
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kernels.moe_a2a_sanitize_expert_ids = faults_once
    with pytest.raises(RuntimeError):
        d.dispatch(x, ids, w)
    assert list(d.backend_dispatcher.failed) == [0]
    out = d.dispatch(x, ids, w)  # the other workspace
    assert out.handle.instance == 1
    d.combine(out.hidden_states, out)


# -- #23 RISK: the init race before FlashInfer 0.7.1 ------------------------------------------------


def test_23_create_barriers_on_the_group_after_flashinfer_initializes_the_workspaces(monkeypatch):
    mod = _fake(vendor.FAKE_0_6_17)
    seen = []
    barrier = mdb.Comm.barrier

    def spy(self, operation="barrier"):  # noqa: ANN001, ANN202 - records, then does the barrier
        seen.append((operation, mod.KERNELS.calls.count("moe_a2a_initialize")))
        return barrier(self, operation)

    monkeypatch.setattr(mdb.Comm, "barrier", spy)
    before = mod.KERNELS.calls.count("moe_a2a_initialize")
    md.create_dispatcher(FlashInferA2ABackend(vendor.FAKE_0_6_17), md.DispatchSpec(H, E, 2,
                         num_max_dispatch_tokens_per_rank=6), env={})
    assert [n for _, n in seen if n == before + 2], seen  # after both workspaces' moe_a2a_initialize


@pytest.mark.parametrize("fake,barriers", [(vendor.FAKE_0_6_15, 0), (vendor.FAKE_0_6_17, 0), (vendor.FAKE_0_7_0, 0),
                                           (vendor.FAKE_0_7_2, 1)])
def test_24_25_flashinfer_barriers_after_initializing_a_workspace_from_0_7_1(fake, barriers):
    comm = _OneRank()
    _raw(_fake(fake), 3, 2, comm)
    assert comm.barriers == barriers


def test_24_26_the_version_facts_the_audit_corrected():
    assert vendor.A2A_INIT_BARRIER_SINCE == (0, 7, 1) and vendor.A2A_UNMAPPED_CHECK_SINCE == (0, 6, 15)
    assert vendor.A2A_DEPRECATED_SINCE == (0, 7, 2)
    assert not vendor.profile((0, 7, 1)).deprecated and vendor.profile((0, 7, 2)).deprecated
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _raw(_fake(vendor.FAKE_0_7_0), 3, 2)  # no warning before 0.7.2


# -- #27 RISK / #28 FAKE: TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN=0 ----------------------------------------


def test_27_one_block_per_token_0_is_refused_where_flashinfer_hangs(monkeypatch):
    monkeypatch.setenv(vendor.ENV_ONE_BLOCK_PER_TOKEN, "0")
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    for fake in (vendor.FAKE_0_6_7, vendor.FAKE_0_6_13):
        with pytest.raises(md.InvalidSpecError) as info:
            md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
        assert info.value.parameter == vendor.ENV_ONE_BLOCK_PER_TOKEN and "0.6.14" in info.value.allowed
    md.create_dispatcher(FlashInferA2ABackend(vendor.FAKE_0_6_14), spec, env={})  # not read any more


@pytest.mark.parametrize("env,published", [({"TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN": "0"}, False),
                                           ({"TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN": "0",
                                             "TLLM_MOE_A2A_DISPATCH_BLOCK_SIZE": "32"}, True),
                                           ({"TLLM_MOE_A2A_ONE_BLOCK_PER_TOKEN": "1"}, True)])
def test_28_the_warp_policy_of_flashinfer_before_0_6_14_never_publishes(monkeypatch, env, published):
    """With 8 warps per block the kernel's token counter counts blocks: no block is "last", so
    the receive counters and completion flags are never written (peers that did publish trap)."""
    mod = _fake(vendor.FAKE_0_6_13)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    mod.KERNELS.reset_function_statics()  # fake-only: as in a fresh process
    a2a = _raw(mod, 4, 2, size_extra=len(env) + int(published))
    try:
        ids = torch.tensor([[0, 1]] * 4, dtype=torch.int32)
        recv = a2a.dispatch(ids, [ids], 4, invalid_token_expert_id=-1, expert_id_payload_index=0)
        received = int((recv[0] >= 0).any(dim=-1).sum())
        a2a.combine(torch.zeros(1, 4, H, dtype=torch.bfloat16), 4)
    finally:
        mod.KERNELS.reset_function_statics()  # fake-only: a new process reads the variables anew
    assert received == (4 if published else 0)


# -- #37 FAKE: TorchDistBackend.Split ----------------------------------------------------------------


def run_split(rank: int, world: int, fake: str) -> tuple[int, int, int]:
    mod = _fake(fake)
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


def test_37_the_fake_torchdistbackend_splits_as_flashinfer_does(moe_rank_pools):
    for size, first, barriers in moe_rank_pools.get(2).map(run_split, vendor.FAKE_0_7_2):
        assert size == 2 and barriers == 0  # FlashInfer: new_group(ranks=...) and nothing else
        assert first == 0  # torch orders a group by global rank, whatever the keys


# -- #42 FAKE: what the combine kernel sums in ------------------------------------------------------


@pytest.mark.parametrize("fake,expected", [(vendor.FAKE_0_6_13, 1.0), (vendor.FAKE_0_6_15, 1.0),
                                           (vendor.FAKE_0_6_17, 1.0078125)])
def test_42_combine_adds_bf16_pairwise_until_0_6_16_then_in_fp32(fake, expected):
    """Three copies of a token (1, 2^-8, 2^-8) summed by the top-4 kernel: ((a0+a1)+(a2+a3)). In
    bf16 each add rounds (1 + 2^-8 ties to 1); in fp32 the sum is 1 + 2^-7, exact in bf16."""
    mod = _fake(fake)
    a2a = _raw(mod, 3, 4)
    a2a.dispatch(torch.zeros(1, 4, dtype=torch.int32), [torch.zeros(1, 4, dtype=torch.int32)], 3)
    # The routing state of a token sent to three ranks' slots 0, 1, 2 (hand-written; one rank here).
    for k, (target, slot) in enumerate([(0, 0), (0, 1), (0, 2), (-1, -1)]):
        _word(mod, a2a, "TOPK_TARGET_RANKS", k).fill_(target)
        _word(mod, a2a, "TOPK_SEND_INDICES", k).fill_(slot)
    _word(mod, a2a, "RECV_COUNTERS", 0).fill_(3)
    payload = torch.tensor([1.0, 2.0**-8, 2.0**-8]).view(1, 3, 1).expand(1, 3, H).to(torch.bfloat16).contiguous()
    out = a2a.combine(payload, 3)
    assert out.dtype == torch.bfloat16 and float(out[0, 0]) == expected


# -- #43 FAKE: the combine round ----------------------------------------------------------------------


def test_43_combine_advances_the_round_counter_and_writes_its_completion_flags():
    mod = _fake(vendor.FAKE_0_6_17)
    a2a = _raw(mod, 2, 2, size_extra=7)
    start = int(_word(mod, a2a, "FLAG_VAL"))
    ids = torch.zeros(2, 2, dtype=torch.int32)
    a2a.dispatch(ids, [ids], 2)
    assert int(_word(mod, a2a, "FLAG_VAL")) == start + 1
    assert int(_word(mod, a2a, "DISPATCH_COMPLETION_FLAGS")) == start + 1
    a2a.combine(torch.zeros(1, 2, H, dtype=torch.bfloat16), 2)
    assert int(_word(mod, a2a, "FLAG_VAL")) == start + 2
    assert int(_word(mod, a2a, "COMBINE_COMPLETION_FLAGS")) == start + 2
