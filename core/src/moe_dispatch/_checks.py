"""The checks on what dispatch and combine are given and what a backend returns: typed errors naming the parameter,
the value and what is allowed, before any data is touched or collective entered. Each check is written once, as a
``Rule`` (``Rules``: the hot path, about half a microsecond, metadata only). The value checks (``check_inputs``)
read the data, so by default only on host memory: on an accelerator they would sync every call."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from ._errors import CapacityError, InvalidInputError, MoEDispatchError, PluginError
from ._output import DispatchOutput, align_up
from ._pending import Pending
from ._spec import DispatchSpec
from ._wire import Layout, wire_dtype

_BF16, _F32 = torch.bfloat16, torch.float32


class Rule(NamedTuple):
    """One check: ``test`` (a Python expression over a call's names) is true for a good input; else
    ``error(message, parameter=..., value=eval(value), allowed=eval(f-string allowed))``. A test may bind a name with
    ``:=`` for the tests after it (a call reads each tensor attribute once)."""

    parameter: str
    test: str
    message: str
    allowed: str
    value: str
    error: type[MoEDispatchError] = InvalidInputError
    fast: bool = True  # False: implied by the other tests, so only the diagnosis runs it (for its precise error)


class Rules:
    """The rules of one call (``args``: its argument names), compiled once against ``constants``: ``all`` is every
    fast test in one expression (the hot path); ``diagnose`` finds the first rule whose chain (it and every rule
    before it) fails, so a test may use what an earlier one bound."""

    def __init__(self, args: str, rules: list[Rule], constants: dict[str, Any]) -> None:
        self.rules = rules
        self.namespace = {"torch": torch, "Tensor": torch.Tensor, **constants}
        self.args = args.split(", ")
        self.all = self._chain(args, [r for r in rules if r.fast])
        self.prefixes = [self._chain(args, rules[: i + 1]) for i in range(len(rules))]

    def _chain(self, args: str, rules: list[Rule]) -> Callable[..., bool]:
        return eval(f"lambda {args}: " + " and ".join(f"({r.test})" for r in rules), self.namespace)

    def diagnose(self, *values: Any) -> None:
        """Raise the first failing rule's error (a test that raises fails)."""
        for rule, chain in zip(self.rules, self.prefixes):
            try:
                if chain(*values):
                    continue
            except Exception:  # noqa: BLE001
                pass
            names = {**self.namespace, **dict(zip(self.args, values))}
            message = eval(f"f{rule.message!r}", names)
            raise rule.error(message, parameter=rule.parameter, value=eval(rule.value, names),
                             allowed=eval(f"f{rule.allowed!r}", names) or None)


_ARGS = {"x": "hidden_states", "ids": "topk_ids", "w": "topk_weights"}


def _dispatch_rules(device: torch.device | None) -> list[Rule]:
    # The tensor checks are implied by the dtype identities (only a tensor has a torch dtype): diagnosis only.
    is_tensor = [Rule(p, f"isinstance({n}, Tensor)", f"must be a torch.Tensor, not {{type({n}).__name__}}",
                      "torch.Tensor", n, fast=False) for n, p in _ARGS.items()]
    # ids and w: implied by x's and the same-device rules below. is_cpu/is_cuda: device.type costs 270 ns.
    kind = {"cpu": "{}.is_cpu", "cuda": "{}.is_cuda"}.get(device.type, "{}.device.type == DEVICE") if device else ""
    cpu = device is not None and device.type == "cpu"  # there, each on the CPU is one device: 40 ns a tensor, not 100
    on_device = [] if device is None else [
        Rule(p, kind.format(n), "is on the wrong device for this process group", "{DEVICE}", n, fast=n == "x" or cpu)
        for n, p in _ARGS.items()]
    return [
        *is_tensor,
        Rule("hidden_states", "len(s := x.shape) == 2 and s[1] == H", "wrong shape", "[num_tokens, {H}]", "x"),
        Rule("hidden_states", "x.dtype is BF16", "wrong dtype", "torch.bfloat16", "x"),
        Rule("topk_ids", "ids.shape == (s[0], K)", "wrong shape", "[{x.shape[0]}, {K}] (num_tokens, top_k)", "ids"),
        Rule("topk_ids", "(d := ids.dtype) is I64 or d is I32", "wrong dtype", "torch.int32, torch.int64", "ids"),
        Rule("topk_weights", "w.shape == (s[0], K)", "wrong shape", "[{x.shape[0]}, {K}] (num_tokens, top_k)", "w"),
        Rule("topk_weights", "w.dtype is F32", "wrong dtype", "torch.float32", "w"),
        *on_device,
        Rule("topk_ids", "ids.device == (dev := x.device)", "is not on the device of hidden_states", "{x.device}",
             "ids", fast=not cpu),
        Rule("topk_weights", "w.device == dev", "is not on the device of hidden_states", "{x.device}", "w",
             fast=not cpu),
        Rule("num_max_dispatch_tokens_per_rank", "s[0] <= CAPACITY",
             "a batch of {x.shape[0]} tokens exceeds the per-rank capacity; raise --num-max-dispatch-tokens-per-rank "
             "(DispatchSpec.num_max_dispatch_tokens_per_rank) to at least {x.shape[0]}", ">= {x.shape[0]}",
             "CAPACITY", CapacityError),
    ]


def _combine_rules(rows_are_hidden: bool, device: torch.device | None) -> list[Rule]:
    cpu = device is not None and device.type == "cpu"  # a CPU group's rows are on the CPU: is_cpu, as for dispatch
    # Rows [..., H] for every dtype but packed ones (NVFP4: [..., H/2]): then one shape comparison.
    shape = ("y.shape == (rows := out.hidden_states).shape" if rows_are_hidden else
             "(ys := y.shape)[-1] == H and ys[:-1] == (rows := out.hidden_states).shape[:-1]")
    return [
        Rule("dispatch_output", "type(out) is DispatchOutput", "{not_an_output(out)}", "DispatchOutput", "out"),
        Rule("dispatch_output", "getattr(out.handle, 'owner', OWNER) is OWNER",
             "comes from another dispatcher; combine each output on the dispatcher that produced it",
             "a DispatchOutput returned by this dispatcher's dispatch", "type(out.handle).__name__"),
        Rule("expert_output", "isinstance(y, Tensor)", "must be a torch.Tensor, not {type(y).__name__}",
             "torch.Tensor", "y", fast=False),
        Rule("expert_output", shape, "wrong shape: one row per dispatched row",
             "{[*out.hidden_states.shape[:-1], H]}", "y"),
        Rule("expert_output", "y.dtype is BF16", "wrong dtype (combine sends BF16)", "torch.bfloat16", "y"),
        Rule("expert_output", "y.is_cpu" if cpu else "y.device == rows.device",
             "is not on the device of the dispatch output", "{out.hidden_states.device}", "y"),
        Rule("dispatch_output", "not out.combined", "dispatch #{out.call} was already combined (or its combine "
             "started); its buffers may now hold a later dispatch's rows (an output is valid until its combine)",
             "an output not yet combined", "f'dispatch #{out.call}'"),
    ]


def not_an_output(value: object) -> str:
    """Why ``value`` is refused where a ``DispatchOutput`` belongs (a ``Pending`` not yet waited is the usual slip)."""
    if isinstance(value, Pending):
        return "is the Pending of a started dispatch: call .wait() first for its DispatchOutput"
    return "must be the DispatchOutput this dispatcher returned"


class InputChecks:
    """The input checks of one dispatcher. ``device``: the process group's device type (None: any); ``owner``: the
    backend dispatcher whose outputs combine takes (``handle.owner``)."""

    def __init__(self, spec: DispatchSpec, device: torch.device | None, owner: object) -> None:
        self.spec = spec
        constants = {"H": spec.hidden_size, "K": spec.top_k, "CAPACITY": spec.num_max_dispatch_tokens_per_rank,
                     "BF16": _BF16, "F32": _F32, "I32": torch.int32, "I64": torch.int64,
                     "DEVICE": None if device is None else device.type, "OWNER": owner,
                     "DispatchOutput": DispatchOutput, "not_an_output": not_an_output}
        self._dispatch = Rules("x, ids, w", _dispatch_rules(device), constants)
        rows_are_hidden = (spec.output_dtype is not None
                           and wire_dtype(spec.output_dtype).row_columns(spec.hidden_size) == spec.hidden_size)
        self._combine = Rules("y, out", _combine_rules(rows_are_hidden, device), constants)
        self._dispatch_ok, self._combine_ok = self._dispatch.all, self._combine.all

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 check_values: bool | None = True) -> bool:
        """Raise a typed error for a bad dispatch input; with ``check_values`` (None: on host memory) the value checks
        too. Returns whether they ran: the output checks read the counts under the same rule."""
        try:  # inlined, not a Rules method: this is most of the core's per-call cost
            ok = self._dispatch_ok(hidden_states, topk_ids, topk_weights)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            self._dispatch.diagnose(hidden_states, topk_ids, topk_weights)
        # runs_value_checks, inlined (a call level costs what two checks do)
        values = hidden_states.is_cpu if check_values is None else check_values and not capturing(hidden_states)
        if values and hidden_states.shape[0]:
            check_dispatch_values(self.spec, hidden_states, topk_ids, topk_weights)
        return values

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> None:
        """Raise a typed error for a bad combine input (metadata only)."""
        try:
            ok = self._combine_ok(expert_output, dispatch_output)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            self._combine.diagnose(expert_output, dispatch_output)


