"""The ``cuda_deepep`` backend: capabilities, limits, buffer sizes, and the adapter it creates."""

from __future__ import annotations

from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.environ import restored_environ

from . import sizes
from .dispatcher import DeepEPDispatcher
from .emulator import LOW_LATENCY_HIDDEN_SIZES
from .vendor import INSTALL_HINT, REAL, VendorInfo, detect

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY

#: NVSHMEM_QP_DEPTH defaults to 1024 and the V1 wrapper asserts depth >= 2·(T+1).
LOW_LATENCY_MAX_TOKENS = 511
#: Low-latency kernels' top-k bound (V1 internode_ll.cu).
LOW_LATENCY_MAX_TOPK = 11
#: DeepEP's ceiling on each buffer ("32 GiB"): the V1 Buffer constructor asserts
#: ``num_nvl_bytes / sizeof(int4) < INT_MAX`` and the same for ``num_rdma_bytes``
#: (deepseek-ai/DeepEP csrc/legacy/buffer.hpp @5996f70a8be8d2e6737fede640a541366801dda7, Buffer::Buffer,
#: "Common checks"), so a buffer is at most 16·(2³¹−1)−1 bytes. Normal mode with more than 8 ranks
#: also asserts both buffers fit an int (2 GiB); one per-mode value cannot say "with an RDMA
#: buffer", and the tuned normal-mode hints (independent of T) stay far below 2 GiB.
MAX_BUFFER_BYTES = 16 * (2**31 - 1) - 1


def capabilities(emulated: bool, nvfp4: bool = False) -> md.Capabilities:
    """``nvfp4``: the installed DeepEP's ``low_latency_dispatch`` takes ``use_nvfp4`` (hybrid-ep)."""
    int8 = "DeepEP has no INT8 dispatch; FP8 sends the same bytes per element"
    no_nvfp4 = ("this DeepEP's low_latency_dispatch has no use_nvfp4 (NVFP4 dispatch is on DeepEP's hybrid-ep "
                "branch)" if not nvfp4 else "DeepEP's normal-mode NVFP4 (hybrid-ep HybridEPBuffer) is not driven")
    return md.Capabilities(
        dtypes={N: frozenset({B, F8}), LL: frozenset({B, F8, F4} if nvfp4 else {B, F8})},
        fallbacks={(N, I8): md.Fallback(F8, int8), (LL, I8): md.Fallback(F8, int8)},
        rejections={F4: no_nvfp4},
        default_dtype=F8,
        fp8_ue8m0=True,
        cuda_graph_modes=frozenset({LL}),
        devices=frozenset({"cpu"} if emulated else {"cuda"}),
        limits={
            N: md.Limits(hidden_multiple=128, max_top_k=128, max_buffer_bytes=MAX_BUFFER_BYTES),
            LL: md.Limits(max_tokens_per_rank=LOW_LATENCY_MAX_TOKENS, hidden_sizes=LOW_LATENCY_HIDDEN_SIZES,
                          max_top_k=LOW_LATENCY_MAX_TOPK, max_buffer_bytes=MAX_BUFFER_BYTES),
        },
        world_sizes=sizes.SUPPORTED_EP_SIZES,
    )


