"""DeepEP-Ascend's ``Buffer`` with ``fused_deep_moe`` (sgl-project/sgl-kernel-npu main f425bdf),
faked on CPU: ``moe_dispatch_ascend_deepep_testing.fakes.deep_ep.Buffer`` plus the fused op.

The vendor's checks, as it makes them (``KN`` = sgl-project/sgl-kernel-npu @ f425bdf): the Python
wrapper (``python/deep_ep/deep_ep/buffer.py`` ``fused_deep_moe``: ``topk_idx.int()``, fuse mode 1 or
2, else ``NotImplementedError``), the C++ (``csrc/deepep/deep_ep.cpp`` ``Buffer::fused_deep_moe``:
2-D x / ids / weights of one shape, quant_mode 0 or 1; ``dispatch_ffn_combine``: int8 weights,
``max_output_size > 0``; ``EP_HOST_ASSERT`` → RuntimeError), and the ops' tiling
(``fused_deep_moe_tiling.cpp``: batch 1..256, H 512..7168, gmm1 N 1024..6144, top-k <= 12,
E <= 512 and E % R, weight and scale shapes, the HCCL window; ``dispatch_ffn_combine_tiling.cpp``:
its window; mode 1's ``moeExpertNumPerRank <= aivNum/2``, aivNum the fake torch_npu's
``npu.get_device_limit(0)["vector_core_num"]``). Numerics from the op's documentation: per-token INT8, dispatch, GMM1 (exact int32)
dequantized by weight and token scales, SwiGLU (silu on gate), per-token requant, GMM2,
dequant, combine weighted by ``topk_weights``. The weight layouts are read here from the vendor
facts (mode 1: gmm1's N in gate/up tiles of ``vendor.GMM1_TILE_N``; mode 2: int64 scale bits).

Numerics as the kernels compute them: mode 1 quantizes the dispatched rows as the low-latency
dispatch does (``s = 127/amax``); mode 2 as moe_init_routing_quant_v2 (``scale = amax/127``,
``x/scale`` truncated to fp16 then rounded) and keeps each GEMM's output after its per-channel
weight scale in **fp16** (``CType = float16_t``, the uint64 fixpipe dequant;
dispatch_ffn_combine.h), so an overflow there is an inf in the fake too.

The chip: an Atlas A2 build of DeepEP-Ascend compiles ``csrc/deepep/ops2``, which has neither
FusedDeepMoe nor DispatchFFNCombine: on the A2 fake chip (ascend_deepep's ``fakes.torch_npu.soc_version(220)``)
``fused_deep_moe`` raises as EXEC_NPU_CMD does for a missing op.

Fake-only ("(fake)"): mode 2's workspace holds ``max_output_size`` rows (its tiling sizes it so):
a rank receiving more rows raises instead of overwriting memory; ``-1`` expert ids in mode 2 (the
vendor's test: "Currently, topk=-1 is not supported", its routing sorts expert ids) and tokens whose
ids are all ``-1`` in mode 1 (the vendor's test guarantees each token a valid expert) raise instead
of computing a clean answer the device may not give; an empty batch in mode 2 raises as in mode 1
(undocumented); quant_mode 0 (BF16 weights) is not emulated.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch
import torch.nn.functional as F

from moe_dispatch_ascend_deepep_testing.fakes import deep_ep as base
from moe_dispatch_ascend_deepep_testing.fakes import torch_npu as fake_torch_npu
from moe_dispatch_ascend_deepep_testing.fakes.deep_ep import (
    A2, Config, EventOverlap, FuseMode, VendorCall, _ep_assert, _op_check, quant_low_latency,
)
from moe_dispatch_ascend_fuseep import vendor as v


def _untile_gate_up(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gmm1's output columns in the op's mode-1 order: tile b (2·TILE wide) = gate tile b ‖ up tile b."""
    tiles = h.unflatten(-1, (h.shape[-1] // (2 * v.GMM1_TILE_N), 2, v.GMM1_TILE_N))
    return tiles[..., 0, :].flatten(-2), tiles[..., 1, :].flatten(-2)


def _fp32_from_int64_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _trunc_fp16(x: torch.Tensor) -> torch.Tensor:
    """fp32 → fp16 rounding toward zero (CAST_TRUNC), for values in fp16's normal range."""
    bits = x.float().contiguous().view(torch.int32) & ~0x1FFF  # drop the 13 mantissa bits fp16 has not
    return bits.view(torch.float32).to(torch.float16)


def quant_mode2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_init_routing_quant_v2's per-token INT8 (KN@f425bdf ops/op_kernel/dispatch_ffn_combine_kernel/
    moe_init_routing_quant_v2/moe_v2_gather_dynamic_quant.h): ``scale = amax/127``, ``x/scale`` cast to fp16
    with CAST_TRUNC, then to int8 with CAST_ROUND (half away from zero)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / torch.tensor(127.0)
    h = _trunc_fp16(xf / scale).float()
    q = torch.where(torch.isfinite(h), torch.sign(h) * torch.floor(h.abs() + 0.5), torch.zeros(()))
    return q.clamp(-127, 127).to(torch.int8), scale.squeeze(-1)


class Buffer(base.Buffer):
    #: Mode 2's tiling reads DEEPEP_HCCL_BUFFSIZE when set (from KN@f7455efe; vendor.mode2_window_mb).
    MODE2_READS_DEEPEP = True
    def fused_deep_moe(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        gmm1_permuted_weight: torch.Tensor,
        gmm1_permuted_weight_scale: torch.Tensor,
        gmm2_weight: torch.Tensor,
        gmm2_weight_scale: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        quant_mode: int = 1,
        fuse_mode: FuseMode = FuseMode.FUSED_DEEP_MOE,
        profile_enable: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        topk_ids = topk_idx.int()
        if self.soc_version == A2:  # an A2 wheel builds ops2: no aclnnFusedDeepMoe / aclnnDispatchFFNCombine
            raise RuntimeError("EXEC_NPU_CMD: aclnnFusedDeepMoe / aclnnDispatchFFNCombine not found: this "
                               "DeepEP-Ascend is an Atlas A2 build (csrc/deepep/ops2 has no fused ops)")
        if fuse_mode == FuseMode.DISPATCH_FFN_COMBINE and bool((topk_ids < 0).any()):
            raise RuntimeError("(fake) aclnnDispatchFFNCombine: topk=-1 is not supported (the vendor's "
                               "test_dispatch_ffn_combine.py); its routing sorts the expert ids")
        if fuse_mode == FuseMode.FUSED_DEEP_MOE and topk_ids.numel() and bool((topk_ids < 0).all(dim=1).any()):
            raise RuntimeError("(fake) aclnnFusedDeepMoe: a token without a valid expert (the vendor's "
                               "test_fused_deep_moe.py guarantees each token at least one)")
        if fuse_mode == FuseMode.FUSED_DEEP_MOE:
            return self._fused(x, topk_ids, topk_weights, gmm1_permuted_weight, gmm1_permuted_weight_scale, gmm2_weight,
                               gmm2_weight_scale, num_max_dispatch_tokens_per_rank, num_experts, quant_mode)
        if fuse_mode == FuseMode.DISPATCH_FFN_COMBINE:
            return self._dispatch_ffn_combine(x, topk_ids, gmm1_permuted_weight, gmm1_permuted_weight_scale,
                                              gmm2_weight, gmm2_weight_scale, topk_weights,
                                              num_max_dispatch_tokens_per_rank, num_experts)
        raise NotImplementedError(f"Not support fuse_mode:{fuse_mode}")

    def _fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
               w2: torch.Tensor, s2: torch.Tensor, T: int, num_experts: int, quant_mode: int
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        # deep_ep.cpp Buffer::fused_deep_moe (A2/A3 build)
        _ep_assert(x.dim() == 2 and ids.dim() == 2 and weights.dim() == 2, "x, expert_ids, expert_scales are 2-D")
        _ep_assert(x.shape[0] == ids.shape[0] and ids.shape == weights.shape, "expert_ids.sizes() == expert_scales.sizes()")
        _ep_assert(quant_mode in (0, 1), f"fused_deep_moe only supports quant_mode 0 (BF16) or 1 (INT8), got {quant_mode}")
        if quant_mode == 0:
            raise NotImplementedError("(fake) BF16 weights (quant_mode 0) are not emulated")
        op, R = "aclnnFusedDeepMoe", self.group_size
        n, h, k = x.shape[0], x.shape[1], ids.shape[1]
        _op_check(v.MIN_BATCH <= n <= v.MAX_BATCH, op, f"batchSize(bs) must be in [1, 256], got {n}")
        _op_check(v.MIN_HIDDEN <= h <= v.MAX_HIDDEN, op, f"tokenLength(h) is invalid. Only support [512, 7168], got {h}")
        _op_check(k <= v.MAX_TOP_K, op, f"topK(k) must <= 12, got {k}")
        _op_check(0 < num_experts <= v.MAX_EXPERTS and num_experts % R == 0, op,
                  "moeExpertNum must be in (0, 512] and divisible by epRankSize")
        local = num_experts // R
        cores = fake_torch_npu.npu.get_device_limit(0)[v.VECTOR_CORE_KEY]
        _op_check(local <= cores // v.MODE1_AIV_PER_LOCAL_EXPERT, op,
                  f"moeExpertNumPerRank must <= (aivNum/2), got {local} with aivNum {cores}")
        two_i = w1.shape[-1]
        _op_check(w1.dim() == 3 and w1.shape[0] == local and w1.shape[1] == h, op,
                  "gmm1Weight Dim0 must be expert number in current rank")
        _op_check(v.MIN_GMM1_HIDDEN <= two_i <= v.MAX_GMM1_HIDDEN, op, "gmm1 hidden size is invalid. Only support "
                  f"[1024, 6144], got {two_i}")
        _op_check(tuple(s1.shape) == (local, two_i), op, f"gmm1WeightScale must be [{local}, {two_i}]")
        _op_check(w2.dim() == 3 and w2.shape[0] == local and w2.shape[1] == h, op, "gmm2Weight must be [E_l, H, I]")
        _op_check(tuple(s2.shape) == (local, h), op, f"gmm2WeightScale must be [{local}, {h}]")
        _op_check(w1.dtype == torch.int8 and w2.dtype == torch.int8, op, "INT8 weights with quant_mode 1")
        need = v.fused_deep_moe_window_bytes(max(n, T), R, local, h)
        _op_check(need <= base._window_mb() * v.MIB, op, f"HCCL_BUFFSIZE is too SMALL, NEEDED {need // v.MIB + 1}MB")
        out, counts, per_src = self._compute(x, ids, weights, w1, s1.float(), w2.transpose(1, 2), s2.float(), local,
                                             interleaved=True, name="fused_deep_moe")
        return out, per_src.flatten()  # ep_recv_count, int32 [E_l·R] (the ids' dtype)

    def _dispatch_ffn_combine(self, x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                              w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor, max_output_size: int,
                              num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
        # deep_ep.cpp Buffer::dispatch_ffn_combine
        _ep_assert(ids.dim() == 2 and weights.dim() == 2, "expert_ids.dim() == 2 and expert_scales.dim() == 2")
        _ep_assert(max_output_size > 0, "max_output_size > 0")
        if w1.dtype != torch.int8:
            _ep_assert(False, "BF16 mode not yet supported for dispatch_ffn_combine")
        op, R = "aclnnDispatchFFNCombine", self.group_size
        n, h, k = x.shape[0], x.shape[1], ids.shape[1]
        if n < 1:
            raise RuntimeError("(fake) aclnnDispatchFFNCombine with an empty batch is not documented")
        local = num_experts // R
        need = v.dispatch_ffn_combine_window_bytes(n, k, h)
        _, window = v.mode2_window_mb(os.environ, self.MODE2_READS_DEEPEP)
        _op_check(need <= window * v.MIB, op, f"HCCL_BUFFSIZE is too SMALL, expected {need // v.MIB + 1}MB")
        _op_check(s1.dtype == torch.int64 and s2.dtype == torch.int64, op, "scales are int64 (fp32 bit patterns)")
        _op_check(w1.shape[0] == local and w1.shape[1] == h and w2.shape[0] == local and w2.shape[2] == h, op,
                  "weights must be [E_l, H, 2I] and [E_l, I, H]")
        out, counts, _ = self._compute(x, ids, weights, w1, _fp32_from_int64_bits(s1), w2, _fp32_from_int64_bits(s2),
                                       local, interleaved=False, name="dispatch_ffn_combine",
                                       max_rows=max_output_size)
        return out, counts.to(torch.int32)  # expert_token_nums, int32 [E_l]

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                 w2: torch.Tensor, s2: torch.Tensor, local: int, interleaved: bool, name: str,
                 max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch (INT8), the two GEMMs per local expert, combine; ``w2`` is ``[E_l, I, H]``. Mode 2
        (not ``interleaved``) keeps each GEMM's output after its per-channel weight scale in fp16."""
        fp16 = not interleaved
        q, s = quant_mode2(x) if fp16 else quant_low_latency(x)
        recv_q, recv_s, counts, state = self._exchange(name, q, s, ids, local)
        assert recv_s is not None
        if max_rows is not None:  # every rank learns whether one overflowed, so none waits for the others
            over = torch.full((self.group_size,), int(recv_q.shape[0] > max_rows), dtype=torch.int64)
            ranks = self.comm.exchange_counts(over).nonzero().flatten().tolist()
            if ranks:
                raise RuntimeError(f"(fake) aclnnDispatchFFNCombine: rank(s) {ranks} received more rows than "
                                   f"max_output_size={max_rows}, the rows its workspace holds "
                                   "(dispatch_ffn_combine_tiling.cpp sizes it by rows); this rank received "
                                   f"{recv_q.shape[0]}")
        h = x.shape[1]
        out_rows = torch.zeros(recv_q.shape[0], h, dtype=torch.bfloat16)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                acc = recv_q[rows].double() @ w1[e].double()  # exact int32 accumulate
                c1 = acc * s1[e].double()
                if fp16:  # CType = float16_t: the fixpipe writes the per-channel dequant in fp16
                    c1 = c1.to(torch.float16).double()
                h1 = (c1 * recv_s[rows].double().unsqueeze(1)).float()
                gate, up = _untile_gate_up(h1) if interleaved else h1.chunk(2, dim=-1)
                aq, a_s = quant_low_latency(F.silu(gate) * up)
                acc2 = aq.double() @ w2[e].double()  # [n, I] @ [I, H]
                c2 = acc2 * s2[e].double()
                if fp16:
                    c2 = c2.to(torch.float16).double()
                out_rows[rows] = (c2 * a_s.double().unsqueeze(1)).to(torch.bfloat16)
            start += n
        back, tok, slot = self._return(out_rows, state)
        out = torch.zeros(x.shape[0], h).index_add_(0, tok, back * weights[tok, slot].float().unsqueeze(1))
        src = torch.repeat_interleave(torch.arange(self.group_size), state.recv)
        per_src = torch.zeros(local, self.group_size, dtype=torch.int32)
        le = torch.repeat_interleave(torch.arange(local), counts)
        if le.numel():
            per_src.index_put_((le, src[state.group]), torch.ones_like(le, dtype=torch.int32), accumulate=True)
        return out.to(torch.bfloat16), counts, per_src


__all__ = ["Buffer", "Config", "EventOverlap", "FuseMode", "VendorCall", "quant_mode2"]
