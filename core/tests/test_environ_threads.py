"""``restored_environ`` under threads: it touches only the variables it is told
about, restores each to its own previous value, runs blocks that agree at once and blocks that
disagree one after the other, and never raises KeyError while other threads set and delete
unrelated variables."""

from __future__ import annotations

import os
import threading
import time

import pytest

import moe_dispatch as md
from moe_dispatch.backend import restored_environ

SCOPED = "MD_TEST_ENVIRON_SCOPED"
WRITTEN = "MD_TEST_ENVIRON_WRITTEN"
OTHER = "MD_TEST_ENVIRON_OTHER_"


@pytest.fixture(autouse=True)
def _clean_environment():
    def clear() -> None:
        for name in [n for n in os.environ if n.startswith("MD_TEST_ENVIRON_")]:
            os.environ.pop(name, None)

    clear()
    yield
    clear()


def _run(threads: list[threading.Thread], seconds: float = 60.0) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)
        assert not t.is_alive(), "a thread did not finish"


def test_blocks_on_several_threads_leave_another_threads_variables_alone():
    """Four threads run scoped blocks (each its own value of one variable, as four dispatchers
    with different settings would) while a fifth sets and deletes variables of its own. Before the
    fix the block snapshotted and restored the WHOLE environment: it deleted what the fifth thread
    set meanwhile (``MD_TEST_ENVIRON_OTHER_KEEP_*`` vanished), brought back what it deleted, and
    raised a raw KeyError (or RuntimeError: dictionary changed size) when a variable vanished
    between its snapshot and its restore."""
    errors: list[str] = []
    done = threading.Event()
    kept: dict[str, str] = {}

    def block_user(i: int) -> None:
        mine = f"thread-{i}"
        try:
            for _ in range(400):
                with restored_environ({SCOPED: mine}):
                    if os.environ.get(SCOPED) != mine:
                        errors.append(f"{mine} saw {os.environ.get(SCOPED)!r} inside its own block")
                    time.sleep(0)  # let the other threads run inside the block
                    if os.environ.get(SCOPED) != mine:
                        errors.append(f"{mine} saw {os.environ.get(SCOPED)!r} later in its own block")
        except BaseException as exc:  # noqa: BLE001 - the point: nothing may escape
            errors.append(f"{mine}: {type(exc).__name__}: {exc}")

    def other_writer() -> None:
        j = 0
        try:
            while not done.is_set():
                j += 1
                keep, churn = f"{OTHER}KEEP_{j}", f"{OTHER}CHURN_{j}"
                os.environ[keep] = str(j)
                kept[keep] = str(j)
                os.environ[churn] = "x"
                time.sleep(0)
                os.environ.pop(churn, None)  # deleted by this thread: must stay deleted
                for name, value in list(kept.items())[-20:]:
                    if os.environ.get(name) != value:
                        errors.append(f"{name} was {os.environ.get(name)!r}, set to {value!r} by its thread")
                        kept[name] = os.environ.get(name)  # type: ignore[assignment]
        except BaseException as exc:  # noqa: BLE001
            errors.append(f"writer: {type(exc).__name__}: {exc}")

    users = [threading.Thread(target=block_user, args=(i,)) for i in range(4)]
    writer = threading.Thread(target=other_writer)
    writer.start()
    try:
        _run(users)
    finally:
        done.set()
        writer.join(10)
    assert not errors, f"{len(errors)} problems, e.g. {errors[:5]}"
    for name, value in kept.items():
        assert os.environ.get(name) == value, f"{name} vanished or changed"
    assert not any(n.startswith(f"{OTHER}CHURN_") for n in os.environ), "a deleted variable came back"
    assert SCOPED not in os.environ


def test_two_blocks_never_interleave():
    """A block holds the process-wide lock for its whole body: a second thread's block starts after
    the first one has restored, so each vendor call sees its own value from start to end."""
    spans: list[tuple[str, float, float, str | None, str | None]] = []
    first_inside = threading.Event()

    def block(name: str, hold: float) -> None:
        with restored_environ({SCOPED: name}):
            start = time.monotonic()
            seen_start = os.environ.get(SCOPED)
            if name == "first":
                first_inside.set()
            time.sleep(hold)
            spans.append((name, start, time.monotonic(), seen_start, os.environ.get(SCOPED)))

    a = threading.Thread(target=block, args=("first", 0.3))
    a.start()
    assert first_inside.wait(10)
    b = threading.Thread(target=block, args=("second", 0.0))
    _run([b])
    a.join(10)
    (n1, s1, e1, start1, end1), (n2, s2, e2, start2, end2) = sorted(spans, key=lambda s: s[1])
    assert (n1, n2) == ("first", "second")
    assert s2 >= e1, "the second block ran while the first was inside"
    assert (start1, end1, start2, end2) == ("first", "first", "second", "second")
    assert SCOPED not in os.environ


def test_blocks_that_set_the_same_values_run_at_once():
    """Two dispatchers of one kind on two threads of a rank (separate groups): their blocks agree, so
    the second does not wait for the first. With one lock for every block, a rank whose threads
    entered in the order A, B and a peer whose threads entered B, A waited for each other until the
    collective's timeout: here the first block stays inside until the second is inside too."""
    first_inside, second_inside = threading.Event(), threading.Event()
    seen: list[tuple[bool, str | None]] = []

    def one() -> None:
        with restored_environ({SCOPED: "same", WRITTEN: None}):
            first_inside.set()
            seen.append((second_inside.wait(10), os.environ.get(SCOPED)))

    def two() -> None:
        first_inside.wait(10)
        with restored_environ({SCOPED: "same", WRITTEN: None}):
            second_inside.set()

    _run([threading.Thread(target=one), threading.Thread(target=two)])
    assert seen == [(True, "same")], "the second block waited for the first"
    assert SCOPED not in os.environ


