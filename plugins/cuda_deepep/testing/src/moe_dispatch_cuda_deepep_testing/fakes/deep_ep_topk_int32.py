"""A fake of DeepEP 2.x built with ``EP_NUM_TOPK_IDX_BITS=32`` (or ``TOPK_IDX_BITS=32`` before 2.x;
deepseek-ai/DeepEP@dd758ca setup.py, deep_ep/include/deep_ep/common/compiled.cuh): ``deep_ep.topk_idx_t``
is ``torch.int32``, every top-k index tensor must have it (``data_ptr<topk_idx_t>()``, and the low-latency
``EP_HOST_ASSERT(topk_idx.scalar_type() == topk_idx_t)``), and the NVL/RDMA hints reserve 4 bytes per
top-k index instead of 8."""

from __future__ import annotations

import torch

from . import deep_ep

# The emulated device, process and CUDA graphs: every fake DeepEP module has them (vendor.*_ATTRIBUTE).
from .deep_ep import (
    EMULATED_DEVICE_NAME,  # noqa: F401
    EMULATED_DEVICE_SMS,  # noqa: F401
    EMULATED_NVSHMEM,  # noqa: F401
    CUDAGraph,  # noqa: F401
    EventOverlap,
    VendorCall,
    emulated_stream_capturing,  # noqa: F401
    install_statics,
)

__version__ = deep_ep.__version__
topk_idx_t = torch.int32


class Config(deep_ep.Config):
    __slots__ = ()
    _IDX_BYTES = 4


class Buffer(deep_ep.Buffer):
    num_sms: int = deep_ep.Buffer.num_sms
    _TOPK_IDX_T = topk_idx_t
    _CONFIG = Config


install_statics(Buffer)

__all__ = ["CUDAGraph", "Buffer", "Config", "EventOverlap", "VendorCall", "topk_idx_t"]
