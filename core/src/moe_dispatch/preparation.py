"""One preparation of a layer, shared by every entry point that checks or sizes one
(``create_dispatcher``, ``plan_buffers``, ``moe-dispatch explain``), so that they can never
disagree about what a spec needs or whether it is refused::

    DispatchSpec ─► Backend.check_spec ─► resolve_dtype (the trail) ─► UE8M0 support
                 ─► Backend.buffer_size ─► max_buffer_bytes
                    (create_dispatcher and explain: refused; plan_buffers: reported as a misfit)

Local and pure: no process group, no allocation, no plugin call but the backend's own checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .backend import Backend, BufferSize
from .errors import CapacityError, InvalidSpecError
from .registry import PluginHost, default_host
from .resolution import resolve_dtype
from .spec import DispatchSpec
from .trail import Resolution

if TYPE_CHECKING:
    from .backend import RunnerInfo


@dataclass(frozen=True)
class PreparedLayer:
    """A spec checked against a backend at a world size: its wire dtype with the trail, and its
    buffers. ``spec`` carries the resolved dtype."""

    backend: Backend
    spec: DispatchSpec
    resolution: Resolution
    buffer_size: BufferSize
    world_size: int

    @property
    def buffer_limit(self) -> int | None:
        """The backend's ``max_buffer_bytes`` for this mode (None: no limit)."""
        return self.backend.capabilities.limits_for(self.spec.mode).max_buffer_bytes

    def over_limit(self) -> CapacityError | None:
        """The error ``create_dispatcher`` raises when the largest allocation passes the limit."""
        limit, need = self.buffer_limit, self.buffer_size.largest_allocation
        if limit is None or need <= limit:
            return None
        return CapacityError(
            f"backend {self.backend.name!r} needs {need:,} buffer bytes, more than its limit of {limit:,}; "
            "lower --num-max-dispatch-tokens-per-rank",
            parameter="num_max_dispatch_tokens_per_rank",
            value=self.spec.num_max_dispatch_tokens_per_rank,
        )


def prepare_layer(
    backend: Backend,
    spec: DispatchSpec,
    world_size: int,
    *,
    runners: "Mapping[str, RunnerInfo]",
    env: Mapping[str, str] | None = None,
    strict: bool = False,
    enforce_limit: bool = True,
    parameter: str = "spec",
) -> PreparedLayer:
    """Check ``spec`` on ``backend`` at ``world_size``, resolve its wire dtype, size its buffers.

    :param runners: the known expert-kernel families (``PluginHost.runners()``).
    :param enforce_limit: raise when the buffers pass ``max_buffer_bytes`` (a planner reports
        it instead: ``PreparedLayer.over_limit``).
    :param parameter: the name a non-``DispatchSpec`` is reported under.
    :raises InvalidSpecError: / :raises UnsupportedDtypeError: / :raises CapacityError: what
        ``create_dispatcher`` raises for this spec, before any collective.
    """
    if not isinstance(spec, DispatchSpec):
        raise InvalidSpecError("must be a DispatchSpec", parameter=parameter, value=spec,
                               allowed="moe_dispatch.DispatchSpec")
    backend.check_spec(spec, world_size)
    resolution = resolve_dtype(spec, backend, runners=runners, env=env, strict=strict)
    resolved = spec.with_dtype(resolution.dtype)
    if resolved.wire_format().ue8m0 and not backend.capabilities.fp8_ue8m0:
        raise InvalidSpecError(
            f"backend {backend.name!r} cannot send FP8 with UE8M0 (power-of-two) scales",
            parameter="quant.fp8_ue8m0_scales", value=True, allowed="False for this backend",
        )
    layer = PreparedLayer(backend, resolved, resolution, backend.buffer_size(resolved, world_size), world_size)
    error = layer.over_limit() if enforce_limit else None
    if error is not None:
        raise error
    return layer


def resolve_output_dtype(
    spec: DispatchSpec,
    backend: "str | Backend",
    *,
    env: Mapping[str, str] | None = None,
    strict: bool = False,
    runners: "Mapping[str, RunnerInfo] | None" = None,
    host: "PluginHost | None" = None,
) -> Resolution:
    """Choose the wire dtype for ``spec`` on ``backend`` (a name or a ``Backend``), with the
    reason for every step (``moe_dispatch.resolution`` has the order).

    :param env: the environment to read (``os.environ`` when None); never written.
    :param strict: a fallback raises ``UnsupportedDtypeError`` instead of warning.
    :param runners: the known expert-kernel families; ``host``'s when None.
    :param host: where a backend name and the runners are looked up (the process's default
        ``PluginHost`` when None).
    :raises UnsupportedDtypeError: the backend rejects the dtype, or falls back under strict.
    :raises InvalidSpecError: a bad env value, unknown runner, or a dtype the spec cannot use.
    """
    if isinstance(backend, str) or runners is None:
        chosen = (host or default_host()).select(backend, must_run_here=False)
        backend, runners = chosen.backend, chosen.runners if runners is None else runners
    return resolve_dtype(spec, backend, runners=runners, env=env, strict=strict)


__all__ = ["PreparedLayer", "prepare_layer", "resolve_output_dtype"]
