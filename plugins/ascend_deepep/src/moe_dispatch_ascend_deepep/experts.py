"""torch_npu expert kernels between DeepEP-Ascend's dispatch and combine.

``NpuExperts(scheme)`` implements the core's ``ExpertKernel`` for the schemes engines ship on
Atlas A2/A3, with the op sequences of sglang's ``apply_without_routing_weights``
(sgl-project/sglang ``python/sglang/srt/hardware_backend/npu/quantization/fused_moe_method_npu.py``
@007baab6e1d2, W4A8 also ``.../npu/quantization/w4a8_moe.py`` @7ffe0f623146):

=======  ========  ==============================================================================
scheme   dispatch  ops
=======  ========  ==============================================================================
w8a8     INT8      int8 gmm → int32; ``npu_dequant_swiglu_quant`` (w13 scale × token scale, SwiGLU
                   with ``activate_left``, per-token requant); int8 gmm with bf16 ``scale`` and
                   ``per_token_scale`` → bf16
w4a8     INT8      int8 × int4 gmm (CANN A8W4) with per-group uint64 scales (group 256), the
                   required ``scale_bias`` = 8·Σ_k(w·s) and ``per_token_scale`` → bf16;
                   ``npu_swiglu``; ``npu_dynamic_quant``; the same for w2
w4a4     BF16      ``npu_dynamic_quant(dst_type=quint4x2)``; int4 × int4 gmm (per-channel uint64
                   scale) → bf16; ``npu_swiglu``; int8 requant; int8 gmm (w2 is int8, as in sglang)
w4a16    BF16      bf16 × int4 gmm with per-group ``antiquant_scale``/``antiquant_offset``;
                   ``npu_swiglu``; the same for w2
bf16     BF16      bf16 gmm; ``npu_swiglu``; bf16 gmm
=======  ========  ==============================================================================

Every gmm is ``npu_grouped_matmul([x], [w], split_item=2, group_type=0, group_list=...,
group_list_type=...)`` with the weight as one ``[E, K, N]`` tensor: the core's ``w13 [E, 2I, H]``
and ``w2 [E, H, I]`` transposed, as sglang's ``process_weights_after_loading`` does. Where
this differs from sglang, on purpose:

- ``npu_dequant_swiglu_quant``'s ``group_index`` takes per-expert **counts** only (its doc);
  sglang passes ``group_list`` whatever its type. The kernel passes counts; the grouped
  matmuls get the caller's list and type (0 cumulative ends, 1 counts) as they came, except
  W4A8's: CANN's A8W4 kernel reads the list as counts whatever the type says, so it gets counts.
- W4A8's ``scale_bias`` is what CANN's A8W4 (MSD) kernel requires, ``8·Σ_k(w·s)`` per expert and
  output channel (``vendor.a8w4_scale_bias``): the kernel computes ``(x − 8)@(w·s) + bias``.
- W4A16 packs its int4 weights on the host (``pack_int4``, the layout ``npu_convert_weight_to_int4pack``
  returns): that op has an NPU kernel only, and weights are processed wherever they are.
- ``npu_grouped_matmul`` rejects ``group_list_type=1`` with a length-1 list (its doc): with one
  local expert the kernel passes the same list as cumulative ends (type 0).
- Zero rows never reach the ops (``npu_swiglu`` takes no empty tensor): an empty ``[0, H]``.
- MASKED ``[E, capacity, H]`` (cheap here): the rows are flattened, each expert's block run as
  a group of ``capacity`` rows, and rows past an expert's count zeroed afterwards.

The ops come from ``module``: ``torch_npu`` (imported when the kernel is built, not when this
plugin is imported) or a stand-in of the same ops, by name or as a module (the CPU fake of
moe-dispatch-ascend-deepep-testing). Reading ``group_list`` for validation and the MASKED mask
costs one host sync per call.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.backend import dequantized_weights, group_counts, quantize_weights_w8a8

from . import vendor as v
from .vendor import TORCH_NPU

REAL = TORCH_NPU
SCHEMES = ("w8a8", "w4a8", "w4a4", "w4a16", "bf16")
#: sglang's W4A8 group size (``NPUW4A8Int4DynamicMoEMethod.group_size``); W4A16's is the checkpoint's.
DEFAULT_GROUP_SIZE = {"w4a8": 256, "w4a16": 128}
_INT8_SCHEMES = ("w8a8", "w4a8")
_OPS = {
    "w8a8": ("npu_grouped_matmul", "npu_dequant_swiglu_quant"),
    "w4a8": ("npu_grouped_matmul", "npu_swiglu", "npu_dynamic_quant"),
    "w4a4": ("npu_grouped_matmul", "npu_swiglu", "npu_dynamic_quant"),
    "w4a16": ("npu_grouped_matmul", "npu_swiglu"),
    "bf16": ("npu_grouped_matmul", "npu_swiglu"),
}
REASONS = {
    "w8a8": "the W8A8 int8 grouped matmuls take per-token INT8 rows",
    "w4a8": "the W4A8 int8 x int4 grouped matmuls take per-token INT8 rows",
    "w4a4": "W4A4 quantizes BF16 rows to int4 itself (npu_dynamic_quant quint4x2)",
    "w4a16": "W4A16 dequantizes int4 weights against BF16 rows",
    "bf16": "unquantized bf16 grouped matmuls",
}


def runner_name(scheme: str) -> str:
    return f"npu_{scheme}"


def install_hint() -> str:
    version = torch.__version__.split("+")[0]
    return (f'pip install "moe-dispatch-ascend-deepep[npu]" "torch=={version}" (torch-npu must match torch); '
            "torch_npu runs on an Ascend NPU (Atlas A2/A3) with CANN installed")


def runner_probe(module: str = REAL) -> str | None:
    """Why the npu_* runners cannot run here (None: they can); cheap and never raises."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module} is not installed; {install_hint()}"
    if module != REAL:
        return None
    try:
        importlib.import_module(module)
        if not (hasattr(torch, "npu") and torch.npu.is_available()):
            return "no Ascend NPU (torch.npu is not available)"
    except Exception as exc:  # noqa: BLE001 - a broken torch_npu is a reason, not a crash
        return f"torch_npu failed to import ({type(exc).__name__}: {exc}); {install_hint()}"
    return None


