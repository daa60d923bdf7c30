"""The ``ascend_deepep`` backend: capabilities, limits, the HCCL window, and the adapter."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Mapping

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import restored_environ

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
#: ``create_dispatcher(options={WINDOW_OPTION: N})``: the group's HCCL window in MB, for a group whose options
#: cannot be read (where they can, a different value is an error).
WINDOW_OPTION = "hccl_window_mb"
#: The environment that decides the Buffer, its windows and which kernels run: equal on every rank (agreement).
AGREED_ENV = (v.HCCL_BUFFSIZE, v.DEEPEP_HCCL_BUFFSIZE, v.INTRA_PCIE_ENV, v.INTRA_ROCE_ENV, v.OP_EXPANSION_ENV)


def capabilities(emulated: bool) -> mdb.Capabilities:
    no_fp8 = "Atlas A2/A3 have no FP8; DeepEP-Ascend quantizes to INT8 (per token) instead"
    ll = mdb.Limits(max_tokens_per_rank=v.LL_MAX_TOKENS, hidden_multiple=v.HIDDEN_MULTIPLE, min_hidden=v.MIN_HIDDEN,
                   max_hidden=v.MAX_HIDDEN, max_top_k=v.MAX_TOP_K)
    return mdb.Capabilities(
        dtypes={N: frozenset({B, I8}), LL: frozenset({B, I8})},
        fallbacks={(N, F8): mdb.Fallback(I8, no_fp8), (LL, F8): mdb.Fallback(I8, no_fp8)},
        rejections={F4: "Atlas A2/A3 have no FP4 dispatch (MXFP4 is A5-only and not NVFP4)"},
        default_dtype=B,
        masked_modes=frozenset(),  # both modes PACKED: low latency hands over the counted prefix (dispatcher.py)
        devices=frozenset({"cpu"} if emulated else {"npu"}),
        # The ops' tiling needs at least 2 ranks; normal mode runs only on get_dispatch_config's sizes.
        world_sizes=frozenset(range(v.MIN_EP_WORLD_SIZE, v.MAX_EP_WORLD_SIZE_LL + 1)),
        limits={N: mdb.Limits(max_tokens_per_rank=v.NORMAL_MAX_TOKENS, hidden_multiple=v.HIDDEN_MULTIPLE,
                             min_hidden=v.MIN_HIDDEN, max_hidden=v.MAX_HIDDEN, max_top_k=v.MAX_TOP_K,
                             world_sizes=frozenset(v.CONFIG_RANKS)), LL: ll},
    )


def check_a2_hccl_options(env: Mapping[str, str], hccl_config: Mapping[str, Any] | None, soc: str,
                          assumed: bool = False) -> None:
    """``HCCL_OP_EXPANSION_MODE`` must be unset on Atlas A2 with DeepEP-Ascend (the vendor's README and
    A2_DEEPEP.md: "unknown operator errors"); torch_npu also sets it per group (``hccl_config`` key
    ``hccl_op_expansion_mode``). An A3 is not limited. ``assumed``: the chip could not be read, ``soc`` is
    the backend's assumption (A2 for ascend_deepep, the stricter)."""
    if soc == v.SOC_A3:
        return
    why = "DeepEP-Ascend's README: HCCL_OP_EXPANSION_MODE must be disabled on Atlas A2 (unknown operator errors)" + (
        "; the chip is not known here, so the A2 rule applies" if assumed else "")
    if env.get(v.OP_EXPANSION_ENV):
        raise md.InvalidSpecError(f"{why}: unset it before the process group starts", parameter=v.OP_EXPANSION_ENV,
                                  value=env[v.OP_EXPANSION_ENV], allowed="unset on Atlas A2")
    if hccl_config is not None and hccl_config.get(v.HCCL_OP_EXPANSION_KEY) is not None:
        raise md.InvalidSpecError(f"{why}: the group was created with hccl_config[{v.HCCL_OP_EXPANSION_KEY!r}]",
                                  parameter="process_group",
                                  value=f"{v.HCCL_OP_EXPANSION_KEY}={hccl_config[v.HCCL_OP_EXPANSION_KEY]!r}",
                                  allowed=f"a group without {v.HCCL_OP_EXPANSION_KEY} on Atlas A2")


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


