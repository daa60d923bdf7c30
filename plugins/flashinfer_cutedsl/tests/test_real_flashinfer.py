"""``flashinfer_a2a`` through FlashInfer's REAL Python (the optional vendor-code job).

flashinfer-python installs on a CPU machine; the testing distribution's ``fakes.real_python``
(``REAL_PYTHON_ON_FAKE_KERNELS``) replaces only its compiled
all-to-all module and the CUDA-driver memory under ``MnnvlMemory``. What runs as FlashInfer ships
it: ``MoeAlltoAll`` (class-level workspace cache, state machine, asserts), ``moe_a2a_dispatch``'s
workspace views, ``MnnvlMemory.get_comm`` / ``set_comm_from_config`` (the MPI fallback), ``Mapping``.
The CuTe-DSL wrapper is compared by its source (its kernels need an SM100 GPU).

A plain ``pytest`` skips this file when flashinfer is not importable; .ci/vendor runs it.
"""

import importlib
import importlib.util
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("flashinfer.comm.trtllm_moe_alltoall",
                    reason="flashinfer-python is not installed (the optional vendor-code job installs it)")

import moe_dispatch as md  # noqa: E402
import moe_dispatch.backend as mdb  # noqa: E402
from moe_dispatch.backend import nvfp4_global_scale  # noqa: E402
from moe_dispatch_flashinfer_cutedsl import vendor  # noqa: E402
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend  # noqa: E402
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend, LocalCommBackend  # noqa: E402
from moe_dispatch_flashinfer_cutedsl_testing import REAL_PYTHON_ON_FAKE_KERNELS, fake_for  # noqa: E402
from moe_dispatch_flashinfer_cutedsl_testing.support import (  # noqa: E402
    E,
    H,
    Recording,
    flashinfer_sizes,
    mnnvl_collectives,
    run_after_one_rank_allocated,
)
from moe_dispatch_testing import dispatch_with_a_bad_id, on_a_fresh_pool, random_routing, relative_error  # noqa: E402
from moe_dispatch_testing.signatures import compare, differences, signature_from_source  # noqa: E402

pytestmark = [pytest.mark.vendor_code,
              pytest.mark.filterwarnings("ignore:MoeAlltoAll is deprecated:DeprecationWarning")]
REAL = REAL_PYTHON_ON_FAKE_KERNELS


def _real():  # noqa: ANN202
    warnings.simplefilter("ignore", DeprecationWarning)
    return importlib.import_module(REAL)  # patches the installed flashinfer in this process


def _mapping(mod, rank: int, world: int):  # noqa: ANN001, ANN202
    return mod.comm.Mapping(world_size=world, rank=rank, gpus_per_node=world, tp_size=world, moe_ep_size=world)


