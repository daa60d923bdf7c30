"""Buffer planning: size every layer's buffers once, before the first forward.

An engine calls ``plan_buffers`` with every MoE layer's spec: each is resolved as ``create_dispatcher`` resolves it
and sized with the backend's ``buffer_size``, and the plan keeps the maxima over layers, dispatch and combine apart
(combine stays BF16 when dispatch is FP8), with the layer that drove each. Nothing is allocated or probed: a backend
that cannot run here is still plannable. Each layer also carries what the same backend asks for a BF16 wire (sglang
sizes for ``params_bytes`` fixed to 2), so the saving of a narrower wire dtype is visible, nil included.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ._contract import Backend, BufferSize, EnvRequirement, RunnerInfo
from ._errors import CapacityError, InvalidSpecError
from ._registry import PluginHost, default_host
from ._resolution import PreparedLayer, memory_bytes, prepare_layer, resolve_dtype
from ._spec import DispatchSpec
from ._trail import DtypeFallbackWarning, Resolution
from ._wire import DispatchDtype

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Misfit:
    """A limit a planned buffer does not fit: what to change (``parameter``, now ``value``, to something in
    ``allowed``), what is needed against what there is, and the layer needing the most. ``summary`` is the short form a
    table shows (``needs HCCL_BUFFSIZE >= 452 MB, have 200``)."""

    parameter: str
    value: Any
    allowed: str
    needed: int
    limit: int
    unit: str
    layer: str
    message: str
    summary: str = ""

    def error(self) -> CapacityError:
        return CapacityError(self.message, parameter=self.parameter, value=self.value, allowed=self.allowed)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class LayerBuffers:
    """One layer on one backend: its resolved spec, its sizes, and the same backend's sizes for a BF16 wire (what
    sglang's fixed ``params_bytes = 2`` asks of that backend).

    :param index: position in the specs given to ``plan_buffers``.
    :param name: the mapping key, or ``"layer <index>"``.
    """

    index: int
    name: str
    spec: DispatchSpec
    resolution: Resolution
    size: BufferSize
    bf16_size: BufferSize

    @property
    def dtype(self) -> DispatchDtype:
        return self.resolution.dtype

    @property
    def largest_allocation(self) -> int:
        """The biggest single buffer (``BufferSize.largest_allocation``)."""
        return self.size.largest_allocation

    @property
    def saving_bytes(self) -> int:
        """Bytes allocated for a BF16 wire minus bytes allocated for this dtype (0 or more)."""
        return self.bf16_size.total_bytes - self.size.total_bytes

    @property
    def saving_fraction(self) -> float:
        bf16 = self.bf16_size.total_bytes
        return self.saving_bytes / bf16 if bf16 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "spec": self.spec.to_dict(),
            "dtype": self.dtype.value,
            "requested_dtype": self.resolution.requested.value,
            "fallback_reason": self.resolution.fallback_reason,
            "buffer_size": self.size.to_dict(),
            "bf16_buffer_size": self.bf16_size.to_dict(),
            "saving_bytes": self.saving_bytes,
            "saving_fraction": round(self.saving_fraction, 6),
        }


@dataclass(frozen=True)
class Peak:
    """A maximum over layers and the layer that reached it (the first, on a tie)."""

    bytes: int
    layer: int
    name: str

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class BufferPlan:
    """Every layer's buffers on one backend and EP size, and what one allocation for all of them needs.

    :param dispatch: / :param combine: the largest dispatch and combine sizes over layers, each with the layer that
        drove it (they may be different layers).
    :param allocated: the largest ``BufferSize.total_bytes`` over layers.
    :param misfits: limits the plan does not fit, one per limit (the layer needing the most); ``plan_buffers`` never
        raises for them, ``check()`` does.
    """

    backend: str
    world_size: int
    layers: tuple[LayerBuffers, ...]
    dispatch: Peak
    combine: Peak
    allocated: Peak
    bf16_allocated: Peak
    misfits: tuple[Misfit, ...] = ()

    @property
    def shared(self) -> bool:
        """Dispatch and combine share one vendor buffer (DeepEP, the HCCL window)."""
        return any(layer.size.allocated_bytes is not None for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        """Bytes to allocate once for every layer: a shared buffer is as large as the largest layer's; separate buffers
        need the dispatch peak plus the combine peak, which may come from different layers."""
        return self.allocated.bytes if self.shared else self.dispatch.bytes + self.combine.bytes

    @property
    def bf16_total_bytes(self) -> int:
        """``total_bytes`` had every layer sent BF16."""
        if self.shared:
            return self.bf16_allocated.bytes
        return (max(layer.bf16_size.dispatch_bytes for layer in self.layers)
                + max(layer.bf16_size.combine_bytes for layer in self.layers))

    @property
    def saving_fraction(self) -> float:
        bf16 = self.bf16_total_bytes
        return (bf16 - self.total_bytes) / bf16 if bf16 else 0.0

    @property
    def fits(self) -> bool:
        return not self.misfits

    def check(self) -> None:
        """Raise ``CapacityError`` for the first misfit, as ``create_dispatcher`` would."""
        if self.misfits:
            raise self.misfits[0].error()

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "world_size": self.world_size,
            "dispatch": self.dispatch.to_dict(),
            "combine": self.combine.to_dict(),
            "allocated": self.allocated.to_dict(),
            "total_bytes": self.total_bytes,
            "bf16_total_bytes": self.bf16_total_bytes,
            "saving_fraction": round(self.saving_fraction, 6),
            "shared": self.shared,
            "fits": self.fits,
            "misfits": [m.to_dict() for m in self.misfits],
            "layers": [layer.to_dict() for layer in self.layers],
        }


def plan_buffers(backend: str | Backend, specs: Sequence[DispatchSpec] | Mapping[str, DispatchSpec], world_size: int,
                 *, env: Mapping[str, str] | None = None, host: PluginHost | None = None,
                 strict: bool = False) -> BufferPlan:
    """Size every layer's buffers on ``backend`` for an EP group of ``world_size`` ranks.

    Call once before the first forward, with every MoE layer's spec (a mapping keeps the layer names in the plan).
    Raises what ``create_dispatcher`` raises for a spec it would refuse (a rejected dtype, a limit in ``check_spec``);
    reports, without raising, buffers over the backend's ``max_buffer_bytes`` and environment values below a backend's
    ``env_requirements`` (``BufferPlan.misfits``; ``BufferPlan.check()`` raises).

    :param env: the environment the dispatchers will be created in (``os.environ`` when None): read for the wire dtype
        (``MOE_DISPATCH_OUTPUT_DTYPE``) and the backends' requirements (``HCCL_BUFFSIZE``); never written.
    :param strict: a dtype fallback raises, as in ``create_dispatcher``.
    """
    host = host or default_host()
    backend_obj = host.get_backend(backend) if isinstance(backend, str) else backend
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise InvalidSpecError("must be a positive int", parameter="world_size", value=world_size,
                               allowed="1, 2, 3, ...")
    named = list(specs.items()) if isinstance(specs, Mapping) else [(f"layer {i}", s) for i, s in enumerate(specs)]
    if not named:
        raise InvalidSpecError("needs at least one layer's spec", parameter="specs", value=specs,
                               allowed="a non-empty sequence or mapping of DispatchSpec")
    env = os.environ if env is None else env
    runners = host.runners()
    layers = tuple(_plan_layer(backend_obj, i, name, spec, world_size, env, runners, strict)
                   for i, (name, spec) in enumerate(named))
    misfits = _misfits(backend_obj, layers, world_size, env)
    return BufferPlan(backend=backend_obj.name, world_size=world_size, layers=layers,
                      dispatch=_peak(layers, lambda layer: layer.size.dispatch_bytes),
                      combine=_peak(layers, lambda layer: layer.size.combine_bytes),
                      allocated=_peak(layers, lambda layer: layer.size.total_bytes),
                      bf16_allocated=_peak(layers, lambda layer: layer.bf16_size.total_bytes), misfits=misfits)


def _plan_layer(backend: Backend, index: int, name: str, spec: DispatchSpec, world_size: int,
                env: Mapping[str, str], runners: Mapping[str, Any], strict: bool) -> LayerBuffers:
    """``create_dispatcher``'s preparation (``prepare_layer``), the buffer limit left to the misfits."""
    with warnings.catch_warnings():  # the fallback is kept on the resolution; create_dispatcher warns
        warnings.simplefilter("ignore", DtypeFallbackWarning)
        layer = prepare_layer(backend, spec, world_size, runners=runners, env=env, strict=strict,
                              enforce_limit=False, parameter=f"specs[{name!r}]")
    resolved, size = layer.spec, layer.buffer_size
    # sglang's params_bytes = 2: the same backend sized for a BF16 wire.
    bf16 = size if resolved.output_dtype is DispatchDtype.BF16 else backend.buffer_size(
        resolved.with_dtype(DispatchDtype.BF16), world_size)
    return LayerBuffers(index, name, resolved, layer.resolution, size, bf16)


