"""Ranks agree on a dispatcher's configuration before its first collective.

DeepEP hangs when ranks disagree on ``num_max_dispatch_tokens_per_rank``; any exchange does when ranks disagree on
hidden size, top-k or the wire dtype. At creation every rank gathers every rank's fingerprint (a flat dict of the fields
that must match) and compares: a mismatch is a ``ConfigMismatchError`` on every rank naming the field and each rank's
value, instead of a hang or corrupt tokens later."""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping

import torch

from .._errors import ConfigMismatchError, PeerFailedError
from .comm import Comm

_BYTES = 4096  # one fixed-size slot per rank: a single gather, no length exchange
_UID = "_uid"  # rank 0's random id, not compared: names the dispatcher's store keys
_FAILED = "_failed"  # a rank that could not prepare sends its error instead of a fingerprint


def agree(comm: Comm, fields: Mapping[str, Any], stage: str, *, failure: BaseException | None = None) -> str:
    """Gather ``fields`` from every rank and compare them; return the dispatcher's uid. A rank that failed while
    preparing passes ``failure`` instead: the others raise ``PeerFailedError`` naming it, and it returns ("") so that
    its caller raises its own error."""
    mine = ({_FAILED: f"{type(failure).__name__}: {failure}"} if failure is not None
            else {str(k): _plain(v) for k, v in fields.items()})
    if comm.rank == 0:
        mine[_UID] = uuid.uuid4().hex  # also when rank 0 failed: the others read the uid of rank 0
    raw = json.dumps(mine).encode()  # insertion order: the first differing field named is the most basic
    if len(raw) > _BYTES:
        raise ConfigMismatchError(
            f"the {stage} fingerprint is {len(raw)} bytes, more than the {_BYTES} the agreement carries",
            parameter="fingerprint", value=sorted(mine), allowed=f"<= {_BYTES} bytes of JSON")
    if comm.world_size == 1:  # nothing to compare with
        return "" if failure is not None else mine[_UID]
    if comm.checks_calls_everywhere:  # gloo: the call check first, as every call's first collective
        check_creation(comm, 0)
    slot = torch.zeros(_BYTES, dtype=torch.uint8)
    slot[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = comm.gather_uncounted(slot, f"agreement on the {stage}")
    everyone = [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in gathered]  # JSON has no NUL
    failed = [(r, d[_FAILED]) for r, d in enumerate(everyone) if _FAILED in d]
    if failure is not None:
        return ""
    if failed:
        rank, reason = failed[0]
        raise PeerFailedError(f"rank {rank} could not create the dispatcher: {reason}", rank=rank, reason=reason,
                              operation=f"agreement on the {stage}")
    _compare(everyone, stage)
    return str(everyone[0][_UID])


def check_creation(comm: Comm, step: int) -> None:
    """The call check for ``step`` of a creation on gloo: a creation that meets another call on a peer (threads that
    create and call on one group in different orders on different ranks, or a peer whose creation failed and that
    went on) raises ``CallOrderError`` there and here, before a collective of another size (gloo would abort the
    process). Not the engine's traffic."""
    comm.begin("create", step)
    counted = comm.traffic.copy()
    comm.watch.check_call(comm, None)  # type: ignore[union-attr]
    comm.traffic.restore(counted)


def _plain(value: Any) -> Any:
    """JSON-safe and comparable: enums by value, everything else by repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return value.value if hasattr(value, "value") else repr(value)


def _compare(everyone: list[dict[str, Any]], stage: str) -> None:
    for key in [k for k in dict.fromkeys(k for d in everyone for k in d) if k != _UID]:
        values = [d.get(key) for d in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ConfigMismatchError(
                f"ranks disagree on {key} ({per_rank}); every rank of the group must create this dispatcher "
                f"with the same {stage}",
                parameter=key, value=values, allowed="the same value on every rank")
