"""``BackendConformance``: the suite every backend passes, built-in, first-party or third-party.

A plugin's test module subclasses it and names its backend::

    from moe_dispatch_testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend_name = "my-backend"

The backend's declared ``Capabilities`` decide which tests apply: a test that does not apply
is skipped with the capability named. Tests that move data run on local gloo ranks (world
sizes 1, 2 and 4) from the ``moe_rank_pools`` fixture. Every test's docstring has a
**Troubleshooting** section: what a failure usually means and how to fix it.

Opting out of a standard test is explicit: override it and mark it
``@pytest.mark.xfail(reason="...")``; ``test_no_overrides_DO_NOT_OVERRIDE`` fails otherwise.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import cached_property
from typing import Any, Callable, ClassVar

import pytest

from moe_dispatch import (
    CapacityError,
    DispatchDtype,
    DispatchSpec,
    DtypeFallbackWarning,
    ExpertWeights,
    InvalidSpecError,
    Layout,
    Mode,
    PluginHost,
    QuantHints,
    UnsupportedDtypeError,
)
from moe_dispatch.backend import Backend, Capabilities, RunnerInfo, nvfp4_global_scale
from moe_dispatch.planning import resolve_output_dtype
from moe_dispatch_testing.accuracy import TOLERANCES

from . import ranks
from .cases import Case, KitShape, Routing, Target, standard_routings

WORLD_SIZES = (1, 2, 4)
#: The ``expert_alignment`` the kit asks for: larger than most experts' row counts at its shape, so padding shows.
ALIGNMENT = 8
_MODES = [m.value for m in Mode]
_DTYPES = [d.value for d in DispatchDtype]


def _run_on_ranks(pools: Any, world_size: int, check: Callable[..., list[str]], *args: Any) -> None:
    """Run a ``ranks.check_*`` on every rank; fail with every rank's problems."""
    _fail([p for per_rank in pools.get(world_size).map(check, *args) for p in per_rank])


def _fail(problems: list[str]) -> None:
    if problems:
        pytest.fail("\n".join(problems[:20]) + (f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""))


