"""``create_dispatcher`` and the ``Dispatcher`` engines call on the hot path."""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from .backend import Backend, BackendDispatcher, BufferSize, DispatchContext
from .codecs import make_codec
from .distributed.comm import Comm, Traffic
from .dtypes import DispatchDtype
from .errors import BackendUnavailableError, CapacityError, InvalidSpecError
from .output import DispatchOutput
from .plugins import PluginHost, default_host
from .resolution import Resolution, resolve_output_dtype
from .spec import DispatchSpec
from .validation import check_combine_inputs, check_dispatch_inputs


class Dispatcher:
    """One layer's dispatch and combine on one group. Keeps nothing of a call: several
    dispatches may be in flight, each combined with its own ``DispatchOutput``."""

    def __init__(
        self,
        backend: Backend,
        spec: DispatchSpec,
        resolution: Resolution,
        impl: BackendDispatcher,
        comm: Comm,
        buffer_size: BufferSize,
        *,
        check_inputs: bool = True,
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.resolution = resolution
        self.buffer_size = buffer_size
        self.check_inputs = check_inputs
        self._impl = impl
        self._comm = comm
        self._device = _group_device(comm)

    @property
    def output_dtype(self) -> DispatchDtype:
        return self.resolution.dtype

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank has sent through this dispatcher so far, by category."""
        return self._comm.traffic

    @property
    def backend_dispatcher(self) -> BackendDispatcher:
        """The backend's own object, for callers that skip the core's checks."""
        return self._impl

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        """Quantize to the wire dtype and send each token to the ranks of its experts.

        :param hidden_states: bf16 ``[T, H]`` with T <= ``num_max_dispatch_tokens_per_rank``.
        :param topk_ids: int32/int64 ``[T, top_k]`` global expert ids, -1 for none.
        :param topk_weights: fp32 ``[T, top_k]``.
        """
        check_dispatch_inputs(
            self.spec, self._device, hidden_states, topk_ids, topk_weights, check_values=self.check_inputs
        )
        return self._impl.dispatch(hidden_states, topk_ids, topk_weights)

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        """Send the unweighted expert rows back, apply the top-k weights, sum: bf16 ``[T, H]``."""
        check_combine_inputs(self.spec, self._impl, expert_output, dispatch_output)
        return self._impl.combine(expert_output, dispatch_output)

    def __repr__(self) -> str:
        return (
            f"<Dispatcher {self.backend.name} {self.spec.mode.value} {self.output_dtype.value} "
            f"rank {self.rank}/{self.world_size}>"
        )


def _group_device(comm: Comm) -> torch.device | None:
    name = comm.backend_name
    if name in ("local", "gloo"):
        return torch.device("cpu")
    if name == "nccl":
        return torch.device("cuda")
    if name == "hccl":
        return torch.device("npu")
    return None


def create_dispatcher(
    backend: str | Backend,
    spec: DispatchSpec,
    group: "dist.ProcessGroup | None" = None,
    *,
    strict: bool = False,
    env: Mapping[str, str] | None = None,
    check_inputs: bool = True,
    host: PluginHost | None = None,
    options: Mapping[str, Any] | None = None,
) -> Dispatcher:
    """Resolve the wire dtype, check the spec against the backend, plan the buffers and
    build the dispatcher: everything that can fail does so here, before the first forward.

    Works in one process (no torch.distributed: world size 1), under ``torchrun`` after
    ``dist.init_process_group()`` (``group=None`` is the default group), and on any group.

    :param strict: a dtype fallback raises instead of warning.
    :param env: environment for the resolution (``os.environ`` when None); never written.
    :param check_inputs: run the value checks (ids in range, finite values) on every call.
    """
    host = host or default_host()
    backend_obj = host.get_backend(backend) if isinstance(backend, str) else backend
    reason = host.probe(backend_obj)
    if reason is not None:
        hint = f"; {backend_obj.install_hint}" if backend_obj.install_hint else ""
        raise BackendUnavailableError(
            f"cannot run here: {reason}{hint}", parameter="backend", value=backend_obj.name
        )
    comm = Comm(group)
    backend_obj.check_spec(spec, comm.world_size)
    resolution = resolve_output_dtype(spec, backend_obj, env=env, strict=strict, runners=host.runners())
    resolved = spec.with_dtype(resolution.dtype)
    if resolved.wire_format().ue8m0 and not backend_obj.capabilities.fp8_ue8m0:
        raise InvalidSpecError(
            f"backend {backend_obj.name!r} cannot send FP8 with UE8M0 (power-of-two) scales",
            parameter="quant.fp8_ue8m0_scales",
            value=True,
            allowed="False for this backend",
        )
    codec = make_codec(resolved.wire_format(), resolved.quant.input_global_scale)
    buffers = backend_obj.buffer_size(resolved, comm.world_size)
    limit = backend_obj.capabilities.limits_for(resolved.mode).max_buffer_bytes
    if limit is not None and max(buffers.dispatch_bytes, buffers.combine_bytes) > limit:
        raise CapacityError(
            f"backend {backend_obj.name!r} needs {max(buffers.dispatch_bytes, buffers.combine_bytes):,} buffer bytes, "
            f"more than its limit of {limit:,}; lower --num-max-dispatch-tokens-per-rank",
            parameter="num_max_dispatch_tokens_per_rank",
            value=resolved.num_max_dispatch_tokens_per_rank,
        )
    ctx = DispatchContext(
        spec=resolved,
        resolution=resolution,
        comm=comm,
        codec=codec,
        buffer_size=buffers,
        device=_group_device(comm) or torch.device("cpu"),
        options=dict(options or {}),
    )
    impl = backend_obj.create(ctx)
    return Dispatcher(backend_obj, resolved, resolution, impl, comm, buffers, check_inputs=check_inputs)


__all__ = ["Dispatcher", "create_dispatcher"]