def run_shared_workspace(rank: int, world: int) -> bool:
    mod = _real()
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend())
    size = mod.comm.moe_a2a_get_workspace_size_per_rank(world, 4, 2 * H + 16, 2 * H)
    a = mod.comm.MoeAlltoAll(_mapping(mod, rank, world), 4, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
    b = mod.comm.MoeAlltoAll(_mapping(mod, rank, world), 4, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
    return a.workspace is b.workspace and a.metainfo is b.metainfo


def test_two_identical_real_moealltoall_instances_share_one_workspace(moe_rank_pools):
    assert moe_rank_pools.get(2).map(run_shared_workspace) == [True, True]


def run_without_config(rank: int, world: int) -> list[str]:
    mod = _real()
    memory, mpi = mod.comm.mnnvl.MnnvlMemory, mod.comm.mnnvl.MpiComm
    saved = memory.comm, mpi._MPI, mpi._comm
    seen = []
    try:
        memory.comm = None  # a fresh torchrun process
        try:
            mod.comm.MoeAlltoAll(_mapping(mod, rank, world), 5, 2, E, hidden_size=H)  # a key not cached yet
        except Exception as exc:  # noqa: BLE001 - what FlashInfer raises is the point
            seen.append(f"{type(exc).__name__}: {exc}")
        # mpi4py present, no mpirun: COMM_WORLD has one rank.
        from moe_dispatch_flashinfer_cutedsl_testing.fakes.mnnvl import SingletonWorld
        memory.comm, mpi._MPI, mpi._comm = None, object(), SingletonWorld()
        try:
            mod.comm.MoeAlltoAll(_mapping(mod, rank, world), 5, 2, E, hidden_size=H)  # a key not cached yet
        except Exception as exc:  # noqa: BLE001
            seen.append(f"{type(exc).__name__}: {exc}")
    finally:
        memory.comm, mpi._MPI, mpi._comm = saved
    return seen


def test_without_mnnvl_config_real_flashinfer_falls_back_to_mpi(moe_rank_pools):
    for seen in moe_rank_pools.get(2).map(run_without_config):
        assert len(seen) == 2, seen
        assert seen[0].startswith("ImportError") or "ep_size" in seen[0], seen  # no mpi4py here: ImportError
        assert "workspace first dim must equal ep_size (1 vs. 2)" in seen[1], seen


def run_layer(rank: int, world: int, top_k: int, drop: float, experts: int, dtype: str) -> dict:
    _real()
    gs = nvfp4_global_scale(6.0) if dtype == "nvfp4" else None
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=16, output_dtype=dtype,
                           quant=md.QuantHints(input_global_scale=gs))
    backend = FlashInferA2ABackend(REAL)
    d = md.create_dispatcher(backend, spec, env={})
    g = torch.Generator().manual_seed(11 + rank)
    xs = [torch.randn(16, H, generator=g).to(torch.bfloat16) for _ in range(2)]
    routes = [random_routing(16, experts, top_k, generator=g, drop_prob=drop) for _ in range(2)]
    outs = [d.dispatch(x, ids, w) for x, (ids, w) in zip(xs, routes)]  # two in flight
    codec = mdb.make_codec(spec.wire_format(), gs)
    rows = [codec.dequantize(mdb.Quantized(o.hidden_states, o.hidden_states_scale)).to(torch.bfloat16)
            if dtype == "nvfp4" else o.hidden_states for o in outs]  # identity experts
    ys = [d.combine(r, o) for r, o in zip(rows, outs)]
    refs = [codec.dequantize(codec.quantize(x)).float() * ((ids >= 0).float() * w).sum(dim=1, keepdim=True)
            for x, (ids, w) in zip(xs, routes)]
    impl = d._impl  # noqa: SLF001
    sizes = {inst.workspace_size_per_rank for inst in impl.instances}
    ported = vendor.ported_workspace_size_per_rank(world, 16, spec.wire_format().bytes_per_token + 8 * top_k, 2 * H,
                                                   vendor.detect(REAL).version)
    return {"error": max(relative_error(y, r) for y, r in zip(ys, refs)), "workspaces": len(sizes),
            "base": min(sizes), "ported": ported}


@pytest.mark.parametrize("top_k,drop,experts,dtype", [(2, 0.0, 8, "bf16"), (1, 0.5, 2, "bf16"), (3, 0.5, 8, "bf16"),
                                                     (8, 0.3, 16, "nvfp4")])
def test_the_adapter_runs_on_flashinfers_real_python(moe_rank_pools, top_k, drop, experts, dtype):
    """Two in flight on distinct workspaces, FlashInfer's own size function (equal to the ported
    formula), the dispatcher's group, -1 ids with one expert per rank, top-k 3, the NVFP4 wire."""
    for r in moe_rank_pools.get(2).map(run_layer, top_k, drop, experts, dtype):
        assert r["workspaces"] == 2 and r["error"] < 2e-2, r
        # FlashInfer's size function (called on the real Python) equals the ported formula; each
        # workspace is that plus 64 B plus 128 B per slot number, to keep FlashInfer's cache keys apart.
        assert r["base"] > r["ported"] and (r["base"] - r["ported"]) % 128 == 64, r


def test_recorded_signatures_equal_the_installed_flashinfer():
    import flashinfer
    import flashinfer.comm.trtllm_moe_alltoall as a2a
    from flashinfer.comm.mapping import Mapping
    from flashinfer.comm.mnnvl import MnnvlConfig
    version = vendor.parse_version(flashinfer.__version__)
    live = {
        "MoeAlltoAll.__init__": a2a.MoeAlltoAll.__init__, "MoeAlltoAll.dispatch": a2a.MoeAlltoAll.dispatch,
        "MoeAlltoAll.combine": a2a.MoeAlltoAll.combine,
        "moe_a2a_get_workspace_size_per_rank": a2a.moe_a2a_get_workspace_size_per_rank,
        "Mapping.__init__": Mapping.__init__, "MnnvlConfig": MnnvlConfig.__init__,
        "fp4_quantize": flashinfer.fp4_quantize,
    }
    problems = []
    for qualname, fn in live.items():
        problems += differences(vendor.signature(qualname, version), inspect.unwrap(fn))
    # CuteDslMoEWrapper: read from its source (importing it needs nvidia-cutlass-dsl and triton).
    spec = importlib.util.find_spec("flashinfer")
    source = Path(spec.submodule_search_locations[0]) / "fused_moe" / "cute_dsl" / "fused_moe.py"
    for qualname in ("CuteDslMoEWrapper.__init__", "CuteDslMoEWrapper.run"):
        recorded = vendor.signature(qualname, version)
        problems += compare(recorded.params, signature_from_source(source, qualname), qualname)
    assert not problems, "\n".join(problems)


def test_kmaxtopk_and_payload_limits_equal_the_installed_headers():
    spec = importlib.util.find_spec("flashinfer")
    header = (Path(spec.submodule_search_locations[0]) / "data" / "csrc" / "nv_internal" / "tensorrt_llm" / "kernels"
              / "communicationKernels" / "moeAlltoAllKernels.h").read_text()
    import flashinfer
    profile = vendor.profile(vendor.parse_version(flashinfer.__version__))
    assert f"kMaxTopK = {profile.max_top_k};" in header
    assert f"kMaxPayloads = {profile.max_payloads};" in header
    assert f"kMaxRanks = {profile.max_ranks};" in header
    kernels = (header_path := Path(spec.submodule_search_locations[0]) / "data" / "csrc" / "nv_internal"
               / "tensorrt_llm" / "kernels" / "communicationKernels" / "moeAlltoAllKernels.cu").read_text()
    assert header_path.is_file()
    switch = kernels[kernels.index("#define SWITCH_TOP_K"):]
    switch = switch[: switch.index("default:")]
    assert {int(v) for v in re.findall(r"case (\d+):", switch)} == set(profile.top_k_values)


# -- MNNVL state, failures and odd shapes, through FlashInfer's real Python --------------------------


def run_larger_group(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from moe_dispatch_flashinfer_cutedsl_testing.fakes.mnnvl import fresh_address_range
    mod = _real()
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    with fresh_address_range(mod.comm.mnnvl.MnnvlMemory):
        md.create_dispatcher(FlashInferA2ABackend(REAL), spec, groups[rank], env={})
        try:
            md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={})
            adapter = None
        except md.InvalidSpecError as exc:
            adapter = exc.parameter
        try:  # FlashInfer's own MoeAlltoAll, asked for the same
            mod.MoeAlltoAll(_mapping(mod, rank, world), 4, 2, E, hidden_size=H + 128,
                            mnnvl_config=mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend()))
            raw = "no error"
        except RuntimeError as exc:
            raw = str(exc)
    return adapter, raw


