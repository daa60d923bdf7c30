"""The second independent audit of the plugin (VENDOR.md, "Independent audit (2026-11)", round
two): one test per non-OK row, against fakes as strict as FlashInfer's source, plus the
creation agreement and the fakes' version modules. Row numbers are the audit's
(``docs/vendor-audits/2026-11/round2/flashinfer_cutedsl.md``); the same rows through FlashInfer's real Python are in
``test_real_flashinfer.py``."""

import ast
import importlib
import inspect
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_testing.accuracy import relative_error
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl.fakes import mnnvl
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend, LocalCommBackend

pytestmark = pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")

H, E = 256, 8


def _fake(name: str):  # noqa: ANN202
    return importlib.import_module(name)


def _one_rank(mod):  # noqa: ANN001, ANN202
    return mod.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)


# -- #6 WRONG: the first workspace had FlashInfer's default size ------------------------------------


@pytest.mark.parametrize("fake", [vendor.FAKE_0_6_13, vendor.FAKE_0_7_2])
def test_6_a_default_sized_moealltoall_created_later_gets_its_own_workspace(fake):
    """FlashInfer's default size (``hidden_size=H``: 2H + 8k dispatch bytes, 2H combine) is the
    adapter's BF16 size; the cache key has no top-k, so the dispatcher's sizes are that + 64 B +
    128 B × slot (round three, #1)."""
    mod, tokens = _fake(fake), 29  # a max-tokens no other test uses: nothing cached for it
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=tokens)
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    mine = {inst.workspace.data_ptr() for inst in d.backend_dispatcher.instances}
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend())
    other = mod.MoeAlltoAll(_one_rank(mod), tokens, 2, 2 * E, hidden_size=H, mnnvl_config=config)  # other experts
    assert other.workspace.data_ptr() not in mine
    default = mod.moe_a2a_get_workspace_size_per_rank(1, tokens, 2 * H + 8 * 2, 2 * H)
    assert {inst.workspace_size_per_rank for inst in d.backend_dispatcher.instances} == {default + 64,
                                                                                           default + 192}
    x, ids, w = torch.randn(3, H).to(torch.bfloat16), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    out = d.dispatch(x, ids, w)
    assert relative_error(d.combine(out.hidden_states, out), x.float() * 2) < 1e-2


def test_6_buffer_size_counts_the_slots():
    spec = md.DispatchSpec(7168, 256, 8, num_max_dispatch_tokens_per_rank=128, output_dtype="bf16")
    for in_flight in (1, 2, 3):
        size = FlashInferA2ABackend(vendor.FAKE_0_6_13, in_flight=in_flight).buffer_size(spec, 8)
        one = size.dispatch_bytes + size.combine_bytes
        assert size.allocated_bytes == in_flight * (one + 64) + 128 * in_flight * (in_flight - 1) // 2


# -- #10 RISK: an address range reserved by an allocation that failed --------------------------------


