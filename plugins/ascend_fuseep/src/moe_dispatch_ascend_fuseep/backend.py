"""The ``ascend_fuseep`` backend: ``fused_deep_moe`` as the fused forward, DeepEP-Ascend's
low-latency INT8 dispatch/combine as the unfused path, W8A8 only."""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any, Mapping

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch_ascend_deepep.backend import AscendDeepEPBackend
from moe_dispatch_ascend_deepep.dispatcher import AscendDeepEPDispatcher
from moe_dispatch_ascend_deepep import vendor as deepep_vendor

from . import vendor as v
from .weights import FuseEPWeights, check_fuse_mode, process_fuseep_weights

B, F8, I8, F4 = md.DispatchDtype.BF16, md.DispatchDtype.FP8, md.DispatchDtype.INT8, md.DispatchDtype.NVFP4
LL = md.Mode.LOW_LATENCY
#: The fused op's batch 1..256 and top-k <= 12 (vendor); H from 1024, the unfused low-latency
#: path's lower bound (the fused op alone takes 512..7168).
MAX_TOKENS, MIN_HIDDEN, MAX_HIDDEN, MAX_TOP_K = v.MAX_BATCH, deepep_vendor.MIN_HIDDEN, v.MAX_HIDDEN, v.MAX_TOP_K


def capabilities(emulated: bool) -> mdb.Capabilities:
    return mdb.Capabilities(
        dtypes={LL: frozenset({I8})},
        fallbacks={(LL, F8): mdb.Fallback(I8, "Atlas A3 has no FP8; FuseEP quantizes to INT8 per token")},
        rejections={B: "FuseEP's fused op is W8A8 INT8 dynamic only (use ascend_deepep for BF16)",
                    F4: "FuseEP's fused op is W8A8 INT8 dynamic only"},
        default_dtype=I8,
        fused_forward=True,
        masked_modes=frozenset(),  # the unfused path is ascend_deepep's: PACKED
        devices=frozenset({"cpu"} if emulated else {"npu"}),
        world_sizes=frozenset(range(deepep_vendor.MIN_EP_WORLD_SIZE, deepep_vendor.MAX_EP_WORLD_SIZE_LL + 1)),
        limits={LL: mdb.Limits(max_tokens_per_rank=MAX_TOKENS, hidden_multiple=deepep_vendor.HIDDEN_MULTIPLE,
                              min_hidden=MIN_HIDDEN, max_hidden=MAX_HIDDEN, max_top_k=MAX_TOP_K)},
    )


def nz_cast(torch_npu: Any, t: torch.Tensor) -> torch.Tensor:
    """FRACTAL_NZ (format 29), the one weight step that needs the NPU: refused for weights elsewhere (torch_npu's
    cast has no CPU kernel) and where torch_npu gave ND instead (``vendor.ALLOW_INTERNAL_FORMAT`` off), which the
    fused ops would refuse (mode 1) or read as NZ (mode 2)."""
    if t.device.type != "npu" and torch_npu.__name__ == v.TORCH_NPU:
        raise md.InvalidSpecError("FuseEP lays out the weights on the NPU (npu_format_cast has no CPU kernel)",
                                  parameter="weights", value=f"on {t.device}", allowed="tensors on the NPU")
    out = torch_npu.npu_format_cast(t, v.ACL_FORMAT_FRACTAL_NZ)
    got = torch_npu.get_npu_format(out)
    if got != v.ACL_FORMAT_FRACTAL_NZ:
        raise md.InvalidSpecError(
            f"torch_npu gave the weights ACL format {got}, not FRACTAL_NZ ({v.ACL_FORMAT_FRACTAL_NZ}): FuseEP's fused "
            "ops read them as NZ", parameter=v.ALLOW_INTERNAL_FORMAT, value=False,
            allowed="True, set before process_weights (as sglang's init_npu_backend and the vendor's tests do)")
    return out


