"""Vendor constructors that write ``os.environ`` (DeepEP's V1 ``Buffer`` sets NVSHMEM_*
variables) run inside ``restored_environ()``: the variables are there while the vendor reads
them, and the process environment is exactly as before afterwards."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator, Mapping

# One scoped change at a time (os.environ is process-wide); re-entrant so a vendor call made
# inside a caller's scoped block does not deadlock on its own scoped block.
_LOCK = threading.RLock()


@contextmanager
def restored_environ(values: Mapping[str, str] | None = None) -> Iterator[None]:
    """Set ``values`` (if any) for the duration of the block, then restore every variable the
    block added, changed or removed."""
    with _LOCK:
        before = dict(os.environ)
        try:
            os.environ.update(values or {})
            yield
        finally:
            for key in set(os.environ) - set(before):
                del os.environ[key]
            for key, value in before.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value


__all__ = ["restored_environ"]
