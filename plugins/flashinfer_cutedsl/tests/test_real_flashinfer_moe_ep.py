"""``flashinfer_a2a`` through FlashInfer 0.7.4+'s REAL ``flashinfer.moe_ep`` Python (the optional vendor-code job).

``fakes.real_python`` (``REAL_PYTHON_ON_FAKE_KERNELS``) replaces only the compiled one-sided module
(``one_sided.KERNELS``), the CUDA-driver memory under ``MnnvlMemory`` and the device probes; what runs as FlashInfer
ships it: ``create_communication``, ``MoEEpCommParams`` (the dispatch bytes of each format), ``NVLinkOneSidedAlltoAll``
(its layout request, class-level workspaces, round owner, receive views, sanitize and combine calls).
The facts the adapter relies on are read from the installed sources. ``test_real_flashinfer.py`` is the same for the
``MoeAlltoAll`` generation (<= 0.7.2); each file runs where its generation is installed.
"""

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (.ci/vendor installs it)")

import moe_dispatch as md  # noqa: E402
import moe_dispatch.backend as mdb  # noqa: E402
from moe_dispatch.backend import nvfp4_global_scale  # noqa: E402
from moe_dispatch_flashinfer_cutedsl import vendor  # noqa: E402
from moe_dispatch_flashinfer_cutedsl.backend import FlashInferA2ABackend  # noqa: E402
from moe_dispatch_flashinfer_cutedsl.mnnvl_comm import GroupCommBackend  # noqa: E402
from moe_dispatch_flashinfer_cutedsl_testing import REAL_PYTHON_ON_FAKE_KERNELS as REAL  # noqa: E402
from moe_dispatch_flashinfer_cutedsl_testing.support import E, H  # noqa: E402
from moe_dispatch_testing import random_routing, relative_error  # noqa: E402
from moe_dispatch_testing.signatures import compare, differences, signature_from_source  # noqa: E402

pytestmark = pytest.mark.vendor_code
if (vendor.parse_version(flashinfer.__version__) or vendor.VERIFIED_UNTIL) < vendor.EP_SINCE:
    pytest.skip(f"FlashInfer {flashinfer.__version__} keeps MoeAlltoAll, which the adapter drives there "
                "(test_real_flashinfer.py); .ci/vendor installs 0.7.4 next", allow_module_level=True)
ROOT = Path(importlib.util.find_spec("flashinfer").submodule_search_locations[0])
COMMUNICATION = ROOT / "data" / "csrc" / "nv_internal" / "tensorrt_llm" / "kernels" / "moe" / "communication"


