"""Checks on the tensors handed to dispatch and combine, before any data is touched.

Shape, dtype and device checks read only metadata and always run. Value checks (ids in
range, no duplicate expert in a token, finite weights and activations) read the data, so on
an accelerator they cost a device sync; ``create_dispatcher(check_inputs=False)`` turns them off.
"""

from __future__ import annotations

import torch

from .errors import CapacityError, InvalidInputError
from .output import DispatchOutput
from .spec import DispatchSpec

_ID_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError("must be a torch.Tensor", parameter=name, value=value, allowed="torch.Tensor")
    return value


def check_dispatch_inputs(
    spec: DispatchSpec,
    device: torch.device | None,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    check_values: bool,
) -> None:
    x = _tensor("hidden_states", hidden_states)
    ids = _tensor("topk_ids", topk_ids)
    w = _tensor("topk_weights", topk_weights)
    h, k = spec.hidden_size, spec.top_k
    if x.dim() != 2 or x.shape[1] != h:
        raise InvalidInputError("wrong shape", parameter="hidden_states", value=x, allowed=f"[num_tokens, {h}]")
    if x.dtype != torch.bfloat16:
        raise InvalidInputError("wrong dtype", parameter="hidden_states", value=x, allowed="torch.bfloat16")
    t = x.shape[0]
    if ids.shape != (t, k):
        raise InvalidInputError("wrong shape", parameter="topk_ids", value=ids, allowed=f"[{t}, {k}] (num_tokens, top_k)")
    if ids.dtype not in _ID_DTYPES:
        raise InvalidInputError("wrong dtype", parameter="topk_ids", value=ids, allowed="torch.int32, torch.int64")
    if w.shape != (t, k):
        raise InvalidInputError(
            "wrong shape", parameter="topk_weights", value=w, allowed=f"[{t}, {k}] (num_tokens, top_k)"
        )
    if w.dtype != torch.float32:
        raise InvalidInputError("wrong dtype", parameter="topk_weights", value=w, allowed="torch.float32")
    for name, tensor in (("hidden_states", x), ("topk_ids", ids), ("topk_weights", w)):
        if device is not None and tensor.device.type != device.type:
            raise InvalidInputError(
                "is on the wrong device for this process group", parameter=name, value=tensor, allowed=str(device)
            )
    if t > spec.num_max_dispatch_tokens_per_rank:
        raise CapacityError(
            f"a batch of {t} tokens exceeds the per-rank capacity; raise --num-max-dispatch-tokens-per-rank "
            f"(DispatchSpec.num_max_dispatch_tokens_per_rank) to at least {t}",
            parameter="num_max_dispatch_tokens_per_rank",
            value=spec.num_max_dispatch_tokens_per_rank,
            allowed=f">= {t}",
        )
    if not check_values or t == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= spec.num_experts:
        bad = lo if lo < -1 else hi
        raise InvalidInputError(
            "expert id out of range", parameter="topk_ids", value=bad, allowed=f"-1 (no expert) or 0..{spec.num_experts - 1}"
        )
    if k > 1:
        s = torch.sort(ids, dim=1).values
        dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
        if bool(dup.any()):
            row = int(dup.any(dim=1).nonzero()[0, 0])
            raise InvalidInputError(
                f"token {row} lists the same expert twice",
                parameter="topk_ids",
                value=ids[row].tolist(),
                allowed="distinct expert ids per token (-1 may repeat)",
            )
    if not bool(torch.isfinite(w).all()):
        raise InvalidInputError("contains NaN or Inf", parameter="topk_weights", value=w, allowed="finite values")
    if not bool(torch.isfinite(x).all()):
        raise InvalidInputError("contains NaN or Inf", parameter="hidden_states", value=x, allowed="finite values")


def check_combine_inputs(
    spec: DispatchSpec, owner: object, expert_output: torch.Tensor, dispatch_output: DispatchOutput
) -> None:
    if not isinstance(dispatch_output, DispatchOutput):
        raise InvalidInputError(
            "must be the DispatchOutput this dispatcher returned",
            parameter="dispatch_output",
            value=dispatch_output,
            allowed="DispatchOutput",
        )
    if getattr(dispatch_output.handle, "owner", owner) is not owner:
        raise InvalidInputError(
            "comes from another dispatcher; combine each output on the dispatcher that produced it",
            parameter="dispatch_output",
            value=type(dispatch_output.handle).__name__,
        )
    y = _tensor("expert_output", expert_output)
    expected = (*dispatch_output.hidden_states.shape[:-1], spec.hidden_size)
    if tuple(y.shape) != expected:
        raise InvalidInputError("wrong shape", parameter="expert_output", value=y, allowed=f"{list(expected)}")
    if y.dtype != torch.bfloat16:
        raise InvalidInputError(
            "wrong dtype (combine sends BF16)", parameter="expert_output", value=y, allowed="torch.bfloat16"
        )
    if y.device != dispatch_output.hidden_states.device:
        raise InvalidInputError(
            "is not on the device of the dispatch output",
            parameter="expert_output",
            value=y,
            allowed=str(dispatch_output.hidden_states.device),
        )


__all__ = ["check_combine_inputs", "check_dispatch_inputs"]
