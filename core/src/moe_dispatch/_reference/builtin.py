"""The ``torch`` and ``allgather`` reference backends, registered like any plugin."""

from __future__ import annotations

from .._contract import Backend, BackendDispatcher, BufferSize, Capabilities, DispatchContext, RunnerInfo
from .._hookspecs import API_VERSION, hookimpl
from .._spec import DispatchSpec
from .._wire import DispatchDtype, Mode
from .exchange import ReferenceDispatcher

MOE_DISPATCH_API = API_VERSION

_ALL = frozenset(DispatchDtype)
_CAPABILITIES = Capabilities(
    dtypes={Mode.NORMAL: _ALL, Mode.LOW_LATENCY: _ALL},
    default_dtype=None,  # → the library default, FP8
    cuda_graph_modes=frozenset({Mode.LOW_LATENCY}),
    split_phase=frozenset({Mode.NORMAL, Mode.LOW_LATENCY}),  # async collectives (exchange.py)
    masked_modes=frozenset({Mode.LOW_LATENCY}),  # the all-gathered capacity slots, as they are (exchange.py)
    token_major_modes=frozenset({Mode.NORMAL}),  # the received rows before they are expanded (exchange.py)
    devices=frozenset({"cpu", "cuda", "npu"}),
    fp8_ue8m0=True,
)


class _ReferenceBackend(Backend):
    capabilities = _CAPABILITIES
    send_to_all_ranks = False

    def buffer_size(self, spec: DispatchSpec, world_size: int) -> BufferSize:
        """Send plus receive staging at the worst routing for ``num_max_dispatch_tokens_per_rank``."""
        t, k, h = spec.num_max_dispatch_tokens_per_rank, spec.top_k, spec.hidden_size
        row = spec.wire_format().bytes_per_token + 8 * k
        back = 2 * h
        if spec.mode is Mode.LOW_LATENCY:
            slots = t * world_size  # fixed: every rank gathers every rank's capacity
            return BufferSize(dispatch_bytes=t * row + slots * row, combine_bytes=2 * slots * back,
                              notes=("fixed all-gather of capacity slots; combine returns one BF16 row per slot",))
        fanout = world_size if self.send_to_all_ranks else min(k, world_size)
        sent, received = t * fanout, t * world_size
        return BufferSize(dispatch_bytes=(sent + received) * row, combine_bytes=(sent + received) * back,
                          notes=(f"a token goes to at most {fanout} ranks; a rank receives at most T from each",))

    def create(self, ctx: DispatchContext) -> BackendDispatcher:
        return ReferenceDispatcher(ctx, send_to_all_ranks=self.send_to_all_ranks)


class TorchBackend(_ReferenceBackend):
    name = "torch"
    description = "all-to-all on torch.distributed (gloo, NCCL, HCCL); each token crosses once per destination rank"


class AllGatherBackend(_ReferenceBackend):
    name = "allgather"
    description = "all-gather every token to every rank, reduce-scatter the results; the baseline engines fall back to"
    send_to_all_ranks = True


@hookimpl
def moe_dispatch_register_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(TorchBackend())
    register(AllGatherBackend())


@hookimpl
def moe_dispatch_register_runners(register) -> None:  # type: ignore[no-untyped-def]
    register(RunnerInfo("torch", None, "the torch reference experts dequantize any wire dtype"))