class BackendConformance:
    """Subclass, set ``backend_name``, and the standard suite runs against that backend.

    Optional settings (class attributes):

    - ``backend_factory``: a zero-argument callable returning the ``Backend`` to test instead
      of the registered one (for example the backend on a vendor emulator). The instance is
      pickled to the local ranks, so its class must be importable.
    - ``backend_options``: passed to ``create_dispatcher(options=...)``.
    - ``kit_shape``: the layer shape (``KitShape``); moved inside the declared limits per mode.
    - ``world_sizes``: the local world sizes to run (default 1, 2, 4).
    - ``buffer_size_ratio``: how many times the worst-case bytes a rank sends and receives
      ``buffer_size`` may ask for (None: the vendor fixes the size; the check is skipped).
    - ``kit_weights``: an importable function applied to the kit's random dense weights before
      the whole-layer check (e.g. ``moe_dispatch.experts.quantize_weights_w8a8`` for a fused op
      that takes only W8A8); the reference uses the same weights. A ``fused_forward`` backend
      gets them through its ``process_weights``.
    """

    backend_name: ClassVar[str] = ""
    backend_factory: ClassVar[Callable[[], Backend] | None] = None
    backend_options: ClassVar[dict[str, Any]] = {}
    kit_shape: ClassVar[KitShape] = KitShape()
    world_sizes: ClassVar[tuple[int, ...]] = WORLD_SIZES
    buffer_size_ratio: ClassVar[float | None] = 4.0
    kit_weights: ClassVar[Callable[[ExpertWeights], ExpertWeights] | None] = None

    # -- plumbing -------------------------------------------------------------------------------

    @cached_property
    def backend(self) -> Backend:
        if type(self).backend_factory is not None:
            return type(self).backend_factory()  # type: ignore[misc]
        if not self.backend_name:
            pytest.fail(f"{type(self).__name__} must set backend_name (or backend_factory)")
        return PluginHost().get_backend(self.backend_name)

    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities

    @property
    def target(self) -> Target:
        backend: str | Backend = self.backend if type(self).backend_factory is not None else self.backend_name
        return Target(backend, tuple(sorted(self.backend_options.items())), type(self).kit_weights)

    def _require_runnable(self) -> None:
        reason = self.backend.probe()
        if reason is not None:
            pytest.skip(f"backend {self.backend.name!r} cannot run here (probe): {reason}")

    def _require_mode(self, mode: Mode) -> None:
        if mode not in self.capabilities.dtypes:
            pytest.skip(f"capabilities.dtypes declares no {mode.value} mode")

    def _require_world(self, world_size: int, mode: Mode | None = None) -> None:
        if world_size not in self.world_sizes:
            pytest.skip(f"world size {world_size} is not in {type(self).__name__}.world_sizes")
        allowed = self.capabilities.world_sizes
        if allowed is not None and world_size not in allowed:
            pytest.skip(f"capabilities.world_sizes does not include {world_size}")
        per_mode = None if mode is None else self.capabilities.limits_for(mode).world_sizes
        if per_mode is not None and world_size not in per_mode:
            pytest.skip(f"capabilities.limits[{mode.value}].world_sizes does not include {world_size}")  # type: ignore[union-attr]

    def _runs_on(self, mode: Mode, world_size: int) -> bool:
        sizes = self.capabilities.world_sizes_for(mode)
        return sizes is None or world_size in sizes

    def _world_for(self, mode: Mode, prefer: int = 2) -> int:
        """A local world size the mode runs on: ``prefer`` when allowed, else the smallest."""
        sizes = [w for w in self.world_sizes if self._runs_on(mode, w)]
        if not sizes:
            pytest.skip(f"none of {type(self).__name__}.world_sizes {self.world_sizes} runs {mode.value} mode")
        return prefer if prefer in sizes else min(sizes)

    def _require_dtype(self, mode: Mode, dtype: DispatchDtype) -> None:
        self._require_mode(mode)
        if dtype not in self.capabilities.dtypes[mode]:
            pytest.skip(f"capabilities.dtypes[{mode.value}] does not accept {dtype.value} as it is")

    def _shape(self, mode: Mode) -> KitShape:
        return self.kit_shape.for_mode(self.capabilities, mode)

    def _case(self, world_size: int, mode: Mode, dtype: DispatchDtype, routing: Routing | None = None,
              seed: int = 0, group_list_type: int = 1, expert_alignment: int = 1) -> Case:
        shape = self._shape(mode)
        routing = routing or standard_routings(world_size, shape.tokens_per_rank)[0]
        return Case(self.target, mode, dtype, shape, routing, seed, group_list_type, expert_alignment)

    def _accepted(self, mode: Mode) -> list[DispatchDtype]:
        return sorted(self.capabilities.dtypes.get(mode, ()), key=lambda d: list(DispatchDtype).index(d))

    def _spec(self, mode: Mode, dtype: DispatchDtype | str = "auto", **overrides: Any) -> DispatchSpec:
        """A spec of the kit's shape on two ranks; NVFP4 gets a global scale."""
        shape = self._shape(mode)
        nvfp4 = dtype in ("nvfp4", DispatchDtype.NVFP4)
        fields: dict[str, Any] = {
            "hidden_size": shape.hidden_size,
            "num_experts": shape.local_experts * 2,
            "top_k": shape.top_k,
            "num_max_dispatch_tokens_per_rank": shape.tokens_per_rank,
            "mode": mode,
            "output_dtype": dtype,
            "quant": QuantHints(input_global_scale=nvfp4_global_scale(4.0)) if nvfp4 else QuantHints(),
        }
        fields.update(overrides)
        return DispatchSpec(**fields)

    # -- discovery and declarations --------------------------------------------------------------

    def test_backend_is_discoverable(self) -> None:
        """The backend is registered under ``backend_name`` when a plugin host loads the
        installed entry points, and nothing failed to load along the way.

        Troubleshooting: check that the distribution is installed (``pip install -e .``)
        and that its ``pyproject.toml`` declares
        ``[project.entry-points."moe_dispatch.backends"] <name> = "<module>"``, that the module
        sets ``MOE_DISPATCH_API`` and implements ``moe_dispatch_register_backends``, and that
        it calls ``register(<Backend instance>)``. ``moe-dispatch backends`` and
        ``MOE_DISPATCH_TRACE_PLUGINS=1`` show what the host saw.
        """
        host = PluginHost()
        name = self.backend.name
        assert name in host.backend_names(), (
            f"no plugin registers {name!r}; registered: {host.backend_names()}; "
            f"failed plugins: {[(p.label(), p.error) for p in host.failures()]}")
        host.get_backend(name)  # raises for a conflict between two distributions
        assert not [p for p in host.failures() if name in p.name], [p.error for p in host.failures()]

    def test_capabilities_are_consistent(self) -> None:
        """The declared capabilities describe a backend that can be used: at least one mode,
        every fallback lands on a dtype that mode accepts, the default is usable, combine
        is BF16, and an unavailable backend says what to install.

        Troubleshooting: fix the ``Capabilities(...)`` the backend declares. A fallback
        ``(mode, dtype) → to`` needs ``to`` in ``dtypes[mode]``; a rejected dtype needs no
        entry (or a reason in ``rejections``); ``install_hint`` tells users what to install
        when ``probe()`` returns a reason.
        """
        caps = self.capabilities
        assert isinstance(caps, Capabilities)
        assert self.backend.name, "Backend.name is empty"
        assert caps.modes, "capabilities.dtypes declares no mode"
        for mode in caps.modes:
            assert caps.dtypes[mode], f"capabilities.dtypes[{mode.value}] is empty"
        for (mode, dtype), fallback in caps.fallbacks.items():
            assert mode in caps.dtypes, f"fallback declared for undeclared mode {mode.value}"
            assert dtype not in caps.dtypes[mode], f"{dtype.value} is both accepted and a fallback in {mode.value}"
            assert fallback.to in caps.dtypes[mode], (
                f"fallback {dtype.value} → {fallback.to.value} in {mode.value}, which that mode does not accept")
            assert fallback.reason, f"fallback {dtype.value} → {fallback.to.value} gives no reason"
        if caps.default_dtype is not None:
            assert any(caps.decide(m, caps.default_dtype).kind != "reject" for m in caps.modes), (
                f"default dtype {caps.default_dtype.value} is rejected in every mode")
        assert caps.combine_dtype is DispatchDtype.BF16, "combine sends BF16 by contract"
        assert caps.cuda_graph_modes <= set(caps.modes), "cuda_graph_modes names an undeclared mode"
        assert caps.split_phase <= set(caps.modes), "split_phase names an undeclared mode"
        assert caps.worst_case_rows <= {Mode.LOW_LATENCY} & set(caps.modes), (
            "worst_case_rows names a mode other than a declared low_latency (normal mode's rows are exact)")
        assert caps.worst_case_rows <= caps.expert_alignment, (
            "worst_case_rows needs the mode in expert_alignment: the core's aligned copy reads exact rows")
        assert caps.token_major_modes <= {Mode.NORMAL} & set(caps.modes) - caps.masked_modes, (
            "token_major_modes names a mode other than a declared normal mode with PACKED rows")
        if self.backend.probe() is not None:
            assert self.backend.install_hint, "probe() says the backend cannot run here, but install_hint is empty"

    @pytest.mark.parametrize("dtype", _DTYPES)
    @pytest.mark.parametrize("mode", _MODES)
    def test_dtype_validation_table(self, mode: str, dtype: str) -> None:
        """Every (mode, dtype) is accepted, replaced by a recorded fallback, or rejected,
        exactly as the capabilities declare, and resolution reports it the same way:
        accepted → that dtype; fallback → the declared dtype, a ``DtypeFallbackWarning``,
        the reason in the trail, and ``UnsupportedDtypeError`` under ``strict=True``;
        rejected → ``UnsupportedDtypeError`` naming ``output_dtype``.

        Troubleshooting: a backend that overrides ``validate_dtype`` must agree with its
        ``Capabilities`` (``moe-dispatch backends`` and the kit read the table); put
        hardware limits in ``dtypes``/``fallbacks``/``rejections`` rather than in code.
        """
        m, d = Mode.parse(mode), DispatchDtype.parse(dtype)
        assert d is not None
        caps = self.capabilities
        if m not in caps.dtypes:
            with pytest.raises(InvalidSpecError) as info:
                self.backend.check_spec(self._spec(m, d), 2)
            assert info.value.parameter == "mode"
            return
        declared = caps.decide(m, d)
        spec = self._spec(m, d)
        decision = self.backend.validate_dtype(d, spec)
        assert (decision.kind, decision.dtype) == (declared.kind, declared.dtype), (
            f"validate_dtype says {decision.kind} {decision.dtype.value}; capabilities declare "
            f"{declared.kind} {declared.dtype.value}")
        if declared.kind == "reject":
            with pytest.raises(UnsupportedDtypeError) as info:
                resolve_output_dtype(spec, self.backend, env={})
            assert info.value.parameter == "output_dtype"
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resolution = resolve_output_dtype(spec, self.backend, env={})
        fell_back = [w for w in caught if issubclass(w.category, DtypeFallbackWarning)]
        assert resolution.dtype is declared.dtype
        if declared.kind == "accept":
            assert not fell_back and not resolution.is_fallback
            return
        assert fell_back, "a fallback must warn (DtypeFallbackWarning)"
        assert resolution.fallback_reason and declared.reason in resolution.steps[-1].note
        with pytest.raises(UnsupportedDtypeError) as info:
            resolve_output_dtype(spec, self.backend, env={}, strict=True)
        assert info.value.parameter == "output_dtype"

    @pytest.mark.parametrize("mode", _MODES)
    def test_resolution_trail(self, mode: str) -> None:
        """With nothing chosen, resolution consults every source in the documented order and
        records each, ending with the backend's validation; an explicit dtype, the
        ``MOE_DISPATCH_OUTPUT_DTYPE`` in the env it is given, and a BF16-only runner each
        decide when present; ``os.environ`` is never read when an env is given.

        Troubleshooting: do not override ``default_dtype`` to read the environment or global
        state; the default must come from ``capabilities.default_dtype`` or the spec.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        accepted = self._accepted(m)
        auto = resolve_output_dtype(self._spec(m, quant=QuantHints()), self.backend, env={})
        sources = [s.source for s in auto.steps]
        order = ["explicit", "env MOE_DISPATCH_OUTPUT_DTYPE", "env SGLANG_DEEPEP_BF16_DISPATCH", "quant", "runner",
                 "backend default"]
        positions = [next(i for i, s in enumerate(sources) if s.startswith(o)) for o in order]
        assert positions == sorted(positions), f"resolution consulted sources out of order: {sources}"
        assert sources[-1] == f"validate:{self.backend.name}" and auto.steps[-1].decided
        assert sum(s.decided for s in auto.steps) == 2, "one source decides, then the backend validates"
        for dtype in accepted:
            quant = QuantHints(input_global_scale=nvfp4_global_scale(4.0)) if dtype is DispatchDtype.NVFP4 else QuantHints()
            via_env = resolve_output_dtype(self._spec(m, quant=quant), self.backend,
                                           env={"MOE_DISPATCH_OUTPUT_DTYPE": dtype.value})
            assert via_env.dtype is dtype and any(s.source.startswith("env MOE") and s.decided for s in via_env.steps)
            explicit = resolve_output_dtype(self._spec(m, dtype), self.backend, env={"MOE_DISPATCH_OUTPUT_DTYPE": "bf16"})
            assert explicit.dtype is dtype and explicit.steps[0].decided
        if self.capabilities.decide(m, DispatchDtype.BF16).kind == "accept":  # a runner asking for BF16 decides
            kit_runner = RunnerInfo("kit_bf16", DispatchDtype.BF16, "a kernel that quantizes its input itself")
            runner = resolve_output_dtype(self._spec(m, quant=QuantHints(), runner="kit_bf16"), self.backend, env={},
                                          runners={"kit_bf16": kit_runner})
            assert any(s.source == "runner kit_bf16" and s.decided for s in runner.steps)
        assert str(auto).count("\n") == len(auto.steps)

    # -- buffers ---------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", _DTYPES)
    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_buffer_size_covers_the_traffic(self, moe_rank_pools: Any, world_size: int, mode: str, dtype: str) -> None:
        """``buffer_size`` holds what dispatch and combine move at the worst routing, and
        is not larger than ``buffer_size_ratio`` times that. The worst case: a rank receives
        T tokens from every rank (T·R wire rows) while sending each of its T tokens to
        min(k, R) ranks; combine moves the same rows back as BF16. When the backend moves
        data through the core's ``Comm``, the bytes it counted at the worst routings must
        fit too.

        Troubleshooting: size dispatch with the *wire* dtype's ``WireFormat.bytes_per_token``
        and combine with BF16 (2·H), separately: combine is BF16 even when dispatch is FP8.
        A buffer sized for BF16 dispatch when FP8 is sent, or per (token, expert) instead of
        per (token, rank), trips the upper bound.
        """
        m, d = Mode.parse(mode), DispatchDtype.parse(dtype)
        assert d is not None
        self._require_world(world_size, m)
        self._require_dtype(m, d)
        shape = self._shape(m)
        spec = self._spec(m, d, num_experts=shape.local_experts * world_size)
        size = self.backend.buffer_size(spec, world_size)
        T, R, k, H = shape.tokens_per_rank, world_size, shape.top_k, shape.hidden_size
        rows = T * min(k, R) + T * R
        need_dispatch, need_combine = rows * spec.wire_format().bytes_per_token, rows * 2 * H
        assert size.dispatch_bytes >= T * R * spec.wire_format().bytes_per_token, (
            f"dispatch buffer {size.dispatch_bytes:,} B cannot hold the {T * R} tokens a rank may receive")
        assert size.combine_bytes >= T * R * 2 * H, (
            f"combine buffer {size.combine_bytes:,} B cannot hold {T * R} BF16 rows")
        if self.buffer_size_ratio is not None:
            ratio = self.buffer_size_ratio
            assert size.dispatch_bytes <= ratio * need_dispatch, (
                f"dispatch buffer {size.dispatch_bytes:,} B is over {ratio}× the worst case {need_dispatch:,} B")
            assert size.combine_bytes <= ratio * need_combine, (
                f"combine buffer {size.combine_bytes:,} B is over {ratio}× the worst case {need_combine:,} B")
        self._require_runnable()
        worst = [self._case(world_size, m, d, r) for r in standard_routings(world_size, T)[:3]]
        for per_rank in moe_rank_pools.get(world_size).map(ranks.measure_traffic, worst):
            for case, moved in zip(worst, per_rank):
                for part in ("dispatch", "combine"):
                    assert moved[part] <= getattr(size, f"{part}_bytes"), (
                        f"[{case.label()}] one {part} sent {moved[part]:,} bytes through the core's Comm (payload and "
                        f"routing metadata, counts exchange included), more than buffer_size().{part}_bytes = "
                        f"{getattr(size, f'{part}_bytes'):,}")

    @pytest.mark.parametrize("mode", _MODES)
    def test_buffer_size_follows_the_wire_dtype(self, mode: str) -> None:
        """A smaller wire format never needs a larger dispatch buffer, and the combine
        buffer does not depend on the dispatch dtype (combine is BF16).

        Troubleshooting: compute dispatch bytes from ``spec.wire_format()`` (the resolved
        dtype), not from a fixed bytes-per-element; compute combine bytes from 2·H.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        sizes = {d: self.backend.buffer_size(self._spec(m, d), 2) for d in self._accepted(m)}
        wire = {d: self._spec(m, d).wire_format().bytes_per_token for d in sizes}
        for a in sizes:
            for b in sizes:
                if wire[a] < wire[b]:
                    assert sizes[a].dispatch_bytes <= sizes[b].dispatch_bytes, (a, b, sizes)
        assert len({s.combine_bytes for s in sizes.values()}) == 1, sizes

    # -- dispatch and combine ----------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", _DTYPES)
    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_dispatch_combine_conserves_tokens(self, moe_rank_pools: Any, world_size: int, mode: str, dtype: str) -> None:
        """On random routings (uniform at capacity; -1 ids with a rank that has no tokens;
        every token on rank 0's experts; every id -1), each (token, expert) pair reaches its
        expert exactly once with the token's data, the ``DispatchOutput`` follows the
        contract (dtype, layout, scale shapes, group list of the requested type), and
        combine returns each token's weighted sum, tokens without experts as zeros, inputs
        untouched. Both group-list types are used.

        Troubleshooting: "counts" problems mean tokens are lost, duplicated or sent to the
        wrong rank (check the expert → rank map: rank = expert // local_experts). "rows
        that are not the tokens" means rows are grouped under the wrong expert. A combine
        error of about one weight means a copy is dropped or weighted twice (apply the
        top-k weights exactly once, at combine). Shape problems: PACKED is [rows, H],
        MASKED is [E_local, capacity·world, H].
        """
        m, d = Mode.parse(mode), DispatchDtype.parse(dtype)
        assert d is not None
        self._require_world(world_size, m)
        self._require_dtype(m, d)
        self._require_runnable()
        T = self._shape(m).tokens_per_rank
        cases = [self._case(world_size, m, d, r, seed=i, group_list_type=i % 2)
                 for i, r in enumerate(standard_routings(world_size, T))]
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_conservation, cases)

    @pytest.mark.parametrize("dtype", _DTYPES)
    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_forward_matches_dense_reference(self, moe_rank_pools: Any, world_size: int, mode: str, dtype: str) -> None:
        """A whole MoE layer (torch reference experts, SwiGLU, random weights; -1 ids and an
        empty rank in the routing) comes within the tolerance stated for the dtype of the
        dense fp32 single-process reference
        (``moe_dispatch_testing.accuracy.TOLERANCES``: bf16 1%, fp8 6%, int8 3%, nvfp4 20%,
        relative L2).

        Troubleshooting: when conservation passes but this fails, the scales are wrong: FP8
        needs one fp32 scale per 128 channels (amax/448), INT8 one per token (amax/127),
        NVFP4 e4m3 block scales per 16 and the spec's global scale. Check
        ``hidden_states_scale`` is in the layout ``DispatchOutput`` documents.
        """
        m, d = Mode.parse(mode), DispatchDtype.parse(dtype)
        assert d is not None
        self._require_world(world_size, m)
        self._require_dtype(m, d)
        self._require_runnable()
        # -1 ids (a token may have none) and an empty rank: what a fused op is given too.
        case = self._case(world_size, m, d, standard_routings(world_size, self._shape(m).tokens_per_rank)[1], seed=3)
        errors = moe_rank_pools.get(world_size).map(ranks.check_forward, case)
        assert max(errors) <= TOLERANCES[d], f"relative error per rank {errors}, allowed {TOLERANCES[d]}"

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_expert_aligned_rows(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """With ``DispatchSpec(expert_alignment=8)``, PACKED outputs put each local expert's rows at
        a multiple of 8 rows (``DispatchOutput.expert_alignment``), every other row zero in data and
        scales, both group-list types describing that layout (type 0: each expert's end); combine
        ignores the expert output's padding rows (NaN there) and gives each token's weighted sum;
        a whole layer with the torch experts matches the dense reference. Every accepted dtype, the
        routings rotated. MASKED outputs are what they are without the alignment.

        Troubleshooting: a backend declares ``capabilities.expert_alignment`` only for the modes
        whose dispatch writes the aligned layout itself (returning ``expert_alignment`` set, gaps
        zeroed) and whose combine takes the expert rows in it; in the other modes it returns dense
        rows and the core copies them (``moe_dispatch.alignment``).
        """
        m = Mode.parse(mode)
        self._require_world(world_size, m)
        self._require_mode(m)
        self._require_runnable()
        routings = standard_routings(world_size, self._shape(m).tokens_per_rank)
        cases = [self._case(world_size, m, d, routings[i % len(routings)], seed=20 + i, group_list_type=i % 2,
                            expert_alignment=ALIGNMENT)
                 for i, d in enumerate(self._accepted(m))]
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_conservation, cases)
        forward = replace(cases[0], routing=routings[1])
        errors = moe_rank_pools.get(world_size).map(ranks.check_forward, forward)
        assert max(errors) <= TOLERANCES[forward.dtype], f"relative error per rank {errors}"

    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_token_major_rows(self, moe_rank_pools: Any, world_size: int) -> None:
        """With ``DispatchSpec(layout="token_major")`` in a mode of ``capabilities.token_major_modes``,
        dispatch returns each received token once with its local top-k (``row_topk_ids``, -1 for
        experts elsewhere, and ``row_topk_weights``, 0 there): each local expert's (row, id) pairs are the
        tokens routed to it with their weights, the counts match, combine adds the rows the ranks
        send back, and a whole layer matches the dense reference. Every accepted dtype.

        Troubleshooting: the expert output is one row per received row, already weighted and
        summed over its local experts (``run_experts`` does it); combine must not weight again.
        """
        modes = sorted(self.capabilities.token_major_modes)
        if not modes:
            pytest.skip(f"backend {self.backend_name!r} declares no token-major mode")
        self._require_world(world_size, modes[0])
        self._require_runnable()
        routings = standard_routings(world_size, self._shape(modes[0]).tokens_per_rank)
        for i, d in enumerate(self._accepted(modes[0])):
            case = replace(self._case(world_size, modes[0], d, routings[i % len(routings)], seed=40 + i,
                                      group_list_type=i % 2), layout=Layout.TOKEN_MAJOR)
            _run_on_ranks(moe_rank_pools, world_size, ranks.check_token_major, case)

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_same_inputs_same_bits(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """The same inputs give bit-identical outputs twice on one dispatcher and on a new one.

        Troubleshooting: a result that changes run to run comes from an unordered reduction
        (atomics, ``index_add_`` on CUDA without ``torch.use_deterministic_algorithms``) or
        from state kept between calls (a stale buffer). Sum a token's contributions in a
        fixed order.
        """
        m = Mode.parse(mode)
        self._require_world(world_size, m)
        self._require_mode(m)
        self._require_runnable()
        dtype = self._accepted(m)[0]
        case = self._case(world_size, m, dtype, standard_routings(world_size, self._shape(m).tokens_per_rank)[1], seed=5)
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_repeatable, case)

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_two_dispatches_in_flight(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """Two dispatches on one dispatcher before either is combined (two-batch overlap), the
        second with smaller batches, combined in reverse order, plus a second dispatcher (the
        other mode, or another dtype) interleaved, give what each gives alone.

        Troubleshooting: everything combine needs must travel in ``DispatchOutput.handle``;
        a dispatcher that keeps the last call's layout or buffers on ``self`` fails here.
        """
        m = Mode.parse(mode)
        self._require_world(world_size, m)
        self._require_mode(m)
        self._require_runnable()
        accepted = self._accepted(m)
        other_mode = next((o for o in self.capabilities.modes if o is not m and self._runs_on(o, world_size)), m)
        other = [d for d in self._accepted(other_mode) if d is not accepted[0]] or self._accepted(other_mode)
        routing = standard_routings(world_size, self._shape(m).tokens_per_rank)[1]
        other_routing = standard_routings(world_size, self._shape(other_mode).tokens_per_rank)[0]
        first = self._case(world_size, m, accepted[0], routing, seed=7)
        second = self._case(world_size, other_mode, other[0], other_routing, seed=8, group_list_type=0)
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_in_flight, first, second)

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_two_micro_batches_overlap(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """Two micro-batches in split phase, interleaved as an engine's two-batch overlap runs
        them (``dispatch_start`` both, ``wait`` one, its experts, ``combine_start``, the other, the
        combines received in reverse), give the bits of blocking calls; a combine started twice is
        refused.

        Troubleshooting: a backend that declares ``capabilities.split_phase`` implements
        ``dispatch_start``/``combine_start`` (``SplitPhaseBackendDispatcher``) and keeps each
        started call's buffers its own until its ``wait()`` returns, even while the other
        micro-batch's calls start; a backend without declares nothing and the core runs each call
        to its end at start.
        """
        m = Mode.parse(mode)
        self._require_world(world_size, m)
        self._require_mode(m)
        self._require_runnable()
        case = self._case(world_size, m, self._accepted(m)[0],
                          standard_routings(world_size, self._shape(m).tokens_per_rank)[1], seed=13)
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_overlap, case)

    @pytest.mark.parametrize("mode", _MODES)
    def test_split_phase_as_declared(self, moe_rank_pools: Any, mode: str) -> None:
        """``Dispatcher.split_phase`` says what ``capabilities.split_phase`` declares for the mode. In a
        declared mode, on more than one rank, ``dispatch_start`` and ``combine_start`` return while the
        data is on its way (``Pending.overlapped`` True); in another mode the core runs each call to its
        end at the start (False). Either way the started calls give the blocking calls' counts and bits.

        Troubleshooting: a mode in ``split_phase`` needs a dispatcher with ``dispatch_start``/
        ``combine_start`` (``SplitPhaseBackendDispatcher``) that start the exchange and return, leaving
        the receive to ``wait()``. ``Pending(finish, overlapped=False)`` is for a call the vendor cannot
        split in some state (CUDA-graph capture); a backend that runs calls whole in the kit's setting
        (local gloo ranks, no capture) leaves the mode out of ``split_phase``, or overrides this test
        with ``xfail(reason=...)`` saying why.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        self._require_runnable()
        multi = [w for w in self.world_sizes if w > 1 and self._runs_on(m, w)]
        if not multi:
            pytest.skip(f"none of {type(self).__name__}.world_sizes {self.world_sizes} above 1 runs {m.value} mode")
        world = 2 if 2 in multi else min(multi)
        case = self._case(world, m, self._accepted(m)[0], standard_routings(world, self._shape(m).tokens_per_rank)[1],
                          seed=17)
        _run_on_ranks(moe_rank_pools, world, ranks.check_split_phase, case)

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_no_host_sync_in_cuda_graph_modes(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """In a mode of ``capabilities.cuda_graph_modes``, a dispatch and a combine (after a first pair,
        as an engine warms up before it captures) read no tensor data on the host, in every accepted
        dtype (on one world size) and, where the backend writes them, expert-aligned rows: no
        ``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero`` or the like
        (``moe_dispatch_testing.host_reads``), which on an accelerator stall the stream and cannot be
        captured in a CUDA graph. The core's value checks are off (``check_inputs=False``: they read the
        data by design); the vendor library's own calls (on CPU, its fake) and the call check that gloo
        alone makes are left out.

        Troubleshooting: each read is named with where it was made. Keep counts on the device and take
        shapes from the capacity (MASKED ``[E_local, capacity·world, H]``, or ``worst_case_rows``), never
        from the counts; a mode whose calls need the counts on the host stays out of
        ``cuda_graph_modes``.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        if m not in self.capabilities.cuda_graph_modes:
            pytest.skip(f"capabilities.cuda_graph_modes does not name {m.value} mode")
        self._require_world(world_size, m)
        self._require_runnable()
        routings = standard_routings(world_size, self._shape(m).tokens_per_rank)
        # every dtype on one world size, the first elsewhere: the dtypes' code and the world sizes' barely mix
        dtypes = self._accepted(m) if world_size == self._world_for(m) else self._accepted(m)[:1]
        cases = [self._case(world_size, m, d, routings[1], seed=30 + i) for i, d in enumerate(dtypes)]
        if m in self.capabilities.expert_alignment:
            cases.append(replace(cases[0], routing=routings[0], expert_alignment=ALIGNMENT))
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_no_host_sync, cases)

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_outputs_live_until_their_combine(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """An output's tensors stay as dispatch left them until its combine while later dispatches
        run and are combined (the lifetime rule of ``DispatchOutput``); combining it again is an
        ``InvalidInputError`` naming ``dispatch_output``, after which the dispatcher still works.

        Troubleshooting: a backend that reuses its buffers must not hand one to a dispatch while
        an earlier output that lives in it has not been combined (the core's reference backends
        keep slots, ``moe_dispatch.reference.slots``); the second-combine refusal is the core's.
        """
        m = Mode.parse(mode)
        self._require_world(world_size, m)
        self._require_mode(m)
        self._require_runnable()
        case = self._case(world_size, m, self._accepted(m)[0],
                          standard_routings(world_size, self._shape(m).tokens_per_rank)[1], seed=11)
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_lifetime, case)

    @pytest.mark.parametrize("mode", _MODES)
    @pytest.mark.parametrize("world_size", WORLD_SIZES)
    def test_combine_uses_the_routing_given_to_dispatch(self, moe_rank_pools: Any, world_size: int, mode: str) -> None:
        """Overwriting ``topk_ids`` and ``topk_weights`` in place between dispatch and combine (what
        a CUDA-graph engine does with its static router outputs) leaves combine's result unchanged.

        Troubleshooting: a combine that reads ``dispatch_output.topk_ids``/``topk_weights`` reads the
        caller's tensors, which may hold the next batch's routing by then; keep what combine needs
        in the handle at dispatch (a copy of the small routing tensors, ``moe_dispatch.output.kept_routing``,
        or the vendor's handle).
        """
        m = Mode.parse(mode)
        self._require_world(world_size, m)
        self._require_mode(m)
        self._require_runnable()
        dtype = self._accepted(m)[0]
        case = self._case(world_size, m, dtype, standard_routings(world_size, self._shape(m).tokens_per_rank)[1], seed=9)
        _run_on_ranks(moe_rank_pools, world_size, ranks.check_routing_reused, case)

    # -- errors -------------------------------------------------------------------------------------

    @pytest.mark.parametrize("mode", _MODES)
    def test_bad_input_is_a_typed_error(self, moe_rank_pools: Any, mode: str) -> None:
        """Bad tensors (wrong dtype, shape or hidden size; ids out of range, -2, duplicated;
        NaN; a combine given the wrong dtype or another dispatcher's output) raise a
        ``MoEDispatchError`` naming the parameter, leave the caller's tensors as they were,
        and leave the dispatcher usable.

        Troubleshooting: call the core's ``Dispatcher`` (never bypass its checks), and give
        your handle an ``owner`` attribute set to your backend dispatcher so combine can
        tell another dispatcher's output apart.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        self._require_runnable()
        world = self._world_for(m, prefer=min(self.world_sizes))
        case = self._case(world, m, self._accepted(m)[0], seed=9)
        _run_on_ranks(moe_rank_pools, world, ranks.check_bad_inputs, case)

    @pytest.mark.parametrize("mode", _MODES)
    def test_capacity_error_at_dispatch(self, moe_rank_pools: Any, mode: str) -> None:
        """A batch larger than ``num_max_dispatch_tokens_per_rank`` is a ``CapacityError``
        naming that parameter, raised before anything is sent.

        Troubleshooting: never grow or reallocate buffers on the hot path; the capacity is
        fixed at creation and the error tells the user which flag to raise.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        self._require_runnable()
        world = self._world_for(m)
        case = self._case(world, m, self._accepted(m)[0])
        _run_on_ranks(moe_rank_pools, world, ranks.check_capacity, case)

    @pytest.mark.parametrize("mode", _MODES)
    def test_declared_limits_are_enforced_at_creation(self, mode: str) -> None:
        """Each limit the capabilities declare for the mode (tokens per rank, hidden sizes,
        hidden multiple, top-k) is a typed error at creation naming the parameter, one past
        the limit; at the limit the spec passes.

        Troubleshooting: keep ``Backend.check_spec`` (or call ``super().check_spec``) and
        declare the vendor's limits in ``Capabilities.limits``.
        """
        m = Mode.parse(mode)
        self._require_mode(m)
        lim = self.capabilities.limits_for(m)
        declared = [lim.max_tokens_per_rank, lim.hidden_sizes, lim.max_top_k, lim.max_hidden,
                    lim.hidden_multiple if lim.hidden_multiple > 1 else None]
        if all(v is None for v in declared):
            pytest.skip(f"capabilities.limits[{m.value}] declares no limit")
        self.backend.check_spec(self._spec(m), 2)
        if lim.max_tokens_per_rank is not None:
            with pytest.raises(CapacityError) as info:
                self.backend.check_spec(self._spec(m, num_max_dispatch_tokens_per_rank=lim.max_tokens_per_rank + 1), 2)
            assert info.value.parameter == "num_max_dispatch_tokens_per_rank"
        if lim.max_top_k is not None:
            with pytest.raises(InvalidSpecError) as info:
                self.backend.check_spec(self._spec(m, top_k=lim.max_top_k + 1, num_experts=4 * (lim.max_top_k + 1)), 2)
            assert info.value.parameter == "top_k"
        bad_hidden = None
        if lim.hidden_sizes is not None:
            bad_hidden = next(h for h in range(128, 1 << 20, 128) if h not in lim.hidden_sizes)
        elif lim.max_hidden is not None:
            bad_hidden = lim.max_hidden + 128
        elif lim.hidden_multiple > 1:
            h = self._shape(m).hidden_size
            bad_hidden = next((x for x in range(h + 16, h + 16 * lim.hidden_multiple + 1, 16) if x % lim.hidden_multiple),
                              None)
        if bad_hidden is not None:
            with pytest.raises(InvalidSpecError) as info:
                self.backend.check_spec(self._spec(m, hidden_size=bad_hidden), 2)
            assert info.value.parameter == "hidden_size"

    def test_environment_is_untouched(self, moe_rank_pools: Any) -> None:
        """Creating dispatchers, dispatching and combining, in every mode and accepted dtype,
        leave ``os.environ`` exactly as it was, on every rank.

        Troubleshooting: a vendor library that reads an environment variable gets it set in
        a scoped, lock-protected block that restores the old value; never write
        ``os.environ`` to pass configuration (sglang's INT8 flag leaked from a draft model
        into the target model this way).
        """
        self._require_runnable()
        for m in self.capabilities.modes:
            world = self._world_for(m)
            cases = [self._case(world, m, d) for d in self._accepted(m)]
            _run_on_ranks(moe_rank_pools, world, ranks.check_environment, cases)

    # -- the guard --------------------------------------------------------------------------------

    def test_no_overrides_DO_NOT_OVERRIDE(self) -> None:
        """Every standard test is present, and an overridden one is marked
        ``@pytest.mark.xfail(reason=...)``.

        Troubleshooting: to opt out of a standard test, override it with the same signature
        and mark it xfail with the reason it does not apply; never delete it or set it to
        None.
        """
        problems = []
        for name in sorted(n for n in vars(BackendConformance) if n.startswith("test_")):
            mine = getattr(type(self), name, None)
            base = vars(BackendConformance)[name]
            if mine is None or not callable(mine):
                problems.append(f"{name} was deleted")
            elif mine is not base:
                marks = [mk for mk in getattr(mine, "pytestmark", []) if mk.name == "xfail"]
                if not any(mk.kwargs.get("reason") for mk in marks):
                    problems.append(f"{name} is overridden without @pytest.mark.xfail(reason=...)")
        _fail(problems)


__all__ = ["BackendConformance", "WORLD_SIZES"]
