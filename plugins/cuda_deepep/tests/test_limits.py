"""DeepEP's limits, refused before DeepEP is touched: what its host and device asserts accept, per mode, EP size,
config, reservation and release, as typed errors naming the parameter (``check_spec``, ``check_options``, the
buffer plan, ``probe()``), with the fake asserting the same where the adapter could meet it.

Past 8 ranks the fakes cannot run normal mode (a CPU pool of 16 ranks is too slow for this suite): those rules are
checked on the functions that decide them, with the fake Buffer executing what they call.
"""

import sys
import types

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch.backend import Comm, make_codec, restored_environ
from moe_dispatch_cuda_deepep import buffers, vendor
from moe_dispatch_cuda_deepep.backend import DeepEPBackend
from moe_dispatch_cuda_deepep_testing import EMULATOR, FAKES
from moe_dispatch_cuda_deepep_testing.fakes import _native
from moe_dispatch_cuda_deepep_testing.support import H, fake_module, ll_spec, normal_spec, outcome_of, world_group
from moe_dispatch_testing.signatures import differences

# -- EP sizes, experts, top-k ---------------------------------------------------------------------------------


def test_ep_sizes_are_below_8_or_multiples_of_8_in_every_mode():
    """The Buffer constructor asserts ``num_ranks < 8 or num_ranks % 8 == 0`` in every mode: low-latency mode runs on 1,
    6, 16, 24 ranks and refuses 12, naming ``world_size``."""
    backend = DeepEPBackend(EMULATOR)
    for world in (1, 6, 16, 24):
        backend.check_spec(md.DispatchSpec(7168, 48 * 8, 8, mode="low_latency"), world)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 12 * 8, 8, mode="low_latency"), 12)
    assert info.value.parameter == "world_size" and "multiple of 8" in info.value.allowed


def test_top_k_past_eight_nodes():
    """Internode dispatch sends a token to at most 8 RDMA ranks (``num_topk_ranks <= kNumTopkRDMARanks``): past 64
    ranks, where a top-k above 8 can span more nodes, top-k is at most 8."""
    backend = DeepEPBackend(EMULATOR)
    backend.check_spec(md.DispatchSpec(7168, 64 * 8, 9, output_dtype="bf16"), 64)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 128 * 2, 9, output_dtype="bf16"), 128)
    assert info.value.parameter == "top_k" and info.value.allowed == "1..8"


def test_rdma_ranks_of_deepep_1_0_and_1_1():
    """DeepEP 1.1.0 lost RDMA ranks 3, 18 and 20 on 2025-06-24 (bc118b2) and got 18/20 back only on 2025-08-11
    (d9767ce): the safe set for 1.1.x is {2, 4, 8, 16}; 1.0 has {2, 3, 4, 8, 16, 18, 20}."""
    v11 = vendor.release_of(types.SimpleNamespace(__version__="1.1.0"))
    assert v11.rdma_ranks == {2, 4, 8, 16} and 24 not in v11.world_sizes
    v10 = vendor.release_of(types.SimpleNamespace(__version__="1.0.0"))
    assert v10.rdma_ranks == {2, 3, 4, 8, 16, 18, 20}


def test_low_latency_needs_two_experts_and_few_warp_groups():
    """The LL dispatch kernel device-asserts ``num_sms > 1`` (one expert) and ``num_warp_groups < 15`` (``ceil(E /
    device SMs)``): both refused at ``check_spec``, naming ``num_experts``."""
    backend = DeepEPBackend(EMULATOR)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_spec(md.DispatchSpec(7168, 1, 1, mode="low_latency"), 1)
    assert info.value.parameter == "num_experts"
    with pytest.raises(md.InvalidSpecError, match="warp groups"):
        backend.check_spec(md.DispatchSpec(7168, 15 * vendor.H100_NUM_SMS, 8, mode="low_latency"), 4)


def _pcie(rank, world):
    fake = fake_module()
    saved = fake.EMULATED_DEVICE_NAME
    fake.EMULATED_DEVICE_NAME = "NVIDIA A100-PCIE-40GB"
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            return outcome_of(lambda: fake.Buffer(world_group(), 1 << 20) and "made")[:1]
    finally:
        fake.EMULATED_DEVICE_NAME = saved