def _peak(layers: Sequence[LayerBuffers], key: Callable[[LayerBuffers], int]) -> Peak:
    best = max(layers, key=lambda layer: (key(layer), -layer.index))
    return Peak(key(best), best.index, best.name)


def _misfits(backend: Backend, layers: Sequence[LayerBuffers], world_size: int,
             env: Mapping[str, str]) -> tuple[Misfit, ...]:
    """One misfit per limit: the layer that needs the most."""
    worst: dict[tuple[str, str], Misfit] = {}

    def keep(key: tuple[str, str], misfit: Misfit) -> None:
        if key not in worst or misfit.needed > worst[key].needed:
            worst[key] = misfit

    device = device_here(backend)
    memory = None if device is None else memory_bytes(device)
    for layer in layers:
        mode = layer.spec.mode
        limit = backend.capabilities.limits_for(mode).max_buffer_bytes
        need = layer.largest_allocation
        if limit is not None and need > limit:
            keep(("max_buffer_bytes", mode.value), _over_limit(backend, layer, world_size, need, limit))
        if memory is not None and layer.size.total_bytes > memory:  # what create_dispatcher refuses on this machine
            total, t = layer.size.total_bytes, layer.spec.num_max_dispatch_tokens_per_rank
            keep(("memory", ""), Misfit(
                "num_max_dispatch_tokens_per_rank", t, "a capacity whose buffers fit the device", total, memory,
                "bytes", layer.name, f"{layer.name} needs {total:,} buffer bytes, more than the {device.type} "  # type: ignore[union-attr]
                f"memory of this machine ({memory:,}); lower --num-max-dispatch-tokens-per-rank",
                f"needs {_human(total)} of {device.type} memory, have {_human(memory)}"))  # type: ignore[union-attr]
        for req in backend.env_requirements(layer.spec, world_size):
            have = _env_int(env, req)
            if have is not None and have >= req.minimum:
                continue
            where = "unset, no default" if have is None else (
                f"have {have}" + ("" if req.variable in env else " (the default)"))
            why = f" ({req.reason})" if req.reason else ""
            keep(("env", req.variable), Misfit(
                req.variable, have, f">= {req.minimum}", req.minimum, have or 0, req.unit, layer.name,
                f"needs {req.variable} >= {req.minimum} {req.unit}, {where}, for {layer.name}{why}; export "
                f"{req.variable}={req.minimum} before the process group starts, or lower "
                f"--num-max-dispatch-tokens-per-rank",
                f"needs {req.variable} >= {req.minimum} {req.unit}, {where}"))
    return tuple(worst.values())


