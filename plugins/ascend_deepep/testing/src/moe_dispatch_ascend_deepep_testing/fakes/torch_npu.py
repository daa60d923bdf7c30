"""A CPU fake of the torch_npu ops the Ascend expert kernels call.

Same names and parameters as ``torch_npu`` 2.13.0's callables: ``torch_npu.npu_X`` is
``torch.ops.npu.npu_X``, so its signature is the op schema torch_npu registers
(``vendor.TORCH_NPU_SCHEMAS``, read from ``libtorch_npu.so``; ``vendor.TORCH_NPU_SIGNATURES`` are those
as Python parameter lists, and the fakes are tested equal to them). The keyword parameters the
schemas have and this fake does not emulate raise ``NotImplementedError`` "(fake)" unless left at
their defaults. Results are computed in fp32 (int32 where the NPU accumulates integers, exactly)
from the ops' documented formulas, CANN's kernels and the golden functions of torch_npu's own tests.
Sources (Ascend/op-plugin, the repository that builds torch_npu's custom ops; commits are the stored
versions read; CANN = hicann/ops-transformer @c29bc10 and its aclnnGroupedMatmulV5.md @0dd10d2):

- ``npu_grouped_matmul``: ``docs/context/torch_npu-npu_grouped_matmul.md`` @07557e5085de.
  Formulas 1 (float), 2/3 (per-channel / per-token quant: ``(x@w)·scale·per_token_scale +
  bias``), 3-3 (int4 × int4), 4 (antiquant: ``x @ ((w + antiquant_offset)·antiquant_scale)``;
  the offset is required by CANN @c29bc10, "antiquantOffset must not be nullptr in antiquant").
  ``group_list_type`` 0 = cumulative ends (non-negative, non-decreasing), 1 = per-group counts
  (non-negative, **length not 1**), at most 1024 groups; CANN's A2/A3 constraint: the list may
  cover fewer rows than x has ("末值 ≤ x 第一维"; the rest of y is not written: NaN here), a list
  covering more reads past x (a RuntimeError here). int8 × int4 (A8W4, sglang's W4A8) is CANN's
  MSD kernel: ``y = ((x − 8) @ (w·s) + bias)·per_token_scale`` with ``bias = 8·Σ_k(w·s)`` required
  (fp32 ``[E, N]``), per-group uint64 scales ``[E, K/256, N]`` (or ``[E, 1, N]``), the group list
  read as **counts whatever ``group_list_type`` says**, and tiling failures (RuntimeError) for
  ``k % 64``, ``k > 18432`` and a group size other than 256 (``vendor.A8W4_*``). Emulated: the
  single-tensor mode (one 2-D x, one 3-D weight ``[E, K, N]``, ``split_item`` 2 or 3,
  ``group_type`` 0), which is what sglang's MoE calls use. int8 × int8 to int32 with no scale is
  listed in the doc's ``tuning_config`` table and CANN's A8W8 table (x int8, weight int8, output
  int32) and is what sglang's W8A8 path asks for.
- ``npu_dynamic_quant``: ``docs/context/torch_npu-npu_dynamic_quant.md`` @0576042bea38:
  per-token symmetric, scale = rowMax/DTYPE_MAX (127; 7 for ``dst_type=torch.quint4x2``, whose
  output is int32 with 8 int4 per word); the int8 rounding is the core INT8 codec's
  (round half to even, amax floored at 1e-10; the golden divides by the raw max: all-zero rows
  differ, [U]); ``smooth_scales`` has x's dtype (TNPU docs).
- ``npu_dequant_swiglu_quant``: ``docs/context/torch_npu-npu_dequant_swiglu_quant.md``
  @1bd23ce26017 and the golden ``test/test_custom_ops/test_npu_dequant_swiglu_quant.py``
  @26199aa6e8a3: ``x·weight_scale·activation_scale`` → SwiGLU (``activate_left``: silu of the
  first half) → ``out·(127/rowmax)``, rounded, scale ``rowmax/127``. ``group_index`` is
  **counts only**; rows past its sum are left as garbage (the fake writes 127 and NaN
  scales there, so a consumer reading them shows it); H ≤ 10496 and a multiple of 64 with
  ``group_index``; dynamic quant (``quant_mode=1``) only with ``group_index``.
- ``npu_swiglu``: the torch_npu API reference, "(beta)torch_npu.npu_swiglu" (hiascend.com,
  PyTorch 7.2.0 apiref): ``swish(A)·B`` with A the first half along ``dim``; no empty tensors, no
  non-contiguous tensors.
- ``npu_convert_weight_to_int4pack``: ``docs/context/torch_npu-npu_convert_weight_to_int4pack.md``
  @285b54823fea (int32 2-D, last dim a multiple of 8, values in [-8, 7] → int32 ``[.., n/8]``)
  and the golden ``pack_int4_3dim`` in ``test/test_custom_ops/test_npu_convert_weight_to_int4pack.py``
  (op-plugin @2f5ea31c): element ``8j+m`` in bits ``4m..4m+3`` of word j. Like every torch_npu op
  its kernel is registered for the NPU key only, so on a CPU tensor it raises what torch raises
  there (NotImplementedError "Could not run ... from the 'CPU' backend"); ``pack_golden`` is the
  golden packer.

int4 operands are int32 tensors with eight int4 per word along the last dim (the ``quint4x2``
output of ``npu_dynamic_quant``, ``npu_convert_weight_to_int4pack``'s output). uint64 scales
(int4 GEMMs) are int64 tensors carrying the fp32 bits in the low word, as the doc's example and
sglang build them; the fake rejects anything in the high word.

``npu.get_soc_version()`` answers ``SOC_VERSION`` (250, an Atlas A3, unless a test sets another code
with ``soc_version(code, name)``) and ``npu.get_device_name()`` its name; the DeepEP-Ascend fake reads
the same, as the vendor's C++ asks the same platform. ``group_hccl_config(group, config)`` stands a
gloo group in for an HCCL group created with ``pg_options`` (``hccl_config_of`` answers what
``group._get_backend(npu).options.hccl_config`` would): its ``hccl_buffer_size`` is its window.

Not emulated (they raise ``NotImplementedError``): tensor lists longer than one, ``split_item``
0/1, ``group_type`` -1, ``group_list_type`` 2, activations (``act_type``), int8 output, per-channel
A8W4, static quant in ``npu_dequant_swiglu_quant``. Formats (ND vs FRACTAL_NZ) are invisible on
CPU: CANN's tables take int4 weights in ND (n % 8) or NZ for A4W4/A8W4; NZ is sglang's
performance choice, and the hardware check runs the ND weights this plugin builds.
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import make_codec

from moe_dispatch_ascend_deepep import vendor as v

INNER_LIMIT = 65536
MAX_GROUPS = v.GMM_MAX_GROUPS
DEQUANT_SWIGLU_MAX_H = v.DEQUANT_SWIGLU_MAX_H
INT4_MIN, INT4_MAX = -8, 7
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
#: The per-token quant table of the grouped-matmul doc: the scale's dtype decides the output.
_QUANT_OUT = {torch.bfloat16: torch.bfloat16, torch.float32: torch.float16}
#: What ``torch_npu.npu.get_soc_version()`` answers here (250..256: Atlas A3; 220..225: Atlas A2) and
#: ``torch_npu.npu.get_device_name()`` (the SoC name torch_npu maps the code from, NpuVariables.cpp).
SOC_VERSION = 250
DEVICE_NAME = "Ascend910_9391"
_NAMES = {220: "Ascend910B1", 221: "Ascend910B2", 222: "Ascend910B2C", 223: "Ascend910B3", 224: "Ascend910B4",
          225: "Ascend910B4-1", 250: "Ascend910_9391", 251: "Ascend910_9392", 252: "Ascend910_9381",
          253: "Ascend910_9382", 254: "Ascend910_9372", 255: "Ascend910_9362", 256: "Ascend910_9363"}
#: ``torch_npu.npu.get_device_limit(device)``'s vector cores (torch-npu 2.13.0 torch_npu/npu/npu_config.py:244-258;
#: 48 on Atlas A3: 24 AI cores of two vector units each).
VECTOR_CORES = 48
#: ``torch_npu.npu``: the part of it the plugins read. ``config.allow_internal_format`` is False by default on Atlas
#: A3 (op-plugin's torch_npu-npu-config-allow_internal_format.md): ``npu_format_cast`` then gives ND.
npu = types.SimpleNamespace(get_soc_version=lambda: SOC_VERSION, get_device_name=lambda device_name=None: DEVICE_NAME,
                            get_device_limit=lambda device: {"cube_core_num": VECTOR_CORES // 2,
                                                             "vector_core_num": VECTOR_CORES},
                            current_device=lambda: 0, config=types.SimpleNamespace(allow_internal_format=False))


@contextmanager
def vector_cores(count: int) -> Iterator[None]:
    """Stand for a device with ``count`` vector cores inside the block."""
    global VECTOR_CORES
    old, VECTOR_CORES = VECTOR_CORES, count
    try:
        yield
    finally:
        VECTOR_CORES = old


@contextmanager
def soc_version(code: int, name: str | None = None) -> Iterator[None]:
    """Stand for another chip (e.g. 220, an Atlas A2) inside the block, named ``name`` (by default the
    name torch_npu gives that code); read at Buffer construction."""
    global SOC_VERSION, DEVICE_NAME
    old = SOC_VERSION, DEVICE_NAME
    SOC_VERSION, DEVICE_NAME = code, name if name is not None else _NAMES.get(code, f"Ascend-unknown-{code}")
    try:
        yield
    finally:
        SOC_VERSION, DEVICE_NAME = old


# -- process groups' HCCL options --------------------------------------------------------------------------
# torch_npu: ``group._get_backend(torch.device("npu")).options.hccl_config`` is the dict the group was
# created with (``ProcessGroupHCCL.Options().hccl_config``, passed as ``pg_options``); HCCL sizes the group's
# window from its "hccl_buffer_size" (MB) and else from HCCL_BUFFSIZE (vendor.group_hccl_config). The fakes
# run on gloo groups, which have no NPU backend: what a test creates "with options" is recorded here.
_GROUP_CONFIG: dict[int, dict[str, Any]] = {}


def _key(group: Any) -> int:
    if group is None:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return id(group)


@contextmanager
def group_hccl_config(group: Any, config: dict[str, Any]) -> Iterator[None]:
    """Inside the block ``group`` stands for an HCCL group created with ``pg_options`` whose ``hccl_config``
    is ``config`` (``{}``: created without one)."""
    key = _key(group)
    old = _GROUP_CONFIG.get(key)
    _GROUP_CONFIG[key] = dict(config)
    try:
        yield
    finally:
        if old is None:
            _GROUP_CONFIG.pop(key, None)
        else:
            _GROUP_CONFIG[key] = old


def hccl_config_of(group: Any) -> dict[str, Any]:
    """What ``group._get_backend(torch.device("npu")).options.hccl_config`` answers for ``group``."""
    return dict(_GROUP_CONFIG.get(_key(group), {}))


def _not_emulated(**kwargs: Any) -> None:
    """Schema keywords the fake does not emulate: only their defaults are accepted."""
    for name, (value, default) in kwargs.items():
        if value != default:
            raise NotImplementedError(f"(fake) {name}={value!r} is not emulated (only {default!r})")


def _cpu_has_no_kernel(op: str, t: torch.Tensor) -> None:
    """torch_npu registers its op kernels for the NPU key only (vendor.NPU_DEVICE_TYPE)."""
    if t.device.type == "cpu":
        raise NotImplementedError(f"Could not run 'npu::{op}' with arguments from the 'CPU' backend. ... "
                                  f"'npu::{op}' is only available for these backends: [PrivateUse1, ...]")


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n/8]`` → int32 ``[..., n]``, element 8j+m from bits 4m..4m+3 of word j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return torch.where(nibbles > 7, nibbles - 16, nibbles).flatten(-2)


def _uint64_scale(scale: torch.Tensor) -> torch.Tensor:
    """int64 carrying fp32 bits in the low word → fp32."""
    assert scale.dtype == torch.int64, f"uint64 scales come as int64, got {scale.dtype}"
    assert bool(((scale >> 32) == 0).all()), "the emulator covers uint64 scales with the fp32 bits in the low word"
    return scale.to(torch.int32).view(torch.float32)


def _one(name: str, value: Any) -> torch.Tensor | None:
    if value is None:
        return None
    assert isinstance(value, (list, tuple)), f"{name} is a list of tensors"
    if len(value) == 0:
        return None
    if len(value) != 1:
        raise NotImplementedError(f"the emulator covers one tensor per list ({name} has {len(value)})")
    return value[0]


def _group_counts(group_list: Any, group_list_type: int, groups: int, rows: int, counts_only: bool = False
                  ) -> list[int]:
    """Per-group row counts; their sum may be below ``rows`` (CANN: the rest of y is not written) but
    not above (the kernel would read past x). ``counts_only``: the A8W4 kernel reads the list as counts
    whatever the type says."""
    assert isinstance(group_list, torch.Tensor), "the single-tensor mode needs group_list as a Tensor"
    assert group_list.dtype == torch.int64 and group_list.dim() == 1, "group_list must be a 1-D int64 Tensor"
    assert group_list.numel() == groups, f"group_list must have one entry per weight group ({groups})"
    assert groups <= MAX_GROUPS, f"at most {MAX_GROUPS} groups"
    values = [int(v) for v in group_list.tolist()]
    assert all(v >= 0 for v in values), "group_list must be non-negative"
    if group_list_type == 2:
        raise NotImplementedError("group_list_type 2 ([E, 2] index/size pairs) is not emulated")
    assert group_list_type in (0, 1), f"group_list_type must be 0, 1 or 2, got {group_list_type}"
    if counts_only or group_list_type == 1:
        if group_list_type == 1:
            assert groups != 1, "group_list_type 1: group_list must not have length 1"
        counts = values
    else:
        assert all(a <= b for a, b in zip(values, values[1:])), "group_list_type 0: group_list must be non-decreasing"
        counts = [b - a for a, b in zip([0, *values[:-1]], values)]
    if sum(counts) > rows:
        raise RuntimeError(f"(fake) group_list covers {sum(counts)} rows but x has {rows}: the kernel reads past x")
    return counts


def _per_group(scale: torch.Tensor, groups: int, k: int, n: int) -> torch.Tensor:
    """A per-channel ``[E, N]`` or per-group ``[E, G, N]`` scale as fp32 ``[E, K, N]`` (rows of w)."""
    if scale.dim() == 2:
        assert tuple(scale.shape) == (groups, n), f"per-channel scale must be [{groups}, {n}]"
        return scale.float().unsqueeze(1).expand(groups, k, n)
    assert scale.dim() == 3 and scale.shape[0] == groups and scale.shape[2] == n, (
        f"per-group scale must be [{groups}, G, {n}]")
    g = scale.shape[1]
    assert g > 0 and k % g == 0, f"the per-group count G={g} must divide K={k}"
    return scale.float().repeat_interleave(k // g, dim=1)


def _fill(out: torch.Tensor, counts: list[int]) -> None:
    """Rows past the group list are not written by the kernel: garbage here (NaN, or INT32_MAX)."""
    covered = sum(counts)
    if covered < out.shape[0]:
        out[covered:] = float("nan") if out.dtype.is_floating_point else torch.iinfo(torch.int32).max


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    offset: Sequence[torch.Tensor] | None = None,
    antiquant_scale: Sequence[torch.Tensor] | None = None,
    antiquant_offset: Sequence[torch.Tensor] | None = None,
    per_token_scale: Sequence[torch.Tensor] | None = None,
    group_list: Any = None,
    activation_input: Sequence[torch.Tensor] | None = None,
    activation_quant_scale: Sequence[torch.Tensor] | None = None,
    activation_quant_offset: Sequence[torch.Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: Any = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[torch.Tensor]:
    """``y[rows of group e] = x[rows of group e] @ weight[e]`` with the scheme's scales, one
    output tensor (``split_item`` 2/3)."""
    _not_emulated(x_dtype=(x_dtype, None), weight_dtype=(weight_dtype, None), scale_dtype=(scale_dtype, None),
                  per_token_scale_dtype=(per_token_scale_dtype, None))
    xs, w = _one("x", x), _one("weight", weight)
    assert xs is not None and w is not None, "x and weight are required"
    if split_item not in (2, 3):
        raise NotImplementedError("the emulator covers the single-output modes (split_item 2 or 3)")
    if group_type != 0:
        raise NotImplementedError("the emulator covers m-axis grouping (group_type=0)")
    if act_type != 0:
        raise NotImplementedError("fused activations (act_type) are not emulated")
    for name, value in (("offset", offset), ("activation_input", activation_input),
                        ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset)):
        assert _one(name, value) is None, f"{name}: only None is supported"
    assert xs.dim() == 2 and w.dim() == 3, "single-tensor mode: x must be 2-D and weight 3-D [E, K, N]"
    assert xs.is_contiguous(), "x must not be transposed (non-contiguous)"
    b, s, pts = _one("bias", bias), _one("scale", scale), _one("per_token_scale", per_token_scale)
    aq_s, aq_o = _one("antiquant_scale", antiquant_scale), _one("antiquant_offset", antiquant_offset)
    x_int4, w_int4 = xs.dtype == torch.int32, w.dtype == torch.int32
    rows, k = xs.shape[0], xs.shape[1] * (8 if x_int4 else 1)
    groups, k_w, n = w.shape[0], w.shape[1], w.shape[2] * (8 if w_int4 else 1)
    assert k == k_w, f"x's K ({k}) must equal weight's K ({k_w})"
    assert k < INNER_LIMIT and n < INNER_LIMIT, f"the inner dims must be < {INNER_LIMIT}"
    a8w4 = xs.dtype == torch.int8 and w_int4
    counts = _group_counts(group_list, int(group_list_type or 0), groups, rows, counts_only=a8w4)
    wv = _unpack_int4(w) if w_int4 else w

    if xs.dtype in _FLOAT:  # float, or antiquant (formula 4)
        if aq_s is None:
            assert w.dtype == xs.dtype, f"non-quant: weight must be {xs.dtype}, got {w.dtype}"
            assert s is None and pts is None and aq_o is None, "non-quant: no scales"
            w_f, out_dtype = wv.float(), xs.dtype
        else:
            assert w.dtype in (torch.int8, torch.int32), "antiquant weights are int8 or int4 (int32-packed)"
            assert xs.dtype in (torch.float16, torch.bfloat16), "antiquant x is float16 or bfloat16"
            assert aq_s.dtype == xs.dtype, f"antiquant_scale must be {xs.dtype}"
            assert aq_o is not None, "antiquantOffset must not be nullptr in antiquant (CANN @c29bc10)"
            assert aq_o.dtype == xs.dtype and aq_o.shape == aq_s.shape, (
                "antiquant_offset must match antiquant_scale's dtype and shape")
            assert s is None and pts is None, "antiquant: scale/per_token_scale must not be given"
            if aq_s.dim() == 3:
                assert w_int4, "per-group antiquant needs int4 weights (int8 is per-channel only)"
            scl = _per_group(aq_s, groups, k, n).to(xs.dtype)
            off = _per_group(aq_o, groups, k, n).to(xs.dtype)
            w_f, out_dtype = ((wv.to(xs.dtype) + off) * scl).float(), xs.dtype  # dequantized in x's dtype
        assert output_dtype in (None, out_dtype), f"output_dtype must be None or {out_dtype}"
        if b is not None:
            assert b.dtype == (torch.float32 if xs.dtype == torch.bfloat16 else xs.dtype), "bias dtype per the table"
        out = torch.empty(rows, n, dtype=torch.float32)
        start = 0
        for e, c in enumerate(counts):
            out[start:start + c] = xs[start:start + c].float() @ w_f[e]
            if b is not None:
                out[start:start + c] += b[e].float()
            start += c
        _fill(out, counts)
        return [out.to(out_dtype)]

    assert xs.dtype in (torch.int8, torch.int32), f"x must be float16/bfloat16/float32/int8/int4, got {xs.dtype}"
    assert aq_s is None and aq_o is None, "quantized x: antiquant scales must not be given"
    assert w.dtype in (torch.int8, torch.int32), f"quantized x needs int8/int4 weights, got {w.dtype}"
    assert not (x_int4 and not w_int4), "int4 x needs int4 weights"
    acc = torch.empty(rows, n, dtype=torch.float64)  # exact integer accumulation (|acc| << 2^53)
    xv = (_unpack_int4(xs) if x_int4 else xs).double()
    if s is None:  # int8 x int8 -> int32 (the tuning_config table's int32 row)
        assert not (x_int4 or w_int4), "the int32 output is for int8 x int8"
        assert pts is None, "per_token_scale needs a scale"
        assert output_dtype == torch.int32, "int8 x int8 without a scale: output_dtype must be torch.int32"
        assert b is None or b.dtype == torch.int32, "bias must be int32"
        start = 0
        for e, c in enumerate(counts):
            acc[start:start + c] = xv[start:start + c] @ wv[e].double()
            if b is not None:
                acc[start:start + c] += b[e].double()
            start += c
        out32 = acc.to(torch.int32)
        _fill(out32, counts)
        return [out32]

    if a8w4:
        return [_a8w4(xv, wv, s, b, pts, counts, groups, rows, k, n, output_dtype)]
    if w_int4:  # int4 x int4 (W4A4): uint64 (fp32-bit) scales per channel, formula 3-3
        w_scale = _per_group(_uint64_scale(s), groups, k, n)
        assert output_dtype in (torch.float16, torch.bfloat16), "int4 GEMMs output float16 or bfloat16"
        assert pts is None or (pts.dtype == torch.float32 and tuple(pts.shape) == (rows,)), (
            f"per_token_scale must be float32 [{rows}]")
        assert b is None, "int4 x int4 takes no bias"
        out = torch.empty(rows, n, dtype=torch.float32)
        start = 0
        for e, c in enumerate(counts):
            # y = x @ (w · scale) (formula 3-3), in float64 so only the final fp32 rounding shows
            y = (xv[start:start + c] @ (wv[e].double() * w_scale[e].double())).float()
            if pts is not None:
                y = y * pts[start:start + c].unsqueeze(1)
            out[start:start + c] = y
            start += c
        _fill(out, counts)
        return [out.to(output_dtype)]

    # int8 x int8 with scale (bfloat16 -> bfloat16 out, float32 -> float16 out) and optional per-token scale
    assert s.dtype in _QUANT_OUT, f"int8 scale must be bfloat16 or float32 (int64 gives int8 output), got {s.dtype}"
    want = _QUANT_OUT[s.dtype]
    assert output_dtype == want, f"a {s.dtype} scale gives {want} output: output_dtype must be {want}"
    assert tuple(s.shape) == (groups, n), f"per-channel scale must be [{groups}, {n}]"
    assert pts is None or (pts.dtype == torch.float32 and tuple(pts.shape) == (rows,)), (
        f"per_token_scale must be float32 [{rows}]")
    assert b is None or b.dtype == torch.int32, "bias must be int32"
    out = torch.empty(rows, n, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts):
        a = xv[start:start + c] @ wv[e].double()
        if b is not None:
            a = a + b[e].double()
        y = a.float() * s[e].float()
        if pts is not None:
            y = y * pts[start:start + c].unsqueeze(1)
        out[start:start + c] = y
        start += c
    _fill(out, counts)
    return [out.to(want)]


def _a8w4(xv: torch.Tensor, wv: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, pts: torch.Tensor | None,
          counts: list[int], groups: int, rows: int, k: int, n: int, output_dtype: Any) -> torch.Tensor:
    """CANN's A8W4 MSD kernel (vendor.A8W4_*): ``y = ((x − 8) @ (w·s) + bias)·per_token_scale``."""
    if k % v.A8W4_K_MULTIPLE:
        raise RuntimeError(f"(fake) aclnnGroupedMatmul A8W4 tiling failed: k should be divisible by 64, got {k}")
    if k > v.A8W4_MAX_K:
        raise RuntimeError(f"(fake) aclnnGroupedMatmul A8W4 tiling failed: K should be less than 18432, got {k}")
    if s.dim() != 3:
        raise NotImplementedError("(fake) per-channel A8W4 scales are not emulated (sglang passes [E, K/256, N])")
    g = s.shape[1]
    if g != 1 and k // g != v.A8W4_GROUP_SIZE:
        raise RuntimeError(f"(fake) aclnnGroupedMatmul A8W4: quantGroupSize must be 256, got {k // max(g, 1)}")
    w_scale = _per_group(_uint64_scale(s), groups, k, n).double()
    assert output_dtype in (torch.float16, torch.bfloat16), "int4 GEMMs output float16 or bfloat16"
    assert b is not None and b.dtype == torch.float32 and tuple(b.shape) == (groups, n), (
        f"A8W4: bias (8·Σ_k w·scale) is required, float32 [{groups}, {n}]")
    assert pts is not None and pts.dtype == torch.float32 and tuple(pts.shape) == (rows,), (
        f"A8W4: per_token_scale is required, float32 [{rows}]")
    out = torch.empty(rows, n, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts):
        xs = xv[start:start + c] - v.A8W4_X_SHIFT
        y = xs @ (wv[e].double() * w_scale[e]) + b[e].double()
        out[start:start + c] = (y * pts[start:start + c].double().unsqueeze(1)).float()
        start += c
    _fill(out, counts)
    return out.to(output_dtype)


