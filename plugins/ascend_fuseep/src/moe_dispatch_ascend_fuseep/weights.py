"""W8A8 expert weights in the layouts ``fused_deep_moe`` reads, as pure torch transforms.

From sglang ``python/sglang/srt/hardware_backend/npu/moe/fuseep.py`` (@008b79d,
``process_fuseep_weights``) and sgl-kernel-npu's test ``reshape_fusion_gmm_weight``:

- fuse mode 1 (fused_deep_moe): ``w13ᵀ`` ``[E, H, 2I]`` with gate and up columns
  interleaved in chunks of 64 (column block b of 128 = gate[64b:64b+64] ‖ up[64b:64b+64]), its
  fp32 per-channel scale ``[E, 2I]`` permuted the same way; ``w2`` ``[E, H, I]`` as is with an
  fp32 scale ``[E, H]``.
- fuse mode 2 (dispatch_ffn_combine): ``w13ᵀ`` ``[E, H, 2I]`` without the interleave, ``w2ᵀ``
  ``[E, I, H]``; scales are the fp32 bits read as int32 and widened to int64.

Only the FRACTAL_NZ format cast needs the NPU (``nz_cast``, e.g. ``lambda w:
torch_npu.npu_format_cast(w, 29)``); everything else runs and is tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import moe_dispatch as md

from . import vendor as v

#: Columns per gate (or up) chunk in fuse mode 1's interleave (the op's GMM tile along N).
CHUNK = v.GMM1_TILE_N
FUSE_MODES = v.FUSE_MODES
OTHER_SCHEMES = ("ascend_deepep with runner npu_bf16, npu_w4a16, npu_w4a8 or npu_w4a4 "
                 "(or npu_w8a8 for W8A8 without the fused op)")


@dataclass(frozen=True)
class FuseEPWeights:
    """One rank's experts ready for ``fused_deep_moe`` in ``fuse_mode``."""

    gmm1_permuted_weight: torch.Tensor
    gmm1_permuted_weight_scale: torch.Tensor
    gmm2_weight: torch.Tensor
    gmm2_weight_scale: torch.Tensor
    fuse_mode: int
    #: Fuse mode 2: the workspace the op allocates at each call at the dispatcher's capacity (None: not known).
    workspace_bytes: int | None = None


def check_fuse_mode(fuse_mode: object) -> int:
    if fuse_mode not in FUSE_MODES:
        raise md.InvalidSpecError("is not a FuseEP fuse mode", parameter="fuse_mode", value=fuse_mode,
                                  allowed=", ".join(f"{k} ({v})" for k, v in FUSE_MODES.items()))
    return int(fuse_mode)  # type: ignore[call-overload]


