"""The ``ascend_deepep`` backend: capabilities, limits, the HCCL window, and the adapter."""

from __future__ import annotations

import os
from typing import Mapping


import moe_dispatch as md

from . import sizes
from .dispatcher import AscendDeepEPDispatcher
from .vendor import INSTALL_HINT, REAL, VendorInfo, detect

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY
#: sgl-kernel-npu docs (LOW_LATENCY_API.md, README): E ≤ 512; top-k ≤ 16; A3 hidden 1024..7168.
MAX_EXPERTS = 512


def capabilities(emulated: bool) -> md.Capabilities:
    no_fp8 = "Atlas A2/A3 have no FP8; DeepEP-Ascend quantizes to INT8 (per token) instead"
    return md.Capabilities(
        dtypes={N: frozenset({B, I8}), LL: frozenset({B, I8})},
        fallbacks={(N, F8): md.Fallback(I8, no_fp8), (LL, F8): md.Fallback(I8, no_fp8)},
        rejections={F4: "Atlas A2/A3 have no FP4 dispatch (MXFP4 is A5-only and not NVFP4)"},
        default_dtype=B,
        devices=frozenset({"cpu"} if emulated else {"npu"}),
        limits={
            N: md.Limits(max_tokens_per_rank=8192, hidden_multiple=32, min_hidden=1024, max_hidden=7168, max_top_k=16),
            LL: md.Limits(max_tokens_per_rank=512, hidden_multiple=32, min_hidden=1024, max_hidden=7168, max_top_k=16),
        },
    )


class AscendDeepEPBackend(md.Backend):
    """DeepEP-Ascend (sgl-kernel-npu) ``Buffer`` on Atlas A2/A3, or with
    ``vendor_module=EMULATOR`` its CPU emulator. ``env`` is what ``HCCL_BUFFSIZE`` is read from
    (``os.environ`` when None), never written."""

    name = "ascend_deepep"
    description = "DeepEP-Ascend Buffer: normal and low-latency modes, BF16 or per-token INT8, HCCL window"
    install_hint = INSTALL_HINT

    def __init__(self, vendor_module: str = REAL, env: Mapping[str, str] | None = None) -> None:
        self.vendor_module = vendor_module
        self.env = env
        self.capabilities = capabilities(vendor_module != REAL)

    def vendor(self) -> VendorInfo:
        return detect(self.vendor_module)

    def probe(self) -> str | None:
        info = self.vendor()
        if info.module is None or not info.is_ascend:
            return info.describe()
        if not info.emulated:
            import torch

            if not (hasattr(torch, "npu") and torch.npu.is_available()):
                return "no Ascend NPU (torch.npu is not available)"
        return None

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        super().check_spec(spec, world_size)
        if spec.num_experts > MAX_EXPERTS:
            raise md.InvalidSpecError("DeepEP-Ascend handles at most 512 experts", parameter="num_experts",
                                      value=spec.num_experts, allowed=f"1..{MAX_EXPERTS}")

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> md.BufferSize:
        T, h = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size
        local = spec.local_experts(world_size)
        rows = T * world_size * min(local, spec.top_k)
        window = sizes.hccl_buffer_bytes(T, h, world_size, local, spec.top_k)
        return md.BufferSize(
            rows * spec.wire_format().bytes_per_token, rows * 2 * h,
            notes=(f"HCCL window (HCCL_BUFFSIZE) >= {sizes.hccl_buffer_mb(T, h, world_size, local, spec.top_k)} MB: "
                   "DeepEP-Ascend's documented minimum, BF16 rows both ways",),
            allocated_bytes=window,
        )

    def env_requirements(self, spec: md.DispatchSpec, world_size: int) -> tuple[md.EnvRequirement, ...]:
        """HCCL_BUFFSIZE (MB) that ``create`` checks: DeepEP-Ascend's HCCL window for this spec."""
        mb = sizes.hccl_buffer_mb(spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, world_size,
                                  spec.local_experts(world_size), spec.top_k)
        return (md.EnvRequirement(sizes.HCCL_BUFFSIZE, mb, "MB", sizes.DEFAULT_HCCL_BUFFSIZE_MB,
                                  "DeepEP-Ascend's HCCL window, BF16 rows both ways"),)

    def create(self, ctx: md.DispatchContext) -> AscendDeepEPDispatcher:
        spec, R = ctx.spec, ctx.world_size
        (window,) = self.env_requirements(spec, R)  # what `moe-dispatch plan` reports is what is checked
        sizes.check_hccl_buffsize(window.minimum, os.environ if self.env is None else self.env)
        buffer = ctx.options.get("buffer")
        info = self.vendor()
        if buffer is None:
            assert info.module is not None
            buffer = info.module.Buffer(ctx.comm.process_group, low_latency_mode=spec.mode is LL)
        return AscendDeepEPDispatcher(ctx, buffer, info.has_quant_mode)
