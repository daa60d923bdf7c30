"""moe_dispatch.signatures: recorded vendor signatures against callables and source files."""

import textwrap

import pytest

from moe_dispatch.backend import REQUIRED, Param, VendorSignature
from moe_dispatch_testing.signatures import compare, differences, params_of, signature_from_source

RECORDED = VendorSignature(
    "Buffer.dispatch",
    "def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None, "
    "num_worst_tokens: int = 0, config: Optional[Config] = None, *, previous_event=None, scale=-1.5, "
    "kind=Kind.A.value) -> Tuple[torch.Tensor, ...]:",
    source="example@0000000 buffer.py",
)


class Fake:
    def dispatch(self, x, handle=None, num_worst_tokens=0, config=None, *, previous_event=None, scale=-1.5,
                 kind="Kind.A.value"):
        return x


def test_a_def_line_with_annotations_parses_to_its_parameters():
    assert RECORDED.names() == ("self", "x", "handle", "num_worst_tokens", "config", "previous_event", "scale", "kind")
    params = {p.name: p for p in RECORDED.params}
    assert params["x"] == Param("x", "positional", REQUIRED)
    assert params["num_worst_tokens"].default == 0 and params["scale"].default == -1.5
    assert params["previous_event"].kind == "keyword-only"
    assert params["kind"].default == "Kind.A.value"  # not a literal: compared by its source text


def test_an_identical_fake_has_no_differences():
    assert differences(RECORDED, Fake.dispatch) == []


@pytest.mark.parametrize("fake_def,expected", [
    ("def dispatch(self, x, handle=None, config=None, *, previous_event=None, scale=-1.5, kind='Kind.A.value'): pass",
     "missing ['num_worst_tokens']"),
    ("def dispatch(self, x, handle=None, config=None, num_worst_tokens=0, *, previous_event=None, scale=-1.5, "
     "kind='Kind.A.value'): pass", "order differs"),
    ("def dispatch(self, x, handle=None, num_worst_tokens=0, config=None, previous_event=None, scale=-1.5, "
     "kind='Kind.A.value'): pass", "previous_event is positional, recorded keyword-only"),
    ("def dispatch(self, x, handle=None, num_worst_tokens=1, config=None, *, previous_event=None, scale=-1.5, "
     "kind='Kind.A.value'): pass", "num_worst_tokens defaults to 1, recorded 0"),
    ("def dispatch(self, x, handle=None, num_worst_tokens=False, config=None, *, previous_event=None, scale=-1.5, "
     "kind='Kind.A.value'): pass", "num_worst_tokens defaults to False, recorded 0"),
    ("def dispatch(self, x, handle=None, num_worst_tokens=0, config=None, *, previous_event=None, scale=-1.5, "
     "kind='Kind.A.value', **kw): pass", "extra ['kw']"),
])
def test_each_kind_of_difference_is_named(fake_def, expected):
    scope: dict = {}
    exec(fake_def, scope)  # noqa: S102 - a throwaway function definition
    problems = differences(RECORDED, scope["dispatch"])
    assert any(expected in p for p in problems), problems
    assert all(p.startswith("Buffer.dispatch: ") for p in problems)


def test_a_vendor_source_file_is_read_without_importing_it(tmp_path):
    path = tmp_path / "vendor_mod.py"
    path.write_text(textwrap.dedent("""
        import this_module_does_not_exist  # never imported: read by AST only

        class Buffer:
            def dispatch(self, x, handle=None, num_worst_tokens: int = 0, config=None, *, previous_event=None,
                         scale=-1.5, kind=Kind.A.value):
                raise RuntimeError

        def helper(a, /, b, *args, c, **kwargs):
            pass
    """))
    assert compare(RECORDED.params, signature_from_source(path, "Buffer.dispatch")) == []
    assert [p.kind for p in signature_from_source(path, "helper")] == [
        "positional-only", "positional", "*args", "keyword-only", "**kwargs"]
    with pytest.raises(LookupError, match="no class 'Other'"):
        signature_from_source(path, "Other.dispatch")
    with pytest.raises(LookupError, match="no function 'Buffer.combine'"):
        signature_from_source(path, "Buffer.combine")


def test_inspect_and_ast_agree_on_a_python_function():
    def f(a, b=None, *rest, c=True, d="x", **kw):
        return a

    assert params_of(f) == VendorSignature("f", "(a, b=None, *rest, c=True, d='x', **kw)", "here").params


def test_an_expression_default_is_evaluated_where_the_callable_lives():
    """The vendor writes ``activation_type: int = ActivationType.Swiglu.value``; a fake (or the
    vendor itself) that defines ``ActivationType`` and defaults to the value agrees with it, and
    one that defaults to another value does not."""
    import enum

    namespace: dict = {"ActivationType": enum.IntEnum("ActivationType", {"Swiglu": 3, "Relu2": 6})}
    exec("def run(x, activation_type=ActivationType.Swiglu.value): pass\n"  # noqa: S102 - a throwaway def
         "def wrong(x, activation_type=ActivationType.Relu2.value): pass", namespace)
    recorded = VendorSignature("run", "(x, activation_type: int = ActivationType.Swiglu.value)", "example@0 m.py")
    assert differences(recorded, namespace["run"]) == []
    assert differences(recorded, namespace["wrong"]) == ["run: activation_type defaults to 6, recorded 3"]
