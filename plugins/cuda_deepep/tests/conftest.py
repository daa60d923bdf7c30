"""The fakes model per-process GPU state (a lost CUDA context after a device assert, NVSHMEM's init/finalize, an
open CUDA-graph capture) and the adapter keeps one Buffer registry per process, as NVSHMEM is per process (it
outlives a test in a rank pool's worker as it outlives a layer in an engine). On a GPU a new process starts clean;
here each test does, in this process and on every rank of the pools it used."""

import pytest

from moe_dispatch_cuda_deepep import buffers
from moe_dispatch_cuda_deepep_testing.fakes import _native, deep_ep


def fresh_process(rank: int = 0, world: int = 1) -> None:
    """What a new process starts with (run on every rank of a pool, by reference to this module)."""
    registry = getattr(buffers, "PROCESS_BUFFERS", None)
    if registry is not None:
        registry.reset()
    _native.reset_context()
    deep_ep.reset_nvshmem()
    reset_capture = getattr(deep_ep, "reset_capture", None)
    if reset_capture is not None:
        reset_capture()


@pytest.fixture(autouse=True)
def _fresh_fake_process_state(request):
    yield
    fresh_process()
    if "moe_rank_pools" in request.fixturenames:
        request.getfixturevalue("moe_rank_pools").on_every_live_rank(fresh_process)
