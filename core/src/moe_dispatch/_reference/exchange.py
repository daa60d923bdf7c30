"""The exchange both reference backends run on ``torch.distributed``: normal mode sends one wire row per (token,
destination rank) pair (the payload, then the token's expert ids and weights) after the counts exchange (its one host
sync) and expands them into PACKED rows (or hands them over as they are: TOKEN_MAJOR); low-latency mode all-gathers
``capacity`` fixed slots into the MASKED layout (no host sync). Combine adds in a fixed order, so results are
bit-identical run to run (docs/design.md)."""

from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import torch
import torch.distributed as dist

from .._codecs import as_bytes, from_bytes
from .._contract import DispatchContext
from .._distributed.comm import Comm, Transfer
from .._errors import CommunicationError
from .._output import DispatchOutput, group_list_from_counts
from .._pending import Pending
from .._wire import Layout, Mode
from .slots import Lease, SlotPool
from .sums import TokenTerms, chunk_bytes, even_blocks, sum_terms, token_major

if TYPE_CHECKING:
    from .receiver import Receiver

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NormalHandle:
    owner: object
    pair_token: torch.Tensor  # [P] source token of each sent pair, in (rank, token) order
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    num_received: int
    terms: "TokenTerms | None"  # each received token's expert rows and weights, ascending expert (None: TOKEN_MAJOR)
    returns: "TokenTerms"  # each own token's returned rows, in ascending rank order
    lease: Lease  # the slot this dispatch's buffers live in, until its combine


@dataclass(frozen=True, slots=True)
class MaskedHandle:
    owner: object
    num_tokens: int
    terms: "TokenTerms"  # each gathered slot's MASKED rows and weights, in ascending expert order
    lease: Lease


