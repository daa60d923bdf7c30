"""A fake of DeepEP 1.2.1 as it was before 2025-09-15 (main @ e9d053c, ``deep_ep/buffer.py``): what differs
from the 2.x fake.

- Low-latency top-k at most 9: ``kNumMaxTopK = 9`` in ``internode_ll.cu`` dispatch and combine, raised to
  11 by 9af0e0d "support topk10 in low latency kernel (#403)".
- ``Buffer.__init__`` has no ``enable_shrink`` (c475ec6) and the pybind runtime takes six arguments.
- No ``deep_ep.topk_idx_t`` (da6ca24): top-k indices are int64.
- No ``self.nvshmem_qp_depth`` and no QP-depth assert (d981409); the constructor still writes
  ``NVSHMEM_QP_DEPTH`` (default 1024).
- No ``check_torch_deterministic`` (2.x).
- Tuned configs without EP48/EP96 (c939644) and ``SWITCH_RDMA_RANKS`` {2, 4, 8, 16, 18, 20}; low-latency
  hidden sizes without 3072 (73b6ea4).

A real 1.x build has no ``__version__``; its distribution version is ``1.2.1+<commit>``. The fake carries
that string as ``__version__`` (it has no distribution metadata).
"""

from __future__ import annotations

from moe_dispatch_cuda_deepep import vendor

from . import deep_ep

# The emulated device, process and CUDA graphs: every fake DeepEP module has them (vendor.*_ATTRIBUTE).
from .deep_ep import (
    EMULATED_DEVICE_NAME,  # noqa: F401
    EMULATED_DEVICE_SMS,  # noqa: F401
    EMULATED_NVSHMEM,  # noqa: F401
    Config,
    CUDAGraph,  # noqa: F401
    EventOverlap,
    VendorCall,
    emulated_stream_capturing,  # noqa: F401
    install_statics,
)

__version__ = "1.2.1+e9d053c"


class Buffer(deep_ep.Buffer):
    num_sms: int = vendor.DEFAULT_NUM_SMS
    _TUNED_DISPATCH = vendor.TUNED_DISPATCH_BEFORE_EP48
    _TUNED_COMBINE = vendor.TUNED_COMBINE_BEFORE_EP48
    _RDMA_RANKS = vendor.RDMA_RANKS_V12_BEFORE_EP48
    _LL_MAX_TOPK = vendor.LL_MAX_TOPK_BEFORE_9AF0E0D
    _LL_HIDDEN_SIZES = vendor.LOW_LATENCY_HIDDEN_SIZES_V12
    _CHECKS_DETERMINISTIC = False
    _ASSERTS_QP_DEPTH = False

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False,
                 comm=None) -> None:
        self._start(group, comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                    allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, False)


install_statics(Buffer)

__all__ = ["CUDAGraph", "Buffer", "Config", "EventOverlap", "VendorCall"]
