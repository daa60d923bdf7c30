"""The HCCL window DeepEP-Ascend's ops and kernels need, and what creation checks: the need from the
vendor's own formulas, ``need <= the ops' window <= the group's window``, the group's window from its
``hccl_buffer_size`` option, the variables read as the vendor reads them; and the fakes' window checks."""

from __future__ import annotations

import warnings

import pytest

import moe_dispatch as md
from moe_dispatch.backend import restored_environ
from moe_dispatch_ascend_deepep import sizes
from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.backend import WINDOW_OPTION, AscendDeepEPBackend
from moe_dispatch_ascend_deepep_testing import FAKE, ascend_backend
from moe_dispatch_ascend_deepep_testing.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep_testing.fakes import torch_npu as fake_npu
from moe_dispatch_ascend_deepep_testing.support import (
    A2,
    LAYERED,
    H,
    MiB,
    batch,
    identity_reference,
    make_spec,
    normal_spec,
    on_a2,
    on_a3,
)
from moe_dispatch_testing import relative_error

HCCL, DEEPEP = v.HCCL_BUFFSIZE, v.DEEPEP_HCCL_BUFFSIZE


SMALL = make_spec(tokens=8, experts=16, top_k=2, hidden=1024)


def _dispatcher(mode: str = "normal", backend: AscendDeepEPBackend | None = None, dtype: str | None = "bf16"
                ) -> md.Dispatcher:
    spec = md.DispatchSpec(H, 4, 2, num_max_dispatch_tokens_per_rank=8, mode=mode, output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(backend or ascend_backend(FAKE), spec, env={})


# -- the need: the ops' own checks, ported ---------------------------------------------------------------------


def test_hccl_window_follows_the_vendors_formulas():
    # The README's non-layered minimum 2·(bs·R·min(E_l,k)·H·2 + 2 MB), H=7168, k=8, E=256, bs=128.
    assert [v.window_mb(v.readme_window_bytes(128, 7168, r, 256 // r, 8)) for r in (8, 16, 32)] == [228, 452, 900]
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, mode="low_latency", output_dtype="int8")
    backend = ascend_backend(FAKE, env={})
    need = max(v.ll_op_window_bytes(128, 7168, 8, 32, 8), v.readme_window_bytes(128, 7168, 8, 32, 8))
    assert backend.buffer_size(spec, 8).allocated_bytes == need
    assert sizes.required_window_mb(spec, 8, {}) == v.window_mb(need) == 956
    with pytest.raises(md.CapacityError) as info:
        sizes.check_hccl_window(956, {"HCCL_BUFFSIZE": "100"})
    assert info.value.parameter == "HCCL_BUFFSIZE" and "HCCL_BUFFSIZE=956" in str(info.value)
    with pytest.raises(md.CapacityError, match="default 200 MB"):
        sizes.check_hccl_window(956, {})
    sizes.check_hccl_window(956, {"HCCL_BUFFSIZE": "956"})
    with pytest.raises(md.InvalidSpecError):
        sizes.check_hccl_window(956, {"HCCL_BUFFSIZE": "lots"})


def _window(mode: str, env: dict[str, str], world: int = 8, tokens: int = 128) -> int:
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=tokens, mode=mode)
    (req,) = ascend_backend(FAKE, env=env).env_requirements(spec, world)
    return req.minimum


def test_the_low_latency_window_is_what_the_op_tiling_checks():
    """MoeLowLatencyCombineV2's tiling refuses HCCL_BUFFSIZE below ((T·tokD·R·E_l) + T·tokC·k)·2,
    which is 956 MB for H=7168, E=256, k=8, T=128, R=8 (the README's formula gives 228)."""
    assert v.window_mb(v.ll_op_window_bytes(128, 7168, 8, 32, 8)) == 956
    assert _window("low_latency", {}) == 956


def test_the_normal_window_is_what_the_op_tiling_checks():
    """CamMoeDispatchNormal's tiling needs (maxBs·k·(tokC + tokD) + 4 MB + 102 MB)·2: at least
    212 MB whatever the shape, so the default 200 MB always fails normal mode."""
    assert v.window_mb(v.normal_op_window_bytes(8, 1024, 2)) == 213
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="normal")
    (req,) = ascend_backend(FAKE, env={}).env_requirements(spec, 2)
    assert req.minimum == 213
    with pytest.raises(md.CapacityError):  # what create() runs, against HCCL's default 200 MB
        sizes.check_hccl_window(req.minimum, {})


def test_planning_without_the_chip_takes_the_a2_normal_window():
    """The A2 build's CamMoeDispatchNormal (ops2) checks (maxBs·k·(…) + 412 MB)·2 + 8 MB: at least 833 MB,
    against 213 MB on A3. Where the chip cannot be known (planning on a CPU machine), the larger."""
    assert v.window_mb(v.normal_op_window_bytes_a2(8, H, 2)) == 833
    (req,) = AscendDeepEPBackend(env={}).env_requirements(normal_spec(), 2)  # the real vendor, not on an NPU here
    assert req.minimum == 833
    (a3,) = AscendDeepEPBackend(env={}, soc="A3").env_requirements(normal_spec(), 2)
    assert a3.minimum == 213
    (wide,) = AscendDeepEPBackend(env={}).env_requirements(normal_spec(), 16)  # planning beyond 8 ranks: A3's
    assert wide.minimum == 213  # figure; create takes an unknown chip as A2


def test_the_a2_layered_window_follows_the_layered_formula():
    """A2 two-node (layered): E·bs·(2H + 16k) + 4 MB + 800 MB = 1256 MB here."""
    assert v.window_mb(v.layered_window_bytes(128, 7168, 256, 8)) == 1256
    layered = {v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "0"}
    assert _window("low_latency", layered, world=16) == max(1256, v.window_mb(v.ll_op_window_bytes(128, 7168, 16, 16, 8)))


def test_the_layered_window_pads_top_k_to_8():
    """moe_distribute_dispatch_v2_layered.h asserts winSize >= E·bs·(2H + 4·RoundUp(k, 8)·4) + 804 MB.
    E=256, T=512, H=1024, k=4: 256·512·(2048 + 128) B + 804 MiB = 1076 MB (the unpadded formula: 1068)."""
    assert v.layered_window_bytes(512, 1024, 256, 4) == 256 * 512 * (2 * 1024 + 16 * 8) + 804 * MiB
    assert v.layered_window_bytes(512, 1024, 256, 8) == 256 * 512 * (2 * 1024 + 16 * 8) + 804 * MiB
    (req,) = on_a2().env_requirements(make_spec("low_latency", tokens=512, experts=256, top_k=4, hidden=1024), 16)
    assert req.minimum == 1076


def test_the_a2_internode_normal_window_is_what_its_kernels_need():
    """DispatchNormalA2 / MoeDistributeCombineA2 keep 800 MB of RDMA area, a 4 MB IPC offset and 400 MB
    for the notify op in the real window; the combine asserts S·bs·(2H + 16k) + 1204 MB on it and writes
    (H + 16) bf16 per (token, expert of the server) into IPC slices of (window − 1204 MB)/R · 8.
    H=7168, k=8, T=64, R=16 (S=2), E_l=8: assert 2·64·14464 B + 1204 MiB (1206 MB); IPC
    16·ceil(64·min(8, 64)·14368/8) B + 1204 MiB = 1219 MB (the A3 op's formula gives 242 MB)."""
    (req,) = on_a2().env_requirements(make_spec(), 16)
    assert req.minimum == 1219
    (a3,) = ascend_backend(FAKE, env=LAYERED, soc="A3").env_requirements(make_spec(), 16)
    assert a3.minimum < 300
    for backend in (on_a2({**LAYERED, v.HCCL_BUFFSIZE: "300"}),
                    AscendDeepEPBackend(env={**LAYERED, v.HCCL_BUFFSIZE: "300"})):  # creation: unknown chip = A2
        with pytest.raises(md.CapacityError):
            backend.check_window(make_spec(), 16, {}, {})
    on_a2({**LAYERED, v.HCCL_BUFFSIZE: "1219"}).check_window(make_spec(), 16, {}, {})


def test_the_a2_internode_ipc_need_counts_every_expert_of_a_server():
    """AlltoAllDispatch (moe_distribute_combine_a2_layered.h) writes one (H + 16) bf16 entry per (token, expert
    of the server): with k=8 experts on one server a token takes 8 entries, more than the kernel's own assert
    (one token row plus 16k bytes of metadata) allows for. The larger is required."""
    T, H, R, k = 4096, 7168, 16, 8
    ipc = R * -(-(T * k * (2 * H + 32)) // 8) + 1204 * MiB
    assert v.normal_internode_window_bytes_a2(T, H, R, 8, k) == ipc
    assert ipc > v.normal_internode_combine_assert_bytes(T, H, R, k)


# -- creation: need <= the ops' window <= the group's window --------------------------------------------------


def small_window(rank: int, world: int) -> str:
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8)
    try:
        md.create_dispatcher(ascend_backend(FAKE, env={"HCCL_BUFFSIZE": "1"}), spec, env={})
    except md.CapacityError as exc:
        return exc.parameter or ""
    return "created"


def test_creation_refuses_a_small_hccl_window(moe_rank_pools):
    assert moe_rank_pools.get(2).map(small_window) == ["HCCL_BUFFSIZE"] * 2


def a2_create(rank: int, world: int) -> str:
    with fake_npu.soc_version(A2), restored_environ({v.HCCL_BUFFSIZE: "400"}):
        try:
            d = _dispatcher("normal", backend=ascend_backend(FAKE, env=None))
        except md.CapacityError as exc:
            return f"CapacityError {exc.parameter} {exc.allowed}"
        x, ids, w = batch(rank, 8)
        try:
            out = d.dispatch(x, ids, w)
            d.combine(out.hidden_states, out)
        except RuntimeError as exc:
            return f"RuntimeError at the first dispatch: {str(exc)[:80]}"
        return "ran"


def test_an_a2_window_below_833_mb_is_refused_at_creation(moe_rank_pools):
    assert moe_rank_pools.get(2).map(a2_create) == ["CapacityError HCCL_BUFFSIZE >= 833"] * 2


def test_deepep_hccl_buffsize_is_the_window_the_ops_check():
    """The ops' tiling reads DEEPEP_HCCL_BUFFSIZE instead of HCCL_BUFFSIZE when it is set, and
    parses either into a uint16: both are checked at creation."""
    spec = md.DispatchSpec(H, 8, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")
    (req,) = ascend_backend(FAKE, env={}).env_requirements(spec, 2)
    sizes.check_hccl_window(req.minimum, {})  # HCCL's default 200 MB is enough for this one
    for env, parameter in (({v.DEEPEP_HCCL_BUFFSIZE: "1"}, v.DEEPEP_HCCL_BUFFSIZE),
                           ({v.HCCL_BUFFSIZE: "70000"}, v.HCCL_BUFFSIZE)):
        with pytest.raises(md.MoEDispatchError) as info:  # what create() runs
            sizes.check_hccl_window(req.minimum, env)
        assert info.value.parameter == parameter


def test_deepep_hccl_buffsize_must_not_exceed_hccl_buffsize():
    """The normal kernels put their second half at DEEPEP_HCCL_BUFFSIZE/2: above HCCL_BUFFSIZE they write
    past the window. Both at least the need, and DEEPEP_HCCL_BUFFSIZE <= HCCL_BUFFSIZE (default 200)."""
    with pytest.raises(md.InvalidSpecError) as info:
        sizes.check_hccl_window(300, {v.HCCL_BUFFSIZE: "1024", v.DEEPEP_HCCL_BUFFSIZE: "4096"})
    assert info.value.parameter == v.DEEPEP_HCCL_BUFFSIZE and info.value.allowed == "300..1024"
    with pytest.raises(md.InvalidSpecError):
        sizes.check_hccl_window(150, {v.DEEPEP_HCCL_BUFFSIZE: "300"})  # HCCL_BUFFSIZE unset: 200
    sizes.check_hccl_window(300, {v.HCCL_BUFFSIZE: "1024", v.DEEPEP_HCCL_BUFFSIZE: "512"})


def oversized_deepep_window(rank: int, world: int) -> str:
    d = _dispatcher("normal")  # constructed with HCCL_BUFFSIZE=1024 (conftest): the window HCCL allocated
    x, ids, w = batch(rank, 8)
    with restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "4096"}):
        try:
            d.dispatch(x, ids, w)
        except RuntimeError as exc:
            return str(exc)
    return "dispatched"