def _pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., n]`` in [-8, 7] → int32 ``[..., n/8]`` (element 8j+m in bits 4m..4m+3)."""
    nibbles = (values.to(torch.int64) & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (nibbles << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def npu_dynamic_quant(
    input: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: Any = None,
    quant_mode: str = "pertoken",
    dst_type_max: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization: int8 (default) or ``torch.quint4x2`` (int32, 8 per word)."""
    _not_emulated(quant_mode=(quant_mode, "pertoken"), dst_type_max=(dst_type_max, 0.0))
    x = input
    assert x.dtype in (torch.float16, torch.bfloat16), f"x must be float16 or bfloat16, got {x.dtype}"
    assert x.dim() > 1, "x must have more than one dim"
    if group_index is not None:
        raise NotImplementedError("grouped smooth scales (group_index) are not emulated")
    xf = x.float()
    if smooth_scales is not None:
        assert smooth_scales.dim() == 1 and smooth_scales.numel() == x.shape[-1], "smooth_scales must be [H]"
        assert smooth_scales.dtype == x.dtype, "smooth_scales的dtype必须和x保持一致 (smooth_scales has x's dtype)"
        xf = xf * smooth_scales.float()
    if dst_type in (None, torch.int8):
        q = make_codec(mdb.WireFormat(md.DispatchDtype.INT8, x.shape[-1])).quantize(xf)
        assert q.scale is not None
        return q.data, q.scale
    assert dst_type == torch.quint4x2, f"dst_type must be int8 or quint4x2, got {dst_type}"
    assert x.shape[-1] % 8 == 0, "int4 quantization needs the last dim to be a multiple of 8"
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    scale = amax / INT4_MAX
    q = torch.round(xf / scale).clamp(INT4_MIN, INT4_MAX).to(torch.int32)
    return _pack_int4(q), scale.squeeze(-1)