def test_real_mnnvl_state_refuses_a_larger_group_after_a_smaller_one(moe_rank_pools):
    """The adapter reads FlashInfer's own class-level reservation (``_MnnvlAllocationRecord``s)."""
    for adapter, raw in moe_rank_pools.get(2).map(run_larger_group):
        assert adapter == "group" and "CUDA_ERROR_INVALID_VALUE" in raw, (adapter, raw)


def run_failed_combine(rank: int, world: int) -> list[str]:
    mod = _real()
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=5)
    d = md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={})
    x, w, ids = torch.randn(5, H).to(torch.bfloat16), torch.ones(5, 2), torch.tensor([[0, 1]] * 5)
    first = d.dispatch(x, ids, w)
    instance = d.backend_dispatcher.instances[first.handle.instance]
    seen = []

    def faults(*args, **kwargs):  # the compiled combine traps once (injected, under FlashInfer's real Python)
        del mod.KERNELS.moe_a2a_combine
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    mod.KERNELS.moe_a2a_combine = faults
    try:
        d.combine(first.hidden_states, first)
    except RuntimeError as exc:
        seen.append(type(exc).__name__)
    seen.append(instance._state.phase)  # noqa: SLF001 - FlashInfer's state machine left it dispatched
    second = d.dispatch(x, ids, w)
    seen.append(str(second.handle.instance != first.handle.instance))
    d.combine(first.hidden_states, first)
    d.combine(second.hidden_states, second)
    return seen