def test_the_fake_refuses_an_ops_window_larger_than_hccl_allocated(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(oversized_deepep_window):
        assert "write past the window" in message


def window_by_max_batch(rank: int, world: int) -> str:
    import torch.distributed as dist

    with restored_environ({v.HCCL_BUFFSIZE: "215"}):  # 213 MB for one token, 222 MB for 512
        buffer = fake.Buffer(dist.group.WORLD)
        x, ids, w = batch(rank, 512 if rank == 0 else 1)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
        try:
            buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=ids, topk_weights=w)
        except RuntimeError as exc:
            return str(exc)[:90]
    return "dispatched"


def test_the_fake_sizes_the_normal_window_by_the_largest_batch_over_ranks(moe_rank_pools):
    for message in moe_rank_pools.get(2).map(window_by_max_batch):
        assert "HCCL_BUFFSIZE is too SMALL" in message


# -- the group's window: its hccl_buffer_size option -----------------------------------------------------------


def group_window_run(rank: int, world: int, env: dict[str, str], group_mb: int | None, mode: str) -> str:
    import torch.distributed as dist

    config = {} if group_mb is None else {v.HCCL_BUFFER_SIZE_KEY: group_mb}
    with fake_npu.group_hccl_config(dist.group.WORLD, config), \
            restored_environ({v.DEEPEP_HCCL_BUFFSIZE: None, **env}):  # unset unless the case sets it
        try:
            d = _dispatcher(mode, ascend_backend(FAKE), dtype=None)
        except md.MoEDispatchError as exc:
            return f"{type(exc).__name__} {exc.parameter}"
        x, ids, w = batch(rank)
        try:
            out = d.dispatch(x, ids, w)
            y = d.combine(out.hidden_states, out)
        except RuntimeError as exc:
            return f"RuntimeError {str(exc)[:70]}"
    return "ran" if relative_error(y, identity_reference(x, ids, w)) < 0.01 else "wrong"


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_the_window_is_the_groups_hccl_buffer_size(moe_rank_pools, mode):
    """A group created with ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": N} has an N MB
    window whatever HCCL_BUFFSIZE says (torch_npu: the option > HCCL_BUFFSIZE > 200). sglang sizes its MoE
    group with DEEPEP_HCCL_BUFFSIZE (sglang parallel_state.py get_torch_distributed_pg_options): that layout
    runs; a group smaller than HCCL_BUFFSIZE is refused (the kernels would write past its end)."""
    pool = moe_rank_pools.get(2)
    sglang = {v.DEEPEP_HCCL_BUFFSIZE: "2048", v.HCCL_BUFFSIZE: "400"}
    assert pool.map(group_window_run, sglang, 2048, mode) == ["ran"] * 2
    small = {v.HCCL_BUFFSIZE: "1024"}  # the ops lay out 1024 MB in the group's 300
    assert pool.map(group_window_run, small, 300, mode) == [f"InvalidSpecError {v.HCCL_BUFFSIZE}"] * 2
    over = {v.DEEPEP_HCCL_BUFFSIZE: "2048", v.HCCL_BUFFSIZE: "4096"}  # the group's 1024 is the real window
    assert pool.map(group_window_run, over, 1024, mode) == [f"InvalidSpecError {v.DEEPEP_HCCL_BUFFSIZE}"] * 2


