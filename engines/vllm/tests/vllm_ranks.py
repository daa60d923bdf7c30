"""What each rank of the vLLM tests runs (vLLM's own FusedMoEKernel and NaiveBatchedExperts on CPU), and the
STAND-INS for the run-time calls vLLM makes on a GPU, installed before vLLM is imported:
``torch.accelerator.empty_cache`` (v1/worker/workspace.py:261), ``torch.accelerator.current_stream`` (for
``is_capturing``, experts/fused_batched_moe.py:45), ``torch.ops._C.silu_and_mul`` (activation.py:356) and
``torch.ops._moe_C.moe_sum`` (_custom_ops.py:2196, the Standard format's top-k sum), the same schemas, in torch; and
``StandardExperts`` for vLLM's GPU experts of the Standard format."""

from __future__ import annotations

import types
from typing import Any

import torch

H, I, E, K, CAPACITY = 2048, 128, 8, 2, 8  # 2048: a hidden size DeepEP's low-latency kernels are built for

torch.accelerator.empty_cache = lambda: None
torch.accelerator.current_stream = lambda *a, **k: types.SimpleNamespace(is_capturing=lambda: False)
_LIB = torch.library.Library("_C", "DEF")
_LIB.define("silu_and_mul(Tensor! result, Tensor input) -> ()")


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    out.copy_(torch.nn.functional.silu(x[..., :half]) * x[..., half:])


_LIB.impl("silu_and_mul", _silu_and_mul, "CompositeExplicitAutograd")
_MOE_LIB = torch.library.Library("_moe_C", "DEF")
_MOE_LIB.define("moe_sum(Tensor input, Tensor! output, Tensor? topk_ids, Tensor? expert_map) -> ()")


def _moe_sum(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor | None, expert_map: torch.Tensor | None) -> None:
    out.copy_(x.sum(1))


_MOE_LIB.impl("moe_sum", _moe_sum, "CompositeExplicitAutograd")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from moe_dispatch_vllm import MoEDispatchPrepareAndFinalize
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    fp8_w8a8_moe_quant_config,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import NaiveBatchedExperts
from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize
from vllm.v1.worker.workspace import init_workspace_manager