def test_a_failed_combine_never_hands_a_dispatched_workspace_to_the_next_dispatch(moe_rank_pools):
    assert moe_rank_pools.get(1).map(run_failed_combine) == [["RuntimeError", "dispatched", "True"]]


def run_odd(rank: int, world: int) -> float:
    _real()
    spec = md.DispatchSpec(H, E, 3, num_max_dispatch_tokens_per_rank=17)
    d = md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={})
    g = torch.Generator().manual_seed(17)
    x = torch.randn(17 * H + 4, generator=g).to(torch.bfloat16)[4:].view(17, H)
    ids, w = random_routing(17, E, 3, generator=g, drop_prob=0.2)
    out = d.dispatch(x, ids, w)
    y = d.combine(out.hidden_states, out)
    return relative_error(y, x.float() * ((ids >= 0).float() * w).sum(dim=1, keepdim=True))


def test_odd_shapes_run_through_the_real_python(moe_rank_pools):
    assert moe_rank_pools.get(1).map(run_odd)[0] < 1e-2


# -- workspaces of other MoeAlltoAll users, failed allocations, warnings ---------------------------------


def run_default_sized_after(rank: int, world: int) -> tuple[bool, bool]:
    mod, tokens = _real(), 31  # a max-tokens no other test uses: nothing cached for it
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=tokens)
    d = md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={})
    mine = {inst.workspace.data_ptr() for inst in d.backend_dispatcher.instances}
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend())
    other = mod.comm.MoeAlltoAll(_mapping(mod, 0, 1), tokens, 2, 2 * E, hidden_size=H, mnnvl_config=config)
    again = mod.comm.MoeAlltoAll(_mapping(mod, 0, 1), tokens, 2, E, hidden_size=H, mnnvl_config=config)
    return other.workspace.data_ptr() not in mine, again.workspace is other.workspace


def test_a_default_sized_real_moealltoall_created_later_gets_its_own_workspace(moe_rank_pools):
    """FlashInfer's own default size (``hidden_size=H``) is never one of the dispatcher's."""
    assert moe_rank_pools.get(1).map(run_default_sized_after) == [(True, True)]


def run_after_failed_allocation(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from moe_dispatch_flashinfer_cutedsl_testing.fakes.mnnvl import DRIVER, fresh_address_range
    mod = _real()
    memory = mod.comm.mnnvl.MnnvlMemory
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=4)
    with fresh_address_range(memory):
        DRIVER.free_bytes = 0  # cuMemCreate fails after the range was reserved
        config = mod.comm.mnnvl.MnnvlConfig(comm_backend=GroupCommBackend(mdb.Comm(groups[rank])))
        try:  # another user of FlashInfer's MoeAlltoAll, over a one-rank group
            mod.comm.MoeAlltoAll(_mapping(mod, 0, 1), 4, 2, E, hidden_size=H, mnnvl_config=config)
            failed = "no error"
        except RuntimeError as exc:
            failed = str(exc)
        finally:
            DRIVER.free_bytes = None
        orphan = vendor.mnnvl_reservation(memory)
        d = md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={})  # the 2-rank group
        x, ids, w = torch.randn(4, H).to(torch.bfloat16), torch.tensor([[0, 7]] * 4), torch.ones(4, 2)
        out = d.dispatch(x, ids, w)
        return failed, orphan, relative_error(d.combine(out.hidden_states, out), x.float() * 2)


