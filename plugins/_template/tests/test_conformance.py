from moe_dispatch_testing import BackendConformance


class TestExampleBackend(BackendConformance):
    backend_name = "example"
