"""One fake FlashInfer release, assembled from the shared pieces: its compiled all-to-all module
(``kernels``), its own ``MnnvlMemory`` and ``TorchDistBackend`` classes (``mnnvl``), ``MoeAlltoAll``
with the signatures of its range and its own workspace cache (``a2a``), ``fp4_quantize``
(``nvfp4``), ``CuteDslMoEWrapper`` (``cute_dsl``, from v0.6.4), laid out as ``flashinfer`` lays them
out (``comm.MoeAlltoAll``, ``comm.mnnvl.MnnvlConfig`` ...). Each version module is one ``export`` call."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from moe_dispatch_flashinfer_cutedsl import vendor

from . import a2a, mnnvl, nvfp4, one_sided
from .kernels import MoeA2AKernels
from .mapping import Mapping


def _owned(obj: Any, module: str, name: str) -> Any:
    """``obj`` as the version module's ``name`` (so pickle finds it there, as it finds FlashInfer's)."""
    obj.__module__, obj.__qualname__ = module, name
    return obj


def build(module: str, version: vendor.Version, moe_alltoall: type[a2a.MoeAlltoAllBase],
          wrapper: type | None) -> SimpleNamespace:
    """The public names of the fake release ``version``, owned by the version module ``module``."""
    kernels = MoeA2AKernels(vendor.profile(version))
    memory = _owned(mnnvl.memory_class(version), module, "MnnvlMemory")
    torch_dist = _owned(mnnvl.torch_dist_backend_class(version), module, "TorchDistBackend")
    moe_a2a = type("MoeAlltoAll", (moe_alltoall,), {"__module__": module, "_KERNELS": kernels, "_MNNVL": memory,
                                                    vendor.WORKSPACE_CACHE_ATTR: {}})  # its own cache
    cute = None if wrapper is None else type("CuteDslMoEWrapper", (wrapper,), {"__module__": module,
                                                                              "_VERSION": version})
    size = _owned(a2a.size_function(kernels), module, "moe_a2a_get_workspace_size_per_rank")

    def get_moe_alltoall_module(*args: Any, **kwargs: Any) -> MoeA2AKernels:
        return kernels

    _owned(get_moe_alltoall_module, module, "get_moe_alltoall_module")

    a2a_module = SimpleNamespace(MoeAlltoAll=moe_a2a, get_moe_alltoall_module=get_moe_alltoall_module,
                                 moe_a2a_get_workspace_size_per_rank=size)
    comm = SimpleNamespace(
        MoeAlltoAll=moe_a2a, Mapping=Mapping, moe_a2a_get_workspace_size_per_rank=size, trtllm_moe_alltoall=a2a_module,
        mnnvl=SimpleNamespace(MnnvlConfig=mnnvl.MnnvlConfig, MnnvlMemory=memory, MpiComm=mnnvl.MpiComm,
                              MPIBackend=mnnvl.MPIBackend, TorchDistBackend=torch_dist,
                              CommBackend=mnnvl.CommBackend))
    return SimpleNamespace(
        VERSION=version, KERNELS=kernels, MoeAlltoAll=moe_a2a, Mapping=Mapping, comm=comm, SfLayout=a2a.SfLayout,
        moe_a2a_get_workspace_size_per_rank=size, get_moe_alltoall_module=get_moe_alltoall_module,
        fp4_quantize=_owned(nvfp4.fp4_quantize_for(version), module, "fp4_quantize"), CuteDslMoEWrapper=cute,
        MnnvlMemory=memory, TorchDistBackend=torch_dist)


def build_one_sided(module: str, version: vendor.Version, wrapper: type) -> SimpleNamespace:
    """The public names of a fake release with ``flashinfer.moe_ep`` and no ``MoeAlltoAll`` (0.7.4+)."""
    memory = _owned(mnnvl.memory_class(version), module, "MnnvlMemory")
    torch_dist = _owned(mnnvl.torch_dist_backend_class(version), module, "TorchDistBackend")
    alltoall = type("NVLinkOneSidedAlltoAll", (one_sided.NVLinkOneSidedAlltoAll,),
                    {"__module__": module, "_MNNVL": memory, "_WORKSPACES": {}})  # its own workspaces
    create = _owned(one_sided.create_communication_for(alltoall), module, "create_communication")

    def get_nvlink_one_sided_alltoall_module() -> one_sided.OneSidedKernels:
        return one_sided.KERNELS

    _owned(get_nvlink_one_sided_alltoall_module, module, "get_nvlink_one_sided_alltoall_module")
    kernels = SimpleNamespace(get_nvlink_one_sided_alltoall_module=get_nvlink_one_sided_alltoall_module)
    moe_ep = SimpleNamespace(
        create_communication=create, BootstrapConfig=one_sided.BootstrapConfig,
        MoEEpCommParams=one_sided.MoEEpCommParams, NVLinkOneSidedConfig=one_sided.NVLinkOneSidedConfig,
        NVLinkOneSidedAlltoAll=alltoall,
        backends=SimpleNamespace(split=SimpleNamespace(comm=SimpleNamespace(
            nvlink_one_sided=SimpleNamespace(kernels=kernels, communication=SimpleNamespace(
                NVLinkOneSidedAlltoAll=alltoall))))))
    comm = SimpleNamespace(Mapping=Mapping, mnnvl=SimpleNamespace(
        MnnvlConfig=mnnvl.MnnvlConfig, MnnvlMemory=memory, MpiComm=mnnvl.MpiComm, MPIBackend=mnnvl.MPIBackend,
        TorchDistBackend=torch_dist, CommBackend=mnnvl.CommBackend))
    cute = type("CuteDslMoEWrapper", (wrapper,), {"__module__": module, "_VERSION": version})
    return SimpleNamespace(
        VERSION=version, KERNELS=one_sided.KERNELS, moe_ep=moe_ep, comm=comm,
        fused_moe=SimpleNamespace(api=SimpleNamespace(QuantFormat=one_sided.QuantFormat), CuteDslMoEWrapper=cute),
        fp4_quantize=_owned(nvfp4.fp4_quantize_for(version), module, "fp4_quantize"), CuteDslMoEWrapper=cute,
        MnnvlMemory=memory, TorchDistBackend=torch_dist, NVLinkOneSidedAlltoAll=alltoall, create_communication=create,
        get_nvlink_one_sided_alltoall_module=get_nvlink_one_sided_alltoall_module)


def export(namespace: dict[str, Any], version: vendor.Version, moe_alltoall: type[a2a.MoeAlltoAllBase] | None,
           wrapper: type | None) -> None:
    """Make the calling version module (``globals()``) the fake of FlashInfer ``version``: its public
    names (owned by it, so they pickle by its name and ``vendor_module=`` finds them by its path),
    ``__version__`` and ``__all__``."""
    release = vars(build(namespace["__name__"], version, moe_alltoall, wrapper) if moe_alltoall is not None
                   else build_one_sided(namespace["__name__"], version, wrapper))
    namespace.update(release, __version__=".".join(map(str, version)), __all__=sorted(release))
    namespace[vendor.EMULATION_MARKER] = True


__all__ = ["build", "build_one_sided", "export"]
