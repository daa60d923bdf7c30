"""The arithmetic of DeepGEMM's grouped GEMMs, in fp32 on CPU, shared by the DeepGEMM fakes.

``d[m] = dequant(a[m]) @ dequant(b[g])ᵀ``, written as bf16: ``a`` scaled per (row, 128 channels), ``b``
per 128×128 block (fp32, the SM90 recipe) or per (row, 128 channels) (UE8M0 on SM100).
"""

from __future__ import annotations

import torch

from moe_dispatch.backend import ue8m0_value, unpack_ue8m0

BLOCK = 128


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b`` (DeepGEMM's ``math::align``)."""
    return ceil_div(a, b) * b


def zero_rows(data: torch.Tensor) -> torch.Tensor:
    """bool ``[R]``: the rows of ``data [R, K]`` whose every element is ±0 (FP8 or BF16)."""
    return (data.float() == 0).all(dim=-1)


def dequant_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data [..., R, K]`` times per-(row, 128) fp32 ``scale [..., R, ceil(K/128)]``."""
    k = data.shape[-1]
    return data.float() * scale.float().repeat_interleave(BLOCK, dim=-1)[..., :k]


def rows_from_blocks(sf: torch.Tensor, n: int) -> torch.Tensor:
    """128×128 block scales ``[G, ceil(N/128), ceil(K/128)]`` → per-row ``[G, N, ceil(K/128)]``."""
    return sf.float().repeat_interleave(BLOCK, dim=-2)[..., :n, :]


def ue8m0_values(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 words of four UE8M0 bytes ``[..., ceil(K/512)]`` → fp32 ``[..., ceil(K/128)]``."""
    return unpack_ue8m0(packed.contiguous(), ceil_div(k, BLOCK))


def exponent_only(sf: torch.Tensor) -> torch.Tensor:
    """What DeepGEMM's PyTorch cast to UE8M0 keeps of an fp32 scale: the byte ``bits >> 23`` (the exponent of a
    positive value), as the value ``2^(byte - 127)`` (csrc/jit_kernels/impls/smxx_layout.hpp
    ``get_mn_major_tma_aligned_packed_ue8m0_tensor_torch``)."""
    return ue8m0_value(((sf.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8))


def cuda_cast_bytes(sf: torch.Tensor) -> torch.Tensor:
    """The bytes DeepGEMM's CUDA cast packs for fp32 scales ``[..., K]`` (``transpose_and_pack_fp32_into_ue8m0``,
    ``pack_fp32_into_ue8m0``, deep_gemm/include/deep_gemm/impls/smxx_layout.cuh): per group of four values
    ``v0 >> 23 | v1 >> 15 | v2 >> 7 | v3 << 1`` as a uint32, no mask. For powers of two that is each exponent in its
    byte; otherwise the mantissa bits of the later values land in the earlier bytes (garbage exponents). 2.6.1
    device-asserts powers of two first. Returns uint8 ``[..., K]``."""
    k = sf.shape[-1]
    bits = sf.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.nn.functional.pad(bits, (0, -k % 4)).unflatten(-1, (-1, 4))
    word = ((bits[..., 0] >> 23) | (bits[..., 1] >> 15) | (bits[..., 2] >> 7) | (bits[..., 3] << 1)) & 0xFFFFFFFF
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(4)], dim=-1).flatten(-2)
    return out[..., :k].to(torch.uint8)


def cuda_cast(sf: torch.Tensor) -> torch.Tensor:
    """``cuda_cast_bytes`` as the fp32 values the GEMM then multiplies by."""
    return ue8m0_value(cuda_cast_bytes(sf))


def is_power_of_two(sf: torch.Tensor) -> bool:
    """``(bits & 0x807fffff) == 0`` for every value: positive, no mantissa."""
    return bool(((sf.float().contiguous().view(torch.int32) & 0x807FFFFF) == 0).all())


def grouped_contiguous(a: torch.Tensor, w: torch.Tensor, groups: torch.Tensor, padding: float) -> torch.Tensor:
    """fp32 ``[M, N]``: row m times ``w[groups[m]]``; rows of group -1 get ``padding``."""
    m, n = a.shape[0], w.shape[1]
    out = torch.full((m, n), padding, dtype=torch.float32)
    ids = groups.long()
    for group in torch.unique(ids[ids >= 0]).tolist():
        rows = (ids == group).nonzero().squeeze(1)
        out[rows] = a[rows] @ w[group].t()
    return out


def grouped_masked(a: torch.Tensor, w: torch.Tensor, d: torch.Tensor, masked_m: list[int], block_m: int) -> None:
    """Rows ``< masked_m[g]`` of each group into ``d`` (bf16), as whole ``block_m``-row tiles stored into one
    ``[G·m, n]`` view: the tile rows past ``masked_m[g]`` get garbage (NaN), spilling into the next group's first
    rows when the tile passes ``m`` (clipped only at ``G·m``). The rest of ``d`` is left as it was."""
    groups, m = d.shape[0], d.shape[1]
    flat = d.view(groups * m, d.shape[2])
    spills = []
    for group, rows in enumerate(masked_m):
        if rows:
            d[group, :rows] = (a[group, :rows] @ w[group].t()).to(d.dtype)
            end = min(group * m + ceil_div(rows, block_m) * block_m, groups * m)
            spills.append((group * m + rows, end))
    for start, end in spills:  # after every group's rows: the store that lands last wins the race
        flat[start:end] = float("nan")


__all__ = ["BLOCK", "align", "ceil_div", "cuda_cast", "cuda_cast_bytes", "dequant_rows", "exponent_only",
           "grouped_contiguous", "grouped_masked", "is_power_of_two", "rows_from_blocks", "ue8m0_values", "zero_rows"]
