"""A fake of DeepEP 2.x's ``deep_ep`` (main @ dd758ca): the V1 ``Buffer`` of ``deep_ep/buffers/legacy.py``
over its pybind runtime (``csrc/legacy/buffer.hpp``), on torch.distributed (gloo on CPU).

As strict as the vendor where the adapter can meet it:

- ``Config`` is a bound class, not a dataclass: it exposes only ``get_nvl_buffer_size_hint`` and
  ``get_rdma_buffer_size_hint`` (positional), no fields; ``dispatch``/``combine`` hand ``config`` to the
  runtime, which raises pybind's ``TypeError`` for anything that is not a ``Config``.
- Every ``EP_HOST_ASSERT`` of the functions the adapter reaches raises ``RuntimeError("Assertion exception
  (...)")`` as pybind turns DeepEP's ``EPException`` into; Python ``assert``s raise ``AssertionError``;
  device asserts raise the CUDA error. Buffer sizes are checked with the exact formulas DeepEP asserts.
- The constructor writes the ``NVSHMEM_*`` variables into ``os.environ`` when it would start NVSHMEM, reads
  ``NVSHMEM_QP_DEPTH`` there, and the low-latency calls assert the QP depth; ``Buffer.num_sms`` is class
  state read by ``get_dispatch_config``/``get_combine_config``; ``check_torch_deterministic`` runs first in
  every dispatch and combine.
- Return tuples and handle tuples hold what DeepEP's do (normal: ``(rank_prefix_matrix,
  channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``;
  low-latency: ``(src_info, layout_range, T, hidden, num_experts)`` with ``layout_range`` packing the count
  in the low and the begin in the high 32 bits, ``pack2``), and combine reads only the handle.
- Low-latency receive tensors are ``torch::empty`` in DeepEP: rows past ``recv_count`` hold garbage (NaN
  here), and rows arrive in atomicAdd order: each source rank's block of an expert lands where the receiver's
  counter put it, its tokens in the sender's slot order (both shuffled here, seeded). The hook is None unless
  ``return_recv_hook``; with it the received data is there only after ``hook()``.
- The constructor runs DeepEP's ``check_nvlink_connections``: on a GPU whose name has 'PCIE'
  (``EMULATED_DEVICE_NAME``) more than two ranks is an ``AssertionError``.
- Device asserts trap and lose the process's CUDA context (``_native.lose_context``); so does using a Buffer
  whose NVSHMEM was finalized by another Buffer's ``destroy()`` (NVSHMEM is per process: ``NvshmemState``;
  csrc/kernels/backend/nvshmem.cu init/finalize; a second live init with another PE numbering fails DeepEP's
  ``nvshmem_rank == nvshmem::init(...)`` assert). ``destroy()`` is a collective (the intranode and NVSHMEM
  barriers). The destructor runs ``destroy()`` unless ``explicitly_destroy`` (then it only prints DeepEP's
  warning when ``destroy()`` was not called, and NVSHMEM stays initialized); a destructor's teardown is recorded
  in ``DESTRUCTOR_TEARDOWNS`` (its barriers hang when a peer died), and with NVL bytes on a group whose ``min(R,
  8)`` has no ``intranode::barrier`` kernel it throws inside a noexcept destructor, and the process aborts
  (``std::terminate``), as it does on a GPU.
- The LL signalling counts are modelled byte by byte (``_SignallingBytes``, from 42253d0): E's half i sits at
  ``align_up(4E, 128)·i``, ``4E`` bytes (``vendor.ll_signalling_halves``); the host toggles
  ``low_latency_buffer_idx`` at every LL dispatch and combine (a captured kernel keeps the half it was captured
  with); an LL kernel of E on half b needs its half-b range zero, leaves it written, zeroes the other half's range
  and writes its send/receive data from ``2·align_up(4E, 128)`` on (over a larger E's counts);
  ``clean_low_latency_buffer`` (a collective: barrier, clean, barrier) zeroes both halves of its E; internode
  normal-mode kernels write the whole RDMA region; intranode ones the NVL region only. A kernel that finds its
  range written loses the context (on a GPU: wrong rows or a hang). Before 42253d0 the counts moved with T and
  hidden too: only the same (T, H, E) finds them clean (``_LL_SIGNALLING_BY_EXPERTS``).
- ``CUDAGraph`` emulates ``torch.cuda.CUDAGraph`` for the LL calls: under ``capture()`` their host code runs and
  their kernels do not (no signalling state is read or changed); ``replay()`` runs the captured kernels again
  with the state they find then, and none of the Python around them. Normal-mode dispatch cannot be captured
  (it syncs the host). ``emulated_stream_capturing`` stands in for ``torch.cuda.is_current_stream_capturing``.
- Normal mode checks what the kernels device-assert about the hidden size (TMA staging) and, past 8 ranks,
  the internode host and device checks on the config, the QPs and the RDMA ranks a token reaches
  (``internode_dispatch_checks``) before refusing to move the data (internode is not emulated).

Results are real: bytes move between real processes through the core's ``Comm``, which, inside a dispatcher's
call, waits with that dispatcher's ``Watch`` (its ``timeout_s``, its peers' failure notices): the core's channel
beside the vendor's API, which takes a group and no deadline. Not emulated: CUDA
events and streams (calls are synchronous), cached-handle dispatch, internode (more than 8 ranks) normal-mode
data movement, LogFMT and zero-copy combine. Each call is recorded in ``Buffer.calls`` for the tests.

Version variants subclass ``Buffer`` and change its class-level rules (``fakes.deep_ep_v121_topk9``,
``fakes.deep_ep_hybrid``, ``fakes.deep_ep_topk_int32``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_dispatch.backend import Comm, as_bytes, from_bytes, ue8m0_value
from moe_dispatch_cuda_deepep import vendor

from ._native import (
    check_args,
    check_context,
    device_assert,
    ep_assert,
    incompatible,
    is_int,
    lose_context,
    scalar_type_check,
)

__version__ = "2.1.0"  # deepseek-ai/DeepEP@dd758ca deep_ep/__init__.py
topk_idx_t = torch.int64
#: ``cudaDeviceProp::multiProcessorCount`` of the emulated GPU (an H100/H200).
EMULATED_DEVICE_SMS = vendor.H100_NUM_SMS
#: ``torch.cuda.get_device_name()`` of the emulated GPU (an SXM H100; set an A100-PCIE name to see DeepEP's
#: ``check_nvlink_connections`` refuse more than two ranks).
EMULATED_DEVICE_NAME = "NVIDIA H100 80GB HBM3"
#: ``torch.cuda.get_device_capability()`` of the emulated GPU (``vendor.EMULATED_CAPABILITY_ATTRIBUTE``): DeepEP 2.x's
#: JIT builds ``sm_90a`` on it (csrc/jit/device_runtime.hpp:49-57); set (8, 0) to see the V2 probe refuse an A100.
EMULATED_DEVICE_CAPABILITY = (9, 0)
#: The fakes emulate one process's NVSHMEM (``NVSHMEM`` below), shared by every fake DeepEP module.
EMULATED_NVSHMEM = "moe_dispatch_cuda_deepep_testing.fakes (emulated process)"

_BUFFER_HPP = "csrc/legacy/buffer.hpp"
_CONFIG_HPP = "csrc/legacy/config.hpp"
_LL_CU = "csrc/kernels/legacy/internode_ll.cu"
_INTRANODE_CU = "csrc/kernels/legacy/intranode.cu"
_INTERNODE_CU = "csrc/kernels/legacy/internode.cu"


# -- pybind classes ---------------------------------------------------------------------------------------


class EventHandle:
    """``deep_ep._C.EventHandle``. The fake's calls are synchronous; an async call's outputs are garbage until the
    current stream waits on its event (DeepEP's kernels write them on the comm stream), so the fake fills them at
    ``current_stream_wait``."""

    def __init__(self) -> None:
        self._fills: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: Run first at the wait: a call whose kernels still read the caller's inputs checks them here.
        self._checks: list[Callable[[], None]] = []

    def current_stream_wait(self) -> None:
        checks, self._checks = self._checks, []
        for check in checks:
            check()
        fills, self._fills = self._fills, []
        for dst, src in fills:
            dst.copy_(src)


def inputs_unchanged_check(given: dict[str, torch.Tensor | None], where: str) -> Callable[[], None]:
    """For an async call whose kernels read the caller's tensors on the comm stream after the host returns: a write
    into them before the wait races with DeepEP (rows to the wrong experts, counts that disagree with the rows). The
    fake reads them at the call; this check, run at the wait (``EventHandle._checks``), refuses any change instead of
    delivering what DeepEP might not (fake). ``where``: the vendor's kernel lines that read them."""
    kept = {name: t.clone() for name, t in given.items() if t is not None}

    def check() -> None:
        for name, copy in kept.items():
            now = given[name]
            assert now is not None
            if not torch.equal(now.contiguous().view(torch.uint8), copy.contiguous().view(torch.uint8)):
                raise RuntimeError(f"(fake) {name} was written between the async call and its current_stream_wait(): "
                                   f"DeepEP's kernels still read it on the comm stream ({where})")
    return check


def _comm_stream_waits(previous_event: Any) -> None:
    """DeepEP's comm stream waits on ``previous_event`` before its kernels: what was written before it is there."""
    handle = getattr(previous_event, "event", None)
    if isinstance(handle, EventHandle):
        handle.current_stream_wait()


def _after_event(async_finish: bool, results: tuple) -> tuple[tuple, "EventOverlap"]:
    """The call's outputs and its ``EventOverlap``: with ``async_finish`` each tensor is a poisoned copy filled when
    the current stream waits on the event (reading it before is reading what the comm stream has not written)."""
    if not async_finish:
        return results, EventOverlap(None)
    handle = EventHandle()

    def shown(r: Any) -> Any:
        if isinstance(r, tuple):
            return tuple(shown(t) for t in r)
        if isinstance(r, torch.Tensor):
            copy = _poisoned_copy(r)
            handle._fills.append((copy, r))
            return copy
        return r

    return tuple(shown(r) for r in results), EventOverlap(handle)


class EventOverlap:
    """``deep_ep.utils.event.EventOverlap`` (deepseek-ai/DeepEP@dd758ca)."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None
        self.event.current_stream_wait()
        if release_handle:
            self.event = None

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.event is not None:
            self.current_stream_wait()


_CONFIG_SIGNATURE = ("deep_ep._C.Config(num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6, "
                     "num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6, "
                     "num_max_rdma_chunked_recv_tokens: int = 256)")


class Config:
    """``deep_ep._C.Config``: five ints in, ``EP_HOST_ASSERT``s on them, the RDMA receive chunk rounded up
    to the send chunk; two hint methods out. No readable fields (pybind binds none)."""

    __slots__ = ("_fields",)
    #: sizeof(topk_idx_t) in the hints (8 unless built with 32-bit top-k indices).
    _IDX_BYTES = 8

    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
                 num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256) -> None:
        values = (num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
                  num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)
        if not all(is_int(v) for v in values):
            raise TypeError(f"__init__(): incompatible constructor arguments. The following argument types are "
                            f"supported:\n    1. {_CONFIG_SIGNATURE}\n\nInvoked with: {values}")
        fields = vendor.ConfigFields(*(int(v) for v in values))
        for problem in fields.problems():
            ep_assert(False, problem, _CONFIG_HPP)
        object.__setattr__(self, "_fields", fields)

    def get_nvl_buffer_size_hint(self, arg0, arg1, /) -> int:
        check_args("get_nvl_buffer_size_hint", "(self: deep_ep._C.Config, arg0: int, arg1: int) -> int",
                   (arg0, arg1), "ui")
        try:
            return vendor.ported_nvl_buffer_size_hint(self._fields, int(arg0), int(arg1),
                                                      topk_idx_bytes=self._IDX_BYTES)
        except ValueError as exc:
            raise RuntimeError(f"Assertion exception ({_CONFIG_HPP}): {exc}") from None

    def get_rdma_buffer_size_hint(self, arg0, arg1, /) -> int:
        check_args("get_rdma_buffer_size_hint", "(self: deep_ep._C.Config, arg0: int, arg1: int) -> int",
                   (arg0, arg1), "ii")
        try:
            return vendor.ported_rdma_buffer_size_hint(self._fields, int(arg0), int(arg1),
                                                       topk_idx_bytes=self._IDX_BYTES)
        except ValueError as exc:
            raise RuntimeError(f"Assertion exception ({_CONFIG_HPP}): {exc}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"'deep_ep._C.Config' object has no attribute '{name}'")

    def __repr__(self) -> str:
        return "<deep_ep._C.Config object>"


def _fields(config: Any, function: str, args: tuple, config_class: type) -> vendor.ConfigFields:
    """What the runtime reads from a ``const Config&`` argument; pybind refuses anything else."""
    if not isinstance(config, config_class):
        raise incompatible(function, f"(self: deep_ep._C.Buffer, ..., arg{len(args)}: deep_ep._C.Config, ...)", args)
    return config._fields


def _low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts) -> int:
    """``deep_ep._C.get_low_latency_rdma_size_hint`` (ints only)."""
    args = (num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    check_args("get_low_latency_rdma_size_hint", "(arg0: int, arg1: int, arg2: int, arg3: int) -> int", args, "iiii")
    ep_assert((int(hidden) // 128) * 4 <= int(hidden), "num_scales * sizeof(float) <= hidden", _CONFIG_HPP)
    return vendor.ported_low_latency_rdma_size_hint(*(int(a) for a in args))


# -- the Buffer -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VendorCall:
    """What one faked call received: the method, the dtype of ``x``, the FP8 flag and the payload bytes
    this rank put on the wire."""

    method: str
    x_dtype: torch.dtype
    use_fp8: bool | None
    payload_bytes: int
    x_global_scale: Any = None  # hybrid-ep NVFP4: the tensor object passed


class NvshmemState:
    """NVSHMEM's per-process state as DeepEP drives it (deepseek-ai/DeepEP@dd758ca csrc/kernels/backend/nvshmem.cu;
    csrc/legacy/buffer.hpp sync): ``init`` splits a CPU RDMA team when ``team_split_stride`` (8 in LL mode) is
    below the PE count and asserts none exists yet; the Buffer then asserts that the PE NVSHMEM reports is the one
    it asked for, so a second live init with another PE numbering (a normal-mode Buffer past 8 ranks is PE
    ``rdma_rank``, an LL Buffer PE ``rank``) fails (``vendor.NVSHMEM_INIT_ASSERT``). A second live init with the
    same numbering is allowed and counted (``live_inits``): whether NVSHMEM takes it is for hardware to say.
    ``finalize`` (every ``Buffer::destroy`` with RDMA bytes) destroys the team and finalizes NVSHMEM for the whole
    process. ``generation`` counts finalizations: a Buffer initialized in an older one has lost its RDMA memory."""

    def __init__(self) -> None:
        self.generation = 0
        self.team = False
        self.inits = 0
        self.live: tuple[int, int] | None = None  # (PE, PE count) of the live init
        self.live_inits = 0

    def init(self, pe: int, num_pes: int, team_split_stride: int) -> int:
        if team_split_stride > 0 and num_pes > team_split_stride:
            ep_assert(not self.team, "cpu_rdma_team == NVSHMEM_TEAM_INVALID", _NVSHMEM_CU)
            ep_assert(num_pes % team_split_stride == 0, "num_ranks % team_split_stride == 0", _NVSHMEM_CU)
            self.team = True
        if self.live is not None and self.live != (pe, num_pes):
            ep_assert(False, f"{vendor.NVSHMEM_INIT_ASSERT} (NVSHMEM is live in this process as PE {self.live[0]} "
                             f"of {self.live[1]}; this Buffer asked for PE {pe} of {num_pes})", _BUFFER_HPP)
        self.live = (pe, num_pes)
        self.inits += 1
        self.live_inits += 1
        return self.generation

    def finalize(self) -> None:
        self.team = False
        self.live = None
        self.live_inits = 0
        self.generation += 1


_NVSHMEM_CU = "csrc/kernels/backend/nvshmem.cu"
#: This process's NVSHMEM.
NVSHMEM = NvshmemState()


def reset_nvshmem() -> None:
    """A fresh process's NVSHMEM (for the tests)."""
    NVSHMEM.__init__()
    DESTRUCTOR_TEARDOWNS.clear()


