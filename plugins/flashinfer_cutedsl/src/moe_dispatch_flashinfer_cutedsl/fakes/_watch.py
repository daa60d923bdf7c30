"""How long the fake kernels' exchanges wait, and for whom: the dispatcher's ``Watch``, when the caller names one.

The fake all-to-all kernels stand in for NVLink stores into peers' memory with collectives over the allocation's
communicator (``mnnvl.Segment.exchange``): blocking gloo calls that wait the process group's own timeout and never
hear of a peer's failure. FlashInfer itself has no such wait: its kernels spin on completion flags in the workspace
and trap after their own timeout (``moeAlltoAllKernels.cu``); its ``MoeAlltoAll`` takes no deadline.

So the waits come from the caller (``moe_dispatch.distributed.emulation``: the release exports its
``emulated_watch`` under ``vendor.EMULATED_WATCH_ATTRIBUTE``): inside it, ``watched_comm`` gives the exchange a
communicator that waits with the dispatcher's ``timeout_s`` and hears its peers' failure notices; outside it (a test
driving a fake by hand) the exchanges run as before. No vendor signature changes.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from moe_dispatch_testing.emulation import WatchedComm, caller_watch


def watched_comm(group: Any) -> WatchedComm | None:
    """A ``Comm`` over ``group`` (None: the default group) waiting with the caller's ``Watch``, when the caller set
    one for the same ranks of a group of this size; None otherwise (the exchange runs as before)."""
    if caller_watch() is None or not dist.is_initialized():
        return None
    comm = WatchedComm(group)
    return comm if comm.caller_watch is not None else None
