from moe_dispatch.testing import BackendConformance


class TestExampleBackend(BackendConformance):
    backend_name = "example"
