"""One declaration per wire dtype (``moe_dispatch.formats``): the byte counts, codecs, tolerances
and checks all read it, and the library names a format only where a policy picks it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_testing.accuracy import TOLERANCES
from moe_dispatch.backend import make_codec
from moe_dispatch._wire import WIRE_DTYPES

LIBRARY = Path(md.__file__).parent
WINGS = ("testing/", "cli/", "accuracy.py", "routing.py", "__main__.py")


@pytest.mark.parametrize("hidden", [128, 2048, 7168])
def test_bytes_per_token_are_the_documented_ones(hidden):
    expected = {md.DispatchDtype.BF16: 2 * hidden, md.DispatchDtype.FP8: hidden + 4 * hidden // 128,
                md.DispatchDtype.INT8: hidden + 4, md.DispatchDtype.NVFP4: hidden // 2 + hidden // 16}
    assert {d: mdb.WireFormat(d, hidden).bytes_per_token for d in md.DispatchDtype} == expected
    assert mdb.WireFormat(md.DispatchDtype.FP8, hidden, ue8m0=True).bytes_per_token == hidden + hidden // 128


def test_every_dtype_is_declared_once_with_a_codec_that_matches_it():
    assert set(WIRE_DTYPES) == set(md.DispatchDtype)
    x = torch.randn(3, 256)
    for dtype, fmt in WIRE_DTYPES.items():
        codec = make_codec(mdb.WireFormat(dtype, 256), 100.0 if fmt.global_scale else None)
        q = codec.quantize(x)
        assert codec.dtype is dtype and q.data.dtype == fmt.element == codec.data_dtype()
        assert q.data.shape == (3, fmt.row_columns(256))
        assert (q.scale is not None) == fmt.scaled
        assert TOLERANCES[dtype] == fmt.tolerance


def test_ue8m0_and_the_global_scale_come_from_the_declaration():
    for dtype, fmt in WIRE_DTYPES.items():
        if fmt.ue8m0_scale_bytes:
            mdb.WireFormat(dtype, 256, ue8m0=True)
        else:
            with pytest.raises(md.InvalidSpecError):
                mdb.WireFormat(dtype, 256, ue8m0=True)
        if fmt.global_scale:
            with pytest.raises(md.InvalidSpecError) as info:
                make_codec(mdb.WireFormat(dtype, 256))
            assert info.value.parameter == "quant.input_global_scale"


def _members_named(path: Path) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "DispatchDtype"
            and re.fullmatch(r"[A-Z0-9]+", node.attr)}


def test_the_library_names_a_format_only_where_a_policy_picks_it():
    """Adding a format is ``_wire.py`` (the member and its declaration) and ``_codecs.py`` (its codec):
    no other library module names a format for what it is (bytes, blocks, scales, tolerance, row shape)."""
    named = {}
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = path.relative_to(LIBRARY).as_posix()
        if rel.startswith(WINGS):
            continue
        members = _members_named(path)
        if members:
            named[rel] = members
    assert named == {
        "_wire.py": {"BF16", "FP8", "INT8", "NVFP4"},  # the declarations; FP8_BLOCK, NVFP4_BLOCK read from them
        "_codecs.py": {"BF16", "FP8", "INT8", "NVFP4"},  # each codec's WIRE_DTYPE
        "_resolution.py": {"BF16", "FP8", "NVFP4"},  # policy: the legacy BF16 variable, a global scale asks
                                                       # for NVFP4, the library default FP8
        "planning.py": {"BF16"},  # sglang sizes every buffer for a BF16 wire
        "_contract.py": {"BF16"},  # combine sends BF16 back
    }
