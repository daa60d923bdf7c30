"""Checks on what a backend returns, so a plugin's bug is a ``PluginError`` naming the backend at
the call that produced it, not an ``AttributeError`` or a wrong shape in the engine later.

- **Metadata** (always on, about a microsecond per call): dispatch returns a ``DispatchOutput``
  whose rows have the wire dtype's tensor dtype and row width, in the layout's rank, with one
  ``group_list`` entry per local expert; combine returns bf16 ``[T, H]`` for the T tokens
  dispatched.
  PACKED rows at the ``expert_alignment`` the backend was asked to write (the spec's where it
  aligns them itself, else 1).
- **Values** (with the input value checks, ``check_inputs``; one device sync): the rows a
  ``group_list`` claims fit the rows returned (PACKED: exactly, or within the rows with their
  segments aligned; MASKED: at most the capacity per expert), and no count is negative.

The conformance kit checks more (the rows' contents); these are what the core can afford on
every call.
"""

from __future__ import annotations

import torch

from .dtypes import Layout
from .errors import PluginError
from .formats import wire_dtype
from .output import DispatchOutput, align_up
from .spec import DispatchSpec


_PACKED, _MASKED = Layout.PACKED, Layout.MASKED


class OutputChecks:
    """The output checks of one dispatcher, against values computed once."""

    __slots__ = ("backend", "hidden", "element", "columns", "local_experts", "alignment", "worst_case", "_groups")

    def __init__(self, backend: str, spec: DispatchSpec, world_size: int, alignment: int = 1, *,
                 worst_case: bool = False) -> None:
        self.backend = backend
        self.hidden = spec.hidden_size
        dtype = wire_dtype(spec.output_dtype)  # type: ignore[arg-type]  # resolved by now
        self.element = dtype.element
        self.columns = dtype.row_columns(spec.hidden_size)
        self.local_experts = spec.num_experts // world_size
        self._groups = (self.local_experts,)
        self.alignment = alignment  # of the backend's PACKED rows
        #: PACKED rows may be the backend's worst case, past the segments' end (``Capabilities.worst_case_rows``).
        self.worst_case = worst_case

    def dispatch(self, out: object, check_values: bool) -> DispatchOutput:
        # One combined test on the hot path (dtypes and enums are singletons: ``is``); the checks
        # below only run, to say what is wrong, when it fails.
        try:
            rows, groups, layout = out.hidden_states, out.group_list, out.layout  # type: ignore[attr-defined]
            shape = rows.shape
            ok = (type(out) is DispatchOutput and rows.dtype is self.element and shape[-1] == self.columns
                  and groups.shape == self._groups and not groups.is_floating_point()
                  and (len(shape) == 2 and out.expert_alignment == self.alignment  # type: ignore[attr-defined]
                       if layout is _PACKED else
                       (layout is _MASKED and len(shape) == 3 and shape[0] == self.local_experts))
                  and out.group_list_type in (0, 1))  # type: ignore[attr-defined]
        except (AttributeError, TypeError, IndexError):
            ok = False
        if not ok:
            self._diagnose(out)
        if check_values:
            self._check_counts(out)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    def _diagnose(self, out: object) -> None:
        if not isinstance(out, DispatchOutput):
            raise self._broken("dispatch()", "its result", type(out).__name__, "a moe_dispatch.DispatchOutput")
        rows, groups = out.hidden_states, out.group_list
        if not (isinstance(rows, torch.Tensor) and rows.dtype == self.element and rows.dim() >= 1
                and rows.shape[-1] == self.columns):
            raise self._broken("hidden_states", "dispatch() returned these rows", _described(rows),
                               f"a {self.element} tensor [..., {self.columns}]")
        layout = out.layout
        if rows.dim() != (3 if layout is Layout.MASKED else 2) or not isinstance(layout, Layout):
            raise self._broken("layout", f"dispatch() returned {layout!r} rows", _described(rows),
                               "PACKED [rows, cols] or MASKED [local experts, capacity, cols]")
        if not (isinstance(groups, torch.Tensor) and groups.shape == (self.local_experts,)
                and not groups.is_floating_point() and out.group_list_type in (0, 1)):
            raise self._broken("group_list", "dispatch() returned this group_list", _described(groups),
                               f"an integer tensor [{self.local_experts}] (one entry per local expert), type 0 or 1")
        if layout is Layout.MASKED and rows.shape[0] != self.local_experts:
            raise self._broken("hidden_states", "dispatch() returned these MASKED rows", _described(rows),
                               f"[{self.local_experts}, capacity, {self.columns}]")
        if layout is Layout.PACKED and out.expert_alignment != self.alignment:
            raise self._broken("expert_alignment", "dispatch() returned PACKED rows at another alignment",
                               out.expert_alignment, f"{self.alignment} (what this dispatcher asks of the backend)")

    def _check_counts(self, out: DispatchOutput) -> None:
        counts = out.expert_counts()
        per_expert = out.hidden_states.shape[1] if out.layout is Layout.MASKED else out.hidden_states.shape[0]
        lo = int(counts.min()) if counts.numel() else 0  # one sync for both on an accelerator: small tensors
        if out.layout is Layout.MASKED:
            bad = counts.numel() > 0 and (lo < 0 or int(counts.max()) > per_expert)
            limit = f"0..{per_expert} rows per expert (the MASKED capacity)"
        elif out.expert_alignment > 1 or self.worst_case:
            bad = lo < 0 or int(align_up(counts, out.expert_alignment).sum()) > per_expert
            limit = (f"counts >= 0 whose segments, aligned to {out.expert_alignment} rows, fit the {per_expert} rows"
                     if out.expert_alignment > 1 else
                     f"counts >= 0 adding up to at most the {per_expert} rows returned (the backend's worst case)")
        else:
            bad = lo < 0 or int(counts.sum()) != per_expert
            limit = f"counts >= 0 adding up to the {per_expert} rows returned"
        if bad:
            raise self._broken("group_list", "dispatch() returned counts that do not fit its rows", counts.tolist(), limit)

    def combine(self, result: object, dispatch_output: DispatchOutput) -> torch.Tensor:
        tokens = dispatch_output.topk_ids.shape[0]
        if not (isinstance(result, torch.Tensor) and result.dtype is torch.bfloat16
                and result.shape == (tokens, self.hidden)):
            raise self._broken("combine()", "its result", _described(result), f"a bfloat16 tensor [{tokens}, {self.hidden}]")
        return result

    def _broken(self, field: str, what: str, value: object, allowed: str) -> PluginError:
        return PluginError(f"backend {self.backend!r} broke the contract: {what}", parameter=field, value=value,
                           allowed=allowed)


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={list(value.shape)}, dtype={value.dtype})"
    return type(value).__name__ if value is not None else "None"


__all__ = ["OutputChecks"]