class ReferenceDispatcher:
    """Dispatch and combine of the ``torch`` and ``allgather`` backends."""

    def __init__(self, ctx: DispatchContext, *, send_to_all_ranks: bool) -> None:
        spec = ctx.spec
        self.comm, self.codec, self.rank, self.world = ctx.comm, ctx.codec, ctx.rank, ctx.world_size
        self.local_experts, self.top_k, self.hidden = ctx.local_experts, spec.top_k, spec.hidden_size
        self.capacity, self.group_list_type = spec.num_max_dispatch_tokens_per_rank, spec.group_list_type
        self.dtype, self.global_scale = ctx.dtype, spec.quant.input_global_scale
        self.send_to_all_ranks = send_to_all_ranks
        self.payload_width = ctx.codec.wire.bytes_per_token
        self.sections = (("payload", self.payload_width), ("metadata", 8 * spec.top_k))  # k int32 ids, k fp32 weights
        self.low_latency, self.token_major = spec.mode is Mode.LOW_LATENCY, spec.layout is Layout.TOKEN_MAJOR
        #: On host memory, the paths tuned for it: low-latency mode reads the counts and expands only the entries that
        #: exist (compact.py). False: an accelerator's paths on any device (the core's tests check them on CPU).
        self.host_paths = True
        self._constants: dict[str, object] = {}
        #: Send, receive, expanded-row and accumulator buffers, reused call after call (slots.py).
        self.slots = SlotPool()
        #: A started call's failure on the receiver thread (receiver.py): later calls refuse to start.
        self.failed_in_background: BaseException | None = None
        #: With peers on host memory (gloo), on a group of every rank, started calls run on the group's receiver
        #: thread, on the started calls' group, made here where every rank is. Not on a subgroup: ``dist.new_group``
        #: names a group made by its members alone by the groups each process has, which differ between ranks once
        #: subgroups have come and gone (the ranks would wait for each other's group forever).
        self._receiver: "Receiver | None" = None
        self._started_comm: Comm | None = None
        if (self.world > 1 and self.comm.device is not None and self.comm.device.type == "cpu"
                and self.world == dist.get_world_size()):
            from .receiver import receiver_for  # the receiver thread: host memory with peers only
            self._receiver = receiver_for(self.comm)
            assert self._receiver.group is not None
            self._started_comm = self.comm.for_started_calls(self._receiver.group)
        if self.low_latency:
            self._reserve(ctx.in_flight, ctx.device)

    def _reserve(self, slots: int, device: torch.device) -> None:
        """Low-latency mode: ``slots`` slots sized at creation (a dispatch's buffers follow from the capacity), so
        that a capacity the memory cannot hold fails here, not at the first dispatch; combine's smaller ones are
        sized at the first combine. A dispatch of an empty batch per slot, each holding its slot until all are
        sized: the same code and buffers as a real call, and a collective like the rest of creation."""
        empty = (torch.empty(0, self.hidden, dtype=torch.bfloat16, device=device),
                 torch.empty(0, self.top_k, dtype=torch.int64, device=device),
                 torch.empty(0, self.top_k, dtype=torch.float32, device=device))
        before = self.comm.traffic.copy()
        for out in [finish() for finish in [self._start_masked(*empty, self.comm) for _ in range(slots)]]:
            out.handle.lease.release()
        self.comm.traffic.restore(before)  # the planning is not the engine's traffic

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchOutput:
        return self._start_dispatch(hidden_states, topk_ids, topk_weights, self.comm)()

    def dispatch_start(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> Pending[DispatchOutput]:
        return self._started(functools.partial(self._start_dispatch, hidden_states, topk_ids, topk_weights),
                             hidden_states)

    def _start_dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        comm: Comm) -> Callable[[], DispatchOutput]:
        self._check_background()
        if self.low_latency:
            return self._start_masked(x, topk_ids, topk_weights, comm)
        return self._start_packed(x, topk_ids, topk_weights, comm)

    def _started(self, start: Callable[[Comm], Callable[[], T]], like: torch.Tensor) -> Pending[T]:
        """A started call's ``Pending``: with peers on host memory both halves run on the group's receiver thread,
        and the caller returns at once; otherwise the start runs here and the receive at ``wait()``."""
        receiver = self._receiver
        if receiver is None:
            if not like.is_cuda:
                return Pending(start(self.comm))
            from .._streams import handed_over, start_mark
            return Pending(handed_over(start(self.comm), start_mark(like)))
        self._check_background()  # refused here, before the call is queued
        begun = receiver.submit(functools.partial(self._in_background, "start", self._begin, start,
                                                  self.comm.take_call(), receiver))
        return Pending(lambda: begun.result().result())

    def _begin(self, start: Callable[[Comm], Callable[[], T]], call: tuple[int, int] | None,
               receiver: Receiver) -> "Future[T]":
        """On the receiver thread: the call's start (its collectives), then its receive queued ahead of the starts
        queued meanwhile (``Receiver.submit_receive``)."""
        comm = self._started_comm
        assert comm is not None
        comm.resume_call(call)
        finish = start(comm)
        return receiver.submit_receive(functools.partial(self._in_background, "receive", finish))

    def _in_background(self, stage: str, job: Callable[..., T], *args: object) -> T:
        """On the receiver thread: the first failure there is kept and told to the peers, so that the next call
        refuses to start even when the engine dropped this call's ``Pending`` and never sees the error."""
        begun_at = self._started_comm.started  # type: ignore[union-attr]
        try:
            return job(*args)
        except BaseException as exc:
            if self.failed_in_background is None:
                self.failed_in_background = exc
            if not isinstance(exc, CommunicationError):  # a peer's failure or a timeout: the peers know already
                self._started_comm.abandon(stage, exc, begun_at)  # type: ignore[union-attr]
            raise

    def _check_background(self) -> None:
        exc = self.failed_in_background
        if exc is not None:
            raise CommunicationError(f"a started call failed on this rank while receiving ({type(exc).__name__}: "
                                     f"{exc}); the process group must be rebuilt") from exc

    def _token_rows(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
        """One wire row per token, in ``out``: the payload, then its global top-k ids (int32) and fp32 weights. On host
        memory a quantizing codec takes 1 MiB of fp32 at a time: whole fresh temporaries page-fault on every call."""
        meta, T = [as_bytes(ids.to(torch.int32)), as_bytes(weights.to(torch.float32))], x.shape[0]
        host = self.host_paths and x.is_cpu and self.codec.wire.scale_bytes
        step = ((1 << 20) // (4 * self.hidden) or 1) if host else max(T, 1)
        for a in range(0, T, step):
            self.codec.encode(x[a : a + step], [m[a : a + step] for m in meta], out[a : a + step])
        return out

    def _split_rows(self, rows: torch.Tensor):  # type: ignore[no-untyped-def]
        """Views into received wire rows: payload, each entry's local expert (outside ``0..local_experts-1``: one
        elsewhere, or none), weights."""
        pw, k, El = self.payload_width, self.top_k, self.local_experts
        gids = from_bytes(rows[:, pw : pw + 4 * k], torch.int32)
        first = self._constant(f"first {rows.device}", lambda: torch.tensor([self.rank * El], device=rows.device))
        return self.codec.from_bytes(rows[:, :pw]), gids - first, from_bytes(rows[:, pw + 4 * k :], torch.float32)

    def _constant(self, name: str, make: Callable[[], T]) -> T:
        """Tensors that follow from the spec alone, made once; not kept from a CUDA-graph capture (no values yet)."""
        made = self._constants.get(name)
        if made is None:
            made = make()
            if not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
                self._constants[name] = made
        return made  # type: ignore[return-value]

    def _start_packed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      comm: Comm) -> Callable[[], DispatchOutput]:
        R, El, T = self.world, self.local_experts, x.shape[0]
        if self.send_to_all_ranks:
            in_rank = torch.ones(R, T, dtype=torch.bool, device=x.device)
        else:  # [R, T]; floor division keeps -1 (no expert) below every rank
            ranks = self._constant(f"ranks {x.device}", lambda: torch.arange(R, device=x.device).view(R, 1, 1))
            in_rank = (torch.div(topk_ids, El, rounding_mode="floor") == ranks).any(2)
        pairs = in_rank.view(-1).nonzero().squeeze(1)  # r·T + t: by rank, then token
        pair_token = pairs % max(T, 1)
        ends = torch.searchsorted(pairs, self._constant(f"rank ends {x.device}", lambda: torch.arange(
            1, R + 1, device=x.device)) * T).tolist()  # the host sync
        send_counts = [end - start for start, end in zip([0, *ends], ends)]
        lease = self.slots.acquire()
        slot, width = lease.slot, self.payload_width + 8 * self.top_k
        rows = self._token_rows(x, topk_ids, topk_weights, slot.take("token_rows", (T, width), torch.uint8, x.device))
        send = torch.index_select(rows, 0, pair_token, out=slot.take("send", (pair_token.numel(), width), rows.dtype,
                                                                         rows.device))
        recv_counts = comm.exchange_counts(send_counts, x.device).tolist()
        transfer = comm.all_to_all_start(send, send_counts, recv_counts, self.sections,
                                         out=None if self.world == 1 else
                                         slot.take("recv", (sum(recv_counts), send.shape[1]), send.dtype, send.device))
        self.slots.keep_until_done(lease, transfer)
        return functools.partial(self._finish_packed, transfer, lease, topk_ids, topk_weights, pair_token,
                                 send_counts, recv_counts)

    def _finish_packed(self, transfer: Transfer, lease: Lease, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       pair_token: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> DispatchOutput:
        El, k, slot, T = self.local_experts, self.top_k, lease.slot, topk_ids.shape[0]
        recv = transfer.wait()
        q, local, rweights = self._split_rows(recv)
        chunk = chunk_bytes(recv.device, self.host_paths)
        returns = token_major(pair_token, T, self.hidden, chunk)
        if self.token_major:  # the received rows as they are, made contiguous
            mine = (local >= 0) & (local < El)
            local, counts = torch.where(mine, local, -1), torch.bincount(local[mine], minlength=El)
            hidden = slot.take("rows", q.data.shape, q.data.dtype, q.data.device).copy_(q.data)
            scale = None if q.scale is None else slot.take("row_scales", q.scale.shape, q.scale.dtype,
                                                           q.scale.device).copy_(q.scale)
            handle = NormalHandle(self, pair_token, send_counts, recv_counts, T, recv.shape[0], None, returns, lease)
            return DispatchOutput(hidden, scale, topk_ids, topk_weights,
                                  group_list_from_counts(counts, self.group_list_type), self.group_list_type,
                                  Layout.TOKEN_MAJOR, self.dtype, handle, self.global_scale,
                                  row_topk_ids=local, row_topk_weights=torch.where(mine, rweights, 0.0))
        # Rows per (token, local expert), grouped by expert, token order within: a stable sort puts the entries for
        # experts elsewhere before and after; the experts' ends give the counts and the rows (a host read).
        by_expert = torch.sort(local.reshape(-1), stable=True)
        bounds = self._constant(f"bounds {recv.device}", lambda: torch.arange(El + 1, device=recv.device))
        ends_t = torch.searchsorted(by_expert.values, bounds)
        ends, counts = ends_t.tolist(), ends_t.diff()
        row_slot = by_expert.indices[ends[0] : ends[El]]
        row_token = torch.div(row_slot, k, rounding_mode="floor")
        hidden = _select_rows(q.data, row_token, slot.take, "rows")
        scale = None if q.scale is None else _select_rows(q.scale, row_token, slot.take, "row_scales")
        handle = NormalHandle(
            owner=self, pair_token=pair_token, send_counts=send_counts, recv_counts=recv_counts, num_tokens=T,
            num_received=recv.shape[0], lease=lease,
            terms=token_major(row_token, recv.shape[0], self.hidden, chunk, torch.take(rweights, row_slot)),
            returns=returns)
        return DispatchOutput(hidden, scale, topk_ids, topk_weights,
                              group_list_from_counts(counts, self.group_list_type), self.group_list_type, Layout.PACKED,
                              self.dtype, handle, self.global_scale)

    def _start_masked(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      comm: Comm) -> Callable[[], DispatchOutput]:
        R, k, C, T = self.world, self.top_k, self.capacity, x.shape[0]
        lease = self.slots.acquire()
        slot = lease.slot
        send = slot.take("send", (C, self.payload_width + 8 * k), torch.uint8, x.device)
        self._token_rows(x, topk_ids, topk_weights, out=send[:T])
        if T < C:  # empty slots route nowhere: zero payload, ids -1 (all bits set)
            send[T:] = 0
            send[T:, self.payload_width : self.payload_width + 4 * k] = 255
        transfer = comm.all_gather_start(send, self.sections, out=None if R == 1 else
                                         slot.take("recv", (R * C, send.shape[1]), send.dtype, send.device))
        self.slots.keep_until_done(lease, transfer)
        return functools.partial(self._finish_masked, transfer, lease, topk_ids, topk_weights)

    def _finish_masked(self, transfer: Transfer, lease: Lease, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> DispatchOutput:
        El, slot = self.local_experts, lease.slot
        q, local, gweights = self._split_rows(transfer.wait())  # local: [R·C, k]
        if self.host_paths and topk_ids.is_cpu:
            from .compact import masked_rows  # reads the counts: host memory only
            hidden, scale, counts, terms = masked_rows(q, local, El, gweights, self.hidden, slot)
        else:
            from .static import masked_rows as static_rows  # static shapes, no host read: an accelerator's
            hidden, scale, counts, terms = static_rows(q, local, El, gweights, self.hidden, slot, self._constant)
        handle = MaskedHandle(owner=self, num_tokens=topk_ids.shape[0], lease=lease, terms=terms)
        return DispatchOutput(hidden, scale, topk_ids, topk_weights,
                              group_list_from_counts(counts, self.group_list_type), self.group_list_type,
                              Layout.MASKED, self.dtype, handle, self.global_scale)

    def _masked_returns(self, T: int, device: torch.device) -> TokenTerms:
        """Low-latency combine's second half: token c's partials come back from every rank at rows r·C + c, added in
        rank order; token-major, so that the first T tokens' entries are a prefix of the capacity's."""
        R, C = self.world, self.capacity
        rows, token = self._constant(f"returns {device}", lambda: (
            (torch.arange(C, device=device).unsqueeze(1) + C * torch.arange(R, device=device)).reshape(-1),
            torch.arange(C, device=device).repeat_interleave(R)))
        return TokenTerms(rows[: R * T], token[: R * T], None, None,
                          even_blocks(T, R, self.hidden, chunk_bytes(device, self.host_paths)))

    def combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> torch.Tensor:
        return self._start_combine(expert_output, dispatch_output, self.comm)()

    def combine_start(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput) -> Pending[torch.Tensor]:
        return self._started(functools.partial(self._start_combine, expert_output, dispatch_output), expert_output)

    def _start_combine(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput,
                       comm: Comm) -> Callable[[], torch.Tensor]:
        self._check_background()
        handle = dispatch_output.handle
        if isinstance(handle, MaskedHandle):
            return self._start_combine_masked(expert_output, handle, comm)
        return self._start_combine_packed(expert_output, handle, comm)

    def _returned(self, handle: "NormalHandle | MaskedHandle", transfer: Transfer, returns: TokenTerms,
                  device: torch.device) -> torch.Tensor:
        """Combine's second half: each token's rows from the ranks, added in rank order."""
        back = transfer.wait()
        out = torch.empty(handle.num_tokens, self.hidden, dtype=torch.bfloat16, device=device)
        sum_terms(out, from_bytes(back, torch.bfloat16), returns, handle.lease.slot)
        # The slot's buffers may now serve a later dispatch. A combine that raised keeps them (a retry at world size
        # 1 needs them); its handle gives them back when it is collected.
        handle.lease.release()
        return out

    def _start_combine_packed(self, y: torch.Tensor, h: NormalHandle, comm: Comm) -> Callable[[], torch.Tensor]:
        H, slot = self.hidden, h.lease.slot
        if h.terms is None:  # TOKEN_MAJOR: the engine has weighted and summed each row's local experts
            send = y.contiguous()
        else:
            send = slot.take("partial_bf16", (h.num_received, H), torch.bfloat16, y.device)
            sum_terms(send, y, h.terms, slot)
        transfer = comm.all_to_all_start(as_bytes(send), h.recv_counts, h.send_counts, (("combine", 2 * H),),
                                         out=None if self.world == 1 else
                                         slot.take("back", (sum(h.send_counts), 2 * H), torch.uint8, y.device))
        self.slots.keep_until_done(h.lease, transfer)
        return functools.partial(self._returned, h, transfer, h.returns, y.device)

    def _start_combine_masked(self, y: torch.Tensor, h: MaskedHandle, comm: Comm) -> Callable[[], torch.Tensor]:
        R, C, H, T, slot = self.world, self.capacity, self.hidden, h.num_tokens, h.lease.slot
        send = slot.take("partial_bf16", (R * C, H), torch.bfloat16, y.device)
        sum_terms(send, y.reshape(-1, H), h.terms, slot)
        transfer = comm.all_to_all_start(as_bytes(send), None, None, (("combine", 2 * H),),
                                         out=None if R == 1 else
                                         slot.take("back", (R * C, 2 * H), torch.uint8, y.device))
        self.slots.keep_until_done(h.lease, transfer)
        return functools.partial(self._returned, h, transfer, self._masked_returns(T, y.device), y.device)


def _select_rows(src: torch.Tensor, index: torch.Tensor, take,  # type: ignore[no-untyped-def]
                 name: str) -> torch.Tensor:
    raw = src.view(torch.uint8) if src.element_size() == 1 else src  # float8 has no index_select(out=)
    out = take(name, (index.numel(), *raw.shape[1:]), raw.dtype, raw.device)
    return torch.index_select(raw, 0, index, out=out).view(src.dtype)
