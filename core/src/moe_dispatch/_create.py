"""``create_dispatcher``: everything that can fail, before the first forward and on every rank of the group::

    arguments ─► PluginHost.select (probe) ─► prepare_layer (spec, wire dtype, buffers) ─► fits the device
              ─► agree (the fingerprint, compared field by field; a rank that failed sends its error instead)
              ─► Backend.create ─► Dispatcher
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Mapping

import torch
import torch.distributed as dist  # loaded with Comm already

from ._codecs import make_codec
from ._contract import Backend, DispatchContext
from ._dispatcher import DEFAULT_IN_FLIGHT, Dispatcher
from ._distributed.comm import DEFAULT_TIMEOUT_S, Comm, check_timeout
from ._errors import InvalidSpecError, MoEDispatchError, PluginError
from ._loading import core_version
from ._registry import PluginHost, Selection, default_host
from ._resolution import prepare_layer
from ._spec import DispatchSpec
from ._trail import Resolution

_MAX_IN_FLIGHT = 64


def create_dispatcher(backend: str | Backend, spec: DispatchSpec, group: "dist.ProcessGroup | None" = None, *,
                      strict: bool = False, env: Mapping[str, str] | None = None, check_inputs: bool | None = None,
                      host: PluginHost | None = None, options: Mapping[str, Any] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S, in_flight: int = DEFAULT_IN_FLIGHT) -> Dispatcher:
    """Resolve the wire dtype, check the spec against the backend, plan the buffers, agree with the other ranks and
    build the dispatcher: everything that can fail does so here, before the first forward, and on every rank.

    Works in one process (no torch.distributed: world size 1), under ``torchrun`` after ``dist.init_process_group()``
    (``group=None`` is the default group), and on any group. Every rank of the group must call it (it is a collective).
    In each process, one thread at a time creates and calls a group's dispatchers (docs/reliability.md).

    :param backend: a registered backend's name, or a ``Backend``.
    :param strict: a dtype fallback raises instead of warning.
    :param env: environment for the resolution (``os.environ`` when None); never written.
    :param check_inputs: run the value checks (ids in range, no duplicate ids, finite values) on every dispatch; they
        read the data (a device sync on an accelerator). None (the default): on host memory only; True: everywhere;
        False: nowhere. The shape, dtype, device and capacity checks always run.
    :param host: the plugin host to take the backend from (``PluginHost.default()`` when None).
    :param options: backend-specific options (``DispatchContext.options``).
    :param in_flight: how many dispatches the engine keeps in flight at once (2, the default: two-batch overlap, as
        DeepEP double-buffers its low-latency mode). Backends that reuse their buffers (the reference backends'
        low-latency slots) plan that many sets at creation; more in flight still works, at one more set each.
    :param timeout_s: how long a rank waits for the others in one collective (gloo) before ``CollectiveTimeoutError``
        names the ranks that did not arrive. NCCL and HCCL use the process group's own timeout.
    """
    if not _is_group(group):  # refused here alone: there is no group to tell the peers on
        raise InvalidSpecError("must be a torch.distributed process group, or None for the default group",
                               parameter="group", value=group, allowed="None or a dist.ProcessGroup (dist.new_group)")
    comm = Comm(group, timeout_s=_timeout_or_default(timeout_s))  # a bad timeout is refused below, the peers told
    with comm.guard or contextlib.nullcontext():  # with peers: the group's only call in this process meanwhile
        try:
            _check_arguments(backend, spec, strict=strict, env=env, check_inputs=check_inputs, host=host,
                             options=options, timeout_s=timeout_s, in_flight=in_flight)
            chosen = (host or default_host()).select(backend)
            with chosen.typed_errors("planning the dispatcher"):  # a plugin bug reaches the peers too
                ctx, resolution = _prepare(chosen, spec, comm, strict=strict, env=env, options=options,
                                           in_flight=in_flight)
                fingerprint = _fingerprint(chosen, ctx, timeout_s)
        except MoEDispatchError as exc:
            # The peers learn of it in the agreement below (no one waits for a timeout); then raise it here.
            if comm.world_size > 1:
                _agreement().agree(comm, {}, "configuration", failure=exc)
            raise
        comm.bind(_agreement().agree(comm, fingerprint, "configuration") if comm.world_size > 1 else uuid.uuid4().hex)
        begun = comm.started
        try:
            impl = comm.in_call(chosen.create)(ctx)
            if not (callable(getattr(impl, "dispatch", None)) and callable(getattr(impl, "combine", None))):
                raise PluginError(f"backend {chosen.backend.name!r} broke the contract: create() returned this",
                                  parameter="create()", value=type(impl).__name__,
                                  allowed="a BackendDispatcher (an object with dispatch and combine)")
        except PluginError as exc:  # create() returned: its collectives ran
            comm.announce_failure("create", exc)
            raise
        except BaseException as exc:
            comm.abandon("create", exc, begun)
            raise
    made = Dispatcher
    if comm.world_size > 1:  # one thread's call at a time on the group
        from ._shared_group import SharedGroupDispatcher as made  # type: ignore[assignment]
    return made(chosen.backend, ctx.spec, resolution, impl, comm, ctx.buffer_size, check_inputs=check_inputs)


def _timeout_or_default(timeout_s: object) -> float:
    try:
        return check_timeout(timeout_s)
    except InvalidSpecError:
        return DEFAULT_TIMEOUT_S


def _is_group(group: object) -> bool:
    """None, a process group, or what ``dist.new_group`` gives its non-members (``Comm`` says so by name)."""
    return group is None or (dist.is_available() and (isinstance(group, dist.ProcessGroup)
                                                      or group is dist.GroupMember.NON_GROUP_MEMBER))


def _check_arguments(backend: object, spec: object, **given: object) -> None:
    """Typed errors for arguments of the wrong kind, raised inside the agreement so the peers hear of them."""
    check_timeout(given["timeout_s"])
    in_flight = given["in_flight"]
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or not 1 <= in_flight <= _MAX_IN_FLIGHT:
        raise InvalidSpecError("must be the number of dispatches kept in flight at once", parameter="in_flight",
                               value=in_flight, allowed=f"an int in 1..{_MAX_IN_FLIGHT} (2 for two micro-batches)")
    if not isinstance(backend, (str, Backend)):
        raise InvalidSpecError("must name a backend or be one", parameter="backend", value=backend,
                               allowed="a registered backend's name (moe-dispatch backends) or a Backend instance")
    if not isinstance(spec, DispatchSpec):
        raise InvalidSpecError("must be a moe_dispatch.DispatchSpec", parameter="spec", value=spec,
                               allowed="DispatchSpec(hidden_size, num_experts, top_k, ...)")
    for name, kinds, allowed in (("strict", (bool,), "True or False"),
                                 ("check_inputs", (bool, type(None)), "None, True or False"),
                                 ("host", (PluginHost, type(None)), "None or a moe_dispatch.PluginHost"),
                                 ("env", (Mapping, type(None)), "None or a dict (e.g. os.environ)"),
                                 ("options", (Mapping, type(None)), "None or a dict of the backend's options")):
        if not isinstance(given[name], kinds):
            raise InvalidSpecError(f"is a {type(given[name]).__name__}, which this argument cannot be", parameter=name,
                                   value=given[name], allowed=allowed)


def _prepare(chosen: Selection, spec: DispatchSpec, comm: Comm, *, strict: bool, env: Mapping[str, str] | None,
             options: Mapping[str, Any] | None, in_flight: int = 2) -> tuple[DispatchContext, Resolution]:
    """Everything local (``prepare_layer``), then the context the backend creates from."""
    device = comm.device or torch.device("cpu")
    layer = prepare_layer(chosen.backend, spec, comm.world_size, runners=chosen.runners, env=env, strict=strict,
                          device=device)
    ctx = DispatchContext(spec=layer.spec, resolution=layer.resolution, comm=comm,
                          codec=make_codec(layer.spec.wire_format(), layer.spec.quant.input_global_scale),
                          buffer_size=layer.buffer_size, device=device,
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
