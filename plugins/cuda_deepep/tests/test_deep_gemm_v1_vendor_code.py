"""The ``deep_gemm`` runner through DeepGEMM v1's own Python layer (the optional ``vendor_code`` job).

PyPI's ``deep_gemm==1.0.0`` is an sdist of DeepGEMM's v1 Python layer at upstream b05ed2f (2025-02-27): its
``m_grouped_gemm_fp8_fp8_bf16_nt_*`` argument checks, ``get_col_major_tma_aligned_tensor`` and block-size
heuristics run for real on CPU tensors; only the JIT-compiled kernel is replaced
(``fakes.deep_gemm_v1_kernels.installed``). The sdist cannot be pip-installed (its setup.py copies a
``third-party/cutlass`` the sdist does not contain), so the job unpacks it onto ``PYTHONPATH``:

    pip download --no-deps --no-binary :all: deep_gemm==1.0.0 -d /tmp/dg
    tar -xzf /tmp/dg/deep_gemm-1.0.0.tar.gz -C /tmp/dg
    PYTHONPATH=/tmp/dg/deep_gemm-1.0.0 pytest -m vendor_code plugins/cuda_deepep

A plain ``pytest`` skips these tests (no ``deep_gemm``), as does a machine with DeepGEMM 2.x installed.
"""

import importlib
import importlib.util

import pytest
import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import make_codec
from moe_dispatch_cuda_deepep import vendor
from moe_dispatch_cuda_deepep.deep_gemm import DeepGemmExperts
from moe_dispatch_cuda_deepep_testing import DEEP_GEMM_V1_EMULATOR, DEEP_GEMM_V1_KERNELS
from moe_dispatch_testing.routing import random_expert_weights

pytestmark = pytest.mark.vendor_code

deep_gemm = pytest.importorskip(vendor.DEEP_GEMM, reason="DeepGEMM v1's Python (PyPI deep_gemm 1.0.0, unpacked on "
                                                          "PYTHONPATH) is not installed: see this file's docstring")
if not hasattr(deep_gemm, vendor.DG_V1_CONTIGUOUS) or importlib.util.find_spec(
        f"{vendor.DEEP_GEMM}.jit_kernels.tuner") is None:
    pytest.skip("the installed deep_gemm is not DeepGEMM v1 1.0.0's Python layer", allow_module_level=True)

kernels = importlib.import_module(DEEP_GEMM_V1_KERNELS)
#: I = 256: two 128-blocks of K for gmm2. 1.0.0 cannot compile an odd count (see below).
H, I, E = 256, 256, 4
#: A masked capacity every v1 BLOCK_M divides.
CAPACITY = 256


def _inputs(layout: str):
    counts = [5, 0, 130, 1] if layout == "packed" else [3, 0, 8, 1]
    shape = (sum(counts),) if layout == "packed" else (E, CAPACITY)
    q = make_codec(mdb.WireFormat(md.DispatchDtype.FP8, H)).quantize(
        torch.randn(*shape, H, generator=torch.Generator().manual_seed(1)))
    return q.data, q.scale, torch.tensor(counts)


@pytest.mark.parametrize("layout", ["packed", "masked"])
def test_the_runner_on_deep_gemm_v1s_python_equals_the_fake(layout):
    mode = md.Mode.NORMAL if layout == "packed" else md.Mode.LOW_LATENCY
    real = DeepGemmExperts("block_fp8", mode, vendor.DEEP_GEMM)
    fake = DeepGemmExperts("block_fp8", mode, DEEP_GEMM_V1_EMULATOR)
    assert real.info.generation == "v1" and not real.ue8m0
    layer = fake.process_weights(random_expert_weights(E, H, I, generator=torch.Generator().manual_seed(0)))
    x, scale, counts = _inputs(layout)
    with kernels.installed(deep_gemm):
        got = real.apply_without_routing_weights(layer, x, scale, 1, counts, torch.float32)
    want = fake.apply_without_routing_weights(layer, x, scale, 1, counts, torch.float32)
    assert torch.equal(got, want)


def test_pypi_1_0_0_is_refused_odd_k_blocks_before_its_jit():
    """b05ed2f's kernel static-asserts "Misaligned barriers" for an odd ceil(K/128) when BLOCK_N
    divides 128; the runner refuses such weights on a v1 without ``wgrad_gemm_fp8_fp8_fp32_nt``."""
    real = DeepGemmExperts("block_fp8", md.Mode.LOW_LATENCY, vendor.DEEP_GEMM)
    assert not real.info.compiles_odd_k_blocks
    with pytest.raises(md.InvalidInputError) as info:
        real.process_weights(random_expert_weights(E, H, 128, generator=torch.Generator().manual_seed(0)))
    assert info.value.parameter == "intermediate_size"


def _bad_calls():
    """(name, call(module)) pairs that DeepGEMM v1's Python refuses."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(128, H, generator=g).to(torch.float8_e4m3fn)
    sa = torch.rand(128, H // 128, generator=g)
    b = torch.randn(2, 128, H, generator=g).to(torch.float8_e4m3fn)
    sb = torch.rand(2, 1, H // 128, generator=g)
    d = torch.empty(128, 128, dtype=torch.bfloat16)
    ids = torch.zeros(128, dtype=torch.int32)
    c, m = vendor.DG_V1_CONTIGUOUS, vendor.DG_V1_MASKED
    a3, sa3, d3 = a.view(2, 64, H), sa.view(2, 64, 2), d.view(2, 64, 128)
    return [
        ("int64 m_indices", lambda mod: getattr(mod, c)((a, sa), (b, sb), d, ids.long())),
        ("bf16 scales", lambda mod: getattr(mod, c)((a, sa.bfloat16()), (b, sb), d, ids)),
        ("wrong rows in out", lambda mod: getattr(mod, c)((a, sa), (b, sb), d[:64], ids)),
        ("non-contiguous rhs scales", lambda mod: getattr(mod, c)((a, sa), (b, sb.transpose(1, 2)), d, ids)),
        ("int64 masked_m", lambda mod: getattr(mod, m)((a3, sa3), (b, sb), d3, torch.tensor([1, 2]), 1)),
        ("expected_m 0", lambda mod: getattr(mod, m)((a3, sa3), (b, sb), d3, torch.tensor([1, 2], dtype=torch.int32),
                                                     0)),
    ]


@pytest.mark.parametrize("name,call", _bad_calls(), ids=[n for n, _ in _bad_calls()])
def test_the_fake_refuses_what_deep_gemm_v1_refuses(name, call):
    fake = importlib.import_module(DEEP_GEMM_V1_EMULATOR)
    with kernels.installed(deep_gemm):
        with pytest.raises(AssertionError):
            call(deep_gemm)
    with pytest.raises(AssertionError):
        call(fake)


def test_the_signatures_are_v1s():
    from moe_dispatch_testing.signatures import differences

    for record in vendor.DEEP_GEMM_V1_SIGNATURES:
        assert differences(record, vendor.lookup(deep_gemm, record.qualname)) == []
