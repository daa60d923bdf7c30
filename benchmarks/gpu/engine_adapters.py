"""The engine adapters through their engines' real GPU expert paths at one rank (shared/GPU.md, item 7): what
settles the scale layout, UE8M0 and the row alignment on hardware, which the CPU tests stand in for.

    python benchmarks/gpu/engine_adapters.py [sglang] [vllm]        # one CUDA device; engines installed

Rows, each against the same layer in fp32 torch (relative L2 error) or with the exception it raised:

- sglang 0.5.x: ``MoEDispatchDeepEPDispatcher`` (the ``torch`` backend on a one-rank NCCL group) in low-latency and
  normal mode, BF16 and FP8, its output through sglang's own ``MoeRunner`` with the DeepGEMM runner (the masked
  grouped GEMM; ep_scatter, the contiguous GEMM and ep_gather), then its combine. FP8 experts: 128x128 blocks.
- vLLM 0.33: ``MoEDispatchPrepareAndFinalize`` in both formats under vLLM's ``FusedMoEKernel`` with its GPU experts
  (``BatchedTritonExperts``; ``TritonExperts`` with the layer's ``expert_map``), BF16.

An engine that is not installed is a SKIP row; a start-up that fails is a FAIL row with its message (the next person
with a GPU reads it in docs/hardware-runs.md).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

H, I, E, K, T = 2048, 512, 8, 2, 48  # DeepGEMM's blocks: H and 2I multiples of 128
MODEL = Path(__file__).resolve().parents[2] / "engines" / "sglang" / "tests" / "model"


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The layer in fp32: each token's weighted sum of its experts' SiLU-gated MLPs."""
    out = torch.zeros(x.shape[0], H, device=x.device)
    for n, j in (ids >= 0).nonzero().tolist():
        gate, up = (x[n].float() @ w13[ids[n, j]].float().T).chunk(2, -1)
        out[n] += w[n, j] * ((torch.nn.functional.silu(gate) * up) @ w2[ids[n, j]].float().T)
    return out


def error(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.float() - want).norm() / want.norm()).item()


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` weights as e4m3 with one fp32 scale per 128x128 block ``[E, N/128, K/128]``."""
    blocks = w.float().unflatten(1, (-1, 128)).unflatten(3, (-1, 128))  # [E, N/128, 128, K/128, 128]
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.flatten(3, 4).flatten(1, 2), scale


def inputs(device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K)
    return tuple(t.to(device) for t in (x, ids, w, w13, w2))


def sglang_rows(device: str) -> list[tuple[str, Callable[[], float]]]:
    os.environ.setdefault("MOE_DISPATCH_SGLANG_BACKEND", "torch")
    os.environ.setdefault("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", str(T))
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=str(MODEL), moe_a2a_backend="deepep", moe_runner_backend="deep_gemm"),
            role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29531", local_rank=0,
                                 backend="nccl", moe_a2a_backend="deepep")
    initialize_model_parallel()
    from moe_dispatch_sglang._dispatcher import MoEDispatchDeepEPDispatcher
    from sglang.srt.distributed import get_moe_ep_group
    from sglang.srt.layers.moe.moe_runner import MoeRunner, MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.deep_gemm import DeepGemmMoeQuantInfo
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import DeepEPMode, MoeRunnerBackend

    x, ids, w, w13, w2 = inputs(device)
    want = reference(x, ids, w, w13, w2)

    def row(mode: str, dtype: str) -> float:
        fp8 = dtype == "fp8"
        d = MoEDispatchDeepEPDispatcher(get_moe_ep_group().device_group, K, num_experts=E, num_local_experts=E,
                                        hidden_size=H, params_dtype=torch.bfloat16, deepep_mode=DeepEPMode(mode))
        d.set_quant_config({"dispatcher_output_dtype": dtype})
        (q13, s13), (q2, s2) = (block_fp8(w13), block_fp8(w2)) if fp8 else ((w13, None), (w2, None))
        info = DeepGemmMoeQuantInfo(w13_weight=q13, w2_weight=q2, use_fp8=fp8, w13_scale=s13, w2_scale=s2,
                                    block_shape=[128, 128] if fp8 else None)
        runner = MoeRunner(MoeRunnerBackend.DEEP_GEMM, MoeRunnerConfig(
            num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I, top_k=K,
            params_dtype=torch.bfloat16))
        out = d.dispatch(x, StandardTopKOutput(w, ids.to(torch.int32), None))
        return error(d.combine(runner.run(out, info)), want)
    return [(f"sglang {m} {t}", lambda m=m, t=t: row(m, t)) for m in ("low_latency", "normal") for t in ("bf16", "fp8")]


def vllm_rows(device: str) -> list[tuple[str, Callable[[], float]]]:
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from moe_dispatch_vllm import MoEDispatchPrepareAndFinalize
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device(device), num_ubatches=1)
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=1, tp_rank=0, pcp_rank=0, dp_rank=0,
                                      ep_rank=0, sp_size=1, use_ep=False, all2all_backend="naive", enable_eplb=False)
    config = FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=H, intermediate_size=I,
                            num_local_experts=E, num_logical_experts=E, activation=MoEActivation.SILU, device=device,
                            routing_method=list(RoutingMethodType)[0], moe_parallel_config=parallel,
                            in_dtype=torch.bfloat16, max_num_tokens=T)
    quant = FUSED_MOE_UNQUANTIZED_CONFIG
    x, ids, w, w13, w2 = inputs(device)
    want = reference(x, ids, w, w13, w2)

    def row(mode: str) -> float:
        pf = MoEDispatchPrepareAndFinalize.for_layer("torch", config, quant, mode=mode, env={})
        experts = (TritonExperts(config, quant) if mode == "normal" else
                   BatchedTritonExperts(config, quant, pf.max_num_tokens_per_rank(), pf.num_dispatchers()))
        expert_map = torch.arange(E, dtype=torch.int32, device=device) if mode == "normal" else None
        y = mk.FusedMoEKernel(pf, experts).apply(x, w13, w2, w, ids, MoEActivation.SILU, E, expert_map, False)
        return error(y, want)
    return [(f"vllm {m}", lambda m=m: row(m)) for m in ("low_latency", "normal")]


def main(argv: list[str]) -> int:
    device = "cuda"
    engines = {"sglang": sglang_rows, "vllm": vllm_rows}
    chosen = argv or list(engines)
    tempfile.tempdir = tempfile.mkdtemp()  # the engines' caches, off the project
    failed = 0
    for name in chosen:
        if importlib.util.find_spec(name) is None:
            print(f"SKIP {name}: not installed")
            continue
        try:
            rows = engines[name](device)
        except Exception:  # noqa: BLE001 - the start-up's failure is the row
            print(f"FAIL {name} start-up\n{traceback.format_exc()}")
            failed += 1
            continue
        for label, run in rows:
            try:
                err, allowed = run(), 0.08 if "fp8" in label else 0.02  # e4m3's rounding; bf16's
                failed += err > allowed
                print(f"{'PASS' if err <= allowed else 'FAIL'} {label}: relative error {err:.3e} (allowed {allowed})",
                      flush=True)
            except Exception:  # noqa: BLE001 - each row on its own
                print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
