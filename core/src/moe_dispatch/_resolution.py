"""Choosing the wire dtype, with a recorded reason for every step (``Resolution``), and the one preparation of a layer
that ``create_dispatcher``, ``plan_buffers`` and ``moe-dispatch explain`` share, so they never disagree about what a
spec needs or whether it is refused::

    DispatchSpec ─► Backend.check_spec ─► resolve_dtype (the trail) ─► UE8M0 support ─► Backend.buffer_size
                 ─► max_buffer_bytes (create_dispatcher and explain: refused; plan_buffers: a misfit)

The order (first match wins): explicit > ``MOE_DISPATCH_OUTPUT_DTYPE`` > deprecated ``SGLANG_DEEPEP_BF16_DISPATCH``
> quant hints > runner > backend default > FP8; then the backend validates. Pure: it reads only the ``env`` given
and calls no plugin but the backend's own checks.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from ._contract import Backend, BufferSize
from ._errors import CapacityError, InvalidSpecError, UnsupportedDtypeError
from ._spec import DispatchSpec
from ._trail import DtypeFallbackWarning, Resolution, Step
from ._wire import DispatchDtype, wire_dtype

if TYPE_CHECKING:
    from ._contract import RunnerInfo

ENV_OUTPUT_DTYPE = "MOE_DISPATCH_OUTPUT_DTYPE"
ENV_SGLANG_BF16 = "SGLANG_DEEPEP_BF16_DISPATCH"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def resolve_dtype(spec: DispatchSpec, backend: Backend, *, runners: "Mapping[str, RunnerInfo]",
                  env: Mapping[str, str] | None = None, strict: bool = False) -> Resolution:
    """Choose the wire dtype for ``spec`` on ``backend`` among ``runners`` (a ``PluginHost``'s ``runners()``): the
    public entry, which also takes a backend's name, and its parameters are ``planning.resolve_output_dtype``'s."""
    env = os.environ if env is None else env
    steps: list[Step] = []
    chosen = _choose(spec, backend, env, runners, steps)
    decision = backend.validate_dtype(chosen, spec)
    fallback_reason = None
    if decision.kind == "accept":
        steps.append(Step(f"validate:{backend.name}", chosen.value, "accepted", True))
        final = chosen
    elif decision.kind == "fallback":
        fallback_reason, final = decision.reason, decision.dtype
        steps.append(Step(f"validate:{backend.name}", final.value, f"fallback from {chosen.value}: {decision.reason}",
                          True))
        if strict:
            raise UnsupportedDtypeError(
                f"backend {backend.name!r} would fall back to {final.value} ({decision.reason}) and strict=True",
                parameter="output_dtype", value=chosen.value, allowed=_accepted(backend, spec))
        warnings.warn(f"moe-dispatch: backend {backend.name!r} sends {final.value} instead of {chosen.value}: "
                      f"{decision.reason}", DtypeFallbackWarning, stacklevel=4)
    else:
        raise UnsupportedDtypeError(f"backend {backend.name!r} rejects it: {decision.reason}", parameter="output_dtype",
                                    value=chosen.value, allowed=_accepted(backend, spec))
    _check_usable(spec, final)
    if spec.runner is not None:
        _check_runner(spec, backend, final, _lookup_runner(spec.runner, runners), steps)
    return Resolution(final, chosen, backend.name, tuple(steps), fallback_reason)


def _check_runner(spec: DispatchSpec, backend: Backend, dtype: DispatchDtype, info: "RunnerInfo",
                  steps: list[Step]) -> None:
    """The runner's declared combinations: the backends and modes it consumes, and the dtypes."""
    if info.backends is not None and spec.mode not in info.backends.get(backend.name, frozenset()):
        combos = ", ".join(f"{b} ({'/'.join(sorted(m.value for m in modes))})"
                           for b, modes in sorted(info.backends.items()))
        raise InvalidSpecError(f"runner {info.name!r} does not run behind backend {backend.name!r} in "
                               f"{spec.mode.value} mode", parameter="runner", value=info.name, allowed=combos)
    if info.accepts is not None and dtype not in info.accepts:
        raise InvalidSpecError(f"runner {info.name!r} cannot consume {dtype.value} rows", parameter="output_dtype",
                               value=dtype.value, allowed=", ".join(sorted(d.value for d in info.accepts)))
    steps.append(Step(f"runner {info.name}", dtype.value, f"consumes {dtype.value} behind {backend.name} "
                                                           f"({spec.mode.value})"))


def _choose(spec: DispatchSpec, backend: Backend, env: Mapping[str, str], runners: "Mapping[str, RunnerInfo]",
            steps: list[Step]) -> DispatchDtype:
    if spec.output_dtype is not None:
        steps.append(Step("explicit (spec.output_dtype)", spec.output_dtype.value, "set by the caller", True))
        return spec.output_dtype
    steps.append(Step("explicit (spec.output_dtype)", "auto", "not set"))

    raw = env.get(ENV_OUTPUT_DTYPE)
    if raw is not None:
        dtype = DispatchDtype.parse(raw, parameter=ENV_OUTPUT_DTYPE)
        if dtype is not None:
            steps.append(Step(f"env {ENV_OUTPUT_DTYPE}", dtype.value, "set in the environment", True))
            return dtype
        steps.append(Step(f"env {ENV_OUTPUT_DTYPE}", "auto", "set to auto"))
    else:
        steps.append(Step(f"env {ENV_OUTPUT_DTYPE}", "-", "not set"))

    legacy = env.get(ENV_SGLANG_BF16)
    if legacy is not None:
        text = legacy.strip().lower()
        if text in _TRUE:
            warnings.warn(f"{ENV_SGLANG_BF16} is deprecated; set {ENV_OUTPUT_DTYPE}=bf16 or pass output_dtype='bf16'",
                          DeprecationWarning, stacklevel=4)
            steps.append(Step(f"env {ENV_SGLANG_BF16}", "bf16", f"deprecated; use {ENV_OUTPUT_DTYPE}=bf16", True))
            return DispatchDtype.BF16
        if text not in _FALSE:
            raise InvalidSpecError("is not a boolean", parameter=ENV_SGLANG_BF16, value=legacy,
                                   allowed="1/0, true/false")
        steps.append(Step(f"env {ENV_SGLANG_BF16}", "off", "set but false (deprecated)"))
    else:
        steps.append(Step(f"env {ENV_SGLANG_BF16}", "-", "not set"))

    if spec.quant.input_global_scale is not None:
        steps.append(Step("quant.input_global_scale", "nvfp4", "a global scale asks for NVFP4 dispatch", True))
        return DispatchDtype.NVFP4
    if spec.quant.dispatcher_output_dtype is not None:
        dtype = spec.quant.dispatcher_output_dtype
        steps.append(Step("quant.dispatcher_output_dtype", dtype.value, "the layer's quant method needs it", True))
        return dtype
    steps.append(Step("quant hints", "-", "no dtype hint"))

    if spec.runner is not None:
        info = _lookup_runner(spec.runner, runners)
        if info.needs is not None:
            steps.append(Step(f"runner {info.name}", info.needs.value, info.reason or "the kernel needs it", True))
            return info.needs
        steps.append(Step(f"runner {info.name}", "any", info.reason or "accepts every dtype"))
    else:
        steps.append(Step("runner", "-", "not set"))

    default = backend.default_dtype(spec)
    if default is not None:
        steps.append(Step(f"backend default ({backend.name})", default.value, "the backend's default", True))
        return default
    steps.append(Step(f"backend default ({backend.name})", "-", "none"))
    steps.append(Step("library default", "fp8", "FP8 halves the bytes of BF16", True))
    return DispatchDtype.FP8


def _lookup_runner(name: str, runners: "Mapping[str, RunnerInfo]") -> "RunnerInfo":
    info = runners.get(name)
    if info is None:
        close = difflib.get_close_matches(name, list(runners), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidSpecError(f"unknown expert runner{hint}; a plugin registers its runners", parameter="runner",
                               value=name, allowed=", ".join(sorted(runners)) or "none registered")
    return info


def _accepted(backend: Backend, spec: DispatchSpec) -> str:
    caps = backend.capabilities
    text = ", ".join(sorted(d.value for d in caps.dtypes.get(spec.mode, ()))) or "none"
    fallbacks = [f"{d.value}→{f.to.value}" for (m, d), f in caps.fallbacks.items() if m is spec.mode]
    if fallbacks:
        text += " (fallbacks: " + ", ".join(fallbacks) + ")"
    return f"{text} in {spec.mode.value} mode"


def _check_usable(spec: DispatchSpec, dtype: DispatchDtype) -> None:
    """The resolved dtype must fit the spec: block divisibility, a global scale where the format has one."""
    spec.wire_format(dtype)
    if wire_dtype(dtype).global_scale and spec.quant.input_global_scale is None:
        raise InvalidSpecError(f"{dtype.value} dispatch needs a global scale", parameter="quant.input_global_scale",
                               value=None, allowed="a positive finite float (FlashInfer's convention: 448*6/amax)")


@dataclass(frozen=True)
class PreparedLayer:
    """A spec checked against a backend at a world size: its wire dtype (in ``spec``), the trail, and its buffers."""

    backend: Backend
    spec: DispatchSpec
    resolution: Resolution
    buffer_size: BufferSize
    world_size: int
    #: The device the buffers go on, when known: they must fit its whole memory.
    device: torch.device | None = None

    @property
    def buffer_limit(self) -> int | None:
        """The backend's ``max_buffer_bytes`` for this mode (None: no limit)."""
        return self.backend.capabilities.limits_for(self.spec.mode).max_buffer_bytes

    def over_limit(self) -> CapacityError | None:
        """The error ``create_dispatcher`` raises when the largest allocation passes the limit."""
        limit, need = self.buffer_limit, self.buffer_size.largest_allocation
        if limit is None or need <= limit:
            return None
        return CapacityError(f"backend {self.backend.name!r} needs {need:,} buffer bytes, more than its limit of "
                             f"{limit:,}; lower --num-max-dispatch-tokens-per-rank",
                             parameter="num_max_dispatch_tokens_per_rank",
                             value=self.spec.num_max_dispatch_tokens_per_rank)

    def over_memory(self) -> CapacityError | None:
        """Buffers larger than the device's whole memory cannot be allocated: the error ``create_dispatcher`` raises,
        instead of an allocator error at the first dispatch (a low-latency capacity of 2**25 tokens)."""
        total = None if self.device is None else memory_bytes(self.device)
        need = self.buffer_size.total_bytes
        if total is None or need <= total:
            return None
        return CapacityError(f"the buffers this spec needs ({need:,} bytes on {self.world_size} ranks) exceed the "
                             f"device's whole memory ({total:,} bytes on {self.device.type})",  # type: ignore[union-attr]
                             parameter="num_max_dispatch_tokens_per_rank",
                             value=self.spec.num_max_dispatch_tokens_per_rank,
                             allowed="a capacity whose buffers fit the device")


def memory_bytes(device: torch.device) -> int | None:
    """The device's total memory, where it can be read cheaply (None: unknown)."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[1])
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None


def prepare_layer(backend: Backend, spec: DispatchSpec, world_size: int, *, runners: "Mapping[str, RunnerInfo]",
                  env: Mapping[str, str] | None = None, strict: bool = False, enforce_limit: bool = True,
                  parameter: str = "spec", device: torch.device | None = None) -> PreparedLayer:
    """Check ``spec`` on ``backend`` at ``world_size``, resolve its wire dtype, size its buffers.

    :param runners: the known expert-kernel families (``PluginHost.runners()``).
    :param enforce_limit: raise when the buffers pass ``max_buffer_bytes`` or the memory of ``device`` (a planner
        reports it instead: ``PreparedLayer.over_limit``, ``over_memory``).
    :param device: where the buffers go (None: not checked against a memory).
    :param parameter: the name a non-``DispatchSpec`` is reported under.
    :raises InvalidSpecError: / :raises UnsupportedDtypeError: / :raises CapacityError: what ``create_dispatcher``
        raises for this spec, before any collective.
    """
    if not isinstance(spec, DispatchSpec):
        raise InvalidSpecError("must be a DispatchSpec", parameter=parameter, value=spec,
                               allowed="moe_dispatch.DispatchSpec")
    backend.check_spec(spec, world_size)
    if spec.layout is not None and spec.layout not in (layouts := backend.capabilities.layouts_for(spec.mode)):
        raise InvalidSpecError(f"backend {backend.name!r} ({spec.mode.value}) does not write this layout",
                               parameter="layout", value=spec.layout.value, allowed=", ".join(layouts))
    resolution = resolve_dtype(spec, backend, runners=runners, env=env, strict=strict)
    resolved = spec.with_dtype(resolution.dtype)
    if resolved.wire_format().ue8m0 and not backend.capabilities.fp8_ue8m0:
        raise InvalidSpecError(f"backend {backend.name!r} cannot send FP8 with UE8M0 (power-of-two) scales",
                               parameter="quant.fp8_ue8m0_scales", value=True, allowed="False for this backend")
    layer = PreparedLayer(backend, resolved, resolution, backend.buffer_size(resolved, world_size), world_size, device)
    error = (layer.over_limit() or layer.over_memory()) if enforce_limit else None
    if error is not None:
        raise error
    return layer
