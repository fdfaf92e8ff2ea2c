"""`llmrun launch claude` keeps Claude Code's prompt byte-stable between requests,
so each turn reuses the previous turn's KV cache: the real Claude Code (from npm, pinned and
cached), run with launch's environment and settings against a recording server, makes two
requests of one session (`claude -p`, then `--continue`); both go through the Anthropic
dialect and SmolLM2's chat template as the daemon would render them, and the second's
tokens must start with everything of the first that came before its last user message.

Without npm (or with no way to reach its registry) the test fails (LLMRUN_TEST_SKIP=agents
skips it on purpose): it is about Claude
Code's requests, which only Claude Code makes.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmrun.api.anthropic.wire import CountBody, to_request
from llmrun.cli.launch import claude_args, claude_env
from llmrun.engine.draft import common_prefix
from llmrun.engine.host import ModelHost
from llmrun.engine.llama import Context, Model
from llmrun.request import ChatRequest
from tests.ci_groups import needs
from tests.fakes.httpserve import serving

CLAUDE_CODE = "2.1.332"
NPM_ROOT = Path.home() / ".cache" / "llmrun" / "npm" / f"claude-code-{CLAUDE_CODE}"


def _npm_missing() -> str:
    """Why Claude Code cannot be had here ("": installed, or npm is there to install it)."""
    if (NPM_ROOT / "node_modules" / ".bin" / "claude").exists() or shutil.which("npm"):
        return ""
    return "npm is not installed (Debian's nodejs and npm)"


# CI must run these (tests/ci_groups.py): without npm, or when npm cannot install Claude Code,
# they fail; LLMRUN_TEST_SKIP=agents skips them on purpose.
pytestmark = needs("agents", _npm_missing)


@pytest.fixture(scope="module")
def claude() -> Path:
    """The pinned Claude Code, installed once under ~/.cache/llmrun/npm."""
    root, exe = NPM_ROOT, NPM_ROOT / "node_modules" / ".bin" / "claude"
    if not exe.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.fail("npm is not installed")
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(root),
                            f"@anthropic-ai/claude-code@{CLAUDE_CODE}"],
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0 or not exe.exists():
            pytest.fail(f"npm could not install Claude Code: {r.stderr[-300:]}")
    return exe


SSE = "".join(f"event: {e}\ndata: {json.dumps({'type': e, **d})}\n\n" for e, d in (
    ("message_start", {"message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "smollm2",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 1}}}),
    ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "Hi!"}}),
    ("content_block_stop", {"index": 0}),
    ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None},
                       "usage": {"output_tokens": 2}}),
    ("message_stop", {}))).encode()


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An Anthropic-shaped server that answers every message with "Hi!" and keeps the
    request bodies."""
    seen: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path.split("?")[0] == "/v1/messages":
                seen.append(body)
            data = SSE if body.get("stream") else json.dumps({"input_tokens": 10}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream" if body.get("stream")
                             else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url, seen


def test_two_turns_of_claude_code_share_all_but_the_last_message(
        claude: Path, recorder: tuple[str, list[dict[str, Any]]], tmp_path: Path,
        smollm2_path: Path) -> None:
    url, seen = recorder
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **claude_env(url, "smollm2")}
    for extra in (["-p", "Say hi"], ["-p", "--continue", "Now say bye"]):
        r = subprocess.run([str(claude), *claude_args(extra)], cwd=project, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Hi!" in r.stdout
    turns = [b for b in seen if b.get("stream")]
    assert len(turns) == 2, [list(b) for b in seen]
    first, second = turns
    assert first["system"] == second["system"] and first["tools"] == second["tools"]

    model = Model(smollm2_path)
    ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=64, n_threads=1)
    try:
        host = ModelHost(None, model, ctx, 256, 1)  # type: ignore[arg-type]

        def render(body: dict[str, Any]) -> tuple[ChatRequest, list[int]]:
            req = to_request(CountBody.model_validate(body))
            return req, host.prompt.render(req)[0]

        req1, tokens1 = render(first)
        _, tokens2 = render(second)
        before_last = host.prompt.boundary(req1, None, tokens1)
    finally:
        ctx.close()
        model.close()
    assert before_last is not None and before_last > 1000  # system prompt and tools
    assert tokens2[:before_last] == tokens1[:before_last]
    shared = common_prefix(tokens1, tokens2)
    assert shared >= before_last and len(tokens1) - shared < 200, (shared, len(tokens1))
