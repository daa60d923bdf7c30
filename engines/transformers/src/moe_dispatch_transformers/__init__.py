"""Expert parallelism for a transformers MoE model (``pip install moe-dispatch-transformers``).

::

    import moe_dispatch_transformers as mdt

    model = AutoModelForCausalLM.from_config(config)        # or from_pretrained, the same on every rank
    mdt.expert_parallel(model, "torch", num_max_dispatch_tokens_per_rank=256)
    logits = model(input_ids).logits                          # this rank's batch; the experts are everyone's

Every rank keeps the whole model but only its slice of each MoE layer's experts, and runs its
own batch (data-parallel attention, expert-parallel MoE, as sglang's DP attention with EP): an
MoE layer's tokens go to the ranks of their experts and come back through the layer's
dispatcher. Every rank must run the same number of forward passes (the layers' calls are
collectives); the batches may differ in size, each at most ``num_max_dispatch_tokens_per_rank``
tokens (batch × sequence) per forward.

What it takes: the MoE layers transformers 5 stores as fused expert tensors behind
``use_experts_implementation`` — ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows),
``down_proj`` ``[E, H, I]``, SiLU, no bias — which is ``moe_dispatch.ExpertWeights``' layout.
Tested on Qwen3-MoE, Mixtral and DeepSeek-V3 (transformers 5.23); other families built the same
way work the same, and any other form (transposed, interleaved, with bias, another activation)
is refused with the reason. The router, shared experts and everything else stay as they are.

NVFP4 needs each layer's activation global scale: ``calibrate_nvfp4(model, batches)`` observes
the experts' inputs and returns the ``QuantHints`` per layer to pass as ``quant=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from moe_dispatch import (
    ConfigMismatchError,
    DispatchDtype,
    Dispatcher,
    DispatchSpec,
    ExpertKernel,
    ExpertWeights,
    InvalidSpecError,
    Mode,
    QuantHints,
    TorchExperts,
    create_dispatcher,
)
from moe_dispatch.backend import nvfp4_global_scale

#: The attributes transformers' ``use_experts_implementation`` sets on a fused experts module.
_LAYOUT_FLAGS = {"is_concatenated": True, "is_transposed": False, "has_bias": False, "has_gate": True,
                 "has_post_expert_norm": False}


@dataclass(frozen=True)
class ExpertsModule:
    """One MoE layer's experts in a transformers model: where it sits and its sizes."""

    name: str
    module: nn.Module
    hidden_size: int
    num_experts: int
    intermediate_size: int


