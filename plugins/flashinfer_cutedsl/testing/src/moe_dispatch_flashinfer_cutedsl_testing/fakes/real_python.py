"""FlashInfer's real Python on the fake kernels and CPU memory (the optional vendor-code job).

Importing this module imports the installed ``flashinfer`` (flashinfer-python installs on a CPU
machine: its Python modules import without a GPU) and replaces exactly what needs a GPU:

- the compiled all-to-all module: until 0.7.2 ``gen_moe_alltoall_module(...).build_and_load()`` returns
  ``kernels.MoeA2AKernels`` for the installed version, so FlashInfer's own wrappers, its
  ``get_moe_alltoall_module`` cache, ``moe_a2a_dispatch``'s workspace views and every Python
  check of ``MoeAlltoAll`` run as shipped; from 0.7.4 ``get_nvlink_one_sided_alltoall_module()``
  returns ``one_sided.KERNELS`` and ``flashinfer.moe_ep``'s ``NVLinkOneSidedAlltoAll`` runs as shipped
  (its layout, shared workspaces, round owner, views, sanitize and combine calls) with the device probes
  answered as an SM90 GPU with NVLink would (``nvlink_platform_supported`` True, the current device 0, no
  PDL, no CFT or Lamport) and ``torch.cuda.synchronize`` a no-op;
- the CUDA-driver side of ``MnnvlMemory`` (initialize, open/close, as_torch_strided_tensor, the
  FABRIC probe; 0.7.4's per-allocation handle choice): CPU memory and the fake's port of
  ``open_mnnvl_memory``'s collectives (``mnnvl.patch_real_mnnvl``); ``MnnvlMemory.comm``, ``get_comm``
  (the MPI fallback), ``set_comm_from_config`` and, in 0.6.16-0.7.2, ``_resolve_fabric_support`` stay
  FlashInfer's.

It exposes the layout ``vendor.detect`` looks for (``comm.MoeAlltoAll``, ``comm.Mapping``,
``comm.mnnvl.MnnvlConfig``, ``comm.moe_a2a_get_workspace_size_per_rank``; from 0.7.4 ``moe_ep`` and
``fused_moe.api.QuantFormat``); ``fp4_quantize`` and the CuTe-DSL MoE are not here (their kernels need an
SM100 GPU; ``CuteDslMoEWrapper.run`` creates CUDA streams and events before any kernel).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import importlib

import flashinfer
import torch
from flashinfer.comm import mnnvl as _mnnvl
from flashinfer.comm.mapping import Mapping

from moe_dispatch_flashinfer_cutedsl import vendor

from . import one_sided
from .kernels import MoeA2AKernels
from .mnnvl import _tuple_record, patch_real_mnnvl

__version__ = str(flashinfer.__version__)
globals()[vendor.EMULATION_MARKER] = True  # FlashInfer's Python on fake kernels: a stand-in all the same
VERSION = vendor.parse_version(__version__) or vendor.VERIFIED_UNTIL
ONE_SIDED = VERSION >= vendor.EP_SINCE
KERNELS: Any = one_sided.KERNELS if ONE_SIDED else MoeA2AKernels(vendor.profile(VERSION))
_record = getattr(_mnnvl, "_MnnvlAllocationRecord", _tuple_record)


def _install_one_sided() -> None:
    ep = "flashinfer.moe_ep.backends.split.comm."
    common = importlib.import_module(ep + "nvlink_common")
    kernels = importlib.import_module(ep + "nvlink_one_sided.kernels")
    communication = importlib.import_module(ep + "nvlink_one_sided.communication")
    utils = importlib.import_module("flashinfer.utils")
    loader = lambda: KERNELS  # noqa: E731 - get_nvlink_one_sided_alltoall_module()
    kernels.get_nvlink_one_sided_alltoall_module = communication.get_nvlink_one_sided_alltoall_module = loader
    kernels.layout_constants.cache_clear()
    common.nvlink_platform_supported = communication.nvlink_platform_supported = lambda: True
    utils.device_support_pdl = lambda device: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    patch_real_mnnvl(_mnnvl.MnnvlMemory, _record, VERSION)


def _install() -> None:
    from flashinfer.comm import trtllm_moe_alltoall as _a2a

    _a2a.gen_moe_alltoall_module = lambda *args, **kwargs: SimpleNamespace(build_and_load=lambda: KERNELS)
    for name in ("_get_moe_alltoall_module_for_target", "get_moe_alltoall_module"):
        cache_clear = getattr(getattr(_a2a, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    _a2a.MoeAlltoAll._METAINFO_INDEX = None
    # allocated_map holds _MnnvlAllocationRecord from v0.6.15, tuples before (vendor.MNNVL_RECORD_SINCE).
    patch_real_mnnvl(_mnnvl.MnnvlMemory, _record, VERSION)


fp4_quantize: Any = None
CuteDslMoEWrapper: Any = None
if ONE_SIDED:
    _install_one_sided()
    moe_ep = importlib.import_module("flashinfer.moe_ep")
    fused_moe = SimpleNamespace(api=importlib.import_module("flashinfer.fused_moe.api"))
    comm = SimpleNamespace(Mapping=Mapping, mnnvl=_mnnvl)
    __all__ = ["KERNELS", "Mapping", "VERSION", "comm", "fused_moe", "moe_ep"]
else:
    _install()
    from flashinfer.comm import trtllm_moe_alltoall as _a2a

    MoeAlltoAll = _a2a.MoeAlltoAll
    comm = SimpleNamespace(MoeAlltoAll=_a2a.MoeAlltoAll, Mapping=Mapping,
                           moe_a2a_get_workspace_size_per_rank=_a2a.moe_a2a_get_workspace_size_per_rank,
                           mnnvl=_mnnvl, trtllm_moe_alltoall=_a2a)
    __all__ = ["KERNELS", "Mapping", "MoeAlltoAll", "VERSION", "comm"]
