"""The guard of the test groups CI must run (tests/ci_groups.py), on tiny test files run by
pytest's own `pytester` (in this process, with the plugin), and the environment scripts'
failure records (scripts/browser-env.sh, scripts/vulkan-env.sh) on a PATH that has neither
the browser, nor the Vulkan build's tools, nor apt-get to install them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ("-p", "tests.ci_groups", "-p", "no:cacheprovider")

GROUP_TESTS = """
import pytest
from tests.ci_groups import inapplicable, needs

CALLS = []

def check():
    CALLS.append(1)
    return {why!r}

pytestmark = needs("browser", check)

def test_one():
    pass

def test_two():
    assert len(CALLS) == 1  # checked once a run, whatever the number of tests
"""


@pytest.fixture(autouse=True)
def _no_skips_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMRUN_TEST_SKIP", raising=False)


def test_a_group_whose_environment_is_missing_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(GROUP_TESTS.format(why="simulated: no Chromium here"))
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(errors=2)  # failed in setup, before the test's fixtures
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*the browser tests cannot run here: simulated: no Chromium*",
                                 "*LLMRUN_TEST_SKIP=browser*"])


def test_a_group_whose_environment_is_there_runs(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(GROUP_TESTS.format(why=""))
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK


def test_asked_for_skips_pass_and_are_said(pytester: pytest.Pytester,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_TEST_SKIP", "vulkan, browser")
    pytester.makepyfile(GROUP_TESTS.format(why="simulated: no Chromium here"))
    result = pytester.runpytest(*PLUGIN, "-rs")
    result.assert_outcomes(skipped=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*skipped on purpose (LLMRUN_TEST_SKIP)*",
                                 "browser: 2 tests not run*"])


def test_asking_to_skip_another_group_changes_nothing(pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_TEST_SKIP", "vulkan")
    pytester.makepyfile(GROUP_TESTS.format(why="simulated: no Chromium here"))
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(errors=2)


def test_an_unknown_group_to_skip_stops_the_run(pytester: pytest.Pytester,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_TEST_SKIP", "browsr")
    pytester.makepyfile(GROUP_TESTS.format(why=""))
    result = pytester.runpytest(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*LLMRUN_TEST_SKIP: unknown test group browsr*"])


def test_any_other_skip_of_a_group_test_fails_the_run(pytester: pytest.Pytester) -> None:
    # the environment is there, but a fixture, a mark or the test itself skips: each such
    # skip is that test's failure, and the run ends red, naming them
    pytester.makepyfile("""
        import pytest
        from tests.ci_groups import needs

        pytestmark = needs("vulkan", lambda: "")

        @pytest.fixture
        def device():
            pytest.skip("no device")

        def test_in_a_fixture(device):
            pass

        @pytest.mark.skipif(True, reason="no .venv-vulkan")
        def test_by_a_mark():
            pass

        def test_in_the_test():
            pytest.skip("not built")

        def test_runs():
            pass
    """)
    result = pytester.runpytest(*PLUGIN)
    # the skips in setup (the fixture's, the mark's) count as errors, the test's as a failure
    result.assert_outcomes(passed=1, errors=2, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*tests CI must run were skipped: the run fails*",
        "*::test_in_a_fixture (vulkan): Skipped: no device",
        "*::test_by_a_mark (vulkan): Skipped: no .venv-vulkan",
        "*::test_in_the_test (vulkan): Skipped: not built"])
    assert "the vulkan tests may not skip for this" in result.stdout.str()


def test_inapplicable_skips_and_skips_outside_the_groups_pass(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import pytest
        from tests.ci_groups import inapplicable, needs

        @needs("repack", lambda: "")
        def test_kernel():
            inapplicable("this CPU has no AVX2")

        @needs("repack", lambda: "")
        def test_expected_to_fail():
            pytest.xfail("known")

        def test_elsewhere():
            pytest.skip("npm is not installed")
    """)
    result = pytester.runpytest(*PLUGIN, "-rs")
    result.assert_outcomes(skipped=2, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*inapplicable here: this CPU has no AVX2*"])
    assert "tests CI must run were skipped" not in result.stdout.str()


# -- the scripts' records ------------------------------------------------------------------

def _bare_path(tmp_path: Path) -> str:
    """A PATH with the few tools the scripts use and no chromium, glslc or apt-get: a machine
    where the environment cannot be built (run as root or not)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("dirname", "ls", "mkdir", "rm", "id", "cat"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def _copy_script(tmp_path: Path, name: str) -> Path:
    # a copy in a throwaway checkout: its record lands there, not beside the real tests
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    script = tmp_path / "repo" / "scripts" / name
    shutil.copy2(ROOT / "scripts" / name, script)
    return script


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash
    return subprocess.run([bash, str(script), *args], capture_output=True, text=True,
                          timeout=60, env={"HOME": os.environ.get("HOME", "/tmp"), **env})


def test_browser_env_records_a_missing_browser(tmp_path: Path) -> None:
    script = _copy_script(tmp_path, "browser-env.sh")
    run = _run(script, PATH=_bare_path(tmp_path))
    assert run.returncode == 0, run.stderr  # `make test` goes on; the tests fail
    why = (tmp_path / "repo" / ".browser.why").read_text()
    assert "no Chromium" in why
    assert "LLMRUN_TEST_SKIP=browser" in run.stderr


def test_browser_env_checks_the_browser_it_is_told(tmp_path: Path) -> None:
    script = _copy_script(tmp_path, "browser-env.sh")
    record = tmp_path / "repo" / ".browser.why"
    run = _run(script, PATH=os.environ["PATH"], LLMRUN_TEST_CHROMIUM=str(tmp_path / "none"))
    assert run.returncode == 0, run.stderr
    assert "is not an executable file" in record.read_text()
    true = shutil.which("true")
    assert true
    run = _run(script, PATH=os.environ["PATH"], LLMRUN_TEST_CHROMIUM=true)
    assert run.returncode == 0 and not record.exists(), run.stderr  # fixed: the record goes


def test_vulkan_env_records_missing_build_tools(tmp_path: Path) -> None:
    script = _copy_script(tmp_path, "vulkan-env.sh")
    venv = tmp_path / "repo" / ".venv-vulkan"
    run = _run(script, "python3", str(venv), PATH=_bare_path(tmp_path))
    assert run.returncode == 0, run.stderr
    assert "missing Debian packages" in Path(f"{venv}.why").read_text()
    assert "LLMRUN_TEST_SKIP=vulkan" in run.stderr


def test_env_scripts_build_nothing_for_a_group_skipped_on_purpose(tmp_path: Path) -> None:
    script = _copy_script(tmp_path, "vulkan-env.sh")
    shutil.copy2(ROOT / "scripts" / "browser-env.sh", script.parent)
    venv = tmp_path / "repo" / ".venv-vulkan"
    run = _run(script, "python3", str(venv), PATH=_bare_path(tmp_path),
               LLMRUN_TEST_SKIP="browser,vulkan")
    assert run.returncode == 0 and "skipped on purpose" in run.stdout, run.stderr
    assert not venv.exists() and not Path(f"{venv}.why").exists()
    run = _run(script.parent / "browser-env.sh", PATH=_bare_path(tmp_path / "b"),
               LLMRUN_TEST_SKIP="vulkan, browser")
    assert run.returncode == 0 and "skipped on purpose" in run.stdout, run.stderr
    assert not (tmp_path / "repo" / ".browser.why").exists()
