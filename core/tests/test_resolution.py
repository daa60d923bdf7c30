"""The wire-dtype resolution order, its recorded trail, fallbacks and strictness."""

import os
import warnings

import pytest

import moe_dispatch as md
import moe_dispatch.backend as mdb
import moe_dispatch.planning as mdp
from moe_dispatch._reference.builtin import TorchBackend

D, M = md.DispatchDtype, md.Mode


class AscendLike(mdb.Backend):
    """A table-driven backend shaped like Ascend: BF16 default, FP8 → INT8, NVFP4 rejected."""

    name = "ascend-like"
    capabilities = mdb.Capabilities(
        dtypes={M.NORMAL: frozenset({D.BF16, D.INT8}), M.LOW_LATENCY: frozenset({D.BF16, D.INT8})},
        fallbacks={(m, D.FP8): mdb.Fallback(D.INT8, "A2/A3 have no FP8") for m in M},
        rejections={D.NVFP4: "Ascend has no NVFP4"},
        default_dtype=D.BF16,
    )


RUNNERS = {
    "torch": mdb.RunnerInfo("torch", None, "any"),
    "cutlass": mdb.RunnerInfo("cutlass", D.BF16, "quantizes internally"),
}


def resolve(spec=None, backend=None, env=None, **kw):
    spec = spec or md.DispatchSpec(256, 8, 2)
    return mdp.resolve_output_dtype(spec, backend or TorchBackend(), env=env or {}, runners=RUNNERS, **kw)


def test_library_default_is_fp8_and_every_step_is_recorded():
    r = resolve()
    assert r.dtype is D.FP8
    sources = [s.source for s in r.steps]
    assert sources[0].startswith("explicit") and sources[-2] == "library default" and sources[-1].startswith("validate")
    assert [s.decided for s in r.steps].count(True) == 2
    assert "fp8" in str(r)


def test_each_step_beats_the_later_ones():
    full = md.DispatchSpec(256, 8, 2, output_dtype="int8", quant=md.QuantHints(dispatcher_output_dtype="fp8"), runner="cutlass")
    env = {"MOE_DISPATCH_OUTPUT_DTYPE": "bf16", "SGLANG_DEEPEP_BF16_DISPATCH": "1"}
    assert resolve(full, env=env).dtype is D.INT8  # explicit
    no_explicit = md.DispatchSpec(256, 8, 2, quant=md.QuantHints(dispatcher_output_dtype="int8"), runner="cutlass")
    env2 = {"MOE_DISPATCH_OUTPUT_DTYPE": "nvfp4", "SGLANG_DEEPEP_BF16_DISPATCH": "1"}
    with pytest.raises(md.InvalidSpecError, match="global scale"):
        resolve(no_explicit, env=env2)  # env wins, and NVFP4 then needs its scale
    with pytest.warns(DeprecationWarning, match="MOE_DISPATCH_OUTPUT_DTYPE"):
        assert resolve(no_explicit, env={"SGLANG_DEEPEP_BF16_DISPATCH": "1"}).dtype is D.BF16
    assert resolve(no_explicit).dtype is D.INT8  # quant hint beats runner
    gs = md.DispatchSpec(256, 8, 2, quant=md.QuantHints(input_global_scale=10.0, dispatcher_output_dtype="int8"))
    assert resolve(gs).dtype is D.NVFP4  # a global scale beats the dtype hint
    assert resolve(md.DispatchSpec(256, 8, 2, runner="cutlass")).dtype is D.BF16  # runner beats defaults
    assert resolve(backend=AscendLike()).dtype is D.BF16  # backend default beats FP8


def test_env_auto_and_false_legacy_flag_are_recorded_and_skipped():
    r = resolve(env={"MOE_DISPATCH_OUTPUT_DTYPE": "auto", "SGLANG_DEEPEP_BF16_DISPATCH": "0"})
    assert r.dtype is D.FP8
    notes = {s.source: s.note for s in r.steps}
    assert notes["env MOE_DISPATCH_OUTPUT_DTYPE"] == "set to auto"
    assert "false" in notes["env SGLANG_DEEPEP_BF16_DISPATCH"]