#: Each time a ``~Buffer`` ran ``destroy()`` (``explicitly_destroy=False``): its barriers wait for every rank, so a
#: peer that died makes this process hang there (at exit, when Buffers live as long as the process). The fake runs
#: no collective in a destructor; it records the hazard.
DESTRUCTOR_TEARDOWNS: list[str] = []

# -- CUDA graphs ------------------------------------------------------------------------------------------------

_CAPTURE: dict[str, Any] = {"graph": None, "recording": False, "replay_half": None}
_CAPTURING_NORMAL = "CUDA error: operation not permitted when stream is capturing"


def reset_capture() -> None:
    """No capture open (for the tests: a fresh process)."""
    _CAPTURE.update(graph=None, recording=False, replay_half=None)


def emulated_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()`` on the emulated device (``vendor.stream_capturing``)."""
    return _CAPTURE["graph"] is not None


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` for the fake's kernels. While ``capture()`` is open the host code of each LL call
    (and ``clean_low_latency_buffer``) runs, its asserts included, but its kernels do not: no signalling state is
    read or changed (the outputs are computed so that the caller can go on). ``replay()`` runs the captured kernels
    again, in order, with the state they find then, and writes their outputs into the captured output tensors;
    nothing of the Python code around them runs, as on a GPU. Normal-mode dispatch syncs the host and cannot be
    captured (``cudaErrorStreamCaptureUnsupported``)."""

    def __init__(self) -> None:
        self._launches: list[tuple[str, Callable[[], Any], Any]] = []

    @property
    def kernels(self) -> list[str]:
        """The captured calls, by method name (for the tests)."""
        return [name for name, _, _ in self._launches]

    @contextlib.contextmanager
    def capture(self) -> Any:
        if _CAPTURE["graph"] is not None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (nested capture)")
        _CAPTURE["graph"] = self
        try:
            yield self
        finally:
            _CAPTURE["graph"] = None

    def replay(self) -> None:
        check_context()
        for _, launch, captured in self._launches:
            _copy_into(captured, launch())


def _copy_into(captured: Any, fresh: Any) -> None:
    if isinstance(captured, torch.Tensor) and isinstance(fresh, torch.Tensor):
        captured.copy_(fresh)
    elif isinstance(captured, (tuple, list)) and isinstance(fresh, (tuple, list)):
        for a, b in zip(captured, fresh):
            _copy_into(a, b)


def _graph_kernel(method: Callable[..., Any]) -> Callable[..., Any]:
    """A Buffer method that launches kernels on the current stream: recorded into an open capture."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        graph = _CAPTURE["graph"]
        if graph is None or _CAPTURE["recording"]:
            return method(self, *args, **kwargs)
        _CAPTURE["recording"] = True
        try:
            result = method(self, *args, **kwargs)
        finally:
            _CAPTURE["recording"] = False
        half = getattr(self, "_ll_half_captured", None)  # the half the host code picked: fixed in the graph

        def launch() -> Any:
            _CAPTURE["replay_half"] = half
            try:
                return method(self, *args, **kwargs)
            finally:
                _CAPTURE["replay_half"] = None

        graph._launches.append((method.__name__, launch, result))
        return result

    return call


def _kernels_run() -> bool:
    """False while a capture records: host code runs, kernels do not."""
    return not _CAPTURE["recording"]


#: The low-latency signalling area right after DeepEP's constructor memsets the RDMA buffer: clean for any layout.
_CLEAN_FOR_ANY = ("any",)


class _SignallingBytes:
    """Which bytes at the front of an LL Buffer's RDMA region are written (nonzero), as disjoint ``[start, end)``
    ranges (``end`` may be infinite: data written past a point). Fresh from the constructor's memset: none."""

    def __init__(self) -> None:
        self.written: list[tuple[int, float]] = []

    def write(self, start: int, end: float) -> None:
        self.zero(start, end)
        self.written = sorted([*self.written, (start, end)])

    def zero(self, start: int, end: float) -> None:
        kept: list[tuple[int, float]] = []
        for a, b in self.written:
            if b <= start or a >= end:
                kept.append((a, b))
                continue
            if a < start:
                kept.append((a, start))
            if b > end:
                kept.append((int(end), b))
        self.written = kept

    def is_zero(self, start: int, end: int) -> bool:
        return all(b <= start or a >= end for a, b in self.written)


