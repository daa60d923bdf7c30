"""The recorded vendor signatures (``vendor.py``) against the fakes, and, where the vendor is
installed, against the vendor: torch_npu's registered op schemas (``torch_npu.npu_X`` is
``torch.ops.npu.npu_X``; read from ``libtorch_npu.so`` without loading it, which needs CANN), its
documented prototypes (``_op_plugin_docs.py``: what the docs say, recorded apart) and
DeepEP-Ascend's ``buffer.py`` (read by AST; every supported build's signatures are recorded, as the
hardware check accepts them). A plain run skips the vendor checks with the reason;
``pip install --no-deps torch-npu==2.13.0`` (no NPU needed) runs the torch_npu ones."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

import pytest

from moe_dispatch_ascend_deepep import vendor as v
from moe_dispatch_ascend_deepep_testing import FAKE, FAKE_ENV_ONLY, SIGNATURES, TORCH_NPU_FAKE
from moe_dispatch_ascend_deepep_testing.fakes import deep_ep as fake
from moe_dispatch_ascend_deepep_testing.hardware import deep_ep_source_rows
from moe_dispatch_testing.signatures import compare, differences, signature_from_source


@pytest.mark.parametrize("fake_module", [FAKE, FAKE_ENV_ONLY])
def test_each_fake_buffer_method_has_the_recorded_signature(fake_module):
    buffer = importlib.import_module(fake_module).Buffer
    problems = [p for rec in SIGNATURES[fake_module]
                for p in differences(rec, getattr(buffer, rec.qualname.split(".")[1]))]
    assert problems == []


@pytest.mark.parametrize("record", v.TORCH_NPU_SIGNATURES, ids=lambda r: r.qualname)
def test_each_torch_npu_fake_takes_the_registered_schema(record):
    fake_npu = importlib.import_module(TORCH_NPU_FAKE)
    assert differences(record, getattr(fake_npu, record.qualname)) == []
    assert record.text == v.schema_params(v.TORCH_NPU_SCHEMAS[record.qualname])


def test_a_wrong_keyword_fails_in_the_fake_as_in_the_vendor():
    """``npu_swiglu(Tensor input, int dim=-1)``: a keyword ``x=`` is a TypeError on the real op."""
    import torch

    fake_npu = importlib.import_module(TORCH_NPU_FAKE)
    with pytest.raises(TypeError):
        fake_npu.npu_swiglu(x=torch.ones(2, 4))
    config = fake.Config
    with pytest.raises(TypeError, match="incompatible"):
        config(20, 6, 256, 6, 128.0)  # pybind: ints are not floats


@pytest.mark.parametrize("fake_module,quant,ll_quant", [(FAKE, True, True), (FAKE_ENV_ONLY, False, False)])
def test_detect_reads_the_version_from_the_signatures(fake_module, quant, ll_quant):
    info = v.detect(fake_module)
    assert info.is_ascend and info.supported and info.emulated and info.has_strategies
    assert (info.has_quant_mode, info.ll_quant_mode) == (quant, ll_quant)


def test_the_documented_prototype_reader():
    docs = '''
_add_torch_npu_docstr(
    "npu_demo",
    """
功能描述: ...
npu_demo是一种...
接口原型:
torch_npu.npu_demo(Tensor x,
    *, Tensor? smooth=None, int[]? tuning, bool left=False) -> (Tensor, Tensor)
