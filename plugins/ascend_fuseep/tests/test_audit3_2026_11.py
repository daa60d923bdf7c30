"""The third independent audit (2026-11, docs/vendor-audits/2026-11/round3/ascend.md) where it reaches FuseEP: the window checks
FuseEP inherits from ascend_deepep (N5: the variables read as strtol / std::stoi read them; K2: a group whose
window is shared by name). The fused ops' own offsets are uint64 (row K6: OK), and FuseEP runs on Atlas A3 only,
so N1-N4 and N8's A2 rows do not reach it. Written first and failing before the fix."""

from __future__ import annotations

import pytest

import moe_dispatch as md
from moe_dispatch_ascend_fuseep import FuseEPBackend
from moe_dispatch_ascend_fuseep import vendor as v

SPEC = md.DispatchSpec(1024, 4, 2, num_max_dispatch_tokens_per_rank=8, mode="low_latency")


@pytest.mark.parametrize("raw", ["1_024", "\uff11\uff10\uff12\uff14"])
def test_n5_fuseep_reads_the_window_variables_as_the_vendor_does(raw):
    with pytest.raises(md.InvalidSpecError) as info:
        FuseEPBackend(v.FAKE, env={"HCCL_BUFFSIZE": raw}).check_window(SPEC, 2, {}, {})
    assert info.value.parameter == "HCCL_BUFFSIZE"
    assert FuseEPBackend(v.FAKE, env={"HCCL_BUFFSIZE": "1024"}).check_window(SPEC, 2, {}, {}).mb == 1024


def test_k2_fuseep_refuses_a_group_sharing_its_window_by_name():
    with pytest.raises(md.InvalidSpecError) as info:
        FuseEPBackend(v.FAKE, env={"HCCL_BUFFSIZE": "1024"}).check_window(SPEC, 2, {"hccl_buffer_name": "moe"}, {})
    assert info.value.parameter == "process_group"


def test_n4_fuseep_takes_a_chip_it_cannot_name_as_a3():
    """New (round three's fix): ascend_deepep refuses HCCL_OP_EXPANSION_MODE on A2 and on a chip torch_npu cannot
    name; FuseEP's fused ops exist on A3 only (where deployments set HCCL_OP_EXPANSION_MODE=AIV), so its unknown
    chip is an A3, and FuseEPBackend takes no soc= to say so."""
    backend = FuseEPBackend(env={"HCCL_BUFFSIZE": "1024", "HCCL_OP_EXPANSION_MODE": "AIV"})  # no torch_npu: unknown
    assert backend.soc() is None
    assert backend.check_environment(SPEC, 2, {}, {}).mb == 1024