def test_bad_env_values_name_the_variable():
    with pytest.raises(md.InvalidSpecError, match="MOE_DISPATCH_OUTPUT_DTYPE"):
        resolve(env={"MOE_DISPATCH_OUTPUT_DTYPE": "fp16"})
    with pytest.raises(md.InvalidSpecError, match="SGLANG_DEEPEP_BF16_DISPATCH"):
        resolve(env={"SGLANG_DEEPEP_BF16_DISPATCH": "maybe"})


def test_fallback_is_recorded_warned_and_strict_raises():
    spec = md.DispatchSpec(256, 8, 2, output_dtype="fp8")
    with pytest.warns(md.DtypeFallbackWarning, match="no FP8"):
        r = resolve(spec, AscendLike())
    assert (r.dtype, r.requested, r.is_fallback) == (D.INT8, D.FP8, True)
    assert "fallback from fp8" in r.steps[-1].note
    with pytest.raises(md.UnsupportedDtypeError, match="strict") as info:
        resolve(spec, AscendLike(), strict=True)
    assert info.value.parameter == "output_dtype" and "int8" in info.value.allowed


def test_rejection_is_a_typed_error_listing_what_is_allowed():
    spec = md.DispatchSpec(256, 8, 2, output_dtype="nvfp4", quant=md.QuantHints(input_global_scale=1.0))
    with pytest.raises(md.UnsupportedDtypeError, match="no NVFP4") as info:
        resolve(spec, AscendLike())
    assert "bf16, int8" in info.value.allowed


def test_unknown_runner_suggests_the_nearest():
    with pytest.raises(md.InvalidSpecError, match="did you mean 'cutlass'"):
        resolve(md.DispatchSpec(256, 8, 2, runner="cutlas"))


def test_quant_hints_from_dict_rejects_typos_with_a_suggestion():
    with pytest.raises(md.InvalidSpecError, match="did you mean dispatcher_output_dtype") as info:
        md.QuantHints.from_dict({"dispather_output_dtype": "int8"})
    assert info.value.parameter == "quant"
    assert md.QuantHints.from_dict({"dispatcher_output_dtype": "int8"}).dispatcher_output_dtype is D.INT8


def test_resolution_reads_only_the_env_it_is_given():
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolve(env={"MOE_DISPATCH_OUTPUT_DTYPE": "int8", "SGLANG_DEEPEP_BF16_DISPATCH": "1"})
    assert dict(os.environ) == before
    assert resolve(env={}).dtype is D.FP8  # whatever the process env says


def test_fp8_hidden_size_must_be_a_multiple_of_128():
    with pytest.raises(md.InvalidSpecError, match="multiple of 128"):
        resolve(md.DispatchSpec(200, 8, 2, output_dtype="fp8"))
    assert resolve(md.DispatchSpec(200, 8, 2, output_dtype="int8")).dtype is D.INT8


@pytest.mark.parametrize(
    "kwargs,parameter",
    [
        (dict(hidden_size=0, num_experts=8, top_k=2), "hidden_size"),
        (dict(hidden_size=128, num_experts=8, top_k=9), "top_k"),
        (dict(hidden_size=128, num_experts=8, top_k=2, mode="fast"), "mode"),
        (dict(hidden_size=128, num_experts=8, top_k=2, output_dtype="fp16"), "output_dtype"),
        (dict(hidden_size=128, num_experts=8, top_k=2, num_max_dispatch_tokens_per_rank=0), "num_max_dispatch_tokens_per_rank"),
        (dict(hidden_size=128, num_experts=8, top_k=2, group_list_type=2), "group_list_type"),
        (dict(hidden_size=128, num_experts=8, top_k=2, quant={"global_scale": 1.0}), "quant"),
    ],
)
def test_bad_specs_name_the_parameter(kwargs, parameter):
    with pytest.raises(md.InvalidSpecError) as info:
        md.DispatchSpec(**kwargs)
    assert info.value.parameter == parameter