def test_a_stated_window_for_a_group_whose_options_cannot_be_read():
    backend = ascend_backend(FAKE, env={v.HCCL_BUFFSIZE: "400", v.DEEPEP_HCCL_BUFFSIZE: "1024"}, soc="A3")
    spec = make_spec(tokens=8, experts=16, hidden=1024, top_k=2)
    with pytest.raises(md.InvalidSpecError):  # unreadable: HCCL_BUFFSIZE's 400 is taken, DEEPEP is above it
        backend.check_window(spec, 2, None, {})
    assert backend.check_window(spec, 2, None, {WINDOW_OPTION: 1024}).mb == 1024
    with pytest.raises(md.InvalidSpecError) as info:  # a stated window that contradicts the group's option
        backend.check_window(spec, 2, {v.HCCL_BUFFER_SIZE_KEY: 2048}, {WINDOW_OPTION: 1024})
    assert info.value.parameter == WINDOW_OPTION


def fake_allocated_window(rank: int, world: int) -> tuple[int, str]:
    import torch.distributed as dist

    with fake_npu.group_hccl_config(dist.group.WORLD, {v.HCCL_BUFFER_SIZE_KEY: 300}):
        buffer = fake.Buffer(dist.group.WORLD)
    x, ids, w = batch(rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, 4)
    with restored_environ({v.DEEPEP_HCCL_BUFFSIZE: "512"}):  # the ops' check passes (512 >= 213), the group is 300
        try:
            buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                            topk_idx=ids, topk_weights=w, num_worst_tokens=8)
        except RuntimeError as exc:
            return buffer.allocated_window_mb, str(exc)
    return buffer.allocated_window_mb, "dispatched"


