"""The ``flashinfer_a2a`` backend: FlashInfer's MoE all-to-all as a dispatch backend."""

from __future__ import annotations

import torch

import moe_dispatch as md

from . import sizes
from .alltoall import FlashInferA2ADispatcher
from .vendor import EMULATOR, INSTALL_HINT, REAL, VendorInfo, detect

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N = md.Mode.NORMAL
#: Workspaces per dispatcher: one dispatch may await combine per workspace (two-batch overlap).
DEFAULT_IN_FLIGHT = 2


def capabilities(emulated: bool) -> md.Capabilities:
    return md.Capabilities(
        dtypes={N: frozenset({B, F8, F4})},
        fallbacks={(N, I8): md.Fallback(F8, "CUDA MoE kernels take FP8, not INT8; FP8 sends the same bytes per element")},
        # The kernels behind it (CuTe-DSL, TRT-LLM MoE) quantize BF16 themselves.
        default_dtype=B,
        devices=frozenset({"cpu"} if emulated else {"cuda"}),
        limits={N: md.Limits(hidden_multiple=128, max_top_k=sizes.MAX_TOP_K)},
    )


class FlashInferA2ABackend(md.Backend):
    """FlashInfer's ``MoeAlltoAll`` (TRT-LLM's MNNVL all-to-all), normal mode, any wire dtype
    but INT8. Options: ``in_flight`` (workspaces, default 2)."""

    name = "flashinfer_a2a"
    description = "FlashInfer MoE all-to-all (MNNVL): one copy per destination rank, add-only combine"
    install_hint = INSTALL_HINT

    def __init__(self, vendor_module: str = REAL) -> None:
        self.vendor_module = vendor_module
        self.capabilities = capabilities(vendor_module == EMULATOR)

    def vendor(self) -> VendorInfo:
        return detect(self.vendor_module)

    def probe(self) -> str | None:
        info = self.vendor()
        if info.api is None:
            return info.describe()
        if info.api.MoeAlltoAll is None:
            return f"{info.describe()}; this FlashInfer has no MoeAlltoAll"
        if not info.emulated and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        super().check_spec(spec, world_size)
        if spec.local_experts(world_size) > sizes.MAX_EXPERTS_PER_RANK:
            raise md.InvalidSpecError(
                f"FlashInfer's all-to-all handles at most {sizes.MAX_EXPERTS_PER_RANK} experts per rank",
                parameter="num_experts", value=spec.num_experts,
                allowed=f"at most {sizes.MAX_EXPERTS_PER_RANK * world_size} on {world_size} ranks",
            )

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> md.BufferSize:
        R, T, h = world_size, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size
        per_token = sizes.dispatch_bytes_per_token(spec.wire_format().bytes_per_token, spec.top_k)
        aux = sizes.pad128(sizes.aux_bytes(R, T))
        dispatch = aux + sizes.pad128(R * T * per_token)
        combine = sizes.pad128(R * T * 2 * h)
        return md.BufferSize(
            dispatch, combine,
            notes=(f"one workspace = {dispatch + combine:,} B (get_moe_workspace_size_per_rank with the wire dtype's "
                   f"bytes), ×{DEFAULT_IN_FLIGHT} for dispatches in flight",),
            allocated_bytes=DEFAULT_IN_FLIGHT * (dispatch + combine),
        )

    def create(self, ctx: md.DispatchContext) -> FlashInferA2ADispatcher:
        info = self.vendor()
        assert info.api is not None
        spec, R = ctx.spec, ctx.world_size
        in_flight = int(ctx.options.get("in_flight", DEFAULT_IN_FLIGHT))
        if in_flight < 1:
            raise md.InvalidSpecError("needs at least one workspace", parameter="options.in_flight",
                                      value=in_flight, allowed="an int >= 1")
        size = self.buffer_size(spec, R)
        mapping = info.api.Mapping(world_size=R, rank=ctx.rank, gpus_per_node=R, tp_size=R, moe_ep_size=R)
        extra = {}
        if info.emulated:  # the emulator talks over a process group instead of MNNVL memory
            extra["group"] = ctx.comm.process_group
        instances = [info.api.MoeAlltoAll(mapping, spec.num_max_dispatch_tokens_per_rank, spec.top_k, spec.num_experts,
                                          workspace_size_per_rank=size.dispatch_bytes + size.combine_bytes,
                                          hidden_size=spec.hidden_size, **extra)
                     for _ in range(in_flight)]
        return FlashInferA2ADispatcher(ctx, instances)