def _over_limit(backend: Backend, layer: LayerBuffers, world_size: int, need: int, limit: int) -> Misfit:
    """The misfit of a buffer over ``max_buffer_bytes``, with the largest token count that fits
    (sizes grow with T; a binary search of ``buffer_size``, a few dozen calls at most)."""
    spec, t = layer.spec, layer.spec.num_max_dispatch_tokens_per_rank

    def fits(tokens: int) -> bool:
        size = backend.buffer_size(dataclasses.replace(spec, num_max_dispatch_tokens_per_rank=tokens), world_size)
        return size.largest_allocation <= limit

    lo, hi = 0, t - 1  # the largest fitting T is in [lo, hi]; 0 means none
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    head = (f"backend {backend.name!r} ({spec.mode.value}) needs a {_human(need)} buffer ({need:,} B) for "
            f"{layer.name}, over its limit of {_human(limit)} ({limit:,} B)")
    short = f"buffer {_human(need)} > limit {_human(limit)}"
    if lo:
        return Misfit("num_max_dispatch_tokens_per_rank", t, f"1..{lo}", need, limit, "bytes", layer.name,
                      f"{head}; lower --num-max-dispatch-tokens-per-rank to {lo} or less",
                      f"{short}; tokens <= {lo} fit")
    return Misfit("num_max_dispatch_tokens_per_rank", t, "none: this buffer does not shrink below the limit with "
                  "fewer tokens", need, limit, "bytes", layer.name,
                  f"{head}, whatever the token count; use more ranks or another backend", short)


def _env_int(env: Mapping[str, str], req: EnvRequirement) -> int | None:
    raw = env.get(req.variable)
    if raw is None:
        return req.default
    if not (raw.strip().isascii() and raw.strip().isdigit()):
        raise InvalidSpecError(f"is not a whole number of {req.unit}", parameter=req.variable, value=raw,
                               allowed=f"an integer >= {req.minimum}")
    return int(raw)


def device_here(backend: Backend) -> torch.device | None:
    """The device ``backend`` would run on in this process, for a check made without a process group (explain,
    plan): CUDA where it supports it and one is here, else the CPU where it supports that (None: neither)."""
    devices = backend.capabilities.devices
    if "cuda" in devices and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu") if "cpu" in devices else None


def _human(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def resolve_output_dtype(spec: DispatchSpec, backend: str | Backend, *, env: Mapping[str, str] | None = None,
                         strict: bool = False, runners: Mapping[str, RunnerInfo] | None = None,
                         host: PluginHost | None = None) -> Resolution:
    """Choose the wire dtype for ``spec`` on ``backend`` (a name or a ``Backend``), with the reason for every step
    (in the order ``moe_dispatch._resolution`` documents).

    :param env: the environment to read (``os.environ`` when None); never written.
    :param strict: a fallback raises ``UnsupportedDtypeError`` instead of warning.
    :param runners: the known expert-kernel families; ``host``'s when None.
    :param host: where a backend name and the runners are looked up (the process's default ``PluginHost`` when None).
    :raises UnsupportedDtypeError: the backend rejects the dtype, or falls back under strict.
    :raises InvalidSpecError: a bad env value, unknown runner, or a dtype the spec cannot use.
    """
    if isinstance(backend, str) or runners is None:
        chosen = (host or default_host()).select(backend, must_run_here=False)
        backend, runners = chosen.backend, chosen.runners if runners is None else runners
    return resolve_dtype(spec, backend, runners=runners, env=env, strict=strict)


__all__ = ["BufferPlan", "LayerBuffers", "Misfit", "Peak", "PreparedLayer", "plan_buffers", "prepare_layer",
           "resolve_output_dtype"]
