"""Work run beside the caller (engines/beside.py): its outcome, and the GIL switch interval
lowered while it runs (CPython keeps it in whole microseconds: 2e-4 reads 199e-6)."""

import sys
import threading

import pytest

from engines.beside import run_beside


@pytest.fixture(autouse=True)
def interpreters_interval():
    """CPython's own 5 ms, whatever a test before left (the server sets 0.2 ms)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(old)


def test_the_future_holds_the_result_or_what_was_raised():
    assert run_beside(lambda: 41 + 1, "adds").result(timeout=10) == 42

    def fails():
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        run_beside(fails, "fails").result(timeout=10)


def test_the_switch_interval_is_lowered_while_any_holder_runs_and_restored_after():
    """Two overlapping holders: the shorter interval while both run, the other's once the
    shorter is done, the interpreter's own after both (one that raised as well); work without
    one leaves it alone."""
    before = sys.getswitchinterval()
    seen = {}
    release_a, release_b, started = threading.Event(), threading.Event(), threading.Barrier(3)

    def holder(name, release, fail=False):
        def run():
            started.wait(10)
            seen[name + " start"] = sys.getswitchinterval()
            assert release.wait(10)
            seen[name + " end"] = sys.getswitchinterval()
            if fail:
                raise RuntimeError("failed")
            return name
        return run

    a = run_beside(holder("a", release_a), "a", switch_interval_s=1e-3)
    b = run_beside(holder("b", release_b, fail=True), "b", switch_interval_s=2e-4)
    started.wait(10)
    seen["plain"] = run_beside(sys.getswitchinterval, "plain").result(timeout=10)
    assert seen["plain"] == pytest.approx(2e-4, abs=2e-6)
    release_b.set()
    with pytest.raises(RuntimeError):
        b.result(timeout=10)
    assert sys.getswitchinterval() == pytest.approx(1e-3, abs=2e-6)  # a still runs
    release_a.set()
    assert a.result(timeout=10) == "a"
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
    assert seen["b end"] == pytest.approx(2e-4, abs=2e-6)
    assert seen["a end"] == pytest.approx(1e-3, abs=2e-6)


def test_an_interval_longer_than_the_interpreters_leaves_it():
    before = sys.getswitchinterval()
    assert run_beside(sys.getswitchinterval, "long", switch_interval_s=before * 10).result(
        timeout=10) == pytest.approx(before, abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
