"""``flashinfer.comm.mnnvl`` on CPU: the communicator logic as FlashInfer has it, the memory fake.

What is FlashInfer's (flashinfer-ai/flashinfer@4230a48 ... flashinfer-python==0.7.2.post1
flashinfer/comm/mnnvl.py), kept as it is:

- ``MnnvlMemory.comm`` is class-level state. ``set_comm_from_config(mapping, config)`` sets it to
  ``config.comm_backend.Split(pp_rank * cp_size + cp_rank, tp_rank)``; ``get_comm`` returns it, or
  falls back to ``MpiComm().Split(...)``: mpi4py's COMM_WORLD. In a process that mpirun did not
  start (torchrun) that world has one rank, so a workspace allocated over it is ``[1, size]``.
- ``open_mnnvl_memory`` allgathers the size over that comm and asserts every rank asks for the same,
  then exchanges the memory handles over it: FABRIC handles (``allgather(handle.data)``) or POSIX
  fds (<= v0.6.15: ``allgather(fd)``, ``allgather(os.getpid())`` for pidfd_getfd; from v0.6.16:
  ``allgather(socket.gethostname())``, then exchange_fds' ``allgather(sock_path)`` and SCM_RIGHTS).
  The handle type: <= v0.6.15 FABRIC on aarch64 (``platform.machine()``); from v0.6.16 decided once
  per process by ``_resolve_fabric_support`` (an AND-reduce allgather over the comm of the first
  allocation, cached in the class-level ``_fabric_supported``; ``vendor.MNNVL_FABRIC_AGREEMENT_SINCE``).
  So the collectives of one allocation differ between a rank that decided before and one that did not.
- ``as_torch_strided_tensor`` has one row per rank of the *class-level* comm at call time.

- The address reservation is class-level: ``current_start_address``, ``current_rank_stride``,
  ``current_mem_offset``. A range is reserved for ``stride * comm_size`` bytes by the allocation
  that did not fit the current one; later allocations that fit go into it whatever their comm,
  and map peer i at ``start + stride * i + offset``: a comm larger than the reserving one maps
  outside the range, and ``cuMemMap`` fails (``DRIVER.map``: CUDA_ERROR_INVALID_VALUE).
- ``allocated_map`` holds tuples until v0.6.14, ``_MnnvlAllocationRecord``s from v0.6.15.

What is faked: the CUDA driver (cuMemCreate/cuMemMap/handle export and import, the FABRIC probe and
the machine; ``DRIVER`` keeps the reserved ranges and refuses a mapping outside them, and refuses to
import anything but a handle it exported). The SCM_RIGHTS / pidfd transfers themselves are not run. Each allocation's memory is a CPU tensor
``[comm_size, size]`` of which only this rank's row is this process's memory; writes the kernels
make into a peer's row travel through the allocation's communicator (``Segment.exchange``).
``patch_real_mnnvl`` puts the same memory model under FlashInfer's real ``MnnvlMemory``.
"""

from __future__ import annotations

import itertools
import os
import platform
import socket
import tempfile
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

import moe_dispatch.backend as mdb
from moe_dispatch_flashinfer_cutedsl import vendor

#: The fake's allocation granularity (the real one is the driver's, typically 2 MiB): the rank
#: stride is the size rounded up to it, so a segment is narrower than its stride, as on the GPU.
GRANULARITY = 128
#: The device every fake rank runs on (``cuCtxGetDevice``).
DEVICE = 0
#: A FABRIC handle is 64 bytes (``CUmemFabricHandle.data``); the fake's start with this tag.
FABRIC_HANDLE_BYTES = 64
_FABRIC_TAG = b"fake-fabric-handle:"