def test_real_mnnvl_state_shows_a_range_a_failed_allocation_left(moe_rank_pools):
    """FlashInfer's real class attributes and records after a failed allocation (over the fake's port
    of ``open_mnnvl_memory``): the adapter has FlashInfer reserve a new range for the larger group."""
    for failed, orphan, error in moe_rank_pools.get(2).map(run_after_failed_allocation):
        assert "CUDA_ERROR_OUT_OF_MEMORY" in failed, failed
        assert orphan.comm_size is None and orphan.room > 0 and error < 1e-2, (orphan, error)


def run_under_error_filter(rank: int, world: int) -> str:
    _real()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=9)
            md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={})
        except md.BackendUnavailableError as exc:
            return f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    with pytest.warns(DeprecationWarning, match="MoeAlltoAll is deprecated"):  # FlashInfer's @deprecated class
        mod = importlib.import_module(REAL)
        mod.comm.MoeAlltoAll(_mapping(mod, 0, 1), 9, 2, E, hidden_size=H + 128)
    return "created"


def test_create_runs_under_an_error_warnings_filter_on_real_flashinfer(moe_rank_pools):
    import flashinfer
    if vendor.parse_version(flashinfer.__version__) < vendor.A2A_DEPRECATED_SINCE:
        pytest.skip("this FlashInfer does not deprecate MoeAlltoAll")
    assert moe_rank_pools.get(1).map(run_under_error_filter) == ["created"]


# -- FlashInfer-sized workspaces, the FABRIC decision, the collectives of an allocation ---------------


def run_flashinfer_sized_after(rank: int, world: int) -> list[int]:
    mod, tokens = _real(), 10  # a max-tokens no other test uses: nothing cached for it
    d = md.create_dispatcher(FlashInferA2ABackend(REAL), md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=tokens),
                             env={})
    mine = {inst.workspace.data_ptr() for inst in d.backend_dispatcher.instances}
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend())
    top_ks = vendor.top_k_values(mod.VERSION)
    others = [mod.comm.MoeAlltoAll(_mapping(mod, 0, 1), tokens, k, E, hidden_size=H, mnnvl_config=config)
              for k in top_ks]
    others += [mod.comm.MoeAlltoAll(_mapping(mod, 0, 1), tokens, 2, E, workspace_size_per_rank=size,
                                    mnnvl_config=config)
               for size in flashinfer_sizes(mod.comm.moe_a2a_get_workspace_size_per_rank, 1, tokens, top_ks)]
    return sorted({o.workspace_size_per_rank for o in others if o.workspace.data_ptr() in mine})


def test_no_flashinfer_sized_real_moealltoall_shares_a_dispatcher_workspace(moe_rank_pools):
    """FlashInfer's own default size and size function, for every top-k and wire dtype: none is one
    of the dispatcher's sizes."""
    assert moe_rank_pools.get(1).map(run_flashinfer_sized_after) == [[]]


def run_real_after_one_rank_allocated(rank: int, world: int, fabric: bool) -> tuple:
    _real()
    return run_after_one_rank_allocated(rank, world, REAL, fabric)


@pytest.mark.parametrize("fabric", [False, True])
def test_real_fabric_decision_cached_on_one_rank_only(moe_rank_pools, fabric):
    """FlashInfer's real ``_resolve_fabric_support`` (v0.6.16+; the driver's probe is the fake's)."""
    import flashinfer
    if vendor.parse_version(flashinfer.__version__) < vendor.MNNVL_FABRIC_AGREEMENT_SINCE:
        pytest.skip("this FlashInfer decides the handle type per allocation (platform.machine())")
    for result, decided in moe_rank_pools.get(2).map(run_real_after_one_rank_allocated, fabric, timeout_s=40):
        assert isinstance(result, float) and result < 1e-2, result
        assert decided is fabric, decided


