"""The test groups CI must run, and the guard that keeps them from skipping in silence.

`make test` (what CI runs) first builds each group's environment: scripts/browser-env.sh
(Debian's Chromium, for the web page's tests), scripts/vulkan-env.sh (.venv-vulkan, llama.cpp
with its Vulkan backend on Mesa's CPU driver) and scripts/llama-wheel.sh (llama.cpp with
llmrun's patches, which the repack tests compare against its ordinary kernels). The scripts
stay tolerant: when they cannot build an environment they record why (.browser.why,
.venv-vulkan.why) and `make test` goes on, so one run still reports the whole suite. The
tests, not the scripts, turn that into red: a test of a group whose environment is missing
FAILS with the recorded reason. Before this, those tests skipped, and a CI run whose Chromium
install or Vulkan build broke (or whose wheel lacked the patches) stayed green with the
features untested.

On a machine that cannot have a group's environment, the skip is asked for by name:
LLMRUN_TEST_SKIP=browser,vulkan,agents (comma-separated groups, see GROUPS). Those tests then skip,
and the run's summary says so.

What counts:
- `needs(group, check)`: the marker of a test (or module) in a group. `check()` returns ""
  when the environment is there, else why not; it runs before the test's fixtures.
- `inapplicable(reason)`: a skip for a condition that makes a test meaningless here, not a
  missing build (a CPU without the instructions a kernel needs). Only these, and the asked-for
  skips, may skip a group's test.
- The guard: any other skip of a group's test (a `pytest.skip` in a fixture, a `skipif`
  mark) is reported as that test's failure, and fails the run, listed in its summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NoReturn

import pytest

SKIP_VAR = "LLMRUN_TEST_SKIP"
GROUPS = {
    "browser": "the web page in headless Chromium (tests/integration/test_web.py; "
               "Chromium from scripts/browser-env.sh)",
    "vulkan": "llama.cpp's Vulkan backend on Mesa's CPU driver (tests/integration/"
              "test_vulkan.py; .venv-vulkan from scripts/vulkan-env.sh)",
    "repack": "llmrun's repacked CPU kernels against llama.cpp's own (tests/integration/"
              "test_repack*.py; llama.cpp with scripts/llama-patches, from "
              "scripts/llama-wheel.sh, and CMake)",
    "agents": "Claude Code and Codex driven through their own CLIs (tests/e2e/; each a "
              "pinned version from npm, installed once under ~/.cache/llmrun/npm)",
}
MARK = "needs_env"


class Inapplicable(pytest.skip.Exception):  # type: ignore[name-defined]
    """A skip for a condition of this machine that no build changes."""


class SkippedOnPurpose(pytest.skip.Exception):  # type: ignore[name-defined]
    """A skip that LLMRUN_TEST_SKIP asked for."""


def needs(group: str, check: Callable[[], str]) -> pytest.MarkDecorator:
    """The mark of a test in `group`: `check()` says why its environment is missing ("")."""
    if group not in GROUPS:
        raise ValueError(f"unknown test group {group!r}: one of {', '.join(GROUPS)}")
    return getattr(pytest.mark, MARK)(group, check)


def inapplicable(reason: str) -> NoReturn:
    raise Inapplicable(f"inapplicable here: {reason}")


def skipped_on_purpose() -> frozenset[str]:
    names = {n.strip() for n in os.environ.get(SKIP_VAR, "").split(",") if n.strip()}
    unknown = sorted(names - GROUPS.keys())
    if unknown:
        # a misspelt group would otherwise make its tests fail with a reason that hides why
        raise pytest.UsageError(f"{SKIP_VAR}: unknown test group {', '.join(unknown)} (the "
                                f"groups: {', '.join(GROUPS)})")
    return frozenset(names)


@dataclass
class _Record:
    checked: dict[Callable[[], str], str]
    silent: list[tuple[str, str, str]]  # (test, group, skip reason): what fails the run
    on_purpose: dict[str, int]  # group: tests skipped because LLMRUN_TEST_SKIP named it


_RECORD = pytest.StashKey[_Record]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}(group, check): a test CI must run, in one of the groups of "
        "tests/ci_groups.py: it fails when its environment is missing, unless "
        f"{SKIP_VAR} names the group")
    skipped_on_purpose()  # a bad value stops the run before any test
    config.stash[_RECORD] = _Record({}, [], {})


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker(MARK)
    return str(mark.args[0]) if mark else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    record = item.config.stash[_RECORD]
    for mark in item.iter_markers(MARK):
        group, check = mark.args
        if check not in record.checked:
            record.checked[check] = check()  # once a run: a check may start a process
        why = record.checked[check]
        if not why:
            continue
        if group in skipped_on_purpose():
            raise SkippedOnPurpose(f"{SKIP_VAR}={group}: skipped on purpose: {why}")
        pytest.fail(f"the {group} tests cannot run here: {why}\n"
                    f"CI must run them ({GROUPS[group]}). On a machine that cannot have "
                    f"this, skip them on purpose: {SKIP_VAR}={group}", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    group = _group(item)
    if group is None or not report.skipped or hasattr(report, "wasxfail"):
        return report
    raised = call.excinfo.value if call.excinfo is not None else None
    record = item.config.stash[_RECORD]
    if isinstance(raised, SkippedOnPurpose):
        record.on_purpose[group] = record.on_purpose.get(group, 0) + 1
    elif not isinstance(raised, Inapplicable):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(raised)
        record.silent.append((item.nodeid, group, reason))
        # shown as what it is: a failure of this test (F or E, in the run's count), not an
        # "s" among the passes
        report.outcome = "failed"
        report.longrepr = (f"{reason}\nthe {group} tests may not skip for this: CI must run "
                           f"them ({GROUPS[group]}). A skip of theirs is allowed only as "
                           f"inapplicable here (tests/ci_groups.py) or when {SKIP_VAR} names "
                           f"the group.")
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # (the reports above already count as failures; this holds even if another plugin's
    # hook turned one back)
    if session.config.stash[_RECORD].silent and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    record = config.stash[_RECORD]
    tr = terminalreporter
    if record.on_purpose:
        tr.section(f"skipped on purpose ({SKIP_VAR})", sep="=", yellow=True, bold=True)
        for group, n in sorted(record.on_purpose.items()):
            tr.line(f"{group}: {n} tests not run: {GROUPS[group]}", yellow=True)
    if record.silent:
        tr.section("tests CI must run were skipped: the run fails", sep="=", red=True,
                   bold=True)
        for nodeid, group, reason in record.silent:
            tr.line(f"{nodeid} ({group}): {reason}", red=True)
        tr.line(f"A group's test may skip only as inapplicable here (tests/ci_groups.py) or "
                f"when {SKIP_VAR} names its group.", red=True)
