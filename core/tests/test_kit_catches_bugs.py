"""The conformance kit fails a backend with a bug, in the test named for that bug.

Each mutant in ``kit_mutants.py`` is the torch backend with one deliberate bug; a pytest
run in a subprocess puts the kit on it and the expected test must fail (and the guard must
catch a silently overridden test).
"""

import textwrap

import pytest

pytest_plugins = ["pytester"]

MUTANTS = {
    "DoubleWeight": "test_dispatch_combine_conserves_tokens and 2-normal-fp8",
    "DropsLastRow": "test_dispatch_combine_conserves_tokens and 2-normal-bf16",
    "TokenMajorKeepsWeights": "test_token_major_rows and 2",
    "SmallBuffer": "test_buffer_size_covers_the_traffic and 2-normal-fp8",
    "WritesEnvironment": "test_environment_is_untouched",
    "KeepsLastCall": "test_two_dispatches_in_flight and 2-low_latency",
    "NoisyCombine": "test_same_inputs_same_bits and 2-normal",
    "TableDisagrees": "test_dtype_validation_table and normal-int8",
    "StartsShareOneReceive": "test_two_micro_batches_overlap and 2-normal",
    "ReadsCountsOnHost": "test_no_host_sync_in_cuda_graph_modes and 2-low_latency",
    "StartsRunWhole": "test_split_phase_as_declared and normal",
}


@pytest.fixture
def kit_run(pytester, request):
    tests_dir = request.path.parent

    def run(body: str, selection: str):
        pytester.makepyfile(test_kit=textwrap.dedent(body))
        return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-k", selection,
                                             f"--rootdir={pytester.path}", "--import-mode=importlib",
                                             "-o", f"pythonpath={tests_dir}")

    return run


def test_the_kit_fails_each_buggy_backend_in_the_test_named_for_its_bug_and_passes_the_real_one(kit_run):
    """One run (one rank pool): each mutant fails its test; the same tests on the real backend pass."""
    classes = "\n".join(
        f"class Test{name}(BackendConformance):\n    backend_name = 'torch'\n    backend_factory = kit_mutants.{name}\n"
        for name in MUTANTS
    )
    real = "class TestReal(BackendConformance):\n    backend_name = 'torch'\n"
    selection = " or ".join([*(f"(Test{name} and {MUTANTS[name]})" for name in MUTANTS),
                             "(TestReal and (" + " or ".join(f"({s})" for s in MUTANTS.values()) + "))"])
    result = kit_run("import kit_mutants\nfrom moe_dispatch_testing import BackendConformance\n\n" + classes + real,
                     selection)
    out = result.stdout.str()
    for name in MUTANTS:
        assert f"FAILED test_kit.py::Test{name}::" in out, (name, out[-4000:])
    assert "FAILED test_kit.py::TestReal::" not in out, out[-4000:]
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == len(MUTANTS), out[-4000:]  # one test per mutant, none of the real backend's
    assert outcomes.get("passed", 0) == len(MUTANTS), out[-4000:]  # the real backend's, and only those


def test_the_guard_catches_a_silent_override_and_accepts_an_explained_one(kit_run):
    result = kit_run("""
        import pytest
        from moe_dispatch_testing import BackendConformance

        class TestSilent(BackendConformance):
            backend_name = "torch"

            def test_environment_is_untouched(self, moe_rank_pools):
                pass

        class TestDeleted(BackendConformance):
            backend_name = "torch"
            test_capabilities_are_consistent = None

        class TestExplained(BackendConformance):
            backend_name = "torch"

            @pytest.mark.xfail(reason="this backend is configured through its launcher's environment")
            def test_environment_is_untouched(self, moe_rank_pools):
                raise AssertionError("opted out")
    """, "DO_NOT_OVERRIDE")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "test_environment_is_untouched is overridden without" in out
    assert "test_capabilities_are_consistent was deleted" in out
