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


class GroupCommBackend:
    """FlashInfer's CommBackend interface (Get_rank, Get_size, allgather, bcast, barrier, Split)
    over a torch.distributed group (None: the default group)."""

    def __init__(self, group: Any = None) -> None:
        self._group = group

    def Get_rank(self) -> int:  # noqa: N802 - FlashInfer's names
        return dist.get_rank(self._group)

    def Get_size(self) -> int:  # noqa: N802
        return dist.get_world_size(self._group)

    def allgather(self, data: Any) -> list[Any]:
        out: list[Any] = [None] * self.Get_size()
        dist.all_gather_object(out, data, group=self._group)
        return out

    def bcast(self, data: Any, root: int) -> Any:
        box = [data]
        src = dist.get_global_rank(self._group, root) if self._group is not None else root
        dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

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


def comm_backend_for(comm: md.Comm) -> GroupCommBackend | LocalCommBackend:
    """The CommBackend for the dispatcher's ``Comm``."""
    if dist.is_available() and dist.is_initialized():
        return GroupCommBackend(comm.process_group)
    return LocalCommBackend()


__all__ = ["GroupCommBackend", "LocalCommBackend", "comm_backend_for"]
