"""The ``ascend_deepep`` backend: capabilities, limits, the HCCL window, and the adapter."""

from __future__ import annotations

import os
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
        # The ops' tiling needs at least 2 ranks; normal mode narrows this further (check_spec).
        world_sizes=frozenset(range(v.MIN_EP_WORLD_SIZE, v.MAX_EP_WORLD_SIZE_LL + 1)),
        limits={N: md.Limits(max_tokens_per_rank=v.NORMAL_MAX_TOKENS, hidden_multiple=v.HIDDEN_MULTIPLE,
                             min_hidden=v.MIN_HIDDEN, max_hidden=v.MAX_HIDDEN, max_top_k=v.MAX_TOP_K), LL: ll},
    )


class AscendDeepEPBackend(md.Backend):
    """DeepEP-Ascend (sgl-kernel-npu) ``Buffer`` on Atlas A2/A3, or with ``vendor_module=vendor.FAKE``
    its CPU fake. ``env`` is what the HCCL window variables are read from (``os.environ`` when
    None), never written; the vendor itself reads the process environment."""

    name = "ascend_deepep"
    description = "DeepEP-Ascend Buffer: normal and low-latency modes, BF16 or per-token INT8, HCCL window"
    install_hint = v.INSTALL_HINT

    def __init__(self, vendor_module: str = v.REAL, env: Mapping[str, str] | None = None) -> None:
        self.vendor_module = vendor_module
        self.env = env
        self.capabilities = capabilities(vendor_module != v.REAL)

    def _env(self) -> Mapping[str, str]:
        return os.environ if self.env is None else self.env

    def vendor(self) -> v.VendorInfo:
        return v.detect(self.vendor_module)

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
        super().check_spec(spec, world_size)
        if spec.num_experts > MAX_EXPERTS:
            raise md.InvalidSpecError("DeepEP-Ascend handles at most 512 experts", parameter="num_experts",
                                      value=spec.num_experts, allowed=f"1..{MAX_EXPERTS}")
        if spec.mode is N and world_size not in v.CONFIG_RANKS:
            raise md.InvalidSpecError(
                "DeepEP-Ascend's normal dispatch/combine assert the EP size is in get_dispatch_config's map",
                parameter="world_size", value=world_size, allowed=", ".join(map(str, v.CONFIG_RANKS)))
        if spec.mode is LL and v.is_layered(self._env()) and spec.top_k < v.A2_LAYERED_MIN_TOP_K:
            raise md.InvalidSpecError("A2 layered (two-node) low-latency kernels take top-k 2..16", parameter="top_k",
                                      value=spec.top_k, allowed=f"{v.A2_LAYERED_MIN_TOP_K}..{v.MAX_TOP_K}")

    def _window_bytes(self, spec: md.DispatchSpec, world_size: int) -> int:
        return sizes.required_window_bytes(spec.mode, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                           world_size, spec.num_experts, spec.top_k, self._env())

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
        """HCCL_BUFFSIZE (MB) that ``create`` checks: what DeepEP-Ascend's ops check for this spec."""
        return (md.EnvRequirement(v.HCCL_BUFFSIZE, v.window_mb(self._window_bytes(spec, world_size)), "MB",
                                  v.DEFAULT_HCCL_BUFFSIZE_MB, "DeepEP-Ascend's HCCL window (the ops' tiling check)"),)

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
            buffer = self._construct(info, ctx.comm.process_group, spec.mode is LL)
        return AscendDeepEPDispatcher(ctx, buffer, info.has_quant_mode, info.ll_quant_mode)
