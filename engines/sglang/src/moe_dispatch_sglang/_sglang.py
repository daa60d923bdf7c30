"""Every sglang name the adapter uses, imported once, with where it is in sglang 0.5.23 (``sglang/srt/``)."""

from __future__ import annotations

from sglang.srt.environ import envs  # environ.py:1439 SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 128)
from sglang.srt.eplb.expert_distribution import (  # :373; the recorder's on_deepep_dispatch_low_latency(masked_m): :184
    get_global_expert_distribution_recorder,
)
from sglang.srt.layers import deep_gemm_wrapper  # configurer.py:58 DEEPGEMM_SCALE_UE8M0: the runner's FP8 scales
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher  # :327: dispatch, combine (abstract)
from sglang.srt.layers.moe.token_dispatcher.deepep import (
    DeepEPLLCombineInput,  # :161 (hidden_states [E_local, R*T, H] unweighted, topk_ids, topk_weights)
    DeepEPLLDispatchOutput,  # :130 (hidden_states, hidden_states_scale, topk_ids, topk_weights, masked_m, expected_m)
    DeepEPPDispatchHooks,  # :110: run between dispatch_a and dispatch_b (register_deepep_dispatch_hook)
)
from sglang.srt.layers.moe.utils import (
    DeepEPMode,  # :267
    DispatcherOutputDtype,  # :297
    get_deepep_output_dtype,  # :344: sglang's own choice of the wire dtype, from its flags and quant config
)
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # :60, :84
from sglang.srt.runtime_context import get_resources  # :1297; .buffers: the process's named buffers (:648-651)

def expected_m(tokens: int, world_size: int, top_k: int, num_experts: int) -> int:
    """What sglang's LL path tells the experts of a local expert's rows: (T * R * K + E) // E
    (layers/moe/token_dispatcher/deepep.py:768-771)."""
    return (tokens * world_size * top_k + num_experts) // num_experts


def ue8m0_scales() -> bool:
    """Whether sglang's DeepGEMM runner reads FP8 scales as powers of two (Blackwell): DeepEP then rounds them when
    it quantizes (layers/moe/token_dispatcher/deepep.py:826-836), and so must the wire."""
    return bool(deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0)


def shared_dispatchers() -> dict:
    """The process's dispatchers, shared by every layer and micro-batch with the same spec, where sglang keeps its
    own process-wide DeepEP buffer (``get_resources().buffers``, token_dispatcher/deepep.py:193-205)."""
    return get_resources().buffers.setdefault("moe_dispatch", {})


def capacity() -> int:
    """Tokens per rank a DeepEP LL buffer is sized for: sglang's own setting."""
    return int(envs.SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get())


__all__ = ["BaseDispatcher", "DeepEPLLCombineInput", "DeepEPLLDispatchOutput", "DeepEPMode", "DeepEPPDispatchHooks",
           "DispatcherOutputDtype", "HookRegistry", "HookType", "capacity", "expected_m", "get_deepep_output_dtype",
           "get_global_expert_distribution_recorder", "shared_dispatchers",
           "ue8m0_scales"]
