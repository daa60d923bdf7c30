"""The fakes model per-process GPU state (a lost CUDA context after a device assert, NVSHMEM's init/finalize);
on a GPU a new process starts clean, here each test does."""

import pytest

from moe_dispatch_cuda_deepep.fakes import _native, deep_ep


@pytest.fixture(autouse=True)
def _fresh_fake_process_state():
    yield
    _native.reset_context()
    deep_ep.reset_nvshmem()