def find_experts(model: nn.Module) -> list[ExpertsModule]:
    """The model's fused experts modules, in module order (the same on every rank), each checked to
    have the layout this integration takes; ``InvalidSpecError`` naming the module otherwise."""
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "is_concatenated")):
            continue
        gate_up, down = module.gate_up_proj, module.down_proj
        if gate_up.dim() != 3 or down.dim() != 3:
            raise InvalidSpecError("expert tensors are not [E, 2I, H] and [E, H, I]", parameter=name,
                                   value=(tuple(gate_up.shape), tuple(down.shape)),
                                   allowed="transformers' fused experts (use_experts_implementation)")
        for flag, wanted in _LAYOUT_FLAGS.items():
            if getattr(module, flag, wanted) != wanted:
                raise InvalidSpecError(f"{type(module).__name__} stores its experts otherwise ({flag}="
                                       f"{getattr(module, flag)})", parameter=name, value=flag,
                                       allowed=", ".join(f"{k}={v}" for k, v in _LAYOUT_FLAGS.items()))
        probe = torch.linspace(-4, 4, 9)
        act = getattr(module, "act_fn", None)
        if act is None or not torch.allclose(act(probe), nn.functional.silu(probe)):
            raise InvalidSpecError("the experts' activation is not SiLU (the reference experts compute SwiGLU)",
                                   parameter=name, value=type(act).__name__, allowed="SiLU")
        e, two_i, h = gate_up.shape
        if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2:
            raise InvalidSpecError("gate_up_proj and down_proj disagree", parameter=name,
                                   value=(tuple(gate_up.shape), tuple(down.shape)), allowed="[E, 2I, H] and [E, H, I]")
        found.append(ExpertsModule(name, module, h, e, two_i // 2))
    return found


class ExpertParallelExperts(nn.Module):
    """Stands in for a transformers experts module: ``forward(hidden_states, top_k_index,
    top_k_weights)`` as transformers calls it, through the layer's dispatcher, with this rank's
    slice of the experts (``weights``)."""

    def __init__(self, dispatcher: Dispatcher, kernel: ExpertKernel, weights: ExpertWeights, name: str) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        self.kernel = kernel
        self.weights = weights
        self.name = name

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # The contract's input rules: bf16 activations, int64 global ids, fp32 weights.
        out = self.dispatcher.forward(self.kernel, self.weights, hidden_states.to(torch.bfloat16),
                                      top_k_index.to(torch.int64), top_k_weights.to(torch.float32))
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.dispatcher!r}, {self.weights.num_experts} local experts"


def expert_parallel(
    model: nn.Module,
    backend: str = "torch",
    *,
    num_max_dispatch_tokens_per_rank: int,
    mode: str | Mode = "normal",
    output_dtype: str | DispatchDtype | None = None,
    quant: QuantHints | Mapping[str, QuantHints] | None = None,
    kernel: ExpertKernel | None = None,
    group: "dist.ProcessGroup | None" = None,
    **create: Any,
) -> list[ExpertParallelExperts]:
    """Make ``model``'s MoE layers expert-parallel over ``group`` (every rank calls it, with the same
    model): each experts module is replaced by an ``ExpertParallelExperts`` holding this rank's slice
    of its experts and a dispatcher on ``backend``. Returns them in module order.

    :param num_max_dispatch_tokens_per_rank: the most tokens (batch × sequence) one forward of this
        rank sends through a layer.
    :param quant: one ``QuantHints`` for every layer, or one per experts module name
        (``calibrate_nvfp4``); NVFP4 needs a global scale per layer.
    :param kernel: the expert kernel (default ``TorchExperts``, which dequantizes any wire dtype).
    :param create: more ``create_dispatcher`` arguments (``check_inputs``, ``timeout_s``, ``in_flight``...).
    """
    kernel = kernel or TorchExperts()
    top_k = _top_k(model)
    replaced = []
    experts = find_experts(model)
    if not experts and any(isinstance(m, ExpertParallelExperts) for m in model.modules()):
        raise InvalidSpecError("this model is expert-parallel already (expert_parallel ran on it)", parameter="model",
                               value=type(model).__name__, allowed="a model whose experts modules are transformers' own")
    for found in experts:
        hints = quant.get(found.name) if isinstance(quant, Mapping) else quant
        spec = DispatchSpec(found.hidden_size, found.num_experts, top_k,
                            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, mode=mode,
                            output_dtype=output_dtype, quant=hints or QuantHints())
        dispatcher = create_dispatcher(backend, spec, group, **create)
        _check_same_experts(dispatcher, found)
        local = spec.local_experts(dispatcher.world_size)
        first = dispatcher.rank * local
        module = found.module
        weights = ExpertWeights(  # copies, so the other ranks' experts are freed with the module
            module.gate_up_proj.detach()[first : first + local].clone(),
            module.down_proj.detach()[first : first + local].clone(),
        )
        layer = ExpertParallelExperts(dispatcher, kernel, weights, found.name)
        _replace(model, found.name, layer)
        replaced.append(layer)
    if not replaced:
        raise InvalidSpecError("no fused experts module in this model", parameter="model", value=type(model).__name__,
                               allowed="a transformers 5 MoE model (experts behind use_experts_implementation)")
    return replaced


@torch.no_grad()
def calibrate_nvfp4(model: nn.Module, batches: Iterable[Mapping[str, Any]],
                    group: "dist.ProcessGroup | None" = None) -> dict[str, QuantHints]:
    """NVFP4's activation global scale per MoE layer: run ``model(**batch)`` for each calibration
    batch (before ``expert_parallel``), observe the largest magnitude entering each experts module,
    take the largest over the ranks of ``group`` (every rank must agree on a layer's spec), and
    return ``{module name: QuantHints(input_global_scale=...)}`` (FlashInfer's convention,
    ``codecs.nvfp4_global_scale``). Every rank calls it when torch.distributed is initialized."""
    found = find_experts(model)
    amax = {f.name: torch.zeros((), dtype=torch.float32) for f in found}

    def observer(name: str):  # type: ignore[no-untyped-def]
        def hook(_module: nn.Module, args: tuple) -> None:  # type: ignore[type-arg]
            amax[name] = torch.maximum(amax[name], args[0].detach().abs().max().float().cpu())
        return hook

    handles = [f.module.register_forward_pre_hook(observer(f.name)) for f in found]
    try:
        for batch in batches:
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    names = [f.name for f in found]
    values = torch.stack([amax[n] for n in names]) if names else torch.zeros(0)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return {n: QuantHints(input_global_scale=nvfp4_global_scale(float(v))) for n, v in zip(names, values)}


def _check_same_experts(dispatcher: Dispatcher, found: ExpertsModule) -> None:
    """Every rank must hold the same layer (each keeps only its slice, so a rank with other weights would
    silently give other tokens' results): a cheap fingerprint of the whole tensors, compared at creation."""
    g, d = found.module.gate_up_proj.detach(), found.module.down_proj.detach()
    mine = tuple(round(float(f), 6) for f in (g.double().sum(), d.double().sum(), g.double().abs().sum(),
                                              d.double().abs().sum()))
    everyone = dispatcher.comm.gather_object(mine, f"{found.name}: expert weights")
    if any(f != mine for f in everyone):
        raise ConfigMismatchError(
            "the ranks hold different expert weights for this layer (each keeps only its slice, so the results would "
            "silently differ): build the same model on every rank (the same seed, or the same checkpoint)",
            parameter=found.name, value={r: f for r, f in enumerate(everyone)}, allowed="the same weights everywhere")


def idle_forward(layers: "list[ExpertParallelExperts]") -> None:
    """What a rank with no tokens calls instead of a forward: each MoE layer once with an empty batch, in
    order, so that its calls match the other ranks' (a transformers model itself refuses an empty batch)."""
    for layer in layers:
        weights = layer.weights
        hidden, top_k = weights.w13_weight.shape[-1], layer.dispatcher.spec.top_k
        layer(torch.empty(0, hidden), torch.empty(0, top_k, dtype=torch.int64), torch.empty(0, top_k))


def _top_k(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise InvalidSpecError("the model's config has no num_experts_per_tok", parameter="model.config",
                               value=type(config).__name__, allowed="a MoE config with num_experts_per_tok")
    return top_k


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


__all__ = ["ExpertParallelExperts", "ExpertsModule", "calibrate_nvfp4", "expert_parallel", "find_experts", "idle_forward"]
