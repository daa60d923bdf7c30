"""A fake of DeepEP 2.0.0 (deepseek-ai/DeepEP@b306af0, a422b5a): what differs from the 2.1.0 fake (``deep_ep``
with ``deep_ep_elastic``).

- ``ElasticBuffer.dispatch`` has no ``do_zero_padding`` (elastic.py is Python: an unexpected keyword is Python's
  ``TypeError``), and its ``EPHandle`` neither ``num_unaligned_recv_tokens_per_expert`` nor ``num_expanded_tokens``
  (a422b5a elastic.py:57-98): they arrived in 2.1.0 (099d5f2, DeepEP #674).

Everything else is the 2.1.0 fake's (the V1 ``Buffer`` included, as 2.0.0 kept it as "legacy").
"""

from __future__ import annotations

from typing import Any

from . import deep_ep_elastic

# The emulated device, process and CUDA graphs: every fake DeepEP module has them (vendor.*_ATTRIBUTE).
from .deep_ep import (  # noqa: F401
    EMULATED_DEVICE_NAME,
    EMULATED_DEVICE_SMS,
    EMULATED_NVSHMEM,
    Buffer,
    Config,
    CUDAGraph,
    EventOverlap,
    emulated_stream_capturing,
    topk_idx_t,
)

__version__ = "2.0.0"
_FROM_2_1 = ("num_unaligned_recv_tokens_per_expert", "num_expanded_tokens")


class EPHandle(deep_ep_elastic.EPHandle):
    """2.0.0's handle: no unaligned per-expert counts, no expanded row count."""


class ElasticBuffer(deep_ep_elastic.ElasticBuffer):
    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None,  # type: ignore[override]
                 cumulative_local_expert_recv_stats: Any = None, num_experts: int | None = None,
                 num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None, num_sms: int = 0,
                 num_qps: int = 0, previous_event: Any = None, previous_event_before_epilogue: Any = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Any = None, do_handle_copy: bool = True, do_cpu_sync: bool | None = None,
                 do_expand: bool = False, use_tma_aligned_col_major_sf: bool = False) -> tuple:
        out = super().dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats, num_experts,
                               num_max_tokens_per_rank, expert_alignment, num_sms, num_qps, previous_event,
                               previous_event_before_epilogue, async_with_compute_stream, allocate_on_comm_stream,
                               handle, do_handle_copy, do_cpu_sync, do_expand, False, use_tma_aligned_col_major_sf)
        old = EPHandle.__new__(EPHandle)
        old.__dict__.update({k: v for k, v in vars(out[3]).items() if k not in _FROM_2_1})
        return (*out[:3], old, out[4])
