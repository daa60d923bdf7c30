"""The adapter: DeepEP's V1 ``Buffer`` calls, converted to the moe-dispatch contract.

Normal mode. DeepEP returns one row per (token, destination rank) with local top-k ids (-1
for experts of other ranks), and its combine only adds. The adapter expands the rows to one
per (token, local expert), grouped by expert (an ``index_select`` of rows·H wire bytes),
and at combine weights each expert row and sums a token's rows in fp32 (rows·H
multiply-adds) before the vendor's add-only combine sends one BF16 row per token back. With
``DispatchSpec(layout="token_major")`` DeepEP's rows are handed over as they are (TOKEN_MAJOR) and
combine takes the engine's weighted rows straight back.

Low-latency mode. DeepEP's masked ``[E_local, R·T, H]`` receive layout is the contract's
MASKED layout as it is (no copy; the FP8 scales stay column-major, which the contract
allows), ``recv_count`` becomes the group list, and the vendor's combine applies the top-k
weights itself: the handle keeps a copy of the dispatch's ids and weights for it, since the
engine may overwrite its router buffers between dispatch and combine (normal mode weights
the rows from what DeepEP received, which is the vendor's memory).

UE8M0 (``QuantHints(fp8_ue8m0_scales=True)``, DeepGEMM on SM100): both modes hand over
int32 scales with four exponent bytes per word (``moe_dispatch.backend.pack_ue8m0``); LL asks
DeepEP for them (``round_scale=use_ue8m0=True``), normal mode packs them before dispatch.

NVFP4 (low-latency, a DeepEP from the hybrid-ep branch): ``use_nvfp4`` with the layer's
``x_global_scale``, one 0-dim float32 tensor made at creation on the layer's device (a tensor built from
the host float at each dispatch would be a host→device copy, which CUDA-graph capture refuses); DeepEP
returns the data expert-last and the scales swizzled 128×4, so the adapter permutes the data (a view) and
unswizzles the scales to the contract's linear rows.

Rows of the MASKED layout past an expert's count are whatever DeepEP's ``torch::empty`` held, and rows
within an expert come in arrival order: nothing here reads either.

The Buffer is the process's, shared with every other layer (``buffers.SharedBuffer``): LL calls clean its
signalling counts first when internode normal-mode kernels or LL kernels of another E used it since, and a
normal-mode combine past 8 ranks on an LL Buffer cleans at once, once per E (a replayed CUDA graph runs no Python);
an LL call under CUDA-graph capture is refused on a Buffer serving several E, and while a clean is due (a graph never
holds one; ``buffers``). Once the backend is closed
(``DeepEPBackend.close``) every call is a ``BackendUnavailableError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

import moe_dispatch as md
import moe_dispatch.backend as mdb
from moe_dispatch.backend import (
    StartMark,
    from_mma_view,
    group_list_from_counts,
    hand_over,
    handed_over,
    keep_on_current,
    kept_routing,
    pack_ue8m0,
    rows_by_expert,
    start_mark,
    sum_weighted_rows,
)

from .buffers import SharedBuffer


@dataclass(frozen=True)
class NormalHandle:
    owner: object
    vendor_handle: tuple
    row_token: torch.Tensor | None  # [rows] received-token index of each expert row (None: TOKEN_MAJOR rows)
    row_weight: torch.Tensor | None  # [rows] fp32 weight of each expert row
    num_received: int


@dataclass(frozen=True, eq=False)  # by identity: SharedBuffer.pending holds them weakly
class LowLatencyHandle:
    owner: object
    vendor_handle: tuple
    topk_ids: torch.Tensor  # the adapter's own copy of the dispatch's routing (``kept_routing``)
    topk_weights: torch.Tensor


def _handle_tensors(h: object) -> list[torch.Tensor]:
    """The tensors of a dispatch's handle that its combine reads on the combine's stream, DeepEP's own handle's
    included (a normal combine run whole records nothing itself)."""
    if isinstance(h, LowLatencyHandle):
        return [*(t for t in h.vendor_handle if isinstance(t, torch.Tensor)), h.topk_ids, h.topk_weights]
    if isinstance(h, NormalHandle):
        rows = [] if h.row_token is None else [h.row_token, h.row_weight]
        return [*(t for t in h.vendor_handle if isinstance(t, torch.Tensor)), *rows]
    return []


class DeepEPDispatcher:
    """One layer on a ``deep_ep.Buffer`` shared with the backend's other layers. ``dispatch_config``/
    ``combine_config``: DeepEP's own ``Config`` objects (normal mode); ``topk_idx_dtype``: ``deep_ep.topk_idx_t``,
    which every top-k index tensor handed to DeepEP must have."""

    def __init__(self, ctx: mdb.DispatchContext, shared: SharedBuffer, dispatch_config: Any, combine_config: Any,
                 topk_idx_dtype: torch.dtype = torch.int64, capturing: Callable[[], bool] = lambda: False) -> None:
        self.shared = shared
        self._capturing = capturing  # torch.cuda.is_current_stream_capturing() on the vendor's device
        self.spec, self.codec, self.dtype = ctx.spec, ctx.codec, ctx.dtype
        self.local_experts = ctx.local_experts
        self.dispatch_config, self.combine_config = dispatch_config, combine_config
        self.topk_idx_dtype = topk_idx_dtype
        self.low_latency = ctx.spec.mode is md.Mode.LOW_LATENCY
        self.token_major = ctx.spec.layout is md.Layout.TOKEN_MAJOR
        self.ue8m0 = ctx.codec.wire.ue8m0
        self.x_global_scale: torch.Tensor | None = None
        if self.dtype is md.DispatchDtype.NVFP4:
            self.x_global_scale = torch.tensor(float(ctx.spec.quant.input_global_scale), dtype=torch.float32,
                                               device=ctx.device)

    @property
    def buffer(self) -> Any:
        """The ``deep_ep.Buffer`` (the process's, shared with the other layers)."""
        return self.shared.buffer

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> md.DispatchOutput:
        return self._dispatch(x, topk_ids, topk_weights, split=False)(None)

    def combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput) -> torch.Tensor:
        return self._combine(expert_output, dispatch_output, split=False)(None)

    # -- split phase (capabilities.split_phase) ----------------------------------------------------------------

    def dispatch_start(self, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> md.Pending[md.DispatchOutput]:
        """LL: DeepEP's send kernel (``return_recv_hook=True``); ``wait()`` runs the hook (the receive kernel,
        stream-ordered, no host wait) and builds the output. Normal: the host waits in DeepEP's notify until every
        rank has entered dispatch, then the data kernel runs on DeepEP's comm stream (``async_finish``); ``wait()``
        orders the current stream after it and expands the rows.

        A ``wait()`` on another stream than the start's first waits for where the start ended (``start_mark``: DeepEP
        may have run the call whole, ending with the start's stream waiting for its own), then records there the
        DeepEP outputs it reads and the tensors it hands out (``moe_dispatch.backend.hand_over``)."""
        finish = self._dispatch(x, topk_ids, topk_weights, split=True)
        mark = start_mark(x)  # after DeepEP's calls: the mark follows everything the start queued
        return md.Pending(handed_over(lambda: finish(mark), mark), overlapped=self._ran_split())

    def combine_start(self, expert_output: torch.Tensor,
                      dispatch_output: md.DispatchOutput) -> md.Pending[torch.Tensor]:
        finish = self._combine(expert_output, dispatch_output, split=True)
        mark = start_mark(expert_output)
        return md.Pending(handed_over(lambda: finish(mark), mark), overlapped=self._ran_split())

    def _ran_split(self) -> bool:
        """Whether the call just started is still on its way: not an LL call under capture (the capture records
        it whole, its receive included), nor a normal call on an LL Buffer past 8 ranks (``_normal_splits``)."""
        return not self._capturing() if self.low_latency else self._normal_splits()

    def _dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  split: bool) -> Callable[[StartMark | None], md.DispatchOutput]:
        self._settle()
        if self.low_latency:
            return self._dispatch_low_latency(x, topk_ids, topk_weights, split)
        return self._dispatch_normal(x, topk_ids, topk_weights, split)

    def _combine(self, expert_output: torch.Tensor, dispatch_output: md.DispatchOutput,
                 split: bool) -> Callable[[StartMark | None], torch.Tensor]:
        self._settle()
        h = dispatch_output.handle
        # The handle's tensors were made on the dispatch's stream; combine reads them on this one (an engine may
        # combine on another): recorded here, their memory is not reused under that read.
        keep_on_current(_handle_tensors(h))
        if isinstance(h, LowLatencyHandle):
            return self._combine_low_latency(expert_output, h, split)
        return self._combine_normal(expert_output, h, split)

    def _settle(self) -> None:
        """Before any call on the shared Buffer: one LL call may await its receive there
        (``vendor.LL_CALLS_AWAITING_RECEIVE``), so run the one awaited, from whichever layer, first."""
        self.shared.check_open()
        self._receivable(self.shared.unreceived)
        self.shared.settle()

    def _receive(self, receipt: Any) -> None:
        self._receivable(receipt)
        self.shared.receive(receipt)

    def _receivable(self, receipt: Any) -> None:
        """A receive still to run would be captured into an open CUDA graph instead of running now (the eager call
        never received; each replay a stray receive kernel): refused."""
        if receipt is not None and receipt.pending and self._capturing():
            raise md.InvalidSpecError(
                "a low-latency call started eagerly on the process's DeepEP Buffer awaits its receive: inside a "
                "CUDA-graph capture its hook would be captured instead of run. wait() for every started call before "
                "capturing", parameter="cuda_graph_capture", value="a receive awaited",
                allowed="a capture with every started call waited")

    def _combine_low_latency(self, expert_output: torch.Tensor, h: LowLatencyHandle,
                             split: bool) -> Callable[[StartMark | None], torch.Tensor]:
        rows = expert_output.to(torch.bfloat16).contiguous()  # DeepEP asserts a dense bf16 [E_l, R·T, H]
        capturing = self._before_low_latency(dispatch=False)
        hook_mode = split and not capturing  # a capture records the whole call, its receive included
        combined, _, hook = self.buffer.low_latency_combine(rows, h.topk_ids, h.topk_weights, h.vendor_handle,
                                                            return_recv_hook=hook_mode)
        receive = self.shared.sent(hook)
        self.shared.pending.discard(h)
        self.shared.captured_pending.discard(h)

        def finish(mark: StartMark | None) -> torch.Tensor:
            self._receive(receive)
            return combined
        return finish

    def _combine_normal(self, expert_output: torch.Tensor, h: NormalHandle,
                        split: bool) -> Callable[[StartMark | None], torch.Tensor]:
        split = split and self._normal_splits()  # _settle checked the Buffer is open
        partial = (expert_output.contiguous() if h.row_token is None else  # TOKEN_MAJOR: weighted by the engine
                   sum_weighted_rows(expert_output, h.row_token, h.row_weight, h.num_received).to(torch.bfloat16))
        combined, _, event = self.buffer.combine(partial, h.vendor_handle, config=self.combine_config,
                                                 **self._async_kwargs(split))
        self.shared.after_normal()

        def finish(mark: StartMark | None) -> torch.Tensor:
            if split:
                event.current_stream_wait()
            return combined
        return finish

    def _async_kwargs(self, split: bool, after: Any = None) -> dict[str, Any]:
        """Normal mode in split phase: DeepEP's kernels on its comm stream, after ``after`` (an earlier call's event)
        or what the current stream has queued so far, outputs allocated there; ``wait()`` orders the current stream
        after them."""
        if not split:
            return {}
        return {"previous_event": after if after is not None else self.buffer.capture(), "async_finish": True,
                "allocate_on_comm_stream": True}

    def _normal_splits(self) -> bool:
        """Not on an LL Buffer past 8 ranks: there the core's combine cleans the LL signalling on the current stream
        right after (``SharedBuffer.after_normal``), which an async combine on the comm stream would still be
        writing (csrc/legacy/buffer.hpp clean_low_latency_buffer, internode combine): those calls run whole."""
        return not (self.shared.held.low_latency_mode and self.shared.internode)

    def _before_low_latency(self, dispatch: bool) -> bool:
        """The shared Buffer's checks and cleaning before an LL call; whether the call is being captured."""
        s, capturing = self.spec, self._capturing()
        self.shared.before_low_latency(s.num_max_dispatch_tokens_per_rank, s.hidden_size, s.num_experts, capturing,
                                       dispatch)
        return capturing

    def _output(self, hidden: torch.Tensor, scale: torch.Tensor | None, counts: torch.Tensor, layout: md.Layout,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: Any,
                **rows: torch.Tensor) -> md.DispatchOutput:
        group_list = group_list_from_counts(counts, self.spec.group_list_type)
        return md.DispatchOutput(hidden, scale, topk_ids, topk_weights, group_list, self.spec.group_list_type, layout,
                                 self.dtype, handle, self.spec.quant.input_global_scale, **rows)

    def _ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return topk_ids.to(self.topk_idx_dtype).contiguous()

    def _dispatch_normal(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         split: bool) -> Callable[[StartMark | None], md.DispatchOutput]:
        split = split and self._normal_splits()  # _settle checked the Buffer is open
        ids = self._ids(topk_ids)
        weights = topk_weights.float().contiguous()
        if self.dtype is md.DispatchDtype.FP8:
            q = self.codec.quantize(x)
            # UE8M0: DeepEP carries the scale columns as opaque 4-byte words, so pack four
            # exponents per int32 (H/128 bytes per token, not 4·H/128).
            vendor_x: Any = (q.data, pack_ue8m0(q.scale) if self.ue8m0 else q.scale)
        else:
            vendor_x = x.contiguous()
        # In split phase the layout runs on the comm stream too, after everything above (its previous_event), and the
        # dispatch after the layout (as sglang does): the current stream never waits for the comm stream's earlier
        # work (another micro-batch's exchange).
        per_rank, per_rdma_rank, per_expert, in_rank, layout_done = self.buffer.get_dispatch_layout(
            ids, self.spec.num_experts, **self._async_kwargs(split))
        recv_x, recv_ids, recv_weights, per_expert_list, handle, event = self.buffer.dispatch(
            vendor_x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
            topk_weights=weights, config=self.dispatch_config, **self._async_kwargs(split, after=layout_done))
        self.shared.after_normal_dispatch()

        def finish(mark: StartMark | None) -> md.DispatchOutput:
            if split:
                event.current_stream_wait()
            data, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            # Read below on the waiting stream, then freed: DeepEP recorded them on its comm and start streams only.
            hand_over(mark, (data, scale, recv_ids, recv_weights))
            # TOKEN_MAJOR: DeepEP's own layout. Ids local, -1 elsewhere with weight 0 (csrc/kernels/legacy/
            # intranode.cu:383-391, internode.cu:1178-1184); the counts list filled before the kernels
            # (csrc/legacy/buffer.hpp:598, 1108); combine adds the rows without weights (deep_ep/buffers/legacy.py:416).
            if self.token_major:
                counts = torch.tensor(per_expert_list, dtype=torch.int64, device=recv_ids.device)
                return self._output(data, scale, counts, md.Layout.TOKEN_MAJOR, topk_ids, topk_weights,
                                    NormalHandle(self, handle, None, None, data.shape[0]),
                                    row_topk_ids=recv_ids.long(), row_topk_weights=recv_weights.float())
            row_slot, counts = rows_by_expert(recv_ids.long(), self.local_experts)
            row_token = torch.div(row_slot, recv_ids.shape[1], rounding_mode="floor")
            handle_out = NormalHandle(self, handle, row_token, recv_weights.reshape(-1)[row_slot].float(),
                                      data.shape[0])
            return self._output(data.index_select(0, row_token),
                                None if scale is None else scale.index_select(0, row_token),
                                counts, md.Layout.PACKED, topk_ids, topk_weights, handle_out)
        return finish

    def _dispatch_low_latency(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                              split: bool) -> Callable[[StartMark | None], md.DispatchOutput]:
        ids = self._ids(topk_ids)
        x = x.contiguous()
        T, E = self.spec.num_max_dispatch_tokens_per_rank, self.spec.num_experts
        capturing = self._before_low_latency(dispatch=True)
        hook_mode = split and not capturing  # a capture records the whole call, its receive included
        if self.dtype is md.DispatchDtype.NVFP4:
            recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
                x, ids, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=self.x_global_scale,
                return_recv_hook=hook_mode)
        else:
            recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
                x, ids, T, E, use_fp8=self.dtype is md.DispatchDtype.FP8, round_scale=self.ue8m0,
                use_ue8m0=self.ue8m0, return_recv_hook=hook_mode)
        receive = self.shared.sent(hook)
        # DeepEP's low-latency combine takes the top-k ids and weights again (it weights the rows itself): keep the
        # dispatch's, not the caller's tensors, which the engine may overwrite before combine ([T, k]: a small copy).
        ll_handle = LowLatencyHandle(self, handle, kept_routing(ids, topk_ids),
                                     kept_routing(topk_weights.float().contiguous(), topk_weights))
        (self.shared.captured_pending if capturing else self.shared.pending).add(ll_handle)

        def finish(mark: StartMark | None) -> md.DispatchOutput:
            self._receive(receive)  # the data, counts and handle are DeepEP's only after its receive
            # Made on the start's stream and read on the waiting one (the counts; NVFP4's swizzled scales).
            hand_over(mark, (recv_count, recv_x[1] if self.dtype is md.DispatchDtype.NVFP4 else None))
            if self.dtype is md.DispatchDtype.NVFP4:
                packed, mma = recv_x
                # Expert-last [R·T, H/2, E_l] → MASKED [E_l, R·T, H/2] (a view); scales from the
                # swizzled MMA layout back to linear rows (a copy of E_l·R·T·H/16 bytes).
                data = packed.permute(2, 0, 1)
                scale = from_mma_view(mma, data.shape[1], self.spec.hidden_size // 16)
            else:
                data, scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            return self._output(data, scale, recv_count, md.Layout.MASKED, topk_ids, topk_weights, ll_handle)
        return finish