def npu_dequant_swiglu_quant(
    x: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    activation_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    quant_offset: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    activate_left: bool = False,
    quant_mode: int = 0,
    dst_type: int | None = None,
    round_mode: int | None = None,
    activate_dim: int | None = None,
    swiglu_mode: int = 0,
    clamp_limit: float = 7.0,
    glu_alpha: float = 1.702,
    glu_bias: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (or bf16) ``[T, 2H]`` → dequant → SwiGLU → dynamic int8 ``[T, H]`` and fp32 ``[T]``."""
    _not_emulated(dst_type=(dst_type, None), round_mode=(round_mode, None), activate_dim=(activate_dim, None))
    assert x.dim() == 2 and x.shape[-1] % 2 == 0, "x must be 2-D [T, 2H] with an even last dim"
    assert x.dtype in (torch.int32, torch.bfloat16), f"x must be int32 or bfloat16, got {x.dtype}"
    tokens, two_h = x.shape
    h = two_h // 2
    if quant_mode != 1:
        raise NotImplementedError("static quantization (quant_mode=0) is not emulated")
    if swiglu_mode != 0:
        raise NotImplementedError("the SwiGLU variant (swiglu_mode=1) is not emulated")
    if x.dtype == torch.int32:
        assert weight_scale is not None and activation_scale is not None, (
            "int32 x needs weight_scale and activation_scale")
    else:  # the 2.13.0 doc: float x takes no dequant inputs
        assert weight_scale is None and activation_scale is None and bias is None, (
            "bfloat16 x: weight_scale, activation_scale and bias must be None")
    valid = tokens
    if group_index is not None:
        assert group_index.dtype == torch.int64 and group_index.dim() == 1, "group_index must be 1-D int64"
        assert bias is None and quant_offset is None, "with group_index, bias and quant_offset must be None"
        assert h <= DEQUANT_SWIGLU_MAX_H and h % 64 == 0, (
            f"with group_index, H={h} must be <= {DEQUANT_SWIGLU_MAX_H} and a multiple of 64")
        counts = [int(c) for c in group_index.tolist()]
        assert all(c >= 0 for c in counts), "group_index holds counts (non-negative)"
        valid = sum(counts)
        assert valid <= tokens, f"group_index sums to {valid} > {tokens} tokens (out-of-bounds access)"
        groups = len(counts)
        row_group = torch.repeat_interleave(torch.arange(groups), torch.tensor(counts, dtype=torch.int64),
                                            output_size=valid)
    else:
        assert bias is None, "bias is not emulated"
        groups, row_group = 1, torch.zeros(tokens, dtype=torch.int64)
    res = x[:valid].float()
    if weight_scale is not None:
        assert weight_scale.dtype == torch.float32, "weight_scale must be float32"
        ws = weight_scale.reshape(-1, two_h)
        assert ws.shape[0] == groups, f"weight_scale must be [{groups}, {two_h}]"
        res = res * ws[row_group]
    if activation_scale is not None:
        assert activation_scale.dtype == torch.float32, "activation_scale must be float32"
        assert activation_scale.numel() == tokens, f"activation_scale must be [{tokens}] (or [{tokens}, 1])"
        res = res * activation_scale.reshape(tokens, 1)[:valid]
    first, second = res.chunk(2, dim=-1)
    out = F.silu(first) * second if activate_left else F.silu(second) * first
    if quant_scale is not None:
        assert quant_scale.dtype in _FLOAT, "quant_scale must be float32, float16 or bfloat16"
        qs = quant_scale.float().reshape(-1, h)
        assert qs.shape[0] in (1, groups), f"quant_scale must be [1, {h}] or [{groups}, {h}]"
        out = out * (qs[row_group] if qs.shape[0] == groups else qs)
    amax = out.abs().amax(dim=-1).clamp_min(1e-10)  # the golden divides by the raw max  [U: all-zero rows]
    q = torch.round(torch.clamp(out * (127.0 / amax).unsqueeze(1), -128, 127)).to(torch.int8)
    y = torch.full((tokens, h), 127, dtype=torch.int8)
    scale = torch.full((tokens,), float("nan"), dtype=torch.float32)
    y[:valid], scale[:valid] = q, amax / 127.0
    return y, scale


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``swish(A)·B``, A and B the halves of ``input`` along ``dim``; same dtype (the registered
    schema: ``npu_swiglu(Tensor input, int dim=-1)``)."""
    x = input
    assert x.dtype in _FLOAT, f"x must be float32, float16 or bfloat16, got {x.dtype}"
    assert 1 <= x.dim() <= 8 and x.numel() > 0, "x must be 1-8 dims and not empty"
    assert x.is_contiguous(), "x must be contiguous (不支持非连续的Tensor)"
    assert x.shape[dim] % 2 == 0, "the split dim must be even"
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def npu_format_cast(input: torch.Tensor, acl_format: int, *, customize_dtype: int | None = None,
                    input_dtype: int | None = None) -> torch.Tensor:
    """The same values back, for ND (2) or FRACTAL_NZ (29), in the format torch_npu gives: FRACTAL_NZ only while
    ``npu.config.allow_internal_format`` is True, else ND ("tensor will be created with base format"), as
    ``get_npu_format`` then tells."""
    _not_emulated(customize_dtype=(customize_dtype, None), input_dtype=(input_dtype, None))
    assert isinstance(input, torch.Tensor) and isinstance(acl_format, int), "npu_format_cast(Tensor input, int acl_format)"
    if acl_format not in (v.ACL_FORMAT_ND, v.ACL_FORMAT_FRACTAL_NZ):
        raise NotImplementedError(f"(fake) ACL format {acl_format} is not emulated")
    out = input.clone()
    out._npu_format = acl_format if npu.config.allow_internal_format else v.ACL_FORMAT_ND  # type: ignore[attr-defined]
    return out


def get_npu_format(input: torch.Tensor) -> int:
    """The ACL format ``npu_format_cast`` gave ``input`` (ND for any other tensor)."""
    return getattr(input, "_npu_format", v.ACL_FORMAT_ND)


def npu_convert_weight_to_int4pack(weight: torch.Tensor, inner_k_tiles: int = 0) -> torch.Tensor:
    """int32 ``[k, n]`` in [-8, 7] → int32 ``[k, n/8]``, eight int4 per word. Registered for the NPU
    only: a CPU tensor raises as on torch_npu (so on a CPU machine the fake never packs; see
    ``pack_golden``)."""
    _cpu_has_no_kernel("npu_convert_weight_to_int4pack", weight)
    assert weight.dtype == torch.int32, f"weight must be int32, got {weight.dtype}"
    assert weight.dim() == 2, "weight must be 2-D"
    assert weight.is_contiguous(), "weight must be contiguous"
    assert weight.shape[-1] % 8 == 0, "the last dim must be a multiple of 8"
    assert bool(((weight >= INT4_MIN) & (weight <= INT4_MAX)).all()), "values must be within int4 [-8, 7]"
    return _pack_int4(weight)


def pack_golden(values: torch.Tensor) -> torch.Tensor:
    """op-plugin's golden ``pack_int4_3dim`` layout (what ``npu_convert_weight_to_int4pack`` returns):
    int32 ``[..., n]`` in [-8, 7] → int32 ``[..., n/8]``, element 8j+m in bits 4m..4m+3 of word j."""
    assert bool(((values >= INT4_MIN) & (values <= INT4_MAX)).all()), "values must be within int4 [-8, 7]"
    assert values.shape[-1] % 8 == 0, "the last dim must be a multiple of 8"
    return _pack_int4(values)


__all__ = [
    "DEVICE_NAME",
    "VECTOR_CORES",
    "get_npu_format",
    "vector_cores",
    "SOC_VERSION",
    "group_hccl_config",
    "hccl_config_of",
    "npu",
    "pack_golden",
    "soc_version",
    "npu_convert_weight_to_int4pack",
    "npu_format_cast",
    "npu_dequant_swiglu_quant",
    "npu_dynamic_quant",
    "npu_grouped_matmul",
    "npu_swiglu",
]
