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
    "create_communication": lambda m: m.moe_ep.create_communication,
    "BootstrapConfig": lambda m: m.moe_ep.BootstrapConfig.__init__,
    "MoEEpCommParams": lambda m: m.moe_ep.MoEEpCommParams.__init__,
    "NVLinkOneSidedConfig": lambda m: m.moe_ep.NVLinkOneSidedConfig.__init__,
    "NVLinkOneSidedAlltoAll.__init__": lambda m: m.moe_ep.NVLinkOneSidedAlltoAll.__init__,
    "NVLinkOneSidedAlltoAll.dispatch": lambda m: m.moe_ep.NVLinkOneSidedAlltoAll.dispatch,
    "NVLinkOneSidedAlltoAll.combine": lambda m: m.moe_ep.NVLinkOneSidedAlltoAll.combine,
}
#: The callables of one all-to-all generation: MoeAlltoAll until 0.7.2, flashinfer.moe_ep from 0.7.4.
A2A_ONLY = ("MoeAlltoAll.", "moe_a2a_get_workspace_size_per_rank")
EP_ONLY = ("create_communication", "BootstrapConfig", "MoEEpCommParams", "NVLinkOneSided")


@pytest.mark.parametrize("fake,version", FAKES)
def test_each_fake_has_the_recorded_signatures_of_its_version(fake, version):
    module = importlib.import_module(fake)
    assert vendor.parse_version(module.__version__) == version
    problems = []
    for qualname, get in CALLABLES.items():
        recorded = vendor.signature(qualname, version)
        absent = EP_ONLY if version < vendor.EP_SINCE else A2A_ONLY
        if qualname.startswith(absent):
            assert recorded is None, f"{qualname} has a record for {version}, which lacks it"
            continue
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
        since = vendor.CUTEDSL_SINCE if qualname.startswith("CuteDsl") else \
            vendor.EP_SINCE if qualname.startswith(EP_ONLY) else vendor.A2A_SINCE
        assert rules[0].since == since, qualname
        for before, after in zip(rules, rules[1:]):
            assert before.until == after.since, f"{qualname}: a gap or overlap at {before.until}"
        assert rules[-1].until == (vendor.EP_SINCE if qualname.startswith(A2A_ONLY) else None), qualname
    assert vendor.signature("CuteDslMoEWrapper.__init__", (0, 6, 3)) is None


@pytest.mark.parametrize("cls", [GroupCommBackend, LocalCommBackend])
def test_the_adapters_comm_backend_has_flashinfers_methods(cls):
    problems = []
    for recorded in vendor.COMM_BACKEND_METHODS:
        problems += differences(recorded, getattr(cls, recorded.qualname.split(".")[1]))
    assert not problems, "\n".join(problems)
