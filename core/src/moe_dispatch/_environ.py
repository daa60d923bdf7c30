"""Scoped changes to the process environment for vendor calls that read or write it: some vendor libraries read
part of their configuration with ``getenv`` at the call (DeepEP-Ascend's ``DEEP_NORMAL_MODE_USE_INT8_QUANT``), and
some constructors write it (DeepEP's V1 ``Buffer`` sets ``NVSHMEM_*``). ``restored_environ`` runs such a call with the
variables it needs and puts them back afterwards:

- Only the named variables are touched (the keys of ``values`` and the ``names`` the block may write), each restored
  to its value when the block began (unset if it was unset); a variable another thread sets meanwhile stays as that
  thread left it. A named variable already gone is left unset (never a ``KeyError``).
- Blocks that agree share; blocks that disagree wait. Blocks that set the same variables to the same values run at
  once; a block that wants another value for a variable a block on another thread holds, or that names a variable
  the vendor may write, waits until those blocks end, so each vendor call sees its own values throughout. Blocks nest
  on one thread: leaving an inner block puts back the outer block's value.
- Other threads still see the values while a block runs: ``os.environ`` is the process's one environment and the
  vendor reads it during the call. The blocks are ordered against each other only.
- A block lasts as long as its vendor call, and some vendor calls are collectives: threads whose blocks disagree (two
  DeepEP V1 ``Buffer`` constructions) run one after the other, so if the ranks order them differently they wait for
  each other until the collective's timeout; such threads must reach those calls in the same order on every rank.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from ._errors import InvalidSpecError


@dataclass
class _Layer:
    """One value of one variable, held by the blocks (counted per thread) that set it or agreed
    with it; ``at_start`` is what the variable was when the layer began, put back when it ends."""

    value: Any  # str, None (unset) or _WRITES
    at_start: str | None
    holders: Counter[int] = field(default_factory=Counter)

    def agrees(self, value: Any) -> bool:
        return value is not _WRITES and self.value is not _WRITES and self.value == value


@dataclass
class _Held:
    """The variables blocks hold now: per name a stack of layers (more than one only while one
    thread nests blocks that set different values)."""

    layers: dict[str, list[_Layer]] = field(default_factory=dict)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def conflicts(self, plan: Mapping[str, Any], me: int) -> bool:
        for name, value in plan.items():
            stack = self.layers.get(name)
            if stack and not stack[-1].agrees(value) and any(set(layer.holders) - {me} for layer in stack):
                return True  # another thread's block holds another value
        return False

    def enter(self, plan: Mapping[str, Any], me: int) -> list[_Layer]:
        joined = []
        for name, value in plan.items():
            stack = self.layers.setdefault(name, [])
            if not stack or not stack[-1].agrees(value):
                stack.append(_Layer(value, os.environ.get(name)))
                _put(name, value)
            stack[-1].holders[me] += 1
            joined.append(stack[-1])
        return joined

    def leave(self, plan: Mapping[str, Any], joined: list[_Layer], me: int) -> None:
        for name, layer in zip(plan, joined):
            layer.holders -= Counter([me])  # drops ``me`` at zero
            stack = self.layers[name]
            while stack and not stack[-1].holders:  # layers all of whose blocks have ended, top first
                _put(name, stack.pop().at_start)
            if not stack:
                del self.layers[name]


#: A variable the vendor may write (``names``): no other thread's block may share it.
_WRITES: Any = object()
# Process-wide, as os.environ is.
_HELD = _Held()


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
    if value is _WRITES:  # the vendor writes it during the block: leave the current value
        return
    if value is None:
        os.environ.pop(name, None)  # never KeyError: gone already is fine
    elif os.environ.get(name) != value:
        os.environ[name] = value


@contextmanager
def restored_environ(values: Mapping[str, str | None] | None = None, *, names: Iterable[str] = ()) -> Iterator[None]:
    """Set ``values`` for the duration of the block (a value of None unsets the variable), then restore every variable
    named in ``values`` or ``names`` to its value from before the block. Nothing else in the environment is read or
    changed; a block that disagrees with one running on another thread waits for it (see the module docstring).

    :param values: the variables the vendor reads during the block.
    :param names: variables the block may write without setting them here (a vendor constructor's writes, e.g.
        ``vendor.NVSHMEM_WRITTEN`` for DeepEP's V1 ``Buffer``): restored too.
    :raises InvalidSpecError: a name or value ``os.environ`` cannot hold.
    """
    wanted, touched = _checked(values, names)
    plan = {name: wanted.get(name, _WRITES) for name in touched}
    me = threading.get_ident()
    with _HELD.changed:
        _HELD.changed.wait_for(lambda: not _HELD.conflicts(plan, me))
        joined = _HELD.enter(plan, me)
    try:
        yield
    finally:
        with _HELD.changed:
            _HELD.leave(plan, joined, me)
            _HELD.changed.notify_all()