def run_layer(rank: int, world: int, top_k: int, drop: float, experts: int, dtype: str) -> dict:
    real = importlib.import_module(REAL)
    gs = nvfp4_global_scale(6.0) if dtype == "nvfp4" else None
    spec = md.DispatchSpec(H, experts, top_k, num_max_dispatch_tokens_per_rank=16, output_dtype=dtype,
                           quant=md.QuantHints(input_global_scale=gs))
    backend = FlashInferA2ABackend(REAL)
    d, other = (md.create_dispatcher(backend, spec, env={}) for _ in range(2))
    g = torch.Generator().manual_seed(11 + rank)
    xs = [torch.randn(16, H, generator=g).to(torch.bfloat16) for _ in range(3)]
    routes = [random_routing(16, experts, top_k, generator=g, drop_prob=drop) for _ in range(3)]
    outs = [d.dispatch(x, ids, w) for x, (ids, w) in zip(xs[:2], routes)]  # two in flight
    outs.append(other.dispatch(xs[2], *routes[2]))  # another dispatcher of the same shape, between them
    codec = mdb.make_codec(spec.wire_format(), gs)
    rows = [codec.dequantize(mdb.Quantized(o.hidden_states, o.hidden_states_scale)).to(torch.bfloat16)
            if dtype != "bf16" else o.hidden_states for o in outs]  # identity experts
    ys = [disp.combine(r, o) for disp, r, o in zip((d, d, other), rows, outs)]
    refs = [codec.dequantize(codec.quantize(x)).float() * ((ids >= 0).float() * w).sum(dim=1, keepdim=True)
            for x, (ids, w) in zip(xs, routes)]
    instances = [inst for disp in (d, other) for inst in disp._impl.instances]  # noqa: SLF001
    field = vendor.EP_METAINFO_NAMES.index("WORKSPACE_SIZE")
    k = instances[0].params.top_k
    wire, combine = vendor.ep_bytes_per_token(dtype, H), world * 16 * 2 * H

    def ported(extra: int) -> int:  # the adapter's port of what FlashInfer asks the layout for
        return vendor.ep_workspace_layout(world, 16, k, vendor.ep_dispatch_bytes(world * 16, wire, k, extra),
                                          combine)["WORKSPACE_SIZE"]
    planned = backend.buffer_size(spec, world)
    return {"error": max(relative_error(y, r) for y, r in zip(ys, refs)),
            "workspaces": len({inst.workspace.data_ptr() for inst in instances}),
            "class": type(instances[0]) is real.moe_ep.NVLinkOneSidedAlltoAll,
            "laid_out": [int(inst.metainfo[field]) for inst in instances],
            "ported": [ported(inst.config.extra_payload_bytes_per_token) for inst in instances],
            "planned": planned.dispatch_bytes + planned.combine_bytes,
            "slot_0": ported(vendor.ep_distinct_extra(0, world, 16))}


@pytest.mark.parametrize("top_k,drop,experts,dtype", [(2, 0.0, 8, "bf16"), (1, 0.5, 2, "bf16"), (5, 0.5, 16, "bf16"),
                                                     (8, 0.3, 16, "fp8"), (8, 0.3, 16, "nvfp4")])
def test_the_adapter_runs_on_flashinfers_real_one_sided_python(moe_rank_pools, top_k, drop, experts, dtype):
    """Two in flight and a second dispatcher on four distinct workspaces; -1 ids (one expert per rank), top-k 5
    padded to 6, the FP8 (DeepSeekFp8) and NVFP4 wires; each workspace FlashInfer's Python lays out (from
    MoEEpCommParams' bytes per token and the slot's extra bytes) equals the adapter's port, whose slot 0 is what
    buffer_size plans (a process that holds other layouts moves the slots past them)."""
    for r in moe_rank_pools.get(2).map(run_layer, top_k, drop, experts, dtype):
        assert r["class"] and r["workspaces"] == 4 and r["error"] < 2e-2, r
        assert r["laid_out"] == r["ported"] and r["planned"] == r["slot_0"], r


def test_recorded_signatures_equal_the_installed_flashinfer():
    import flashinfer
    from flashinfer.comm.mapping import Mapping
    from flashinfer.comm.mnnvl import MnnvlConfig
    from flashinfer.moe_ep import BootstrapConfig, MoEEpCommParams, NVLinkOneSidedAlltoAll, NVLinkOneSidedConfig
    from flashinfer.moe_ep import create_communication
    version = vendor.parse_version(flashinfer.__version__)
    live = {"create_communication": create_communication, "BootstrapConfig": BootstrapConfig.__init__,
            "MoEEpCommParams": MoEEpCommParams.__init__, "NVLinkOneSidedConfig": NVLinkOneSidedConfig.__init__,
            "NVLinkOneSidedAlltoAll.__init__": NVLinkOneSidedAlltoAll.__init__,
            "NVLinkOneSidedAlltoAll.dispatch": NVLinkOneSidedAlltoAll.dispatch,
            "NVLinkOneSidedAlltoAll.combine": NVLinkOneSidedAlltoAll.combine,
            "Mapping.__init__": Mapping.__init__, "MnnvlConfig": MnnvlConfig.__init__,
            "fp4_quantize": flashinfer.fp4_quantize}
    problems = []
    for qualname, fn in live.items():
        problems += differences(vendor.signature(qualname, version), inspect.unwrap(fn))
    source = ROOT / "fused_moe" / "cute_dsl" / "fused_moe.py"  # importing it needs nvidia-cutlass-dsl
    for qualname in ("CuteDslMoEWrapper.__init__", "CuteDslMoEWrapper.run"):
        problems += compare(vendor.signature(qualname, version).params, signature_from_source(source, qualname),
                            qualname)
    assert vendor.signature("MoeAlltoAll.__init__", version) is None and not hasattr(flashinfer.comm, "MoeAlltoAll")
    assert not problems, "\n".join(problems)


