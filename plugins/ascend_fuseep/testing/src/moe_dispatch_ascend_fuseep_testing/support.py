"""What the plugin's tests share: the layer's sizes (``H``, ``I``, ``LOCAL`` experts per rank, top-``K``, ``T``
tokens per rank) and a low-latency FuseEP dispatcher of that layer on the fake, for two ranks."""

from __future__ import annotations

import moe_dispatch as md

from . import FAKE, fuseep_backend

H, I, LOCAL, K, T = 1024, 512, 2, 2, 8


def fused_dispatcher(fuse_mode: int) -> md.Dispatcher:
    """A low-latency dispatcher on the fake in ``fuse_mode``, ``LOCAL`` experts on each of two ranks."""
    spec = md.DispatchSpec(H, LOCAL * 2, K, num_max_dispatch_tokens_per_rank=T, mode="low_latency")
    return md.create_dispatcher(fuseep_backend(FAKE), spec, env={}, options={"fuse_mode": fuse_mode})


__all__ = ["H", "I", "K", "LOCAL", "T", "fused_dispatcher"]
