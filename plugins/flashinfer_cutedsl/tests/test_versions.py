"""FlashInfer's versions: what ``vendor.detect`` finds in each, the version facts of the all-to-all (init barrier,
unmapped check, deprecation), and the fakes, one module per version range, each one declaration whose names
pickle by the module's path."""

import ast
import inspect
import pickle
import warnings

import pytest

from moe_dispatch_flashinfer_cutedsl import vendor
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import LocalCommBackend
from moe_dispatch_flashinfer_cutedsl_testing import EMULATOR, FAKE_0_7_0, FAKE_0_7_1, FAKE_0_7_2, FAKES, fake_for
from moe_dispatch_flashinfer_cutedsl_testing.support import E, H, fake, one_rank, raw_moe_alltoall


def test_detect_knows_which_versions_have_each_api():
    for name, version in FAKES:
        info = vendor.detect(name)
        assert info.fake and info.version == version and info.a2a_reason() is None and info.cutedsl_reason() is None
    api = vendor.detect(FAKE_0_7_2).api
    old = vendor.VendorInfo("flashinfer", api, "0.5.3", None, False)
    assert "MoeAlltoAll needs FlashInfer >= 0.6.0" in old.a2a_reason()
    assert "CuteDslMoEWrapper needs FlashInfer >= 0.6.4" in vendor.VendorInfo("flashinfer", api, "0.6.3", None,
                                                                                False).cutedsl_reason()
    assert "newer than 0.7.4" in vendor.VendorInfo("flashinfer", api, "0.8.0", None, False).describe()
    one_sided = vendor.detect(EMULATOR).api  # 0.7.4: flashinfer.moe_ep, no MoeAlltoAll looked for
    assert one_sided.MoeAlltoAll is None and one_sided.create_communication is not None
    lacking = vendor.VendorInfo("flashinfer", vendor.FlashInferAPI(**{**vars(one_sided), "NVLinkOneSidedConfig": None}),
                                "0.7.4", None, False)
    assert "flashinfer.moe_ep lacks NVLinkOneSidedConfig" in lacking.a2a_reason()
    assert vendor.parse_version("0.7.2.post1") == (0, 7, 2) and vendor.parse_version("0.6.18rc7") == (0, 6, 18)


def test_the_init_barrier_unmapped_check_and_deprecation_arrive_in_their_versions():
    assert vendor.A2A_INIT_BARRIER_SINCE == (0, 7, 1) and vendor.A2A_UNMAPPED_CHECK_SINCE == (0, 6, 15)
    assert vendor.A2A_DEPRECATED_SINCE == (0, 7, 2)
    assert not vendor.profile((0, 7, 1)).deprecated and vendor.profile((0, 7, 2)).deprecated
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        raw_moe_alltoall(fake(FAKE_0_7_0), 3, 2)  # no warning before 0.7.2


def test_flashinfer_0_7_1_has_its_own_fake_without_the_deprecation_warning():
    assert fake_for((0, 7, 1)) == FAKE_0_7_1 and fake_for((0, 7, 2)) == FAKE_0_7_2
    old, new = fake(FAKE_0_7_1), fake(FAKE_0_7_2)
    assert old.VERSION == (0, 7, 1) and (FAKE_0_7_1, (0, 7, 1)) in FAKES
    size = old.moe_a2a_get_workspace_size_per_rank(1, 3, 2 * H + 16, 2 * H) + 128 * 991
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old.MoeAlltoAll(one_rank(old), 3, 2, E, workspace_size_per_rank=size,
                        mnnvl_config=old.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend()))
    with pytest.warns(DeprecationWarning, match="MoeAlltoAll is deprecated"):
        new.MoeAlltoAll(one_rank(new), 3, 2, E, workspace_size_per_rank=size,
                        mnnvl_config=new.comm.mnnvl.MnnvlConfig(comm_backend=LocalCommBackend()))
    assert "deprecated" in vendor.detect(FAKE_0_7_2).describe()
    assert "deprecated" not in vendor.detect(FAKE_0_7_1).describe()


@pytest.mark.parametrize("fake_module,version", FAKES)
def test_each_version_module_is_one_declaration_and_pickles_by_its_names(fake_module, version):
    module = fake(fake_module)
    body = [node for node in ast.parse(inspect.getsource(module)).body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    assert len(body) == 1, [ast.unparse(node) for node in body]  # release.export(...)
    assert module.__version__ == ".".join(map(str, version)) and module.VERSION == version
    a2a = ("NVLinkOneSidedAlltoAll", "create_communication", "get_nvlink_one_sided_alltoall_module") \
        if version >= vendor.EP_SINCE else ("MoeAlltoAll", "get_moe_alltoall_module", "moe_a2a_get_workspace_size_per_rank")
    for name in ("comm", "fp4_quantize", "CuteDslMoEWrapper", "MnnvlMemory", "TorchDistBackend", "KERNELS", *a2a):
        assert name in module.__all__ and hasattr(module, name), name
    for name in ("CuteDslMoEWrapper", "MnnvlMemory", "TorchDistBackend", "fp4_quantize", *a2a):
        obj = getattr(module, name)
        assert obj.__module__ == fake_module and pickle.loads(pickle.dumps(obj)) is obj, name
    assert vendor.detect(fake_module).a2a_reason() is None