def fill_minus_one(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, rows: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each ``-1`` id (in ``rows`` only, when given) replaced by an expert that token does not already use,
    in increasing id, with weight 0: the fused op computes that row and combine adds ``0·y``, so the
    result is the one the -1 asked for, without the host read a refusal would need. A token has k <= E
    slots, so there are enough unused experts; each still reaches a rank at most min(k, E_local) times,
    inside mode 2's row bound."""
    holes = ids < 0
    if rows is not None:
        holes = holes & rows.unsqueeze(1)
    used = torch.zeros(ids.shape[0], num_experts + 1, dtype=torch.bool, device=ids.device)
    used.scatter_(1, torch.where(ids >= 0, ids, num_experts), True)
    free_first = torch.argsort(used[:, :num_experts].to(torch.int8), dim=1, stable=True)  # unused experts first
    nth_hole = (torch.cumsum(holes.to(torch.int64), dim=1) - 1).clamp_min(0)
    filled = torch.gather(free_first, 1, nth_hole).to(ids.dtype)
    return torch.where(holes, filled, ids), torch.where(holes, torch.zeros_like(weights), weights)


class FuseEPDispatcher(AscendDeepEPDispatcher):
    """The unfused path, plus what this dispatcher's fused forward passes."""

    fuse_mode: int = v.FUSED_DEEP_MOE
    max_output_size: int | None = None  # fuse mode 2's row bound
    #: The NZ weight cast of the real torch_npu (None on the fake: ND layouts).
    nz_cast: Any = None

    def process_weights(self, weights: Any) -> FuseEPWeights:
        """The fused op's layout of this rank's W8A8 experts for this dispatcher's fuse mode; in mode 2 with the
        per-call workspace it needs at the capacity (``FuseEPWeights.workspace_bytes``)."""
        spec = self.spec
        return process_fuseep_weights(weights, self.fuse_mode, self.nz_cast, max_output_size=self.max_output_size,
                                      tokens=spec.num_max_dispatch_tokens_per_rank, top_k=spec.top_k,
                                      world_size=spec.num_experts // self.local_experts)

    def fused_forward(self, layer: Any, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        if not isinstance(layer, FuseEPWeights) or layer.fuse_mode != self.fuse_mode:
            got = f"FuseEPWeights for fuse mode {layer.fuse_mode}" if isinstance(layer, FuseEPWeights) else \
                type(layer).__name__
            raise md.InvalidInputError("needs the layer process_weights made for this dispatcher", parameter="layer",
                                       value=got, allowed=f"FuseEPWeights for fuse mode {self.fuse_mode}")
        spec = self.spec
        x = hidden_states.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.float().contiguous()
        n = x.shape[0]
        if n == 0:  # the op takes batch 1..256 and is a collective: one zero-weight row joins it
            x = x.new_zeros(1, x.shape[1])
            ids = torch.arange(spec.top_k, device=ids.device, dtype=ids.dtype).unsqueeze(0)
            weights = weights.new_zeros(1, spec.top_k)
        else:  # -1 ids: mode 2 takes none, mode 1 none in a token without a valid expert (vendor.MINUS_ONE_*)
            only = None if self.fuse_mode in v.MINUS_ONE_UNSUPPORTED_MODES else (ids < 0).all(dim=1)
            ids, weights = fill_minus_one(ids, weights, spec.num_experts, only)
        bound = spec.num_max_dispatch_tokens_per_rank if self.fuse_mode == v.FUSED_DEEP_MOE else self.max_output_size
        out, _ = self.buffer.fused_deep_moe(x, ids, weights, layer.gmm1_permuted_weight,
                                            layer.gmm1_permuted_weight_scale, layer.gmm2_weight,
                                            layer.gmm2_weight_scale, bound, spec.num_experts, quant_mode=v.QUANT_INT8,
                                            fuse_mode=self.fuse_mode)
        return out[:n]


class FuseEPBackend(AscendDeepEPBackend):
    """Options (``create_dispatcher(options=...)``): ``fuse_mode`` 1 (fused_deep_moe, the default)
    or 2 (dispatch_ffn_combine), an explicit option, never an environment variable; with mode 2,
    ``max_output_size``: the rows one rank may receive, which the op sizes its per-call workspace by
    (about ``max_output_size·(8 + 5I + 3H)`` bytes; default and least ``T·R·min(k, E_local)``, what can arrive;
    the vendor's tests pass ``T·R·k``)."""

    name = "ascend_fuseep"
    engine_sizing = "as ascend_deepep (sglang's FuseEP path also fixes params_bytes = 2)."
    description = "Ascend FuseEP: dispatch, GMM1, SwiGLU, GMM2 and combine in one op (W8A8, Atlas A3)"

    def __init__(self, vendor_module: str = v.REAL, env: Mapping[str, str] | None = None,
                 torch_npu_module: str | None = None) -> None:
        super().__init__(vendor_module, env, torch_npu_module=torch_npu_module)
        self.capabilities = capabilities(vendor_module != v.REAL)

    def probe(self) -> str | None:
        """ascend_deepep's (its supported floor, fused_deep_moe with fuse_mode from KN@0ac00159, is this
        plugin's too), and the chip: an Atlas A2 build of DeepEP-Ascend has no fused ops."""
        reason = super().probe()
        if reason is None and self.soc() not in (None, *v.FUSED_OPS_SOCS):
            return (f"FuseEP needs Atlas A3: this is an Atlas {self.soc()}, whose DeepEP-Ascend build (csrc/deepep/"
                    "ops2) has no FusedDeepMoe / DispatchFFNCombine op; use ascend_deepep with the npu_w8a8 runner")
        return reason

    def _creation_soc(self) -> str:
        """A chip torch_npu cannot name is an A3 here: the fused ops exist on A3 only (an A2 fails them anyway),
        and A3 deployments set HCCL_OP_EXPANSION_MODE, which ascend_deepep refuses on A2."""
        return self.soc() or deepep_vendor.SOC_A3

    def window_needed_mb(self, spec: md.DispatchSpec, world_size: int, soc: str | None) -> int:
        """The largest of the unfused path's and both fused ops' window checks (MB): what env_requirements
        reports (on the variable the ops read) and create checks against the ops' and the group's windows."""
        T, h = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size
        fused = max(v.fused_deep_moe_window_bytes(T, world_size, spec.local_experts(world_size), h),
                    v.dispatch_ffn_combine_window_bytes(T, spec.top_k, h))
        return max(super().window_needed_mb(spec, world_size, soc), v.window_mb(fused))

    def agreement(self, ctx: mdb.DispatchContext) -> Mapping[str, Any]:
        """ascend_deepep's, and the fuse mode and its bound: they pick the collective op (aclnnFusedDeepMoe or
        aclnnDispatchFFNCombine) and its workspace, so ranks that differ would wait in different ops."""
        fuse_mode, max_output = self.check_options(ctx.spec, ctx.options, ctx.world_size)
        return {**super().agreement(ctx), "fuse_mode": fuse_mode, "max_output_size": max_output}

    def check_options(self, spec: md.DispatchSpec, options: Mapping[str, Any],
                      world_size: int | None = None) -> tuple[int, int | None]:
        """``(fuse_mode, max_output_size)`` from the options, or a typed error naming the option."""
        fuse_mode = check_fuse_mode(options.get("fuse_mode", v.FUSED_DEEP_MOE))
        raw = options.get("max_output_size")
        if fuse_mode == v.FUSED_DEEP_MOE or world_size is None:
            if raw is not None and fuse_mode == v.FUSED_DEEP_MOE:
                raise md.InvalidSpecError("applies to fuse mode 2 only", parameter="max_output_size", value=raw,
                                          allowed="None with fuse_mode=1")
            return fuse_mode, None
        T = spec.num_max_dispatch_tokens_per_rank
        least = v.mode2_min_output_rows(T, world_size, spec.local_experts(world_size), spec.top_k)
        rows = least if raw is None else raw
        if not isinstance(rows, int) or isinstance(rows, bool) or not least <= rows < v.MODE2_ATTR_LIMIT:
            raise md.InvalidSpecError("fuse mode 2 sizes its workspace by the rows one rank receives (an int32 attribute)",
                                      parameter="max_output_size", value=raw,
                                      allowed=f"an int in {least}..{v.MODE2_ATTR_LIMIT - 1} (from T·R·min(k, E_local))")
        return fuse_mode, rows

    def _check_fused_op(self, spec: md.DispatchSpec, world_size: int, fuse_mode: int) -> None:
        """What the fused op's tiling refuses at the first call, refused here: mode 1 takes at most half the
        device's vector cores of local experts; mode 2 on a build before ``vendor.MODE2_DEEPEP_WINDOW_SINCE``
        sees HCCL_BUFFSIZE only."""
        if fuse_mode == v.FUSED_DEEP_MOE:
            cores = self._vector_cores()
            local = spec.local_experts(world_size)
            if local > cores // v.MODE1_AIV_PER_LOCAL_EXPERT:
                raise md.InvalidSpecError(
                    f"fused_deep_moe (fuse mode 1) runs two vector cores per local expert; this device has {cores}",
                    parameter="num_experts", value=spec.num_experts,
                    allowed=f"at most {cores // v.MODE1_AIV_PER_LOCAL_EXPERT * world_size} over {world_size} ranks, "
                            "or fuse_mode=2")
            return
        env, reads_deepep = self._env(), self.vendor().has_quant_mode
        name, window = v.mode2_window_mb(env, reads_deepep)
        need = v.window_mb(v.dispatch_ffn_combine_window_bytes(spec.num_max_dispatch_tokens_per_rank, spec.top_k,
                                                               spec.hidden_size))
        if window < need:
            why = "" if reads_deepep else (f" (this DeepEP-Ascend, before {v.KN}@{v.MODE2_DEEPEP_WINDOW_SINCE}, reads "
                                           f"only {v.HCCL_BUFFSIZE} in fuse mode 2)")
            raise md.InvalidSpecError(f"fuse mode 2's tiling sees a {window} MB window{why}", parameter=name,
                                      value=env.get(name), allowed=f">= {need} (MB)")

    def _vector_cores(self) -> int:
        """The device's vector cores as torch_npu reports them (``vendor.A3_VECTOR_CORES`` where it cannot)."""
        module = self._torch_npu()
        try:
            return int(module.npu.get_device_limit(module.npu.current_device())[v.VECTOR_CORE_KEY])
        except Exception:  # noqa: BLE001 - no device or an older torch_npu: Atlas A3's count
            return v.A3_VECTOR_CORES

    def _torch_npu(self) -> Any:
        """torch_npu (a stand-in's module by name), or None where it is not importable."""
        try:
            return importlib.import_module(self.torch_npu_module)
        except ImportError:
            return None

    def env_requirements(self, spec: md.DispatchSpec, world_size: int) -> tuple[mdb.EnvRequirement, ...]:
        """ascend_deepep's, and on a build whose fuse mode 2 reads HCCL_BUFFSIZE only, HCCL_BUFFSIZE for it when
        DEEPEP_HCCL_BUFFSIZE stands in for the others."""
        base = super().env_requirements(spec, world_size)
        if self.vendor().has_quant_mode or self._env().get(v.DEEPEP_HCCL_BUFFSIZE) is None:
            return base
        need = v.window_mb(v.dispatch_ffn_combine_window_bytes(spec.num_max_dispatch_tokens_per_rank, spec.top_k,
                                                               spec.hidden_size))
        return (*base, mdb.EnvRequirement(v.HCCL_BUFFSIZE, need, "MB", v.DEFAULT_HCCL_BUFFSIZE_MB,
                                          f"fuse mode 2's window on this DeepEP-Ascend (before "
                                          f"{v.KN}@{v.MODE2_DEEPEP_WINDOW_SINCE}: it reads HCCL_BUFFSIZE only)"))

    def create(self, ctx: mdb.DispatchContext) -> FuseEPDispatcher:
        fuse_mode, max_output = self.check_options(ctx.spec, ctx.options, ctx.world_size)
        soc, module = self.soc(), self._torch_npu()
        if soc not in (None, *v.FUSED_OPS_SOCS) or (soc is None and module is not None):
            chip = soc and f"an Atlas {soc}" or _chip_name(module)
            raise md.BackendUnavailableError(
                f"FuseEP's fused ops are built for Atlas A3 only (op definitions AddConfig(\"ascend910_93\")); this is "
                f"{chip} (an A2 build, csrc/deepep/ops2, has neither op; A5's fused_deep_moe takes MX weights)",
                parameter="backend", value=soc or chip,
                allowed="Atlas A3; on A2 use ascend_deepep with the npu_w8a8 runner")
        self._check_fused_op(ctx.spec, ctx.world_size, fuse_mode)
        base = super().create(ctx)
        d = FuseEPDispatcher(ctx, base.buffer, base.has_quant_mode, base.ll_quant_mode)
        d.fuse_mode, d.max_output_size = fuse_mode, max_output
        d.nz_cast = None if self.vendor().emulated else partial(nz_cast, module)
        return d


def _chip_name(torch_npu: Any) -> str:
    """What torch_npu calls the chip, for a message."""
    try:
        return f"{torch_npu.npu.get_device_name()} (SoC code {torch_npu.npu.get_soc_version()})"
    except Exception:  # noqa: BLE001 - no device
        return "a chip torch_npu cannot name"
