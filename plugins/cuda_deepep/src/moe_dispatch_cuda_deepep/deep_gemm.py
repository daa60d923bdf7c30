"""DeepGEMM as the expert kernel between DeepEP's dispatch and combine (runner ``deep_gemm``).

``DeepGemmExperts`` implements the core's ``ExpertKernel``: gmm1 (``w13``, gate rows then up
rows) → SwiGLU → gmm2 (``w2``) per local expert on DeepGEMM's grouped GEMMs, rows in place,
no routing weights. Block-FP8 weights (e4m3, one fp32 scale per 128×128 block, sglang's
``*_weight_scale_inv``) take FP8 rows with per-(row, 128) scales; BF16 weights take BF16 rows.

- PACKED ``[rows, H]`` goes through the contiguous GEMM, whose layout needs every expert's rows
  in segments aligned to ``get_mk_alignment_for_contiguous_layout()`` (128) with ``m_indices``
  naming each row's expert (-1 for padding). The kernel reads the counts on the host (one
  sync; normal mode has synced for the layout already), copies the rows into a zero-padded
  buffer (rows·(H + scale) bytes written into at most rows + 127·E_local rows), runs both
  GEMMs on the padded rows and gathers the output rows back (rows·H·2 bytes).
- PACKED rows already at an ``expert_alignment`` that is a multiple of the mk alignment (the engine
  passes ``DispatchSpec(expert_alignment=experts.expert_alignment)``, built after any change it makes
  to DeepGEMM's mk alignment, which DeepGEMM 2.4.2+ lets it set at run time; DeepEP V2 writes that layout
  itself, the core copies other backends' rows into it) go through the contiguous GEMM as they are,
  without a copy of the rows (the scales are laid out as on the dense path; fp32 UE8M0 scales on SM100
  still cost the host check of ``_pack_fp32``, refused under capture): with DeepGEMM's PSUM layout
  (SM100 2.3+, SM90 2.4.2+: ``use_psum_layout=True``, ``grouped_layout`` = each expert's end row, the
  type-0 group list) or else ``m_indices`` made on the device (``moe_dispatch.backend.row_experts``;
  ``DeepGemmExperts(psum_layout=False)`` forces these). The output keeps the input's rows; its padding rows
  are whatever DeepGEMM left there (combine ignores them).
- MASKED ``[E_local, capacity, H]`` goes through the masked GEMM as it is, with
  ``masked_m`` = the counts and no host sync (CUDA-graph safe). ``expected_m`` is only a
  tile-size hint: ``layer.expected_m`` when set (``sglang_expected_m``), else the capacity.
  Rows past an expert's count are zeroed with one ``where`` over the output, whatever
  DeepGEMM left there. DeepGEMM stores whole BLOCK_M-row tiles into one ``[E·capacity, N]``
  view, so with more than one expert the capacity must be a multiple of every BLOCK_M the
  installed version may pick (``masked_capacity_multiple``: 128 on 2.1.1+ SM90 and 2.4.2+ SM100 (its
  mk alignment), 256 on 2.0.0 and 2.1.0, which report no version, and on v1), else one expert's last tile
  overwrites the next expert's first rows;
  a typed error, and ``DeepEPBackend.check_spec`` refuses such a spec at creation.

Between the GEMMs the FP8 path re-quantizes SwiGLU's output per row and 128 channels with
scale ``max(amax, 1e-10)/448`` (sglang ``per_token_group_quant_fp8`` /
``silu_and_mul_masked_post_quant_fwd``), rounded up to powers of two for a UE8M0 layer, packed
four per int32 when the dispatched scales came packed (DeepGEMM's SM100 format).

Scale formats follow the GPU (``vendor.device_capability``): SM90 takes fp32 scales only, which the runner hands over
MN-major and TMA-aligned, laid out with torch ops (``vendor.dg_mn_major``), so that DeepGEMM's own transform returns them
as they are and JIT-compiles no transpose kernel (its first kernel otherwise, compiled at the first call); SM100 takes
packed UE8M0 (four exponent bytes per int32, MN-major with a
TMA-aligned stride, which the runner lays out with DeepGEMM's ``get_tma_aligned_size`` and packs with its
``get_mn_major_tma_aligned_packed_ue8m0_tensor`` when installed, the ports in ``vendor`` otherwise). fp32 scales
handed to the runner on SM100 (they must be powers of two: a typed error otherwise; the rows past each expert's count
in masked layout are ignored; under CUDA-graph capture, where the check cannot run, a typed error) are
packed by the runner itself, contiguous, with that helper: DeepGEMM's own cast of MN-major fp32 scales asserts
``mn % 4 == 0 and num_groups == 1`` in some 2.0.0 builds, device-asserts powers of two from 2.6.1 and packs
garbage exponents for anything else before it. Powers of two are taken by bits (the core's ``pow2_ceil``, as
DeepGEMM's ``ceil_to_ue8m0``), never by ``exp2(ceil(log2))``. ``ue8m0=None`` picks the device's format; the other
one is refused (VENDOR.md).

The DeepGEMM generation installed is found by its attributes (``detect``): 2.x
(deepseek-ai/DeepGEMM ``csrc/apis/gemm.hpp``, ``deep_gemm/__init__.py``; PR #112 and later)
has ``m_grouped_fp8_gemm_nt_{contiguous,masked}`` (early alias ``fp8_m_grouped_gemm_nt_masked``)
and later ``m_grouped_bf16_gemm_nt_*``; v1 (``deep_gemm/jit_kernels/m_grouped_gemm.py``) has
``m_grouped_gemm_fp8_fp8_bf16_nt_*`` and no BF16. Calls pass the first arguments positionally:
the newest versions renamed ``m_indices`` to ``grouped_layout``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.backend import (
    FP8_MAX,
    dequantized_weights,
    group_counts,
    group_starts,
    pow2_ceil,
    row_experts,
    swiglu,
)

from . import vendor
from .vendor import DeepGemmInfo

REAL = vendor.DEEP_GEMM
#: The runner's registered name: the module it runs.
RUNNER = vendor.DEEP_GEMM
INSTALL_HINT = vendor.DEEP_GEMM_INSTALL_HINT
BLOCK = vendor.DG_BLOCK
WEIGHT_KINDS = ("block_fp8", "bf16")
#: Block amax floor of DeepGEMM's ``per_block_cast_to_fp8`` (weights) and of sglang's
#: ``per_token_group_quant_fp8`` (the intermediate activations).
WEIGHT_AMAX_FLOOR, ACT_AMAX_FLOOR = 1e-4, 1e-10
#: SM90 BF16 grouped GEMMs assert ``k % 64 == 0`` (deepseek-ai/DeepGEMM@54e2261
#: csrc/jit_kernels/impls/sm90_bf16_gemm.hpp), for both GEMMs: H and I.
SM90_BF16_K_MULTIPLE = 64
#: BF16 rows of H and I elements need 16-byte strides for DeepGEMM's TMA descriptors (any architecture).
BF16_ROW_MULTIPLE = vendor.TMA_STRIDE_BYTES // 2

detect = vendor.detect_deep_gemm


def runner_probe(module: str = REAL) -> str | None:
    """Why the ``deep_gemm`` runner cannot run here (None: it can), without importing DeepGEMM
    (its import initializes its CUDA JIT): the package and a CUDA device."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module} is not installed; {INSTALL_HINT}"
    if module == REAL and not torch.cuda.is_available():
        return "no CUDA device"
    return None


