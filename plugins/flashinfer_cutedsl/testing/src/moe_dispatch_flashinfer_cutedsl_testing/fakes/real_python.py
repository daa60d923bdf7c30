"""FlashInfer's real Python on the fake kernels and CPU memory (the optional vendor-code job).

Importing this module imports the installed ``flashinfer`` (flashinfer-python installs on a CPU
machine: its Python modules import without a GPU) and replaces exactly two things in it:

- the compiled all-to-all module: ``gen_moe_alltoall_module(...).build_and_load()`` returns
  ``kernels.MoeA2AKernels`` for the installed version, so FlashInfer's own wrappers, its
  ``get_moe_alltoall_module`` cache, ``moe_a2a_dispatch``'s workspace views and every Python
  check of ``MoeAlltoAll`` run as shipped;
- the CUDA-driver side of ``MnnvlMemory`` (initialize, open/close, as_torch_strided_tensor, the
  FABRIC probe): CPU memory and the fake's port of ``open_mnnvl_memory``'s collectives
  (``mnnvl.patch_real_mnnvl``); ``MnnvlMemory.comm``, ``get_comm`` (the MPI fallback),
  ``set_comm_from_config`` and, from v0.6.16, ``_resolve_fabric_support`` stay FlashInfer's.

It exposes the layout ``vendor.detect`` looks for (``comm.MoeAlltoAll``, ``comm.Mapping``,
``comm.mnnvl.MnnvlConfig``, ``comm.moe_a2a_get_workspace_size_per_rank``); ``fp4_quantize`` and the
CuTe-DSL MoE are not here (their kernels need an SM100 GPU; ``CuteDslMoEWrapper.run`` creates CUDA
streams and events before any kernel).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import flashinfer
from flashinfer.comm import mnnvl as _mnnvl
from flashinfer.comm import trtllm_moe_alltoall as _a2a
from flashinfer.comm.mapping import Mapping

from moe_dispatch_flashinfer_cutedsl import vendor

from .kernels import MoeA2AKernels
from .mnnvl import _tuple_record, patch_real_mnnvl

__version__ = str(flashinfer.__version__)
globals()[vendor.EMULATION_MARKER] = True  # FlashInfer's Python on fake kernels: a stand-in all the same
VERSION = vendor.parse_version(__version__) or vendor.VERIFIED_UNTIL
KERNELS = MoeA2AKernels(vendor.profile(VERSION))


def _install() -> None:
    _a2a.gen_moe_alltoall_module = lambda *args, **kwargs: SimpleNamespace(build_and_load=lambda: KERNELS)
    for name in ("_get_moe_alltoall_module_for_target", "get_moe_alltoall_module"):
        cache_clear = getattr(getattr(_a2a, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    _a2a.MoeAlltoAll._METAINFO_INDEX = None
    # allocated_map holds _MnnvlAllocationRecord from v0.6.15, tuples before (vendor.MNNVL_RECORD_SINCE).
    patch_real_mnnvl(_mnnvl.MnnvlMemory, getattr(_mnnvl, "_MnnvlAllocationRecord", _tuple_record), VERSION)


_install()

MoeAlltoAll = _a2a.MoeAlltoAll
comm = SimpleNamespace(MoeAlltoAll=_a2a.MoeAlltoAll, Mapping=Mapping,
                       moe_a2a_get_workspace_size_per_rank=_a2a.moe_a2a_get_workspace_size_per_rank,
                       mnnvl=_mnnvl, trtllm_moe_alltoall=_a2a)
fp4_quantize: Any = None
CuteDslMoEWrapper: Any = None

__all__ = ["KERNELS", "Mapping", "MoeAlltoAll", "VERSION", "comm"]
