"""What each rank of the sglang tests runs, in a process of its own (sglang's state is per process): sglang's own start-up
(its plugin loader, server arguments, MoE config, distributed groups on gloo at --tp 2 --ep 2), then its DeepEPMoE."""

from __future__ import annotations

import os
import traceback
import types
from pathlib import Path
from typing import Any

import torch

H, I, E, K = 2048, 64, 8, 2  # 2048: a hidden size DeepEP's low-latency kernels are built for
MODEL = Path(__file__).parent / "model"  # a config.json only: ServerArgs reads the architecture from it
DEEP_GEMM = "TEST_STAND_IN_DEEP_GEMM"  # set: sglang runs as with DeepGEMM on a GPU (normal mode then sends FP8)
DEEP_EP = "TEST_STAND_IN_DEEP_EP"  # set: DeepEP is its CPU fake (moe-dispatch-cuda-deepep-testing)


def start(rank: int, port: int, env: dict[str, str], **server_args: Any) -> None:
    """sglang's start-up on this rank, in the order its scheduler takes it."""
    os.environ.update(env)
    if env.get(DEEP_EP):  # STAND-IN: DeepEP's CPU fake where the cuda_deepep plugin imports deep_ep
        import sys

        from moe_dispatch_cuda_deepep_testing.fakes import deep_ep
        sys.modules["deep_ep"] = deep_ep
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before the arguments are parsed, as launch_server does
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(MODEL), tp_size=2, ep_size=2, moe_a2a_backend="deepep", device="cpu",
                      **server_args)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    initialize_moe_config()
    if env.get(DEEP_GEMM):
        from sglang.srt.layers import deep_gemm_wrapper

        deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True  # STAND-IN: DeepGEMM's JIT on, as on an SM90 GPU (configurer.py:55)
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo", moe_a2a_backend="deepep")
    initialize_model_parallel()


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """All E experts' w13 [E, 2I, H] and w2 [E, H, I], the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16),
            (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16))


def experts(layer: Any) -> Any:
    """STAND-IN for sglang's GPU runners (deep_gemm's grouped GEMMs): each local expert's SiLU-gated MLP, dequantized
    from the wire dtype. Low latency: on each expert's first masked_m rows, unweighted. Normal: each received row's
    local experts (ids >= 0), weighted and summed, as ep_scatter, the contiguous GEMMs and ep_gather give."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput, DeepEPNormalCombineInput
    from sglang.srt.utils.common import dispose_tensor

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (rows @ layer.w13_weight[e].float().T).chunk(2, -1)
        return (torch.nn.functional.silu(gate) * up) @ layer.w2_weight[e].float().T

    def run_moe_core(out: Any) -> Any:
        rows, scale = out.hidden_states.float(), out.hidden_states_scale
        if scale is not None:  # FP8: one scale per 128 columns (fp32, or four UE8M0 exponents an int32)
            scale = scale.view(torch.uint8).float().sub(127).exp2() if scale.dtype == torch.int32 else scale
            rows = (rows.unflatten(-1, (-1, 128)) * scale[..., : rows.shape[-1] // 128].unsqueeze(-1)).flatten(-2)
        if hasattr(out, "masked_m"):
            y = torch.zeros(*rows.shape[:2], H)
            for e in range(rows.shape[0]):
                y[e, : int(out.masked_m[e])] = mlp(e, rows[e, : int(out.masked_m[e])])
            combine_input = DeepEPLLCombineInput
        else:
            y = torch.zeros(rows.shape[0], H)
            for n, j in (out.topk_ids >= 0).nonzero().tolist():
                y[n] += out.topk_weights[n, j] * mlp(int(out.topk_ids[n, j]), rows[n])
            combine_input = DeepEPNormalCombineInput
        dispose_tensor(out.hidden_states)  # as the real runner does after its first GEMM (moe_runner/deep_gemm.py:800)
        return combine_input(y.to(torch.bfloat16), out.topk_ids, out.topk_weights)
    return run_moe_core


def forward(rank: int, port: int, result: Path, env: dict[str, str], server_args: dict[str, Any],
            micro_batches: int = 1) -> None:
    """Two of sglang's DeepEPMoE layers, built by sglang, on a batch of this rank's (as two micro-batches overlapped
    with ``micro_batches=2``), against ``moe_forward_native`` on the full experts; saves what happened to ``result``."""
    try:
        start(rank, port, env, **server_args)
        from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
        from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        w13, w2 = weights()
        local = slice(rank * E // 2, (rank + 1) * E // 2)
        layers = []
        for layer_id in range(2):  # the same experts in both: the reference applies them twice
            layer = get_moe_impl_class(None)(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                                             layer_id=layer_id, params_dtype=torch.bfloat16)
            layer.w13_weight.data.copy_(w13[local])
            layer.w2_weight.data.copy_(w2[local])
            layer.run_moe_core = experts(layer)
            layers.append(layer)
        g = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(6 + rank, H, generator=g).to(torch.bfloat16)
        logits = torch.randn(x.shape[0], E, generator=g)
        w, ids = logits.softmax(-1).topk(K)
        topk = StandardTopKOutput(w, ids.to(torch.int32), logits)
        from sglang.srt.runtime_context import get_forward

        errors = []
        for extend in [True, False] if server_args.get("deepep_mode") == "auto" else [False]:
            y, reference = x, x
            with get_forward().scoped(is_extend_in_batch=extend):  # a prefill (True) or decode batch; auto picks by it
                for layer in layers:
                    y = layer.forward(y, topk) if micro_batches == 1 else _two_batches(layer, y, topk)
                    reference = moe_forward_native(types.SimpleNamespace(num_experts=E, w13_weight=w13,
                                                                         w2_weight=w2),
                                                   reference, topk, layer.moe_runner_config)
            errors.append(((y.float() - reference.float()).norm() / reference.float().norm()).item())
        inners = [inner for layer in layers for inner in layer.dispatcher._inners]
        used = [d for inner in inners for d in inner._dispatchers.values()]
        torch.save({"error": max(errors),
                    "inners": [type(i).__name__ for i in layers[0].dispatcher._inners],
                    "dispatchers": len({id(d) for d in used}), "modes": sorted({d.spec.mode.value for d in used}),
                    "wire": sorted({str(d.output_dtype) for d in used}), "resolution": str(used[0].resolution)},
                   result / f"{rank}.pt")
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        torch.save({"raised": type(exc).__name__, "message": str(exc), "parameter": getattr(exc, "parameter", None),
                    "traceback": traceback.format_exc()}, result / f"{rank}.pt")


def _two_batches(layer: Any, x: torch.Tensor, topk: Any) -> torch.Tensor:
    """sglang's two-batch-overlap order on one layer: both dispatches started, then each batch's experts and
    combine (``tbo_subbatch_index`` picks the micro-batch's inner dispatcher, as two_batch_overlap.py does)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    d, half = layer.dispatcher, x.shape[0] // 2
    parts = [slice(0, half), slice(half, None)]
    for i, p in enumerate(parts):
        d.dispatch_a(hidden_states=x[p], topk_output=StandardTopKOutput(topk.topk_weights[p], topk.topk_ids[p],
                                                                         topk.router_logits[p]),
                     tbo_subbatch_index=i)
    outs = [d.dispatch_b(tbo_subbatch_index=i) for i in range(2)]
    for i, out in enumerate(outs):
        d.combine_a(combine_input=layer.run_moe_core(out), tbo_subbatch_index=i)
    return torch.cat([d.combine_b(tbo_subbatch_index=i) for i in range(2)])