def _config(local_experts: int, world_size: int, rank: int) -> FusedMoEConfig:
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world_size, ep_size=world_size, tp_rank=0,
                                      pcp_rank=0, dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=world_size > 1,
                                      all2all_backend="naive", enable_eplb=False)
    return FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=I,
                          num_local_experts=local_experts, num_logical_experts=E, activation=MoEActivation.SILU,
                          device="cpu", routing_method=list(RoutingMethodType)[0], moe_parallel_config=parallel,
                          in_dtype=torch.bfloat16, max_num_tokens=CAPACITY)


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` weights as e4m3 with one fp32 scale per 128x128 block ``[E, N/128, K/128]`` (DeepSeek's)."""
    blocks = w.float().unflatten(1, (-1, 128)).unflatten(3, (-1, 128))
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    return (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).flatten(3, 4).flatten(1, 2), scale


def _dequant(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 of a block-FP8 tensor (scales per 128 columns, and per 128 rows for weights), or of a BF16 one."""
    if scale is None:
        return t.float()
    if t.dim() >= 2:  # weights [..., N, K], scales [..., N/128, K/128]; a row [K], scales [K/128]
        scale = scale.repeat_interleave(128, -2)
    return t.float() * scale.repeat_interleave(128, -1)


class StandardExperts(mk.FusedMoEExpertsModular):
    """STAND-IN for vLLM's GPU experts of the Standard format (TritonExperts, DeepGemmExperts): each (row, k) entry's
    expert, localized by ``expert_map`` (skipped where it gives -1), SiLU-gated, weighted and summed into ``output``
    [M, H] (TopKWeightAndReduceNoOP, triton_moe.py:197, 641-651). ``reduces=False``: unweighted into [M, topk, H],
    the weights and the sum left to finalize (TopKWeightAndReduceDelegate)."""

    activation_format = staticmethod(lambda: mk.FusedMoEActivationFormat.Standard)
    _supports_current_device = _supports_no_act_and_mul = staticmethod(lambda: True)
    _supports_quant_scheme = _supports_activation = _supports_parallel_config = staticmethod(lambda *a: True)
    reduces = True

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, *args: Any) -> tuple:
        return (M, topk, max(N, K)), (M, topk, N // 2), (M, K) if self.reduces else (M, topk, K)

    def finalize_weight_and_reduce_impl(self) -> Any:
        from vllm.model_executor.layers.fused_moe import topk_weight_and_reduce as reduce
        return reduce.TopKWeightAndReduceNoOP() if self.reduces else reduce.TopKWeightAndReduceDelegate()

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, **kwargs: Any) -> None:
        local = topk_ids if expert_map is None else expert_map[topk_ids]
        out = torch.zeros(*output.shape, dtype=torch.float32)
        x, (s1, s2) = hidden_states, (self.quant_config.w1_scale, self.quant_config.w2_scale)
        for n, j in (local >= 0).nonzero().tolist():
            e, a_scale = int(local[n, j]), kwargs["a1q_scale"]
            row = _dequant(x[n], None if a_scale is None else a_scale[n])
            gate, up = (row @ _dequant(w1[e], None if s1 is None else s1[e]).T).chunk(2, -1)
            y = (torch.nn.functional.silu(gate) * up) @ _dequant(w2[e], None if s2 is None else s2[e]).T
            if self.reduces:
                out[n] += topk_weights[n, j] * y
            else:
                out[n, j] = y
        output.copy_(out)


class DelegatingStandardExperts(StandardExperts):
    reduces = False


def forward(rank: int, world_size: int, overlapped: bool, mode: str = "low_latency", backend: str = "torch",
            experts_reduce: bool = True, dtype: str = "bf16") -> dict[str, Any]:
    """This rank's batch through vLLM's FusedMoEKernel on a moe-dispatch ``backend``'s prepare/finalize (experts
    sliced to the rank; ``mode`` normal: the Standard format, the experts reducing themselves or not; ``dtype`` fp8:
    block-FP8 experts), against the same layer, in BF16 on the dequantized weights, on vLLM's own single-process
    BatchedPrepareAndFinalize with every expert."""
    if backend == "cuda_deepep":  # STAND-IN: DeepEP's CPU fake where the cuda_deepep plugin imports deep_ep
        import sys

        from moe_dispatch_cuda_deepep_testing.fakes import deep_ep
        sys.modules["deep_ep"] = deep_ep
    init_workspace_manager(torch.device("cpu"), num_ubatches=2)
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(CAPACITY - rank, H, generator=g).to(torch.bfloat16)
    w, ids = torch.randn(x.shape[0], E, generator=g).softmax(-1).topk(K)
    local = E // world_size
    mine = slice(rank * local, (rank + 1) * local)
    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    if dtype == "fp8":
        (w1, s1), (w2, s2) = block_fp8(w1), block_fp8(w2)
        quant = fp8_w8a8_moe_quant_config(w1_scale=s1[mine], w2_scale=s2[mine], block_shape=[128, 128])
        reference_weights = [_dequant(w, s).to(torch.bfloat16) for w, s in ((w1, s1), (w2, s2))]
    else:
        reference_weights = [w1, w2]
    config = _config(local, world_size, rank)
    pf = MoEDispatchPrepareAndFinalize.for_layer(backend, config, quant, mode=mode, env={})
    standard = StandardExperts if experts_reduce else DelegatingStandardExperts
    experts = (standard(config, quant) if mode == "normal" else
               NaiveBatchedExperts(config, quant, pf.max_num_tokens_per_rank(), pf.num_dispatchers()))
    kernel = mk.FusedMoEKernel(pf, experts)
    shared = MoEDispatchPrepareAndFinalize.for_layer(backend, config, quant, mode=mode,
                                                     env={}).dispatcher is pf.dispatcher  # a second layer's
    expert_map = None  # the batched rows are per local expert already
    if mode == "normal":  # global ids: localized by the map vLLM's FusedMoE layer builds under EP
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(local, dtype=torch.int32)
    layers = 2  # the same layer twice: the hand-over between layers is part of DBO
    if not overlapped:
        y = x
        for _ in range(layers):
            y = kernel.apply(y, w1[mine], w2[mine], w, ids, MoEActivation.SILU, E, expert_map, False)
    else:
        y = _dual_batch_overlap(kernel, x, w1[mine], w2[mine], w, ids, layers, expert_map)
    unquantized = FUSED_MOE_UNQUANTIZED_CONFIG
    oracle = mk.FusedMoEKernel(BatchedPrepareAndFinalize(CAPACITY, E, 1, 0),
                               NaiveBatchedExperts(_config(E, 1, 0), unquantized, CAPACITY, 1))
    reference = x
    for _ in range(layers):
        reference = oracle.apply(reference, *reference_weights, w, ids, MoEActivation.SILU, E, None, False)
    return {"error": ((y.float() - reference.float()).norm() / reference.float().norm()).item(),
            "wire": str(pf.dispatcher.output_dtype), "shared": shared, "format": pf.activation_format.name}


def _dual_batch_overlap(kernel: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w: torch.Tensor,
                        ids: torch.Tensor, layers: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """vLLM's DBO: two micro-batch threads in its own ``UBatchContext``s, each running ``layers`` layers of the kernel,
    handing over at every prepare and finalize (``dbo_yield``, the hooks run by the other thread). STAND-IN:
    ``ubatching.current_stream`` and the contexts' compute and comm streams are one object (CUDA streams)."""
    import threading

    from vllm.v1.worker import ubatching

    stream = object()
    ubatching.current_stream = lambda: stream
    barrier = threading.Barrier(3)
    contexts = ubatching.make_ubatch_contexts(2, stream, stream, [None, None], barrier)
    halves = [slice(0, x.shape[0] // 2), slice(x.shape[0] // 2, x.shape[0])]
    outs: list[Any] = [None, None]

    def micro_batch(i: int) -> None:
        try:
            with contexts[i]:
                h = x[halves[i]]
                for _ in range(layers):
                    h = kernel.apply(h, w1, w2, w[halves[i]], ids[halves[i]], MoEActivation.SILU, E, expert_map,
                                     False)
                outs[i] = h
        except BaseException as exc:  # noqa: BLE001 - raised below, on the rank's thread
            outs[i] = exc
            contexts[i].cpu_signal_event.set()  # let the other micro-batch end
    threads = [threading.Thread(target=micro_batch, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    contexts[0].cpu_wait_event.set()
    for t in threads:
        t.join(60)
    for out in outs:
        if not isinstance(out, torch.Tensor):
            raise RuntimeError(f"a micro-batch did not finish: {out!r}")
    return torch.cat(outs)
