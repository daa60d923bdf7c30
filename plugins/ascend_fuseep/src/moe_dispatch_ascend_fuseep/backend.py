"""The ``ascend_fuseep`` backend: ``fused_deep_moe`` as the fused forward, DeepEP-Ascend's
low-latency INT8 dispatch/combine as the unfused path, W8A8 only."""

from __future__ import annotations

from typing import Any, Mapping

import torch

import moe_dispatch as md
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.dispatcher import AscendDeepEPDispatcher
from moe_dispatch_ascend_deepep.vendor import REAL

from .weights import FuseEPWeights, check_fuse_mode, process_fuseep_weights

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
LL = md.Mode.LOW_LATENCY
#: sgl-kernel-npu fused_deep_moe docs (@a4a7aeb): batch 1..256, H 512..7168 and % 32, top-k <= 12.
#: H starts at 1024 here: the unfused path is DeepEP-Ascend's low-latency dispatch (A3: 1024..7168).
MAX_TOKENS, MIN_HIDDEN, MAX_HIDDEN, MAX_TOP_K = 256, 1024, 7168, 12


def capabilities(emulated: bool) -> md.Capabilities:
    return md.Capabilities(
        dtypes={LL: frozenset({I8})},
        fallbacks={(LL, F8): md.Fallback(I8, "Atlas A3 has no FP8; FuseEP quantizes to INT8 per token")},
        rejections={B: "FuseEP's fused op is W8A8 INT8 dynamic only (use ascend_deepep for BF16)",
                    F4: "FuseEP's fused op is W8A8 INT8 dynamic only"},
        default_dtype=I8,
        fused_forward=True,
        devices=frozenset({"cpu"} if emulated else {"npu"}),
        limits={LL: md.Limits(max_tokens_per_rank=MAX_TOKENS, hidden_multiple=32, min_hidden=MIN_HIDDEN,
                              max_hidden=MAX_HIDDEN, max_top_k=MAX_TOP_K)},
    )


def _nz_cast(t: torch.Tensor) -> torch.Tensor:
    """FRACTAL_NZ (format 29), the one weight step that needs the NPU."""
    import torch_npu

    return torch_npu.npu_format_cast(t, 29)


class FuseEPDispatcher(AscendDeepEPDispatcher):
    """The unfused path, plus the fuse mode this dispatcher's fused forward runs."""

    fuse_mode: int = 1


class FuseEPBackend(AscendDeepEPBackend):
    """Options (``create_dispatcher(options=...)``): ``fuse_mode`` 1 (dispatch_gmm_combine_decode,
    the default) or 2 (dispatch_ffn_combine). An explicit option, never an environment variable."""

    name = "ascend_fuseep"
    description = "Ascend FuseEP: dispatch, GMM1, SwiGLU, GMM2 and combine in one op (W8A8, Atlas A3)"

    def __init__(self, vendor_module: str = REAL, env: Mapping[str, str] | None = None) -> None:
        super().__init__(vendor_module, env)
        self.capabilities = capabilities(vendor_module != REAL)

    def probe(self) -> str | None:
        reason = super().probe()
        if reason is None and not hasattr(self.vendor().module.Buffer, "fused_deep_moe"):  # type: ignore[union-attr]
            return "this DeepEP-Ascend has no fused_deep_moe"
        return reason

    def create(self, ctx: md.DispatchContext) -> FuseEPDispatcher:
        fuse_mode = check_fuse_mode(ctx.options.get("fuse_mode", 1))
        base = super().create(ctx)
        d = FuseEPDispatcher(ctx, base.buffer, base.has_quant_mode)
        d.fuse_mode = fuse_mode
        return d

    def process_weights(self, weights: Any, dispatcher: Any) -> FuseEPWeights:
        impl: FuseEPDispatcher = dispatcher.backend_dispatcher
        return process_fuseep_weights(weights, impl.fuse_mode, None if self.vendor().emulated else _nz_cast)

    def fused_forward(self, dispatcher: Any, layer: Any, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        impl: FuseEPDispatcher = dispatcher.backend_dispatcher
        if not isinstance(layer, FuseEPWeights) or layer.fuse_mode != impl.fuse_mode:
            got = f"FuseEPWeights for fuse mode {layer.fuse_mode}" if isinstance(layer, FuseEPWeights) else \
                type(layer).__name__
            raise md.InvalidInputError("needs the layer process_weights made for this dispatcher", parameter="layer",
                                       value=got, allowed=f"FuseEPWeights for fuse mode {impl.fuse_mode}")
        spec = dispatcher.spec
        out, _ = impl.buffer.fused_deep_moe(
            hidden_states, topk_ids.to(torch.int64), topk_weights.float(), layer.gmm1_permuted_weight,
            layer.gmm1_permuted_weight_scale, layer.gmm2_weight, layer.gmm2_weight_scale,
            spec.num_max_dispatch_tokens_per_rank, spec.num_experts, quant_mode=1, fuse_mode=impl.fuse_mode)
        return out
