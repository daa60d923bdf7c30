"""The third independent audit of the plugin (VENDOR.md, "Independent audit (2026-11)", round
three): one test per non-OK row, against fakes as strict as FlashInfer's source. Row numbers are the
audit's (``docs/vendor-audits/2026-11/round3/flashinfer_cutedsl.md``); the same rows through FlashInfer's real Python are
in ``test_real_flashinfer.py``."""

import importlib
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

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


def flashinfer_sizes(size_function: Any, world: int, tokens: int, top_ks: frozenset[int]) -> set[int]:
    """Every workspace size FlashInfer's size function gives for (world, tokens) with this hidden size:
    its default (``hidden_size=H``: BF16 rows) and the per-dtype sizes vLLM and SGLang compute (BF16,
    FP8 with 128-blocks or per-token scales, NVFP4 with 16-blocks), for each top-k the kernels take."""
    wires = (2 * H, H + 4 * (H // 128), H + 4, H // 2 + H // 16)
    return {size_function(world, tokens, wire + 8 * k, 2 * H) for wire in wires for k in top_ks}


# -- #1 WRONG: a neighbouring shape's FlashInfer-sized workspace was one of the dispatcher's ----------


@pytest.mark.parametrize("fake", [vendor.FAKE_0_6_13, vendor.FAKE_0_7_2])
def test_1_no_flashinfer_sized_moealltoall_shares_a_dispatcher_workspace(fake):
    """R=1, T=2, top-2: FlashInfer's default size for top-10 (and other top-k / dtypes) is the
    dispatcher's size + 128 B; the cache key has no top-k, so such a MoeAlltoAll built later got the
    dispatcher's workspace. Every size FlashInfer's function gives is a multiple of 128."""
    mod, tokens = _fake(fake), 2  # a max-tokens no other test uses: nothing cached for it
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=tokens)
    d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={})
    instances = d.backend_dispatcher.instances
    mine = {inst.workspace.data_ptr() for inst in instances}
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend())
    top_ks = vendor.top_k_values(mod.VERSION)
    others = [mod.MoeAlltoAll(_one_rank(mod), tokens, k, E, hidden_size=H, mnnvl_config=config) for k in top_ks]
    others += [mod.MoeAlltoAll(_one_rank(mod), tokens, 2, E, workspace_size_per_rank=size, mnnvl_config=config)
               for size in flashinfer_sizes(mod.moe_a2a_get_workspace_size_per_rank, 1, tokens, top_ks)]
    shared = sorted({o.workspace_size_per_rank for o in others if o.workspace.data_ptr() in mine})
    assert not shared, f"FlashInfer-sized MoeAlltoAll of sizes {shared} share a dispatcher workspace"
    assert all(o.workspace_size_per_rank % vendor.CACHELINE == 0 for o in others)
    x, ids, w = torch.randn(2, H).to(torch.bfloat16), torch.tensor([[0, 1]] * 2), torch.ones(2, 2)
    out = d.dispatch(x, ids, w)
    assert relative_error(d.combine(out.hidden_states, out), x.float() * 2) < 1e-2


# -- #3 CRASH: ranks that differ in FlashInfer's cached FABRIC/POSIX decision ------------------------


@contextmanager
def driver(fabric: bool, machine: str = "x86_64") -> Iterator[None]:
    """This rank's GPU as the fake driver reports it: FABRIC handles supported or not (FlashInfer's
    probe, v0.6.16+), and the machine (<= v0.6.15 choose FABRIC handles on aarch64)."""
    saved = getattr(mnnvl.DRIVER, "fabric", None), getattr(mnnvl.DRIVER, "machine", None)
    mnnvl.DRIVER.fabric, mnnvl.DRIVER.machine = fabric, machine
    try:
        yield
    finally:
        mnnvl.DRIVER.fabric, mnnvl.DRIVER.machine = saved


@contextmanager
def fresh_process(memory: Any) -> Iterator[None]:
    """``memory`` as in a new process: no address range, no FABRIC decision cached, no comm."""
    saved = memory.comm, getattr(memory, vendor.MNNVL_FABRIC_ATTR, "absent")
    memory.comm = None
    if saved[1] != "absent":
        setattr(memory, vendor.MNNVL_FABRIC_ATTR, None)
    try:
        with mnnvl.fresh_address_range(memory):
            yield
    finally:
        memory.comm = saved[0]
        if saved[1] != "absent":
            setattr(memory, vendor.MNNVL_FABRIC_ATTR, saved[1])


