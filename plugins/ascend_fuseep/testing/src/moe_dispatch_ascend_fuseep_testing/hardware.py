"""FuseEP's part of ``plugins/ascend_deepep/scripts/hardware_check.py``: ``fused_deep_moe`` through
the adapter on the real DeepEP-Ascend against the same adapter on the CPU fake, both fuse modes,
and the opt-in probe of fuse mode 2's row bound (what the op does with sglang's ``T``)."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.backend import quantize_weights_w8a8, restored_environ
from moe_dispatch_ascend_deepep.backend import CONSTRUCTION_ENV
from moe_dispatch_ascend_deepep_testing.hardware import Options, Row, _guard, _probe
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep.weights import process_fuseep_weights
from moe_dispatch_testing import random_expert_weights, reference_moe, relative_error

from . import FAKE, fuseep_backend


def _to(weights: md.ExpertWeights, device: torch.device) -> md.ExpertWeights:
    moved = {f.name: getattr(weights, f.name).to(device) for f in dataclasses.fields(weights)
             if isinstance(getattr(weights, f.name), torch.Tensor)}
    return dataclasses.replace(weights, **moved)


def _module(opts: Options) -> str:
    return FAKE if opts.fake else v.REAL


def _forward(rank: int, world: int, opts: Options, backend_module: str, group: Any, fuse_mode: int,
             device: torch.device, all_to_rank_0: bool) -> torch.Tensor:
    local, k, T = opts.experts_per_rank, min(opts.top_k, v.MAX_TOP_K), min(opts.tokens, v.MAX_BATCH)
    E = local * world
    spec = md.DispatchSpec(opts.hidden, E, k, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    d = md.create_dispatcher(fuseep_backend(backend_module), spec, group, env={}, options={"fuse_mode": fuse_mode})
    g = torch.Generator().manual_seed(0)
    weights = quantize_weights_w8a8(random_expert_weights(E, opts.hidden, opts.intermediate, generator=g))
    layer = d.process_weights(_to(weights.slice(rank * local, local), device))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, opts.hidden, generator=g).to(torch.bfloat16)
    ids = (torch.arange(k).repeat(T, 1) if all_to_rank_0 else
           torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]))
    w = torch.rand(T, k, generator=g)
    return d.forward(None, layer, x.to(device), ids.to(device), w.to(device)).float().cpu()


def fuseep_rows(rank: int, world: int, opts: Options, group: Any, reference: Any) -> list[Row]:
    rows: list[Row] = []
    if not hasattr(importlib.import_module(_module(opts)).Buffer, "fused_deep_moe"):
        return [Row("fuseep", "fused_deep_moe", None, "this DeepEP-Ascend has none")]
    reason = fuseep_backend(_module(opts)).probe()
    if reason is not None:  # e.g. an Atlas A2: no fused ops in its build
        return [Row("fuseep", "fused_deep_moe", None, f"not run: {reason}")]
    for fuse_mode in (v.FUSED_DEEP_MOE, v.DISPATCH_FFN_COMBINE):
        for concentrated in (False, True):
            name = f"fuse mode {fuse_mode}{' (every token to rank 0)' if concentrated else ''}: = fake"

            def check(fuse_mode: int = fuse_mode, concentrated: bool = concentrated, name: str = name) -> list[Row]:
                got = _forward(rank, world, opts, _module(opts), group, fuse_mode, opts.device, concentrated)
                want = _forward(rank, world, opts, FAKE, reference, fuse_mode, torch.device("cpu"), concentrated)
                err = relative_error(got, want)
                return [Row("fuseep", name, err < opts.tolerance["int8"], f"rel err {err:.2e}")]

            rows += _guard("fuseep", name, check)
    if opts.probe_mode2_tokens:
        rows += _probe("fuseep", "probe: mode 2 with num_max_dispatch_tokens_per_rank = T",
                       lambda: _probe_mode2_tokens(rank, world, opts, group, reference))
    if opts.probe_fused_neg_one:
        for fuse_mode in (v.FUSED_DEEP_MOE, v.DISPATCH_FFN_COMBINE):
            name = f"probe: fuse mode {fuse_mode} with raw -1 ids"
            rows += _probe("fuseep", name, lambda m=fuse_mode, n=name: _probe_neg_one(rank, world, opts, group,
                                                                                    reference, m, n))
    return rows


def _probe_neg_one(rank: int, world: int, opts: Options, group: Any, reference: Any, fuse_mode: int, name: str
                   ) -> list[Row]:
    """The vendor's op with raw -1 ids (mode 2: some slots; mode 1: a whole token), against the adapter's
    mapped call on the fake: settles whether the mapping (backend.fill_minus_one) is needed."""
    module = importlib.import_module(_module(opts))
    local, k, T = opts.experts_per_rank, min(opts.top_k, v.MAX_TOP_K), min(opts.tokens, v.MAX_BATCH)
    E = local * world
    with restored_environ(CONSTRUCTION_ENV):
        buffer = module.Buffer(group, low_latency_mode=True)
    weights = quantize_weights_w8a8(random_expert_weights(E, opts.hidden, opts.intermediate,
                                                          generator=torch.Generator().manual_seed(0)))
    nz = None if opts.fake else (lambda t: importlib.import_module(v.TORCH_NPU).npu_format_cast(t, v.ACL_FORMAT_FRACTAL_NZ))
    mine = weights.slice(rank * local, local)
    layer = process_fuseep_weights(_to(mine, opts.device), fuse_mode, nz)
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(T, opts.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if fuse_mode == v.DISPATCH_FFN_COMBINE:
        ids[::2, -1] = -1
    else:
        ids[0] = -1
    w = torch.rand(T, k, generator=g)
    bound = T if fuse_mode == v.FUSED_DEEP_MOE else v.mode2_max_output_rows(T, world, k)
    out, _ = buffer.fused_deep_moe(x.to(opts.device), ids.to(opts.device), w.to(opts.device),
                                   layer.gmm1_permuted_weight, layer.gmm1_permuted_weight_scale, layer.gmm2_weight,
                                   layer.gmm2_weight_scale, bound, E, quant_mode=1, fuse_mode=fuse_mode)
    want = reference_moe(x, ids, w, weights)
    err = relative_error(out.float().cpu(), want)
    return [Row("fuseep", name, None, f"no error; rel err against the dense reference {err:.2e} "
                                      "(the adapter maps -1 to unused experts with weight 0)")]


def _probe_mode2_tokens(rank: int, world: int, opts: Options, group: Any, reference: Any) -> list[Row]:
    """Mode 2 with sglang's bound (T, not the rows received) and every token to rank 0, called on
    the vendor directly. May corrupt device memory if the op trusts the bound: run it last."""
    module = importlib.import_module(_module(opts))
    local, k, T = opts.experts_per_rank, min(opts.top_k, v.MAX_TOP_K), min(opts.tokens, v.MAX_BATCH)
    E = local * world
    with restored_environ(CONSTRUCTION_ENV):
        buffer = module.Buffer(group, low_latency_mode=True)
    g = torch.Generator().manual_seed(0)
    weights = quantize_weights_w8a8(random_expert_weights(E, opts.hidden, opts.intermediate, generator=g))
    nz = None if opts.fake else (lambda t: importlib.import_module(v.TORCH_NPU).npu_format_cast(t, v.ACL_FORMAT_FRACTAL_NZ))
    layer = process_fuseep_weights(_to(weights.slice(rank * local, local), opts.device), 2, nz)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, opts.hidden, generator=g).to(torch.bfloat16).to(opts.device)
    ids = torch.arange(k).repeat(T, 1).to(opts.device)
    w = torch.rand(T, k, generator=g).to(opts.device)
    out, _ = buffer.fused_deep_moe(x, ids, w, layer.gmm1_permuted_weight, layer.gmm1_permuted_weight_scale,
                                   layer.gmm2_weight, layer.gmm2_weight_scale, T, E, quant_mode=1, fuse_mode=2)
    want = _forward(rank, world, opts, FAKE, reference, 2, torch.device("cpu"), True)
    err = relative_error(out.float().cpu(), want)
    return [Row("fuseep", "probe: mode 2 with num_max_dispatch_tokens_per_rank = T", None,
                f"no error; rel err against the fake {err:.2e} (rank 0 received T·R·k rows)")]


__all__ = ["fuseep_rows"]
