"""Every sglang name the adapter uses, imported once, with where it is in sglang 0.5.23 (``sglang/srt/``)."""

from __future__ import annotations

import torch
from sglang.srt.arg_groups.model_override_base import resolved_view  # :133: the settings as sglang resolved them
from sglang.srt.arg_groups.moe_hook import (  # :733: the most tokens one rank sends through a fixed all-to-all
    _required_flashinfer_a2a_dispatch_tokens_per_rank as _most_tokens_per_rank,
)
from sglang.srt.environ import envs  # environ.py:1439 SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK (default 128)
from sglang.srt.eplb.expert_distribution import (  # :373; the recorder's on_deepep_dispatch_low_latency(masked_m): :184
    get_global_expert_distribution_recorder,
)
from sglang.srt.layers import deep_gemm_wrapper  # configurer.py:58 DEEPGEMM_SCALE_UE8M0: the runner's FP8 scales
from sglang.srt.layers.dp_attention import get_is_extend_in_batch  # :437: what --deepep-mode auto resolves by
from sglang.srt.layers.moe.token_dispatcher.base import BaseDispatcher  # :327: dispatch, combine (abstract)
from sglang.srt.layers.moe.token_dispatcher.deepep import (
    DeepEPLLCombineInput,  # :161 (hidden_states [E_local, R*T, H] unweighted, topk_ids, topk_weights)
    DeepEPLLDispatchOutput,  # :130 (hidden_states, hidden_states_scale, topk_ids, topk_weights, masked_m, expected_m)
    DeepEPNormalDispatchOutput,  # :116 (hidden_states, hidden_states_scale, topk_ids, topk_weights,
    #                               num_recv_tokens_per_expert: list[int]); combine: [rows, H] weighted (:683)
    DeepEPPDispatchHooks,  # :110: run between dispatch_a and dispatch_b (register_deepep_dispatch_hook)
    _is_npu,  # :42: the platform sglang's DeepEP path serves
    _use_aiter,  # :75
)
from sglang.srt.layers.moe.utils import (
    DeepEPMode,  # :267
    DispatcherOutputDtype,  # :297
    get_deepep_output_dtype,  # :344: sglang's own choice of the wire dtype, from its flags and quant config
)
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # :60, :84
from sglang.srt.runtime_context import (
    get_resources,  # :1297; .buffers: the process's named buffers (:648-651)
    get_server_args,  # :1289
)

#: sglang runs on an Ascend NPU.
is_npu = bool(_is_npu)


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


def chunked_prefill_size() -> int:
    """sglang's resolved --chunked-prefill-size (<= 0: chunked prefill off, a prefill of any length in one forward)."""
    return int(resolved_view(get_server_args()).chunked_prefill_size or 0)


def normal_tokens() -> int:
    """The most tokens one rank sends in a normal-mode forward: sglang's own bound for a fixed-size all-to-all
    (prefill chunks, prefill and decode/verify CUDA graphs: arg_groups/moe_hook.py:733-745)."""
    return max(int(_most_tokens_per_rank(get_server_args())), capacity())


def normal_expert_alignment() -> int:
    """The row multiple sglang asks DeepEP's normal-mode counts to be rounded to: 128 for its DeepGEMM runner, whose
    ep_scatter places each expert's rows at those starts (token_dispatcher/deepep.py:676)."""
    return 128 if deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM else 1


def normal_sends_fp8() -> bool:
    """Whether sglang's normal mode sends FP8 when its dtype choice says so: only for the DeepGEMM runner, which
    quantizes before DeepEP's dispatch (token_dispatcher/deepep.py:565-573); other runners get BF16 rows."""
    return bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM)


def aiter_expert_mask(num_local_experts: int | None) -> torch.Tensor | None:
    """AITER's expert mask: its runner sends -1 ids to a sink expert at index num_local_experts, masked off here
    (token_dispatcher/deepep.py:1028-1039; read by the quant methods, quantization/fp8.py:3442)."""
    if not (_use_aiter and num_local_experts is not None):
        return None
    mask = torch.ones(num_local_experts + 1, device=torch.cuda.current_device(), dtype=torch.int)
    mask[-1] = 0
    return mask


__all__ = [
    "BaseDispatcher",
    "DeepEPLLCombineInput",
    "DeepEPLLDispatchOutput",
    "DeepEPMode",
    "DeepEPNormalDispatchOutput",
    "DeepEPPDispatchHooks",
    "DispatcherOutputDtype",
    "HookRegistry",
    "HookType",
    "aiter_expert_mask",
    "capacity",
    "chunked_prefill_size",
    "expected_m",
    "get_deepep_output_dtype",
    "get_global_expert_distribution_recorder",
    "get_is_extend_in_batch",
    "is_npu",
    "normal_expert_alignment",
    "normal_sends_fp8",
    "normal_tokens",
    "shared_dispatchers",
    "ue8m0_scales",
]