def scheme_of(weights: md.ExpertWeights) -> str:
    """The quantization scheme a layer's weights are in, as the error messages name it."""
    if weights.w13_weight.dtype == torch.int8 and weights.w2_weight.dtype == torch.int8:
        return "w8a8" if weights.w13_weight_scale is not None and weights.w2_weight_scale is not None else \
            "int8 without per-channel scales"
    return {torch.bfloat16: "bf16 (unquantized)", torch.float32: "fp32 (unquantized)",
            torch.float16: "fp16 (unquantized)"}.get(weights.w13_weight.dtype, str(weights.w13_weight.dtype))


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` gate-then-up → chunks of 64: gate[0:64], up[0:64], gate[64:128], ..."""
    i = t.shape[-1] // 2
    gate, up = t[..., :i].unflatten(-1, (i // CHUNK, CHUNK)), t[..., i:].unflatten(-1, (i // CHUNK, CHUNK))
    return torch.stack([gate, up], dim=-2).flatten(-3)


def deinterleave_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``interleave_gate_up``: (gate, up)."""
    pairs = t.unflatten(-1, (t.shape[-1] // (2 * CHUNK), 2, CHUNK))
    return pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)


def scale_to_int64(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales → their bits as int32, widened to int64 (fuse mode 2's scale format)."""
    return scale.float().contiguous().view(torch.int32).to(torch.int64)


def scale_from_int64(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def process_fuseep_weights(weights: md.ExpertWeights | FuseEPWeights, fuse_mode: int = 1,
                           nz_cast: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                           max_output_size: int | None = None, tokens: int | None = None, top_k: int | None = None,
                           world_size: int | None = None) -> FuseEPWeights:
    """A rank's W8A8 experts (int8 ``w13`` ``[E, 2I, H]`` gate-then-up, ``w2`` ``[E, H, I]``,
    per-output-channel fp32 scales) → ``FuseEPWeights`` for ``fuse_mode``. Idempotent: weights
    already processed for the same mode come back as they are. Any other scheme is a typed
    error naming it and the backends that take it; never a wrong layout handed to the op. With mode 2's
    ``max_output_size`` (and the dispatcher's ``tokens``, ``top_k``, ``world_size``): its 32-bit workspace sizes
    checked and the per-call workspace reported."""
    fuse_mode = check_fuse_mode(fuse_mode)
    if isinstance(weights, FuseEPWeights):
        if weights.fuse_mode != fuse_mode:
            raise md.InvalidSpecError(f"these weights were processed for fuse mode {weights.fuse_mode}",
                                      parameter="fuse_mode", value=fuse_mode, allowed=str(weights.fuse_mode))
        return weights
    scheme = scheme_of(weights)
    if scheme != "w8a8":
        raise md.InvalidSpecError(f"FuseEP's fused_deep_moe takes only W8A8 INT8 dynamic weights; for {scheme} use "
                                  f"{OTHER_SCHEMES}", parameter="weights", value=scheme, allowed="w8a8")
    i = weights.w2_weight.shape[2]
    if fuse_mode == 1 and i % CHUNK:
        raise md.InvalidSpecError("fuse mode 1 interleaves gate/up in chunks of 64", parameter="weights",
                                  value=f"intermediate size {i}", allowed="a multiple of 64")
    if fuse_mode == 1 and not v.MIN_GMM1_HIDDEN <= 2 * i <= v.MAX_GMM1_HIDDEN:
        raise md.InvalidSpecError("fused_deep_moe (fuse mode 1) takes gmm1 N = 2 x intermediate in 1024..6144",
                                  parameter="intermediate_size", value=i,
                                  allowed=f"{v.MIN_GMM1_HIDDEN // 2}..{v.MAX_GMM1_HIDDEN // 2}")
    h, local = weights.w2_weight.shape[1], weights.w2_weight.shape[0]
    workspace = None
    if fuse_mode == 2:
        if i % v.MODE2_INTERMEDIATE_MULTIPLE:
            raise md.InvalidSpecError("fuse mode 2's FRACTAL_NZ w2ᵀ [E, I, H] takes I in whole 16-row blocks",
                                      parameter="intermediate_size", value=i,
                                      allowed=f"a multiple of {v.MODE2_INTERMEDIATE_MULTIPLE}")
        if max_output_size is not None and max_output_size * max(2 * i, h) >= v.MODE2_PRODUCT_LIMIT:
            raise md.InvalidSpecError(
                "fuse mode 2 sizes its workspace regions as 32-bit products of max_output_size and 2I or H: they "
                "would wrap", parameter="max_output_size", value=max_output_size,
                allowed=f"< {v.MODE2_PRODUCT_LIMIT // max(2 * i, h)} at I={i}, H={h} (fewer tokens per rank or ranks)")
        if None not in (max_output_size, tokens, top_k, world_size):
            workspace = v.mode2_workspace_bytes(tokens, top_k, world_size, local, h, i, max_output_size)
    cast = nz_cast or (lambda t: t)
    w13_t = weights.w13_weight.transpose(1, 2)  # [E, H, 2I]
    assert weights.w13_weight_scale is not None and weights.w2_weight_scale is not None
    s13, s2 = weights.w13_weight_scale.float(), weights.w2_weight_scale.float()
    if fuse_mode == 1:
        return FuseEPWeights(cast(interleave_gate_up(w13_t).contiguous()), interleave_gate_up(s13).contiguous(),
                             cast(weights.w2_weight.contiguous()), s2.contiguous(), 1)
    return FuseEPWeights(cast(w13_t.contiguous()), scale_to_int64(s13), cast(weights.w2_weight.transpose(1, 2).contiguous()),
                         scale_to_int64(s2), 2, workspace)


__all__ = ["CHUNK", "FUSE_MODES", "FuseEPWeights", "check_fuse_mode", "deinterleave_gate_up", "interleave_gate_up",
           "process_fuseep_weights", "scale_from_int64", "scale_to_int64", "scheme_of"]
