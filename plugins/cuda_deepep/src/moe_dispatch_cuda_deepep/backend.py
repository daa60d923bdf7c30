"""The ``cuda_deepep`` backend: capabilities, limits, buffer sizes, and the adapter it creates.

Every limit is DeepEP's, for the release installed (``vendor.release_of``): what its host and device
asserts accept. Where a limit depends on the environment (``NVSHMEM_QP_DEPTH``) or on ``options`` (user
configs, a shared buffer) it is checked in ``create``, before DeepEP is touched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

import moe_dispatch as md
from moe_dispatch.environ import restored_environ

from . import sizes, vendor
from .dispatcher import DeepEPDispatcher

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY

#: With DeepEP's default ``NVSHMEM_QP_DEPTH`` of 1024 (see ``vendor.low_latency_max_tokens``).
LOW_LATENCY_MAX_TOKENS = vendor.low_latency_max_tokens()
#: DeepEP's ceiling on each buffer ("32 GiB"): ``num_bytes / sizeof(int4) < INT_MAX``. Normal mode with
#: more than 8 ranks also asserts both buffers fit an int (2 GiB); the tuned hints stay far below it.
MAX_BUFFER_BYTES = vendor.MAX_BUFFER_BYTES
#: Normal mode's buffers use NVSHMEM only across nodes; 24 QPs per peer is DeepEP's default.
NORMAL_NUM_QPS_PER_RANK = 24
CONFIG_OPTIONS = ("dispatch_config", "combine_config")


def capabilities(emulated: bool, nvfp4: bool = False,
                 release: vendor.DeepEPRelease = vendor.PLANNING_RELEASE) -> md.Capabilities:
    """``nvfp4``: the installed DeepEP's ``low_latency_dispatch`` takes ``use_nvfp4`` (hybrid-ep).

    ``world_sizes`` is None: low-latency mode runs on any EP size dividing the experts, normal mode only
    where DeepEP has a tuned config and a kernel; ``check_spec`` enforces each."""
    int8 = "DeepEP has no INT8 dispatch; FP8 sends the same bytes per element"
    no_nvfp4 = ("this DeepEP's low_latency_dispatch has no use_nvfp4 (NVFP4 dispatch is on DeepEP's hybrid-ep "
                "branch)" if not nvfp4 else "DeepEP's normal-mode NVFP4 (hybrid-ep HybridEPBuffer) is not driven")
    return md.Capabilities(
        dtypes={N: frozenset({B, F8}), LL: frozenset({B, F8, F4} if nvfp4 else {B, F8})},
        fallbacks={(N, I8): md.Fallback(F8, int8), (LL, I8): md.Fallback(F8, int8)},
        rejections={F4: no_nvfp4},
        default_dtype=F8,
        fp8_ue8m0=True,
        cuda_graph_modes=frozenset({LL}),
        devices=frozenset({"cpu"} if emulated else {"cuda"}),
        limits={
            N: md.Limits(hidden_multiple=128, max_top_k=vendor.NORMAL_MAX_TOPK, max_buffer_bytes=MAX_BUFFER_BYTES),
            LL: md.Limits(max_tokens_per_rank=LOW_LATENCY_MAX_TOKENS, hidden_sizes=release.ll_hidden_sizes,
                          max_top_k=release.ll_max_topk, max_buffer_bytes=MAX_BUFFER_BYTES),
        },
        world_sizes=None,
    )


def _invalid(message: str, parameter: str, value: Any, allowed: str) -> md.InvalidSpecError:
    return md.InvalidSpecError(message, parameter=parameter, value=value, allowed=allowed)


class DeepEPBackend(md.Backend):
    """DeepEP's V1 ``Buffer`` on CUDA (or, with ``vendor_module=vendor.EMULATOR``, its CPU fake).

    Options (``create_dispatcher(options=...)``): ``dispatch_config`` / ``combine_config``: DeepEP's
    ``Config``, or ``vendor.ConfigFields`` / a dict of its five fields, converted (the same ``num_sms`` in
    both, as DeepEP's combine needs); the buffer is sized for them. ``buffer``: a ``deep_ep.Buffer`` shared
    by several layers (same group, the mode's buffers at least this layer's size).
    """

    name = "cuda_deepep"
    description = "DeepEP V1 Buffer: normal (NVLink/RDMA) and low-latency (masked, CUDA-graph safe) modes"
    install_hint = vendor.INSTALL_HINT

    def __init__(self, vendor_module: str = vendor.REAL) -> None:
        self.vendor_module = vendor_module
        self._capabilities: md.Capabilities | None = None
        self._info: vendor.VendorInfo | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Backends travel to rank processes; the imported module does not (it is found again there)."""
        return {**self.__dict__, "_info": None}

    def vendor(self) -> vendor.VendorInfo:
        if self._info is None:
            self._info = vendor.detect(self.vendor_module)
        return self._info

    @property
    def _module(self) -> ModuleType | None:
        return self.vendor().module

    @property
    def capabilities(self) -> md.Capabilities:  # type: ignore[override]
        """Read on first use, not at registration: NVFP4 and the limits depend on the DeepEP installed."""
        if self._capabilities is None:
            info = self.vendor()
            self._capabilities = capabilities(info.emulated, info.has_nvfp4, info.release)
        return self._capabilities

    def probe(self) -> str | None:
        info = self.vendor()
        if info.module is None:
            return info.describe()
        if not info.has_v1_buffer:
            return f"{info.describe()}; this adapter drives the V1 Buffer"
        if not info.emulated and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    # -- limits --------------------------------------------------------------------------------------------

    def normal_world_sizes(self) -> frozenset[int]:
        return vendor.supported_world_sizes(self._module, self.vendor().release)

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        super().check_spec(spec, world_size)
        local = spec.local_experts(world_size)
        if spec.mode is LL:
            t = spec.num_max_dispatch_tokens_per_rank
            if (world_size * t) % vendor.LOW_LATENCY_TOKEN_MULTIPLE:
                raise _invalid("DeepEP's low-latency dispatch needs num_ranks · num_max_dispatch_tokens_per_rank to "
                               "be a multiple of 4 (TMA)", "num_max_dispatch_tokens_per_rank", t,
                               f"multiples of {vendor.LOW_LATENCY_TOKEN_MULTIPLE // math.gcd(world_size, 4)} on "
                               f"{world_size} ranks (num_ranks · T a multiple of {vendor.LOW_LATENCY_TOKEN_MULTIPLE})")
            return
        allowed = self.normal_world_sizes()
        if world_size not in allowed:
            raise _invalid("DeepEP's normal mode has kernels and a tuned config for these EP sizes only",
                           "world_size", world_size, ", ".join(map(str, sorted(allowed))))
        internode = world_size > vendor.NUM_MAX_NVL_PEERS
        most = (vendor.NORMAL_INTERNODE_MAX_NVL_EXPERTS // vendor.NUM_MAX_NVL_PEERS if internode
                else vendor.NORMAL_INTRANODE_MAX_LOCAL_EXPERTS)
        if local > most:
            raise _invalid(f"DeepEP's {'internode' if internode else 'intranode'} notify kernel handles at most "
                           f"{most} experts per rank", "num_experts", spec.num_experts,
                           f"at most {most} · {world_size} = {most * world_size}")

    def check_options(self, spec: md.DispatchSpec, world_size: int, options: Mapping[str, Any]) -> None:
        """What ``create`` checks in ``options`` before touching DeepEP (typed errors)."""
        self._configs(spec, world_size, options)

    def env_requirements(self, spec: md.DispatchSpec, world_size: int) -> tuple[md.EnvRequirement, ...]:
        """Low-latency mode: ``NVSHMEM_QP_DEPTH`` (read by the Buffer constructor, default 1024) must be at
        least 2·(T+1), which DeepEP asserts in every low-latency call."""
        if spec.mode is not LL:
            return ()
        return (md.EnvRequirement(vendor.NVSHMEM_QP_DEPTH, 2 * (spec.num_max_dispatch_tokens_per_rank + 1),
                                  "work requests", vendor.DEFAULT_NVSHMEM_QP_DEPTH,
                                  "DeepEP asserts the NVSHMEM QP depth covers 2·(T+1) in-flight requests"),)

    # -- sizes -----------------------------------------------------------------------------------------------

    def _tuned(self, spec: md.DispatchSpec, world_size: int) -> tuple[Any, Any]:
        module = self._module
        dcfg, ccfg = vendor.dispatch_config(module, world_size), vendor.combine_config(module, world_size)
        if dcfg is None or ccfg is None:
            raise _invalid("DeepEP has no tuned normal-mode config for this EP size", "world_size", world_size,
                           ", ".join(map(str, sorted(self.normal_world_sizes()))))
        return dcfg, ccfg

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> md.BufferSize:
        if spec.mode is LL:
            return sizes.low_latency_buffer(spec, world_size, self._module)
        return sizes.normal_buffer(sizes.normal_hints(spec, world_size, *self._tuned(spec, world_size)))

    def nvl_rdma_bytes(self, spec: md.DispatchSpec, world_size: int) -> tuple[int, int]:
        """What to pass to ``Buffer(num_nvl_bytes=, num_rdma_bytes=)`` with the tuned configs."""
        if spec.mode is LL:
            return 0, self.buffer_size(spec, world_size).total_bytes
        hints = sizes.normal_hints(spec, world_size, *self._tuned(spec, world_size))
        return hints.nvl_bytes, hints.rdma_bytes

    # -- configs ---------------------------------------------------------------------------------------------

    def _config(self, name: str, given: Any, tuned: Any) -> tuple[Any, vendor.ConfigFields | None]:
        """The vendor ``Config`` to use for option ``name`` and, when known, its fields."""
        module = self._module
        if given is None:
            return tuned, tuned if isinstance(tuned, vendor.ConfigFields) else None
        fields: vendor.ConfigFields | None = None
        if isinstance(given, vendor.ConfigFields):
            fields = given
        elif isinstance(given, Mapping):
            try:
                fields = vendor.ConfigFields(**given)
            except TypeError as exc:
                raise _invalid(f"not DeepEP Config fields ({exc})", f"options.{name}", dict(given),
                               "the keys of vendor.ConfigFields") from None
        elif module is not None and isinstance(given, module.Config):
            return given, None
        else:
            raise _invalid("DeepEP's dispatch/combine take its own pybind Config", f"options.{name}", given,
                           "deep_ep.Config, vendor.ConfigFields, or a dict of its five fields")
        problems = fields.problems()
        if problems:
            raise _invalid(f"DeepEP's Config asserts {problems[0]}", f"options.{name}", fields,
                           "fields DeepEP's Config constructor accepts")
        if fields.num_sms % 2:
            raise _invalid("DeepEP's normal-mode kernels use two SMs per channel", f"options.{name}", fields,
                           "an even num_sms")
        return (fields.to_vendor(module) if module is not None else fields), fields

    def _configs(self, spec: md.DispatchSpec, world_size: int, options: Mapping[str, Any]) -> tuple[Any, Any]:
        if spec.mode is LL:
            return None, None
        tuned = self._tuned(spec, world_size)
        (dcfg, dfields), (ccfg, cfields) = (self._config(n, options.get(n), t) for n, t in zip(CONFIG_OPTIONS, tuned))
        if dfields is not None and cfields is not None and dfields.num_sms != cfields.num_sms:
            raise _invalid("DeepEP's combine reads the dispatch's channel layout: both configs need the same "
                           "num_sms", "options.combine_config", cfields.num_sms, f"num_sms={dfields.num_sms}")
        return dcfg, ccfg

    # -- creation --------------------------------------------------------------------------------------------

    def _check_torch_flags(self) -> None:
        """DeepEP 2.x asserts in every call that torch does not both use deterministic algorithms and fill
        uninitialized memory (``check_torch_deterministic``)."""
        if self.vendor().release.checks_deterministic and torch.are_deterministic_algorithms_enabled() and \
                torch.utils.deterministic.fill_uninitialized_memory:
            raise _invalid("DeepEP 2.x refuses to run while torch fills uninitialized memory (deterministic mode)",
                           "torch.use_deterministic_algorithms", True,
                           "False, or torch.utils.deterministic.fill_uninitialized_memory = False")

    def _check_qp_depth(self, spec: md.DispatchSpec, depth: int) -> None:
        t = spec.num_max_dispatch_tokens_per_rank
        most = vendor.low_latency_max_tokens(depth)
        if t > most:
            raise md.CapacityError(f"DeepEP's low-latency calls assert {vendor.NVSHMEM_QP_DEPTH} ({depth}) >= "
                                   f"2·(T+1); raise {vendor.NVSHMEM_QP_DEPTH} or lower T",
                                   parameter="num_max_dispatch_tokens_per_rank", value=t, allowed=f"1..{most}")

    def _check_shared(self, buffer: Any, spec: md.DispatchSpec, world_size: int, nvl: int, rdma: int) -> None:
        def refuse(why: str, allowed: str) -> md.InvalidSpecError:
            return _invalid(f"the shared DeepEP Buffer {why}", "options.buffer", type(buffer).__name__, allowed)

        if getattr(buffer, "group_size", world_size) != world_size:
            raise refuse(f"spans {buffer.group_size} ranks, not {world_size}",
                         f"a Buffer of this {world_size}-rank group")
        if spec.mode is LL and not getattr(buffer, "low_latency_mode", False):
            raise refuse("was not created with low_latency_mode=True", "a low-latency Buffer")
        if getattr(buffer, "num_nvl_bytes", nvl) < nvl or getattr(buffer, "num_rdma_bytes", rdma) < rdma:
            raise refuse(f"is smaller than this layer needs (NVL {nvl:,} B, RDMA {rdma:,} B)",
                         "a Buffer sized for the largest layer sharing it")
        depth = getattr(buffer, "nvshmem_qp_depth", None)
        if spec.mode is LL and depth is not None:
            self._check_qp_depth(spec, depth)

    def create(self, ctx: md.DispatchContext) -> DeepEPDispatcher:
        spec, R = ctx.spec, ctx.world_size
        info = self.vendor()
        module = info.module
        assert module is not None  # probe() said so before create_dispatcher got here
        self._check_torch_flags()
        dcfg, ccfg = self._configs(spec, R, ctx.options)
        if spec.mode is LL:
            nvl, rdma = 0, ctx.buffer_size.total_bytes
        else:
            hints = sizes.normal_hints(spec, R, dcfg, ccfg)
            nvl, rdma = hints.nvl_bytes, hints.rdma_bytes
        buffer = ctx.options.get("buffer")
        if buffer is not None:
            self._check_shared(buffer, spec, R, nvl, rdma)
        else:
            if spec.mode is LL:
                self._check_qp_depth(spec, vendor.qp_depth_from(os.environ))
            group = ctx.comm.process_group
            if group is None:
                raise md.BackendUnavailableError(
                    "DeepEP's Buffer needs a torch.distributed process group (it raises ValueError without one): "
                    "call torch.distributed.init_process_group() first; a group of one rank works",
                    parameter="group", value=None, allowed="an initialized process group")
            with restored_environ():  # the V1 Buffer writes NVSHMEM_* into os.environ while it starts
                qps = ctx.local_experts if spec.mode is LL else NORMAL_NUM_QPS_PER_RANK  # LL: >= local experts
                buffer = module.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma,
                                       low_latency_mode=spec.mode is LL, num_qps_per_rank=qps)
        return DeepEPDispatcher(ctx, buffer, dcfg, ccfg, vendor.topk_idx_dtype(module))