def run_after_one_rank_allocated(rank: int, world: int, fake: str, fabric: bool) -> tuple[Any, Any]:
    """Rank 0 alone allocated MNNVL memory before (another FlashInfer user on a one-rank group, whose
    allocation fills its address range, so the dispatcher's workspaces go to a new range); rank 1
    never did. Then a dispatcher on both ranks."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = _fake(fake)
    memory = mod.comm.mnnvl.MnnvlMemory
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=12)
    with driver(fabric), fresh_process(memory):
        earlier = None
        if rank == 0:
            memory.set_comm_from_config(_one_rank(mod), mod.comm.mnnvl.MnnvlConfig(
                comm_backend=GroupCommBackend(mdb.Comm(groups[0]))))
            earlier = memory(_one_rank(mod), memory.fabric_page_size)  # fills its 512 MiB range (address space)
        try:
            d = md.create_dispatcher(FlashInferA2ABackend(fake), spec, env={}, timeout_s=10)
            x, ids, w = torch.randn(12, H).to(torch.bfloat16), torch.tensor([[0, 7]] * 12), torch.ones(12, 2)
            out = d.dispatch(x, ids, w)
            result: Any = relative_error(d.combine(out.hidden_states, out), x.float() * 2)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            result = f"{type(exc).__name__}: {exc} (from {exc.__cause__!r})"
        decided = getattr(memory, vendor.MNNVL_FABRIC_ATTR, "absent")
        del earlier
    return result, decided


@pytest.mark.parametrize("fake,fabric", [(vendor.FAKE_0_7_2, False), (vendor.FAKE_0_6_17, True),
                                         (vendor.FAKE_0_6_15, True)])
def test_3_ranks_that_differ_in_flashinfers_cached_fabric_decision_create_a_dispatcher(moe_rank_pools, fake,
                                                                                      fabric):
    """From v0.6.16 ``open_mnnvl_memory`` AND-reduces the ranks' FABRIC support (an allgather) only
    where the per-process ``MnnvlMemory._fabric_supported`` is unset: rank 0 skipped it, rank 1 ran
    it, and their next collectives paired wrongly (a raise on one rank, a hang on the other). The
    adapter has every rank decide again when they differ; the decision is then this group's AND."""
    got = moe_rank_pools.get(2).map(run_after_one_rank_allocated, fake, fabric, timeout_s=40)
    expected = "absent" if vendor.parse_version(_fake(fake).__version__) < vendor.MNNVL_FABRIC_AGREEMENT_SINCE \
        else fabric
    for result, decided in got:
        assert isinstance(result, float) and result < 1e-2, result
        assert decided == expected, decided


# -- #4 FAKE: the fake's open_mnnvl_memory had one collective where FlashInfer has two to four --------


class Recording(LocalCommBackend):
    """A one-rank CommBackend that records the type of every allgather's data."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def allgather(self, data: Any) -> list[Any]:
        self.seen.append(type(data).__name__)
        return [data]


def mnnvl_collectives(mod: Any, fabric: bool, machine: str) -> list[list[str]]:
    """The allgathers of two MNNVL allocations in a fresh process (one rank)."""
    memory = mod.comm.mnnvl.MnnvlMemory
    with driver(fabric, machine), fresh_process(memory):
        comm = Recording()
        memory.set_comm_from_config(_one_rank(mod), mod.comm.mnnvl.MnnvlConfig(comm_backend=comm))
        seen, held = [], []
        for _ in range(2):
            comm.seen = []
            held.append(memory(_one_rank(mod), 1000))
            seen.append(comm.seen)
        del held
    return seen


#: The allgathers of two allocations, from FlashInfer's open_mnnvl_memory (every tag and wheel; the
#: same sequences come out of the real functions with the driver stubbed, test_real_flashinfer.py):
#: <= v0.6.15 the size, then FABRIC handles on aarch64 (``allgather(handle.data)``) or POSIX fds
#: elsewhere (``allgather(fd)``, ``allgather(os.getpid())`` for pidfd_getfd); from v0.6.16 the size,
#: the once-per-process FABRIC AND-reduce (a bool), then ``allgather(handle.data)`` or POSIX fds over
#: SCM_RIGHTS (``allgather(socket.gethostname())``, exchange_fds' ``allgather(sock_path)``).
MNNVL_COLLECTIVES = {
    "0_6_15 fabric": [["int", "bytes"], ["int", "bytes"]],
    "0_6_15 posix": [["int", "int", "int"], ["int", "int", "int"]],
    "0_6_16 fabric": [["int", "bool", "bytes"], ["int", "bytes"]],
    "0_6_16 posix": [["int", "bool", "str", "str"], ["int", "str", "str"]],
}


@pytest.mark.parametrize("fake", [vendor.FAKE_0_6_6, vendor.FAKE_0_6_15, vendor.FAKE_0_6_17, vendor.FAKE_0_7_2])
@pytest.mark.parametrize("fabric", [False, True])
def test_4_the_fake_mnnvl_allocation_makes_flashinfers_collectives(fake, fabric):
    mod = _fake(fake)
    era = "0_6_16" if mod.VERSION >= vendor.MNNVL_FABRIC_AGREEMENT_SINCE else "0_6_15"
    expected = MNNVL_COLLECTIVES[f"{era} {'fabric' if fabric else 'posix'}"]
    assert mnnvl_collectives(mod, fabric, "aarch64" if fabric else "x86_64") == expected