def _nan_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What ``torch::empty`` may hold, made visible: NaN (all-ones bytes for integer and FP8 types)."""
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.full(shape, -1, dtype=torch.int8 if dtype.itemsize == 1 else torch.int32).view(dtype)


def _internode_notify_checks(num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    """``notify_dispatch`` / ``cached_notify``: both buffers below INT_MAX bytes (an LL Buffer may hold more)."""
    ep_assert(num_rdma_bytes < vendor.INT_MAX, "num_rdma_bytes < std::numeric_limits<int>::max()", _INTERNODE_CU)
    ep_assert(num_nvl_bytes < vendor.INT_MAX, "num_nvl_bytes < std::numeric_limits<int>::max()", _INTERNODE_CU)


def internode_dispatch_checks(num_ranks: int, num_qps: int | None, cfg: vendor.ConfigFields, hidden_bytes: int,
                              num_scales: int, num_topk: int, topk_rdma_ranks: int = 0, num_nvl_bytes: int = 0,
                              num_rdma_bytes: int = 0) -> None:
    """What internode dispatch checks before moving data (deepseek-ai/DeepEP@dd758ca csrc/kernels/legacy/
    internode.cu notify_dispatch, dispatch): the buffers below INT_MAX (host), then the QPs against the config's
    SMs, the token's TMA staging, at most 8 RDMA ranks per token (``topk_rdma_ranks``: the most any token
    reaches)."""
    _internode_notify_checks(num_nvl_bytes, num_rdma_bytes)
    device_assert(num_qps is not None and vendor.internode_qps_ok(num_qps, cfg.num_sms),
                  "ibgda_get_state()->num_rc_per_pe == num_channels or ibgda_get_state()->num_rc_per_pe >= num_sms",
                  _INTERNODE_CU)
    per_token = vendor.internode_bytes_per_token(hidden_bytes, num_scales, num_topk, num_topk)
    device_assert(per_token + vendor.TMA_MBARRIER_BYTES <= vendor.INTERNODE_TMA_BYTES,
                  "num_bytes_per_token + sizeof(uint64_t) <= kNumTMABytesPerWarp", _INTERNODE_CU)
    device_assert(topk_rdma_ranks <= min(num_ranks // vendor.NUM_MAX_NVL_PEERS, vendor.NORMAL_MAX_TOPK_RDMA_RANKS),
                  "num_topk_ranks <= kNumTopkRDMARanks", _INTERNODE_CU)


def internode_combine_checks(num_ranks: int, cfg: vendor.ConfigFields, hidden: int, num_topk: int,
                             num_nvl_bytes: int = 0, num_rdma_bytes: int = 0) -> None:
    """``cached_notify``'s and ``internode::combine``'s host asserts (buffers below INT_MAX, the config) and the
    combine kernels' TMA device asserts."""
    _internode_notify_checks(num_nvl_bytes, num_rdma_bytes)
    for problem in vendor.internode_combine_config_problems(cfg.num_sms, cfg.num_max_nvl_chunked_send_tokens,
                                                            cfg.num_max_nvl_chunked_recv_tokens,
                                                            cfg.num_max_rdma_chunked_send_tokens, num_ranks):
        ep_assert(False, problem, _INTERNODE_CU)
    per_token = vendor.internode_bytes_per_token(2 * hidden, 0, 0, num_topk)
    device_assert(per_token + vendor.TMA_MBARRIER_BYTES <= vendor.INTERNODE_TMA_BYTES,
                  "num_bytes_per_token + sizeof(uint64_t) <= kNumTMABytesPerSenderWarp", _INTERNODE_CU)
    device_assert((2 * hidden // 16) % vendor.INTERNODE_COMBINE_HIDDEN_INT4_MULTIPLE == 0, "hidden_int4 % 32 == 0",
                  _INTERNODE_CU)


class _Runtime:
    """The per-Buffer state of ``deep_ep._C.Buffer`` that the fake needs."""

    def __init__(self, num_ranks: int, num_qps: int | None) -> None:
        self.num_rdma_ranks = max(1, num_ranks // vendor.NUM_MAX_NVL_PEERS)
        self.num_qps = num_qps  # NVSHMEM's IBGDA QPs per peer, when NVSHMEM was started
        self.low_latency_buffer_idx = 0
        self.destroyed = False

    def get_num_rdma_ranks(self) -> int:
        return self.num_rdma_ranks


def _check_torch_deterministic() -> None:
    # deepseek-ai/DeepEP@dd758ca deep_ep/utils/envs.py check_torch_deterministic
    assert not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory)


_FP8_MAX = torch.tensor(448.0, dtype=torch.float32)  # kFinfoAmaxE4M3
_FP8_MAX_INV = torch.tensor(1 / 448.0, dtype=torch.float32)  # kFinfoAmaxInvE4M3 = 1 / 448.0f


def _fast_log2_ceil(x: torch.Tensor) -> torch.Tensor:
    """``fast_log2_ceil``: the biased exponent - 127, plus one when any mantissa bit is set."""
    bits = x.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + (bits & 0x7FFFFF).ne(0).to(torch.int32)


def _quantize_fp8(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The LL kernel's cast (csrc/kernels/legacy/utils.cuh calculate_fp8_scales; internode_ll.cu dispatch): per
    128 channels amax starts at kFP8Margin (1e-4); ``scale = 448 / amax``, ``scale_inv = amax * (1 / 448.0f)``,
    or with ``round_scale`` both powers of two from ``fast_log2_ceil(amax * (1 / 448.0f))``; values times
    ``scale``, cast with saturation (``__NV_SATFINITE``)."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        exponent = _fast_log2_ceil(amax * _FP8_MAX_INV)  # fast_pow2(-e), fast_pow2(e): built from bits
        scale, inv = ue8m0_value((127 - exponent).to(torch.uint8)), ue8m0_value((127 + exponent).to(torch.uint8))
    else:
        scale, inv = _FP8_MAX / amax, amax * _FP8_MAX_INV
    data = (blocks * scale.unsqueeze(2)).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, h)
    return data, inv


def _channel_ranges(num_tokens: int, num_channels: int) -> list[tuple[int, int]]:
    """``get_channel_task_range``: channel c takes tokens [c·⌈N/C⌉, (c+1)·⌈N/C⌉) ∩ [0, N)."""
    per = -(-num_tokens // num_channels) if num_channels else 0
    return [(min(per * c, num_tokens), min(per * c + per, num_tokens)) for c in range(num_channels)]


class Buffer:
    """``deep_ep.Buffer`` (the V1 API; ``deep_ep/buffers/legacy.py`` on main)."""

    num_sms: int = vendor.DEFAULT_NUM_SMS
    #: Version rules a variant overrides (see the module docstring).
    _TOPK_IDX_T = topk_idx_t
    _CONFIG = Config
    _TUNED_DISPATCH = vendor.TUNED_DISPATCH
    _TUNED_COMBINE = vendor.TUNED_COMBINE
    _RDMA_RANKS = vendor.RDMA_RANKS
    _LL_MAX_TOPK = vendor.LL_MAX_TOPK
    _LL_HIDDEN_SIZES = vendor.LOW_LATENCY_HIDDEN_SIZES
    _CHECKS_DETERMINISTIC = True  # 2.x: check_torch_deterministic() (b306af0)
    _ASSERTS_QP_DEPTH = True  # since d981409
    _LL_SIGNALLING_BY_EXPERTS = True  # since 42253d0 (vendor.ll_clean_key)
    _NUM_DEVICE_SMS = EMULATED_DEVICE_SMS
    runtime: Any = None

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False,
                 enable_shrink=False, comm=None) -> None:
        self._start(group, comm, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                    allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, enable_shrink)

    def _start(self, group: Any, comm: Any, num_nvl_bytes: Any, num_rdma_bytes: Any, low_latency_mode: Any,
               num_qps_per_rank: Any, allow_nvlink_for_low_latency_mode: Any, allow_mnnvl: Any,
               explicitly_destroy: Any, enable_shrink: Any) -> None:
        if group is None and comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        if group is None:
            raise NotImplementedError("the fake runs on torch.distributed process groups, not mpi4py communicators")
        self._check_nvlink_connections(group)
        check_context()
        self._comm = Comm(group)  # inside a dispatcher's call it waits with that dispatcher's Watch
        self.rank, self.group, self.group_size = self._comm.rank, group, self._comm.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, enable_shrink
        args = (self.rank, self.group_size, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy,
                enable_shrink, allow_mnnvl)
        check_args("__init__", "deep_ep._C.Buffer(arg0: int, arg1: int, arg2: int, arg3: int, arg4: bool, arg5: bool, "
                               "arg6: bool, arg7: bool)", args, "iiiibbbb")
        self._check_sizes(int(num_nvl_bytes), int(num_rdma_bytes), bool(low_latency_mode))
        num_qps = None
        if self.group_size > vendor.NUM_MAX_NVL_PEERS or low_latency_mode:
            assert num_qps_per_rank > 0
            num_qps = self._write_nvshmem_env(num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl)
        runtime = _Runtime(self.group_size, num_qps)
        # Runtime::sync: NVSHMEM starts (and the RDMA buffer is zeroed) only with RDMA bytes; LL mode puts every
        # rank in NVSHMEM and splits a team per 8, normal mode one PE per node (csrc/legacy/buffer.hpp sync).
        self._nvshmem = None
        if int(num_rdma_bytes) > 0:
            pe, pes = vendor.nvshmem_pe(self.rank, self.group_size, bool(low_latency_mode))
            self._nvshmem = NVSHMEM.init(pe, pes, vendor.NUM_MAX_NVL_PEERS if low_latency_mode else 0)
        self.runtime = runtime
        self._clean_for: Any = _CLEAN_FOR_ANY
        self._signalling = _SignallingBytes()
        self._ll_half = 0  # Buffer::low_latency_buffer_idx
        self._pending_receive: _Receipt | None = None  # a hook-mode LL call whose receive has not run
        self._ll_half_captured: int | None = None
        self._arrivals = torch.Generator().manual_seed(1009 + self.rank)
        self.calls: list[VendorCall] = []

    @staticmethod
    def _check_nvlink_connections(group: Any) -> None:
        """``check_nvlink_connections(group)`` (deep_ep/utils/envs.py): PCIe GPUs pair up only. (The NVLink P2P status
        of the pair, read through pynvml, is taken as connected.)"""
        if vendor.pcie_pairs_only(sys.modules[__name__].EMULATED_DEVICE_NAME):
            assert group.size() <= vendor.PCIE_MAX_RANKS, vendor.PCIE_ASSERT_MESSAGE

    def _check_sizes(self, nvl: int, rdma: int, low_latency: bool) -> None:
        """``Buffer::Buffer`` common checks."""
        r, a = self.group_size, vendor.NUM_BUFFER_ALIGNMENT_BYTES
        ep_assert(nvl % a == 0 and (nvl <= vendor.INT_MAX or rdma == 0),
                  "num_nvl_bytes % LEGACY_NUM_BUFFER_ALIGNMENT_BYTES == 0 and (num_nvl_bytes <= "
                  "std::numeric_limits<int>::max() or num_rdma_bytes == 0)", _BUFFER_HPP)
        ep_assert(rdma % a == 0 and (low_latency or rdma <= vendor.INT_MAX),
                  "num_rdma_bytes % LEGACY_NUM_BUFFER_ALIGNMENT_BYTES == 0 and (low_latency_mode or num_rdma_bytes "
                  "<= std::numeric_limits<int>::max())", _BUFFER_HPP)
        ep_assert(nvl // 16 < vendor.INT_MAX, "num_nvl_bytes / sizeof(int4) < std::numeric_limits<int>::max()",
                  _BUFFER_HPP)
        ep_assert(rdma // 16 < vendor.INT_MAX, "num_rdma_bytes / sizeof(int4) < std::numeric_limits<int>::max()",
                  _BUFFER_HPP)
        ep_assert(0 <= self.rank < r and (r <= vendor.NUM_MAX_NVL_PEERS * vendor.NUM_MAX_RDMA_PEERS or low_latency),
                  "0 <= rank and rank < num_ranks and (num_ranks <= LEGACY_NUM_MAX_NVL_PEERS * "
                  "LEGACY_NUM_MAX_RDMA_PEERS or low_latency_mode)", _BUFFER_HPP)
        ep_assert(r < vendor.NUM_MAX_NVL_PEERS or r % vendor.NUM_MAX_NVL_PEERS == 0,
                  "num_ranks < LEGACY_NUM_MAX_NVL_PEERS or num_ranks % LEGACY_NUM_MAX_NVL_PEERS == 0", _BUFFER_HPP)
        if rdma > 0:
            ep_assert(r > vendor.NUM_MAX_NVL_PEERS or low_latency,
                      "num_ranks > LEGACY_NUM_MAX_NVL_PEERS or low_latency_mode", _BUFFER_HPP)
        half = self._NUM_DEVICE_SMS // 2
        ep_assert(-(-nvl // half) < vendor.INT_MAX and -(-rdma // half) < vendor.INT_MAX,
                  "ceil_div<int64_t>(num_*_bytes, num_device_sms / 2) < std::numeric_limits<int>::max()", _BUFFER_HPP)

    def _write_nvshmem_env(self, num_qps_per_rank: int, allow_nvlink: bool, allow_mnnvl: bool) -> int:
        """What Buffer.__init__ puts in ``os.environ`` before NVSHMEM starts; returns the QPs per peer."""
        os.environ[vendor.NVSHMEM_DISABLE_P2P] = "0" if allow_nvlink else "1"
        os.environ[vendor.NVSHMEM_IB_ENABLE_IBGDA] = "1"
        os.environ[vendor.NVSHMEM_IBGDA_NUM_RC_PER_PE] = f"{num_qps_per_rank}"
        if self._ASSERTS_QP_DEPTH:
            self.nvshmem_qp_depth = vendor.qp_depth_from(os.environ)
            os.environ[vendor.NVSHMEM_QP_DEPTH] = str(self.nvshmem_qp_depth)
        else:
            os.environ[vendor.NVSHMEM_QP_DEPTH] = os.environ.get(vendor.NVSHMEM_QP_DEPTH,
                                                                 str(vendor.DEFAULT_NVSHMEM_QP_DEPTH))
        os.environ[vendor.NVSHMEM_MAX_TEAMS] = str(vendor.NVSHMEM_MAX_TEAMS_VALUE)
        os.environ[vendor.NVSHMEM_DISABLE_NVLS] = "1"
        os.environ[vendor.NVSHMEM_CUMEM_GRANULARITY] = f"{vendor.NVSHMEM_CUMEM_GRANULARITY_VALUE}"
        if not allow_mnnvl:
            os.environ[vendor.NVSHMEM_DISABLE_MNNVL] = "1"
        return int(num_qps_per_rank)

    # -- statics and small methods -------------------------------------------------------------------------

    def destroy(self):  # noqa: ANN201
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._runtime_destroy(self.runtime)
        # Buffer::destroy's intranode barrier and nvshmem_barrier_all: every rank of the group must get here.
        self._comm.all_gather(torch.zeros(1, 1, dtype=torch.uint8), (("metadata", 1),))
        self.runtime = None

    def _runtime_destroy(self, runtime: _Runtime) -> None:
        """``Buffer::destroy``: the intranode barrier when there are NVL bytes (a kernel switched on ``min(R,
        8)``: "Unsupported ranks" otherwise), then NVSHMEM's finalize when there are RDMA bytes."""
        ep_assert(not runtime.destroyed, "not destroyed", _BUFFER_HPP)
        if self.num_nvl_bytes > 0:
            ep_assert(min(self.group_size, vendor.NUM_MAX_NVL_PEERS) in vendor.INTRANODE_RANKS,
                      "false and \"Unsupported ranks\"", _INTRANODE_CU)
        runtime.destroyed = True
        if self._nvshmem is not None:
            NVSHMEM.finalize()

    def __del__(self) -> None:
        """``~Buffer() noexcept(false)``: with ``explicitly_destroy`` only DeepEP's warning when ``destroy()`` was
        not called (NVSHMEM stays initialized: a later Buffer's init finds it live); else ``destroy()``, whose
        barriers are collectives (``DESTRUCTOR_TEARDOWNS``). pybind11 frees the object inside a noexcept
        ``unique_ptr`` destructor, so an exception there is ``std::terminate``."""
        runtime = self.runtime
        if runtime is None or runtime.destroyed:
            return
        if self.explicitly_destroy:
            sys.stdout.write(vendor.BUFFER_DESTROY_WARNING + "\n")
            sys.stdout.flush()
            return
        DESTRUCTOR_TEARDOWNS.append(f"rank {self.rank}: ~Buffer ran destroy() (NVL {self.num_nvl_bytes} B, RDMA "
                                    f"{self.num_rdma_bytes} B)")
        try:
            self._runtime_destroy(runtime)
        except RuntimeError as exc:
            sys.stderr.write(f"terminate called after throwing an instance of 'deep_ep::EPException'\n  what():  {exc}\n")
            sys.stderr.flush()
            os.abort()

    def _check_runtime(self, uses_nvshmem: bool = False) -> None:
        """A CUDA call: the context must be alive, the runtime not destroyed, and its NVSHMEM not finalized."""
        check_context()
        ep_assert(self.runtime is not None and not self.runtime.destroyed, "runtime is available", _BUFFER_HPP)
        if uses_nvshmem and self._nvshmem is not None and self._nvshmem != NVSHMEM.generation:
            raise lose_context("this Buffer's NVSHMEM memory is gone: another Buffer's destroy() ran "
                               "nvshmem::finalize() for the whole process")

    def _dirty_after_normal(self) -> None:
        """Internode normal-mode kernels write the RDMA buffer where the LL signalling counts live (legacy.py
        clean_low_latency_buffer: "after running the normal dispatch/combine, you must run this function before
        executing any low-latency kernel"); intranode ones use the NVL buffer only."""
        if self.low_latency_mode and self.runtime.get_num_rdma_ranks() > 1 and _kernels_run():
            self._write_everything()

    def emulate_internode_normal_kernels(self) -> None:
        """For the tests: what internode normal-mode dispatch/combine leave in an LL-mode Buffer's RDMA region
        (stale signalling counts); the fake cannot run the 16 ranks they need on CPU."""
        if self.low_latency_mode:
            self._write_everything()

    def _overwrite_pending_receive(self, by: str) -> None:
        if self._pending_receive is not None and _kernels_run():
            self._pending_receive.overwritten = by
            self._pending_receive = None

    def _write_everything(self) -> None:
        self._overwrite_pending_receive("internode normal-mode kernels")
        self._clean_for = None
        self._signalling.write(0, float("inf"))

    def _clean_key(self, T: int, hidden: int, num_experts: int) -> Any:
        return vendor.ll_clean_key(self._LL_SIGNALLING_BY_EXPERTS, T, hidden, num_experts)

    def _next_half(self) -> int:
        """``layout.buffers[low_latency_buffer_idx]``, then ``low_latency_buffer_idx ^= 1`` (host code of every LL
        dispatch and combine, csrc/legacy/buffer.hpp); a replayed kernel uses the half it was captured with."""
        replayed = _CAPTURE["replay_half"]
        if replayed is not None:
            return replayed
        self._overwrite_pending_receive("the next low-latency call's send phase")
        half, self._ll_half = self._ll_half, self._ll_half ^ 1
        self._ll_half_captured = half
        return half

    def _ll_signalling(self, T: int, hidden: int, num_experts: int, half: int) -> None:
        """An LL kernel on ``half``: reads its counts there (they must be zero), writes them, zeroes the other
        half's for its E (``next_clean``) and writes its data from ``2·align_up(4E, 128)`` on. Before 42253d0 the
        counts moved with T and hidden too: only the same (T, hidden, E) finds them clean."""
        if not _kernels_run():
            return
        key, state = self._clean_key(T, hidden, num_experts), self._clean_for
        if self._LL_SIGNALLING_BY_EXPERTS:
            halves = vendor.ll_signalling_halves(num_experts)
            ok = self._signalling.is_zero(*halves[half])
            if ok:
                self._signalling.write(*halves[half])
                self._signalling.zero(*halves[half ^ 1])
                self._signalling.write(vendor.ll_data_offset(num_experts), float("inf"))
                return
            why = ("internode normal-mode kernels or LL kernels of another E wrote them" if state is not None
                   else "internode normal-mode kernels ran on this Buffer")
            where = f"bytes [{halves[half][0]}, {halves[half][1]}) of half {half} for E={num_experts}"
        else:
            ok = state == _CLEAN_FOR_ANY or (isinstance(state, frozenset) and key in state)
            if ok:
                self._clean_for = frozenset({key})
                return
            why = ("internode normal-mode kernels ran on this Buffer" if state is None
                   else f"the last LL kernels left them clean for {state}, not {key}")
            where = f"layout {key}"
        raise lose_context(f"(fake) stale low-latency signalling counts ({where}): {why} and "
                           "clean_low_latency_buffer did not run since; DeepEP's LL kernels would read them (wrong rows "
                           "or a hang)")

    def _after_clean(self, T: int, hidden: int, num_experts: int) -> None:
        key, state = self._clean_key(T, hidden, num_experts), self._clean_for
        for start, end in vendor.ll_signalling_halves(num_experts):
            self._signalling.zero(start, end)
        if state != _CLEAN_FOR_ANY:
            self._clean_for = (state if isinstance(state, frozenset) else frozenset()) | {key}

    def _deterministic_check(self) -> None:
        if self._CHECKS_DETERMINISTIC:
            _check_torch_deterministic()

    # -- normal mode ----------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):  # noqa: ANN201
        check_args("get_dispatch_layout", "(self: deep_ep._C.Buffer, arg0: torch.Tensor, arg1: int, arg2: "
                   "Optional[EventHandle], arg3: bool, arg4: bool)",
                   (topk_idx, num_experts, getattr(previous_event, "event", None), async_finish,
                    allocate_on_comm_stream), "tixbb")
        self._check_runtime()
        ep_assert(topk_idx.dim() == 2, "topk_idx.dim() == 2", _BUFFER_HPP)
        ep_assert(topk_idx.is_contiguous(), "topk_idx.is_contiguous()", _BUFFER_HPP)
        ep_assert(num_experts > 0, "num_experts > 0", _BUFFER_HPP)
        if allocate_on_comm_stream:
            ep_assert(previous_event is not None and async_finish, "previous_event.has_value() and async", _BUFFER_HPP)
        _comm_stream_waits(previous_event)
        scalar_type_check(topk_idx, self._TOPK_IDX_T, "get_dispatch_layout topk_idx.data_ptr<topk_idx_t>()")
        R = self.group_size
        local = num_experts // R
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx.long() // max(local, 1), R)
        in_rank = torch.zeros(topk_idx.shape[0], R + 1, dtype=torch.bool)
        in_rank.scatter_(1, rank_of, True)
        in_rank = in_rank[:, :R].contiguous()
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        per_rdma = None
        if R > vendor.NUM_MAX_NVL_PEERS:
            per_rdma = in_rank.view(-1, R // vendor.NUM_MAX_NVL_PEERS, vendor.NUM_MAX_NVL_PEERS).any(2).sum(0)
            per_rdma = per_rdma.to(torch.int32)
        per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).to(torch.int32)
        (per_rank, per_rdma, per_expert, in_rank), event = _after_event(async_finish,
                                                                        (per_rank, per_rdma, per_expert, in_rank))
        return per_rank, per_rdma, per_expert, in_rank, event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False):  # noqa: ANN201
        self._deterministic_check()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        self._check_runtime(uses_nvshmem=True)
        _comm_stream_waits(previous_event)
        if emulated_stream_capturing():  # the CPU waits for the received-token counter
            raise RuntimeError(_CAPTURING_NORMAL)
        self._dirty_after_normal()
        if self.runtime.get_num_rdma_ranks() > 1:
            assert num_worst_tokens == 0, "Internode dispatch does not support `num_worst_tokens > 0`"
            cfg = _fields(config, "internode_dispatch", (x, config), self._CONFIG)
            data, scales = x if isinstance(x, tuple) else (x, None)
            reached = 0
            if topk_idx is not None and num_tokens_per_expert is not None:
                nodes = torch.where(topk_idx >= 0, topk_idx.long() // max(1, num_tokens_per_expert.numel()
                                                                          // self.runtime.num_rdma_ranks), -1)
                reached = max((len(set(row) - {-1}) for row in nodes.tolist()), default=0)
            internode_dispatch_checks(self.group_size, self.runtime.num_qps, cfg, data.size(1) * data.element_size(),
                                      0 if scales is None else scales.size(1),
                                      0 if topk_idx is None else topk_idx.size(1), reached, int(self.num_nvl_bytes),
                                      int(self.num_rdma_bytes))
            raise NotImplementedError("the fake emulates normal-mode data movement within one node (at most 8 ranks)")
        data, scales = x if isinstance(x, tuple) else (x, None)
        if handle is not None:
            raise NotImplementedError("the fake does not replay a cached dispatch handle")
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        args = (data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, 0,
                None, None, expert_alignment, num_worst_tokens, config, getattr(previous_event, "event", None),
                async_finish, allocate_on_comm_stream)
        check_args("intranode_dispatch", "(self: deep_ep._C.Buffer, arg0: torch.Tensor, arg1: Optional[torch.Tensor], "
                   "..., arg12: deep_ep._C.Config, ...)", args, "tTTTTtTiTTiicxbb")
        cfg = _fields(config, "intranode_dispatch", args, self._CONFIG)
        return self._intranode_dispatch(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                        num_tokens_per_expert, int(expert_alignment), int(num_worst_tokens), cfg,
                                        async_finish, previous_event, allocate_on_comm_stream)

    def _intranode_dispatch(self, x: torch.Tensor, x_scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                            topk_weights: torch.Tensor | None, per_rank: torch.Tensor, in_rank: torch.Tensor,
                            per_expert: torch.Tensor, expert_alignment: int, num_worst_tokens: int,
                            cfg: vendor.ConfigFields, async_finish: bool, previous_event: Any,
                            allocate_on_comm_stream: bool):  # noqa: ANN202
        R, rank = self.group_size, self.rank
        w = _BUFFER_HPP
        ep_assert(cfg.num_sms % 2 == 0, "config.num_sms % 2 == 0", w)
        C = cfg.num_sms // 2
        ep_assert(in_rank.dtype == torch.bool, "is_token_in_rank.scalar_type() == torch::kBool", w)
        ep_assert(per_expert.dtype == torch.int32, "num_tokens_per_expert->scalar_type() == torch::kInt32", w)
        ep_assert(per_rank.dtype == torch.int32, "num_tokens_per_rank->scalar_type() == torch::kInt32", w)
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()", w)
        ep_assert((x.size(1) * x.element_size()) % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0", w)
        ep_assert(in_rank.dim() == 2 and in_rank.is_contiguous(), "is_token_in_rank.dim() == 2 and contiguous", w)
        ep_assert(in_rank.size(0) == x.size(0) and in_rank.size(1) == R,
                  "is_token_in_rank.size(0) == x.size(0) and is_token_in_rank.size(1) == num_ranks", w)
        ep_assert(per_expert.dim() == 1 and per_expert.is_contiguous(), "num_tokens_per_expert->dim() == 1", w)
        ep_assert(per_expert.size(0) % R == 0, "num_tokens_per_expert->size(0) % num_ranks == 0", w)
        ep_assert(per_expert.size(0) // R <= vendor.NUM_MAX_LOCAL_EXPERTS,
                  "num_tokens_per_expert->size(0) / num_ranks <= LEGACY_NUM_MAX_LOCAL_EXPERTS", w)
        ep_assert(per_rank.dim() == 1 and per_rank.is_contiguous() and per_rank.size(0) == R,
                  "num_tokens_per_rank->size(0) == num_ranks", w)
        n, hidden = x.shape
        num_experts = per_expert.size(0)
        local = num_experts // R
        ep_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()", w)
        k = 0
        if topk_idx is not None:
            k = topk_idx.size(1)
            ep_assert(num_experts > 0, "num_experts > 0", w)
            ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx->dim() == 2 and contiguous", w)
            ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights->dim() == 2", w)
            ep_assert(n == topk_idx.size(0) and n == topk_weights.size(0), "num_tokens == topk_idx->size(0)", w)
            ep_assert(k == topk_weights.size(1), "num_topk == topk_weights->size(1)", w)
            ep_assert(topk_weights.dtype == torch.float32, "topk_weights->scalar_type() == torch::kFloat32", w)
            scalar_type_check(topk_idx, self._TOPK_IDX_T, "intranode_dispatch topk_idx->data_ptr<topk_idx_t>()")
        num_scales = 0
        if x_scales is not None:
            ep_assert(x.element_size() == 1, "x.element_size() == 1", w)
            ep_assert(x_scales.dtype in (torch.float32, torch.int32),
                      "x_scales->scalar_type() == torch::kFloat32 or x_scales->scalar_type() == torch::kInt", w)
            ep_assert(x_scales.dim() == 2, "x_scales->dim() == 2", w)
            ep_assert(x_scales.size(0) == n, "x_scales->size(0) == num_tokens", w)
            num_scales = x_scales.size(1)
        if allocate_on_comm_stream:
            ep_assert(previous_event is not None and async_finish, "previous_event.has_value() and async", w)
        ep_assert(R * (R + local) * 4 <= self.num_nvl_bytes,
                  "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes", w)
        ep_assert(local <= vendor.NORMAL_INTRANODE_MAX_LOCAL_EXPERTS and R <= vendor.NORMAL_INTRANODE_MAX_LOCAL_EXPERTS,
                  "num_experts / num_ranks <= kNumThreads and num_ranks <= kNumThreads", _INTRANODE_CU)
        ep_assert(R in vendor.INTRANODE_RANKS, "false and \"Unsupported ranks\"", _INTRANODE_CU)
        recv = cfg.num_max_nvl_chunked_recv_tokens
        idx_bytes = torch.empty((), dtype=self._TOPK_IDX_T).element_size()
        need = (R * R * 4 + 4 * C * R * 4 + C * R * recv * hidden * x.element_size() + C * R * recv * 4
                + C * R * recv * k * idx_bytes + C * R * recv * k * 4 + C * R * recv * 4 * num_scales)
        ep_assert(need <= self.num_nvl_bytes, "<buffer layout of the dispatch kernel> <= num_nvl_bytes "
                  f"({need} > {self.num_nvl_bytes})", w)
        device_assert(k <= vendor.NORMAL_MAX_TOPK, "num_topk <= 32", _INTRANODE_CU)
        hidden_int4 = hidden * x.element_size() // 16
        device_assert(hidden_int4 % 2 == 0 and hidden_int4 // 2 * 16 + vendor.TMA_MBARRIER_BYTES
                      <= vendor.INTRANODE_DISPATCH_TMA_BYTES,
                      "hidden_int4 % 2 == 0 and half_hidden_bytes + sizeof(uint64_t) <= kNumTMABytesPerWarp",
                      _INTRANODE_CU)
        return self._exchange(x, x_scales, topk_idx, topk_weights, per_rank, in_rank, local, k, C, expert_alignment,
                              num_worst_tokens, async_finish)

    def _exchange(self, x: torch.Tensor, x_scales: torch.Tensor | None, topk_idx: torch.Tensor | None,
                  topk_weights: torch.Tensor | None, per_rank: torch.Tensor, in_rank: torch.Tensor, local: int,
                  k: int, C: int, expert_alignment: int, num_worst_tokens: int, async_finish: bool):  # noqa: ANN202
        R, rank = self.group_size, self.rank
        n, hidden = x.shape
        # notify_dispatch: every rank learns the full [R, R] token-count matrix (src → dst).
        gathered = from_bytes(self._comm.all_gather(as_bytes(per_rank.to(torch.int64).unsqueeze(0)),
                                                    (("metadata", 8 * R),)), torch.int64).view(R, R)
        rank_prefix_matrix = gathered.cumsum(0).to(torch.int32).contiguous()
        send_counts, recv_counts = per_rank.tolist(), gathered[:, rank].tolist()
        cum = torch.cat([torch.zeros(1, R, dtype=torch.int64), in_rank.long().cumsum(0)])  # [n + 1, R]
        ends = torch.tensor([e for _, e in _channel_ranges(n, C)], dtype=torch.long)
        channel_prefix = cum[ends].t().to(torch.int32).contiguous()  # [R, C]: tokens to each rank by channel end
        send_head = torch.where(in_rank, cum[1:] - 1, -1).to(torch.int32)  # a token's slot at each rank
        recv_channel_prefix = from_bytes(self._comm.all_to_all(as_bytes(channel_prefix), None, None,
                                                               (("metadata", 4 * C),)), torch.int32).view(R, C)
        pairs = in_rank.t().nonzero()  # (dest rank, token), rank-major, token order within
        dest, token = pairs[:, 0], pairs[:, 1]
        columns = [as_bytes(x[token])] + ([as_bytes(x_scales[token].contiguous())] if x_scales is not None else [])
        payload = sum(c.shape[1] for c in columns)
        meta = [as_bytes(token.to(torch.int32).unsqueeze(1))]
        if topk_idx is not None:
            ids = topk_idx[token].long()
            mine = (ids >= 0) & (ids // local == dest[:, None])
            meta += [as_bytes(torch.where(mine, ids - dest[:, None] * local, -1).to(self._TOPK_IDX_T)),
                     as_bytes(torch.where(mine, topk_weights[token], 0.0).float())]
        rows = torch.cat(columns + meta, dim=1)
        got = self._comm.all_to_all(rows, send_counts, recv_counts,
                                    (("payload", payload), ("metadata", rows.shape[1] - payload)))
        self.calls.append(VendorCall("dispatch", x.dtype, x_scales is not None, rows.shape[0] * payload))
        at, width = 0, hidden * x.element_size()
        # Fresh contiguous tensors, as DeepEP allocates them (csrc/legacy/buffer.hpp:603-622)
        recv_x = from_bytes(got[:, :width], x.dtype).contiguous()
        at = width
        recv_scales = None
        if x_scales is not None:
            sw = x_scales.size(1) * x_scales.element_size()
            recv_scales = from_bytes(got[:, at : at + sw], x_scales.dtype).contiguous()
            at += sw
        recv_src_idx = from_bytes(got[:, at : at + 4], torch.int32).squeeze(1).contiguous()
        at += 4
        recv_topk_idx = recv_topk_weights = None
        per_expert_list: list[int] = []
        if topk_idx is not None:
            ib = k * torch.empty((), dtype=self._TOPK_IDX_T).element_size()
            recv_topk_idx = from_bytes(got[:, at : at + ib], self._TOPK_IDX_T).contiguous()
            recv_topk_weights = from_bytes(got[:, at + ib : at + ib + 4 * k], torch.float32).contiguous()
            if num_worst_tokens == 0:
                counts = torch.bincount(recv_topk_idx[recv_topk_idx >= 0].long(), minlength=local)
                per_expert_list = [-(-int(c) // expert_alignment) * expert_alignment for c in counts]
        handle = (rank_prefix_matrix, channel_prefix.contiguous(), recv_channel_prefix.contiguous(), recv_src_idx,
                  in_rank, send_head)
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        (recv, recv_topk_idx, recv_topk_weights), event = _after_event(async_finish,
                                                                       (recv, recv_topk_idx, recv_topk_weights))
        if event.event is not None:  # the data kernel reads them on the comm stream (csrc/legacy/buffer.hpp:638-695)
            event.event._checks.append(inputs_unchanged_check({"x": x, "x_scales": x_scales, "topk_idx": topk_idx,
                                                               "topk_weights": topk_weights},
                                                              "csrc/legacy/buffer.hpp:638-695"))
        return recv, recv_topk_idx, recv_topk_weights, per_expert_list, handle, event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):  # noqa: ANN201
        """Add-only: each token gets the plain sum of the rows its destination ranks send back."""
        self._deterministic_check()
        config = self.get_combine_config(self.group_size) if config is None else config
        self._check_runtime(uses_nvshmem=True)
        _comm_stream_waits(previous_event)
        self._dirty_after_normal()
        if self.runtime.get_num_rdma_ranks() > 1:
            cfg = _fields(config, "internode_combine", (x, config), self._CONFIG)
            internode_combine_checks(self.group_size, cfg, x.size(1), 0 if topk_weights is None else
                                     topk_weights.size(1), int(self.num_nvl_bytes), int(self.num_rdma_bytes))
            raise NotImplementedError("the fake emulates normal-mode data movement within one node (at most 8 ranks)")
        rank_prefix_matrix, _, channel_prefix_matrix, src_idx, is_recv_token_in_rank, send_head = handle
        bias_0, bias_1 = _unpack_bias(bias)
        args = (x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head, config,
                getattr(previous_event, "event", None), async_finish, allocate_on_comm_stream)
        check_args("intranode_combine", "(self: deep_ep._C.Buffer, arg0: torch.Tensor, ..., arg8: deep_ep._C.Config, "
                   "...)", args, "tTTTttttcxbb")
        cfg = _fields(config, "intranode_combine", args, self._CONFIG)
        w = _BUFFER_HPP
        R = self.group_size
        ep_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()", w)
        ep_assert(src_idx.dim() == 1 and src_idx.is_contiguous() and src_idx.dtype == torch.int32,
                  "src_idx.dim() == 1 and src_idx.is_contiguous() and src_idx.scalar_type() == torch::kInt32", w)
        ep_assert(send_head.dim() == 2 and send_head.is_contiguous() and send_head.dtype == torch.int32,
                  "send_head.dim() == 2 and send_head.is_contiguous() and send_head.scalar_type() == torch::kInt32", w)
        ep_assert(rank_prefix_matrix.dim() == 2 and rank_prefix_matrix.is_contiguous()
                  and rank_prefix_matrix.dtype == torch.int32, "rank_prefix_matrix: 2-d contiguous int32", w)
        ep_assert(channel_prefix_matrix.dim() == 2 and channel_prefix_matrix.is_contiguous()
                  and channel_prefix_matrix.dtype == torch.int32, "channel_prefix_matrix: 2-d contiguous int32", w)
        ep_assert(cfg.num_sms % 2 == 0, "config.num_sms % 2 == 0", w)
        C = cfg.num_sms // 2
        num_tokens, hidden = x.shape
        num_recv_tokens = send_head.size(0)
        ep_assert(src_idx.size(0) == num_tokens, "src_idx.size(0) == num_tokens", w)
        ep_assert(send_head.size(1) == R, "send_head.size(1) == num_ranks", w)
        ep_assert(rank_prefix_matrix.size(0) == R and rank_prefix_matrix.size(1) == R,
                  "rank_prefix_matrix.size(0) == num_ranks and rank_prefix_matrix.size(1) == num_ranks", w)
        ep_assert(channel_prefix_matrix.size(0) == R and channel_prefix_matrix.size(1) == C,
                  "channel_prefix_matrix.size(0) == num_ranks and channel_prefix_matrix.size(1) == num_channels", w)
        ep_assert((hidden * x.element_size()) % 16 == 0, "(hidden * x.element_size()) % sizeof(int4) == 0", w)
        k = 0
        if topk_weights is not None:
            ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights->dim() == 2", w)
            ep_assert(topk_weights.size(0) == num_tokens, "topk_weights->size(0) == num_tokens", w)
            ep_assert(topk_weights.dtype == torch.float32, "topk_weights->scalar_type() == torch::kFloat32", w)
            k = topk_weights.size(1)
        ep_assert(C * R * 4 * 2 <= self.num_nvl_bytes, "num_channels * num_ranks * sizeof(int) * 2 <= num_nvl_bytes", w)
        for b in (bias_0, bias_1):
            if b is not None:
                ep_assert(b.dim() == 2 and b.is_contiguous() and b.dtype == x.dtype
                          and b.size(0) == num_recv_tokens and b.size(1) == hidden, "bias checks", w)
        recv = cfg.num_max_nvl_chunked_recv_tokens
        need = C * R * 8 + C * R * recv * hidden * x.element_size() + C * R * recv * 4 + C * R * recv * k * 4
        ep_assert(need <= self.num_nvl_bytes, "<buffer layout of the combine kernel> <= num_nvl_bytes "
                  f"({need} > {self.num_nvl_bytes})", w)
        ep_assert(R in vendor.INTRANODE_RANKS, "false and \"Unsupported ranks\"", _INTRANODE_CU)
        ep_assert(x.dtype == torch.bfloat16, "false and \"Unsupported type\"", _INTRANODE_CU)
        device_assert(k <= vendor.NORMAL_MAX_TOPK, "num_topk <= 32", _INTRANODE_CU)
        # Rows arrived grouped by source rank (rank_prefix_matrix[:, me]); each goes back to its source.
        col = rank_prefix_matrix[:, self.rank].long()
        back_counts = torch.diff(col, prepend=col.new_zeros(1)).tolist()
        mine_counts = is_recv_token_in_rank.sum(0).tolist()
        rows = [as_bytes(x), as_bytes(src_idx.unsqueeze(1))]
        if topk_weights is not None:
            rows.append(as_bytes(topk_weights))
        got = self._comm.all_to_all(torch.cat(rows, 1), back_counts, mine_counts,
                                    (("combine", hidden * 2), ("metadata", 4 + 4 * k)))
        out = torch.zeros(num_recv_tokens, hidden, dtype=torch.float32)
        token = from_bytes(got[:, hidden * 2 : hidden * 2 + 4], torch.int32).squeeze(1).long()
        out.index_add_(0, token, from_bytes(got[:, : hidden * 2], torch.bfloat16).float())
        for b in (bias_0, bias_1):
            if b is not None:
                out += b.float()
        combined_weights = None
        if topk_weights is not None:
            wb = from_bytes(got[:, hidden * 2 + 4 :], torch.float32)
            combined_weights = torch.zeros(num_recv_tokens, k).index_add_(0, token, wb)
        (combined, combined_weights), event = _after_event(async_finish, (out.to(torch.bfloat16), combined_weights))
        if event.event is not None:  # the kernel reads x on the comm stream until the wait (buffer.hpp:836-846)
            event.event._checks.append(inputs_unchanged_check({"x": x, "topk_weights": topk_weights},
                                                              "csrc/legacy/buffer.hpp:836-846"))
        return combined, combined_weights, event

    # -- low-latency mode -------------------------------------------------------------------------------------

    @_graph_kernel
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        check_args("clean_low_latency_buffer", "(self: deep_ep._C.Buffer, arg0: int, arg1: int, arg2: int)",
                   (num_max_dispatch_tokens_per_rank, hidden, num_experts), "iii")
        self._check_runtime(uses_nvshmem=True)
        ep_assert(self.low_latency_mode, "low_latency_mode", _BUFFER_HPP)
        layout = vendor.LowLatencyLayout.build(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        ep_assert(2 * layout.signaling_bytes <= self.num_rdma_bytes,
                  "0 <= offset and offset + num_bytes <= num_rdma_bytes", _BUFFER_HPP)
        self.calls.append(VendorCall("clean_low_latency_buffer", torch.uint8, None, 0))
        # internode_ll::clean_low_latency_buffer: nvshmemx_barrier_all_block(), zero both signalling areas,
        # barrier again: a collective every rank must reach.
        self._comm.all_gather(torch.zeros(1, 1, dtype=torch.uint8), (("metadata", 1),))
        if _kernels_run():
            self._overwrite_pending_receive("clean_low_latency_buffer")
            self._after_clean(int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts))

    def _qp_depth_check(self, T: int) -> None:
        if self._ASSERTS_QP_DEPTH:
            assert self.nvshmem_qp_depth >= (T + 1) * 2

    def _ll_checks(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, num_experts: int, use_fp8: bool,
                   round_scale: bool, use_ue8m0: bool, async_finish: bool, return_recv_hook: bool,
                   stats: torch.Tensor | None, wait_stats: torch.Tensor | None) -> None:
        """The host asserts of ``Buffer::low_latency_dispatch`` and ``internode_ll::dispatch``, and the
        device asserts the adapter can trip."""
        w, R = _BUFFER_HPP, self.group_size
        ep_assert(self.low_latency_mode, "low_latency_mode", w)
        ep_assert(x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16,
                  "x.dim() == 2 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16", w)
        ep_assert(x.size(1) % 16 == 0 and x.size(1) % 128 == 0,
                  "x.size(1) % sizeof(int4) == 0 and x.size(1) % 128 == 0", w)
        ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(),
                  "topk_idx.dim() == 2 and topk_idx.is_contiguous()", w)
        ep_assert(x.size(0) == topk_idx.size(0) and x.size(0) <= T,
                  "x.size(0) == topk_idx.size(0) and x.size(0) <= num_max_dispatch_tokens_per_rank", w)
        ep_assert(topk_idx.dtype == self._TOPK_IDX_T,
                  "topk_idx.scalar_type() == c10::CppTypeToScalarType<topk_idx_t>::value", w)
        ep_assert(num_experts % R == 0, "num_experts % num_ranks == 0", w)
        local = num_experts // R
        if stats is not None:
            ep_assert(stats.dtype == torch.int32 and stats.dim() == 1 and stats.is_contiguous()
                      and stats.size(0) == local, "cumulative_local_expert_recv_stats checks", w)
        if wait_stats is not None:
            ep_assert(wait_stats.dtype == torch.int64 and wait_stats.dim() == 1 and wait_stats.is_contiguous()
                      and wait_stats.size(0) == R, "dispatch_wait_recv_cost_stats checks", w)
        hidden = x.size(1)
        layout = vendor.LowLatencyLayout.build(T, hidden, num_experts)
        ep_assert(layout.total_bytes <= self.num_rdma_bytes, "layout.total_bytes <= num_rdma_bytes", w)
        ep_assert(not (async_finish and return_recv_hook), "not(async and return_recv_hook)", w)
        ep_assert((R * T) % vendor.LOW_LATENCY_TOKEN_MULTIPLE == 0,
                  "(num_ranks * num_max_dispatch_tokens_per_rank) % 4 == 0 and \"TMA requires the number of tokens "
                  "to be multiple of 4\"", w)
        if use_fp8:
            ep_assert(hidden % vendor.LOW_LATENCY_FP8_HIDDEN_MULTIPLE == 0, "hidden % 512 == 0", w)
            if use_ue8m0:
                ep_assert(round_scale, "round_scale", w)
        self._check_runtime(uses_nvshmem=True)
        half = self._next_half()  # the host toggles before the launch (and its launch-time asserts)
        self._ll_kernel_checks(x.size(1), topk_idx.size(1), num_experts, use_ue8m0, round_scale)
        self._ll_signalling(T, hidden, num_experts, half)

    def _ll_kernel_checks(self, hidden: int, num_topk: int, num_experts: int, use_ue8m0: bool,
                          round_scale: bool) -> None:
        groups = -(-num_experts // self._NUM_DEVICE_SMS)
        per_group = 32 // groups if groups else 0
        ep_assert(groups > 0 and per_group > 0, "num_warp_groups > 0 and num_warps_per_group > 0", _LL_CU)
        ep_assert(self._LL_MAX_TOPK + 1 <= groups * per_group, "kNumMaxTopK + 1 <= num_warp_groups * "
                  "num_warps_per_group", _LL_CU)
        ep_assert(num_topk <= self._LL_MAX_TOPK, "num_topk <= kNumMaxTopK", _LL_CU)
        ep_assert(num_experts * 8 <= vendor.NUM_WORKSPACE_BYTES, "num_experts * sizeof(int) * 2 <= workspace", _LL_CU)
        if use_ue8m0:
            ep_assert(round_scale, "round_scale and \"UE8M0 SF requires `round_scale=True`\"", _LL_CU)
        ep_assert(hidden in self._LL_HIDDEN_SIZES, "false and \"Unsupported hidden\"", _LL_CU)
        local = num_experts // self.group_size
        device_assert(self.runtime.num_qps is not None and self.runtime.num_qps >= local,
                      "ibgda_get_state()->num_rc_per_pe >= num_local_experts", _LL_CU)
        device_assert(-(-num_experts // groups) > 1, "num_sms > 1", _LL_CU)
        device_assert(per_group > 1 and groups < 15, "num_warps_per_group > 1 and num_warp_groups < 15", _LL_CU)

    @_graph_kernel
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=True,
                             round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):  # noqa: ANN201
        self._deterministic_check()
        self._qp_depth_check(num_max_dispatch_tokens_per_rank)
        args = (x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
                return_recv_hook)
        check_args("low_latency_dispatch", "(self: deep_ep._C.Buffer, arg0: torch.Tensor, arg1: torch.Tensor, "
                   "arg2: Optional[torch.Tensor], arg3: Optional[torch.Tensor], arg4: int, arg5: int, arg6: bool, "
                   "arg7: bool, arg8: bool, arg9: bool, arg10: bool)", args, "ttTTiibbbbb")
        T = int(num_max_dispatch_tokens_per_rank)
        self._ll_checks(x, topk_idx, T, num_experts, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
                        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
        recv_x, recv_count, handle = self._ll_exchange(x, topk_idx, T, num_experts, use_fp8, round_scale, use_ue8m0,
                                                       cumulative_local_expert_recv_stats)
        (recv_x, recv_count), handle, hook = _received(self, (recv_x, recv_count), return_recv_hook, handle, recv_count)
        return recv_x, recv_count, handle, EventOverlap(EventHandle() if async_finish else None), hook

    def _ll_exchange(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, num_experts: int, use_fp8: bool,
                     round_scale: bool, use_ue8m0: bool, stats: torch.Tensor | None) -> tuple[Any, torch.Tensor, tuple]:
        R, h = self.group_size, x.shape[1]
        local = num_experts // R
        if use_fp8:
            data, inv = _quantize_fp8(x, round_scale)
            columns = [as_bytes(data), as_bytes(inv)]  # messages carry fp32 scales; UE8M0 is taken on arrival
        else:
            columns = [as_bytes(x)]
        got, payload = self._gather_slots(x, topk_idx, T, columns, use_fp8)
        k = topk_idx.shape[1]
        slot, expert, position, recv_count = self._place_received(
            from_bytes(got[:, payload : payload + 8 * k], torch.int64), local, T)
        if stats is not None:
            stats += recv_count
        if use_fp8:
            fp8 = from_bytes(got[:, :h], torch.float8_e4m3fn)
            inv = from_bytes(got[:, h:payload], torch.float32)
            recv_data = _nan_like((local, R * T, h), torch.float8_e4m3fn)
            recv_data.view(torch.uint8)[expert, position] = fp8.view(torch.uint8)[slot]
            if use_ue8m0:  # extract_required_scale_format: the fp32 bits >> 23, four per int32, column-major
                exps = ((inv[slot].view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
                packed = _nan_like((local, h // 512, R * T), torch.int32)
                packed.transpose(1, 2)[expert, position] = from_bytes(exps, torch.int32)
                recv_scales = packed.transpose(1, 2)
            else:  # fp32 scale_inv, column-major [E_l, R·T, H/128]
                scales = _nan_like((local, h // 128, R * T), torch.float32)
                scales.transpose(1, 2)[expert, position] = inv[slot]
                recv_scales = scales.transpose(1, 2)
            recv_x: Any = (recv_data, recv_scales)
        else:
            bf16 = from_bytes(got[:, :payload], torch.bfloat16)
            recv_x = _nan_like((local, R * T, h), torch.bfloat16)
            recv_x[expert, position] = bf16[slot]
        handle = self._low_latency_handle(slot, expert, position, local, T, h, num_experts)
        return recv_x, recv_count, handle

    def _gather_slots(self, x: torch.Tensor, topk_idx: torch.Tensor, T: int, columns: list[torch.Tensor],
                      use_fp8: bool, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Every rank's T message slots (payload, then the top-k ids as int64, -1 past the batch, then any
        ``extra`` metadata bytes) to every rank: ``[R·T, payload + 8k (+ extra)]`` and the payload width."""
        n, k = x.shape[0], topk_idx.shape[1]
        payload = sum(c.shape[1] for c in columns)
        more = 0 if extra is None else extra.shape[1]
        slots = torch.zeros(T, payload + 8 * k + more, dtype=torch.uint8)
        ids = torch.full((T, k), -1, dtype=torch.int64)
        ids[:n] = topk_idx.long()
        if n:
            slots[:n, :payload] = torch.cat(columns, dim=1)
            if extra is not None:
                slots[:n, payload + 8 * k :] = extra
        slots[:, payload : payload + 8 * k] = as_bytes(ids)
        got = self._comm.all_gather(slots, (("payload", payload), ("metadata", 8 * k + more)))
        self.calls.append(VendorCall("low_latency_dispatch", x.dtype, use_fp8, n * payload * self.group_size))
        return got, payload

    def _place_received(self, gids: torch.Tensor, local: int, T: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each (received slot, local expert) lands in the masked layout: the slot (src_rank·T +
        token), its local expert, its position in that expert's block, and the per-expert counts. An
        expert's rows are grouped by source rank, the blocks in the order the receiver's atomicAdd handed
        them out and each block's tokens in the sender's slot order (internode_ll.cu dispatch): both
        arbitrary, so both are shuffled here (seeded per rank)."""
        first = self.rank * local
        hits = ((gids >= first) & (gids < first + local)).nonzero()
        expert = gids[hits[:, 0], hits[:, 1]] - first
        source = hits[:, 0] // T
        block_order = torch.rand(local, self.group_size, generator=self._arrivals).argsort(dim=1).argsort(dim=1)
        key = (expert * self.group_size + block_order[expert, source]).double() * 2 + torch.rand(
            expert.numel(), generator=self._arrivals, dtype=torch.float64)
        order = torch.argsort(key)
        slot, expert = hits[order, 0], expert[order]
        recv_count = torch.bincount(expert, minlength=local).to(torch.int32)
        start = torch.cumsum(recv_count.long(), 0) - recv_count.long()
        return slot, expert, torch.arange(slot.numel()) - start[expert], recv_count

    def _low_latency_handle(self, slot: torch.Tensor, expert: torch.Tensor, position: torch.Tensor, local: int,
                            T: int, h: int, num_experts: int) -> tuple:
        """``(packed_recv_src_info, packed_recv_layout_range, T, hidden, num_experts)``: each received row's
        source token, and per (local expert, source rank) ``pack2<int, int64_t>(count, begin)`` — the
        count in the low 32 bits (csrc/kernels/legacy/internode_ll.cu dispatch, utils.cuh pack2)."""
        R = self.group_size
        src_info = torch.full((local, R * T), -1, dtype=torch.int32)
        src_info[expert, position] = (slot % T).to(torch.int32)
        src_rank = slot // T
        layout_range = torch.zeros(local, R, dtype=torch.int64)
        for e in range(local):
            for r in range(R):
                sel = (expert == e) & (src_rank == r)
                count = int(sel.sum())
                begin = int(position[sel].min()) if count else 0
                layout_range[e, r] = (begin << 32) | count
        return (src_info, layout_range, T, h, num_experts)

    @_graph_kernel
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None,
                            combine_wait_recv_cost_stats=None):  # noqa: ANN201
        """Weighted: token t gets Σ_j topk_weights[t, j] · (expert topk_idx[t, j]'s row for t)."""
        self._deterministic_check()
        src_info, layout_range, T, hidden, num_experts = handle
        self._qp_depth_check(T)
        combined, event = self._ll_combine(x, topk_idx, topk_weights, src_info, layout_range, T, num_experts,
                                           use_logfmt, zero_copy, async_finish, return_recv_hook, out,
                                           combine_wait_recv_cost_stats)
        combined, hook = _combined_with_hook(self, combined, return_recv_hook)
        return combined, event, hook

    def _ll_combine(self, x: Any, topk_idx: Any, topk_weights: Any, src_info: Any, layout_range: Any, T: Any,
                    num_experts: Any, use_logfmt: Any, zero_copy: Any, async_finish: Any, return_recv_hook: Any,
                    out: Any, wait_stats: Any) -> tuple[torch.Tensor, EventOverlap]:
        args = (x, topk_idx, topk_weights, src_info, layout_range, wait_stats, T, num_experts, use_logfmt, zero_copy,
                async_finish, return_recv_hook, out)
        check_args("low_latency_combine", "(self: deep_ep._C.Buffer, arg0: torch.Tensor, ..., arg6: int, arg7: int, "
                   "arg8: bool, ..., arg12: Optional[torch.Tensor])", args, "tttttTiibbbbT")
        return self._ll_combine_checked(x, topk_idx, topk_weights, src_info, layout_range, int(T), int(num_experts),
                                        use_logfmt, zero_copy, async_finish, return_recv_hook, out, self._LL_MAX_TOPK)

    def _ll_combine_checked(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            src_info: torch.Tensor, layout_range: torch.Tensor, T: int, num_experts: int,
                            use_logfmt: bool, zero_copy: bool, async_finish: bool, return_recv_hook: bool,
                            out: torch.Tensor | None, max_topk: int) -> tuple[torch.Tensor, EventOverlap]:
        w, R = _BUFFER_HPP, self.group_size
        ep_assert(self.low_latency_mode, "low_latency_mode", w)
        local = num_experts // R
        ep_assert(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16,
                  "x.dim() == 3 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16", w)
        ep_assert(x.size(0) == local, "x.size(0) == num_experts / num_ranks", w)
        ep_assert(x.size(1) == R * T, "x.size(1) == num_ranks * num_max_dispatch_tokens_per_rank", w)
        ep_assert(x.size(2) % 16 == 0 and x.size(2) % 128 == 0, "x.size(2) % sizeof(int4) == 0 and % 128 == 0", w)
        ep_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and contiguous", w)
        ep_assert(topk_idx.size(0) == topk_weights.size(0) and topk_idx.size(1) == topk_weights.size(1),
                  "topk_idx.size(0) == topk_weights.size(0) and topk_idx.size(1) == topk_weights.size(1)", w)
        ep_assert(topk_idx.dtype == self._TOPK_IDX_T, "topk_idx.scalar_type() == topk_idx_t", w)
        ep_assert(topk_weights.dim() == 2 and topk_weights.is_contiguous(), "topk_weights.dim() == 2", w)
        ep_assert(topk_weights.size(0) <= T, "topk_weights.size(0) <= num_max_dispatch_tokens_per_rank", w)
        ep_assert(topk_weights.dtype == torch.float32, "topk_weights.scalar_type() == torch::kFloat32", w)
        ep_assert(src_info.dim() == 2 and src_info.is_contiguous() and src_info.dtype == torch.int32
                  and x.size(0) == src_info.size(0), "src_info: 2-d contiguous int32, one row per local expert", w)
        ep_assert(layout_range.dim() == 2 and layout_range.is_contiguous() and layout_range.dtype == torch.int64,
                  "layout_range: 2-d contiguous int64", w)
        ep_assert(layout_range.size(0) == local and layout_range.size(1) == R, "layout_range [E_local, R]", w)
        hidden, k, n = x.size(2), topk_weights.size(1), topk_weights.size(0)
        layout = vendor.LowLatencyLayout.build(T, hidden, num_experts)
        ep_assert(layout.total_bytes <= self.num_rdma_bytes, "layout.total_bytes <= num_rdma_bytes", w)
        ep_assert(not (async_finish and return_recv_hook), "not(async and return_recv_hook)", w)
        if out is not None:
            ep_assert(out.dim() == 2 and out.is_contiguous() and out.size(0) == n and out.size(1) == hidden
                      and out.dtype == x.dtype, "out checks", w)
        ep_assert(k <= max_topk, "num_topk <= kNumMaxTopk", _LL_CU)
        ep_assert(not (zero_copy and use_logfmt), "not(zero_copy and use_logfmt)", _LL_CU)
        if use_logfmt or zero_copy:
            raise NotImplementedError("the fake sends BF16 rows (no LogFMT, no zero-copy)")
        self._check_runtime(uses_nvshmem=True)
        self._ll_signalling(T, hidden, num_experts, self._next_half())
        # Back to each source rank: a [T, E_l, H] block per rank, each expert's row at its source token.
        blocks = torch.zeros(R, T, local, hidden, dtype=torch.bfloat16)
        for e in range(local):
            for r in range(R):
                packed = int(layout_range[e, r])
                count, begin = packed & 0xFFFFFFFF, packed >> 32  # unpack2: (count, begin)
                if count:
                    rows = slice(begin, begin + count)
                    blocks[r, src_info[e, rows].long(), e] = x[e, rows]
        back = self._comm.all_to_all(as_bytes(blocks.view(R * T, local * hidden)), None, None,
                                     (("combine", 2 * local * hidden),))
        got = from_bytes(back, torch.bfloat16).view(R, T, local, hidden).float()

        def weighted() -> torch.Tensor:  # the receive phase: reads topk_idx/topk_weights as they are then
            result = torch.zeros(n, hidden, dtype=torch.float32)
            for j in range(k):
                e = topk_idx[:n, j].long()
                valid = e >= 0
                rank, le = (e // local).clamp(min=0), (e % local).clamp(min=0)
                rows = got[rank, torch.arange(n), le]
                result += torch.where(valid[:, None], rows * topk_weights[:n, j, None].float(), 0.0)
            return result.to(torch.bfloat16)

        event = EventOverlap(EventHandle() if async_finish else None)
        if return_recv_hook:  # filled by the hook (``_received``), from the routing at that time
            combined = out if out is not None else torch.empty(n, hidden, dtype=torch.bfloat16)
            return (combined, weighted), event
        combined = weighted()
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, event


def _unpack_bias(bias: Any) -> tuple[Any, Any]:
    """``Buffer._unpack_bias``: a tensor, a pair, or nothing."""
    if isinstance(bias, torch.Tensor):
        return bias, None
    if isinstance(bias, tuple):
        assert len(bias) == 2
        return bias
    return None, None


def _poisoned_copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and strides whose contents are garbage until the hook fills it."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    if t.dtype.is_floating_point and t.element_size() > 1:
        out.fill_(float("nan"))
    else:
        out.view(torch.uint8 if t.element_size() == 1 else t.dtype).fill_(-1 if t.element_size() > 1 else 255)
    return out


class _Receipt:
    """One hook-mode LL call's receive phase, pending on its Buffer until the hook runs. The next LL call on the
    Buffer (its send zeroes the other signalling half: ``vendor.LL_CALLS_AWAITING_RECEIVE``), a clean or internode
    normal-mode kernels overwrite what it waits on: its receive kernel then spins until DeepEP's trap."""

    def __init__(self) -> None:
        self.overwritten = ""
        self.runs = 0


def _pending_receive(buffer: Any) -> _Receipt:
    """A hook-mode call has sent: its receive is the Buffer's pending one (outside a capture's recording)."""
    receipt = _Receipt()
    if _kernels_run():
        buffer._pending_receive = receipt
    return receipt


def _receiving(buffer: Any, receipt: _Receipt) -> None:
    """The hook runs the receive kernel: lost if a later call overwrote its signalling; captured into a graph if a
    capture is open (the eager call's receive would never run eagerly, and each replay would run a stray one)."""
    if _CAPTURE["graph"] is not None and not _CAPTURE["recording"]:
        raise RuntimeError("(fake) an eager low-latency call's receive hook ran inside a CUDA-graph capture: on a GPU "
                           "its kernel is captured into the graph instead of running now")
    if receipt.overwritten:
        raise lose_context(f"(fake) a low-latency receive kernel waited for signalling that {receipt.overwritten} "
                           "overwrote before its hook ran (DeepEP: a spin until the ~100 s trap; one LL call per "
                           "Buffer may await its receive)")
    if buffer._pending_receive is receipt:
        buffer._pending_receive = None
    receipt.runs += 1


def _received(buffer: Any, results: tuple, return_recv_hook: bool, handle: tuple | None = None,
              counts: torch.Tensor | None = None) -> tuple[tuple, tuple | None, Callable[[], None] | None]:
    """DeepEP returns ``std::nullopt`` (None) for the hook unless ``return_recv_hook``; with it the kernel only
    sends, and the received tensors, the dispatch's counts and its handle's ``src_info``/``layout_range`` are
    filled when the hook runs the receive kernel (csrc/legacy/buffer.hpp low_latency_*; internode_ll.cu receive
    phase). A second run adds the counts again (``atomicAdd``); a receive whose signalling was overwritten first
    loses the context."""
    if not return_recv_hook:
        return results, handle, None
    handle_tensors = [] if handle is None else [t for t in handle if isinstance(t, torch.Tensor)]
    flat = [t for r in results for t in (r if isinstance(r, tuple) else (r,))] + handle_tensors
    shown = [_poisoned_copy(t) for t in flat]
    receipt = _pending_receive(buffer)

    def hook() -> None:
        _receiving(buffer, receipt)
        for dst, src in zip(shown, flat):
            if receipt.runs > 1 and src is counts:
                dst.add_(src)  # recv_count accumulates by atomicAdd in the receive phase
            else:
                dst.copy_(src)

    it = iter(shown)
    received = tuple(tuple(next(it) for _ in r) if isinstance(r, tuple) else next(it) for r in results)
    new_handle = None if handle is None else tuple(next(it) if isinstance(t, torch.Tensor) else t for t in handle)
    return received, new_handle, hook


def _combined_with_hook(buffer: Any, combined: Any, return_recv_hook: bool
                        ) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """``low_latency_combine``'s output and hook. With the hook the output (``out`` itself when given, else
    ``torch::empty``) holds garbage until the hook runs the receive phase, which reads ``topk_idx``/``topk_weights``
    then (internode_ll.cu combine, receive phase) and writes the weighted sums."""
    if not return_recv_hook:
        return combined, None
    output, weighted = combined
    output.copy_(_poisoned_copy(output))
    receipt = _pending_receive(buffer)

    def hook() -> None:
        _receiving(buffer, receipt)
        output.copy_(weighted())

    return output, hook


def install_statics(cls: type) -> None:
    """The static methods of ``Buffer`` bound to ``cls``'s own class state (``cls.num_sms``, its tables)."""

    def set_num_sms(new_num_sms):  # noqa: ANN001, ANN202
        assert new_num_sms % 2 == 0, "The SM count must be even"
        cls.num_sms = new_num_sms

    def get_dispatch_config(num_ranks):  # noqa: ANN001, ANN202
        table = cls._TUNED_DISPATCH
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return cls._CONFIG(cls.num_sms, *table[num_ranks])

    def get_combine_config(num_ranks):  # noqa: ANN001, ANN202
        table = cls._TUNED_COMBINE
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return cls._CONFIG(cls.num_sms, *table[num_ranks])

    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):  # noqa
        return _low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def is_sm90_compiled():  # noqa: ANN202
        return True

    def capture():  # noqa: ANN202
        return EventOverlap(EventHandle())

    for fn in (set_num_sms, get_dispatch_config, get_combine_config, get_low_latency_rdma_size_hint,
               is_sm90_compiled, capture):
        setattr(cls, fn.__name__, staticmethod(fn))


install_statics(Buffer)

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "VendorCall", "install_statics",
           "topk_idx_t"]


def __getattr__(name: str) -> Any:
    """V2's ``ElasticBuffer`` and ``EPHandle`` (``deep_ep_elastic``), exported as DeepEP 2.x does; loaded on first use
    (that module builds on this one)."""
    if name in ("ElasticBuffer", "EPHandle", vendor.V2_PHYSICAL_DOMAIN_SIZE):
        from . import deep_ep_elastic

        return getattr(deep_ep_elastic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