def run_after_a_failed_allocation(rank: int, world: int, fake: str, by: str) -> tuple:
    """An allocation over a one-rank group fails after reserving its range (``by`` the adapter, or
    by another user of FlashInfer's MoeAlltoAll); then a dispatcher on the 2-rank group."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = _fake(fake)
    memory = mod.comm.mnnvl.MnnvlMemory
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    with mnnvl.fresh_address_range(memory):
        mnnvl.DRIVER.free_bytes = 0  # cuMemCreate fails after new_mnnvl_memory_address reserved the range
        try:
            if by == "adapter":
                md.create_dispatcher(FlashInferA2ABackend(fake), spec, groups[rank], env={})
            else:
                config = mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend(mdb.Comm(groups[rank])))
                mod.MoeAlltoAll(_one_rank(mod), 4, 2, E, hidden_size=H, mnnvl_config=config)
            failed = "no error"
        except md.BackendUnavailableError as exc:  # the core's wrapping of a vendor failure in create
            failed = str(exc.__cause__)
        except RuntimeError as exc:
            failed = str(exc)
        finally:
            mnnvl.DRIVER.free_bytes = None
        orphan = vendor.mnnvl_reservation(memory)
        try:
            d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})  # the 2-rank group
            x, ids, w = torch.randn(4, H).to(torch.bfloat16), torch.tensor([[0, 7]] * 4), torch.ones(4, 2)
            out = d.dispatch(x, ids, w)
            larger = relative_error(d.combine(out.hidden_states, out), x.float() * 2)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            larger = f"{type(exc).__name__}: {exc}"
    return failed, orphan, larger


@pytest.mark.parametrize("fake,by", [(vendor.FAKE_0_6_13, "flashinfer"), (vendor.FAKE_0_7_2, "flashinfer"),
                                     (vendor.FAKE_0_7_2, "adapter")])
def test_10_a_range_a_failed_allocation_reserved_is_not_reused_by_a_larger_group(moe_rank_pools, fake, by):
    """FlashInfer keeps the range a failed allocation reserved (over one rank here) with no record
    of its size; the adapter sees it from the class state (or marked it full itself when its own
    creation failed) and has FlashInfer reserve a new one."""
    for failed, orphan, larger in moe_rank_pools.get(2).map(run_after_a_failed_allocation, fake, by):
        assert "CUDA_ERROR_OUT_OF_MEMORY" in failed, failed
        assert isinstance(larger, float) and larger < 1e-2, larger
        assert orphan is not None and orphan.comm_size is None, orphan  # no allocation made it
        assert (orphan.room == 0) == (by == "adapter"), orphan


def test_10_a_failed_creation_leaves_no_allocation_at_the_offset_it_failed_at():
    """NEW (next to #10): an allocation that fails inside a range that already holds workspaces
    leaves whatever it mapped at the range's current offset, and FlashInfer neither unmaps it nor
    advances the offset; the adapter marks that range full, so the next creation gets a new one."""
    fake = vendor.FAKE_0_7_0
    memory = _fake(fake).comm.mnnvl.MnnvlMemory
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=3)
    md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})  # a range holding two workspaces
    before = vendor.mnnvl_reservation(memory)
    assert before is not None and before.comm_size == 1 and before.room > 0
    mnnvl.DRIVER.free_bytes = 0
    try:
        with pytest.raises(md.BackendUnavailableError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    finally:
        mnnvl.DRIVER.free_bytes = None
    assert vendor.mnnvl_reservation(memory).room == 0  # nothing goes at the failed offset again
    start = memory.current_start_address
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    assert memory.current_start_address != start  # a new range
    x, ids, w = torch.randn(3, H).to(torch.bfloat16), torch.tensor([[0, 1]] * 3), torch.ones(3, 2)
    out = d.dispatch(x, ids, w)
    assert relative_error(d.combine(out.hidden_states, out), x.float() * 2) < 1e-2


# -- #23 RISK: the 0.7.2 DeprecationWarning under an "error" filter ----------------------------------


@pytest.mark.parametrize("fake", [vendor.FAKE_0_7_1, vendor.FAKE_0_7_2])
def test_23_create_runs_under_an_error_warnings_filter(fake):
    before = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # python -W error, pytest filterwarnings = error
        inner = list(warnings.filters)
        md.create_dispatcher(FlashInferA2ABackend(fake), md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=5),
                             env={})
        assert warnings.filters == inner  # the adapter's filter was scoped to its constructors
    assert warnings.filters == before


def test_23_only_flashinfers_deprecation_of_moealltoall_is_filtered(monkeypatch):
    kernels = _fake(vendor.FAKE_0_7_2).KERNELS
    initialize = kernels.moe_a2a_initialize

    def warns(*args, **kwargs):  # another DeprecationWarning raised during construction (injected)
        warnings.warn("moe_a2a_initialize: something else is deprecated", DeprecationWarning, stacklevel=2)
        return initialize(*args, **kwargs)

    monkeypatch.setattr(kernels, "moe_a2a_initialize", warns)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(md.BackendUnavailableError) as info:  # the core wraps what create raised
            md.create_dispatcher(FlashInferA2ABackend(vendor.FAKE_0_7_2),
                                 md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=6), env={})
    assert isinstance(info.value.__cause__, DeprecationWarning) and "something else" in str(info.value.__cause__)


# -- #32 FAKE: the 0.7.1 release has no deprecation ----------------------------------------------------


def test_32_flashinfer_0_7_1_has_its_own_fake_without_the_deprecation_warning():
    assert vendor.fake_for((0, 7, 1)) == vendor.FAKE_0_7_1 and vendor.fake_for((0, 7, 2)) == vendor.FAKE_0_7_2
    old, new = _fake(vendor.FAKE_0_7_1), _fake(vendor.FAKE_0_7_2)
    assert old.VERSION == (0, 7, 1) and (vendor.FAKE_0_7_1, (0, 7, 1)) in vendor.FAKES
    size = old.moe_a2a_get_workspace_size_per_rank(1, 3, 2 * H + 16, 2 * H) + 128 * 991
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old.MoeAlltoAll(_one_rank(old), 3, 2, E, workspace_size_per_rank=size,
                        mnnvl_config=old.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend()))
    with pytest.warns(DeprecationWarning, match="MoeAlltoAll is deprecated"):
        new.MoeAlltoAll(_one_rank(new), 3, 2, E, workspace_size_per_rank=size,
                        mnnvl_config=new.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend()))
    assert "deprecated" in vendor.detect(vendor.FAKE_0_7_2).describe()
    assert "deprecated" not in vendor.detect(vendor.FAKE_0_7_1).describe()


# -- the creation agreement: what decides FlashInfer's collective constructor --------------------------


def run_mixed(rank: int, world: int, fakes: list[str], in_flight: list[int]) -> tuple[str, str]:
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=7)
    try:
        md.create_dispatcher(FlashInferA2ABackend(fakes[rank], in_flight=in_flight[rank]), spec, env={},
                             timeout_s=20)
    except md.ConfigMismatchError as exc:
        return exc.parameter, str(exc)
    return "created", ""


@pytest.mark.parametrize("fakes,in_flight,field", [
    ([vendor.FAKE_0_7_2, vendor.FAKE_0_7_1], [2, 2], "flashinfer_a2a: FlashInfer"),
    ([vendor.FAKE_0_7_2, vendor.FAKE_0_7_2], [2, 1], "flashinfer_a2a: in_flight"),
])
def test_every_rank_agrees_on_what_decides_flashinfers_constructor(moe_rank_pools, fakes, in_flight, field):
    """Another FlashInfer on one rank (another workspace layout), or another number of workspaces
    (another number of collective allocations): refused on every rank before any allocation."""
    for parameter, _ in moe_rank_pools.get(2).map(run_mixed, fakes, in_flight, timeout_s=60):
        assert parameter == field


def run_size_function_fails(rank: int, world: int) -> str:
    kernels = _fake(vendor.FAKE_0_7_2).KERNELS

    def jit_fails(*args, **kwargs):  # FlashInfer's JIT build of the all-to-all module fails (injected)
        raise RuntimeError("Ninja build failed. Ninja output: ...")

    if rank == 1:
        kernels.moe_a2a_get_aux_data_size = jit_fails
    try:
        md.create_dispatcher(FlashInferA2ABackend(vendor.FAKE_0_7_2),
                             md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=11), env={}, timeout_s=5)
    except md.MoEDispatchError as exc:
        return f"{type(exc).__name__}: {vendor.is_environment_refusal(exc)}"
    finally:
        kernels.__dict__.pop("moe_a2a_get_aux_data_size", None)
    return "created"


def test_a_failing_size_function_on_one_rank_is_a_typed_error_on_every_rank(moe_rank_pools):
    """NEW: FlashInfer's size function (its JIT module) is called while the ranks plan and agree;
    raised as it is, the peers were left waiting in the agreement until the timeout."""
    got = moe_rank_pools.get(2).map(run_size_function_fails, timeout_s=60)
    assert got == ["PeerFailedError: True", "BackendUnavailableError: True"], got  # both name the JIT failure


# -- the fakes' version modules: one declaration each ----------------------------------------------------


@pytest.mark.parametrize("fake,version", vendor.FAKES)
def test_each_version_module_is_one_declaration_and_pickles_by_its_names(fake, version):
    module = _fake(fake)
    body = [node for node in ast.parse(inspect.getsource(module)).body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert len(body) == 1, [ast.unparse(node) for node in body]  # release.export(...)
    assert module.__version__ == ".".join(map(str, version)) and module.VERSION == version
    for name in ("MoeAlltoAll", "Mapping", "comm", "fp4_quantize", "CuteDslMoEWrapper", "MnnvlMemory",
                 "TorchDistBackend", "get_moe_alltoall_module", "moe_a2a_get_workspace_size_per_rank", "KERNELS"):
        assert name in module.__all__ and hasattr(module, name), name
    for name in ("MoeAlltoAll", "CuteDslMoEWrapper", "MnnvlMemory", "TorchDistBackend", "fp4_quantize",
                 "get_moe_alltoall_module", "moe_a2a_get_workspace_size_per_rank"):
        obj = getattr(module, name)
        assert obj.__module__ == fake and pickle.loads(pickle.dumps(obj)) is obj, name
    assert vendor.detect(fake).a2a_reason() is None