def runs_value_checks(check_inputs: bool | None, hidden_states: torch.Tensor) -> bool:
    """Whether a call reads values: None (the default) where the data is host memory; True everywhere but inside a
    CUDA-graph capture (a sync would abort it, and replays bring new values); False nowhere."""
    if check_inputs is None:
        return hidden_states.is_cpu
    return bool(check_inputs) and not capturing(hidden_states)


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device stream is being captured into a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _duplicates(ids: torch.Tensor) -> torch.Tensor:
    s = torch.sort(ids, dim=1).values
    return (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)


def check_dispatch_values(spec: DispatchSpec, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor) -> None:
    """The value checks on inputs whose metadata passed: every flag reduced to one boolean (one device sync on an
    accelerator); only a failure looks for the first bad element. None during a CUDA-graph capture."""
    if not hidden_states.is_cpu and capturing(hidden_states):
        return
    e, ids = spec.num_experts, topk_ids
    flags = [((ids < -1) | (ids >= e)).any(), ~torch.isfinite(topk_weights).all(), ~torch.isfinite(hidden_states).all()]
    if ids.shape[1] > 1:
        flags.append(_duplicates(ids).any())
    if bool(torch.stack(flags).any()):
        _diagnose_values(e, hidden_states, ids, topk_weights)