def _normal_hints(spec: md.DispatchSpec, world_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(NVL, RDMA) size hints as (dispatch, combine): dispatch with the wire dtype's hidden
    bytes (FP8: H, its scales are in DeepEP's reserved columns), combine with BF16's 2·H."""
    dcfg, ccfg = sizes.dispatch_config(world_size), sizes.combine_config(world_size)
    d_bytes, c_bytes = spec.hidden_size * (1 if spec.output_dtype is F8 else 2), 2 * spec.hidden_size
    return ((dcfg.nvl_buffer_size_hint(d_bytes, world_size), ccfg.nvl_buffer_size_hint(c_bytes, world_size)),
            (dcfg.rdma_buffer_size_hint(d_bytes, world_size), ccfg.rdma_buffer_size_hint(c_bytes, world_size)))


class DeepEPBackend(md.Backend):
    """DeepEP's V1 ``Buffer`` on CUDA (or, with ``vendor_module=EMULATOR``, its CPU emulator).

    Options (``create_dispatcher(options=...)``): ``dispatch_config`` / ``combine_config``
    (a ``sizes.Config`` for an EP size without a tuned one), ``buffer`` (a ``Buffer`` shared
    by several layers, sized for the largest).
    """

    name = "cuda_deepep"
    description = "DeepEP V1 Buffer: normal (NVLink/RDMA) and low-latency (masked, CUDA-graph safe) modes"
    install_hint = INSTALL_HINT

    def __init__(self, vendor_module: str = REAL) -> None:
        self.vendor_module = vendor_module
        self._capabilities: md.Capabilities | None = None

    @property
    def capabilities(self) -> md.Capabilities:  # type: ignore[override]
        """Read on first use, not at registration: NVFP4 depends on the DeepEP installed."""
        if self._capabilities is None:
            info = self.vendor()
            self._capabilities = capabilities(info.emulated, info.has_nvfp4)
        return self._capabilities

    def vendor(self) -> VendorInfo:
        return detect(self.vendor_module)

    def probe(self) -> str | None:
        info = self.vendor()
        if info.module is None:
            return info.describe()
        if not info.has_v1_buffer:
            return f"{info.describe()}; this adapter drives the V1 Buffer"
        if not info.emulated and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> md.BufferSize:
        if spec.mode is LL:
            t, h, e = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.num_experts
            layout = sizes.LowLatencyLayout.build(t, h, e)
            return md.BufferSize(
                layout.dispatch_bytes, layout.combine_bytes,
                notes=("one RDMA buffer for both (DeepEP get_low_latency_rdma_size_hint); messages are sized for "
                       "BF16 whatever the dispatch dtype",),
                allocated_bytes=sizes.low_latency_rdma_size_hint(t, h, world_size, e),
            )
        nvl, rdma = _normal_hints(spec, world_size)
        return md.BufferSize(
            nvl[0] + rdma[0], nvl[1] + rdma[1],
            notes=(f"NVL {max(nvl):,} B + RDMA {max(rdma):,} B, shared by dispatch and combine (combine is BF16)",),
            allocated_bytes=max(nvl) + max(rdma),
        )

    def nvl_rdma_bytes(self, spec: md.DispatchSpec, world_size: int) -> tuple[int, int]:
        """What to pass to ``Buffer(num_nvl_bytes=, num_rdma_bytes=)``."""
        if spec.mode is LL:
            return 0, self.buffer_size(spec, world_size).total_bytes
        nvl, rdma = _normal_hints(spec, world_size)
        return max(nvl), max(rdma)

    def create(self, ctx: md.DispatchContext) -> DeepEPDispatcher:
        options: dict[str, Any] = ctx.options
        R = ctx.world_size
        dcfg = options.get("dispatch_config") or (sizes.dispatch_config(R) if ctx.spec.mode is N else None)
        ccfg = options.get("combine_config") or (sizes.combine_config(R) if ctx.spec.mode is N else None)
        buffer = options.get("buffer")
        if buffer is None:
            module = self.vendor().module
            nvl, rdma = self.nvl_rdma_bytes(ctx.spec, R)
            with restored_environ():  # V1 Buffer sets NVSHMEM_* in os.environ while it initializes
                buffer = module.Buffer(ctx.comm.process_group, num_nvl_bytes=nvl, num_rdma_bytes=rdma,
                                       low_latency_mode=ctx.spec.mode is LL,
                                       num_qps_per_rank=ctx.local_experts if ctx.spec.mode is LL else 24)
        return DeepEPDispatcher(ctx, buffer, dcfg, ccfg)