class CommBackend(ABC):
    """The communicator interface (an ABC until v0.6.15, a Protocol from v0.6.16; never checked)."""

    @abstractmethod
    def Get_rank(self) -> int: ...  # noqa: N802

    @abstractmethod
    def Get_size(self) -> int: ...  # noqa: N802

    @abstractmethod
    def allgather(self, data: Any) -> Any: ...

    @abstractmethod
    def bcast(self, data: Any, root: int) -> Any: ...

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def Split(self, color: int, key: int) -> "CommBackend": ...  # noqa: N802


class SingletonWorld:
    """mpi4py's COMM_WORLD in a process mpirun did not start: one rank."""

    def Get_rank(self) -> int:  # noqa: N802
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def allgather(self, data: Any) -> list[Any]:
        return [data]

    def bcast(self, data: Any, root: int = 0) -> Any:
        return data

    def Barrier(self) -> None:  # noqa: N802
        return None

    def Split(self, color: int, key: int) -> "SingletonWorld":  # noqa: N802
        return SingletonWorld()


class MpiComm:
    """``flashinfer.comm.mnnvl.MpiComm``: attribute access goes to mpi4py's COMM_WORLD. The fake
    models mpi4py installed and no mpirun (without mpi4py FlashInfer raises
    ``ImportError("mpi4py is not installed")`` here instead; either way not the EP group)."""

    _comm: Any = SingletonWorld()

    def __getattr__(self, name: str) -> Any:
        return getattr(type(self)._comm, name)


class MPIBackend(CommBackend):
    def __init__(self) -> None:
        self._mpicomm = MpiComm()

    def Get_rank(self) -> int:  # noqa: N802
        return self._mpicomm.Get_rank()

    def Get_size(self) -> int:  # noqa: N802
        return self._mpicomm.Get_size()

    def allgather(self, data: Any) -> tuple[Any, ...]:
        return tuple(self._mpicomm.allgather(data))

    def bcast(self, data: Any, root: int) -> Any:
        return self._mpicomm.bcast(data, root)

    def barrier(self) -> None:
        self._mpicomm.Barrier()

    def Split(self, color: int, key: int) -> "MPIBackend":  # noqa: N802
        split = MPIBackend()
        split._mpicomm = self._mpicomm.Split(color, key)
        return split


