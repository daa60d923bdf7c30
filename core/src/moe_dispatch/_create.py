"""``create_dispatcher``: everything that can fail, before the first forward and on every rank of the group::

    arguments ─► PluginHost.select (probe) ─► prepare_layer (spec, wire dtype, buffers) ─► fits the device
              ─► agree (the fingerprint, compared field by field; a rank that failed sends its error instead)
              ─► Backend.create ─► Dispatcher
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ._codecs import make_codec
from ._contract import Backend, DispatchContext
from ._dispatcher import DEFAULT_IN_FLIGHT, Dispatcher
from ._distributed.comm import DEFAULT_TIMEOUT_S, Comm, check_timeout
from ._errors import CapacityError, InvalidSpecError, MoEDispatchError, PluginError
from ._loading import core_version
from ._registry import PluginHost, Selection, default_host
from ._resolution import prepare_layer
from ._spec import DispatchSpec
from ._trail import Resolution

if TYPE_CHECKING:
    import torch.distributed as dist

_MAX_IN_FLIGHT = 64


def create_dispatcher(backend: str | Backend, spec: DispatchSpec, group: "dist.ProcessGroup | None" = None, *,
                      strict: bool = False, env: Mapping[str, str] | None = None, check_inputs: bool | None = None,
                      host: PluginHost | None = None, options: Mapping[str, Any] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S, in_flight: int = DEFAULT_IN_FLIGHT) -> Dispatcher:
    """Resolve the wire dtype, check the spec against the backend, plan the buffers, agree with the other ranks and
    build the dispatcher: everything that can fail does so here, before the first forward, and on every rank.

    Works in one process (no torch.distributed: world size 1), under ``torchrun`` after ``dist.init_process_group()``
    (``group=None`` is the default group), and on any group. Every rank of the group must call it (it is a collective).

    :param backend: a registered backend's name, or a ``Backend``.
    :param strict: a dtype fallback raises instead of warning.
    :param env: environment for the resolution (``os.environ`` when None); never written.
    :param check_inputs: run the value checks (ids in range, no duplicate ids, finite values) on every dispatch; they
        read the data (a device sync on an accelerator). None (the default): on host memory only, so an accelerator's
        hot path makes no host sync; True: everywhere; False: nowhere. The shape, dtype, device and capacity checks
        always run.
    :param host: the plugin host to take the backend from (``PluginHost.default()`` when None).
    :param options: backend-specific options (``DispatchContext.options``).
    :param in_flight: how many dispatches the engine keeps in flight at once (two-batch overlap: 2, the default, as
        DeepEP double-buffers its low-latency mode). Backends that reuse their buffers plan that many sets at creation
        (the reference backends' low-latency slots); more in flight still works, each extra one at the cost of one more
        set.
    :param timeout_s: how long a rank waits for the others in one collective (gloo) before ``CollectiveTimeoutError``
        names the ranks that never arrived. NCCL and HCCL use the process group's own timeout.
    """
    comm = Comm(group, timeout_s=_timeout_or_default(timeout_s))  # a bad one is refused below, with the peers told
    try:
        _check_arguments(spec, env, options, timeout_s, in_flight)
        chosen = (host or default_host()).select(backend)
        with chosen.typed_errors("planning the dispatcher"):  # a plugin bug reaches the peers too
            ctx, resolution = _prepare(chosen, spec, comm, strict=strict, env=env, options=options,
                                       in_flight=in_flight)
            _check_fits_memory(ctx)
            fingerprint = _fingerprint(chosen, ctx, timeout_s)
    except MoEDispatchError as exc:
        # The peers learn of it in the agreement below (no one waits for a timeout); then raise it here.
        if comm.world_size > 1:
            _agreement().agree(comm, {}, "configuration", failure=exc)
        raise
    comm.bind(_agreement().agree(comm, fingerprint, "configuration") if comm.world_size > 1 else uuid.uuid4().hex)
    try:
        impl = comm.in_call(chosen.create)(ctx)
        if not (callable(getattr(impl, "dispatch", None)) and callable(getattr(impl, "combine", None))):
            raise PluginError(f"backend {chosen.backend.name!r} broke the contract: create() returned this",
                              parameter="create()", value=type(impl).__name__,
                              allowed="a BackendDispatcher (an object with dispatch and combine)")
    except BaseException as exc:
        comm.announce_failure("create", exc)
        raise
    return Dispatcher(chosen.backend, ctx.spec, resolution, impl, comm, ctx.buffer_size, check_inputs=check_inputs)


def _memory_bytes(device: torch.device) -> int | None:
    """The device's total memory, where it can be read cheaply (None: unknown)."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info()[1])
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None


def _check_fits_memory(ctx: DispatchContext) -> None:
    """Buffers larger than the device's whole memory cannot be allocated: say so at creation, not with an allocator
    error at the first dispatch (a low-latency capacity of 2**25 tokens)."""
    total, need = _memory_bytes(ctx.device), ctx.buffer_size.total_bytes
    if total is not None and need > total:
        raise CapacityError(f"the buffers this spec needs ({need:,} bytes on {ctx.world_size} ranks) exceed the "
                            f"device's whole memory ({total:,} bytes on {ctx.device.type})",
                            parameter="num_max_dispatch_tokens_per_rank",
                            value=ctx.spec.num_max_dispatch_tokens_per_rank,
                            allowed="a capacity whose buffers fit the device")


def _timeout_or_default(timeout_s: object) -> float:
    try:
        return check_timeout(timeout_s)
    except InvalidSpecError:
        return DEFAULT_TIMEOUT_S


def _check_arguments(spec: object, env: object, options: object, timeout_s: object, in_flight: object) -> None:
    """Typed errors for arguments of the wrong kind, raised inside the agreement so the peers hear of them."""
    check_timeout(timeout_s)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or not 1 <= in_flight <= _MAX_IN_FLIGHT:
        raise InvalidSpecError("must be the number of dispatches kept in flight at once", parameter="in_flight",
                               value=in_flight, allowed=f"an int in 1..{_MAX_IN_FLIGHT} (2 for two micro-batches)")
    if not isinstance(spec, DispatchSpec):
        raise InvalidSpecError("must be a moe_dispatch.DispatchSpec", parameter="spec", value=spec,
                               allowed="DispatchSpec(hidden_size, num_experts, top_k, ...)")
    for name, value in (("env", env), ("options", options)):
        if value is not None and not isinstance(value, Mapping):
            raise InvalidSpecError("must be a mapping of names to values, or None", parameter=name,
                                   value=value, allowed="None or a dict (e.g. os.environ)")


def _prepare(chosen: Selection, spec: DispatchSpec, comm: Comm, *, strict: bool, env: Mapping[str, str] | None,
             options: Mapping[str, Any] | None, in_flight: int = 2) -> tuple[DispatchContext, Resolution]:
    """Everything local (``prepare_layer``), then the context the backend creates from."""
    layer = prepare_layer(chosen.backend, spec, comm.world_size, runners=chosen.runners, env=env, strict=strict)
    ctx = DispatchContext(spec=layer.spec, resolution=layer.resolution, comm=comm,
                          codec=make_codec(layer.spec.wire_format(), layer.spec.quant.input_global_scale),
                          buffer_size=layer.buffer_size, device=comm.device or torch.device("cpu"),
                          options=dict(options or {}), in_flight=in_flight)
    return ctx, layer.resolution


def _fingerprint(chosen: Selection, ctx: DispatchContext, timeout_s: float) -> dict[str, Any]:
    """What every rank must agree on, compared field by field at creation: every field of the resolved spec
    (``DispatchSpec.to_dict``: a field added to the spec is compared by construction), then what else decides the
    collectives, then the backend's own ``agreement``."""
    backend = chosen.backend
    spec = {f"{name}.{k}" if isinstance(value, dict) else name: v
            for name, value in ctx.spec.to_dict().items()
            for k, v in (value.items() if isinstance(value, dict) else [(None, value)])}
    sizes = ctx.buffer_size
    return {**spec, "backend": backend.name, "backend version": chosen.label, "core version": core_version(),
            "world_size": ctx.world_size, "buffer bytes": [sizes.dispatch_bytes, sizes.combine_bytes],
            "timeout_s": timeout_s,
            "in_flight": ctx.in_flight,  # backends may plan buffers per call in flight (the reference's LL)
            **{f"{backend.name}: {name}": value for name, value in backend.agreement(ctx).items()}}


def _agreement():  # type: ignore[no-untyped-def]
    from ._distributed import agreement  # with peers only
    return agreement
