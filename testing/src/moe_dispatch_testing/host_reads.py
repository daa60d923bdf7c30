"""Which aten ops a block of code runs, and which of them read tensor data on the host.

A host read is ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``), an op whose output shape
depends on the data (``nonzero``, ``masked_select``, ``unique``...), or a tensor method that copies the data out
without any aten op on CPU (``tolist()``, ``numpy()``, ``cpu()``). On CPU nothing blocks, so the tests record them
and fail on those: on an accelerator the same code would stall the stream and could not be captured in a CUDA graph.

``RecordedOps(packages)`` keeps only the reads of the code under test: a read made inside a call into any other
package is the vendor library's (on CPU, its fake, whose Python stands for device kernels) and is left out, as is
one inside a module of ``leave_out``. Torch and the standard library count as their caller.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import FrameType
from typing import NamedTuple

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

#: aten ops (by schema name) and tensor methods that read data on the host.
HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
                        "unique_dim", "repeat_interleave", "item", "equal", "is_nonzero", "tolist", "numpy", "cpu"})
#: Those that reach no aten op on CPU: seen as tensor methods instead.
_METHODS = frozenset({"tolist", "numpy", "cpu"})
_TRANSPARENT = frozenset({"torch"}) | frozenset(sys.stdlib_module_names)


class HostRead(NamedTuple):
    op: str
    where: str  # ``module:line in function``, the innermost frame outside torch and the standard library


class RecordedOps(TorchDispatchMode):
    """``with RecordedOps() as seen:`` the aten ops run inside, by schema name, in ``seen.ops``; the host reads in
    ``seen.reads``, their names in ``seen.host_reads()``. On this thread only.

    :param packages: the top-level packages of the code under test (None: a read anywhere counts).
    :param leave_out: modules whose reads do not count, whatever calls them.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's guard against dynamo imports dynamo at the first op: 1.5 s in every rank process

    def __init__(self, packages: Iterable[str] | None = None, leave_out: Iterable[str] = ()) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.reads: list[HostRead] = []
        self.packages = None if packages is None else frozenset(packages)
        self.leave_out = frozenset(leave_out)
        self._methods = _Methods(self)
        self._entered: FrameType | None = None

    def __enter__(self) -> RecordedOps:  # noqa: PYI034
        self._entered = sys._getframe(1)  # the frames from there out are the recording caller's
        self._methods.__enter__()
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._methods.__exit__(*exc)
        self._entered = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name.split("::")[-1]
        self.ops.append(name)
        if name in HOST_READS:
            self._read(name)
        return func(*args, **(kwargs or {}))

    def _read(self, op: str) -> None:
        where = ""
        frame = sys._getframe(1)
        while frame is not None and frame is not self._entered:
            module = frame.f_globals.get("__name__", "")
            top = module.partition(".")[0]
            if module in self.leave_out:
                return
            if top not in _TRANSPARENT and module != __name__:
                if self.packages is not None and top not in self.packages:
                    return  # inside the vendor's call
                where = where or f"{module}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back  # type: ignore[assignment]
        self.reads.append(HostRead(op, where or "torch"))

    def host_reads(self) -> list[str]:
        return sorted({r.op for r in self.reads})


class _Methods(TorchFunctionMode):
    """The tensor methods of ``_METHODS`` while ``recorded`` records (not under ``_disable_current_modes()``, which
    a test uses to leave a fake's calls out)."""

    def __init__(self, recorded: RecordedOps) -> None:
        super().__init__()
        self.recorded = recorded

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in _METHODS and self.recorded in _get_current_dispatch_mode_stack():
            self.recorded._read(func.__name__)
        return func(*args, **(kwargs or {}))


__all__ = ["HOST_READS", "HostRead", "RecordedOps"]
