"""What the plugin's tests share: the specs of the window and chip tests, the adapter on an Atlas A2 or A3 fake
chip, a dispatcher on a fake and a batch for it (``H``-wide rows) with its identity-experts answer, and the
dispatcher and inputs of the tests that run a layer on a pool of ranks with a timeout (``TOKENS`` tokens,
``TOP_K``, ``PER_RANK`` experts per rank)."""

from __future__ import annotations

import warnings
from typing import Mapping

import torch

import moe_dispatch as md
from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_testing import random_routing

from . import FAKE, ascend_backend

H = 1024
MiB = 1 << 20
#: The variables of A2's layered (two-node) low-latency kernels.
LAYERED = {v.INTRA_PCIE_ENV: "1", v.INTRA_ROCE_ENV: "0"}
A2 = 220  # torch_npu.npu.get_soc_version() of an Ascend910B1 (Atlas A2)
TOKENS, TOP_K, PER_RANK = 8, 2, 4


def make_spec(mode: str = "normal", tokens: int = 64, experts: int = 128, top_k: int = 8, hidden: int = 7168,
              dtype: str | None = None) -> md.DispatchSpec:
    """A layer (by default DeepSeek's: H 7168, 128 experts, top-k 8, 64 tokens per rank)."""
    return md.DispatchSpec(hidden, experts, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode,
                           output_dtype=dtype)


def normal_spec(tokens: int = 8, top_k: int = 2, mode: str = "normal") -> md.DispatchSpec:
    """A layer of 16 experts, ``H``-wide rows."""
    return md.DispatchSpec(H, 16, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode)


def on_a2(env: Mapping[str, str] | None = None, module: str = FAKE) -> AscendDeepEPBackend:
    """The adapter on ``module`` on an Atlas A2 chip (``env`` by default: ``LAYERED``)."""
    return ascend_backend(module, env={**LAYERED} if env is None else env, soc="A2")


def on_a3(env: Mapping[str, str]) -> AscendDeepEPBackend:
    """The adapter on the fake on an Atlas A3 chip."""
    return ascend_backend(FAKE, env=env, soc="A3")


def dispatcher(vendor: str, dtype: str | None, mode: str = "normal", tokens: int = 8, experts: int = 4,
               top_k: int = 2, env: Mapping[str, str] | None = None) -> md.Dispatcher:
    """A dispatcher on ``vendor`` (a dtype falling back is no warning here)."""
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=tokens, mode=mode, output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(ascend_backend(vendor, env=env), spec, env={})


def batch(seed: int, tokens: int = 8, experts: int = 4, drop: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` rows (seeded), each to 2 distinct experts of ``experts`` (``drop``: token 0's second id is -1), and
    their weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, 2, dtype=torch.int64)
    if drop:
        ids[0, 1] = -1
    return x, ids, torch.rand(tokens, 2, generator=g)


def identity_reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What combine returns with identity experts: each row times the sum of its valid copies' weights."""
    return x.float() * torch.where(ids >= 0, w, 0.0).sum(1, keepdim=True)


def timed_dispatcher(vendor: str, world: int, mode: str, dtype: str, timeout_s: float = 300.0) -> md.Dispatcher:
    """A dispatcher of ``PER_RANK`` experts per rank, ``TOP_K``, ``TOKENS`` tokens, waiting ``timeout_s``."""
    spec = md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, mode=mode,
                           output_dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", md.DtypeFallbackWarning)
        return md.create_dispatcher(ascend_backend(vendor), spec, env={}, timeout_s=timeout_s)


def routed_inputs(rank: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``TOKENS`` rows, a routing with dropped ids, its weights, and another routing (seeded by rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g, drop_prob=0.1)
    other_ids, _ = random_routing(TOKENS, num_experts, TOP_K, generator=g)
    return x, ids, w, other_ids


__all__ = ["A2", "H", "LAYERED", "MiB", "PER_RANK", "TOKENS", "TOP_K", "on_a2", "on_a3", "batch",
           "dispatcher", "identity_reference", "make_spec", "normal_spec", "routed_inputs", "timed_dispatcher"]
