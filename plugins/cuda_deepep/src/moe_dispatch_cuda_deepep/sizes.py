"""How big the DeepEP buffers of one layer must be, from DeepEP's own size functions.

With DeepEP installed every number comes from it (``Buffer.get_low_latency_rdma_size_hint``, the
``Config.get_nvl_buffer_size_hint``/``get_rdma_buffer_size_hint`` of the configs the dispatcher will use);
without it (planning on a laptop, ``moe-dispatch plan``) from the ports in ``vendor``, tested equal to
DeepEP's published numbers. Normal mode sizes dispatch with the wire dtype's bytes per hidden element and
combine with BF16's, and allocates the larger of each (sglang's sizing).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import moe_dispatch as md
import moe_dispatch.backend as mdb

from . import vendor


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int,
                               module: ModuleType | None = None) -> int:
    """The low-latency RDMA buffer: DeepEP's hint when ``module`` is an installed DeepEP, else the port."""
    return vendor.low_latency_rdma_size_hint(module, num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)


@dataclass(frozen=True)
class NormalHints:
    """NVL and RDMA hints of the dispatch config (wire dtype) and the combine config (BF16)."""

    nvl: tuple[int, int]
    rdma: tuple[int, int]

    @property
    def nvl_bytes(self) -> int:
        return max(self.nvl)

    @property
    def rdma_bytes(self) -> int:
        return max(self.rdma)


def normal_hints(spec: md.DispatchSpec, world_size: int, dispatch_config: Any, combine_config: Any) -> NormalHints:
    """The hints of two configs (vendor ``Config`` objects, or ``vendor.ConfigFields`` for planning).
    FP8 scales travel in DeepEP's reserved columns, so dispatch counts H bytes per token for FP8."""
    d_bytes = spec.hidden_size * (1 if spec.output_dtype is md.DispatchDtype.FP8 else 2)
    c_bytes = 2 * spec.hidden_size
    return NormalHints(
        (vendor.nvl_buffer_size_hint(dispatch_config, d_bytes, world_size),
         vendor.nvl_buffer_size_hint(combine_config, c_bytes, world_size)),
        (vendor.rdma_buffer_size_hint(dispatch_config, d_bytes, world_size),
         vendor.rdma_buffer_size_hint(combine_config, c_bytes, world_size)),
    )


def low_latency_buffer(spec: md.DispatchSpec, world_size: int, module: ModuleType | None) -> mdb.BufferSize:
    t, h, e = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.num_experts
    layout = vendor.LowLatencyLayout.build(t, h, e)
    return mdb.BufferSize(
        layout.dispatch_bytes, layout.combine_bytes,
        notes=("one RDMA buffer for both (DeepEP get_low_latency_rdma_size_hint); messages are sized for BF16 "
               "whatever the dispatch dtype",),
        allocated_bytes=low_latency_rdma_size_hint(t, h, world_size, e, module),
    )


def normal_buffer(hints: NormalHints) -> mdb.BufferSize:
    return mdb.BufferSize(
        hints.nvl[0] + hints.rdma[0], hints.nvl[1] + hints.rdma[1],
        notes=(f"NVL {hints.nvl_bytes:,} B + RDMA {hints.rdma_bytes:,} B, shared by dispatch and combine "
               "(combine is BF16)",),
        allocated_bytes=hints.nvl_bytes + hints.rdma_bytes,
    )


__all__ = ["NormalHints", "low_latency_buffer", "low_latency_rdma_size_hint", "normal_buffer", "normal_hints"]
