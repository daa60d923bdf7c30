"""Every fake's callables have the signatures recorded from the vendor's source in ``vendor.py``: a keyword
the vendor does not take, or a positional argument in the wrong place, fails in the fake as in the vendor.
(``scripts/hardware_check.py`` compares the same records with the real callables.)"""

import importlib

import pytest

from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep_testing import (
    DEEP_GEMM_EMULATOR,
    DEEP_GEMM_EMULATOR_SM100,
    DEEP_GEMM_V1_EMULATOR,
    DEEP_GEMM_V1_PYPI_EMULATOR,
    EMULATOR,
    EMULATOR_NVFP4,
    EMULATOR_TOPK_INT32,
    EMULATOR_V1_TOPK9,
)
from moe_dispatch_testing.signatures import differences


def _check(module, records) -> list[str]:
    module = importlib.import_module(module) if isinstance(module, str) else module
    problems = []
    for record in records:
        problems += differences(record, vendor.lookup(module, record.qualname))
    return problems


def _deep_ep(name):
    return name, vendor.deep_ep_signatures(vendor.release_of(importlib.import_module(name)))


@pytest.mark.parametrize("module_name,records", [
    (EMULATOR, vendor.DEEP_EP_SIGNATURES),
    _deep_ep(EMULATOR_TOPK_INT32),
    _deep_ep(EMULATOR_NVFP4),
    _deep_ep(EMULATOR_V1_TOPK9),
    (DEEP_GEMM_EMULATOR, vendor.DEEP_GEMM_SIGNATURES),
    (DEEP_GEMM_EMULATOR_SM100, vendor.DEEP_GEMM_SIGNATURES),
    (DEEP_GEMM_V1_EMULATOR, vendor.DEEP_GEMM_V1_SIGNATURES),
    (DEEP_GEMM_V1_PYPI_EMULATOR, vendor.DEEP_GEMM_V1_SIGNATURES),
])
def test_fake_signatures_equal_the_recorded_ones(module_name, records):
    assert _check(module_name, records) == []


@pytest.mark.parametrize("version", ["2.0.0", "2.2.0", "2.3.0", "2.5.0", "2.6.1"])
def test_each_emulated_deep_gemm_version_has_its_recorded_signatures(version):
    """``m_indices`` up to 2.2.0, recipe_a/recipe_b and the PSUM layout from 2.3.0,
    ``ensure_zero_padding`` from 2.6.1."""
    module = importlib.import_module(DEEP_GEMM_EMULATOR).emulate((9, 0), version)
    assert _check(module, vendor.deep_gemm_signatures("v2", version)) == []


def test_a_wrong_record_is_caught():
    """The comparison is not vacuous: main's low_latency_dispatch is not the hybrid-ep branch's."""
    problems = _check(EMULATOR_NVFP4, (vendor.BUFFER_LL_DISPATCH,))
    assert problems and ("order differs" in problems[0] or "extra" in problems[0])


def test_the_deep_gemm_aliases_are_the_same_callables():
    module = importlib.import_module(DEEP_GEMM_EMULATOR)
    assert getattr(module, vendor.DG_FP8_MASKED_ALIAS) is getattr(module, vendor.DG_FP8_MASKED)