def test_cli_args_round_trip_into_a_spec():
    import argparse

    parser = md.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--dispatch-output-dtype", "int8", "--dispatch-mode", "low_latency",
                              "--num-max-dispatch-tokens-per-rank", "256"])
    spec = md.DispatchSpec.from_args(args, hidden_size=1024, num_experts=64, top_k=4)
    assert (spec.output_dtype, spec.mode, spec.num_max_dispatch_tokens_per_rank) == (D.INT8, M.LOW_LATENCY, 256)
    assert args.moe_a2a_backend == "torch"


def test_the_engine_flags_reach_create_dispatcher_strict_included():
    """``--moe-a2a-backend`` and ``--dispatch-strict`` are create_dispatcher's (add_cli_args says how): a fallback
    warns without the flag and is an error with it."""
    import argparse
    import warnings

    from moe_dispatch._reference.builtin import TorchBackend

    class FallsBackFromInt8(TorchBackend):
        capabilities = mdb.Capabilities(dtypes={M.NORMAL: frozenset({D.BF16, D.FP8})},
                                        fallbacks={(M.NORMAL, D.INT8): mdb.Fallback(D.FP8, "no INT8 kernel")})

    parser = md.add_cli_args(argparse.ArgumentParser())
    for argv, strict in (([], False), (["--dispatch-strict"], True)):
        args = parser.parse_args(["--dispatch-output-dtype", "int8", *argv])
        spec = md.DispatchSpec.from_args(args, hidden_size=128, num_experts=4, top_k=2)
        backend = FallsBackFromInt8() if args.moe_a2a_backend == "torch" else args.moe_a2a_backend
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if strict:
                with pytest.raises(md.UnsupportedDtypeError):
                    md.create_dispatcher(backend, spec, env={}, strict=args.dispatch_strict)
            else:
                assert md.create_dispatcher(backend, spec, env={}, strict=args.dispatch_strict).output_dtype is D.FP8
        assert strict or any(issubclass(w.category, md.DtypeFallbackWarning) for w in seen)


class _PerModeWorlds(mdb.Backend):
    """Normal mode on tuned EP sizes only, low latency on any (DeepEP's rule)."""

    name = "per_mode_worlds"
    capabilities = mdb.Capabilities(
        dtypes={md.Mode.NORMAL: frozenset({md.DispatchDtype.BF16}), md.Mode.LOW_LATENCY: frozenset({md.DispatchDtype.BF16})},
        world_sizes=frozenset(range(1, 65)),
        limits={md.Mode.NORMAL: mdb.Limits(world_sizes=frozenset({2, 4, 8}))},
    )


def test_world_sizes_are_checked_per_mode():
    backend = _PerModeWorlds()
    caps = backend.capabilities
    assert caps.world_sizes_for(md.Mode.NORMAL) == {2, 4, 8} and caps.world_sizes_for(md.Mode.LOW_LATENCY) == set(
        range(1, 65))
    low_latency = md.DispatchSpec(128, 96, 2, mode="low_latency", output_dtype="bf16")
    backend.check_spec(low_latency, 3)  # any EP size in low-latency mode
    with pytest.raises(md.InvalidSpecError) as err:
        backend.check_spec(md.DispatchSpec(128, 96, 2, output_dtype="bf16"), 3)
    assert (err.value.parameter, err.value.value, err.value.allowed) == ("world_size", 3, "2, 4, 8")
    assert "(normal)" in str(err.value)
    with pytest.raises(md.InvalidSpecError):  # the backend-wide set still binds every mode
        backend.check_spec(md.DispatchSpec(128, 96 * 2, 2, mode="low_latency", output_dtype="bf16"), 96)
    assert caps.to_dict()["limits"]["normal"]["world_sizes"] == [2, 4, 8]