def test_the_one_sided_facts_equal_the_installed_sources():
    header = (COMMUNICATION / "moeAlltoAllKernels.h").read_text()
    assert f"kMaxRanks = {vendor.EP_MAX_RANKS};" in header and f"kMaxPayloads = {vendor.EP_MAX_PAYLOADS};" in header
    kernels = (COMMUNICATION / "moeAlltoAllKernels.cu").read_text()
    switch = kernels[kernels.index("#define SWITCH_TOP_K"):]
    switch = switch[: switch.index("default:")]
    assert {int(v) for v in re.findall(r"case (\d+):", switch)} == vendor.EP_TOP_K_VALUES
    # -1 (and any id outside [0, num_experts)) is sent nowhere: the adapter pads top-k with -1.
    assert "bool const valid_expert = expert_id >= 0 && expert_id < num_experts;" in kernels
    from flashinfer.moe_ep.backends.split.comm.nvlink_one_sided import communication
    assert set(communication._SUPPORTED_TOP_K) == vendor.EP_TOP_K_VALUES  # noqa: SLF001
    meta = (ROOT / "data" / "csrc" / "nv_internal" / "tensorrt_llm" / "thop" / "moe" / "communication"
            / "moeAlltoAllMeta.h").read_text()
    pairs = re.findall(r'\{"MOE_A2A_(\w+)_INDEX", \w+\}', meta)
    assert tuple(pairs) == vendor.EP_METAINFO_NAMES
    assert f"kWorkspaceAlignment = {vendor.EP_WORKSPACE_ALIGNMENT};" in meta
    host = (ROOT / "data" / "csrc" / "nvlink_one_sided_alltoall.cu").read_text()
    assert host.count('"payload must be 16-byte aligned"') == 2 and vendor.EP_PAYLOAD_ALIGNMENT == 16
    assert f"kCachelineAlignment = {vendor.CACHELINE};" in host
    from flashinfer.moe_ep.core.comm.communication import _DISPATCH_BYTES_PER_TOKEN
    for dtype, fmt in vendor.EP_DISPATCH_FORMATS.items():
        want = 2 * 7168 if fmt is None else _DISPATCH_BYTES_PER_TOKEN[fmt](7168)
        assert vendor.ep_bytes_per_token(dtype, 7168) == want, dtype


def run_raw_share(rank: int, world: int) -> tuple[bool, bool]:
    real = importlib.import_module(REAL)
    ep = real.moe_ep
    params = ep.MoEEpCommParams(num_experts=E, top_k=2, max_tokens_per_rank=4, hidden_size=H)

    def make(extra: int):  # noqa: ANN202
        return ep.create_communication(ep.BootstrapConfig(world_size=world, rank=rank), params,
                                       ep.NVLinkOneSidedConfig(comm_backend=GroupCommBackend(),
                                                               extra_payload_bytes_per_token=extra))
    a, b, c = make(0), make(0), make(vendor.ep_distinct_extra(0, world, 4))  # a dispatcher's first slot
    return a.workspace is b.workspace, c.workspace is not a.workspace


def test_real_instances_of_one_layout_share_a_workspace_and_a_slots_extra_bytes_part_them(moe_rank_pools):
    """What the adapter's slots rely on: FlashInfer shares one workspace per layout (``_WORKSPACES``), and
    ``ep_distinct_extra`` changes the layout."""
    for shared, apart in moe_rank_pools.get(2).map(run_raw_share):
        assert shared and apart
