"""``CuteDslMoEWrapper`` (flashinfer/fused_moe/cute_dsl/fused_moe.py) W4A4 on CPU.

It computes in fp32 what the kernels compute: GEMM1 on the NVFP4 rows and weights times
``w1_alpha``, SwiGLU on w1's rows read as FlashInfer lays them out (``vendor.W1_INTERLEAVE_GROUP``
rows of up, then as many of gate, repeated), the intermediate re-quantized to NVFP4 with
``fc2_input_scale``, GEMM2 times ``w2_alpha``, then the fused finalize (times
``token_final_scales``, summed over top-k). Ids outside ``[local_expert_offset,
local_expert_offset + num_local_experts)`` (-1 included) contribute nothing; the output row of a
token with no local expert is zero from v0.6.7 and uninitialised before (NaN here,
``vendor.CUTEDSL_DENSE_ZERO_SINCE``).

Read as the kernels read them: every tensor through its raw pointer (``data_ptr``) with the
layout the host wrapper fixes, whatever its strides (a non-contiguous weight, a re-laid-out scale
view or a strided alpha gives other numbers, as on the GPU): weights ``[E_l, N, K/2]`` row-major,
weight scales in the storage order of the MMA view (``(E, m_tiles, k_tiles, 32, 4, 4)``), alphas
``E_l`` float32 in a row.

Checks as the vendor makes them: the pointer alignment ``make_ptr`` asserts (flashinfer-ai/flashinfer@f1e6fdc
flashinfer/cute_dsl/utils.py ``_Pointer.__init__``: ``pointer must be N bytes aligned``; activations and
weights 32 bytes, scales 16); the routing step's limits on ``num_experts`` (``vendor.cutedsl_routing_limits``,
RuntimeError); from 0.6.18 the TypeError for activations that are not packed uint8. Checks where the GPU
would read out of bounds or garbage instead of failing (AssertionError here, marked "fake:"):
contiguity and linear layout of the activations and their scales ``[T, H/16]`` (the kernel reads
them by token), shapes, dtypes, one device for every tensor, zero tokens.

``Wrapper_0_6_4`` ... ``Wrapper_0_6_18`` carry each release range's ``__init__``/``run`` signature
(``vendor.SIGNATURES``); a version module subclasses one with its ``_VERSION``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

import moe_dispatch as md
from moe_dispatch.backend import NVFP4Codec, WireFormat, e2m1_unpack, swizzled_shape, unswizzle_128x4
from moe_dispatch_flashinfer_cutedsl import vendor

from .nvfp4 import UNSET

DEFAULT_SWIGLU_ALPHA = vendor.DEFAULT_SWIGLU_ALPHA
DEFAULT_SWIGLU_BETA = vendor.DEFAULT_SWIGLU_BETA
DEFAULT_SWIGLU_LIMIT = vendor.DEFAULT_SWIGLU_LIMIT


class ActivationType(IntEnum):
    Swiglu = vendor.ACTIVATION_SWIGLU


def _nvfp4_values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e2m1 × block scale, without the global scale (the kernels fold it into alpha)."""
    values = e2m1_unpack(packed).unflatten(-1, (-1, vendor.NVFP4_BLOCK))
    return (values * scales.view(torch.float8_e4m3fn).float().unsqueeze(-1)).flatten(-2)


