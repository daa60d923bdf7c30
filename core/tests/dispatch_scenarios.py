"""Functions the multi-rank tests run on every local rank (importable by name)."""

from __future__ import annotations

import os

import torch

import moe_dispatch as md
from moe_dispatch.backend import make_codec, nvfp4_global_scale
from moe_dispatch_testing.routing import random_routing
from moe_dispatch_testing import IdentityExperts


def global_inputs(p: dict, world: int):
    g = torch.Generator().manual_seed(p["seed"])
    counts = p["tokens"]
    total = sum(counts)
    x = (torch.randn(total, p["hidden"], generator=g) * p.get("scale", 1.0)).to(torch.bfloat16)
    ids, w = random_routing(total, p["experts"], p["top_k"], generator=g, drop_prob=p.get("drop", 0.0),
                            skew=p.get("skew", 0.0))
    starts = [sum(counts[:r]) for r in range(world)]
    return x, ids, w, starts


def sequential_reference(x, ids, w, world, experts, codec):
    """The documented combine order, token by token: per rank, local experts in ascending
    order summed in fp32 and rounded to bf16; then ranks in ascending order in fp32."""
    local = experts // world
    y = codec.dequantize(codec.quantize(x)).to(torch.bfloat16).float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        total = torch.zeros(x.shape[1], dtype=torch.float32)
        for r in range(world):
            chosen = sorted((int(e), j) for j, e in enumerate(ids[t].tolist()) if e >= 0 and e // local == r)
            if not chosen:
                continue
            partial = torch.zeros(x.shape[1], dtype=torch.float32)
            for _, j in chosen:
                partial = partial + y[t] * w[t, j]
            total = total + partial.to(torch.bfloat16).float()
        out[t] = total
    return out.to(torch.bfloat16)


def spec_for(p: dict, x: torch.Tensor) -> md.DispatchSpec:
    dtype = md.DispatchDtype(p["dtype"])
    quant = md.QuantHints(input_global_scale=nvfp4_global_scale(x.float().abs().max().item() if x.numel() else 1.0)) \
        if dtype is md.DispatchDtype.NVFP4 else md.QuantHints()
    return md.DispatchSpec(
        p["hidden"], p["experts"], p["top_k"], num_max_dispatch_tokens_per_rank=max(1, max(p["tokens"])),
        mode=p["mode"], output_dtype=dtype, quant=quant, group_list_type=p.get("group_list_type", 1),
    )


def conservation(rank: int, world: int, p: dict) -> dict:
    x, ids, w, starts = global_inputs(p, world)
    spec = spec_for(p, x)
    d = md.create_dispatcher(p.get("backend", "torch"), spec, env={})
    d.backend_dispatcher.host_paths = not p.get("static", False)  # static: the accelerator's low-latency path
    mine = slice(starts[rank], starts[rank] + p["tokens"][rank])
    out = d.dispatch(x[mine], ids[mine], w[mine])
    if out.layout is md.Layout.PACKED:
        assert int(out.expert_counts().sum()) == out.hidden_states.shape[0]
    rows = IdentityExperts().apply_without_routing_weights(
        p["hidden"], out.hidden_states, out.hidden_states_scale, out.group_list_type, out.group_list, torch.bfloat16,
        global_scale=out.global_scale)
    result = d.combine(rows, out)
    codec = make_codec(spec.wire_format(), spec.quant.input_global_scale)
    ref = sequential_reference(x[mine], ids[mine], w[mine], world, p["experts"], codec)
    local = p["experts"] // world
    dests = [len({int(e) // local for e in row if e >= 0}) for row in ids[mine].tolist()]
    return {
        "bit_equal": torch.equal(result, ref),
        "max_diff": (result.float() - ref.float()).abs().max().item() if ref.numel() else 0.0,
        "payload": d.traffic.payload_bytes,
        "metadata": d.traffic.metadata_bytes,
        "check": d.traffic.check_bytes,
        "combine": d.traffic.combine_bytes,
        "wire": spec.wire_format().bytes_per_token,
        "pairs": sum(dests),
        "tokens": p["tokens"][rank],
        "capacity": spec.num_max_dispatch_tokens_per_rank,
        "result": result,
    }


def interleaved(rank: int, world: int, p: dict) -> bool:
    """Two dispatchers (FP8 and BF16, different modes) with dispatches in flight at once."""
    env_before = dict(os.environ)
    x, ids, w, starts = global_inputs(p, world)
    mine = slice(starts[rank], starts[rank] + p["tokens"][rank])
    a = md.create_dispatcher("torch", spec_for({**p, "dtype": "fp8", "mode": "normal"}, x), env={})
    b = md.create_dispatcher("allgather", spec_for({**p, "dtype": "bf16", "mode": "low_latency"}, x), env={})
    experts = IdentityExperts()

    def run(d, out):
        rows = experts.apply_without_routing_weights(p["hidden"], out.hidden_states, out.hidden_states_scale,
                                                     out.group_list_type, out.group_list, torch.bfloat16)
        return d.combine(rows, out)

    alone_a = run(a, a.dispatch(x[mine], ids[mine], w[mine]))
    alone_b = run(b, b.dispatch(x[mine], ids[mine], w[mine]))
    out_a = a.dispatch(x[mine], ids[mine], w[mine])
    out_b = b.dispatch(x[mine], ids[mine], w[mine])
    got_b = run(b, out_b)
    got_a = run(a, out_a)
    return torch.equal(got_a, alone_a) and torch.equal(got_b, alone_b) and dict(os.environ) == env_before
