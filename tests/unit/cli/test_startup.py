"""CLI start-up: what `import llmrun.cli`, `llmrun --help`, `list` and `ps` load.

`--help`, `list` and `ps` should each start in under 0.25 s on an idle 2-core machine, and
importing httpx, pydantic or Jinja alone costs 0.1-0.3 s, so the heavy modules load only in
the commands that use them. Timing is for scripts/startup_time.py; these tests check the cause
deterministically: each command runs in a fresh interpreter, which then reports its
`sys.modules`.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun import config
from llmrun.store import names
from llmrun.store.manifests import Layer, Manifest, Manifests
from tests.fakes.httpserve import serving

# Never on the way of these commands: the HTTP client library, Jinja and the Go templates,
# the Hub, llama.cpp and its grammar engine, the daemon's web stack, the REPL's line editor.
HEAVY = ("httpx", "jinja2", "huggingface_hub", "llama_cpp", "llguidance", "fastapi",
         "uvicorn", "starlette", "prompt_toolkit", "llmrun.chat.templates",
         "llmrun.engine", "llmrun.daemon", "llmrun.server", "llmrun.api")

_RUN = """
import json, os, sys
sys.argv = ["llmrun", *json.loads(os.environ["ARGV"])]
try:
    from llmrun.cli import main
    if len(sys.argv) > 1:
        main()
except SystemExit:
    pass
with open(os.environ["MODULES_OUT"], "w") as fh:
    json.dump(sorted(sys.modules), fh)
"""


def loaded(tmp_path: Path, *argv: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The modules a fresh interpreter holds after `llmrun ARGV` (after `import llmrun.cli`
    alone when ARGV is empty), and the run itself."""
    out = tmp_path / "modules.json"
    r = subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "ARGV": json.dumps(argv),
                                        "MODULES_OUT": str(out), "COLUMNS": "200"})
    assert out.is_file(), r.stderr
    return set(json.loads(out.read_text())), r


def heavy_in(modules: set[str], extra: tuple[str, ...] = ()) -> list[str]:
    """The modules of HEAVY (and `extra`), packages with their submodules, in `modules`."""
    return sorted(m for m in modules
                  if any(m == x or m.startswith(x + ".") for x in (*HEAVY, *extra)))


def test_importing_the_cli_loads_nothing_heavy(tmp_path: Path) -> None:
    modules, _ = loaded(tmp_path)
    assert heavy_in(modules, ("pydantic", "rich", "llmrun.store", "llmrun.request")) == []


def test_help_loads_neither_the_store_nor_an_http_client(tmp_path: Path) -> None:
    modules, r = loaded(tmp_path, "--help")
    assert "list" in r.stdout and "ps" in r.stdout
    assert heavy_in(modules, ("pydantic", "rich", "llmrun.store", "llmrun.request")) == []


def test_list_reads_manifests_without_templates_or_the_hub(tmp_path: Path,
                                                          _isolated_home: Path) -> None:
    manifest = Manifest(name="smollm2:latest", model=Layer(digest="sha256:" + "0" * 64,
                                                           size=1000))
    Manifests(config.home() / "manifests").put(names.parse("smollm2"), manifest)
    modules, r = loaded(tmp_path, "list")
    assert r.returncode == 0, r.stderr
    assert "smollm2:latest" in r.stdout and manifest.id in r.stdout
    # no validation either: pydantic and the request models alone are ~0.25 s
    assert heavy_in(modules, ("pydantic", "llmrun.request", "llmrun.store.store",
                              "llmrun.store.storage", "filelock")) == []


def test_list_upgrades_manifests_of_older_versions(tmp_path: Path,
                                                   _isolated_home: Path) -> None:
    """A manifest written before it carried its digest, and a damaged file beside it: `list`
    shows the model (validated, the damaged file skipped), stores the digest, and the next
    `list` still needs the validated reader only because of the damaged file."""
    root = config.home() / "manifests"
    manifest = Manifest(name="old:latest", model=Layer(digest="sha256:" + "1" * 64, size=5))
    path = Manifests(root).path(names.parse("old"))
    path.parent.mkdir(parents=True)
    path.write_text(manifest.model_dump_json())  # as versions before the stored digest did
    modules, r = loaded(tmp_path, "list")
    assert r.returncode == 0, r.stderr
    assert "old:latest" in r.stdout and manifest.id in r.stdout
    assert json.loads(path.read_bytes())["digest"] == manifest.digest
    assert Manifests(root).get(names.parse("old")) == manifest  # same model, same id

    modules, r = loaded(tmp_path, "list")
    assert "old:latest" in r.stdout and heavy_in(modules, ("pydantic",)) == []

    damaged = Manifests(root).path(names.parse("broken"))
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"name": "broken:latest", "digest": "')
    modules, r = loaded(tmp_path, "list")
    assert r.returncode == 0, r.stderr
    assert "old:latest" in r.stdout and "broken" not in r.stdout


@pytest.fixture
def fake_daemon(_isolated_home: Path) -> Iterator[list[dict[str, str]]]:
    """An HTTP server on LLMRUN_HOST that answers /api/version and /api/ps as llmrun does;
    yields the requests it saw (path and Authorization header)."""
    seen: list[dict[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append({"path": self.path, "auth": self.headers.get("Authorization", "")})
            body = {"version": "0"} if self.path == "/api/version" else {"models": [{
                "name": "smollm2:latest", "digest": "ab" * 32, "size": 10**8,
                "context_length": 1024, "slots": 4, "slots_busy": 1}]}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("x-llmrun-version", "0")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    host, port = os.environ["LLMRUN_HOST"].split(":")
    with serving(Handler, host, int(port), threaded=False):
        yield seen


def test_ps_asks_the_daemon_without_httpx_or_the_store(
        tmp_path: Path, fake_daemon: list[dict[str, str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_API_KEYS", "k1,k2")
    modules, r = loaded(tmp_path, "ps")
    assert r.returncode == 0, r.stderr
    assert "smollm2:latest" in r.stdout and "1/4" in r.stdout
    assert [x["path"] for x in fake_daemon] == ["/api/version", "/api/ps"]
    assert {x["auth"] for x in fake_daemon} == {"Bearer k1"}  # the key goes on these GETs too
    assert heavy_in(modules, ("llmrun.store", "llmrun.request")) == []
