"""Which aten ops a block of code runs, and which of them read tensor data on the host.

A host read is ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``) or an op whose
output shape depends on the data (``nonzero``, ``masked_select``, ``unique``...). On CPU nothing
blocks, so the tests record the ops (a ``TorchDispatchMode``) and fail on those: on an accelerator
the same code would stall the stream and could not be captured in a CUDA graph. ``tolist()`` and
``.cpu()`` reach no aten op on CPU: this sees the ops only.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops (by schema name) that read data on the host.
HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                        "unique_dim", "repeat_interleave", "item", "equal", "is_nonzero", "tolist"})


class RecordedOps(TorchDispatchMode):
    """``with RecordedOps() as seen:`` the aten ops run inside, by schema name, in ``seen.ops``;
    ``seen.host_reads()`` those of ``HOST_READS``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> list[str]:
        return sorted(set(self.ops) & HOST_READS)


__all__ = ["HOST_READS", "RecordedOps"]
