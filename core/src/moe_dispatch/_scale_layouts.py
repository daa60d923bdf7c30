"""Block-scale layouts of NVFP4 activations: linear per row, as they cross the wire, and the 128×4 swizzled layout
FP4 tensor-core GEMMs read, made after dispatch (``swizzle_128x4``; ``unswizzle_128x4`` for vendors that hand scales
over swizzled).

The layout (FlashInfer ``fp4_quantization.py`` ``SfLayout.layout_128x4`` / ``block_scale_interleave``, v0.3; vLLM
``_swizzle_blockscale``): pad rows to a multiple of 128 and scale columns to a multiple of 4 with zeros, then store the
scale of (row m, column k) at tile ``(m // 128, k // 4)``, position ``(m % 32, (m % 128) // 32, k % 4)`` within the
tile, tiles in row-major order, returned as ``[..., round_up(M, 128), round_up(K, 4)]``.
"""

from __future__ import annotations

import torch

from ._errors import InvalidInputError

ROW_TILE, COL_TILE = 128, 4


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def swizzled_shape(rows: int, columns: int) -> tuple[int, int]:
    """The padded ``(rows, columns)`` of the swizzled layout."""
    return _round_up(rows, ROW_TILE), _round_up(columns, COL_TILE)


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Linear ``[..., M, K]`` block scales → the 128×4 layout ``[..., round_up(M,128), round_up(K,4)]``, for any
    one-byte dtype (float8_e4m3fn, uint8), one swizzled block per leading index (per expert of a MASKED layout)."""
    if scales.dim() < 2 or scales.element_size() != 1:
        raise InvalidInputError("block scales must be one byte each, at least [M, K]", parameter="scales", value=scales,
                                allowed="float8_e4m3fn or uint8 [..., M, K]")
    *lead, m, k = scales.shape
    mp, kp = swizzled_shape(m, k)
    padded = torch.zeros(*lead, mp, kp, dtype=torch.uint8, device=scales.device)
    padded[..., :m, :k] = scales.view(torch.uint8)
    tiles = padded.reshape(*lead, mp // ROW_TILE, 4, 32, kp // COL_TILE, COL_TILE)
    n = len(lead)
    # (m_tile, inner_m, outer, k_tile, inner_k) → (m_tile, k_tile, outer, inner_m, inner_k)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return tiles.permute(order).reshape(*lead, mp, kp).contiguous().view(scales.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The inverse of ``swizzle_128x4``: back to linear ``[..., rows, columns]``, padding dropped."""
    mp, kp = swizzled_shape(rows, columns)
    if swizzled.dim() < 2 or tuple(swizzled.shape[-2:]) != (mp, kp) or swizzled.element_size() != 1:
        raise InvalidInputError(f"a swizzled block for {rows}×{columns} scales is {mp}×{kp} bytes",
                                parameter="swizzled", value=swizzled, allowed=f"one-byte [..., {mp}, {kp}]")
    lead = swizzled.shape[:-2]
    n = len(lead)
    tiles = swizzled.view(torch.uint8).reshape(*lead, mp // ROW_TILE, kp // COL_TILE, 32, 4, COL_TILE)
    # (m_tile, k_tile, outer, inner_m, inner_k) → (m_tile, inner_m, outer, k_tile, inner_k)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    linear = tiles.permute(order).reshape(*lead, mp, kp)
    return linear[..., :rows, :columns].contiguous().view(swizzled.dtype)


def to_mma_view(linear: torch.Tensor) -> torch.Tensor:
    """Linear ``[E, M, K]`` scales → swizzled per E, viewed as the CuTe-DSL MMA layout
    ``(32, 4, ceil(M/128), 4, ceil(K/4), E)`` (FlashInfer ``convert_sf_to_mma_layout``; what DeepEP's hybrid-ep
    low-latency NVFP4 dispatch returns). A view: no copy after the swizzle."""
    e, m, k = linear.shape
    mp, kp = swizzled_shape(m, k)
    return swizzle_128x4(linear).view(e, mp // ROW_TILE, kp // COL_TILE, 32, 4, COL_TILE).permute(3, 4, 1, 5, 2, 0)


def from_mma_view(mma: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The inverse of ``to_mma_view``: linear ``[E, rows, columns]`` (a copy)."""
    if mma.dim() != 6 or tuple(mma.shape[:2]) != (32, 4) or mma.shape[3] != 4:
        raise InvalidInputError("not an MMA scale view", parameter="scales", value=mma,
                                allowed="(32, 4, m_tiles, 4, k_tiles, E)")
    storage = mma.permute(5, 2, 4, 0, 1, 3)  # (E, m_tiles, k_tiles, 32, 4, 4)
    e, mt, kt = storage.shape[:3]
    return unswizzle_128x4(storage.reshape(e, mt * ROW_TILE, kt * COL_TILE), rows, columns)
