"""The conformance kit against the built-in backends, as any plugin would run it."""

from moe_dispatch_testing import BackendConformance


class TestTorchBackend(BackendConformance):
    backend_name = "torch"


class TestAllGatherBackend(BackendConformance):
    backend_name = "allgather"