def a2_limits(spec: md.DispatchSpec, world_size: int, soc: str | None, env: Mapping[str, str] | None = None,
              max_top_k: int = v.A2_INTERNODE_MAX_TOP_K) -> None:
    """Atlas A2 limits beyond the declared capabilities (vendor.A2_*): more than 8 ranks take
    DeepEP-Ascend's internode paths. An A3 that is known to be one is not limited. ``soc`` None
    (planning without the chip): the tiling limits common to the internode ops (R in whole nodes up to
    256, T <= 4096, top-k >= 2); ``"A2"`` also what the normal internode kernels need (exactly 16 ranks:
    they exchange with one peer server, BF16, top-k <= ``max_top_k``: 10 on builds that may predate
    KN@7a396def) and,
    with ``env`` (creation: where the HCCL variables are read), the layered variables. ``create`` takes
    a chip torch_npu cannot name as A2. ``spec.output_dtype`` None (auto) is checked again resolved, in
    ``create``."""
    if soc == v.SOC_A3 or world_size <= v.A2_MAX_HCCS_PEERS:
        return
    why = "on Atlas A2 (ASCEND910B), more than 8 ranks take DeepEP-Ascend's internode kernels" + (
        "; the chip is not known here, so the A2 bound applies (it does not on A3)" if soc is None else "")
    if world_size % v.A2_INTERNODE_EP_MULTIPLE or world_size > v.A2_INTERNODE_MAX_EP:
        raise md.InvalidSpecError(f"{why}, which take 8..256 ranks in whole nodes of 8", parameter="world_size",
                                  value=world_size, allowed=f"multiples of 8 up to {v.A2_INTERNODE_MAX_EP}")
    normal, T = spec.mode is N, spec.num_max_dispatch_tokens_per_rank
    if spec.top_k < v.A2_LAYERED_MIN_TOP_K:
        raise md.InvalidSpecError(f"{why}, which take top-k 2..16", parameter="top_k", value=spec.top_k,
                                  allowed=f"{v.A2_LAYERED_MIN_TOP_K}..{v.MAX_TOP_K}")
    if normal and T > v.A2_INTERNODE_MAX_TOKENS:
        raise md.CapacityError(f"{why}, whose normal dispatch takes at most 4096 tokens per rank",
                               parameter="num_max_dispatch_tokens_per_rank", value=T,
                               allowed=f"1..{v.A2_INTERNODE_MAX_TOKENS}")
    if soc != v.SOC_A2 or not normal:  # planning without the chip; low latency's limits end here
        return
    if world_size != v.A2_INTERNODE_NORMAL_RANKS:
        raise md.InvalidSpecError(
            f"{why}; normal mode's kernels (aclnnNotifyDispatchA2, MoeDistributeCombineA2) exchange with exactly one "
            "peer server, (1 - serverId)·8 + localRank: two 8-NPU servers (the vendor's 'A2 Dual Node'), although "
            "the notify tiling takes up to 64 ranks", parameter="world_size", value=world_size,
            allowed=f"2..8, or {v.A2_INTERNODE_NORMAL_RANKS} (two 8-NPU nodes; low latency: multiples of 8 up to "
            f"{v.A2_INTERNODE_MAX_EP})")
    if spec.top_k > max_top_k:
        old = " (builds before KN@7a396def, which this one may be: it has no low_latency_dispatch(quant_mode=))" \
            if max_top_k < v.A2_INTERNODE_MAX_TOP_K else ""
        raise md.InvalidSpecError(f"{why}, whose normal dispatch takes top-k {v.A2_LAYERED_MIN_TOP_K}..{max_top_k}"
                                  f"{old}", parameter="top_k", value=spec.top_k,
                                  allowed=f"{v.A2_LAYERED_MIN_TOP_K}..{max_top_k}")
    if spec.output_dtype in (I8, F8):
        via = " (FP8 falls back to INT8 here)" if spec.output_dtype is F8 else ""
        raise md.InvalidSpecError(
            f"{why}, which have no INT8 kernel{via}: DispatchNormalA2's tiling key for quant mode 2 (2000001002, "
            "2100001002 layered) has no kernel (dispatch_normal_a2.cpp builds BF16 only); the vendor's README: "
            "'Normal mode does NOT support quantization' on A2 dual node", parameter="output_dtype",
            value=spec.output_dtype.value, allowed="bf16 (or low-latency mode for INT8)")
    if env is not None and not v.is_layered(env):
        raise md.InvalidSpecError(
            f"{why}, whose combine (MoeDistributeCombineA2) has a kernel only for the layered tiling key 3000: "
            f"export {v.INTRA_PCIE_ENV}=1 and {v.INTRA_ROCE_ENV}=0 on every rank before the process group starts "
            "(the vendor's README: 'A2 Dual Node: Must set')", parameter=f"{v.INTRA_PCIE_ENV}/{v.INTRA_ROCE_ENV}",
            value=f"{env.get(v.INTRA_PCIE_ENV)}/{env.get(v.INTRA_ROCE_ENV)}", allowed="1/0")


