"""The real Codex CLI (from npm, pinned and cached) on the daemon over the Responses API:
`codex exec` with `llmrun launch codex`'s command line against Gemma 3 270M at 32k context
finishes with exit code 0 after the daemon read its whole ~9k-token prompt, and
a second `codex exec` in the same directory reads that prefix from the cache. And Codex's
`--oss --local-provider ollama` mode gets past its Ollama version check.

Without npm (or with no way to reach its registry) these fail (LLMRUN_TEST_SKIP=agents skips
them on purpose): they are about what
Codex sends, which only Codex does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun.cli.launch import codex_args
from llmrun.store import Store, catalog, names
from tests.ci_groups import needs
from tests.conftest import Daemon

CODEX = "0.169.0"
NPM_ROOT = Path.home() / ".cache" / "llmrun" / "npm" / f"codex-{CODEX}"


def _npm_missing() -> str:
    """Why Codex cannot be had here ("": installed, or npm is there to install it)."""
    if (NPM_ROOT / "node_modules" / ".bin" / "codex").exists() or shutil.which("npm"):
        return ""
    return "npm is not installed (Debian's nodejs and npm)"


# CI must run these (tests/ci_groups.py): without npm, or when npm cannot install Codex,
# they fail; LLMRUN_TEST_SKIP=agents skips them on purpose.
pytestmark = needs("agents", _npm_missing)
GEMMA = "gemma3-32k"


@pytest.fixture(scope="module")
def codex() -> Path:
    """The pinned Codex CLI, installed once under ~/.cache/llmrun/npm."""
    root, exe = NPM_ROOT, NPM_ROOT / "node_modules" / ".bin" / "codex"
    if not exe.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("npm is not installed")
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(root),
                            f"@openai/codex@{CODEX}"],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not exe.exists():
            pytest.fail(f"npm could not install Codex: {r.stderr[-300:]}")
    return exe


@pytest.fixture(scope="module")
def gemma_daemon(tmp_path_factory: pytest.TempPathFactory, gemma3_path: Path
                 ) -> Iterator[Daemon]:
    home = tmp_path_factory.mktemp("codex-home")
    template = catalog.lookup(names.parse("gemma3:270m")).template  # type: ignore[union-attr]
    # Codex asks for no output limit and takes one reached (status "incomplete") as an
    # error, and a 270M model rambles: a one-line answer (the stop string) ends the turn
    Store(home).create(GEMMA, f'FROM {gemma3_path}\nPARAMETER num_ctx 32768\n'
                              f'PARAMETER num_predict 200\nPARAMETER stop """\n"""\n'
                              f'TEMPLATE """{template}"""\n')
    d = Daemon(home, env={"LLMRUN_NUM_PARALLEL": "1"}).start()
    yield d
    d.stop()


def run_codex(exe: Path, workdir: Path, args: list[str],
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    codex_home = workdir.parent / f"{workdir.name}-codex-home"  # not the user's ~/.codex
    codex_home.mkdir(exist_ok=True)
    return subprocess.run([str(exe), *args], cwd=workdir, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "CODEX_HOME": str(codex_home), **(env or {})})


READ = re.compile(rf"{GEMMA}: prompt (\d+) tokens \((\d+) from cache\)")


def test_codex_exec_runs_on_the_daemon_and_reuses_its_prompt(codex: Path,
                                                             gemma_daemon: Daemon,
                                                             tmp_path: Path) -> None:
    work = tmp_path / "project"
    work.mkdir()
    (work / "README.md").write_text("A small project.\n")
    args, env = codex_args(gemma_daemon.url, GEMMA,
                           ["exec", "--skip-git-repo-check", "Say hello in one word."])
    first = run_codex(codex, work, args, env)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    reads = [(int(a), int(b)) for a, b in READ.findall(gemma_daemon.log.read_text())]
    assert reads, gemma_daemon.log.read_text()[-3000:]
    prompt, _ = reads[0]
    assert prompt > 5000  # Codex's instructions and tools, read whole
    second = run_codex(codex, work, args, env)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    later = [(int(a), int(b)) for a, b in READ.findall(gemma_daemon.log.read_text())]
    new = later[len(reads):]
    assert new and new[0][1] >= prompt * 0.8, (reads, new)  # the prefix came from the cache


def test_codex_oss_mode_accepts_the_daemon_as_ollama(codex: Path, gemma_daemon: Daemon,
                                                     tmp_path: Path) -> None:
    work = tmp_path / "oss"
    work.mkdir()
    r = run_codex(codex, work, ["exec", "--skip-git-repo-check", "--oss", "--local-provider",
                                "ollama", "-m", GEMMA, "Say hi."],
                  {"CODEX_OSS_BASE_URL": gemma_daemon.url + "/v1"})
    out = r.stdout + r.stderr
    assert "too old" not in out, out[-3000:]
    assert "/v1/responses" in gemma_daemon.log.read_text() or \
        "/v1/chat/completions" in gemma_daemon.log.read_text()