def _diagnose_values(e: int, hidden_states: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    out_of_range = (ids < -1) | (ids >= e)
    if bool(out_of_range.any()):
        token, slot = out_of_range.nonzero()[0].tolist()
        raise InvalidInputError(f"expert id out of range at token {token}, slot {slot}", parameter="topk_ids",
                                value=int(ids[token, slot]), allowed=f"-1 (no expert) or 0..{e - 1}")
    if ids.shape[1] > 1 and bool((dup := _duplicates(ids).any(dim=1)).any()):
        row = int(dup.nonzero()[0, 0])
        raise InvalidInputError(f"token {row} lists the same expert twice", parameter="topk_ids",
                                value=ids[row].tolist(), allowed="distinct expert ids per token (-1 may repeat)")
    for name, tensor, axis in (("topk_weights", topk_weights, "slot"), ("hidden_states", hidden_states, "channel")):
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            token, col = bad.nonzero()[0].tolist()
            raise InvalidInputError(f"non-finite value at token {token}, {axis} {col}", parameter=name,
                                    value=float(tensor[token, col]), allowed="finite values")


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={list(value.shape)}, dtype={value.dtype})"
    return type(value).__name__ if value is not None else "None"


def _broken(parameter: str, test: str, what: str, allowed: str, value: str) -> Rule:
    return Rule(parameter, test, "backend {BACKEND!r} broke the contract: " + what, allowed, value, PluginError)


_OUTPUT_RULES = [
    _broken("dispatch()", "type(out) is DispatchOutput", "its result", "a moe_dispatch.DispatchOutput",
            "type(out).__name__"),
    _broken("hidden_states", "(h := out.hidden_states).dtype is ELEMENT and (hs := h.shape)[-1] == COLUMNS",
            "dispatch() returned these rows", "a {ELEMENT} tensor [..., {COLUMNS}]", "described(out.hidden_states)"),
    _broken("layout", "(lay := out.layout) is LAYOUT", "dispatch() returned {out.layout} rows in {MODE} mode, where "
            "the spec and its capabilities ask for {LAYOUT} (DispatchSpec.layout, Capabilities.masked_modes)",
            "{LAYOUT}", "out.layout"),
    _broken("layout", "len(hs) == (3 if lay is MASKED else 2)",
            "dispatch() returned {out.layout!r} rows",
            "MASKED [local experts, capacity, cols], otherwise [rows, cols]", "described(out.hidden_states)"),
    _broken("row_topk_ids", "lay is not TOKEN_MAJOR or (out.row_topk_ids.shape == (hs[0], "
            "K) == out.row_topk_weights.shape and out.row_topk_ids.dtype is I64 and out.row_topk_weights.dtype is F32)",
            "dispatch() returned TOKEN_MAJOR rows with this routing", "int64 ids and fp32 weights [rows, {K}]",
            "(described(out.row_topk_ids), described(out.row_topk_weights))"),
    _broken("group_list", "(g := out.group_list).shape == GROUPS and g.dtype in INTEGERS "
            "and out.group_list_type in (0, 1)", "dispatch() returned this group_list",
            "an int32 or int64 tensor [{GROUPS[0]}] (one entry per local expert), type 0 or 1",
            "described(out.group_list)"),
    _broken("hidden_states", "lay is not MASKED or hs[0] == GROUPS[0]",
            "dispatch() returned these MASKED rows", "[{GROUPS[0]}, capacity, {COLUMNS}]",
            "described(out.hidden_states)"),
    _broken("expert_alignment", "lay is MASKED or out.expert_alignment == ALIGNMENT",
            "dispatch() returned PACKED rows at another alignment",
            "{ALIGNMENT} (what this dispatcher asks of the backend)", "out.expert_alignment"),
]


