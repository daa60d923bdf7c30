"""The ``cuda_deepep`` backend: capabilities, limits, buffer sizes, and the adapter it creates.

Every limit is DeepEP's, for the release installed (``vendor.release_of``): what its host and device
asserts accept. Where a limit depends on the environment (``NVSHMEM_QP_DEPTH``), on the wire dtype (the normal
kernels' hidden limits), or on ``options`` (user configs, the process's Buffer) it is checked in ``buffer_size`` /
``agreement`` / ``create``, before DeepEP is touched. The Buffers are the process's (``buffers``: one with NVSHMEM
per process, as NVSHMEM is); every rank must plan the same one (``agreement``); ``close()`` destroys them.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import DEFAULT_TIMEOUT_S, check_timeout

from . import sizes, vendor
from .buffers import PROCESS_BUFFERS, BufferPlan, BufferRequest, qps_option, reserved_bytes
from .dispatcher import DeepEPDispatcher

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY

#: With DeepEP's default ``NVSHMEM_QP_DEPTH`` of 1024 (see ``vendor.low_latency_max_tokens``).
LOW_LATENCY_MAX_TOKENS = vendor.low_latency_max_tokens()
#: DeepEP's ceiling on each buffer ("32 GiB"): ``num_bytes / sizeof(int4) < INT_MAX``. Normal mode with
#: more than 8 ranks also asserts both buffers fit an int (2 GiB); the tuned hints stay far below it.
MAX_BUFFER_BYTES = vendor.MAX_BUFFER_BYTES
CONFIG_OPTIONS = ("dispatch_config", "combine_config")


def capabilities(emulated: bool, nvfp4: bool = False, release: vendor.DeepEPRelease = vendor.PLANNING_RELEASE,
                 normal_world_sizes: frozenset[int] | None = None) -> mdb.Capabilities:
    """``nvfp4``: the installed DeepEP's ``low_latency_dispatch`` takes ``use_nvfp4`` (hybrid-ep).

    Normal mode runs on the EP sizes with a tuned config and a kernel (``Limits.world_sizes``); low-latency mode on
    any EP size below 8 or a multiple of 8 dividing the experts, a rule with no upper bound that ``check_spec``
    applies (as it does the rules that depend on more than the EP size)."""
    int8 = "DeepEP has no INT8 dispatch; FP8 sends the same bytes per element"
    no_nvfp4 = ("this DeepEP's low_latency_dispatch has no use_nvfp4 (NVFP4 dispatch is on DeepEP's hybrid-ep "
                "branch)" if not nvfp4 else "DeepEP's normal-mode NVFP4 (hybrid-ep HybridEPBuffer) is not driven")
    return mdb.Capabilities(
        dtypes={N: frozenset({B, F8}), LL: frozenset({B, F8, F4} if nvfp4 else {B, F8})},
        fallbacks={(N, I8): mdb.Fallback(F8, int8), (LL, I8): mdb.Fallback(F8, int8)},
        rejections={F4: no_nvfp4},
        default_dtype=F8,
        fp8_ue8m0=True,
        cuda_graph_modes=frozenset({LL}),
        split_phase=frozenset({N, LL}),  # LL: return_recv_hook; normal: async_finish (dispatcher.py)
        masked_modes=frozenset({LL}),  # low_latency_dispatch's [E_local, R*T, H] as it is (dispatcher.py)
        token_major_modes=frozenset({N}),  # dispatch's received tokens with their local top-k, as they are
        devices=frozenset({"cpu"} if emulated else {"cuda"}),
        limits={
            N: mdb.Limits(hidden_multiple=128, max_top_k=vendor.NORMAL_MAX_TOPK, max_buffer_bytes=MAX_BUFFER_BYTES,
                         world_sizes=release.world_sizes if normal_world_sizes is None else normal_world_sizes),
            LL: mdb.Limits(max_tokens_per_rank=LOW_LATENCY_MAX_TOKENS, hidden_sizes=release.ll_hidden_sizes,
                          max_top_k=release.ll_max_topk, max_buffer_bytes=MAX_BUFFER_BYTES),
        },
    )


def _invalid(message: str, parameter: str, value: Any, allowed: str) -> md.InvalidSpecError:
    return md.InvalidSpecError(message, parameter=parameter, value=value, allowed=allowed)


def installed_deep_gemm() -> tuple[vendor.DeepGemmInfo | None, int | None]:
    """The DeepGEMM installed here and the compute-capability major its kernels run on (None, None when it is not
    installed or does not import: planning, or a host without it)."""
    if importlib.util.find_spec(vendor.DEEP_GEMM) is None:
        return None, None
    info = vendor.detect_deep_gemm(vendor.DEEP_GEMM)
    if info.module is None:
        return None, None
    return info, (vendor.device_capability(info.module) or (None,))[0]


def check_runner_alignment(spec: md.DispatchSpec, backend: str) -> None:
    """``runner="deep_gemm"`` with expert-aligned PACKED rows: the runner hands them to DeepGEMM's contiguous GEMM
    as they are, which takes each expert's rows at a multiple of its BLOCK_M, the mk alignment
    (``get_mk_alignment_for_contiguous_layout()``, read live; DeepGEMM@54e2261 heuristics/sm90.hpp:31-33,
    sm100.hpp:32-40; ``DeepGemmExperts._aligned``): any other alignment is refused here, at creation, not at the
    first forward. 1 (dense rows, which the runner pads itself) is always taken."""
    if spec.runner != vendor.DEEP_GEMM or spec.expert_alignment <= 1:
        return
    info, _ = installed_deep_gemm()
    mk = vendor.mk_alignment(info.module) if info is not None else vendor.DG_DEFAULT_MK_ALIGNMENT
    if spec.expert_alignment % mk:
        raise _invalid(f"backend {backend!r} with runner 'deep_gemm': DeepGEMM's contiguous GEMM takes each expert's "
                       f"rows at a multiple of its mk alignment ({mk}, BLOCK_M)", "expert_alignment",
                       spec.expert_alignment, f"1, or a multiple of {mk} (DeepGemmExperts(...).expert_alignment)")


@dataclass(frozen=True)
class LayerConfigs:
    """Normal mode's two configs as the dispatcher hands them to DeepEP (vendor ``Config``s; ``ConfigFields`` when
    planning without DeepEP) and the SM count both use."""

    dispatch: Any
    combine: Any
    num_sms: int


class DeepEPBackend(mdb.Backend):
    """DeepEP's V1 ``Buffer`` on CUDA (or, with ``vendor_module`` a fake's module path, its CPU fake).

    Buffers: the process's (``buffers.PROCESS_BUFFERS``): one ``deep_ep.Buffer`` with NVSHMEM per process (every
    low-latency layer, and normal mode past 8 ranks), one intranode normal-mode Buffer per process group, shared by
    every dispatcher of every backend object. ``close()`` (collective) destroys them.

    Options (``create_dispatcher(options=...)``): ``dispatch_config`` / ``combine_config``: ``vendor.ConfigFields``
    or a dict of its five fields (sglang's ``--deepep-config``), converted to DeepEP's ``Config``; both with the
    same ``num_sms``. ``buffer_bytes``: what the process's Buffer reserves when this layer creates it (an int, e.g.
    ``moe_dispatch.planning.plan_buffers(...).total_bytes``, or ``(nvl, rdma)``, per mode: ``buffers.reserved_bytes``).
    ``buffer_num_qps_per_rank``: the QPs per peer of a Buffer this layer creates, or of the one it hands in.
    ``buffer``: a ``deep_ep.Buffer`` of the engine's own to use instead (the process's only NVSHMEM one; checked
    as the adapter's own are). Every rank must pass the same (``agreement``).
    """

    vendor_environment = vendor.READ_ENVIRONMENT
    name = "cuda_deepep"
    engine_sizing = ("normal: sglang's sizing (NVL/RDMA hints of both configs with hidden_bytes = 2H); the buffer is "
                     "shared with combine, which is BF16, so FP8 saves only where the dispatch config's hint is the "
                     "larger. low_latency: get_low_latency_rdma_size_hint ignores the dtype (BF16 messages), as in "
                     "sglang, so nothing is saved.")
    description = ("DeepEP's V1 Buffer (legacy in DeepEP 2.x): normal (NVLink/RDMA) and low-latency (masked, "
                   "CUDA-graph safe) modes; DeepEP 2.x's ElasticBuffer is backend 'cuda_deepep_v2'")
    install_hint = vendor.INSTALL_HINT

    def __init__(self, vendor_module: str = vendor.REAL) -> None:
        self.vendor_module = vendor_module
        self._capabilities: mdb.Capabilities | None = None
        self._info: vendor.VendorInfo | None = None
        self._masked_multiple: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Backends travel to rank processes; the imported module does not (the Buffers are each process's own)."""
        return {**self.__dict__, "_info": None}

    def vendor(self) -> vendor.VendorInfo:
        if self._info is None:
            self._info = vendor.detect(self.vendor_module)
        return self._info

    @property
    def _module(self) -> ModuleType | None:
        return self.vendor().module

    @property
    def capabilities(self) -> mdb.Capabilities:  # type: ignore[override]
        """Read on first use, not at registration: NVFP4 and the limits depend on the DeepEP installed."""
        if self._capabilities is None:
            info = self.vendor()
            self._capabilities = capabilities(info.emulated, info.has_nvfp4, info.release, self.normal_world_sizes())
        return self._capabilities

    def probe(self) -> str | None:
        info = self.vendor()
        if info.module is None:
            return info.describe()
        if not info.has_v1_buffer:
            return f"{info.describe()}; this adapter drives the V1 Buffer"
        floor = vendor.floor_problem(info.module)
        if floor is not None:
            return floor
        if not info.emulated and not torch.cuda.is_available():
            return "no CUDA device"
        return None

    # -- limits --------------------------------------------------------------------------------------------

    def normal_world_sizes(self) -> frozenset[int]:
        return vendor.supported_world_sizes(self._module, self.vendor().release)

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        super().check_spec(spec, world_size)
        name = vendor.device_name(self._module) if self._module is not None else None
        if vendor.pcie_pairs_only(name) and world_size > vendor.PCIE_MAX_RANKS:
            raise _invalid(f"DeepEP's Buffer asserts at most 2 ranks on PCIe GPUs ({name}: "
                           f"'{vendor.PCIE_ASSERT_MESSAGE}', check_nvlink_connections)", "world_size", world_size,
                           f"1..{vendor.PCIE_MAX_RANKS} on this GPU")
        if spec.mode is LL:
            self._check_low_latency(spec, world_size)  # MASKED rows: no expert alignment
            return
        check_runner_alignment(spec, self.name)
        local = spec.local_experts(world_size)
        internode = world_size > vendor.NUM_MAX_NVL_PEERS
        most = (vendor.NORMAL_INTERNODE_MAX_NVL_EXPERTS // vendor.NUM_MAX_NVL_PEERS if internode
                else vendor.NORMAL_INTRANODE_MAX_LOCAL_EXPERTS)
        if local > most:
            raise _invalid(f"DeepEP's {'internode' if internode else 'intranode'} notify kernel handles at most "
                           f"{most} experts per rank", "num_experts", spec.num_experts,
                           f"at most {most} · {world_size} = {most * world_size}")
        top_k = vendor.normal_max_top_k(world_size)
        if spec.top_k > top_k:
            raise _invalid("DeepEP's internode dispatch sends a token to at most 8 nodes (device assert); past 64 "
                           "ranks a top-k above 8 can reach more (node-limited routing is not checked)", "top_k",
                           spec.top_k, f"1..{top_k}")

    def _check_low_latency(self, spec: md.DispatchSpec, world_size: int) -> None:
        if not vendor.world_size_ok(world_size):
            raise _invalid("DeepEP's Buffer asserts num_ranks < 8 or a multiple of 8 in every mode", "world_size",
                           world_size, "fewer than 8, or a multiple of 8")
        t = spec.num_max_dispatch_tokens_per_rank
        if (world_size * t) % vendor.LOW_LATENCY_TOKEN_MULTIPLE:
            raise _invalid("DeepEP's low-latency dispatch needs num_ranks · num_max_dispatch_tokens_per_rank to "
                           "be a multiple of 4 (TMA)", "num_max_dispatch_tokens_per_rank", t,
                           f"multiples of {vendor.LOW_LATENCY_TOKEN_MULTIPLE // math.gcd(world_size, 4)} on "
                           f"{world_size} ranks (num_ranks · T a multiple of {vendor.LOW_LATENCY_TOKEN_MULTIPLE})")
        problem = vendor.low_latency_launch_problem(spec.num_experts, vendor.device_num_sms(self._module))
        if problem is not None:
            raise _invalid(f"DeepEP's low-latency dispatch kernel device-asserts {problem}", "num_experts",
                           spec.num_experts, "2 .. 14 · the GPU's SM count")
        if spec.runner == vendor.DEEP_GEMM and spec.local_experts(world_size) > 1:
            multiple = self.masked_capacity_multiple()
            if (world_size * t) % multiple:
                raise _invalid(
                    "DeepGEMM's masked GEMM stores whole BLOCK_M-row tiles: a capacity num_ranks · "
                    "num_max_dispatch_tokens_per_rank that is not a multiple of every BLOCK_M it may pick lets one "
                    "expert's last tile overwrite the next expert's first rows", "num_max_dispatch_tokens_per_rank",
                    t, f"num_ranks · T a multiple of {multiple} (multiples of "
                       f"{multiple // math.gcd(multiple, world_size)} on {world_size} ranks)")

    def masked_capacity_multiple(self) -> int:
        """What the installed DeepGEMM's masked GEMM needs of the capacity R·T (every version's rule when DeepGEMM
        is not installed here, e.g. planning)."""
        if self._masked_multiple is None:
            info, arch = installed_deep_gemm()
            mk = vendor.mk_alignment(info.module) if info is not None else vendor.DG_DEFAULT_MK_ALIGNMENT
            self._masked_multiple = vendor.dg_masked_capacity_multiple(info, arch, mk)
        return self._masked_multiple

    def check_options(self, spec: md.DispatchSpec, world_size: int, options: Mapping[str, Any]) -> None:
        """What ``create`` checks in ``options`` before touching DeepEP, that needs no Buffer (typed errors)."""
        self._configs(spec, world_size, options)
        if options.get("buffer_bytes") is not None:
            reserved_bytes(options["buffer_bytes"], spec.mode is LL, world_size)
        qps_option(options)

    def both_modes_options(self, normal: md.DispatchSpec, low_latency: md.DispatchSpec, world_size: int,
                           options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``options`` for the first low-latency layer past 8 ranks, so that the process's one NVSHMEM Buffer (LL mode)
        also serves ``normal``'s layers (sglang's auto mode; DeepEP's ``test_internode.py --test-ll-compatibility``):
        both modes' bytes and ``max(local experts, the normal QPs)`` QPs per peer. ``options``: ``normal``'s own
        (configs). A ``CapacityError`` when one Buffer cannot hold both: past 8 ranks normal mode asserts both
        regions below INT_MAX (internode notify), which an LL region of ``T · E`` bytes often is not."""
        ll, n = self.buffer_request(low_latency, world_size), self.buffer_request(normal, world_size, options)
        nvl, rdma = max(ll.num_nvl_bytes, n.num_nvl_bytes), max(ll.num_rdma_bytes, n.num_rdma_bytes)
        if world_size > vendor.NUM_MAX_NVL_PEERS and not vendor.internode_bytes_ok(nvl, rdma):
            raise md.CapacityError(
                "one DeepEP Buffer cannot serve both modes past 8 ranks: normal mode's internode notify asserts "
                f"num_nvl_bytes and num_rdma_bytes < INT_MAX, and the low-latency layer needs {ll.num_rdma_bytes:,} "
                "RDMA bytes; lower num_max_dispatch_tokens_per_rank or the experts per rank of the low-latency layer",
                parameter="low_latency", value=(nvl, rdma), allowed=f"< {vendor.INT_MAX} bytes each")
        return {"buffer_bytes": (nvl, rdma), "buffer_num_qps_per_rank": max(ll.num_qps_per_rank, n.num_qps_per_rank)}

    def env_requirements(self, spec: md.DispatchSpec, world_size: int) -> tuple[mdb.EnvRequirement, ...]:
        """Low-latency mode: ``NVSHMEM_QP_DEPTH`` (read by the Buffer constructor, default 1024) must be at
        least 2·(T+1), which DeepEP asserts in every low-latency call."""
        if spec.mode is not LL:
            return ()
        return (mdb.EnvRequirement(vendor.NVSHMEM_QP_DEPTH, 2 * (spec.num_max_dispatch_tokens_per_rank + 1),
                                  "work requests", vendor.DEFAULT_NVSHMEM_QP_DEPTH,
                                  "DeepEP asserts the NVSHMEM QP depth covers 2·(T+1) in-flight requests"),)

    # -- sizes -----------------------------------------------------------------------------------------------

    def _tuned(self, world_size: int) -> LayerConfigs:
        module = self._module
        num_sms = int(module.Buffer.num_sms) if getattr(module, "Buffer", None) is not None else vendor.DEFAULT_NUM_SMS
        problems = vendor.normal_num_sms_problems(num_sms, world_size, self._device_sms())
        if problems:
            raise _invalid(f"DeepEP's tuned configs use the class-level Buffer.num_sms, and its kernels assert "
                           f"{problems[0]}", "deep_ep.Buffer.num_sms", num_sms, self._num_sms_allowed(world_size))
        dcfg, ccfg = vendor.dispatch_config(module, world_size), vendor.combine_config(module, world_size)
        if dcfg is None or ccfg is None:
            raise _invalid("DeepEP has no tuned normal-mode config for this EP size", "world_size", world_size,
                           ", ".join(map(str, sorted(self.normal_world_sizes()))))
        return LayerConfigs(dcfg, ccfg, num_sms)

    def _check_hidden(self, spec: md.DispatchSpec, world_size: int) -> None:
        """The normal kernels' TMA staging of a token (device asserts): a typed error at planning and creation."""
        fp8 = spec.output_dtype is F8
        ue8m0 = fp8 and spec.quant.fp8_ue8m0_scales
        # UE8M0: four exponents per int32 word, ceil(H/128/4) words as pack_ue8m0 sends them (H % 512 may be nonzero)
        scales = 0 if not fp8 else -(-spec.hidden_size // (512 if ue8m0 else 128))
        problems = vendor.normal_hidden_problems(spec.hidden_size, 1 if fp8 else 2, scales, spec.top_k, world_size)
        if problems:
            raise _invalid(f"DeepEP's normal-mode kernels device-assert {problems[0]}", "hidden_size",
                           spec.hidden_size, "BF16 rows below 8 KiB within a node (H < 8192 BF16, < 16384 FP8); past "
                           "8 ranks a token below 16 KiB and H % 256")

    def buffer_request(self, spec: md.DispatchSpec, world_size: int,
                       options: Mapping[str, Any] | None = None) -> BufferRequest:
        """The ``deep_ep.Buffer`` this layer needs (``spec`` with its dtype resolved; ``options`` as for
        ``create_dispatcher``)."""
        if spec.mode is LL:
            size = sizes.low_latency_buffer(spec, world_size, self._module)
            return BufferRequest(0, size.total_bytes, True, spec.local_experts(world_size))
        return self._normal_request(spec, world_size, self._configs(spec, world_size, options or {}))

    def _normal_request(self, spec: md.DispatchSpec, world_size: int, configs: LayerConfigs) -> BufferRequest:
        self._check_hidden(spec, world_size)
        hints = sizes.normal_hints(spec, world_size, configs.dispatch, configs.combine)
        qps = (vendor.normal_num_qps_per_rank(configs.num_sms) if world_size > vendor.NUM_MAX_NVL_PEERS
               else vendor.DEFAULT_NUM_QPS_PER_RANK)
        return BufferRequest(hints.nvl_bytes, hints.rdma_bytes, False, qps, configs.num_sms)

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> mdb.BufferSize:
        if spec.mode is LL:
            return sizes.low_latency_buffer(spec, world_size, self._module)
        self._check_hidden(spec, world_size)
        tuned = self._tuned(world_size)
        return sizes.normal_buffer(sizes.normal_hints(spec, world_size, tuned.dispatch, tuned.combine))

    def nvl_rdma_bytes(self, spec: md.DispatchSpec, world_size: int) -> tuple[int, int]:
        """What ``Buffer(num_nvl_bytes=, num_rdma_bytes=)`` needs for ``spec`` with the tuned configs."""
        request = self.buffer_request(spec, world_size)
        return request.num_nvl_bytes, request.num_rdma_bytes

    # -- configs ---------------------------------------------------------------------------------------------

    def _fields(self, name: str, given: Any, world_size: int) -> vendor.ConfigFields:
        """The fields of a user config (``ConfigFields`` or a dict); anything else is a typed error."""
        module = self._module
        if isinstance(given, vendor.ConfigFields):
            fields = given
        elif isinstance(given, Mapping):
            try:
                fields = vendor.ConfigFields(**given)
            except TypeError as exc:
                raise _invalid(f"not DeepEP Config fields ({exc})", f"options.{name}", dict(given),
                               "the keys of vendor.ConfigFields") from None
        elif module is not None and isinstance(given, module.Config):
            raise _invalid("DeepEP's pybind Config hides its fields, and the adapter needs its num_sms (both "
                           "directions must share it; the QPs past 8 ranks follow it)", f"options.{name}", given,
                           "vendor.ConfigFields(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv) or a dict of them")
        else:
            raise _invalid("DeepEP's dispatch/combine take its own pybind Config", f"options.{name}", given,
                           "vendor.ConfigFields or a dict of its five fields")
        problems = fields.problems()
        if problems:
            raise _invalid(f"DeepEP's Config asserts {problems[0]}", f"options.{name}", fields,
                           "fields DeepEP's Config constructor accepts")
        problems = vendor.normal_num_sms_problems(fields.num_sms, world_size, self._device_sms())
        if problems:
            raise _invalid(f"DeepEP's normal-mode kernels assert {problems[0]} (num_sms {fields.num_sms})",
                           f"options.{name}", fields, self._num_sms_allowed(world_size))
        if name == "combine_config":
            problems = fields.internode_problems(world_size)
            if problems:
                raise _invalid(f"DeepEP's internode combine asserts {problems[0]}", f"options.{name}", fields,
                               f"fields internode::combine accepts on {world_size} ranks")
        return fields

    def _configs(self, spec: md.DispatchSpec, world_size: int, options: Mapping[str, Any]) -> LayerConfigs | None:
        if spec.mode is LL:
            return None
        tuned = self._tuned(world_size)
        chosen, sms = [], []
        for name, default in zip(CONFIG_OPTIONS, (tuned.dispatch, tuned.combine)):
            given = options.get(name)
            if given is None:
                chosen.append(default)
                sms.append(tuned.num_sms)
                continue
            fields = self._fields(name, given, world_size)
            chosen.append(fields.to_vendor(self._module) if self._module is not None else fields)
            sms.append(fields.num_sms)
        if sms[0] != sms[1]:
            raise _invalid("DeepEP's combine reads the dispatch's channel layout: both configs need the same "
                           "num_sms (a config left out is DeepEP's tuned one, with Buffer.num_sms)",
                           "options.combine_config", sms[1], f"num_sms={sms[0]}")
        return LayerConfigs(chosen[0], chosen[1], sms[0])

    # -- creation --------------------------------------------------------------------------------------------

    def _check_torch_flags(self) -> None:
        """DeepEP 2.x asserts in every call that torch does not both use deterministic algorithms and fill
        uninitialized memory (``check_torch_deterministic``)."""
        if self.vendor().release.checks_deterministic and torch.are_deterministic_algorithms_enabled() and \
                torch.utils.deterministic.fill_uninitialized_memory:
            raise _invalid("DeepEP 2.x refuses to run while torch fills uninitialized memory (deterministic mode)",
                           "torch.use_deterministic_algorithms", True,
                           "False, or torch.utils.deterministic.fill_uninitialized_memory = False")

    def _device_sms(self) -> int | None:
        return vendor.device_num_sms(self._module) if self._module is not None else None

    def _num_sms_allowed(self, world_size: int) -> str:
        low = vendor.INTERNODE_MIN_NUM_SMS if world_size > vendor.NUM_MAX_NVL_PEERS else vendor.NORMAL_MIN_NUM_SMS
        high = vendor.INTERNODE_MAX_NUM_SMS if world_size > vendor.NUM_MAX_NVL_PEERS else None
        device = self._device_sms()
        high = device if high is None else high if device is None else min(high, device)
        return f"an even num_sms in {low}..{high if high is not None else 'the GPU SM count'} on {world_size} ranks"

    def _need(self, spec: md.DispatchSpec, world_size: int, options: Mapping[str, Any]
              ) -> tuple[BufferRequest, LayerConfigs | None]:
        configs = self._configs(spec, world_size, options)
        if configs is None:
            return self.buffer_request(spec, world_size), None
        return self._normal_request(spec, world_size, configs), configs

    def _plan(self, ctx: mdb.DispatchContext) -> tuple[BufferPlan, LayerConfigs | None]:
        """Which Buffer this layer uses (create, reuse, adopt) and its configs: typed errors first."""
        module = self._module
        assert module is not None  # probe() said so before create_dispatcher got here
        floor = vendor.floor_problem(module)
        if floor is not None:  # probe() says so too; create() may be reached without it
            raise md.BackendUnavailableError(floor, parameter=vendor.REAL, value=vendor.deep_ep_version(module),
                                             allowed=f"DeepEP from {vendor.COMMIT_UE8M0} on")
        self.check_options(ctx.spec, ctx.world_size, ctx.options)
        need, configs = self._need(ctx.spec, ctx.world_size, ctx.options)
        plan = PROCESS_BUFFERS.plan(module, ctx.comm.process_group, ctx.world_size, need, ctx.spec, ctx.options)
        return plan, configs

    def agreement(self, ctx: mdb.DispatchContext) -> Mapping[str, Any]:
        """What decides DeepEP's collective constructor (its bytes, mode and QPs; ``all_gather_object`` then
        NVSHMEM's symmetric allocation) and the kernels' launch: whether this layer creates, reuses or adopts a
        Buffer and what it holds, the configs, the QP depth read at construction. Ranks that differ get a
        ``ConfigMismatchError`` instead of a hang in the constructor."""
        self._check_torch_flags()
        plan, configs = self._plan(ctx)
        fields: dict[str, Any] = plan.agreement()
        if configs is not None:
            fields["configs"] = (f"{self._config_text(ctx.options.get('dispatch_config'))}/"
                                 f"{self._config_text(ctx.options.get('combine_config'))} sms={configs.num_sms}")
        if plan.decision == "create" and plan.held.low_latency_mode:
            fields[vendor.NVSHMEM_QP_DEPTH] = vendor.qp_depth_from(os.environ)
        return fields

    @staticmethod
    def _config_text(given: Any) -> str:
        if given is None:
            return "tuned"
        fields = given if isinstance(given, vendor.ConfigFields) else vendor.ConfigFields(**dict(given))
        return ",".join(map(str, fields.as_tuple()))

    def create(self, ctx: mdb.DispatchContext) -> DeepEPDispatcher:
        module = self._module
        assert module is not None  # probe() said so before create_dispatcher got here
        self._check_torch_flags()
        plan, configs = self._plan(ctx)
        shared = PROCESS_BUFFERS.open(plan, module, ctx.comm.process_group, ctx.world_size, ctx.spec,
                                      self.vendor().release.ll_clean_by_experts)
        return DeepEPDispatcher(ctx, shared, None if configs is None else configs.dispatch,
                                None if configs is None else configs.combine, vendor.topk_idx_dtype(module),
                                functools.partial(vendor.stream_capturing, module))

    def close(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Destroy the ``deep_ep.Buffer``s the adapter created in this process (every backend object's: they are the
        process's) and let go of the ones handed in; their dispatchers then raise ``BackendUnavailableError``. A
        collective, like DeepEP's ``destroy()``: every rank calls it, at the same point (an engine's orderly
        shutdown). The ranks of each Buffer's group first meet in a barrier that waits ``timeout_s`` (as a
        dispatcher's collectives do) and names a rank that does not come, instead of waiting in DeepEP's teardown.
        Without ``close`` the Buffers live until the process exits, and their destructors run no collective
        (``explicitly_destroy=True``), so a peer that died cannot make this one hang."""
        timeout_s = check_timeout(timeout_s)
        module = self._module
        if module is not None:
            PROCESS_BUFFERS.close(vendor.nvshmem_domain(module), timeout_s)
