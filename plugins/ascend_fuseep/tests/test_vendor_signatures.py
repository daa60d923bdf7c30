"""The recorded ``fused_deep_moe`` signatures (``vendor.py``) against the fakes, per version, and
against an installed DeepEP-Ascend's ``buffer.py`` (read by AST; skipped without it)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

from moe_dispatch_ascend_deepep import vendor as deepep_vendor
from moe_dispatch_ascend_fuseep import vendor as v
from moe_dispatch_ascend_fuseep_testing import FAKE, FAKE_NO_FUSE_MODE, SIGNATURES
from moe_dispatch_testing.signatures import compare, differences, signature_from_source


@pytest.mark.parametrize("fake_module", [FAKE, FAKE_NO_FUSE_MODE])
def test_each_fake_fused_deep_moe_has_the_recorded_signature(fake_module):
    buffer = importlib.import_module(fake_module).Buffer
    assert differences(SIGNATURES[fake_module], buffer.fused_deep_moe) == []
    # the rest of the Buffer is DeepEP-Ascend's main, recorded by ascend_deepep
    problems = [p for rec in deepep_vendor.DEEP_EP_SIGNATURES if rec.qualname != "Buffer.fused_deep_moe"
                for p in differences(rec, getattr(buffer, rec.qualname.split(".")[1]))]
    assert problems == []


def test_detect_sees_which_fused_deep_moe_is_installed():
    assert "fuse_mode" in v.detect(FAKE).fused_params and "profile_enable" in v.detect(FAKE).fused_params
    assert "fuse_mode" not in v.detect(FAKE_NO_FUSE_MODE).fused_params


def _buffer_py() -> str | None:
    spec = importlib.util.find_spec(v.REAL)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "buffer.py")
    return path if os.path.exists(path) and "fused_deep_moe" in Path(path).read_text(encoding="utf-8") else None


_BUFFER_PY = _buffer_py()


@pytest.mark.vendor_code
@pytest.mark.skipif(_BUFFER_PY is None, reason="DeepEP-Ascend with fused_deep_moe is not installed (it builds from "
                    "source with CANN; sgl-kernel-npu is not on the package index)")
def test_the_installed_fused_deep_moe_is_a_recorded_version():
    assert _BUFFER_PY is not None
    got = signature_from_source(_BUFFER_PY, "Buffer.fused_deep_moe")
    records = (v.SIG_FUSED_DEEP_MOE, v.SIG_FUSED_DEEP_MOE_NO_PROFILE, v.SIG_FUSED_DEEP_MOE_NO_FUSE_MODE)
    assert any(compare(r.params, got) == [] for r in records), got
