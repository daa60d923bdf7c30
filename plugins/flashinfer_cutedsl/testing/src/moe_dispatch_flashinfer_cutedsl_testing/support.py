"""What the plugin's tests share, on the fakes and on FlashInfer's real Python (``real_python``, the
vendor-code job): a layer through ``flashinfer_a2a`` with identity experts, one-rank communicators and
mappings, this rank's fake driver, a fresh process's MNNVL state, every size FlashInfer's size
function gives, the collectives of an MNNVL allocation, and a dispatcher created after one rank
alone allocated MNNVL memory."""

from __future__ import annotations

import importlib
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend, LocalCommBackend
from moe_dispatch_testing import random_routing, relative_error

from .fakes import mnnvl

H, E = 256, 8


def fake(name: str) -> Any:
    """The fake (or ``real_python``) module ``name``."""
    return importlib.import_module(name)


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Identity experts: the weighted sum of a token's valid copies."""
    keep = (ids >= 0).float() * w
    return x.float() * keep.sum(dim=1, keepdim=True)


def round_trip(d: md.Dispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Dispatch and combine with identity experts."""
    out = d.dispatch(x, ids, w)
    return d.combine(out.hidden_states, out)


def run_layer(rank: int, world: int, fake_module: str, top_k: int, drop: float, experts: int = E) -> float:
    """One layer of 16 tokens per rank through ``flashinfer_a2a`` on ``fake_module``: its error."""
    warnings.simplefilter("ignore", DeprecationWarning)
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=16)
    d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={})
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(16, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(16, experts, top_k, generator=g, drop_prob=drop)
    return relative_error(round_trip(d, x, ids, w), reference(x, ids, w))


def one_rank(mod: Any) -> Any:
    """``mod``'s ``Mapping`` of a one-rank EP group."""
    return mod.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)


class OneRank:
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


def raw_moe_alltoall(mod: Any, tokens: int, top_k: int, comm: OneRank | None = None, size_extra: int = 0) -> Any:
    """FlashInfer's MoeAlltoAll of ``mod`` on one rank, on a workspace no other test shares."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mapping = mod.Mapping(world_size=1, rank=0, gpus_per_node=1, tp_size=1, moe_ep_size=1)
    config = mod.comm.mnnvl.MnnvlConfig(comm_backend=comm or OneRank())
    size = mod.moe_a2a_get_workspace_size_per_rank(1, tokens, 4 * H + 8 * top_k, 2 * H) + 128 * (977 + size_extra)
    return mod.MoeAlltoAll(mapping, tokens, top_k, E, workspace_size_per_rank=size, mnnvl_config=config)


def metainfo_word(mod: Any, inst: Any, name: str, index: int = 0) -> torch.Tensor:
    """The int32 at ``metainfo[name] + 4·index`` of this rank's workspace row (a view)."""
    at = int(inst.metainfo[vendor.profile(mod.VERSION).metainfo_names.index(name)])
    return inst.workspace[inst.ep_rank][at + 4 * index : at + 4 * index + 4].view(torch.int32)


def flashinfer_sizes(size_function: Any, world: int, tokens: int, top_ks: frozenset[int]) -> set[int]:
    """Every workspace size FlashInfer's size function gives for (world, tokens) with this hidden size:
    its default (``hidden_size=H``: BF16 rows) and the per-dtype sizes vLLM and SGLang compute (BF16,
    FP8 with 128-blocks or per-token scales, NVFP4 with 16-blocks), for each top-k the kernels take."""
    wires = (2 * H, H + 4 * (H // 128), H + 4, H // 2 + H // 16)
    return {size_function(world, tokens, wire + 8 * k, 2 * H) for wire in wires for k in top_ks}


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


def run_after_one_rank_allocated(rank: int, world: int, fake_module: str, fabric: bool) -> tuple[Any, Any]:
    """Rank 0 alone allocated MNNVL memory before (another FlashInfer user on a one-rank group, whose
    allocation fills its address range, so the dispatcher's workspaces go to a new range); rank 1
    never did. Then a dispatcher on both ranks."""
    warnings.simplefilter("ignore", DeprecationWarning)
    mod = fake(fake_module)
    memory = mod.comm.mnnvl.MnnvlMemory
    groups = [dist.new_group([r]) for r in range(world)]
    spec = md.DispatchSpec(H, E, 2, num_max_dispatch_tokens_per_rank=12)
    with driver(fabric), fresh_process(memory):
        earlier = None
        if rank == 0:
            memory.set_comm_from_config(one_rank(mod), mod.comm.mnnvl.MnnvlConfig(
                comm_backend=GroupCommBackend(mdb.Comm(groups[0]))))
            earlier = memory(one_rank(mod), memory.fabric_page_size)  # fills its 512 MiB range (address space)
        try:
            d = md.create_dispatcher(FlashInferA2ABackend(fake_module), spec, env={}, timeout_s=10)
            x, ids, w = torch.randn(12, H).to(torch.bfloat16), torch.tensor([[0, 7]] * 12), torch.ones(12, 2)
            out = d.dispatch(x, ids, w)
            result: Any = relative_error(d.combine(out.hidden_states, out), x.float() * 2)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            result = f"{type(exc).__name__}: {exc} (from {exc.__cause__!r})"
        decided = getattr(memory, vendor.MNNVL_FABRIC_ATTR, "absent")
        del earlier
    return result, decided


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
        memory.set_comm_from_config(one_rank(mod), mod.comm.mnnvl.MnnvlConfig(comm_backend=comm))
        seen, held = [], []
        for _ in range(2):
            comm.seen = []
            held.append(memory(one_rank(mod), 1000))
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


__all__ = [
    "MNNVL_COLLECTIVES",
    "E",
    "H",
    "OneRank",
    "Recording",
    "driver",
    "fake",
    "flashinfer_sizes",
    "fresh_process",
    "metainfo_word",
    "mnnvl_collectives",
    "one_rank",
    "raw_moe_alltoall",
    "reference",
    "round_trip",
    "run_after_one_rank_allocated",
    "run_layer",
]