class _StubDriver:
    """cuda-python's driver module with the calls ``open_mnnvl_memory`` makes answered without a GPU
    (types and enums are cuda-python's own)."""

    def __init__(self) -> None:
        from cuda.bindings import driver
        self._driver, self._ok = driver, driver.CUresult.CUDA_SUCCESS

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._driver, name)

    def cuMemExportToShareableHandle(self, handle, kind, flags):  # noqa: ANN001, ANN201, N802
        import os
        from types import SimpleNamespace
        if kind == self._driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            return self._ok, SimpleNamespace(data=bytes(64))
        return self._ok, os.open(os.devnull, os.O_RDONLY)  # a POSIX fd the exchange closes

    def __call_ok(self, *values):  # noqa: ANN002, ANN202
        return (self._ok, *values)

    def cuCtxGetDevice(self): return self.__call_ok(0)  # noqa: E704, N802, ANN201
    def cuMemGetAllocationGranularity(self, prop=None, option=None): return self.__call_ok(1 << 21)  # noqa: E704, N802, ANN001, ANN201
    def cuMemAddressReserve(self, *args): return self.__call_ok(1 << 40)  # noqa: E704, N802, ANN002, ANN201
    def cuMemCreate(self, *args, **kwargs): return self.__call_ok(object())  # noqa: E704, N802, ANN002, ANN003, ANN201
    def cuMemImportFromShareableHandle(self, *args): return self.__call_ok(object())  # noqa: E704, N802, ANN002, ANN201
    def cuMemMap(self, *args): return self.__call_ok()  # noqa: E704, N802, ANN002, ANN201
    def cuMemSetAccess(self, *args): return self.__call_ok()  # noqa: E704, N802, ANN002, ANN201
    def cuMemUnmap(self, *args): return self.__call_ok()  # noqa: E704, N802, ANN002, ANN201
    def cuMemRelease(self, *args): return self.__call_ok()  # noqa: E704, N802, ANN002, ANN201
    def cuMemAddressFree(self, *args): return self.__call_ok()  # noqa: E704, N802, ANN002, ANN201


def _fresh_real_mnnvl():  # noqa: ANN202
    """A new copy of the installed ``flashinfer/comm/mnnvl.py`` (its own MnnvlMemory class state, as
    in a new process; ``real_python``'s patches are not in it), on the stub driver."""
    import sys

    import flashinfer.comm.mnnvl as installed
    name = "flashinfer.comm._mnnvl_fresh_copy"
    spec = importlib.util.spec_from_file_location(name, installed.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    module.cuda = _StubDriver()
    return module


@pytest.mark.parametrize("fabric", [False, True])
def test_the_fakes_mnnvl_collectives_equal_flashinfers_open_mnnvl_memory(fabric):
    """FlashInfer's own ``open_mnnvl_memory`` (the installed one, only the CUDA driver calls stubbed)
    makes the allgathers the fake of its version makes, in order, for two allocations."""
    import flashinfer
    real = _fresh_real_mnnvl()
    memory = real.MnnvlMemory
    memory._probe_fabric_supported = staticmethod(lambda dev_id: fabric)  # noqa: SLF001 - the driver's answer
    mapping = real.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)
    comm = Recording()
    memory.set_comm_from_config(mapping, real.MnnvlConfig(comm_backend=comm))
    seen, held = [], []
    for _ in range(2):
        comm.seen = []
        held.append(memory(mapping, 1000))
        seen.append(comm.seen)
    fake = importlib.import_module(fake_for(vendor.parse_version(flashinfer.__version__)))
    assert seen == mnnvl_collectives(fake, fabric, "aarch64" if fabric else "x86_64")


def _bad_input_on_rank_1(rank: int, world: int):  # noqa: ANN202
    _real()
    spec = md.DispatchSpec(H, 4 * world, 3, num_max_dispatch_tokens_per_rank=8, output_dtype="bf16")
    d = md.create_dispatcher(FlashInferA2ABackend(REAL), spec, env={}, timeout_s=30)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(8, d.spec.num_experts, 3, generator=g, drop_prob=0.1)
    return dispatch_with_a_bad_id(d, x, ids, w, bad=rank == 1)


def test_a_peers_failure_reaches_the_fake_kernels_exchange_under_the_real_python():
    """The fake kernels' exchanges under FlashInfer's real Python wait with the dispatcher's Watch: rank 0, waiting
    in one, gets PeerFailedError naming rank 1 within a few seconds (timeout 30 s), not after gloo's own timeout."""
    (name0, attrs0, seconds0, message0), (name1, _, _, _) = on_a_fresh_pool(_bad_input_on_rank_1)
    assert name1 == "InvalidInputError"
    assert name0 == "PeerFailedError" and attrs0["rank"] == 1, message0
    assert seconds0 < 5.0
