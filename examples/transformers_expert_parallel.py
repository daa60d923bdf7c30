"""Serve a tiny transformers MoE model with expert parallelism, and check it against the model on one process.

    torchrun --nproc-per-node 4 examples/transformers_expert_parallel.py [--family qwen3_moe] [--dtype fp8]
    python examples/transformers_expert_parallel.py --local 4          # the same on local ranks, no torchrun

Needs ``pip install "moe-dispatch[transformers]"``. Every rank builds the same randomly initialised model (a seed;
from_pretrained works the same), keeps its slice of each MoE layer's experts (``expert_parallel``), and runs its own
batch; it prints the agreement of its logits with the unmodified model's on the same batch.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


def tiny_config(family: str):  # type: ignore[no-untyped-def]
    import transformers

    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_key_value_heads=2,
                                           head_dim=32, num_experts=8, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=64, num_key_value_heads=2, num_local_experts=8, **common)
    return transformers.DeepseekV3Config(intermediate_size=256, moe_intermediate_size=64, first_k_dense_replace=1,
                                         n_routed_experts=8, n_group=1, topk_group=1, n_shared_experts=1,
                                         num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                                         qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, **common)


def serve(rank: int, world: int, family: str, dtype: str, mode: str) -> str:
    import transformers

    import moe_dispatch_transformers as mdt
    from moe_dispatch_testing.accuracy import relative_error

    torch.manual_seed(0)  # the same model on every rank
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    prompt = torch.randint(0, 128, (1, 8 + rank), generator=torch.Generator().manual_seed(rank))  # this rank's batch
    with torch.no_grad():
        alone = model(prompt).logits  # before: the whole model on this process
        quant = mdt.calibrate_nvfp4(model, [{"input_ids": prompt}]) if dtype == "nvfp4" else None
        layers = mdt.expert_parallel(model, "torch", num_max_dispatch_tokens_per_rank=32, mode=mode,
                                     output_dtype=dtype, quant=quant)
        logits = model(prompt).logits
    same_argmax = (logits.argmax(-1) == alone.argmax(-1)).float().mean().item()
    return (f"rank {rank}/{world}: {family}, {len(layers)} MoE layers expert-parallel ({layers[0].weights.num_experts}"
            f" of 8 experts each here), {dtype} {mode}: logits rel err {relative_error(logits, alone):.2e}, "
            f"argmax agreement {same_argmax:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe", choices=FAMILIES)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp8", "int8", "nvfp4"])
    parser.add_argument("--mode", default="normal", choices=["normal", "low_latency"])
    parser.add_argument("--local", type=int, default=None, metavar="N", help="run on N local ranks instead of torchrun")
    args = parser.parse_args()
    if args.local:
        from moe_dispatch_testing.local import run_local

        for line in run_local(serve, args.local, args.family, args.dtype, args.mode):
            print(line)
        return
    dist.init_process_group("gloo")  # torchrun's env:// (use "nccl" and a device per rank on GPUs)
    try:
        print(serve(dist.get_rank(), dist.get_world_size(), args.family, args.dtype, args.mode), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
