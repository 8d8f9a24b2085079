"""The fast lane's duration budget (tests/_lanes.py), run on tests of its own with a tiny budget: an unmarked
test over it fails and names itself, a slow fixture counts, a test marked slow passes."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

SLEEPERS = """
import time

import pytest


@pytest.fixture
def slow_fixture():
    time.sleep(0.3)


def test_unmarked():
    time.sleep(0.3)


def test_unmarked_with_a_slow_fixture(slow_fixture):
    pass


@pytest.mark.slow
def test_marked():
    time.sleep(0.3)


@pytest.mark.slow
def test_marked_with_a_slow_fixture(slow_fixture):
    pass


def test_quick():
    pass
"""


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, budget: str,
        *args: str) -> pytest.RunResult:
    """SLEEPERS under the budget's hooks, taken by a conftest as tests/conftest.py takes them, with
    ``EVOCACHE_TEST_BUDGET_S=budget``. No plugin of the environment loads: they only cost time here."""
    monkeypatch.setenv("EVOCACHE_TEST_BUDGET_S", budget)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest("from _lanes import pytest_configure, pytest_runtest_makereport  # noqa: F401\n")
    pytester.makepyfile(test_sleepers=SLEEPERS)
    return pytester.runpytest("-p", "no:cacheprovider", *args)


def test_an_unmarked_test_over_the_budget_fails_and_a_marked_one_passes(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(pytester, monkeypatch, "0.1")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines([
        "test_sleepers.py::test_unmarked took * s (setup * s, call * s), over the fast lane's budget of 0.1 s "
        "(EVOCACHE_TEST_BUDGET_S): mark it slow or make it faster",
        "test_sleepers.py::test_unmarked_with_a_slow_fixture took * s (setup * s, call * s), over the fast "
        "lane's budget of 0.1 s (EVOCACHE_TEST_BUDGET_S): mark it slow or make it faster",
    ], consecutive=False)
    assert [line.split()[1] for line in result.stdout.lines if line.startswith("FAILED ")] == [
        "test_sleepers.py::test_unmarked", "test_sleepers.py::test_unmarked_with_a_slow_fixture"]


def test_the_fast_lane_leaves_the_slow_tests_out(pytester: pytest.Pytester,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(pytester, monkeypatch, "0.1", "-m", "not slow")
    result.assert_outcomes(passed=1, failed=2, deselected=2)


@pytest.mark.parametrize("value", ["soon", "0", "-1"])
def test_a_budget_that_is_not_a_positive_number_is_a_usage_error(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    result = run(pytester, monkeypatch, value)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*EVOCACHE_TEST_BUDGET_S={value!r}: expected a number of seconds*"])