class AscendDeepEPBackend(mdb.Backend):
    """DeepEP-Ascend (sgl-kernel-npu) ``Buffer`` on Atlas A2/A3, or, named by ``vendor_module`` and
    ``torch_npu_module``, stand-ins of both (the CPU fakes of moe-dispatch-ascend-deepep-testing). ``env``
    is what the HCCL variables are read from (``os.environ`` when None), never written; the vendor itself
    reads the process environment. ``soc`` (``"A2"`` or ``"A3"``) names the chip for planning elsewhere;
    by default it is read from torch_npu where this process has it (on the NPU; a stand-in is imported),
    and where it cannot be known the window and limits are the safe bound over both chips. The group's
    HCCL window is read from its options at creation (``options={"hccl_window_mb": N}`` states it for a
    group whose options cannot be read)."""

    name = "ascend_deepep"
    engine_sizing = ("sglang sizes nothing here: memory is the HCCL window, HCCL_BUFFSIZE (default 200 MB); the total "
                     "is DeepEP-Ascend's documented minimum, BF16 rows both ways whatever the dtype.")
    description = "DeepEP-Ascend Buffer: normal and low-latency modes, BF16 or per-token INT8, HCCL window"
    install_hint = v.INSTALL_HINT
    vendor_environment = v.READ_ENVIRONMENT

    def __init__(self, vendor_module: str = v.REAL, env: Mapping[str, str] | None = None,
                 soc: str | None = None, torch_npu_module: str | None = None) -> None:
        if soc not in (None, v.SOC_A2, v.SOC_A3):
            raise md.InvalidSpecError("is not an Atlas chip this plugin knows", parameter="soc", value=soc,
                                      allowed=f"None, {v.SOC_A2!r}, {v.SOC_A3!r}")
        if torch_npu_module is None and vendor_module != v.REAL:  # a stand-in Buffer beside the real torch_npu would
            raise md.InvalidSpecError(  # plan for a chip and an HCCL window that are not the stand-in's
                "a stand-in deep_ep needs the torch_npu it runs with", parameter="torch_npu_module", value=None,
                allowed=f"the module name of the stand-in torch_npu (vendor_module is {vendor_module!r})")
        self.vendor_module = vendor_module
        #: Where the chip and the groups' HCCL options are read: torch_npu, or a stand-in module's name.
        self.torch_npu_module = v.TORCH_NPU if torch_npu_module is None else torch_npu_module
        self.env = env
        self.soc_override = soc
        self.capabilities = capabilities(vendor_module != v.REAL)

    def _env(self) -> Mapping[str, str]:
        return os.environ if self.env is None else self.env

    def vendor(self) -> v.VendorInfo:
        return v.detect(self.vendor_module)

    def soc(self) -> str | None:
        """The chip: the override, else what torch_npu says (a stand-in's, imported; the real one only
        when this process has imported it, never importing it here), else None (unknown)."""
        if self.soc_override is not None:
            return self.soc_override
        if self.torch_npu_module != v.TORCH_NPU:
            return v.current_soc(importlib.import_module(self.torch_npu_module))
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
        soc = self.soc()
        a2_limits(spec, world_size, soc, None, self._internode_top_k())  # the environment: at creation
        self._check_normal_op_tokens(spec, world_size, soc, soc)

    def _check_normal_op_tokens(self, spec: md.DispatchSpec, world_size: int, need_soc: str | None,
                                bound_soc: str | None) -> None:
        """Normal mode on the normal dispatch op: refuse a spec no ops' window holds below the op's 32-bit
        data-offset bound (``sizes.normal_op_bound``), naming the largest tokens per rank that fit."""
        if spec.mode is not N or sizes.is_a2_internode(N, world_size, need_soc):
            return
        most = sizes.normal_op_max_tokens(spec, world_size, self._env(), need_soc, bound_soc)
        if most is not None:
            raise md.CapacityError(
                "DeepEP-Ascend's normal dispatch op keeps its second-half data offset (half the window plus "
                "T·k·ceil512(2H)) in a uint32: no window this spec needs stays below it; lower the tokens per rank "
                "(or top-k)", parameter="num_max_dispatch_tokens_per_rank",
                value=spec.num_max_dispatch_tokens_per_rank, allowed=f"1..{most}")

    def _internode_top_k(self) -> int:
        """The A2 internode dispatch's top-k limit on this build: 16 since KN@7a396def, seen from Python as
        low_latency_dispatch(quant_mode=) (KN@f451a596, later); 10 where the build may be older or unknown."""
        return v.A2_INTERNODE_MAX_TOP_K if self.vendor().ll_quant_mode else v.A2_INTERNODE_MAX_TOP_K_OLD

    def _window_bytes(self, spec: md.DispatchSpec, world_size: int, soc: str | None = None) -> int:
        return sizes.required_window_bytes(spec.mode, spec.num_max_dispatch_tokens_per_rank, spec.hidden_size,
                                           world_size, spec.num_experts, spec.top_k, self._env(), soc or self.soc())

    def window_needed_mb(self, spec: md.DispatchSpec, world_size: int, soc: str | None) -> int:
        """The window (MB) this spec needs on ``soc`` (None: not known): what every check and report uses."""
        return v.window_mb(self._window_bytes(spec, world_size, soc))

    def buffer_size(self, spec: md.DispatchSpec, world_size: int) -> mdb.BufferSize:
        T, h = spec.num_max_dispatch_tokens_per_rank, spec.hidden_size
        rows = v.ll_receive_rows(T, world_size, spec.local_experts(world_size), spec.top_k)
        window = self._window_bytes(spec, world_size)
        dispatch, combine = rows * spec.wire_format().bytes_per_token, rows * 2 * h
        # Low-latency rows live in the window; normal mode's received rows are tensors the C++
        # allocates beside it (its window only stages rounds), so there the parts add up.
        shared = window if window >= max(dispatch, combine) else None
        return mdb.BufferSize(
            dispatch, combine,
            notes=(f"HCCL window >= {v.window_mb(window)} MB (the group's, and the ops' DEEPEP_HCCL_BUFFSIZE or "
                   "HCCL_BUFFSIZE): what DeepEP-Ascend's ops check and its kernels use",),
            allocated_bytes=shared,
        )

    def env_requirements(self, spec: md.DispatchSpec, world_size: int) -> tuple[mdb.EnvRequirement, ...]:
        """The window (MB) that ``create`` checks: what DeepEP-Ascend's ops and kernels need for this spec on
        this chip (where the chip is unknown: the larger of A2 and A3 on one node, A3's beyond; ``create`` then
        checks A2's), on the variable the ops read (``DEEPEP_HCCL_BUFFSIZE`` when set, else ``HCCL_BUFFSIZE``);
        the group's window must hold it too."""
        soc = self.soc()
        where = "the ops' tiling and kernels" + (" on either chip (A2 or A3: not known here)" if soc is None else
                                                 f" on Atlas {soc}")
        env = self._env()
        name = v.DEEPEP_HCCL_BUFFSIZE if env.get(v.DEEPEP_HCCL_BUFFSIZE) is not None else v.HCCL_BUFFSIZE
        return (mdb.EnvRequirement(name, self.window_needed_mb(spec, world_size, soc), "MB",
                                  v.DEFAULT_HCCL_BUFFSIZE_MB if name == v.HCCL_BUFFSIZE else None,
                                  f"DeepEP-Ascend's HCCL window ({where}; the group's window must hold it too)"),)

    def group_hccl_config(self, process_group: Any) -> dict[str, Any] | None:
        """The group's ``hccl_config`` as torch_npu keeps it (a stand-in's for its gloo groups)."""
        if self.torch_npu_module != v.TORCH_NPU:
            return importlib.import_module(self.torch_npu_module).hccl_config_of(process_group)
        return v.group_hccl_config(process_group)

    def check_window(self, spec: md.DispatchSpec, world_size: int, hccl_config: Mapping[str, Any] | None,
                     options: Mapping[str, Any]) -> sizes.GroupWindow:
        """What ``create`` checks before the Buffer exists: the need <= the ops' window <= the group's window
        (``hccl_config``: the group's options as read, None where they cannot be; ``options[WINDOW_OPTION]``
        states the window then). Returns the group's window."""
        soc, known = self._creation_soc(), self.soc()
        need = self.window_needed_mb(spec, world_size, soc)  # what `moe-dispatch plan` reports (the chip known)
        env = self._env()
        group = sizes.group_window(hccl_config, env, options.get(WINDOW_OPTION), WINDOW_OPTION, need)
        ops_max = None
        if spec.mode is N and not sizes.is_a2_internode(N, world_size, soc):
            self._check_normal_op_tokens(spec, world_size, soc, known)
            ops_max = sizes.normal_op_bound(spec.num_max_dispatch_tokens_per_rank, spec.hidden_size, spec.top_k, known)
        return sizes.check_hccl_window(need, env, group, sizes.window_bounds(spec.mode, world_size, env, soc), ops_max)

    def check_environment(self, spec: md.DispatchSpec, world_size: int, hccl_config: Mapping[str, Any] | None,
                          options: Mapping[str, Any]) -> sizes.GroupWindow:
        """Everything ``create`` checks before the Buffer exists, on the resolved spec: the A2 limits with the
        environment they need (the layered variables, no HCCL_OP_EXPANSION_MODE on A2, INT8 that a runner asked
        for) and the windows. A chip torch_npu cannot name is taken as A2 here (the stricter: its internode kernels
        need the most)."""
        a2_limits(spec, world_size, self._creation_soc(), self._env(), self._internode_top_k())
        check_a2_hccl_options(self._env(), hccl_config, self._creation_soc(), assumed=self.soc() is None)
        return self.check_window(spec, world_size, hccl_config, options)

    def _creation_soc(self) -> str:
        """The chip ``create`` checks for: the known one, else A2 (the stricter: its internode kernels need
        the most, and it refuses HCCL_OP_EXPANSION_MODE)."""
        return self.soc() or v.SOC_A2

    def agreement_values(self, spec: md.DispatchSpec, world_size: int, hccl_config: Mapping[str, Any] | None,
                         options: Mapping[str, Any]) -> dict[str, Any]:
        """What decides the Buffer's construction, its windows and which kernels its calls take: the chip, the
        vendor build, the HCCL variables and the windows they give (a rank that differs would hang in a
        collective vendor call, or run another kernel, instead of failing)."""
        env, info = self._env(), self.vendor()
        need = self.window_needed_mb(spec, world_size, self._creation_soc())
        group = sizes.group_window(hccl_config, env, options.get(WINDOW_OPTION), WINDOW_OPTION, need)
        build = (f"ascend={info.is_ascend} supported={info.supported} quant_mode={info.has_quant_mode} "
                 f"ll_quant_mode={info.ll_quant_mode} strategies={info.has_strategies}")
        return {"chip": self.soc() or "unknown", "vendor build": build,
                **{name: env.get(name) for name in AGREED_ENV},
                "group window MB": group.mb, "ops window MB": v.ops_window_mb(env), "window MB needed": need}

    def agreement(self, ctx: mdb.DispatchContext) -> Mapping[str, Any]:
        return self.agreement_values(ctx.spec, ctx.world_size, self.group_hccl_config(ctx.comm.process_group),
                                     ctx.options)

    def _construct(self, info: v.VendorInfo, process_group: Any, low_latency: bool) -> Any:
        """``Buffer(...)`` with the construction-time environment pinned (restored afterwards)."""
        assert info.module is not None
        with restored_environ({**CONSTRUCTION_ENV, **dict.fromkeys(CONSTRUCTION_UNSET)}):  # None: unset for the call
            return info.module.Buffer(process_group, low_latency_mode=low_latency)

    def create(self, ctx: mdb.DispatchContext) -> AscendDeepEPDispatcher:
        spec, R = ctx.spec, ctx.world_size
        self.check_environment(spec, R, self.group_hccl_config(ctx.comm.process_group), ctx.options)
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