class OutputChecks:
    """The checks on one dispatcher's backend outputs, so a plugin's bug is a ``PluginError`` naming the backend at
    the call that produced it. ``alignment``: of the backend's PACKED rows; ``worst_case``: its low-latency PACKED
    rows may run past the segments (``Capabilities.worst_case_rows``); ``masked``: it declares MASKED rows
    (``masked_modes``). With the value checks, the counts are checked to fit the rows (one device sync)."""

    def __init__(self, backend: str, spec: DispatchSpec, world_size: int, alignment: int = 1, *,
                 worst_case: bool = False, masked: bool = False) -> None:
        self.backend, self.hidden, self.worst_case = backend, spec.hidden_size, worst_case
        dtype = wire_dtype(spec.output_dtype)  # type: ignore[arg-type]  # resolved by now
        self._rules = Rules("out", _OUTPUT_RULES, {
            "BACKEND": backend, "ELEMENT": dtype.element, "COLUMNS": dtype.row_columns(spec.hidden_size),
            "GROUPS": (spec.num_experts // world_size,), "ALIGNMENT": alignment, "PACKED": Layout.PACKED,
            "MASKED": Layout.MASKED, "TOKEN_MAJOR": Layout.TOKEN_MAJOR, "K": spec.top_k, "I64": torch.int64,
            "INTEGERS": frozenset({torch.int32, torch.int64}),
            "F32": _F32, "LAYOUT": spec.layout or (Layout.MASKED if masked else Layout.PACKED), "MODE": spec.mode.value,
            "DispatchOutput": DispatchOutput, "described": _described})
        self._ok = self._rules.all

    def dispatch(self, out: object, check_values: bool) -> DispatchOutput:
        try:
            ok = self._ok(out)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            self._rules.diagnose(out)
        if check_values:
            self._check_counts(out)  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    def _check_counts(self, out: DispatchOutput) -> None:
        counts = out.expert_counts()
        masked = out.layout is Layout.MASKED
        per_expert = out.hidden_states.shape[1 if masked else 0]
        lo = int(counts.min()) if counts.numel() else 0
        if masked:
            bad = counts.numel() > 0 and (lo < 0 or int(counts.max()) > per_expert)
            limit = f"0..{per_expert} rows per expert (the MASKED capacity)"
        elif out.layout is Layout.TOKEN_MAJOR:
            pairs = int((out.row_topk_ids >= 0).sum())  # type: ignore[operator]
            bad, limit = lo < 0 or int(counts.sum()) != pairs, f"counts >= 0 adding up to the {pairs} local ids"
        elif out.expert_alignment > 1 or self.worst_case:
            bad = lo < 0 or int(align_up(counts, out.expert_alignment).sum()) > per_expert
            limit = (f"counts >= 0 whose segments, aligned to {out.expert_alignment} rows, fit the {per_expert} rows"
                     if out.expert_alignment > 1 else
                     f"counts >= 0 adding up to at most the {per_expert} rows returned (the backend's worst case)")
        else:
            bad = lo < 0 or int(counts.sum()) != per_expert
            limit = f"counts >= 0 adding up to the {per_expert} rows returned"
        if bad:
            raise PluginError(f"backend {self.backend!r} broke the contract: dispatch() returned counts that do not "
                              "fit its rows", parameter="group_list", value=counts.tolist(), allowed=limit)

    def combine(self, result: object, dispatch_output: DispatchOutput) -> torch.Tensor:
        tokens = dispatch_output.topk_ids.shape[0]
        if not (isinstance(result, torch.Tensor) and result.dtype is _BF16 and result.shape == (tokens, self.hidden)):
            raise PluginError(f"backend {self.backend!r} broke the contract: its result", parameter="combine()",
                              value=_described(result), allowed=f"a bfloat16 tensor [{tokens}, {self.hidden}]")
        return result
