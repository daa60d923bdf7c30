"""The ``ascend_deepep`` backend: capabilities, limits, the HCCL window, and the adapter."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Mapping

import moe_dispatch as md
from moe_dispatch.environ import restored_environ

from . import sizes
from . import vendor as v
from .dispatcher import AscendDeepEPDispatcher

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
N, LL = md.Mode.NORMAL, md.Mode.LOW_LATENCY
MAX_EXPERTS = v.MAX_EXPERTS
#: What the adapter constructs ``deep_ep.Buffer`` with, whatever the process environment says:
#: the default strategies (their layouts and quantization flags are the ones this adapter reads),
#: no shared-expert ranks; the long-sequence rounds are removed for the call (one round of 8192).
CONSTRUCTION_ENV = {v.STRATEGY_ENV: v.STRATEGY_DEFAULT, v.SHARED_RANKS_ENV: "0"}
CONSTRUCTION_UNSET = (v.LONG_SEQ_ROUND_ENV, v.LONG_SEQ_TOKENS_ENV, v.LONG_SEQ_COMBINE_ENV)


def capabilities(emulated: bool) -> md.Capabilities:
    no_fp8 = "Atlas A2/A3 have no FP8; DeepEP-Ascend quantizes to INT8 (per token) instead"
    ll = md.Limits(max_tokens_per_rank=v.LL_MAX_TOKENS, hidden_multiple=v.HIDDEN_MULTIPLE, min_hidden=v.MIN_HIDDEN,
                   max_hidden=v.MAX_HIDDEN, max_top_k=v.MAX_TOP_K)
    return md.Capabilities(
        dtypes={N: frozenset({B, I8}), LL: frozenset({B, I8})},
        fallbacks={(N, F8): md.Fallback(I8, no_fp8), (LL, F8): md.Fallback(I8, no_fp8)},
        rejections={F4: "Atlas A2/A3 have no FP4 dispatch (MXFP4 is A5-only and not NVFP4)"},
        default_dtype=B,
        devices=frozenset({"cpu"} if emulated else {"npu"}),
        # The ops' tiling needs at least 2 ranks; normal mode runs only on get_dispatch_config's sizes.
        world_sizes=frozenset(range(v.MIN_EP_WORLD_SIZE, v.MAX_EP_WORLD_SIZE_LL + 1)),
        limits={N: md.Limits(max_tokens_per_rank=v.NORMAL_MAX_TOKENS, hidden_multiple=v.HIDDEN_MULTIPLE,
                             min_hidden=v.MIN_HIDDEN, max_hidden=v.MAX_HIDDEN, max_top_k=v.MAX_TOP_K,
                             world_sizes=frozenset(v.CONFIG_RANKS)), LL: ll},
    )


def check_hccl_group(process_group: Any) -> None:
    """DeepEP-Ascend builds its communicator from the group's HCCL backend; without one its Python
    prints "get_hccl_comm_name failed" and every rank initialises its OWN HCCL communicator (no common
    one: a hang or wrong peers; KN@f425bdf buffer.py Buffer.__init__, deep_ep.cpp Buffer::Buffer). A
    typed error instead, before the Buffer exists."""
    import torch.distributed as dist

    name = dist.get_backend(process_group) if process_group is not None else "none"
    if "hccl" not in str(name).lower():
        raise md.InvalidSpecError("DeepEP-Ascend needs a process group with an HCCL backend",
                                  parameter="process_group", value=str(name), allowed="hccl (or cpu:gloo,npu:hccl)")


def a2_limits(spec: md.DispatchSpec, world_size: int, soc: str | None) -> None:
    """Atlas A2 limits beyond the declared capabilities (vendor.A2_*): more than 8 ranks take
    DeepEP-Ascend's internode paths. ``soc`` None (planning without the chip): the safe bound,
    as if it were A2; an A3 that is known to be one is not limited."""
    if soc == v.SOC_A3 or world_size <= v.A2_MAX_HCCS_PEERS:
        return
    why = "on Atlas A2 (ASCEND910B), more than 8 ranks take DeepEP-Ascend's internode kernels" + (
        "; the chip is not known here, so the A2 bound applies (it does not on A3)" if soc is None else "")
    if world_size % v.A2_INTERNODE_EP_MULTIPLE or world_size > v.A2_INTERNODE_MAX_EP:
        raise md.InvalidSpecError(f"{why}, which take 8..256 ranks in whole nodes of 8", parameter="world_size",
                                  value=world_size, allowed=f"multiples of 8 up to {v.A2_INTERNODE_MAX_EP}")
    if spec.top_k < v.A2_LAYERED_MIN_TOP_K:
        raise md.InvalidSpecError(f"{why}, which take top-k 2..16", parameter="top_k", value=spec.top_k,
                                  allowed=f"{v.A2_LAYERED_MIN_TOP_K}..{v.MAX_TOP_K}")
    T = spec.num_max_dispatch_tokens_per_rank
    if spec.mode is N and T > v.A2_INTERNODE_MAX_TOKENS:
        raise md.CapacityError(f"{why}, whose normal dispatch takes at most 4096 tokens per rank",
                               parameter="num_max_dispatch_tokens_per_rank", value=T,
                               allowed=f"1..{v.A2_INTERNODE_MAX_TOKENS}")


class AscendDeepEPBackend(md.Backend):
    """DeepEP-Ascend (sgl-kernel-npu) ``Buffer`` on Atlas A2/A3, or with ``vendor_module=vendor.FAKE``
    its CPU fake. ``env`` is what the HCCL window variables are read from (``os.environ`` when
    None), never written; the vendor itself reads the process environment. ``soc`` (``"A2"`` or
    ``"A3"``) names the chip for planning elsewhere; by default it is read from torch_npu where this
    process has it (on the NPU; the fakes' torch_npu on CPU), and where it cannot be known the window
    and limits are the safe bound over both chips."""

    name = "ascend_deepep"
    description = "DeepEP-Ascend Buffer: normal and low-latency modes, BF16 or per-token INT8, HCCL window"
    install_hint = v.INSTALL_HINT

    def __init__(self, vendor_module: str = v.REAL, env: Mapping[str, str] | None = None,
                 soc: str | None = None) -> None:
        if soc not in (None, v.SOC_A2, v.SOC_A3):
            raise md.InvalidSpecError("is not an Atlas chip this plugin knows", parameter="soc", value=soc,
                                      allowed=f"None, {v.SOC_A2!r}, {v.SOC_A3!r}")
        self.vendor_module = vendor_module
        self.env = env
        self.soc_override = soc
        self.capabilities = capabilities(vendor_module != v.REAL)

    def _env(self) -> Mapping[str, str]:
        return os.environ if self.env is None else self.env

    def vendor(self) -> v.VendorInfo:
        return v.detect(self.vendor_module)

    def soc(self) -> str | None:
        """The chip: the override, else what torch_npu says (the fakes' on CPU; the real one only when
        this process has imported it, never importing it here), else None (unknown)."""
        if self.soc_override is not None:
            return self.soc_override
        if self.vendor_module != v.REAL:
            return v.current_soc(importlib.import_module(v.TORCH_NPU_FAKE))
        module = sys.modules.get(v.TORCH_NPU)
        return None if module is None else v.current_soc(module)

    def probe(self) -> str | None:
        info = self.vendor()
        if info.module is None or not info.is_ascend or not info.supported:
            return info.describe()
        if not info.emulated:
            import torch

            if not (hasattr(torch, "npu") and torch.npu.is_available()):
                return "no Ascend NPU (torch.npu is not available)"
        return None

    def check_spec(self, spec: md.DispatchSpec, world_size: int) -> None:
        if not v.MIN_EP_WORLD_SIZE <= world_size <= v.MAX_EP_WORLD_SIZE_LL:  # before the core's long list
            raise md.InvalidSpecError("DeepEP-Ascend's ops take 2..768 ranks", parameter="world_size",
                                      value=world_size, allowed=f"{v.MIN_EP_WORLD_SIZE}..{v.MAX_EP_WORLD_SIZE_LL}")
        super().check_spec(spec, world_size)  # normal mode: Limits.world_sizes = get_dispatch_config's map
        if spec.num_experts > MAX_EXPERTS:
            raise md.InvalidSpecError("DeepEP-Ascend handles at most 512 experts", parameter="num_experts",
                                      value=spec.num_experts, allowed=f"1..{MAX_EXPERTS}")
        if spec.mode is LL and v.is_layered(self._env()) and spec.top_k < v.A2_LAYERED_MIN_TOP_K:
            raise md.InvalidSpecError("A2 layered (two-node) low-latency kernels take top-k 2..16", parameter="top_k",
                                      value=spec.top_k, allowed=f"{v.A2_LAYERED_MIN_TOP_K}..{v.MAX_TOP_K}")
        a2_limits(spec, world_size, self.soc())

    def _window_bytes(self, spec: md.DispatchSpec, world_size: int) -> int:
        return sizes.required_window_bytes(spec.mode, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                           world_size, spec.num_experts, spec.top_k, self._env(), self.soc())

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> md.BufferSize:
        T, h = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size
        rows = v.ll_receive_rows(T, world_size, spec.local_experts(world_size), spec.top_k)
        window = self._window_bytes(spec, world_size)
        dispatch, combine = rows * spec.wire_format().bytes_per_token, rows * 2 * h
        # Low-latency rows live in the window; normal mode's received rows are tensors the C++
        # allocates beside it (its window only stages rounds), so there the parts add up.
        shared = window if window >= max(dispatch, combine) else None
        return md.BufferSize(
            dispatch, combine,
            notes=(f"HCCL window (HCCL_BUFFSIZE) >= {v.window_mb(window)} MB: what DeepEP-Ascend's ops check",),
            allocated_bytes=shared,
        )

    def env_requirements(self, spec: md.DispatchSpec, world_size: int) -> tuple[md.EnvRequirement, ...]:
        """HCCL_BUFFSIZE (MB) that ``create`` checks: what DeepEP-Ascend's ops check for this spec on this
        chip (where the chip is unknown, the largest over Atlas A2 and A3)."""
        soc = self.soc()
        where = "the ops' tiling check" + (" on either chip (A2 or A3: not known here)" if soc is None else
                                           f" on Atlas {soc}")
        return (md.EnvRequirement(v.HCCL_BUFFSIZE, v.window_mb(self._window_bytes(spec, world_size)), "MB",
                                  v.DEFAULT_HCCL_BUFFSIZE_MB, f"DeepEP-Ascend's HCCL window ({where})"),)

    def _construct(self, info: v.VendorInfo, process_group: Any, low_latency: bool) -> Any:
        """``Buffer(...)`` with the construction-time environment pinned (restored afterwards)."""
        assert info.module is not None
        with restored_environ(CONSTRUCTION_ENV):
            for name in CONSTRUCTION_UNSET:
                os.environ.pop(name, None)
            return info.module.Buffer(process_group, low_latency_mode=low_latency)

    def create(self, ctx: md.DispatchContext) -> AscendDeepEPDispatcher:
        spec, R = ctx.spec, ctx.world_size
        (window,) = self.env_requirements(spec, R)  # what `moe-dispatch plan` reports is what is checked
        sizes.check_hccl_window(window.minimum, self._env())
        info = self.vendor()
        buffer = ctx.options.get("buffer")
        if buffer is None:
            if not info.supported:
                raise md.BackendUnavailableError(info.describe(), parameter="vendor_module", value=self.vendor_module,
                                                 allowed=f"DeepEP-Ascend from {v.KN}@0ac00159 on")
            if not info.emulated:  # the fakes run on gloo; the vendor needs the group's HCCL communicator
                check_hccl_group(ctx.comm.process_group)
            buffer = self._construct(info, ctx.comm.process_group, spec.mode is LL)
        return AscendDeepEPDispatcher(ctx, buffer, info.has_quant_mode, info.ll_quant_mode)