# -- weights ----------------------------------------------------------------------------------------


def quantize_block_fp8(w: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` → e4m3 ``[E, N, K]`` and fp32 ``[E, N/128, K/128]``: scale = block amax/448
    (DeepGEMM ``per_block_cast_to_fp8``; rounded up to a power of two with ``ue8m0``)."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp_min(WEIGHT_AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(e, n, k)
    return q, scale.reshape(e, n // BLOCK, k // BLOCK)


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)


@dataclass(frozen=True)
class DeepGemmLayer:
    """A layer's local experts as DeepGEMM takes them (sglang's attribute names).

    ``block_fp8``: ``w13_weight`` e4m3 ``[E, 2I, H]`` with ``w13_weight_scale_inv`` fp32
    ``[E, 2I/128, H/128]``, ``w2_weight`` ``[E, H, I]`` with ``[E, H/128, I/128]``; ``ue8m0``:
    the scales are powers of two (what SM100's UE8M0 path needs). ``bf16``: bf16 weights, no
    scales. ``expected_m``: the masked GEMM's hint (None: the capacity).
    """

    weights: str
    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    w13_weight_scale_inv: torch.Tensor | None = None
    w2_weight_scale_inv: torch.Tensor | None = None
    ue8m0: bool = False
    expected_m: int | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13_weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w13_weight.shape[2])

    @property
    def intermediate_size(self) -> int:
        return int(self.w2_weight.shape[2])

    def dequantized(self) -> md.ExpertWeights:
        """fp32 weights, exactly what the kernel multiplies by (for ``TorchExperts``/``reference_moe``)."""
        if self.weights == "bf16":
            return md.ExpertWeights(self.w13_weight.float(), self.w2_weight.float())
        assert self.w13_weight_scale_inv is not None and self.w2_weight_scale_inv is not None
        return md.ExpertWeights(dequantize_block_fp8(self.w13_weight, self.w13_weight_scale_inv),
                                dequantize_block_fp8(self.w2_weight, self.w2_weight_scale_inv))

    def slice(self, first: int, count: int) -> "DeepGemmLayer":
        """Experts ``first .. first+count-1`` (a rank's share; block scales are per expert)."""
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[first : first + count]

        return dataclasses.replace(self, w13_weight=cut(self.w13_weight), w2_weight=cut(self.w2_weight),
                                   w13_weight_scale_inv=cut(self.w13_weight_scale_inv),
                                   w2_weight_scale_inv=cut(self.w2_weight_scale_inv))

    def to(self, device: torch.device | str) -> "DeepGemmLayer":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(self, w13_weight=move(self.w13_weight), w2_weight=move(self.w2_weight),
                                   w13_weight_scale_inv=move(self.w13_weight_scale_inv),
                                   w2_weight_scale_inv=move(self.w2_weight_scale_inv))


def sglang_expected_m(spec: md.DispatchSpec, world_size: int) -> int:
    """sglang's ``expected_m`` for the masked GEMM: (T·R·top_k + E) // E, the mean rows per
    expert if routing were uniform, known without reading the counts."""
    t, e = spec.num_max_dispatch_tokens_per_rank, spec.num_experts
    return max(1, (t * world_size * spec.top_k + e) // e)


# -- the kernel -----------------------------------------------------------------------------------------


def quantize_per_token_group(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` → e4m3 and fp32 ``[..., K/128]`` with scale max(amax, 1e-10)/448 (sglang
    ``per_token_group_quant_fp8``; rounded up to a power of two with ``ue8m0``)."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), scale.squeeze(-1)


class DeepGemmExperts:
    """DeepGEMM grouped GEMMs as an ``md.ExpertKernel``.

    :param weights: ``"block_fp8"`` (FP8 rows in) or ``"bf16"`` (BF16 rows in).
    :param mode: the dispatch mode; it decides the wire dtype of BF16 weights.
    :param module: the ``deep_gemm`` module name (or a module object), imported here, not when
        this plugin is imported; tests pass a fake's module path.
    :param ue8m0: block-FP8 with power-of-two (UE8M0) scales, DeepGEMM's SM100 format; the
        dispatcher is then asked for UE8M0 scales too. None (the default): what the GPU needs (True on
        compute capability 10.x, False on 9.x); the other value there is an ``InvalidSpecError``.
    :raises md.BackendUnavailableError: DeepGEMM is missing, or lacks what was asked for, or the GPU is
        not one DeepGEMM's grouped GEMMs run on.
    """

    def __init__(self, weights: str, mode: md.Mode | str, module: str | ModuleType | Any = REAL, *,
                 ue8m0: bool | None = None, psum_layout: bool | None = None) -> None:
        if weights not in WEIGHT_KINDS:
            raise md.InvalidSpecError("unknown DeepGEMM weight format", parameter="weights", value=weights,
                                      allowed=", ".join(WEIGHT_KINDS))
        self.weights, self.mode = weights, md.Mode.parse(mode)
        self.info = info = detect(module)
        if info.module is None or info.generation is None:
            raise md.BackendUnavailableError(
                f"cannot run the DeepGEMM expert kernel: {info.describe()}; {INSTALL_HINT}", parameter="runner",
                value=RUNNER, allowed="an installed DeepGEMM (v1 or 2.x), or another runner")
        if weights == "bf16" and not info.has_bf16:
            raise md.BackendUnavailableError(
                f"{info.describe()}: BF16 weights need m_grouped_bf16_gemm_nt_contiguous/_masked (DeepGEMM 2.x, SM90+)",
                parameter="weights", value="bf16", allowed="block_fp8 with this DeepGEMM, or a newer DeepGEMM")
        self.arch = self._arch(info)
        self.ue8m0 = self._scale_format(weights, ue8m0, info)
        has_psum = vendor.dg_has_psum_layout(info, self.arch)
        if psum_layout and not has_psum:
            raise md.BackendUnavailableError(
                f"{info.describe()} has no PSUM layout for aligned rows on this GPU (SM100 from 2.3, SM90 from 2.4.2)",
                parameter="psum_layout", value=True, allowed="None (use it where the version has it) or False")
        #: aligned rows as DeepGEMM's PSUM layout, else per-row m_indices (False forces those: the hardware check)
        self._psum_layout = has_psum and psum_layout is not False
        self._contiguous_fn, self._masked_fn = info.functions(weights)
        if self._contiguous_fn is None or self._masked_fn is None:
            raise md.BackendUnavailableError(f"{info.describe()}: lacks a contiguous or masked grouped GEMM",
                                             parameter="runner", value=RUNNER, allowed="DeepGEMM v1 or 2.x")
        # Block-FP8 weights: FP8 in both modes. BF16 weights: BF16. sglang (PR #25540) sends BF16
        # only for unquantized layers on the DeepGEMM runner in low-latency mode and keeps FP8 in
        # normal mode; here normal mode uses DeepGEMM's contiguous BF16 GEMM
        # (m_grouped_bf16_gemm_nt_contiguous) instead, the one place this kernel differs.
        self.needs_dispatch_dtype: md.DispatchDtype = (
            md.DispatchDtype.FP8 if weights == "block_fp8" else md.DispatchDtype.BF16)

    @staticmethod
    def _arch(info: DeepGemmInfo) -> int | None:
        """The compute-capability major the kernels run on (None: no GPU to ask). v1 runs on SM90 only;
        2.x has grouped GEMMs for SM90 and SM100."""
        capability = vendor.device_capability(info.module)
        if info.generation == "v1":
            if capability is not None and capability[0] != vendor.DG_ARCH_SM90:
                raise md.BackendUnavailableError(f"{info.describe()} runs on SM90 only, not compute capability "
                                                 f"{capability[0]}.{capability[1]}", parameter="runner",
                                                 value=RUNNER, allowed="DeepGEMM 2.x on this GPU")
            return vendor.DG_ARCH_SM90
        if capability is not None and capability[0] not in (vendor.DG_ARCH_SM90, vendor.DG_ARCH_SM100):
            raise md.BackendUnavailableError(f"DeepGEMM's grouped GEMMs run on SM90 and SM100, not compute capability "
                                             f"{capability[0]}.{capability[1]}", parameter="runner", value=RUNNER,
                                             allowed="an SM90 (Hopper) or SM100 (Blackwell) GPU")
        return None if capability is None else capability[0]

    def _scale_format(self, weights: str, ue8m0: bool | None, info: DeepGemmInfo) -> bool:
        """UE8M0 scales exactly where DeepGEMM needs them: on SM100 it casts fp32 scales to UE8M0 (from 2.6.1
        asserting powers of two on the device, before it packing garbage exponents), on SM90 it takes
        fp32 only (and v1 is SM90-only). ``None`` picks the device's; the other one is a typed error."""
        if weights == "bf16":
            if ue8m0:
                raise md.InvalidSpecError("UE8M0 scales exist only for block-FP8 weights", parameter="ue8m0",
                                          value=True, allowed="False for bf16 weights")
            return False
        needed = self.arch == vendor.DG_ARCH_SM100
        if ue8m0 is None:
            return needed
        if self.arch is not None and bool(ue8m0) != needed:
            cc = f"{self.arch}.x"
            why = ("DeepGEMM casts fp32 scales to UE8M0 there (a device assert for non-powers of two from 2.6.1, "
                   "garbage exponents before)" if needed else "DeepGEMM's SM90 kernels take fp32 scales only")
            raise md.InvalidSpecError(f"block-FP8 on compute capability {cc} needs ue8m0={needed}: {why}",
                                      parameter="ue8m0", value=bool(ue8m0),
                                      allowed=f"{needed} or None (chosen by the device) on compute capability {cc}")
        return bool(ue8m0)

    @property
    def masked_capacity_multiple(self) -> int:
        """What the masked GEMM needs of the capacity (R·T) when a rank holds more than one expert: a multiple of
        every BLOCK_M this DeepGEMM may pick (``vendor.dg_masked_block_ms``)."""
        return vendor.dg_masked_capacity_multiple(self.info, self.arch, vendor.mk_alignment(self.info.module))

    @property
    def expert_alignment(self) -> int:
        """The ``DispatchSpec(expert_alignment=...)`` that hands this kernel PACKED rows it runs without a copy:
        DeepGEMM's ``get_mk_alignment_for_contiguous_layout()`` (128)."""
        return vendor.mk_alignment(self.info.module)

    @property
    def psum_layout(self) -> bool:
        """Aligned rows go to the contiguous GEMMs as DeepGEMM's PSUM layout (SM100 from 2.3, SM90 from 2.4.2, unless
        the constructor's ``psum_layout=False``), else with per-row ``m_indices``."""
        return self._psum_layout

    def quant_hints(self) -> md.QuantHints:
        """What to pass as ``DispatchSpec(quant=...)`` so resolution sends this kernel's dtype."""
        return md.QuantHints(dispatcher_output_dtype=self.needs_dispatch_dtype, fp8_ue8m0_scales=self.ue8m0)

    def process_weights(self, weights: md.ExpertWeights) -> DeepGemmLayer:
        """bf16/fp32 (or W8A8 int8) expert weights → this kernel's format."""
        w13, w2 = dequantized_weights(weights)
        e, two_i, h = w13.shape
        if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
            raise md.InvalidInputError("w13 must be [E, 2I, H] and w2 [E, H, I]", parameter="w2_weight", value=w2,
                                       allowed=f"[{e}, {h}, {two_i // 2}]")
        if self.weights == "bf16":
            for name, size in (("hidden_size", h), ("intermediate_size", two_i // 2)):
                if self.arch == vendor.DG_ARCH_SM90 and size % SM90_BF16_K_MULTIPLE:
                    raise md.InvalidInputError("DeepGEMM's SM90 BF16 grouped GEMMs need K % 64 == 0 (H for gmm1, "
                                               "I for gmm2)", parameter=name, value=size, allowed="multiples of 64")
                if size % BF16_ROW_MULTIPLE:
                    raise md.InvalidInputError("DeepGEMM's TMA descriptors need 16-byte row strides: BF16 rows of "
                                               "H and I elements (cuTensorMapEncodeTiled fails otherwise)",
                                               parameter=name, value=size, allowed="multiples of 8")
            return DeepGemmLayer("bf16", w13.to(torch.bfloat16), w2.to(torch.bfloat16))
        for name, size in (("hidden_size", h), ("intermediate_size", two_i // 2)):
            if size % BLOCK:
                raise md.InvalidInputError("block-FP8 weights need 128-aligned GEMM dims", parameter=name,
                                           value=size, allowed="multiples of 128")
            if not self.info.compiles_odd_k_blocks and (size // BLOCK) % 2:
                raise md.InvalidInputError(
                    f"{self.info.describe()} may be PyPI's 1.0.0 (b05ed2f; it has no {vendor.DG_V1_ODD_K_FIXED_MARKER}),"
                    " whose kernel fails to compile (\"Misaligned barriers\") for an odd number of 128-blocks of K",
                    parameter=name, value=size, allowed="multiples of 256 with this DeepGEMM, or a v1 from 2025-05 on")
        q13, s13 = quantize_block_fp8(w13, self.ue8m0)
        q2, s2 = quantize_block_fp8(w2, self.ue8m0)
        return DeepGemmLayer("block_fp8", q13, q2, s13, s2, ue8m0=self.ue8m0)

    def apply_without_routing_weights(
        self,
        layer: Any,
        hidden_states: torch.Tensor,
        hidden_states_scale: torch.Tensor | None,
        group_list_type: int,
        group_list: torch.Tensor,
        output_dtype: torch.dtype,
        *,
        global_scale: float | None = None,
        expert_alignment: int = 1,
    ) -> torch.Tensor:
        """gmm1 → SwiGLU → gmm2 per local expert; PACKED ``[rows, H]`` (dense, or each expert's rows at a
        multiple of ``expert_alignment``) or MASKED ``[E, capacity, H]``."""
        self._check_layer(layer)
        packed_scales = self._check_rows(layer, hidden_states, hidden_states_scale)
        experts = layer.num_experts
        if group_list_type not in (0, 1):
            raise md.InvalidInputError("unknown group_list_type", parameter="group_list_type", value=group_list_type,
                                       allowed="0 (cumulative ends), 1 (counts)")
        if tuple(group_list.shape) != (experts,):
            raise md.InvalidInputError("needs one entry per local expert", parameter="group_list", value=group_list,
                                       allowed=f"[{experts}]")
        counts = group_counts(group_list.to(torch.int64), group_list_type, expert_alignment)
        if hidden_states.dim() == 3:
            out = self._masked(layer, hidden_states, hidden_states_scale, counts, packed_scales)
        elif expert_alignment > 1:
            out = self._aligned(layer, hidden_states, hidden_states_scale, counts, packed_scales, expert_alignment)
        else:
            out = self._contiguous(layer, hidden_states, hidden_states_scale, counts, packed_scales)
        return out.to(output_dtype)

    # -- checks -------------------------------------------------------------------------------------

    def _check_layer(self, layer: Any) -> None:
        if not isinstance(layer, DeepGemmLayer) or layer.weights != self.weights:
            raise md.InvalidInputError(f"a {self.weights} DeepGEMM kernel needs its own weight format",
                                       parameter="layer", value=type(layer).__name__,
                                       allowed=f"DeepGemmExperts({self.weights!r}, ...).process_weights(weights)")

    def _check_rows(self, layer: DeepGemmLayer, x: torch.Tensor, scale: torch.Tensor | None) -> bool:
        """Dtype, shape and scale checks; returns whether the scales are packed UE8M0 (int32)."""
        want = torch.float8_e4m3fn if self.weights == "block_fp8" else torch.bfloat16
        h = layer.hidden_size
        if x.dtype != want or x.dim() not in (2, 3):
            raise md.InvalidInputError(
                f"DeepGEMM {self.weights} experts take {want} rows; pass DeepGemmExperts.quant_hints() as "
                "DispatchSpec(quant=...) so dispatch sends that dtype", parameter="hidden_states", value=x,
                allowed=f"{want} [rows, {h}] or [E_local, capacity, {h}]")
        if x.shape[-1] != h or h % BLOCK:
            raise md.InvalidInputError("hidden size must match the weights and be a multiple of 128",
                                       parameter="hidden_states", value=x, allowed=f"[..., {h}] with {h} % 128 == 0")
        if want == torch.bfloat16:
            if scale is not None:
                raise md.InvalidInputError("BF16 rows carry no scales", parameter="hidden_states_scale", value=scale,
                                           allowed="None")
            return False
        lead = tuple(x.shape[:-1])
        fp32_shape, int_shape = (*lead, h // BLOCK), (*lead, -(-h // (4 * BLOCK)))
        if scale is None or not ((scale.dtype == torch.float32 and tuple(scale.shape) == fp32_shape)
                                 or (scale.dtype == torch.int32 and tuple(scale.shape) == int_shape)):
            raise md.InvalidInputError("FP8 rows need one scale per 128 channels", parameter="hidden_states_scale",
                                       value=scale, allowed=f"float32 {list(fp32_shape)} or int32 (packed UE8M0) "
                                                            f"{list(int_shape)}")
        if scale.dtype == torch.int32 and not layer.ue8m0:
            raise md.InvalidInputError(
                "packed UE8M0 activation scales need weights with power-of-two scales (DeepGEMM's SM100 path casts "
                "fp32 weight scales down to their exponent)", parameter="hidden_states_scale", value=scale,
                allowed="fp32 scales, or a layer from DeepGemmExperts(..., ue8m0=True).process_weights")
        return scale.dtype == torch.int32

    # -- the two layouts ----------------------------------------------------------------------------

    def _gemm(self, contiguous: bool, a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
              w_scale: torch.Tensor | None, d: torch.Tensor, groups: torch.Tensor, expected_m: int = 0,
              psum: bool = False) -> None:
        fn = self._contiguous_fn if contiguous else self._masked_fn
        lhs: Any = a if self.weights == "bf16" else (a, a_scale)
        rhs: Any = w if self.weights == "bf16" else (w, w_scale)
        if psum:
            fn(lhs, rhs, d, groups, **{vendor.DG_USE_PSUM_LAYOUT: True})
        elif contiguous:
            if self.info.generation == "v1":  # what #113 (0c88cd0) does in the kernel, for the v1 builds before it
                groups = groups.clamp(min=0)
            fn(lhs, rhs, d, groups)
        else:
            fn(lhs, rhs, d, groups, expected_m)

    def _pack_fp32(self, scale: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 activation scales on SM100 → packed UE8M0, MN-major, TMA-aligned, with DeepGEMM's own helper on a
        contiguous copy (its cast of MN-major fp32 scales asserts ``mn % 4 == 0 and num_groups == 1`` in 2.0.0 builds
        of 2025-07-18 .. 07-29 and 08-02 .. 08-04, deepseek-ai/DeepGEMM@9da4a23 smxx_layout.hpp). They must be powers
        of two (2.6.1's pack kernels device-assert it, earlier ones pack garbage exponents): checked here, a host
        read, so refused under CUDA-graph capture. ``valid``: the rows that hold data (masked layout: rows past each
        expert's count are DeepEP's ``torch::empty``), the others packed as 1.0."""
        if vendor.stream_capturing(self.info.module):
            raise md.InvalidInputError(
                "fp32 activation scales on SM100 under CUDA-graph capture: DeepGEMM casts them to UE8M0 and only "
                "powers of two survive (2.6.1 device-asserts, earlier versions pack garbage exponents), which cannot "
                "be checked while capturing (a host read)", parameter="hidden_states_scale", value=scale,
                allowed="packed int32 UE8M0 (a spec with experts.quant_hints(): QuantHints(fp8_ue8m0_scales=True))")
        scale = scale.float()
        if valid is not None:
            scale = torch.where(valid, scale, torch.ones((), dtype=scale.dtype, device=scale.device))
        bits = scale.contiguous().view(torch.int32)
        if bool(((bits & 0x807FFFFF) != 0).any()):
            raise md.InvalidInputError(
                "fp32 scales on SM100 must be powers of two: DeepGEMM casts them to UE8M0 (2.6.1 device-asserts, "
                "earlier versions pack garbage exponents)", parameter="hidden_states_scale", value=scale,
                allowed="power-of-two fp32 scales (QuantHints(fp8_ue8m0_scales=True)), or packed int32 UE8M0")
        return vendor.dg_packed_ue8m0_mn_major(self.info.module, scale.contiguous())

    def _between(self, layer: DeepGemmLayer, h: torch.Tensor, valid: torch.Tensor, packed: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """SwiGLU on gmm1's bf16 output (invalid rows zeroed), then gmm2's input."""
        act = torch.where(valid, swiglu(h.float()), 0.0)
        if self.weights == "bf16":
            return act.to(torch.bfloat16), None
        q, scale = quantize_per_token_group(act, layer.ue8m0)
        module = self.info.module
        return q, vendor.dg_packed_ue8m0_mn_major(module, scale) if packed else vendor.dg_mn_major(module, scale)

    def _scales(self, scale: torch.Tensor | None, packed: bool, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, bool]:
        """The activation scales laid out as DeepGEMM's kernels read them, so that it transforms none: MN-major and
        TMA-aligned, packed UE8M0 (SM100) or fp32 (SM90: ``vendor.dg_mn_major``, torch ops); fp32 on SM100 packed
        first (``_pack_fp32``, ``valid`` its rows). Returns them and whether they are packed."""
        if scale is None:
            return None, packed
        if not packed and self.arch == vendor.DG_ARCH_SM100:
            return self._pack_fp32(scale, valid), True
        return vendor.dg_mn_major(self.info.module, scale), packed

    def _contiguous(self, layer: DeepGemmLayer, x: torch.Tensor, scale: torch.Tensor | None, counts: torch.Tensor,
                    packed: bool) -> torch.Tensor:
        rows, h = x.shape
        if vendor.stream_capturing(self.info.module):
            raise md.InvalidInputError(
                "dense PACKED rows (expert_alignment 1) are padded to DeepGEMM's layout from the counts, a host read, "
                "which CUDA-graph capture cannot make", parameter="expert_alignment", value=1,
                allowed=f"DispatchSpec(expert_alignment=experts.expert_alignment) ({self.expert_alignment}): the "
                        "aligned rows run as they are, with no host read")
        host = [int(c) for c in counts.tolist()]  # host sync: the padded layout is sized from the counts
        if min(host, default=0) < 0 or sum(host) > rows:
            raise md.InvalidInputError(f"counts {host} must be >= 0 and add up to at most the {rows} rows",
                                       parameter="group_list", value=host, allowed="per-expert counts of the rows")
        # Rows past the counts' sum: low latency's worst case (DispatchOutput), padding, their output zero.
        valid = sum(host)
        x, scale = x[:valid], (scale[:valid] if scale is not None else None)
        align = vendor.mk_alignment(self.info.module)
        padded = [-(-c // align) * align for c in host]
        total, device = sum(padded), x.device
        if total == 0:
            return torch.zeros(rows, h, dtype=torch.bfloat16, device=device)
        seg_start = torch.tensor([0, *itertools.accumulate(padded)][:-1], device=device)
        src_start = torch.tensor([0, *itertools.accumulate(host)][:-1], device=device)
        expert = torch.repeat_interleave(torch.arange(len(host), device=device), counts.to(device), output_size=valid)
        dest = seg_start[expert] + torch.arange(valid, device=device) - src_start[expert]
        m_indices = torch.full((total,), -1, dtype=torch.int32, device=device)
        m_indices[dest] = expert.to(torch.int32)
        a = torch.zeros(total, h, dtype=x.dtype, device=device)
        _bytes(a)[dest] = _bytes(x)
        a_scale = None
        if scale is not None:
            a_scale = torch.zeros(total, scale.shape[-1], dtype=scale.dtype, device=device)
            a_scale[dest] = scale
            a_scale, packed = self._scales(a_scale, packed)
        h1 = torch.empty(total, 2 * layer.intermediate_size, dtype=torch.bfloat16, device=device)
        self._gemm(True, a, a_scale, layer.w13_weight, layer.w13_weight_scale_inv, h1, m_indices)
        act, act_scale = self._between(layer, h1, (m_indices >= 0).unsqueeze(1), packed)
        h2 = torch.empty(total, h, dtype=torch.bfloat16, device=device)
        self._gemm(True, act, act_scale, layer.w2_weight, layer.w2_weight_scale_inv, h2, m_indices)
        if valid == rows:
            return h2.index_select(0, dest)
        out = torch.zeros(rows, h, dtype=torch.bfloat16, device=device)
        out[:valid] = h2.index_select(0, dest)
        return out

    def _aligned(self, layer: DeepGemmLayer, x: torch.Tensor, scale: torch.Tensor | None, counts: torch.Tensor,
                 packed: bool, alignment: int) -> torch.Tensor:
        """Rows already in DeepGEMM's contiguous layout (each expert at a multiple of ``alignment``, padding zero):
        both GEMMs on them as they are, no copy, no host read."""
        mk = self.expert_alignment
        rows, h = x.shape
        if alignment % mk or rows % mk:
            raise md.InvalidInputError(
                f"DeepGEMM's contiguous GEMM takes each expert's rows at a multiple of its mk alignment ({mk}) and "
                f"whole blocks of {mk} rows", parameter="expert_alignment", value=alignment,
                allowed=f"a multiple of {mk} (DispatchSpec(expert_alignment=experts.expert_alignment)), rows a "
                        f"multiple of {mk}, or 1 (dense rows: the runner pads them itself)")
        device = x.device
        if rows == 0:
            return torch.zeros(0, h, dtype=torch.bfloat16, device=device)
        counts = counts.to(device)
        expert = row_experts(counts, alignment, rows)
        psum = self.psum_layout
        # PSUM: each expert's end row (DeepEP V2's psum_num_recv_tokens_per_expert); else each row's expert, -1 padding
        groups = (group_starts(counts, alignment) + counts if psum else expert).to(torch.int32).contiguous()
        scale, packed = self._scales(scale, packed, (expert >= 0).unsqueeze(1))  # padding rows: a worst case's garbage
        h1 = torch.empty(rows, 2 * layer.intermediate_size, dtype=torch.bfloat16, device=device)
        self._gemm(True, x, scale, layer.w13_weight, layer.w13_weight_scale_inv, h1, groups, psum=psum)
        act, act_scale = self._between(layer, h1, (expert >= 0).unsqueeze(1), packed)
        h2 = torch.empty(rows, h, dtype=torch.bfloat16, device=device)
        self._gemm(True, act, act_scale, layer.w2_weight, layer.w2_weight_scale_inv, h2, groups, psum=psum)
        return h2

    def _masked(self, layer: DeepGemmLayer, x: torch.Tensor, scale: torch.Tensor | None, counts: torch.Tensor,
                packed: bool) -> torch.Tensor:
        experts, capacity, h = x.shape
        if experts != layer.num_experts:
            raise md.InvalidInputError("masked layout needs one block per local expert", parameter="hidden_states",
                                       value=x, allowed=f"[{layer.num_experts}, capacity, {h}]")
        device = x.device
        if capacity == 0:
            return torch.zeros(experts, 0, h, dtype=torch.bfloat16, device=device)
        multiple = self.masked_capacity_multiple
        if experts > 1 and capacity % multiple:
            raise md.InvalidInputError(
                "DeepGEMM's masked GEMM stores whole BLOCK_M-row tiles into one [experts · capacity, N] view: a "
                "capacity that is not a multiple of every BLOCK_M it may pick lets one expert's last tile overwrite "
                "the next expert's first rows (DeepGEMM issues #15, #268)", parameter="hidden_states", value=x,
                allowed=f"capacity (DeepEP LL: num_ranks · num_max_dispatch_tokens_per_rank) a multiple of {multiple}")
        masked_m = counts.to(device=device, dtype=torch.int32).contiguous()
        valid = (torch.arange(capacity, device=device).unsqueeze(0) < masked_m.unsqueeze(1)).unsqueeze(2)
        scale, packed = self._scales(scale, packed, valid)
        expected_m = int(layer.expected_m or capacity)  # a hint; reading the counts would sync the host
        h1 = torch.empty(experts, capacity, 2 * layer.intermediate_size, dtype=torch.bfloat16, device=device)
        self._gemm(False, x, scale, layer.w13_weight, layer.w13_weight_scale_inv, h1, masked_m, expected_m)
        act, act_scale = self._between(layer, h1, valid, packed)
        h2 = torch.empty(experts, capacity, h, dtype=torch.bfloat16, device=device)
        self._gemm(False, act, act_scale, layer.w2_weight, layer.w2_weight_scale_inv, h2, masked_m, expected_m)
        return torch.where(valid, h2, torch.zeros((), dtype=h2.dtype, device=device))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte dtypes as uint8 (CPU index_put has no float8 kernel); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


__all__ = [
    "INSTALL_HINT",
    "REAL",
    "DeepGemmExperts",
    "DeepGemmInfo",
    "DeepGemmLayer",
    "detect",
    "quantize_block_fp8",
    "quantize_per_token_group",
    "runner_probe",
    "sglang_expected_m",
]