class TorchDistBackend(CommBackend):
    """``flashinfer.comm.mnnvl.TorchDistBackend`` (every version): torch.distributed objects.
    Its ``Split`` gathers ``Get_rank()`` (the rank *in its group*) and builds the group of its
    colour from those numbers as if they were global ranks (right for the WORLD group only):
    ``new_group(ranks=<its colour's ranks by key>)`` on each rank, nothing else (4230a48
    mnnvl.py; v0.6.16+ comm_backend.py). ``bcast`` passes ``src=root`` until v0.6.12 and the
    root's global rank from v0.6.13 (``_GLOBAL_ROOT``, set per version)."""

    _GLOBAL_ROOT = True

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized. "
                               "Please call torch.distributed.init_process_group() first.")
        self._group = group
        self._dist = dist

    def Get_rank(self) -> int:  # noqa: N802
        return self._dist.get_rank(self._group)

    def Get_size(self) -> int:  # noqa: N802
        return self._dist.get_world_size(self._group)

    def allgather(self, data: Any) -> list[Any]:
        out: list[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(out, data, group=self._group)
        return out

    def bcast(self, data: Any, root: int) -> Any:
        box = [data]
        src = root
        if self._GLOBAL_ROOT and self._group is not None:
            src = self._dist.get_global_rank(self._group, root)
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def barrier(self) -> None:
        self._dist.barrier(group=self._group)

    def Split(self, color: int, key: int) -> "TorchDistBackend":  # noqa: N802
        global_rank = self.Get_rank()
        color_groups: dict[int, list[tuple[int, int]]] = {}
        for c, k, r in self.allgather((color, key, global_rank)):
            color_groups.setdefault(c, []).append((k, r))
        for c in color_groups:
            color_groups[c].sort(key=lambda x: x[0])
        my_group_ranks = [r for _, r in color_groups[color]]
        return type(self)(group=self._dist.new_group(ranks=my_group_ranks))


@dataclass
class MnnvlConfig:
    """Configuration for MNNVL memory management."""

    comm_backend: Any = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


# -- the memory ----------------------------------------------------------------------------------


class _Driver:
    """The CUDA driver's virtual address space, as far as MNNVL memory uses it: reserved ranges
    (``cuMemAddressReserve``) and mappings into them (``cuMemMap`` fails outside every range), and
    physical allocations (``cuMemCreate``), which fail when the device is out of memory."""

    def __init__(self) -> None:
        self._next = 1 << 44
        self.ranges: dict[int, int] = {}  # start -> size
        #: Device memory left for one cuMemCreate (None: enough). A test lowers it to make an
        #: allocation fail as on a full GPU: after ``new_mnnvl_memory_address`` reserved its range.
        self.free_bytes: int | None = None
        #: What FlashInfer's ``_probe_fabric_supported`` finds on this rank (v0.6.16+:
        #: CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED and an NVML fabric clique). False, as on
        #: a machine without an NVLink fabric (and what the real probe returns without a GPU).
        self.fabric = False
        #: ``platform.machine()``: FlashInfer <= v0.6.15 uses FABRIC handles on aarch64 only.
        self.machine = platform.machine()
        self._handles = itertools.count(1)

    def export(self, fabric: bool) -> bytes | int:
        """cuMemExportToShareableHandle: a FABRIC handle's ``.data`` (64 bytes) or a POSIX fd."""
        number = next(self._handles)
        if fabric:
            return (_FABRIC_TAG + f"{os.getpid()}:{number}".encode()).ljust(FABRIC_HANDLE_BYTES, b"\0")
        return 1000 + number

    def import_handle(self, data: Any, fabric: bool) -> None:
        """cuMemImportFromShareableHandle: only a handle of the allocation's type that a rank exported
        (a peer's value from a mis-paired collective is not one; what the real driver and cuda-python
        make of it is for the hardware to say, the fake raises as checkCudaErrors does)."""
        valid = (isinstance(data, bytes) and len(data) == FABRIC_HANDLE_BYTES and data.startswith(_FABRIC_TAG)) \
            if fabric else (isinstance(data, int) and not isinstance(data, bool))
        if not valid:
            raise RuntimeError("CUDA error code=1(CUDA_ERROR_INVALID_VALUE)")

    def create(self, size: int) -> None:
        if self.free_bytes is not None and size > self.free_bytes:
            raise RuntimeError("CUDA error code=2(CUDA_ERROR_OUT_OF_MEMORY)")  # checkCudaErrors(cuMemCreate(...))

    def reserve(self, size: int, alignment: int) -> int:
        start = -(-self._next // alignment) * alignment
        self._next = start + size + alignment  # a gap: ranges are never adjacent
        self.ranges[start] = size
        return start

    def free(self, start: int) -> None:
        self.ranges.pop(start, None)

    def map(self, address: int, size: int) -> None:
        if not any(s <= address and address + size <= s + n for s, n in self.ranges.items()):
            raise RuntimeError("CUDA error code=1(CUDA_ERROR_INVALID_VALUE)")  # checkCudaErrors(cuMemMap(...))


DRIVER = _Driver()


@dataclass
class Segment:
    """One MNNVL allocation: a ``[comm_size, size]`` view of which row ``rank`` is ours."""

    comm: Any
    rank: int
    comm_size: int
    size: int
    rank_stride: int
    storage: torch.Tensor

    def rows(self, num_segments: int) -> torch.Tensor:
        if num_segments * self.rank_stride > self.storage.numel():
            raise RuntimeError(f"fake MNNVL: a [{num_segments}, {self.size}] view of an allocation made over "
                               f"{self.comm_size} ranks (MnnvlMemory.comm changed in between)")
        return self.storage.as_strided((num_segments, self.size), (self.rank_stride, 1))

    def exchange(self, outgoing: dict[int, list[tuple[int, torch.Tensor]]]) -> list[list[tuple[int, torch.Tensor]]]:
        """Byte stores ``(offset, uint8 tensor)`` to each peer → the stores every source made to
        this rank. Over a communicator with a process group (``_group``, as FlashInfer's
        TorchDistBackend) the headers and bytes go through the core's ``Comm`` on that group, which
        inside a dispatcher's call on the same ranks waits with the dispatcher's ``Watch`` (its
        ``timeout_s``, its peers' failure notices) instead of blocking in gloo; otherwise (the
        adapter's CommBackend, already over the dispatcher's ``Comm``) both go through the
        communicator's allgather."""
        size = self.comm_size
        headers = {peer: [(off, int(data.numel())) for off, data in stores] for peer, stores in outgoing.items()}
        group = getattr(self.comm, "_group", _NO_GROUP)
        comm = mdb.Comm(group) if size > 1 and group is not _NO_GROUP and dist.is_initialized() else None
        everyone = self.comm.allgather(headers) if comm is None else \
            comm.gather_object(headers, "fake MNNVL stores (headers)")
        send = [torch.cat([d.reshape(-1) for _, d in outgoing.get(p, [])] or [torch.empty(0, dtype=torch.uint8)])
                for p in range(size)]
        send_counts = [int(t.numel()) for t in send]
        recv_counts = [sum(n for _, n in everyone[src].get(self.rank, [])) for src in range(size)]
        if comm is not None:
            got = comm.all_to_all(torch.cat(send).unsqueeze(1), send_counts, recv_counts, [("payload", 1)])
            chunks = list(torch.split(got.reshape(-1), recv_counts))
        else:
            gathered = self.comm.allgather(send)
            chunks = [gathered[src][self.rank] for src in range(size)]
        result = []
        for src in range(size):
            stores, at = [], 0
            for off, n in everyone[src].get(self.rank, []):
                stores.append((off, chunks[src][at : at + n]))
                at += n
            result.append(stores)
        return result


_NO_GROUP = object()

#: data_ptr of every live workspace tensor (row 0) → its segment; what the fake kernels find
#: from the ``workspace`` argument, as the real ones find peer rows from its base pointer.
FABRIC: dict[int, Segment] = {}
#: MNNVL pointer (a fake virtual address) → its CPU memory.
_SEGMENTS: dict[int, Segment] = {}


def segment_of(workspace: torch.Tensor) -> Segment | None:
    return FABRIC.get(workspace.data_ptr())


@dataclass
class _AllocationRecord:
    """``_MnnvlAllocationRecord`` (v0.6.15+)."""

    comm: Any
    comm_size: int
    comm_rank: int
    aligned_size: int
    mem_handles: list[Any]
    start_address: int
    rank_stride: int
    address_offset: int
    mapped: bool = True
    handle_type: Any = None  # 0.7.4: the type this allocation chose (FABRIC or POSIX fd)


def _tuple_record(comm: Any, comm_size: int, comm_rank: int, aligned_size: int, mem_handles: list[Any],
                  start_address: int, rank_stride: int, address_offset: int, mapping: Any = None) -> tuple:
    """``allocated_map[ptr]`` until v0.6.14: (mapping, aligned_size, mem_handles, start, stride, offset)."""
    return (mapping, aligned_size, mem_handles, start_address, rank_stride, address_offset)


def _uses_fabric(cls: Any, version: vendor.Version) -> bool:
    """``get_allocation_prop``'s handle type: the process's decision (v0.6.16+, probed when there
    is none) or the machine (<= v0.6.15)."""
    if version >= vendor.MNNVL_FABRIC_AGREEMENT_SINCE:
        decided = getattr(cls, vendor.MNNVL_FABRIC_ATTR)
        return bool(cls._probe_fabric_supported(DEVICE) if decided is None else decided)
    return "aarch64" in DRIVER.machine.lower()


def _exchange_handles(comm: Any, comm_rank: int, fabric: bool, version: vendor.Version) -> list[Any]:
    """The handle exchange of ``_create_and_map_handles`` (its collectives, in FlashInfer's order):
    every rank's exported handle, by rank."""
    local = DRIVER.export(fabric)
    if fabric:
        return list(comm.allgather(local))
    if version < vendor.MNNVL_FABRIC_AGREEMENT_SINCE:  # pidfd_open / pidfd_getfd on every peer's fd
        fds, pids = list(comm.allgather(local)), list(comm.allgather(os.getpid()))
        for pid, fd in zip(pids, fds, strict=True):
            if not isinstance(pid, int) or isinstance(pid, bool):
                raise RuntimeError(f"pidfd_open({pid}) failed with errno 3: No such process")
            if not isinstance(fd, int) or isinstance(fd, bool):
                raise RuntimeError(f"pidfd_getfd(pidfd=3, fd={fd}) failed with errno 9: Bad file descriptor.")
        return fds
    hosts = comm.allgather(socket.gethostname())
    if len(set(hosts)) != 1:
        raise RuntimeError(
            "[MnnvlMemory] POSIX fd exchange via SCM_RIGHTS requires all ranks to share the same host, but got "
            f"differing hostnames: {hosts}. Multi-node MNNVL requires a fabric-capable GPU setup "
            "(CU_MEM_HANDLE_TYPE_FABRIC).")
    # exchange_fds: each rank's socket path, then an SCM_RIGHTS connection to every peer's.
    paths = comm.allgather(os.path.join(tempfile.gettempdir(), f"cuda_fd_xchg_{os.getpid()}_{comm_rank}_", "fd.sock"))
    for path in paths:
        if not isinstance(path, str):
            raise TypeError(f"a bytes-like object is required, not '{type(path).__name__}'")  # socket.connect
    return [1000] * len(paths)  # the received fds (the fake maps no real memory with them)


def _allocate_handles(comm: Any, aligned: int) -> tuple[bool, list[Any]]:
    """0.7.4's ``allocate_mnnvl_handles``: the handle type chosen over ``comm`` (``choose_mnnvl_handle_type``),
    every rank's allocation error gathered before any import (all ranks raise together), the handles
    exchanged (FABRIC: an allgather; POSIX: the socket paths of ``exchange_fds``)."""
    status = comm.allgather((socket.gethostname(), None if DRIVER.fabric else "no FABRIC handle support",
                             b"fake-domain" if DRIVER.fabric else b""))
    if len({host for host, _, _ in status}) > 1 and not all(reason is None for _, reason, _ in status):
        raise RuntimeError("[MNNVL] memory shared across hosts needs FABRIC handles within one NVLink domain")
    fabric = all(reason is None for _, reason, _ in status)
    try:
        DRIVER.create(aligned)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    errors = list(comm.allgather(error))
    if any(errors):
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        raise RuntimeError(f"[MNNVL] allocating memory shared through {'FABRIC' if fabric else 'POSIX file descriptor'} "
                           f"handles failed:\n{failed}")
    if fabric:
        return True, list(comm.allgather(DRIVER.export(True)))
    comm.allgather(os.path.join(tempfile.gettempdir(), f"cuda_fd_xchg_{os.getpid()}", "fd.sock"))
    return False, [DRIVER.export(False)] * comm.Get_size()


def _open(cls: Any, record: Callable[..., Any], mapping: Any, size: int, version: vendor.Version) -> tuple[int, int]:
    """``MnnvlMemory.open_mnnvl_memory`` with CPU memory: FlashInfer's comm logic and collectives
    (the size allgather, the FABRIC decision from v0.6.16, the handle exchange), its class-level
    address reservation (``current_start_address`` / ``current_rank_stride`` /
    ``current_mem_offset``, see ``vendor.mnnvl_reservation``), the fake driver's ranges."""
    comm = cls.get_comm(mapping)
    comm_rank, comm_size = comm.Get_rank(), comm.Get_size()
    sizes = comm.allgather(size)
    assert len(sizes) == comm_size
    assert all(x == size for x in sizes), "Not all rank allocating same size."
    if vendor.MNNVL_FABRIC_AGREEMENT_SINCE <= version < vendor.MNNVL_HANDLE_PER_ALLOCATION_SINCE:
        cls._resolve_fabric_support(comm, DEVICE)
    granularity = cls.allocation_granularity or GRANULARITY
    aligned = -(-size // granularity) * granularity
    if cls.current_mem_offset + aligned > cls.current_rank_stride:  # new_mnnvl_memory_address
        page = cls.fabric_page_size
        stride = -(-aligned // page) * page
        cls.current_start_address = DRIVER.reserve(stride * cls.get_comm(mapping).Get_size(), page)
        cls.current_rank_stride = stride
        cls.current_mem_offset = 0
    assert cls.current_mem_offset + aligned <= cls.current_rank_stride
    # _create_and_map_handles: a failure from here on leaves the range reserved, with no record.
    if version >= vendor.MNNVL_HANDLE_PER_ALLOCATION_SINCE:
        fabric, handles = _allocate_handles(comm, aligned)
    else:
        DRIVER.create(aligned)
        fabric = _uses_fabric(cls, version)
        handles = _exchange_handles(comm, comm_rank, fabric, version)
    start, stride, offset = cls.current_start_address, cls.current_rank_stride, cls.current_mem_offset
    for i, handle in enumerate(handles):  # cuMemMap of every rank's handle at its place in the range
        if i != comm_rank:
            DRIVER.import_handle(handle, fabric)
        DRIVER.map(start + stride * i + offset, aligned)
    storage = torch.empty(comm_size * aligned, dtype=torch.uint8)  # peers' rows: not our memory
    seg = Segment(comm, comm_rank, comm_size, size, aligned, storage)
    FABRIC[storage.data_ptr()] = seg
    ptr = start + offset
    cls.allocated_map[ptr] = record(comm=comm, comm_size=comm_size, comm_rank=comm_rank, aligned_size=aligned,
                                    mem_handles=[None] * comm_size, start_address=start, rank_stride=stride,
                                    address_offset=offset, **({"mapping": mapping} if record is _tuple_record else {}),
                                    **({"handle_type": "FABRIC" if fabric else "POSIX_FD"}
                                       if version >= vendor.MNNVL_HANDLE_PER_ALLOCATION_SINCE else {}))
    cls.address_refcnt[start] = cls.address_refcnt.get(start, 0) + 1
    cls.current_mem_offset += aligned
    _SEGMENTS[ptr] = seg
    return ptr, stride


def _close(cls: Any, ptr: int) -> None:
    record = cls.allocated_map.pop(ptr, None)
    seg = _SEGMENTS.pop(ptr, None)
    if seg is not None:
        FABRIC.pop(seg.storage.data_ptr(), None)
    if record is None:
        return
    start = record.start_address if hasattr(record, "start_address") else record[3]
    cls.address_refcnt[start] -= 1
    if cls.address_refcnt[start] == 0:
        cls.address_refcnt.pop(start)
        DRIVER.free(start)
        if start == cls.current_start_address:
            cls.current_start_address = cls.current_rank_stride = cls.current_mem_offset = 0


def _as_tensor(cls: Any, mem: Any, dtype: torch.dtype) -> torch.Tensor:
    """``as_torch_strided_tensor``: rows = the class-level comm's size *now*, as FlashInfer's."""
    num_segments = cls.comm.Get_size()
    return _SEGMENTS[mem.ptr].rows(num_segments).view(dtype)


class MnnvlMemoryBase:
    """``flashinfer.comm.mnnvl.MnnvlMemory``; ``memory_class(version)`` gives each fake release its
    own class, as each installed FlashInfer has its own class-level state."""

    initialized: bool = False
    current_mem_offset: int = 0
    current_rank_stride: int = 0
    current_start_address: int = 0
    allocation_granularity: int = 0
    fabric_page_size: int = vendor.MNNVL_FABRIC_PAGE_SIZE
    comm: Any = None
    dev_id: Any = None
    allocated_map: dict[int, Any] = {}
    address_refcnt: dict[int, Any] = {}
    config: Any = None
    _RECORD: Callable[..., Any] = _AllocationRecord
    _VERSION: vendor.Version = vendor.VERIFIED_UNTIL

    def __init__(self, mapping: Any, size: int) -> None:
        self.mapping = mapping
        self.segment_size = size
        self.ptr, self.rank_stride = type(self).open_mnnvl_memory(mapping, size)

    def __del__(self) -> None:
        if hasattr(self, "ptr"):
            type(self).close_mnnvl_memory(self.ptr)

    @property
    def mapped(self) -> bool:  # v0.6.15+ (records)
        return type(self).allocated_map[self.ptr].mapped

    def as_torch_strided_tensor(self, dtype: torch.dtype) -> torch.Tensor:
        return _as_tensor(type(self), self, dtype)

    @classmethod
    def initialize(cls) -> None:
        cls.initialized = True  # the real one creates a CUDA context and initializes NVML

    @classmethod
    def set_comm_from_config(cls, mapping: Any, config: Any = None) -> None:
        cls.config = config or MnnvlConfig(comm_backend=MPIBackend())
        comm = config.comm_backend.Split(mapping.pp_rank * mapping.cp_size + mapping.cp_rank, mapping.tp_rank)
        cls.comm = comm

    @classmethod
    def get_comm(cls, mapping: Any) -> Any:
        if cls.comm is not None:
            return cls.comm
        comm = MpiComm().Split(mapping.pp_rank * mapping.cp_size + mapping.cp_rank, mapping.tp_rank)
        cls.comm = comm
        return comm

    @classmethod
    def open_mnnvl_memory(cls, mapping: Any, size: int) -> tuple[int, int]:
        return _open(cls, cls._RECORD, mapping, size, cls._VERSION)

    @classmethod
    def close_mnnvl_memory(cls, ptr: int) -> None:
        _close(cls, ptr)


class FabricAgreement:
    """``MnnvlMemory``'s once-per-process FABRIC decision (v0.6.16+; flashinfer-ai/flashinfer@8da13a2
    ... flashinfer-python==0.7.2.post1 flashinfer/comm/mnnvl.py ``_fabric_supported``,
    ``_probe_fabric_supported``, ``_resolve_fabric_support``, ``all_ranks_agree``)."""

    _fabric_supported: bool | None = None

    @staticmethod
    def _probe_fabric_supported(dev_id: int) -> bool:
        return bool(DRIVER.fabric)

    @classmethod
    def _resolve_fabric_support(cls, comm: Any, dev_id: int) -> bool:
        """The cached decision, or every rank's probe AND-reduced over ``comm`` (an allgather) and
        cached for the process."""
        if cls._fabric_supported is not None:
            return cls._fabric_supported
        agreed = all(comm.allgather(cls._probe_fabric_supported(dev_id)))
        cls._fabric_supported = agreed
        return agreed


def memory_class(version: vendor.Version) -> type[MnnvlMemoryBase]:
    """A fresh ``MnnvlMemory`` (own class-level comm, reservation, allocation map, FABRIC decision)
    for ``version``."""
    records = vendor.profile(version).mnnvl_records
    bases: tuple[type, ...] = (MnnvlMemoryBase,)
    if vendor.MNNVL_FABRIC_AGREEMENT_SINCE <= version < vendor.MNNVL_HANDLE_PER_ALLOCATION_SINCE:
        bases += (FabricAgreement,)
    return type("MnnvlMemory", bases, {
        "__module__": __name__, "allocated_map": {}, "address_refcnt": {}, "_VERSION": version,
        "_RECORD": staticmethod(_AllocationRecord if records else _tuple_record)})


def torch_dist_backend_class(version: vendor.Version) -> type[TorchDistBackend]:
    return type("TorchDistBackend", (TorchDistBackend,), {
        "__module__": __name__, "_GLOBAL_ROOT": vendor.profile(version).bcast_global_root})


_RANGE_STATE = ("current_start_address", "current_rank_stride", "current_mem_offset")


@contextmanager
def fresh_address_range(memory: Any) -> Iterator[None]:
    """``memory`` (a fake's or FlashInfer's real ``MnnvlMemory``) as in a fresh process: no MNNVL
    address range reserved; its reservation state is put back on exit (tests share processes)."""
    saved = {name: getattr(memory, name) for name in _RANGE_STATE}
    for name in _RANGE_STATE:
        setattr(memory, name, 0)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(memory, name, value)


def patch_real_mnnvl(real: Any, record_cls: Any, version: vendor.Version) -> Callable[[], None]:
    """Put CPU memory under FlashInfer's real ``MnnvlMemory`` (its comm logic stays: ``get_comm``,
    ``set_comm_from_config``, the class-level ``comm``, and from v0.6.16 ``_resolve_fabric_support``
    with its cached ``_fabric_supported``, whose probe of the device becomes ``DRIVER.fabric``; the
    reservation state is its own class attributes, kept as FlashInfer keeps them); returns the undo."""
    names = ["initialize", "open_mnnvl_memory", "close_mnnvl_memory", "as_torch_strided_tensor"]
    if version >= vendor.MNNVL_HANDLE_PER_ALLOCATION_SINCE:
        names.append("uses_fabric_handles")  # choose_mnnvl_handle_type's precheck: the driver's attribute
    elif version >= vendor.MNNVL_FABRIC_AGREEMENT_SINCE:
        names.append("_probe_fabric_supported")
    saved = {name: real.__dict__[name] for name in names}

    def initialize() -> None:
        real.initialized = True

    def open_mnnvl_memory(mapping: Any, size: int) -> tuple[int, int]:
        return _open(real, record_cls, mapping, size, version)

    def close_mnnvl_memory(ptr: int) -> None:
        _close(real, ptr)

    def as_torch_strided_tensor(self: Any, dtype: torch.dtype) -> torch.Tensor:
        return _as_tensor(real, self, dtype)

    real.initialize = staticmethod(initialize)
    real.open_mnnvl_memory = staticmethod(open_mnnvl_memory)
    real.close_mnnvl_memory = staticmethod(close_mnnvl_memory)
    real.as_torch_strided_tensor = as_torch_strided_tensor
    if "_probe_fabric_supported" in saved:
        real._probe_fabric_supported = staticmethod(FabricAgreement._probe_fabric_supported)
    if "uses_fabric_handles" in saved:  # the same allgather as choose_mnnvl_handle_type
        real.uses_fabric_handles = staticmethod(
            lambda comm, dev_id: all(fabric for fabric in comm.allgather(bool(DRIVER.fabric))))

    def undo() -> None:
        for name, value in saved.items():
            setattr(real, name, value)

    return undo


__all__ = ["CommBackend", "DEVICE", "DRIVER", "FABRIC", "FabricAgreement", "MPIBackend", "MnnvlConfig", "MnnvlMemoryBase", "MpiComm", "Segment",
           "SingletonWorld", "TorchDistBackend", "fresh_address_range", "memory_class", "patch_real_mnnvl",
           "segment_of", "torch_dist_backend_class"]
