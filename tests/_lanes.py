"""The two test lanes: ``make test-fast`` runs ``pytest -m "not slow"``, ``make test`` runs everything.

A test is marked ``slow`` when it starts Ray, a server, a subprocess of the CLI, the demo or a bench script. What
keeps the fast lane fast is this budget: a test not marked ``slow`` whose setup and call together take longer
than ``EVOCACHE_TEST_BUDGET_S`` seconds (default ``DEFAULT_BUDGET_S``) fails, whichever lane runs it, with a
message that names it. Setup counts because a slow fixture (a session-scoped one included, charged to the first
test that asks for it) is as slow as a slow test body. Teardown does not: a session fixture's teardown would be
charged to whichever test happens to run last.

A pytest plugin: tests/conftest.py takes its hooks (as does the conftest of tests/test_lanes.py's own runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Several times the slowest test of the fast lane measured on two shared cores, so that a loaded machine does
# not fail a test that is fast on a quiet one.
DEFAULT_BUDGET_S = 20.0
BUDGET_VARIABLE = "EVOCACHE_TEST_BUDGET_S"

_SETUP_S = pytest.StashKey[float]()
_BUDGET_S = pytest.StashKey[float]()


def budget_s() -> float:
    """The budget in seconds: ``EVOCACHE_TEST_BUDGET_S`` when set, else ``DEFAULT_BUDGET_S``."""
    raw = os.environ.get(BUDGET_VARIABLE)
    if raw is None or not raw.strip():
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_VARIABLE}={raw!r}: expected a number of seconds") from None
    if not value > 0:
        raise pytest.UsageError(f"{BUDGET_VARIABLE}={raw!r}: expected a number of seconds above 0")
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: starts Ray, a server, a CLI subprocess, the demo or a bench script (make test only)"
    )
    config.stash[_BUDGET_S] = budget_s()  # read once: a bad value is a usage error at start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "setup":
        item.stash[_SETUP_S] = report.duration
        return
    if report.when != "call" or not report.passed or item.get_closest_marker("slow") is not None:
        return
    setup = item.stash.get(_SETUP_S, 0.0)
    budget = item.config.stash[_BUDGET_S]
    if setup + report.duration > budget:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {setup + report.duration:.2f} s (setup {setup:.2f} s, call "
            f"{report.duration:.2f} s), over the fast lane's budget of {budget:g} s "
            f"({BUDGET_VARIABLE}): mark it slow or make it faster"
        )
