"""Checks on the tensors handed to dispatch and combine, before any data is touched or any
collective entered. Each failure is a typed error (``InvalidInputError``, ``CapacityError``)
naming the parameter, the value seen and what is allowed, raised on the rank that has the
bad input.

Two kinds of check:

- **Metadata** (always on): types, shapes, dtypes, devices, the batch against
  ``num_max_dispatch_tokens_per_rank``, and that a ``DispatchOutput`` comes from this
  dispatcher. They read no tensor data and cost about half a microsecond per call on a CPU
  host: one combined test against values computed once per dispatcher (``InputChecks``); only
  when it fails does the slower diagnosis run, which finds the first thing wrong and raises
  its precise error.
- **Values** (the ``check_inputs`` switch): expert ids in ``-1, 0..E-1``, no expert twice in
  a token, finite ``topk_weights`` and ``hidden_states``. They read the data, so on an
  accelerator they cost kernels and one device sync per dispatch (all flags are reduced to
  one boolean first). By default (``check_inputs=None``) they run where the data is host
  memory (gloo, one process on a CPU) and not on an accelerator, where a sync per call would
  stall the device queue: no micro-batch overlap, no CUDA-graph capture (issue 16).
  ``check_inputs=True`` runs them everywhere (debugging an engine's router on a GPU),
  ``False`` nowhere. The metadata checks stay on either way.

Checks on what a backend returns, so a plugin's bug is a ``PluginError`` naming the backend at
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

from ._errors import CapacityError, InvalidInputError, PluginError
from ._output import DispatchOutput, align_up
from ._pending import Pending
from ._spec import DispatchSpec
from ._wire import Layout, wire_dtype

_BF16, _F32, _I32, _I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
_ID_DTYPES = (_I32, _I64)
_FAST_FAIL = (AttributeError, TypeError, ValueError, IndexError)


class InputChecks:
    """The input checks of one dispatcher, with what they compare against computed once.

    :param spec: the dispatcher's spec, its wire dtype resolved.
    :param device: the device type of the process group (None: any).
    :param owner: the backend dispatcher; a ``DispatchOutput`` whose ``handle.owner`` is
        another object came from another dispatcher.
    """

    __slots__ = ("spec", "device", "owner", "_hidden", "_top_k", "_capacity", "_seen", "_rows_are_hidden")

    def __init__(self, spec: DispatchSpec, device: torch.device | None, owner: object) -> None:
        self.spec = spec
        self.device = device
        self.owner = owner
        self._hidden = spec.hidden_size
        self._top_k = spec.top_k
        self._capacity = spec.num_max_dispatch_tokens_per_rank
        # The device of the last inputs that passed: the fast path compares against it, so
        # an index (cuda:3) never needs the slow type comparison after the first call.
        self._seen: torch.device | None = None
        # Dispatched rows are [..., H] for every dtype but packed ones (NVFP4: [..., H/2]): then
        # the expert output has exactly the dispatched rows' shape, one comparison.
        self._rows_are_hidden = (spec.output_dtype is not None
                                 and wire_dtype(spec.output_dtype).row_columns(spec.hidden_size) == spec.hidden_size)

    def dispatch(
        self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        check_values: bool | None = True,
    ) -> bool:
        """Raise a typed error for a bad dispatch input; ``check_values`` adds the value checks (None:
        where the data is host memory, the dispatcher's default). Returns whether they ran
        (``runs_value_checks``): the output checks read the counts under the same rule."""
        try:
            t, h = hidden_states.shape
            dev = hidden_states.device
            ok = (
                h == self._hidden
                and t <= self._capacity
                and hidden_states.dtype is _BF16
                and topk_weights.dtype is _F32
                and ((d := topk_ids.dtype) is _I64 or d is _I32)
                and topk_ids.shape == (t, self._top_k)
                and topk_weights.shape == (t, self._top_k)
                and dev == self._seen
                and topk_ids.device == dev
                and topk_weights.device == dev
            )
        except _FAST_FAIL:
            ok = False
        if not ok:
            diagnose_dispatch_inputs(self.spec, self.device, hidden_states, topk_ids, topk_weights)
            t = hidden_states.shape[0]
            if topk_ids.device == hidden_states.device == topk_weights.device:
                self._seen = hidden_states.device
        values = runs_value_checks(check_values, hidden_states)
        if values and t:
            check_dispatch_values(self.spec, hidden_states, topk_ids, topk_weights)
        return values

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> None:
        """Raise a typed error for a bad combine input (metadata only: reads no data)."""
        try:
            rows = dispatch_output.hidden_states
            ok = (
                type(dispatch_output) is DispatchOutput
                and expert_output.dtype is _BF16
                and getattr(dispatch_output.handle, "owner", self.owner) is self.owner
                and (
                    expert_output.shape == rows.shape
                    if self._rows_are_hidden
                    else expert_output.shape[-1] == self._hidden and expert_output.shape[:-1] == rows.shape[:-1]
                )
                and expert_output.device == rows.device
            )
        except _FAST_FAIL:
            ok = False
        if not ok:
            diagnose_combine_inputs(self.spec, self.owner, expert_output, dispatch_output)


def check_dispatch_inputs(
    spec: DispatchSpec,
    device: torch.device | None,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    check_values: bool,
) -> None:
    """One-off form of ``InputChecks.dispatch``: the metadata checks, and the value checks
    when ``check_values``."""
    InputChecks(spec, device, None).dispatch(hidden_states, topk_ids, topk_weights, check_values)


def check_combine_inputs(
    spec: DispatchSpec, owner: object, expert_output: torch.Tensor, dispatch_output: DispatchOutput
) -> None:
    """One-off form of ``InputChecks.combine``."""
    InputChecks(spec, None, owner).combine(expert_output, dispatch_output)


# -- the slow path: find the first thing wrong and say so precisely ----------------------------


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidInputError(
            f"must be a torch.Tensor, not {type(value).__name__}", parameter=name, value=value, allowed="torch.Tensor"
        )
    return value


def diagnose_dispatch_inputs(
    spec: DispatchSpec,
    device: torch.device | None,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> None:
    """Every metadata check of a dispatch, one by one; returns when all pass."""
    x = _tensor("hidden_states", hidden_states)
    ids = _tensor("topk_ids", topk_ids)
    w = _tensor("topk_weights", topk_weights)
    h, k = spec.hidden_size, spec.top_k
    if x.dim() != 2 or x.shape[1] != h:
        raise InvalidInputError("wrong shape", parameter="hidden_states", value=x, allowed=f"[num_tokens, {h}]")
    if x.dtype != _BF16:
        raise InvalidInputError("wrong dtype", parameter="hidden_states", value=x, allowed="torch.bfloat16")
    t = x.shape[0]
    if tuple(ids.shape) != (t, k):
        raise InvalidInputError("wrong shape", parameter="topk_ids", value=ids, allowed=f"[{t}, {k}] (num_tokens, top_k)")
    if ids.dtype not in _ID_DTYPES:
        raise InvalidInputError("wrong dtype", parameter="topk_ids", value=ids, allowed="torch.int32, torch.int64")
    if tuple(w.shape) != (t, k):
        raise InvalidInputError(
            "wrong shape", parameter="topk_weights", value=w, allowed=f"[{t}, {k}] (num_tokens, top_k)"
        )
    if w.dtype != _F32:
        raise InvalidInputError("wrong dtype", parameter="topk_weights", value=w, allowed="torch.float32")
    for name, tensor in (("hidden_states", x), ("topk_ids", ids), ("topk_weights", w)):
        if device is not None and tensor.device.type != device.type:
            raise InvalidInputError(
                "is on the wrong device for this process group", parameter=name, value=tensor, allowed=str(device)
            )
    if ids.device != x.device or w.device != x.device:
        name, tensor = ("topk_ids", ids) if ids.device != x.device else ("topk_weights", w)
        raise InvalidInputError(
            "is not on the device of hidden_states", parameter=name, value=tensor, allowed=str(x.device)
        )
    if t > spec.num_max_dispatch_tokens_per_rank:
        raise CapacityError(
            f"a batch of {t} tokens exceeds the per-rank capacity; raise --num-max-dispatch-tokens-per-rank "
            f"(DispatchSpec.num_max_dispatch_tokens_per_rank) to at least {t}",
            parameter="num_max_dispatch_tokens_per_rank",
            value=spec.num_max_dispatch_tokens_per_rank,
            allowed=f">= {t}",
        )


def check_dispatch_values(
    spec: DispatchSpec, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> None:
    """The value checks (the ``check_inputs`` switch), on inputs whose metadata passed. On an
    accelerator every flag is reduced on the device and read back with one sync; on the CPU,
    where reading a flag costs nothing, each check stops at the first failure. Only a failure
    costs more: ``_diagnose_values`` finds the first bad element.

    While a CUDA graph is being captured they do not run: reading a flag back is a host sync,
    which capture forbids, and a check at capture would see the capture's inputs, not the
    replays'. Check the inputs before copying them into the graph's static tensors."""
    if not hidden_states.is_cpu and capturing(hidden_states):
        return
    e = spec.num_experts
    ids = topk_ids
    dup = None
    if ids.is_cpu:
        lo, hi = torch.aminmax(ids)
        bad = int(lo) < -1 or int(hi) >= e
        if not bad and ids.shape[1] > 1:
            s = torch.sort(ids, dim=1).values
            dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
            bad = bool(dup.any())
        bad = bad or not bool(torch.isfinite(topk_weights).all()) or not bool(torch.isfinite(hidden_states).all())
    else:
        flags = [((ids < -1) | (ids >= e)).any()]
        if ids.shape[1] > 1:
            s = torch.sort(ids, dim=1).values
            dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
            flags.append(dup.any())
        flags.append(~torch.isfinite(topk_weights).all())
        flags.append(~torch.isfinite(hidden_states).all())
        bad = bool(torch.stack(flags).any())
    if bad:
        _diagnose_values(e, hidden_states, ids, topk_weights)


def runs_value_checks(check_inputs: bool | None, hidden_states: torch.Tensor) -> bool:
    """Whether a call with this ``check_inputs`` setting reads values: None (the default) where the
    data is host memory, not on an accelerator, where each call would sync the device; True
    everywhere but inside a CUDA-graph capture (a sync would abort it); False nowhere."""
    if check_inputs is None:
        return hidden_states.is_cpu
    return bool(check_inputs) and not capturing(hidden_states)


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _diagnose_values(e: int, hidden_states: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    out_of_range = (ids < -1) | (ids >= e)
    if bool(out_of_range.any()):
        token, slot = out_of_range.nonzero()[0].tolist()
        raise InvalidInputError(
            f"expert id out of range at token {token}, slot {slot}",
            parameter="topk_ids",
            value=int(ids[token, slot]),
            allowed=f"-1 (no expert) or 0..{e - 1}",
        )
    if ids.shape[1] > 1:
        s = torch.sort(ids, dim=1).values
        dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(dim=1)
        if bool(dup.any()):
            row = int(dup.nonzero()[0, 0])
            raise InvalidInputError(
                f"token {row} lists the same expert twice",
                parameter="topk_ids",
                value=ids[row].tolist(),
                allowed="distinct expert ids per token (-1 may repeat)",
            )
    for name, tensor, axis in (("topk_weights", topk_weights, "slot"), ("hidden_states", hidden_states, "channel")):
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            token, col = bad.nonzero()[0].tolist()
            raise InvalidInputError(
                f"non-finite value at token {token}, {axis} {col}",
                parameter=name,
                value=float(tensor[token, col]),
                allowed="finite values",
            )


def not_an_output(value: object) -> str:
    """Why ``value`` is refused where a ``DispatchOutput`` belongs (a ``Pending`` not yet waited is the usual slip)."""
    if isinstance(value, Pending):
        return "is the Pending of a started dispatch: call .wait() first for its DispatchOutput"
    return "must be the DispatchOutput this dispatcher returned"


def diagnose_combine_inputs(
    spec: DispatchSpec, owner: object, expert_output: torch.Tensor, dispatch_output: DispatchOutput
) -> None:
    """Every metadata check of a combine, one by one; returns when all pass."""
    if not isinstance(dispatch_output, DispatchOutput):
        raise InvalidInputError(
            not_an_output(dispatch_output),
            parameter="dispatch_output",
            value=dispatch_output,
            allowed="DispatchOutput",
        )
    if getattr(dispatch_output.handle, "owner", owner) is not owner:
        raise InvalidInputError(
            "comes from another dispatcher; combine each output on the dispatcher that produced it",
            parameter="dispatch_output",
            value=type(dispatch_output.handle).__name__,
            allowed="a DispatchOutput returned by this dispatcher's dispatch",
        )
    y = _tensor("expert_output", expert_output)
    rows = dispatch_output.hidden_states
    expected = (*rows.shape[:-1], spec.hidden_size)
    if tuple(y.shape) != expected:
        raise InvalidInputError(
            "wrong shape: one row per dispatched row", parameter="expert_output", value=y, allowed=f"{list(expected)}"
        )
    if y.dtype != _BF16:
        raise InvalidInputError(
            "wrong dtype (combine sends BF16)", parameter="expert_output", value=y, allowed="torch.bfloat16"
        )
    if y.device != rows.device:
        raise InvalidInputError(
            "is not on the device of the dispatch output",
            parameter="expert_output",
            value=y,
            allowed=str(rows.device),
        )





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