def test_the_fake_allocates_the_groups_window(moe_rank_pools):
    """The fake's window is the one HCCL gives the group (its hccl_buffer_size option), not HCCL_BUFFSIZE."""
    for mb, message in moe_rank_pools.get(2).map(fake_allocated_window):
        assert mb == 300 and "write past the window" in message


def test_a_group_sharing_its_window_by_name_is_refused():
    """torch_npu's hccl_config["hccl_buffer_name"]: communicators with the same name share one buffer, so other
    groups' collectives overwrite DeepEP-Ascend's flags, magic and halves."""
    backend = on_a3({HCCL: "1024"})
    with pytest.raises(md.InvalidSpecError) as info:
        backend.check_window(SMALL, 2, {"hccl_buffer_name": "shared"}, {})
    assert info.value.parameter == "process_group"
    backend.check_window(SMALL, 2, {}, {})


# -- the variables, read as torch_npu (strtol) and the ops (std::stoi) read them -------------------------------


@pytest.mark.parametrize("raw,want", [("1024MB", 1024), (" 300", 300), ("lots", 200), ("70000", 70000 % 65536),
                                      ("-1", 65535), ("99999999999", 200)])
def test_the_ops_read_the_window_with_stoi_into_a_uint16(raw, want):
    assert v.ops_window_mb({v.HCCL_BUFFSIZE: raw}) == want


@pytest.mark.parametrize("raw", ["1_024", "\uff11\uff10\uff12\uff14", "1024MB", "0x400", "-1024", "0", "70000", ""])
@pytest.mark.parametrize("name", [HCCL, DEEPEP])
def test_window_variables_must_be_plain_decimal_mb(raw, name):
    """Python int("1_024") and int("１０２４") are 1024; strtol and std::stoi read 1 and nothing (so 200 or a
    refusal): the plugin believed 1024 MB."""
    env = {name: raw} if name == HCCL else {HCCL: "2048", name: raw}
    with pytest.raises(md.InvalidSpecError) as info:
        on_a3(env).check_window(SMALL, 2, {}, {})
    assert info.value.parameter == name


@pytest.mark.parametrize("raw", ["1024", " 1024", "+1024", "1024\n", "01024"])
def test_window_values_every_reader_reads_alike_are_taken(raw):
    assert on_a3({HCCL: raw}).check_window(SMALL, 2, {}, {}).mb == 1024