def test_pcie_gpus_pair_only(moe_rank_pools):
    """DeepEP's constructor asserts ``group.size() <= 2`` when the device name has 'PCIE'
    (``check_nvlink_connections``): the fake asserts it on 4 ranks, and ``check_spec`` refuses such a group, naming
    ``world_size``."""
    assert moe_rank_pools.get(4).map(_pcie) == [("AssertionError",)] * 4
    fake = fake_module()
    saved = fake.EMULATED_DEVICE_NAME
    fake.EMULATED_DEVICE_NAME = "NVIDIA A100-PCIE-40GB"
    try:
        with pytest.raises(md.InvalidSpecError) as info:
            DeepEPBackend(EMULATOR).check_spec(ll_spec(4), 4)
        assert info.value.parameter == "world_size"
        DeepEPBackend(EMULATOR).check_spec(ll_spec(2), 2)
    finally:
        fake.EMULATED_DEVICE_NAME = saved


# -- normal mode: hidden sizes, configs, QPs ------------------------------------------------------------------


def _intranode_hidden_8192(rank, world):
    fake = fake_module()
    cfg = fake.Buffer.get_dispatch_config(world)
    try:
        with restored_environ(names=vendor.NVSHMEM_WRITTEN):
            buf = fake.Buffer(torch.distributed.group.WORLD, cfg.get_nvl_buffer_size_hint(2 * 8192, world))
        ids = torch.tensor([[0, 4]] * 2)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, 8)
        buf.dispatch(torch.zeros(2, 8192, dtype=torch.bfloat16), num_tokens_per_rank=per_rank,
                     is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
                     topk_weights=torch.ones(2, 2), config=cfg)
    except RuntimeError as exc:
        return str(exc)
    finally:
        _native.reset_context()
    return None


def test_normal_mode_hidden_limits(moe_rank_pools):
    """The normal kernels stage a token in TMA shared memory: within a node half the hidden bytes + 8 <= 8192 (BF16 H <
    8192; FP8 halves the bytes), across nodes a whole token + 8 <= 16384 and the BF16 combine's ``hidden_int4 % 32`` (H
    % 256). ``buffer_size`` refuses them naming ``hidden_size``; the fake's dispatch device-asserts."""
    backend = DeepEPBackend(EMULATOR)
    with pytest.raises(md.InvalidSpecError) as info:
        backend.buffer_size(md.DispatchSpec(8192, 64, 8, output_dtype="bf16"), 8)
    assert info.value.parameter == "hidden_size"
    backend.buffer_size(md.DispatchSpec(8192, 64, 8, output_dtype="fp8"), 8)  # FP8 halves the bytes
    with pytest.raises(md.InvalidSpecError):
        backend.buffer_size(md.DispatchSpec(7168 + 128, 16 * 8, 8, output_dtype="fp8"), 16)  # BF16 combine: H % 256
    backend.buffer_size(md.DispatchSpec(7168, 16 * 8, 8, output_dtype="fp8"), 16)
    errors = moe_rank_pools.get(2).map(_intranode_hidden_8192)
    assert all(e and "unspecified launch failure" in e for e in errors), errors


def test_ue8m0_scale_words_are_counted_as_sent(monkeypatch):
    """Audit finding 9: UE8M0 scales travel four exponents per int32 word, ceil(H/512) words per token as
    ``pack_ue8m0`` sends them (H % 512 may be nonzero: the hidden multiple is 128); the TMA staging limit counts them
    so, not ``H // 512``."""
    seen = []
    real = vendor.normal_hidden_problems
    monkeypatch.setattr(vendor, "normal_hidden_problems", lambda *a: seen.append(a[2]) or real(*a))
    spec = md.DispatchSpec(640, 16, 2, output_dtype="fp8", quant=md.QuantHints(fp8_ue8m0_scales=True))
    DeepEPBackend(EMULATOR)._check_hidden(spec, 2)
    DeepEPBackend(EMULATOR)._check_hidden(md.DispatchSpec(640, 16, 2, output_dtype="fp8"), 2)
    assert seen == [2, 5]  # ceil(640/512) packed words; 640/128 fp32 scales


def test_internode_normal_qps_cover_the_configs_sms():
    """Internode dispatch device-asserts ``num_rc_per_pe == num_channels or >= num_sms``: the Buffer a normal layer past
    8 ranks asks for has QPs per peer that cover its configs' SMs, and the fake's internode checks assert the rule."""
    fields = vendor.ConfigFields(32, 6, 288, 12, 128)
    spec = md.DispatchSpec(7168, 16 * 8, 8, output_dtype="bf16")
    request = DeepEPBackend(EMULATOR).buffer_request(spec, 16, {"dispatch_config": fields,
                                                                      "combine_config": fields})
    assert request.num_sms == 32 and vendor.internode_qps_ok(request.num_qps_per_rank, 32)
    assert not vendor.internode_qps_ok(24, 32) and vendor.internode_qps_ok(16, 32)
    with pytest.raises(RuntimeError, match="num_rc_per_pe"):  # the fake's internode checks say the same
        fake_module().internode_dispatch_checks(16, 24, fields, 7168 * 2, 0, 8)