def _up_gate(gemm1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1's ``2I`` output columns as the kernel pairs them: groups of up and gate rows."""
    g = vendor.W1_INTERLEAVE_GROUP
    pairs = gemm1.unflatten(-1, (gemm1.shape[-1] // (2 * g), 2, g))
    first, second = pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)
    return (first, second) if vendor.W1_UP_FIRST else (second, first)


def _aligned(name: str, t: torch.Tensor, alignment: int) -> None:
    assert t.data_ptr() % alignment == 0, f"pointer must be {alignment} bytes aligned ({name})"


def _raw(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """What a kernel reads at ``t.data_ptr()`` as a row-major ``shape`` (past the end of the
    storage: torch refuses, as the GPU would fault)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return torch.as_strided(t, shape, tuple(reversed(strides)), t.storage_offset())


def _raw_weight_scales(sf: torch.Tensor, experts: int, rows: int, columns: int) -> torch.Tensor:
    """The e4m3 weight scales as the kernel reads them: the bytes at ``data_ptr`` in the storage
    order of the MMA view (per expert a 128x4-swizzled block), back to linear ``[E, rows, columns]``."""
    mp, kp = swizzled_shape(rows, columns)
    return unswizzle_128x4(_raw(sf, (experts, mp, kp)), rows, columns)


class CuteDslBase:
    """The wrapper's state and ``run``; the signature classes below give ``__init__``/``run``."""

    _VERSION: ClassVar[vendor.Version]

    def _init(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
              num_local_experts: int | None, local_expert_offset: int, sf_vec_size: int,
              output_dtype: torch.dtype) -> None:
        if sf_vec_size != vendor.NVFP4_BLOCK:
            raise NotImplementedError("fake CuteDslMoEWrapper implements W4A4 NVFP4 (sf_vec_size 16)")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_local_experts = num_local_experts or num_experts
        self.local_expert_offset, self.output_dtype = local_expert_offset, output_dtype
        self.calls = 0

    def _route(self) -> None:
        """``moe_sort``'s host checks (the routing step ``run`` starts with)."""
        limits = vendor.cutedsl_routing_limits(self._VERSION)
        e = self.num_experts
        if self._VERSION < (0, 6, 8):
            if not self.top_k <= e:
                raise RuntimeError(f"Routing kernel expects topK {self.top_k} to be at most #experts {e}")
            if e > limits.max_experts:
                raise RuntimeError(limits.message.format(e=e))
            if e % limits.multiple:
                raise RuntimeError(f"Routing kernel expects #experts {e} to be a multiple of 4.")
        elif e > limits.max_experts:
            raise RuntimeError(limits.message.format(e=e))

    def _run(self, x: torch.Tensor, x_sf: torch.Tensor, token_selected_experts: torch.Tensor,
             token_final_scales: torch.Tensor, w1_weight: torch.Tensor, w1_weight_sf: torch.Tensor,
             w1_alpha: torch.Tensor, fc2_input_scale: torch.Tensor, w2_weight: torch.Tensor,
             w2_weight_sf: torch.Tensor, w2_alpha: torch.Tensor, tactic: Any = None) -> torch.Tensor:
        h, i, el = self.hidden_size, self.intermediate_size, self.num_local_experts
        t = token_selected_experts.shape[0]
        tensors = {"x": x, "x_sf": x_sf, "token_selected_experts": token_selected_experts,
                   "token_final_scales": token_final_scales, "w1_weight": w1_weight, "w1_weight_sf": w1_weight_sf,
                   "w1_alpha": w1_alpha, "fc2_input_scale": fc2_input_scale, "w2_weight": w2_weight,
                   "w2_weight_sf": w2_weight_sf, "w2_alpha": w2_alpha}
        wrong = {n: str(v.device) for n, v in tensors.items() if v.device != x.device}
        assert not wrong, f"fake: every tensor on x's device {x.device} (the kernels read raw pointers): {wrong}"
        self._route()
        data, scales = vendor.MAKE_PTR_ALIGN_DATA, vendor.MAKE_PTR_ALIGN_SCALES
        for name, alignment in (("x", data), ("x_sf", scales), ("w1_weight", data), ("w1_weight_sf", scales),
                                ("w2_weight", data), ("w2_weight_sf", scales)):
            _aligned(name, tensors[name], alignment)
        assert t > 0, "fake: zero tokens (what moe_sort and the GEMMs do with none is not confirmed)"
        assert x.dtype == torch.uint8 and tuple(x.shape) == (t, h // 2) and x.is_contiguous(), (
            f"fake: x must be packed NVFP4 [{t}, {h // 2}], contiguous")
        sf = x_sf.squeeze(-1) if x_sf.dim() == 3 else x_sf
        assert tuple(sf.shape) == (t, h // vendor.NVFP4_BLOCK) and sf.element_size() == 1 and sf.is_contiguous(), (
            f"fake: x_sf must be linear [{t}, {h // vendor.NVFP4_BLOCK}] (the kernel reads it by token)")
        assert token_selected_experts.dtype == torch.int32, "fake: token_selected_experts int32"
        assert token_final_scales.dtype in vendor.TOKEN_FINAL_SCALES_DTYPES, (
            f"fake: token_final_scales float32, bfloat16 or float16, got {token_final_scales.dtype}")
        assert tuple(token_selected_experts.shape) == tuple(token_final_scales.shape) == (t, self.top_k)
        assert w1_weight.dtype == w2_weight.dtype == torch.uint8, "fake: packed NVFP4 weights"
        assert tuple(w1_weight.shape) == (el, 2 * i, h // 2) and tuple(w2_weight.shape) == (el, h, i // 2)
        for name in ("w1_alpha", "w2_alpha", "fc2_input_scale"):
            assert tensors[name].dtype == torch.float32, f"fake: {name} is read as float32"
        assert w1_alpha.numel() == el and w2_alpha.numel() == el and fc2_input_scale.numel() == 1
        self.calls += 1
        # Everything through its raw pointer, in the layout the wrapper fixes.
        ids = _raw(token_selected_experts, (t, self.top_k))
        scales = _raw(token_final_scales, (t, self.top_k)).float()
        xv = _nvfp4_values(x, sf)
        w1 = _nvfp4_values(_raw(w1_weight, (el, 2 * i, h // 2)),
                           _raw_weight_scales(w1_weight_sf, el, 2 * i, h // vendor.NVFP4_BLOCK))
        w2 = _nvfp4_values(_raw(w2_weight, (el, h, i // 2)),
                           _raw_weight_scales(w2_weight_sf, el, h, i // vendor.NVFP4_BLOCK))
        alpha1, alpha2 = _raw(w1_alpha, (el,)), _raw(w2_alpha, (el,))
        fc2 = NVFP4Codec(WireFormat(md.DispatchDtype.NVFP4, i), float(_raw(fc2_input_scale, (1,))[0]))
        out = torch.zeros(t, h, dtype=torch.float32)
        local = ids.long() - self.local_expert_offset
        for e in range(el):
            tok, slot = (local == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            up, gate = _up_gate((xv[tok] @ w1[e].t()) * alpha1[e])
            inter = fc2.quantize(F.silu(gate) * up)
            gemm2 = (_nvfp4_values(inter.data, inter.scale) @ w2[e].t()) * alpha2[e]
            out.index_add_(0, tok, gemm2 * scales[tok, slot].unsqueeze(1))
        if self._VERSION < vendor.CUTEDSL_DENSE_ZERO_SINCE:  # torch.empty + a sparse memset of routed rows
            routed = ((local >= 0) & (local < el)).any(dim=1)
            out[~routed] = float("nan")
        return out.to(self.output_dtype)


# -- the signatures of each release range ----------------------------------------------------------


class Wrapper_0_6_4(CuteDslBase):  # noqa: N801 - v0.6.4-v0.6.6
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=4096, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda") -> None:
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None) -> torch.Tensor:
        return self._run(x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
                         fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic)


class Wrapper_0_6_7(Wrapper_0_6_4):  # noqa: N801 - v0.6.7-v0.6.13: enable_pdl
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=4096, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True) -> None:
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)


class Wrapper_0_6_14(Wrapper_0_6_4):  # noqa: N801 - v0.6.14: activation='silu', max_num_tokens=None
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True, activation="silu") -> None:
        if activation != "silu":
            raise NotImplementedError("fake CuteDslMoEWrapper implements W4A4 with SwiGLU (activation='silu')")
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)


def _default_swiglu(activation_type: Any, alpha: Any, beta: Any, limit: Any, situ_beta: Any = None) -> None:
    if activation_type != ActivationType.Swiglu.value or situ_beta is not None or (alpha, beta, limit) != (
            DEFAULT_SWIGLU_ALPHA, DEFAULT_SWIGLU_BETA, DEFAULT_SWIGLU_LIMIT):
        raise NotImplementedError("fake CuteDslMoEWrapper implements W4A4 with the default SwiGLU")


class Wrapper_0_6_15(Wrapper_0_6_4):  # noqa: N801 - v0.6.15: activation_type and the SwiGLU knobs
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True,
                 activation_type=ActivationType.Swiglu.value, swiglu_alpha=DEFAULT_SWIGLU_ALPHA,
                 swiglu_beta=DEFAULT_SWIGLU_BETA, swiglu_limit=DEFAULT_SWIGLU_LIMIT) -> None:
        _default_swiglu(activation_type, swiglu_alpha, swiglu_beta, swiglu_limit)
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)


class Wrapper_0_6_16(CuteDslBase):  # noqa: N801 - v0.6.16-v0.6.17: use_fused_finalize, run(per_token_scale=)
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True,
                 activation_type=ActivationType.Swiglu.value, swiglu_alpha=DEFAULT_SWIGLU_ALPHA,
                 swiglu_beta=DEFAULT_SWIGLU_BETA, swiglu_limit=DEFAULT_SWIGLU_LIMIT, use_fused_finalize=True) -> None:
        _default_swiglu(activation_type, swiglu_alpha, swiglu_beta, swiglu_limit)
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None, *, per_token_scale=None) -> torch.Tensor:
        self._check_x(x)
        if per_token_scale is not None:
            raise NotImplementedError("fake CuteDslMoEWrapper: per_token_scale is not emulated")
        return self._run(x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
                         fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic)

    def _check_x(self, x: Any) -> None:
        return None


class Wrapper_0_6_18(Wrapper_0_6_16):  # noqa: N801 - 0.6.18+: SiTU, quant_mode, the x dtype TypeError
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True,
                 activation_type=ActivationType.Swiglu.value, swiglu_alpha=DEFAULT_SWIGLU_ALPHA,
                 swiglu_beta=DEFAULT_SWIGLU_BETA, swiglu_limit=DEFAULT_SWIGLU_LIMIT, situ_beta=None,
                 situ_linear_beta=None, use_fused_finalize=True, quant_mode="w4a4") -> None:
        _default_swiglu(activation_type, swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta)
        if quant_mode != "w4a4":
            raise NotImplementedError("fake CuteDslMoEWrapper implements quant_mode='w4a4'")
        self.quant_mode = quant_mode
        self._init(num_experts, top_k, hidden_size, intermediate_size, num_local_experts, local_expert_offset,
                   sf_vec_size, output_dtype)

    def _check_x(self, x: Any) -> None:
        if x.dtype is not torch.uint8:
            raise TypeError("quant_mode='w4a4' requires packed uint8 input")


class Wrapper_0_7_4(Wrapper_0_6_18):  # noqa: N801 - 0.7.4: clamped_relu2_limit, swap_ab, run(nvfp4_4over6=)
    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph=False,
                 max_num_tokens=None, num_local_experts=None, local_expert_offset=0, tile_size=128, sf_vec_size=16,
                 output_dtype=torch.bfloat16, device="cuda", enable_pdl=True,
                 activation_type=ActivationType.Swiglu.value, swiglu_alpha=DEFAULT_SWIGLU_ALPHA,
                 swiglu_beta=DEFAULT_SWIGLU_BETA, swiglu_limit=DEFAULT_SWIGLU_LIMIT, situ_beta=None,
                 situ_linear_beta=None, use_fused_finalize=True, quant_mode="w4a4", clamped_relu2_limit=None,
                 swap_ab=False) -> None:
        if clamped_relu2_limit is not None or swap_ab:
            raise NotImplementedError("fake CuteDslMoEWrapper: clamped_relu2_limit and swap_ab are not emulated")
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, use_cuda_graph, max_num_tokens,
                         num_local_experts, local_expert_offset, tile_size, sf_vec_size, output_dtype, device,
                         enable_pdl, activation_type, swiglu_alpha, swiglu_beta, swiglu_limit, situ_beta,
                         situ_linear_beta, use_fused_finalize, quant_mode)

    def run(self, x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
            fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic=None, *, per_token_scale=None,
            nvfp4_4over6=UNSET) -> torch.Tensor:
        if nvfp4_4over6 is not UNSET:
            raise NotImplementedError("fake CuteDslMoEWrapper: nvfp4_4over6 is not emulated")
        return super().run(x, x_sf, token_selected_experts, token_final_scales, w1_weight, w1_weight_sf, w1_alpha,
                           fc2_input_scale, w2_weight, w2_weight_sf, w2_alpha, tactic, per_token_scale=per_token_scale)


__all__ = ["ActivationType", "CuteDslBase", "Wrapper_0_6_14", "Wrapper_0_6_15", "Wrapper_0_6_16", "Wrapper_0_6_18",
           "Wrapper_0_6_4", "Wrapper_0_6_7", "Wrapper_0_7_4"]
