"""What the plugin's tests share: a fake by its module path, this rank's process group, the specs and the batch
of the Buffer tests (``H``-wide rows, low latency or normal mode), one dispatch and combine, a step's outcome as
the tests compare it, and the spec and inputs of the tests that run a layer on a pool of ranks (``TOKENS`` tokens,
``TOP_K``, ``PER_RANK`` experts per rank)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

import moe_dispatch as md
from moe_dispatch_testing.routing import random_routing

from . import EMULATOR

H = 2048
TOKENS, TOP_K, PER_RANK = 8, 3, 4


def fake_module(name: str = EMULATOR) -> Any:
    """The fake module ``name`` (DeepEP's by default)."""
    return importlib.import_module(name)


def world_group() -> Any:
    """This rank's process group (the rank pool's WORLD)."""
    return torch.distributed.group.WORLD


def ll_spec(world: int, tokens: int = 8, experts_per_rank: int = 4) -> md.DispatchSpec:
    """A BF16 low-latency layer of ``experts_per_rank`` experts per rank, top-k 2."""
    return md.DispatchSpec(H, experts_per_rank * world, 2, num_max_dispatch_tokens_per_rank=tokens, mode="low_latency",
                           output_dtype="bf16")


def normal_spec(world: int) -> md.DispatchSpec:
    """A BF16 normal-mode layer of 4 experts per rank, top-k 2."""
    return md.DispatchSpec(H, 4 * world, 2, output_dtype="bf16")


def batch(d: md.Dispatcher, n: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` tokens (seeded) to the first and the last expert of ``d``, weights 1."""
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return x, torch.tensor([[0, d.spec.num_experts - 1]] * n), torch.ones(n, 2)


def dispatch_and_combine(d: md.Dispatcher, copy: bool = False) -> torch.Tensor:
    """One dispatch of ``batch(d)`` and its combine, of the received rows (``copy``: of a BF16 copy of them, not of
    the receive tensor itself)."""
    x, ids, w = batch(d)
    out = d.dispatch(x, ids, w)
    return d.combine(out.hidden_states.float().to(torch.bfloat16) if copy else out.hidden_states, out)


def outcome_of(fn: Callable[[], Any]) -> Any:
    """``fn()``'s value, or (exception type, its ``parameter``, the start of its message)."""
    try:
        return fn()
    except Exception as exc:  # the type and the parameter are what the tests compare
        return type(exc).__name__, getattr(exc, "parameter", None), str(exc)[:300]


def short_outcome(outcome: Any) -> Any:
    """A step's outcome: its value (a string), or (exception type, parameter)."""
    return outcome if isinstance(outcome, str) else outcome[:2]


def routed_spec(world: int, mode: str, dtype: str) -> md.DispatchSpec:
    """A layer of ``PER_RANK`` experts per rank, ``TOP_K``, ``TOKENS`` tokens per rank."""
    return md.DispatchSpec(H, PER_RANK * world, TOP_K, num_max_dispatch_tokens_per_rank=TOKENS, mode=mode,
                           output_dtype=dtype)


def routed_inputs(rank: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``TOKENS`` rows, a routing with dropped ids, its weights, and another routing (seeded by rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, H, generator=g).to(torch.bfloat16)
    ids, w = random_routing(TOKENS, num_experts, TOP_K, generator=g, drop_prob=0.1)
    other_ids, _ = random_routing(TOKENS, num_experts, TOP_K, generator=g)
    return x, ids, w, other_ids


__all__ = ["H", "PER_RANK", "TOKENS", "TOP_K", "batch", "dispatch_and_combine", "fake_module", "ll_spec",
           "normal_spec", "outcome_of", "routed_inputs", "routed_spec", "short_outcome", "world_group"]
