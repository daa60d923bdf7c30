"""A DeepEP-Ascend of tags 2026.03.31.rc1 ... 2026.7.2 (sgl-project/sgl-kernel-npu @ 0ac00159 ... @ be6b5e7f): fuse
mode 2's tiling reads only ``HCCL_BUFFSIZE`` (``vendor.MODE2_DEEPEP_WINDOW_SINCE``), and ``dispatch`` /
``low_latency_dispatch`` have no ``quant_mode`` (ascend_deepep's ``fakes.deep_ep_env_only``). Everything else is
``fakes.deep_ep``."""

from __future__ import annotations

from moe_dispatch_ascend_deepep_testing.fakes import deep_ep_env_only

from . import deep_ep
from .deep_ep import Config, EventOverlap, FuseMode, VendorCall


class Buffer(deep_ep_env_only.Buffer, deep_ep.Buffer):
    MODE2_READS_DEEPEP = False


__all__ = ["Buffer", "Config", "EventOverlap", "FuseMode", "VendorCall"]
