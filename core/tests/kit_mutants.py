"""Backends with one deliberate bug each: the conformance kit must fail every one of them.

They are the torch backend with a single change, so any failure the kit reports comes from
that change. Module-level classes, so local ranks can unpickle them.
"""

from __future__ import annotations

import dataclasses
import os

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch._reference.builtin import TorchBackend


class DoubleWeight(TorchBackend):
    """Applies the top-k weights twice."""

    def create(self, ctx):
        inner = super().create(ctx)
        real = inner.combine
        inner.combine = lambda y, out: real(y, out) * 2
        return inner


class TokenMajorKeepsWeights(TorchBackend):
    """Hands TOKEN_MAJOR rows the weights of experts elsewhere (DeepEP's are 0 there): a kernel that reads every
    top-k entry counts them."""

    def create(self, ctx):
        inner = super().create(ctx)
        real = inner.dispatch

        def dispatch(x, ids, w):
            out = real(x, ids, w)
            if out.layout is not md.Layout.TOKEN_MAJOR:
                return out
            return dataclasses.replace(out, row_topk_weights=out.row_topk_weights + (out.row_topk_ids < 0) * 1.0)
        inner.dispatch = dispatch
        return inner


class DropsLastRow(TorchBackend):
    """Loses the last (token, expert) row of every dispatch in normal mode."""

    def create(self, ctx):
        inner = super().create(ctx)
        real = inner.dispatch

        def dispatch(x, ids, w):
            out = real(x, ids, w)
            if out.layout is md.Layout.PACKED and out.hidden_states.shape[0]:
                counts = out.expert_counts().clone()
                last = int((counts > 0).nonzero().max())
                counts[last] -= 1
                hidden = out.hidden_states.clone()
                hidden[int(counts.sum()):] = 0
                gl = counts if out.group_list_type == 1 else torch.cumsum(counts, 0)
                out = dataclasses.replace(out, hidden_states=hidden, group_list=gl)
            return out

        inner.dispatch = dispatch
        return inner


class SmallBuffer(TorchBackend):
    """Sizes the dispatch buffer with one byte per element, whatever the wire dtype."""

    def buffer_size(self, spec, world_size):
        size = super().buffer_size(spec, world_size)
        return mdb.BufferSize(spec.num_max_dispatch_tokens_per_rank * spec.hidden_size, size.combine_bytes)


class WritesEnvironment(TorchBackend):
    """Passes configuration through os.environ, like sglang's INT8 flag."""

    def create(self, ctx):
        os.environ["MOE_KIT_MUTANT_DTYPE"] = ctx.dtype.value
        return super().create(ctx)


class KeepsLastCall(TorchBackend):
    """Keeps the last dispatch's handle on the dispatcher and combines with it."""

    def create(self, ctx):
        inner = super().create(ctx)
        real_dispatch, real_combine = inner.dispatch, inner.combine
        state = {}

        def dispatch(x, ids, w):
            out = real_dispatch(x, ids, w)
            state["last"] = out
            return out

        def combine(y, out):
            return real_combine(y, state["last"])

        inner.dispatch, inner.combine = dispatch, combine
        return inner


class NoisyCombine(TorchBackend):
    """Sums in an order that changes from call to call."""

    def create(self, ctx):
        inner = super().create(ctx)
        real = inner.combine
        calls = [0]

        def combine(y, out):
            calls[0] += 1
            result = real(y, out)
            return result + (calls[0] % 2) * torch.finfo(torch.bfloat16).eps * result

        inner.combine = combine
        return inner


_FP8_ONLY = dataclasses.replace(
    TorchBackend.capabilities,
    dtypes={m: frozenset({md.DispatchDtype.BF16, md.DispatchDtype.FP8}) for m in md.Mode},
    fallbacks={(m, md.DispatchDtype.INT8): mdb.Fallback(md.DispatchDtype.FP8, "no INT8 kernels") for m in md.Mode},
)


class TableDisagrees(TorchBackend):
    """Declares INT8 → FP8 but its validate_dtype accepts INT8."""

    capabilities = _FP8_ONLY

    def validate_dtype(self, dtype, spec):
        return mdb.DtypeDecision("accept", dtype)


class StartsShareOneReceive(TorchBackend):
    """In split phase, keeps the started dispatch's receiving half on the dispatcher: the next start replaces it, so
    the first of two micro-batches receives the second's rows."""

    def create(self, ctx):
        inner = super().create(ctx)
        real = inner.dispatch_start

        def dispatch_start(x, ids, w):
            inner.last_started = real(x, ids, w)
            return md.Pending(lambda: inner.last_started.wait())

        inner.dispatch_start = dispatch_start
        return inner


class ReadsCountsOnHost(TorchBackend):
    """Declares CUDA-graph support for low-latency mode, as the torch backend does, but reads its counts on the host
    there (to check them against its slots)."""

    def create(self, ctx):
        inner = super().create(ctx)
        real = inner.dispatch

        def dispatch(x, ids, w):
            out = real(x, ids, w)
            if max(out.expert_counts().tolist(), default=0) > out.hidden_states.shape[-2]:
                raise RuntimeError("more rows than slots")
            return out

        inner.dispatch = dispatch
        return inner


class StartsRunWhole(TorchBackend):
    """Declares split phase in both modes, as the torch backend does, but its starts run each call to its end."""

    def create(self, ctx):
        inner = super().create(ctx)
        inner.dispatch_start = lambda x, ids, w: md.Pending.completed(inner.dispatch(x, ids, w))
        inner.combine_start = lambda y, out: md.Pending.completed(inner.combine(y, out))
        return inner