# -- int4 and uint64-scale layouts ------------------------------------------------------------------


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int ``[..., n]`` in [-8, 7] → int32 ``[..., n/8]``: two int4 per byte, the even element in
    the low nibble, four bytes per little-endian word, i.e. element 8j+m in bits 4m..4m+3 of
    word j. This is sglang's W4A8 route (int8 pairs viewed as int32) and the layout of
    ``npu_convert_weight_to_int4pack`` (Ascend/op-plugin's ``pack_int4_3dim`` golden)."""
    v = values.to(torch.int16) & 0xF
    pairs = (v[..., 0::2] | (v[..., 1::2] << 4)).to(torch.uint8)
    return pairs.contiguous().view(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: int32 ``[..., n/8]`` → int8 ``[..., n]``."""
    raw = packed.contiguous().view(torch.uint8).to(torch.int16)
    nibbles = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2)
    return torch.where(nibbles > 7, nibbles - 16, nibbles).to(torch.int8)


def fp32_as_uint64(scale: torch.Tensor) -> torch.Tensor:
    """fp32 → int64 with the fp32 bits in the low word (sglang: ``scale_np.dtype = np.uint32``
    then ``astype(np.int64)``), the uint64 scale format of torch_npu's int4 grouped matmuls."""
    return scale.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def uint64_as_fp32(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.int32).view(torch.float32)


def _quantize_int4(w: torch.Tensor, group: int, scale_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` → int4 values (int8) and fp32 scales ``[E, N, K/group]``: symmetric,
    scale amax/7, rounded to ``scale_dtype`` first when the kernel reads it in that dtype."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n, k // group, group)
    scale = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 7.0
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).float()
    q = torch.round(blocks / scale).clamp(-8, 7).to(torch.int8).reshape(e, n, k)
    return q, scale.squeeze(-1)


def _kn(t: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` (the core's layout) → ``[E, K, N]`` (the NPU grouped matmul's weight)."""
    return t.transpose(1, 2).contiguous()


def _a8w4_bias(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """CANN A8W4's required ``scale_bias`` ``8·Σ_k(w·s)`` fp32 ``[E, N]`` from the int4 values ``[E, N, K]``
    and the (fp16-rounded) group scales ``[E, N, K/group]`` exactly as the op receives them."""
    passed = uint64_as_fp32(fp32_as_uint64(scale))  # the fp32 the kernel reads from the uint64
    return v.a8w4_scale_bias(_kn(q), _kn(passed.repeat_interleave(group, dim=-1)))


# -- the layer ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NpuExpertLayer:
    """A layer's local experts as the torch_npu kernels take them, in sglang's attribute names.

    Weights are ``[E, K, N]``: ``w13_weight`` ``[E, H, 2I]`` (gate columns, then up),
    ``w2_weight`` ``[E, I, H]``; int8 (w8a8, and w2 of w4a4), int32 with eight int4 per word
    along N (``[E, K, N/8]``), or bf16. Scales: w8a8 fp32 ``[E, N]`` (w2's passed as bf16);
    w4a4 w13 uint64 ``[E, 2I]`` (int64 holding fp32 bits), w2 fp32 ``[E, H]``; w4a8 uint64
    ``[E, K/256, N]``; w4a16 bf16 ``[E, K/group, N]`` with ``*_weight_offset`` (zeros:
    symmetric). ``*_scale_bias``: w4a8's fp32 ``[E, N]``, ``8·Σ_k(w·s)`` (CANN A8W4 requires it).
    """

    scheme: str
    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    hidden_size: int
    intermediate_size: int
    w13_weight_scale: torch.Tensor | None = None
    w2_weight_scale: torch.Tensor | None = None
    w13_weight_offset: torch.Tensor | None = None
    w2_weight_offset: torch.Tensor | None = None
    w13_scale_bias: torch.Tensor | None = None
    w2_scale_bias: torch.Tensor | None = None
    group_size: int | None = None

    @property
    def num_experts(self) -> int:
        return int(self.w13_weight.shape[0])

    def _map(self, fn: Any) -> "NpuExpertLayer":
        names = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale", "w13_weight_offset",
                 "w2_weight_offset", "w13_scale_bias", "w2_scale_bias")
        return dataclasses.replace(self, **{n: None if getattr(self, n) is None else fn(getattr(self, n))
                                            for n in names})

    def slice(self, first: int, count: int) -> "NpuExpertLayer":
        """Experts ``first .. first+count-1`` (a rank's share; every tensor is per expert)."""
        return self._map(lambda t: t[first:first + count])

    def to(self, device: torch.device | str) -> "NpuExpertLayer":
        return self._map(lambda t: t.to(device))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> md.ExpertWeights:
        """``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in ``dtype``: exactly what the kernels multiply by
        (w2's int8 scale rounded to bf16 as it is passed; w4a16 dequantized in bf16 as the op
        does). Integer weights times their scales are formed in float64 and rounded once."""
        return md.ExpertWeights(self._dequant(self.w13_weight, self.w13_weight_scale, self.w13_weight_offset, True)
                                .transpose(1, 2).to(dtype).contiguous(),
                                self._dequant(self.w2_weight, self.w2_weight_scale, self.w2_weight_offset, False)
                                .transpose(1, 2).to(dtype).contiguous())

    def _dequant(self, w: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
                 first: bool) -> torch.Tensor:
        if self.scheme == "bf16":
            return w.double()
        assert scale is not None
        if w.dtype == torch.int8:  # per-channel int8: w8a8, w4a4's w2
            s = scale.float() if first else scale.to(torch.bfloat16)
            return w.double() * s.double().unsqueeze(1)
        values = unpack_int4(w)
        k = values.shape[1]
        if self.scheme == "w4a16":
            assert offset is not None
            rep = k // scale.shape[1]
            s, o = scale.repeat_interleave(rep, dim=1), offset.repeat_interleave(rep, dim=1)
            return ((values.to(scale.dtype) + o) * s).double()
        s = uint64_as_fp32(scale).double()
        s = s.unsqueeze(1) if s.dim() == 2 else s.repeat_interleave(k // s.shape[1], dim=1)
        return values.double() * s


# -- the kernel --------------------------------------------------------------------------------------


def load_ops(module: str | ModuleType | Any, scheme: str) -> Any:
    """The module holding the torch_npu ops ``scheme`` calls, or ``BackendUnavailableError``."""
    runner = runner_name(scheme)
    if isinstance(module, str):
        try:
            module = importlib.import_module(module)
        except Exception as exc:  # a missing or broken torch_npu is a reason, not a crash
            raise md.BackendUnavailableError(
                f"cannot run the {scheme} expert kernel: {type(exc).__name__}: {exc}; {install_hint()}",
                parameter="runner", value=runner, allowed="an installed torch_npu, or a module of the same ops on CPU",
            ) from exc
    missing = [op for op in _OPS[scheme] if not hasattr(module, op)]
    if missing:
        name = getattr(module, "__name__", type(module).__name__)
        raise md.BackendUnavailableError(
            f"{name} lacks {', '.join(missing)}, which the {scheme} kernel calls; upgrade torch-npu ({install_hint()})",
            parameter="runner", value=runner, allowed="a torch_npu with " + ", ".join(_OPS[scheme]))
    return module


class NpuExperts:
    """torch_npu grouped-matmul experts as an ``md.ExpertKernel``, one ``scheme`` per instance.

    :param scheme: ``"w8a8"``, ``"w4a8"``, ``"w4a4"``, ``"w4a16"`` or ``"bf16"``.
    :param module: where the ops come from: ``"torch_npu"`` (default), a stand-in's module name, or a module.
    :param group_size: int4 scale group along K for w4a8/w4a16 (default 256 / 128).
    :raises md.BackendUnavailableError: torch_npu is missing or lacks an op the scheme calls.
    """

    def __init__(self, scheme: str, module: str | ModuleType | Any = REAL, *, group_size: int | None = None) -> None:
        if scheme not in SCHEMES:
            raise md.InvalidSpecError("unknown NPU expert scheme", parameter="scheme", value=scheme,
                                      allowed=", ".join(SCHEMES))
        self.scheme = scheme
        self.runner = runner_name(scheme)
        if group_size is not None and (scheme not in DEFAULT_GROUP_SIZE or group_size <= 0):
            raise md.InvalidSpecError("a positive int4 scale group size applies to w4a8 and w4a16 only",
                                      parameter="group_size", value=group_size,
                                      allowed="None" if scheme not in DEFAULT_GROUP_SIZE else "a positive int")
        if scheme == "w4a8" and group_size not in (None, v.A8W4_GROUP_SIZE):
            raise md.InvalidSpecError("CANN's A8W4 grouped matmul supports quantGroupSize 256 only",
                                      parameter="group_size", value=group_size, allowed=str(v.A8W4_GROUP_SIZE))
        self.group_size = group_size if group_size is not None else DEFAULT_GROUP_SIZE.get(scheme)
        self.ops = load_ops(module, scheme)
        #: W8A8/W4A8 GEMMs take INT8 rows; W4A4 quantizes BF16 rows itself; W4A16/BF16 take BF16.
        self.needs_dispatch_dtype: md.DispatchDtype = (
            md.DispatchDtype.INT8 if scheme in _INT8_SCHEMES else md.DispatchDtype.BF16)

    def quant_hints(self) -> md.QuantHints:
        """What to pass as ``DispatchSpec(quant=...)`` so resolution sends this kernel's dtype."""
        return md.QuantHints(dispatcher_output_dtype=self.needs_dispatch_dtype)

    # -- weights --------------------------------------------------------------------------------------

    def process_weights(self, weights: md.ExpertWeights) -> NpuExpertLayer:
        """The core's ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` (bf16/fp32, or W8A8 int8 with
        per-channel scales) → this scheme's NPU layout."""
        w13, w2 = dequantized_weights(weights)
        e, two_i, h = w13.shape
        i = two_i // 2
        if two_i % 2 or tuple(w2.shape) != (e, h, i):
            raise md.InvalidInputError("w13 must be [E, 2I, H] and w2 [E, H, I]", parameter="w2_weight", value=w2,
                                       allowed=f"[{e}, {h}, {i}]")
        self._check_dims(h, i)
        s = self.scheme
        if s == "bf16":
            return NpuExpertLayer(s, _kn(w13.to(torch.bfloat16)), _kn(w2.to(torch.bfloat16)), h, i)
        if s == "w8a8":
            q = weights if weights.w13_weight.dtype == torch.int8 else quantize_weights_w8a8(md.ExpertWeights(w13, w2))
            return NpuExpertLayer(s, _kn(q.w13_weight), _kn(q.w2_weight), h, i,
                                  q.w13_weight_scale.float(), q.w2_weight_scale.float())
        if s == "w4a4":
            q13, s13 = _quantize_int4(w13, h, None)
            q2 = quantize_weights_w8a8(md.ExpertWeights(w13, w2))
            return NpuExpertLayer(s, pack_int4(_kn(q13)), _kn(q2.w2_weight), h, i,
                                  fp32_as_uint64(s13.squeeze(-1)), q2.w2_weight_scale.float())
        g = self.group_size
        assert g is not None
        if s == "w4a8":  # sglang rounds the combined group scale through fp16 before packing it
            q13, s13 = _quantize_int4(w13, g, torch.float16)
            q2, s2 = _quantize_int4(w2, g, torch.float16)
            return NpuExpertLayer(s, pack_int4(_kn(q13)), pack_int4(_kn(q2)), h, i,
                                  fp32_as_uint64(_kn(s13)), fp32_as_uint64(_kn(s2)),
                                  w13_scale_bias=_a8w4_bias(q13, s13, g), w2_scale_bias=_a8w4_bias(q2, s2, g),
                                  group_size=g)
        # w4a16: antiquant scales in the activations' dtype (bf16), zero offsets (symmetric)
        # w4a16: sglang packs with npu_convert_weight_to_int4pack on NPU parameters; that op has an NPU
        # kernel only (vendor.NPU_DEVICE_TYPE) and for A2/A3 ND input packs on the host in this same layout
        # (op-plugin ConvertWeightToINT4PackKernelNpuOpApi.cpp convert_to_int4_pack), so pack_int4 does it
        # here, on whatever device the weights are (the hardware check compares it with the op on the NPU).
        q13, s13 = _quantize_int4(w13, g, torch.bfloat16)
        q2, s2 = _quantize_int4(w2, g, torch.bfloat16)
        s13, s2 = _kn(s13).to(torch.bfloat16), _kn(s2).to(torch.bfloat16)
        return NpuExpertLayer(s, pack_int4(_kn(q13)), pack_int4(_kn(q2)), h, i, s13, s2,
                              torch.zeros_like(s13), torch.zeros_like(s2), group_size=g)

    def _check_dims(self, h: int, i: int) -> None:
        needs: list[tuple[str, int, int, str]] = []
        if self.scheme == "w8a8":  # npu_dequant_swiglu_quant with group_index: H <= 10496, 64-aligned
            needs.append(("intermediate_size", i, 64, "npu_dequant_swiglu_quant needs I % 64 == 0"))
            if i > 10496:
                raise md.InvalidInputError("npu_dequant_swiglu_quant with group_index takes I <= 10496",
                                           parameter="intermediate_size", value=i, allowed="64..10496")
        if self.scheme in ("w4a8", "w4a4", "w4a16"):  # eight int4 per int32 along N (and K for w4a4's x)
            needs += [("intermediate_size", i, 8, "int4 packing needs multiples of 8"),
                      ("hidden_size", h, 8, "int4 packing needs multiples of 8")]
        if self.group_size is not None:  # w4a8/w4a16: the scale groups run along K (H for w13, I for w2)
            needs += [("hidden_size", h, self.group_size, "the int4 scale groups must divide K"),
                      ("intermediate_size", i, self.group_size, "the int4 scale groups must divide K")]
        if self.scheme == "w4a8":  # CANN A8W4 tiling: k % 64 == 0 and k <= 18432 (K = H for gmm1, I for gmm2)
            needs += [("hidden_size", h, v.A8W4_K_MULTIPLE, "CANN's A8W4 tiling needs K % 64 == 0"),
                      ("intermediate_size", i, v.A8W4_K_MULTIPLE, "CANN's A8W4 tiling needs K % 64 == 0")]
            for name, value in (("hidden_size", h), ("intermediate_size", i)):
                if value > v.A8W4_MAX_K:
                    raise md.InvalidInputError("CANN's A8W4 grouped matmul takes K <= 18432", parameter=name,
                                               value=value, allowed=f"1..{v.A8W4_MAX_K}")
        for name, value, multiple, why in needs:
            if value % multiple:
                raise md.InvalidInputError(why, parameter=name, value=value, allowed=f"multiples of {multiple}")

    # -- the call -------------------------------------------------------------------------------------

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
    ) -> torch.Tensor:
        """gmm1 → SwiGLU → gmm2 per local expert, rows in place, no routing weights; PACKED
        ``[rows, H]`` or MASKED ``[E, capacity, H]``. The ops write bf16 (what DeepEP-Ascend's
        combine takes); another ``output_dtype`` is a cast of that."""
        if not isinstance(layer, NpuExpertLayer) or layer.scheme != self.scheme:
            raise md.InvalidInputError(f"the {self.scheme} kernel needs its own weight layout", parameter="layer",
                                       value=type(layer).__name__,
                                       allowed=f"NpuExperts({self.scheme!r}).process_weights(weights)")
        self._check_rows(layer, hidden_states, hidden_states_scale)
        experts, h = layer.num_experts, layer.hidden_size
        counts = self._counts(group_list, group_list_type, experts)
        masked = hidden_states.dim() == 3
        x, scale = hidden_states, hidden_states_scale
        if masked:
            e, capacity, _ = x.shape
            if e != experts:
                raise md.InvalidInputError("MASKED layout needs one block per local expert", parameter="hidden_states",
                                           value=x, allowed=f"[{experts}, capacity, {h}]")
            if int(counts.max()) > capacity:
                raise md.InvalidInputError(f"a count exceeds the capacity {capacity}", parameter="group_list",
                                           value=counts.tolist(), allowed=f"counts in [0, {capacity}]")
            rows_per_group = torch.full((experts,), capacity, dtype=torch.int64)
            x = x.reshape(e * capacity, h)
            scale = None if scale is None else scale.reshape(e * capacity)
        else:
            rows_per_group = counts
            if int(counts.sum()) != x.shape[0]:
                raise md.InvalidInputError(f"counts sum to {int(counts.sum())} but there are {x.shape[0]} rows",
                                           parameter="group_list", value=counts.tolist(),
                                           allowed="per-expert counts (type 1) or cumulative ends (type 0) of the rows")
        if x.shape[0] == 0:  # npu_swiglu takes no empty tensor; nothing to compute
            out = torch.zeros(x.shape[0], h, dtype=output_dtype, device=x.device)
        else:
            if masked:  # every block is a group of `capacity` rows
                gl, glt = self._npu_group_list(rows_per_group, 1, x.device)
            else:  # the caller's list as it came, as sglang passes it
                gl, glt = self._npu_group_list(group_list, group_list_type, x.device)
            idx = rows_per_group.to(device=x.device, dtype=torch.int64)  # npu_dequant_swiglu_quant: counts
            out = getattr(self, f"_{self.scheme}")(layer, x.contiguous(), scale, gl, glt, idx)
        if masked:
            out = out.reshape(experts, -1, h)
            valid = torch.arange(out.shape[1], device=out.device).unsqueeze(0) < counts.to(out.device).unsqueeze(1)
            out = torch.where(valid.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out.to(output_dtype)

    def _check_rows(self, layer: NpuExpertLayer, x: torch.Tensor, scale: torch.Tensor | None) -> None:
        h = layer.hidden_size
        int8 = self.scheme in _INT8_SCHEMES
        want = torch.int8 if int8 else torch.bfloat16
        if x.dtype != want or x.dim() not in (2, 3) or x.shape[-1] != h:
            raise md.InvalidInputError(
                f"the {self.scheme} NPU kernel takes {want} rows; pass NpuExperts.quant_hints() as "
                "DispatchSpec(quant=...) so dispatch sends that dtype", parameter="hidden_states", value=x,
                allowed=f"{want} [rows, {h}] (PACKED) or [E_local, capacity, {h}] (MASKED)")
        lead = tuple(x.shape[:-1])
        if not int8:
            if scale is not None:
                raise md.InvalidInputError(f"{self.scheme} takes BF16 rows, which carry no scales",
                                           parameter="hidden_states_scale", value=scale, allowed="None")
            return
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != lead:
            raise md.InvalidInputError("INT8 rows need their per-token scales (the dequant multiplier)",
                                       parameter="hidden_states_scale", value=scale,
                                       allowed=f"float32 {list(lead)}")

    @staticmethod
    def _counts(group_list: Any, group_list_type: int, experts: int) -> torch.Tensor:
        if group_list_type not in (0, 1):
            raise md.InvalidInputError("unknown group_list_type", parameter="group_list_type", value=group_list_type,
                                       allowed="0 (cumulative ends), 1 (per-expert counts)")
        if not isinstance(group_list, torch.Tensor) or tuple(group_list.shape) != (experts,) or (
                group_list.dtype.is_floating_point or group_list.dtype == torch.bool):
            raise md.InvalidInputError("needs one integer entry per local expert", parameter="group_list",
                                       value=group_list, allowed=f"an int64 tensor [{experts}]")
        counts = group_counts(group_list.to(torch.int64).cpu(), group_list_type)  # host sync
        if bool((counts < 0).any()):
            raise md.InvalidInputError("counts must be >= 0 (cumulative ends non-decreasing)", parameter="group_list",
                                       value=group_list.tolist(), allowed="non-negative counts")
        return counts

    @staticmethod
    def _npu_group_list(group_list: torch.Tensor, group_list_type: int, device: torch.device
                        ) -> tuple[torch.Tensor, int]:
        """What ``npu_grouped_matmul`` gets: the list as int64 on the rows' device with its type,
        except that a one-expert count list goes as cumulative ends (type 0, the same value),
        since a type-1 list may not have length 1."""
        gl = group_list.to(device=device, dtype=torch.int64)
        if group_list_type == 1 and gl.numel() == 1:
            return gl, 0
        return gl, group_list_type

    # -- the schemes: the ops in sglang's order ------------------------------------------------------------

    def _gmm(self, x: torch.Tensor, w: torch.Tensor, gl: torch.Tensor, glt: int, out: torch.dtype,
             **scales: Any) -> torch.Tensor:
        return self.ops.npu_grouped_matmul([x], [w], **scales, split_item=2, group_list_type=glt, group_type=0,
                                           group_list=gl, output_dtype=out)[0]

    def _w8a8(self, layer: NpuExpertLayer, x: torch.Tensor, xs: torch.Tensor, gl: torch.Tensor, glt: int,
              counts: torch.Tensor) -> torch.Tensor:
        h = self._gmm(x, layer.w13_weight, gl, glt, torch.int32)
        q, qs = self.ops.npu_dequant_swiglu_quant(
            h, weight_scale=layer.w13_weight_scale, activation_scale=xs, bias=None, quant_scale=None,
            quant_offset=None, group_index=counts, activate_left=True, quant_mode=1)
        assert layer.w2_weight_scale is not None
        return self._gmm(q, layer.w2_weight, gl, glt, torch.bfloat16,
                         scale=[layer.w2_weight_scale.to(torch.bfloat16)], per_token_scale=[qs])

    def _w4a8(self, layer: NpuExpertLayer, x: torch.Tensor, xs: torch.Tensor, gl: torch.Tensor, glt: int,
              counts: torch.Tensor) -> torch.Tensor:
        # CANN's A8W4 kernel reads group_list as counts whatever group_list_type says: always counts here.
        gl, glt = self._npu_group_list(counts, 1, x.device)
        h = self._gmm(x, layer.w13_weight, gl, glt, torch.bfloat16, scale=[layer.w13_weight_scale],
                      bias=[layer.w13_scale_bias], per_token_scale=[xs])
        q, qs = self.ops.npu_dynamic_quant(self.ops.npu_swiglu(h))
        return self._gmm(q, layer.w2_weight, gl, glt, torch.bfloat16, scale=[layer.w2_weight_scale],
                         bias=[layer.w2_scale_bias], per_token_scale=[qs])

    def _w4a4(self, layer: NpuExpertLayer, x: torch.Tensor, xs: None, gl: torch.Tensor, glt: int,
              counts: torch.Tensor) -> torch.Tensor:
        x4, x4s = self.ops.npu_dynamic_quant(x, dst_type=torch.quint4x2)
        h = self._gmm(x4, layer.w13_weight, gl, glt, torch.bfloat16, scale=[layer.w13_weight_scale],
                      per_token_scale=[x4s])
        q, qs = self.ops.npu_dynamic_quant(self.ops.npu_swiglu(h))
        assert layer.w2_weight_scale is not None
        return self._gmm(q, layer.w2_weight, gl, glt, torch.bfloat16,
                         scale=[layer.w2_weight_scale.to(torch.bfloat16)], per_token_scale=[qs])

    def _w4a16(self, layer: NpuExpertLayer, x: torch.Tensor, xs: None, gl: torch.Tensor, glt: int,
               counts: torch.Tensor) -> torch.Tensor:
        h = self._gmm(x, layer.w13_weight, gl, glt, torch.bfloat16, antiquant_scale=[layer.w13_weight_scale],
                      antiquant_offset=[layer.w13_weight_offset])
        return self._gmm(self.ops.npu_swiglu(h), layer.w2_weight, gl, glt, torch.bfloat16,
                         antiquant_scale=[layer.w2_weight_scale], antiquant_offset=[layer.w2_weight_offset])

    def _bf16(self, layer: NpuExpertLayer, x: torch.Tensor, xs: None, gl: torch.Tensor, glt: int,
              counts: torch.Tensor) -> torch.Tensor:
        h = self._gmm(x, layer.w13_weight, gl, glt, torch.bfloat16)
        return self._gmm(self.ops.npu_swiglu(h), layer.w2_weight, gl, glt, torch.bfloat16)


__all__ = [
    "REAL",
    "REASONS",
    "SCHEMES",
    "NpuExpertLayer",
    "NpuExperts",
    "fp32_as_uint64",
    "install_hint",
    "load_ops",
    "pack_int4",
    "runner_name",
    "runner_probe",
    "uint64_as_fp32",
    "unpack_int4",
]
