"""Scoped changes to the process environment for vendor calls that read or write it.

Some vendor libraries take part of their configuration from the process environment at the
call (DeepEP-Ascend's ``DEEP_NORMAL_MODE_USE_INT8_QUANT``, ``MOE_EXPERT_TOKEN_NUMS_TYPE``; the
C++ calls ``getenv``), and some constructors write it (DeepEP's V1 ``Buffer`` sets ``NVSHMEM_*``
before NVSHMEM starts). ``restored_environ`` runs such a call with the variables it needs and
puts them back afterwards:

- **Only the named variables are touched**: the keys of ``values`` and the ``names`` the block
  may write. Each is restored to the value it had when the block began (unset if it was unset);
  no other variable is read, written or deleted, so a variable another thread sets or deletes
  meanwhile stays as that thread left it.
- **One block at a time in the process** (a re-entrant lock): two dispatches on two threads
  cannot interleave their set and restore, so each vendor call sees its own values. Re-entrant,
  so a block opened inside another on the same thread does not deadlock; the inner block
  restores what the outer one set.
- **Other threads can still see the values while a block runs.** ``os.environ`` is the
  process's one environment (POSIX has no per-thread environment), and the vendor reads the
  process environment (``getenv``) during the call, so the value has to be there, for every
  thread, for as long as the call runs. The lock orders the blocks against each other; it
  cannot hide them from code that reads ``os.environ`` without taking it.
- The lock is held for the whole block, the vendor call included. When that call is a collective,
  threads of one rank that dispatch at once must do so in the same order on every rank (or from
  one thread per rank): rank 0 holding the lock in thread A's collective while rank 1 holds it in
  thread B's is a deadlock between the ranks, which only the collective's timeout ends
  (docs/reliability.md).
- Never a ``KeyError``: a named variable already gone is simply left unset.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

from .errors import InvalidSpecError

# One scoped change at a time (os.environ is process-wide); re-entrant so a vendor call made
# inside a caller's scoped block does not deadlock on its own scoped block.
_LOCK = threading.RLock()


def _checked(values: Mapping[str, str | None] | None, names: Iterable[str]) -> tuple[dict[str, str | None], list[str]]:
    if values is not None and not isinstance(values, Mapping):
        raise InvalidSpecError("the variables to set for the block", parameter="values", value=values,
                               allowed="a mapping of names to str (None: unset for the block), or None")
    wanted = dict(values or {})
    if isinstance(names, str):  # one name given bare would be read letter by letter
        raise InvalidSpecError("the variables the block may write", parameter="names", value=names,
                               allowed="an iterable of names, e.g. (name,)")
    touched = list(dict.fromkeys([*wanted, *names]))
    for name in touched:
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise InvalidSpecError("not an environment variable name", parameter="names", value=name,
                                   allowed="a non-empty str without '=' or NUL")
    for name, value in wanted.items():
        if value is not None and (not isinstance(value, str) or "\0" in value):
            raise InvalidSpecError(f"not a value for {name}", parameter=f"values[{name!r}]", value=value,
                                   allowed="a str without NUL, or None (unset for the block)")
    return wanted, touched


def _put(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)  # never KeyError: gone already is fine
    elif os.environ.get(name) != value:
        os.environ[name] = value


@contextmanager
def restored_environ(values: Mapping[str, str | None] | None = None, *, names: Iterable[str] = ()) -> Iterator[None]:
    """Set ``values`` for the duration of the block (a value of None unsets the variable), then
    restore every variable named in ``values`` or ``names`` to its value from before the block.

    :param values: the variables the vendor reads during the block.
    :param names: variables the block may write without setting them here (a vendor constructor's
        writes, e.g. ``vendor.NVSHMEM_WRITTEN`` for DeepEP's V1 ``Buffer``): restored too.
    :raises InvalidSpecError: a name or value ``os.environ`` cannot hold.

    Nothing else in the environment is read or changed. Blocks are serialized process-wide by a
    re-entrant lock, held for the whole block; other threads still see the values while it runs
    (see the module docstring).
    """
    wanted, touched = _checked(values, names)
    with _LOCK:
        before = {name: os.environ.get(name) for name in touched}
        try:
            for name, value in wanted.items():
                _put(name, value)
            yield
        finally:
            for name, value in before.items():
                _put(name, value)


__all__ = ["restored_environ"]
