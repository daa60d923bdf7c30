"""Every fake's callables have the signatures recorded from the vendor's source in ``vendor.py``: a keyword
the vendor does not take, or a positional argument in the wrong place, fails in the fake as in the vendor.
(``scripts/hardware_check.py`` compares the same records with the real callables.)"""

import importlib

import pytest

from moe_dispatch.signatures import VendorSignature, differences
from moe_dispatch_cuda_deepep import vendor


def _check(module_name: str, records) -> list[str]:
    module = importlib.import_module(module_name)
    problems = []
    for record in records:
        problems += differences(VendorSignature(*record), vendor.lookup(module, record.qualname))
    return problems


def _replace(records, *overrides):
    by_name = {r.qualname: r for r in overrides}
    return tuple(by_name.get(r.qualname, r) for r in records)


@pytest.mark.parametrize("module_name,records", [
    (vendor.EMULATOR, vendor.DEEP_EP_SIGNATURES),
    (vendor.EMULATOR_TOPK_INT32, vendor.DEEP_EP_SIGNATURES),
    (vendor.EMULATOR_NVFP4, _replace(vendor.DEEP_EP_SIGNATURES, *vendor.HYBRID_SIGNATURES)),
    (vendor.EMULATOR_V1_TOPK9, _replace(vendor.DEEP_EP_SIGNATURES, vendor.V121_BUFFER_INIT)),
    (vendor.DEEP_GEMM_EMULATOR, vendor.DEEP_GEMM_SIGNATURES),
    (vendor.DEEP_GEMM_EMULATOR_SM100, vendor.DEEP_GEMM_SIGNATURES),
    (vendor.DEEP_GEMM_V1_EMULATOR, vendor.DEEP_GEMM_V1_SIGNATURES),
])
def test_fake_signatures_equal_the_recorded_ones(module_name, records):
    assert _check(module_name, records) == []


def test_a_wrong_record_is_caught():
    """The comparison is not vacuous: main's low_latency_dispatch is not the hybrid-ep branch's."""
    problems = _check(vendor.EMULATOR_NVFP4, (vendor.BUFFER_LL_DISPATCH,))
    assert problems and "order differs" in problems[0] or "extra" in problems[0]


def test_the_deep_gemm_aliases_are_the_same_callables():
    module = importlib.import_module(vendor.DEEP_GEMM_EMULATOR)
    assert getattr(module, vendor.DG_FP8_MASKED_ALIAS) is getattr(module, vendor.DG_FP8_MASKED)