""",
)
'''
    assert v.documented_signature(docs, "npu_demo") == "(x, *, smooth=None, tuning=None, left=False)"
    assert v.documented_signature(docs, "npu_other") is None


def test_the_fake_config_is_pybinds():
    assert differences(v.SIG_CONFIG_INIT, fake.Config.__init__) == []
    assert fake.Config().num_max_rdma_chunked_recv_tokens == 256 and fake.Config(num_sms=24).num_sms == 24
    with pytest.raises(TypeError, match="incompatible"):
        fake.Config(20.0)


def test_every_supported_build_has_a_recorded_signature(tmp_path):
    """KN@0ac00159..9aa6257c (no topk_weights) and 9aa6257c..be6b5e7f (no use_mxfp4) have their own
    low_latency_dispatch; builds before 9aa6257c the old __init__: the hardware check accepts them."""
    recorded = {rec.text for rec in v.RECORDED_VERSIONS["Buffer.low_latency_dispatch"]}
    assert {v.SIG_LOW_LATENCY_DISPATCH_OLD.text, v.SIG_LOW_LATENCY_DISPATCH_TOPK_WEIGHTS.text} <= recorded
    oldest = {**{q: recs[0] for q, recs in v.RECORDED_VERSIONS.items()},
              "Buffer.__init__": v.SIG_BUFFER_INIT_OLD, "Buffer.low_latency_dispatch": v.SIG_LOW_LATENCY_DISPATCH_OLD,
              "Buffer.dispatch": v.SIG_DISPATCH_ENV_ONLY, "Buffer.fused_deep_moe": v.SIG_FUSED_DEEP_MOE_NO_PROFILE}
    body = "\n".join(f"    def {q.split('.')[1]}{rec.text}:\n        pass" for q, rec in oldest.items())
    path = tmp_path / "buffer.py"
    path.write_text(f"class Buffer:\n{body}\n", encoding="utf-8")
    rows = deep_ep_source_rows(path)
    assert rows and all(row.ok for row in rows), rows


# -- the installed vendor (optional) -------------------------------------------------------------------------

_DOCS = v.torch_npu_docs_path()


@pytest.mark.vendor_code
@pytest.mark.skipif(_DOCS is None, reason="torch_npu is not installed: `pip install --no-deps torch-npu==2.13.0` "
                    "(its docs module is read without importing it; no NPU or CANN needed)")
@pytest.mark.parametrize("record", v.TORCH_NPU_DOC_SIGNATURES, ids=lambda r: r.qualname)
def test_the_installed_torch_npu_documents_the_recorded_prototype(record):
    assert _DOCS is not None
    documented = v.documented_signature(Path(_DOCS).read_text(encoding="utf-8"), record.qualname)
    assert documented is not None, f"{_DOCS} documents no {record.qualname}"
    from moe_dispatch.backend import VendorSignature

    assert compare(record.params, VendorSignature(record.qualname, documented, _DOCS).params,
                   record.qualname) == []


_LIBRARY = v.torch_npu_library_path()


@pytest.mark.vendor_code
@pytest.mark.skipif(_LIBRARY is None, reason="torch_npu is not installed: `pip install --no-deps torch-npu==2.13.0` "
                    "(libtorch_npu.so is read as bytes, not loaded; no NPU or CANN needed)")
@pytest.mark.parametrize("record", v.TORCH_NPU_SIGNATURES, ids=lambda r: r.qualname)
def test_the_installed_torch_npu_registers_the_recorded_schema(record):
    assert _LIBRARY is not None
    schema = v.registered_schema(Path(_LIBRARY).read_bytes(), record.qualname)
    assert schema is not None, f"{_LIBRARY} registers no {record.qualname}"
    from moe_dispatch.backend import VendorSignature

    assert compare(record.params, VendorSignature(record.qualname, v.schema_params(schema), _LIBRARY).params,
                   record.qualname) == []


def _deep_ep_buffer_py() -> str | None:
    spec = importlib.util.find_spec(v.REAL)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "buffer.py")
    return path if os.path.exists(path) and "deep_ep_cpp" in Path(path).read_text(encoding="utf-8") else None


_BUFFER_PY = _deep_ep_buffer_py()


@pytest.mark.vendor_code
@pytest.mark.skipif(_BUFFER_PY is None, reason="DeepEP-Ascend is not installed (it builds from source with CANN; "
                    "sgl-kernel-npu is not on the package index)")
def test_the_installed_deep_ep_buffer_has_a_recorded_signature_per_method():
    assert _BUFFER_PY is not None
    for qualname, recs in v.RECORDED_VERSIONS.items():
        got = signature_from_source(_BUFFER_PY, qualname)
        assert any(compare(r.params, got) == [] for r in recs), (qualname, got)
