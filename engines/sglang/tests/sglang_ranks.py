"""What each rank of the sglang tests runs, in a process of its own (sglang's state is per process): sglang's own start-up
(its plugin loader, server arguments, MoE config, distributed groups on gloo at --tp 2 --ep 2), then its DeepEPMoE."""

from __future__ import annotations

import os
import traceback
import types
from pathlib import Path
from typing import Any

import torch

H, I, E, K = 128, 64, 8, 2
MODEL = Path(__file__).parent / "model"  # a config.json only: ServerArgs reads the architecture from it


def start(rank: int, port: int, env: dict[str, str], **server_args: Any) -> None:
    """sglang's start-up on this rank, in the order its scheduler takes it."""
    os.environ.update(env)
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
    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=0, backend="gloo", moe_a2a_backend="deepep")
    initialize_model_parallel()


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """All E experts' w13 [E, 2I, H] and w2 [E, H, I], the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return ((torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16),
            (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16))


def experts(layer: Any) -> Any:
    """STAND-IN for sglang's GPU runner on the DeepEP LL format (deep_gemm's masked grouped GEMMs): each local expert's
    SiLU-gated MLP on its first masked_m rows, dequantized from the wire dtype, unweighted."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput
    from sglang.srt.utils.common import dispose_tensor

    def run_moe_core(out: Any) -> Any:
        rows = out.hidden_states.float()
        if out.hidden_states_scale is not None:  # FP8: one fp32 scale per 128 columns
            rows = (rows.unflatten(-1, (-1, 128)) * out.hidden_states_scale.unsqueeze(-1)).flatten(-2)
        y = torch.zeros(*rows.shape[:2], H)
        for e in range(rows.shape[0]):
            n = int(out.masked_m[e])
            gate, up = (rows[e, :n] @ layer.w13_weight[e].float().T).chunk(2, -1)
            y[e, :n] = (torch.nn.functional.silu(gate) * up) @ layer.w2_weight[e].float().T
        dispose_tensor(out.hidden_states)  # as the real runner does after its first GEMM (moe_runner/deep_gemm.py:800)
        return DeepEPLLCombineInput(y.to(torch.bfloat16), out.topk_ids, out.topk_weights)
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
        y, reference = x, x
        for layer in layers:
            y = layer.forward(y, topk) if micro_batches == 1 else _two_batches(layer, y, topk)
            reference = moe_forward_native(types.SimpleNamespace(num_experts=E, w13_weight=w13, w2_weight=w2),
                                           reference, topk, layer.moe_runner_config)
        inners = [inner for layer in layers for inner in layer.dispatcher._inners]
        inner = inners[0]
        torch.save({"error": ((y.float() - reference.float()).norm() / reference.float().norm()).item(),
                    "inners": [type(i).__name__ for i in layers[0].dispatcher._inners],
                    "dispatchers": len({id(i.dispatcher) for i in inners}),
                    "wire": str(inner.dispatcher.output_dtype), "resolution": str(inner.dispatcher.resolution)},
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