def test_user_configs_must_be_readable():
    """A ``deep_ep.Config`` hides its fields, so its SMs cannot be compared with the tuned config's (a mismatch fails at
    the first combine: ``channel_prefix_matrix.size(1) == num_channels``): user configs are ``ConfigFields`` or dicts,
    and both directions need the SMs of the tuned ``Buffer.num_sms``."""
    spec = md.DispatchSpec(H, 8, 2, output_dtype="fp8")
    with pytest.raises(md.InvalidSpecError) as info:
        DeepEPBackend(EMULATOR).check_options(spec, 2, {"dispatch_config": fake_module().Config(24, 6, 256, 6, 128)})
    assert info.value.parameter == "options.dispatch_config" and "ConfigFields" in info.value.allowed
    with pytest.raises(md.InvalidSpecError, match="num_sms"):  # the other one is tuned: Buffer.num_sms = 20
        DeepEPBackend(EMULATOR).check_options(spec, 2, {"dispatch_config": vendor.ConfigFields(24, 6, 256, 6,
                                                                                                      128)})


def test_internode_combine_config_asserts_are_typed():
    """``internode::combine`` host-asserts on the config past 8 ranks (NVL receive chunk a multiple of the RDMA ranks,
    room for the forwarder warps): ``check_options`` refuses such a config, naming ``options.combine_config``."""
    backend = DeepEPBackend(EMULATOR)
    spec = md.DispatchSpec(7168, 24 * 8, 8, output_dtype="bf16")
    bad = vendor.ConfigFields(20, 6, 256, 6, 128)  # 256 % 3 != 0
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_options(spec, 24, {"dispatch_config": bad, "combine_config": bad})
    assert info.value.parameter == "options.combine_config" and "% num_rdma_ranks" in str(info.value)
    good = vendor.ConfigFields(20, 6, 288, 8, 128)
    backend.check_options(spec, 24, {"dispatch_config": good, "combine_config": good})


def test_config_num_sms_bounds():
    """A config's ``num_sms`` must be one DeepEP's kernels launch: not 0 (no channel), not 2 past 8 ranks
    (``num_channels * 2 > 3``), not 58 past 8 ranks (8 KiB of shared memory per channel, 227 KiB at most), not more than
    the GPU's SMs (a cooperative launch). The tuned configs' ``Buffer.num_sms`` (class state an engine may set) is
    checked too, naming ``deep_ep.Buffer.num_sms``."""
    backend = DeepEPBackend(EMULATOR)
    for sms, world in ((0, 8), (2, 16), (58, 16), (vendor.H100_NUM_SMS + 2, 8)):
        fields = vendor.ConfigFields(sms, 6, 288, 12, 128)
        with pytest.raises(md.InvalidSpecError) as info:
            backend.check_options(normal_spec(world), world, {"dispatch_config": fields, "combine_config": fields})
        assert info.value.parameter == "options.dispatch_config" and "num_sms" in str(info.value), (sms, world)
    ok = vendor.ConfigFields(56, 6, 288, 12, 128)
    backend.check_options(normal_spec(16), 16, {"dispatch_config": ok, "combine_config": ok})
    fake = fake_module()
    try:
        fake.Buffer.set_num_sms(0)
        with pytest.raises(md.InvalidSpecError) as info:
            DeepEPBackend(EMULATOR).buffer_size(normal_spec(8), 8)
        assert info.value.parameter == "deep_ep.Buffer.num_sms"
    finally:
        fake.Buffer.set_num_sms(vendor.DEFAULT_NUM_SMS)


# -- reservations -------------------------------------------------------------------------------------------


def test_buffer_bytes_pairs_are_checked_per_mode():
    """``buffer_bytes=(nvl, rdma)``: RDMA bytes in normal mode within 8 ranks fail the constructor's assert; NVL bytes
    on an LL Buffer of 1, 3, 5, 6 or 7 ranks make its destructor throw (``intranode::barrier`` has no kernel for them:
    ``std::terminate``). Both are refused, naming ``options.buffer_bytes``; the pairs DeepEP takes pass."""
    backend = DeepEPBackend(EMULATOR)
    for spec, world, pair in ((ll_spec(6), 6, (1 << 20, 1 << 30)), (normal_spec(8), 8, (1 << 28, 1 << 20))):
        with pytest.raises(md.InvalidSpecError) as info:
            backend.check_options(spec, world, {"buffer_bytes": pair})
        assert info.value.parameter == "options.buffer_bytes", info.value
    backend.check_options(ll_spec(8), 8, {"buffer_bytes": (1 << 20, 1 << 30)})  # normal-mode bytes for later
    backend.check_options(normal_spec(8), 8, {"buffer_bytes": (1 << 28, 0)})


