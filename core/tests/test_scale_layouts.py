"""The 128×4 swizzled NVFP4 scale layout: the element offsets FlashInfer's kernels use, and
the inverse."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import moe_dispatch as md
from moe_dispatch.backend import swizzle_128x4, swizzled_shape
from moe_dispatch._scale_layouts import unswizzle_128x4


def _offset(m: int, k: int, kp: int) -> int:
    """FlashInfer's ``get_sf_out_offset_128x4`` (csrc/nv_internal/.../quantization.cuh):
    512-byte tiles of 128 rows × 4 columns, row-major over tiles; inside a tile the byte
    (m % 32)·16 + ((m % 128) // 32)·4 + k % 4."""
    tile = (m // 128) * (kp // 4) + k // 4
    return tile * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 300), columns=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_every_scale_lands_where_the_kernel_reads_it(rows, columns, seed):
    g = torch.Generator().manual_seed(seed)
    linear = torch.randint(1, 256, (rows, columns), generator=g, dtype=torch.uint8)
    swizzled = swizzle_128x4(linear)
    mp, kp = swizzled_shape(rows, columns)
    assert swizzled.shape == (mp, kp)
    flat = swizzled.flatten()
    for m in range(rows):
        for k in range(columns):
            assert flat[_offset(m, k, kp)] == linear[m, k]
    assert int((flat != 0).sum()) == rows * columns  # padding is zero
    assert torch.equal(unswizzle_128x4(swizzled, rows, columns), linear)


def test_batched_e4m3_blocks_swizzle_per_expert():
    scales = (torch.rand(3, 130, 8) * 4).to(torch.float8_e4m3fn)
    sw = swizzle_128x4(scales)
    assert sw.dtype == torch.float8_e4m3fn and sw.shape == (3, 256, 8)
    for e in range(3):
        assert torch.equal(sw[e].view(torch.uint8), swizzle_128x4(scales[e]).view(torch.uint8))
    assert torch.equal(unswizzle_128x4(sw, 130, 8).view(torch.uint8), scales.view(torch.uint8))


def test_wrong_shapes_are_typed_errors():
    with pytest.raises(md.InvalidInputError, match="128"):
        unswizzle_128x4(torch.zeros(100, 4, dtype=torch.uint8), 100, 4)
    with pytest.raises(md.InvalidInputError, match="one byte"):
        swizzle_128x4(torch.zeros(4, 4))
