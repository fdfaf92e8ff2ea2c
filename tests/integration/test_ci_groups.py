"""A CI run whose Chromium, Vulkan build or patched llama.cpp is missing turns red.

In a copy of this checkout's tests and scripts (so the records land there, not beside the
real ones): scripts/browser-env.sh and scripts/vulkan-env.sh run as `make test` runs them,
on a PATH without chromium, glslc or apt-get, and record why they could not build; one more
patch beside scripts/llama-patches makes the installed llama.cpp one built without this
checkout's patches. Then pytest runs the real test files of the three groups CI must run
(tests/ci_groups.py): every one of their tests fails, none skips, and the run exits 1. With
LLMRUN_TEST_SKIP naming the groups, the same tests skip, on purpose and said, and it exits 0.
(The serving tests of test_web.py, which need no browser, are left out with `-m needs_env`.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.unit.test_ci_groups import _bare_path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["test_web.py", "test_vulkan.py", "test_repack.py", "test_repack_fallback.py"]
# the group tests of those files: 12 of test_web.py's (the others serve, without a browser),
# test_vulkan.py's 6, test_repack.py's 5 and test_repack_fallback.py's 1
GROUP_TESTS = 12 + 6 + 5 + 1


def _checkout(tmp_path: Path) -> Path:
    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "tests", copy / "tests", ignore=ignore)
    shutil.copytree(ROOT / "scripts", copy / "scripts", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", copy)
    return copy


def _pytest(copy: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "LLMRUN_TEST_SKIP"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "needs_env",
         "-c", str(copy / "pyproject.toml"), "--rootdir", str(copy),
         *(str(copy / "tests" / "integration" / f) for f in FILES)],
        cwd=copy, env={**base, **env}, capture_output=True, text=True, timeout=600)


def _count(out: str, what: str) -> int:
    found = re.search(rf"(\d+) {what}", out.splitlines()[-1] if out.strip() else "")
    return int(found.group(1)) if found else 0


def test_a_run_without_the_groups_environments_fails(tmp_path: Path) -> None:
    copy = _checkout(tmp_path)
    bare = _bare_path(tmp_path)
    home = {"HOME": os.environ.get("HOME", "/tmp")}
    bash = shutil.which("bash")
    assert bash
    browser = subprocess.run([bash, str(copy / "scripts/browser-env.sh")], env={
        **home, "PATH": bare}, capture_output=True, text=True, timeout=60)
    vulkan = subprocess.run([bash, str(copy / "scripts/vulkan-env.sh"), sys.executable,
                             str(copy / ".venv-vulkan")], env={**home, "PATH": bare},
                            capture_output=True, text=True, timeout=60)
    # as in `make test`: the scripts say why and let the run go on
    assert browser.returncode == 0 and (copy / ".browser.why").exists(), browser.stderr
    assert vulkan.returncode == 0 and (copy / ".venv-vulkan.why").exists(), vulkan.stderr
    (copy / "scripts/llama-patches/0099-not-in-this-build.patch").write_text("--- a\n+++ b\n")

    red = _pytest(copy)
    out = red.stdout + red.stderr
    assert red.returncode == 1, out
    assert _count(out, "error") == GROUP_TESTS, out  # each fails in setup, with the reason
    assert _count(out, "skipped") == _count(out, "passed") == 0, out
    assert "the browser tests cannot run here: no Chromium" in out
    assert "the vulkan tests cannot run here: missing Debian packages" in out
    assert "the repack tests cannot run here: the installed llama.cpp was built with" in out

    asked = _pytest(copy, LLMRUN_TEST_SKIP="browser,vulkan,repack")
    out = asked.stdout + asked.stderr
    assert asked.returncode == 0, out
    assert _count(out, "skipped") == GROUP_TESTS, out
    assert "skipped on purpose (LLMRUN_TEST_SKIP)" in out