def test_constructor_byte_limits_are_typed():
    """DeepEP's constructor asserts ``num_nvl_bytes <= INT_MAX or num_rdma_bytes == 0`` and each region ``/ sizeof(int4)
    < INT_MAX`` (csrc/legacy/buffer.hpp Buffer::Buffer): a reservation breaking them is a ``CapacityError`` naming
    ``options.buffer_bytes`` before anything is created."""
    backend = DeepEPBackend(EMULATOR)
    ll = ll_spec(8)
    need = backend.buffer_request(ll, 8)
    for reserve in ((2**31, need.num_rdma_bytes), 16 * vendor.INT_MAX):
        with pytest.raises(md.CapacityError) as info:
            buffers.planned_request(need, {"buffer_bytes": reserve}, 8)
        assert info.value.parameter == "options.buffer_bytes"
    normal = md.DispatchSpec(H, 32, 2, output_dtype="bf16")
    with pytest.raises(md.CapacityError):
        buffers.planned_request(backend.buffer_request(normal, 8), {"buffer_bytes": 16 * vendor.INT_MAX}, 8)
    buffers.planned_request(need, {"buffer_bytes": (vendor.INT_MAX - 127, need.num_rdma_bytes)}, 8)


# -- the oldest DeepEP driven ----------------------------------------------------------------------------------


def _deep_ep_before_ue8m0(monkeypatch, v10):
    """DeepEP 1.0 (ebfe47e) or 1.1.0 before 21efbe9 (9ec0612): ``low_latency_dispatch`` without round_scale/use_ue8m0
    (and, on 1.0, without use_fp8)."""
    base = fake_module()

    class Buffer(base.Buffer):
        if v10:
            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     async_finish=False, return_recv_hook=False):
                return base.Buffer.low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                        num_experts, async_finish=async_finish,
                                                        return_recv_hook=return_recv_hook)
        else:
            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     cumulative_local_expert_recv_stats=None, use_fp8=True, async_finish=False,
                                     return_recv_hook=False):
                return base.Buffer.low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                        num_experts, cumulative_local_expert_recv_stats,
                                                        use_fp8=use_fp8, async_finish=async_finish,
                                                        return_recv_hook=return_recv_hook)

    recorded = vendor.V10_LL_DISPATCH if v10 else vendor.V11_BEFORE_UE8M0_LL_DISPATCH
    assert differences(recorded, Buffer.low_latency_dispatch) == []
    name = f"{FAKES}.deep_ep_before_21efbe9_{'v10' if v10 else 'v11'}"  # a fake's name: no CUDA device needed
    module = types.ModuleType(name)
    module.__version__, module.Buffer, module.Config = "1.0.0" if v10 else "1.1.0", Buffer, base.Config
    module.EMULATED_NVSHMEM = base.EMULATED_NVSHMEM  # a fake (vendor.detect): it runs on CPU
    monkeypatch.setitem(sys.modules, name, module)
    return name


@pytest.mark.parametrize("v10", [True, False], ids=["1.0", "1.1-before-21efbe9"])
def test_deepep_without_round_scale_is_refused(monkeypatch, v10):
    """DeepEP 1.0.x and 1.1.0 before 21efbe9 have no ``round_scale``/``use_ue8m0`` (no ``use_fp8`` before ed7487c), and
    their normal mode asserts float32 scales: every LL dispatch would raise ``TypeError``. The supported floor is
    21efbe9, read from the installed signature: ``probe()`` and ``create`` refuse older builds, naming why."""
    name = _deep_ep_before_ue8m0(monkeypatch, v10)
    backend = DeepEPBackend(name)
    reason = backend.probe()
    assert reason is not None and "round_scale" in reason and vendor.COMMIT_UE8M0 in reason
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency", output_dtype="bf16")
    with pytest.raises(md.BackendUnavailableError, match="round_scale"):
        md.create_dispatcher(backend, spec, env={})
    resolution = mdp.resolve_output_dtype(spec, DeepEPBackend(EMULATOR), env={})
    ctx = mdb.DispatchContext(spec, resolution, Comm(None), make_codec(spec.wire_format()),
                             DeepEPBackend(EMULATOR).buffer_size(spec, 1), torch.device("cpu"))
    with pytest.raises(md.BackendUnavailableError, match="round_scale") as info:
        backend.create(ctx)
    assert info.value.parameter == vendor.REAL
    assert DeepEPBackend(EMULATOR).probe() is None