@pytest.mark.parametrize("first,second,names", [
    ({SCOPED: "same"}, {SCOPED: "other"}, ()),  # another value: each vendor call sees its own
    ({SCOPED: "same", WRITTEN: "1"}, {SCOPED: "same", WRITTEN: None}, ()),  # agree on one, not the other
    ({SCOPED: "same"}, {SCOPED: "same"}, (WRITTEN,)),  # the vendor may write WRITTEN: what it writes is unknown
])
def test_blocks_that_disagree_wait(first, second, names):
    began: list[float] = []
    ended: list[float] = []
    inside = threading.Event()

    def one() -> None:
        with restored_environ(first, names=names):
            inside.set()
            time.sleep(0.3)
            ended.append(time.monotonic())

    def two() -> None:
        inside.wait(10)
        with restored_environ(second, names=names):
            began.append(time.monotonic())

    _run([threading.Thread(target=one), threading.Thread(target=two)])
    assert began[0] >= ended[0], "the disagreeing block ran inside the first"
    assert SCOPED not in os.environ and WRITTEN not in os.environ


def test_a_shared_value_stays_until_the_last_block_ends():
    os.environ[SCOPED] = "before"
    first_may_leave, second_inside = threading.Event(), threading.Event()
    seen: list[str | None] = []

    def one() -> None:
        with restored_environ({SCOPED: "same"}):
            second_inside.wait(10)
        first_may_leave.set()

    def two() -> None:
        with restored_environ({SCOPED: "same"}):
            second_inside.set()
            first_may_leave.wait(10)
            seen.append(os.environ.get(SCOPED))  # the first block has ended; this one has not

    _run([threading.Thread(target=one), threading.Thread(target=two)])
    assert seen == ["same"]
    assert os.environ[SCOPED] == "before"


def test_only_named_variables_are_restored_each_to_its_own_value():
    os.environ[SCOPED] = "before"
    with restored_environ({SCOPED: "during", f"{OTHER}UNSET": None}, names=(WRITTEN,)):
        assert os.environ[SCOPED] == "during" and f"{OTHER}UNSET" not in os.environ
        os.environ[WRITTEN] = "a vendor constructor wrote this"  # named: restored (unset)
        os.environ[f"{OTHER}NOT_NAMED"] = "another thread's"  # not named: left alone
    assert os.environ[SCOPED] == "before"
    assert WRITTEN not in os.environ
    assert os.environ[f"{OTHER}NOT_NAMED"] == "another thread's"


def test_a_named_variable_deleted_inside_the_block_raises_nothing():
    """Whoever deletes a named variable during the block (the vendor, another thread), the restore
    puts back the previous value or leaves it unset; no KeyError."""
    os.environ[WRITTEN] = "old"
    with restored_environ({SCOPED: "x"}, names=(WRITTEN,)):
        del os.environ[SCOPED]
        del os.environ[WRITTEN]
    assert os.environ[WRITTEN] == "old" and SCOPED not in os.environ


def test_an_error_in_the_block_still_restores():
    with pytest.raises(RuntimeError, match="vendor failed"):
        with restored_environ({SCOPED: "x"}, names=(WRITTEN,)):
            os.environ[WRITTEN] = "half-written"
            raise RuntimeError("vendor failed")
    assert SCOPED not in os.environ and WRITTEN not in os.environ


def test_blocks_nest_on_one_thread():
    os.environ[WRITTEN] = "old"
    with restored_environ({SCOPED: "outer"}, names=(WRITTEN,)):
        os.environ[WRITTEN] = "outer wrote"
        with restored_environ({SCOPED: "inner"}, names=(WRITTEN,)):
            assert os.environ[SCOPED] == "inner"
            os.environ[WRITTEN] = "inner wrote"
        assert os.environ[SCOPED] == "outer" and os.environ[WRITTEN] == "outer wrote"
        with restored_environ({SCOPED: "outer"}):  # agrees: joins the outer block's value
            assert os.environ[SCOPED] == "outer"
        assert os.environ[SCOPED] == "outer"
    assert SCOPED not in os.environ and os.environ[WRITTEN] == "old"


@pytest.mark.parametrize("values,names,parameter", [
    ({SCOPED: 5}, (), f"values[{SCOPED!r}]"),
    ({SCOPED: "a\0b"}, (), f"values[{SCOPED!r}]"),
    ({"": "1"}, (), "names"),
    ({"A=B": "1"}, (), "names"),
    (None, WRITTEN, "names"),
    (None, (WRITTEN, 3), "names"),
    ([(SCOPED, "1")], (), "values"),
])
def test_what_the_environment_cannot_hold_is_a_typed_error_before_anything_is_set(values, names, parameter):
    with pytest.raises(md.InvalidSpecError) as info:
        with restored_environ(values, names=names):
            pytest.fail("the block must not run")
    assert info.value.parameter == parameter
    assert SCOPED not in os.environ and WRITTEN not in os.environ
