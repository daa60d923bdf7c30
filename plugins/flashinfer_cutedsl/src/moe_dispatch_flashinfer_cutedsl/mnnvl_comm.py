"""The communicator FlashInfer allocates MNNVL workspaces over: the dispatcher's own group.

Without ``mnnvl_config`` FlashInfer falls back to mpi4py's COMM_WORLD, which under torchrun (no
mpirun) is a one-rank world: the workspace comes out ``[1, size]`` and ``moe_a2a_initialize``
fails ``workspace.size(0) == ep_size``. So the adapter passes ``MnnvlConfig(comm_backend=...)``
with this object, built on the process group the dispatcher was created on (vLLM does the same
with its CustomCommunicator). FlashInfer's own ``TorchDistBackend`` is not used: its ``Split``
treats group ranks as global ranks (right for the WORLD group only) and creates process groups.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import moe_dispatch as md
import moe_dispatch.backend as mdb


class GroupCommBackend:
    """FlashInfer's CommBackend interface (Get_rank, Get_size, allgather, bcast, barrier, Split)
    over the dispatcher's ``Comm``: FlashInfer's start-up exchanges (MNNVL handles, the fabric
    decision, the workspace barrier) wait with the dispatcher's ``timeout_s`` and hear its peers'
    failure notices, as its own collectives do; a peer that fails while the workspaces are being
    allocated is named, not waited for. ``comm`` None: a ``Comm`` over the default group."""

    def __init__(self, comm: mdb.Comm | None = None) -> None:
        self._comm = comm if comm is not None else mdb.Comm()

    def Get_rank(self) -> int:  # noqa: N802 - FlashInfer's names
        return self._comm.rank

    def Get_size(self) -> int:  # noqa: N802
        return self._comm.world_size

    def allgather(self, data: Any) -> list[Any]:
        return self._comm.gather_object(data, "flashinfer_a2a: MNNVL allgather")

    def bcast(self, data: Any, root: int) -> Any:
        """``root`` is a rank of the group (FlashInfer's ``Split`` communicators are group-relative)."""
        return self._comm.gather_object(data if self.Get_rank() == root else None, "flashinfer_a2a: MNNVL bcast")[root]

    def barrier(self) -> None:
        self._comm.barrier("flashinfer_a2a: MNNVL barrier")

    def Split(self, color: int, key: int) -> "GroupCommBackend":  # noqa: N802
        """FlashInfer splits by (pp, cp) colour and tp key; the adapter's Mapping makes that the
        identity (colour 0, key = rank on every rank, each rank checking its own). Anything else
        would need new process groups: refused."""
        if color != 0 or key != self.Get_rank():
            raise md.InvalidSpecError(
                "FlashInfer asked to split the dispatcher's group; the adapter only hands it the whole group",
                parameter="group", value=(color, key), allowed=f"(0, {self.Get_rank()}): the adapter's Mapping")
        return self


class LocalCommBackend:
    """One process without torch.distributed: a world of one."""

    def Get_rank(self) -> int:  # noqa: N802
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def allgather(self, data: Any) -> list[Any]:
        return [data]

    def bcast(self, data: Any, root: int) -> Any:
        return data

    def barrier(self) -> None:
        return None

    def Split(self, color: int, key: int) -> "LocalCommBackend":  # noqa: N802
        return self


def comm_backend_for(comm: mdb.Comm) -> GroupCommBackend | LocalCommBackend:
    """The CommBackend for the dispatcher's ``Comm``."""
    if dist.is_available() and dist.is_initialized():
        return GroupCommBackend(comm)
    return LocalCommBackend()


__all__ = ["GroupCommBackend", "LocalCommBackend", "comm_backend_for"]
