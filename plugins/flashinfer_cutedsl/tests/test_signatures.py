"""Every fake's callables have the signature ``vendor.SIGNATURES`` records for the version the
fake models (a keyword FlashInfer does not take fails in the fake as there), the adapter's
CommBackend has FlashInfer's CommBackend methods, and the records cover every supported version."""

import importlib

import pytest

from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend, LocalCommBackend
from moe_dispatch_flashinfer_cutedsl_testing import FAKE_0_6_7, FAKES
from moe_dispatch_testing.signatures import differences

CALLABLES = {
    "MoeAlltoAll.__init__": lambda m: m.comm.MoeAlltoAll.__init__,
    "MoeAlltoAll.dispatch": lambda m: m.comm.MoeAlltoAll.dispatch,
    "MoeAlltoAll.combine": lambda m: m.comm.MoeAlltoAll.combine,
    "moe_a2a_get_workspace_size_per_rank": lambda m: m.comm.moe_a2a_get_workspace_size_per_rank,
    "Mapping.__init__": lambda m: m.comm.Mapping.__init__,
    "MnnvlConfig": lambda m: m.comm.mnnvl.MnnvlConfig.__init__,
    "fp4_quantize": lambda m: m.fp4_quantize,
    "CuteDslMoEWrapper.__init__": lambda m: m.CuteDslMoEWrapper.__init__,
    "CuteDslMoEWrapper.run": lambda m: m.CuteDslMoEWrapper.run,
}


@pytest.mark.parametrize("fake,version", FAKES)
def test_each_fake_has_the_recorded_signatures_of_its_version(fake, version):
    module = importlib.import_module(fake)
    assert vendor.parse_version(module.__version__) == version
    problems = []
    for qualname, get in CALLABLES.items():
        recorded = vendor.signature(qualname, version)
        assert recorded is not None, f"{qualname} has no record for {version}"
        problems += differences(recorded, get(module))
    assert not problems, "\n".join(problems)


def test_a_wrong_keyword_fails_in_the_fake_as_in_flashinfer():
    old = importlib.import_module(FAKE_0_6_7)
    with pytest.raises(TypeError, match="activation_type"):
        old.CuteDslMoEWrapper(8, 1, 256, 128, activation_type=3)
    with pytest.raises(TypeError, match="output_dtype"):
        old.comm.MoeAlltoAll.combine(object(), None, 4, output_dtype=None)


def test_the_records_cover_every_version_from_the_first_release_on():
    for qualname, rules in vendor.SIGNATURES.items():
        since = vendor.CUTEDSL_SINCE if qualname.startswith("CuteDsl") else vendor.A2A_SINCE
        assert rules[0].since == since, qualname
        for before, after in zip(rules, rules[1:]):
            assert before.until == after.since, f"{qualname}: a gap or overlap at {before.until}"
        assert rules[-1].until is None, qualname
    assert vendor.signature("CuteDslMoEWrapper.__init__", (0, 6, 3)) is None


@pytest.mark.parametrize("cls", [GroupCommBackend, LocalCommBackend])
def test_the_adapters_comm_backend_has_flashinfers_methods(cls):
    problems = []
    for recorded in vendor.COMM_BACKEND_METHODS:
        problems += differences(recorded, getattr(cls, recorded.qualname.split(".")[1]))
    assert not problems, "\n".join(problems)
