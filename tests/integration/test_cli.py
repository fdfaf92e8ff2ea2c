"""The `llmrun` command as a user runs it: a real subprocess, a real daemon, the real model."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import make_home


def llmrun(*args: str, stdin: str | None = None, timeout: float = 180,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmrun", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def stop_daemon(home: Path) -> None:
    pid_file = home / "daemon.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                os.kill(pid, 0)
                threading.Event().wait(0.1)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def home_with_model(_isolated_home: Path, smollm2_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    make_home(_isolated_home, smollm2_path)
    monkeypatch.setenv("LLMRUN_CONTEXT_LENGTH", "1024")
    yield _isolated_home
    stop_daemon(_isolated_home)


def test_run_autostarts_daemon_and_answers(home_with_model: Path) -> None:
    first = llmrun("run", "smollm2", "Why is the sky blue?", "--seed", "1")
    assert first.returncode == 0, first.stderr
    assert "started llmrun daemon" in first.stderr
    assert len(first.stdout.split()) > 5, first.stdout
    assert (home_with_model / "logs" / "server.log").exists()
    # a second run talks to the same daemon instead of starting another
    second = llmrun("run", "smollm2", "Say hello.")
    assert second.returncode == 0, second.stderr
    assert "started" not in second.stderr
    assert second.stdout.strip()


def test_run_reads_piped_stdin(home_with_model: Path) -> None:
    r = llmrun("run", "smollm2", stdin="What is the capital of France?\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_concurrent_clis_start_one_daemon(home_with_model: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "llmrun", "run", "smollm2", "Hi"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    started = sum("started llmrun daemon" in err for _, err in results)
    assert started == 1


def test_run_missing_model_names_the_fix(home_with_model: Path) -> None:
    r = llmrun("run", "nonexistent", "hi")
    assert r.returncode == 1
    assert "not found" in r.stderr
    assert "llmrun pull" in r.stderr


def test_run_detects_foreign_server_on_port(_isolated_home: Path) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    host, port = os.environ["LLMRUN_HOST"].split(":")
    server = http.server.HTTPServer((host, int(port)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = llmrun("run", "smollm2", "hi", timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == 1
    assert "not llmrun" in r.stderr


def test_daemon_that_fails_to_start_shows_its_log(_isolated_home: Path) -> None:
    # A socket bound but not listening: connections are refused (no daemon answers), and
    # `llmrun serve` cannot bind the port, so it exits; the CLI must say why.
    host, port = os.environ["LLMRUN_HOST"].split(":")
    with socket.socket() as blocker:
        blocker.bind((host, int(port)))
        r = llmrun("run", "smollm2", "hi", timeout=90)
    assert r.returncode == 1
    assert "exited" in r.stderr
    assert "already in use" in r.stderr


def test_create_list_show_rm(_isolated_home: Path, smollm2_path: Path, tmp_path: Path) -> None:
    mf = tmp_path / "Modelfile"
    mf.write_text(f'FROM {smollm2_path}\nPARAMETER temperature 0.3\nSYSTEM """Be brief."""\n')
    r = llmrun("create", "brief", "-f", str(mf))
    assert r.returncode == 0, r.stderr
    listed = llmrun("list")
    assert "brief:latest" in listed.stdout
    assert "98.4 MB" in listed.stdout
    shown = llmrun("show", "brief")
    assert "Be brief." in shown.stdout and "temperature" in shown.stdout
    # what this CPU's class measured of the file's quantization (Q4_1), where one was
    from llmrun.store.quantspeed import cpu_class, decode_note
    note = decode_note("Q4_1", cpu_class())
    assert note is None or re.search(r"decode speed +" + re.escape(note), shown.stdout), \
        shown.stdout
    assert llmrun("cp", "brief", "brief2").returncode == 0
    assert llmrun("rm", "brief").returncode == 0
    assert len(list((_isolated_home / "blobs").iterdir())) == 1  # still used by brief2
    assert llmrun("rm", "brief2").returncode == 0
    assert list((_isolated_home / "blobs").iterdir()) == []
    assert "brief" not in llmrun("list").stdout


def test_create_refuses_non_gguf(_isolated_home: Path, tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"<html>not a model</html>" * 10)
    mf = tmp_path / "Modelfile"
    mf.write_text(f"FROM {fake}\n")
    r = llmrun("create", "fake", "-f", str(mf))
    assert r.returncode == 1
    assert "not a GGUF file" in r.stderr
    blobs = _isolated_home / "blobs"
    assert not blobs.exists() or list(blobs.iterdir()) == []
    assert "fake" not in llmrun("list").stdout


def test_rm_through_a_running_daemon_unloads_the_model(home_with_model: Path) -> None:
    import httpx

    assert llmrun("cp", "smollm2", "mine").returncode == 0
    r = llmrun("run", "mine", "Hi")
    assert r.returncode == 0, r.stderr
    url = f"http://{os.environ['LLMRUN_HOST']}"
    assert [m["name"] for m in httpx.get(url + "/api/ps").json()["models"]] == ["mine:latest"]
    r = llmrun("rm", "mine")
    assert r.returncode == 0 and "deleted 'mine'" in r.stdout, r.stderr
    assert httpx.get(url + "/api/ps").json()["models"] == []
    assert "mine" not in llmrun("list").stdout
    r = llmrun("rm", "mine")  # the daemon's 404, said as the store says it
    assert r.returncode == 1 and "model 'mine' not found" in r.stderr, r.stderr


def test_rm_missing_model(_isolated_home: Path) -> None:
    r = llmrun("rm", "ghost")
    assert r.returncode == 1
    assert "model 'ghost' not found" in r.stderr


def test_version() -> None:
    r = llmrun("--version")
    assert r.returncode == 0 and r.stdout.startswith("llmrun ")


def test_launch_claude_print_env(home_with_model: Path) -> None:
    r = llmrun("launch", "claude", "--model", "smollm2", "--print-env", "--context", "8192")
    assert r.returncode == 0, r.stderr
    assert "export ANTHROPIC_CUSTOM_HEADERS='X-Llmrun-Num-Ctx: 8192'" in r.stdout
    host = os.environ["LLMRUN_HOST"]
    assert f"export ANTHROPIC_BASE_URL=http://{host}" in r.stdout
    assert "export ANTHROPIC_DEFAULT_SONNET_MODEL=smollm2" in r.stdout
    assert "ANTHROPIC_AUTH_TOKEN" in r.stdout
    assert "export CLAUDE_CODE_ATTRIBUTION_HEADER=0" in r.stdout
    assert "# then: claude --settings" in r.stdout


def test_launch_codex_and_opencode_print_their_setup(home_with_model: Path) -> None:
    host = os.environ["LLMRUN_HOST"]
    r = llmrun("launch", "codex", "-m", "smollm2", "--print-env", "--context", "8192", "--",
               "exec", "hi")
    assert r.returncode == 0, r.stderr
    assert 'model_providers.llmrun.http_headers={ "X-Llmrun-Num-Ctx" = "8192" }' in r.stdout
    assert f"model_providers.llmrun.base_url=\"http://{host}/v1\"" in r.stdout
    assert "model_providers.llmrun.wire_api=\"responses\"" in r.stdout
    assert r.stdout.rstrip().endswith("exec hi")
    r = llmrun("launch", "codex", "-m", "smollm2", "--print-env", "--context", "8192",
               env={"LLMRUN_API_KEYS": "sk-abc"})
    assert "export LLMRUN_API_KEY=sk-abc" in r.stdout  # asked for: shown
    assert "model_providers.llmrun.env_key=\"LLMRUN_API_KEY\"" in r.stdout
    r = llmrun("launch", "opencode", "-m", "smollm2", "--print-config", "--context", "8192")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["provider"]["llmrun"]["options"]["headers"] == {"X-Llmrun-Num-Ctx": "8192"}
    assert cfg["model"] == "llmrun/smollm2"
    assert cfg["provider"]["llmrun"]["options"]["baseURL"] == f"http://{host}/v1"
    r = llmrun("launch", "opencode", "-m", "smollm2", "--print-env", "--context", "8192")
    path = Path(r.stdout.split("OPENCODE_CONFIG=")[1].split()[0])
    assert json.loads(path.read_text()) == cfg and path.stat().st_mode & 0o077 == 0
    r = llmrun("launch", "vim")
    assert r.returncode != 0 and "claude, codex, opencode" in r.stderr


def test_launch_says_plainly_when_a_model_is_too_short_for_the_agent(
        home_with_model: Path) -> None:
    """SmolLM2 was trained for 8192 tokens; Claude Code's own prompt is about 20k: launch
    refuses before the agent starts, in words, and --context lets a user try anyway."""
    for tool in ("claude", "codex", "opencode"):
        r = llmrun("launch", tool, "-m", "smollm2", "--print-env")
        assert r.returncode == 1
        assert "holds at most 8192 tokens" in r.stderr and "--context" in r.stderr, r.stderr
    r = llmrun("launch", "claude", "-m", "ghost", "--print-env")
    assert r.returncode == 1 and "ghost" in r.stderr
    r = llmrun("launch", "claude", "-m", "smollm2", "--print-env", "--context", "0")
    assert r.returncode == 2  # typer's usage error: not a context


def test_launch_loads_the_model_with_the_agents_context(home_with_model: Path,
                                                        gemma3_path: Path,
                                                        tmp_path: Path) -> None:
    """Gemma 3 270M holds 32k: launch loads it with that (not the daemon's default, 1024 in
    these tests) before the agent starts, and the agent is set to send it with each request
    (the stand-in `claude` records its environment, then asks as Claude Code would)."""
    from llmrun.store import Store

    Store(home_with_model).create("gemma", f"FROM {gemma3_path}\n")
    fake = tmp_path / "bin" / "claude"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nenv > {tmp_path}/env\n")
    fake.chmod(0o755)
    r = llmrun("launch", "claude", "-m", "gemma",
               env={"PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines()
               if "=" in line)
    assert env["ANTHROPIC_CUSTOM_HEADERS"] == "X-Llmrun-Num-Ctx: 32768"
    import httpx

    models = httpx.get(f"http://{os.environ['LLMRUN_HOST']}/api/ps").json()["models"]
    assert [(m["name"].split(":")[0], m["context_length"]) for m in models] == \
        [("gemma", 32768)], models


def test_launch_claude_runs_it_with_a_stable_prompt_setup(home_with_model: Path,
                                                          tmp_path: Path) -> None:
    """A stand-in `claude` on PATH records what llmrun ran it with."""
    fake = tmp_path / "bin" / "claude"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    f"env > {tmp_path}/env\n"
                    f"for a in \"$@\"; do echo \"$a\"; done > {tmp_path}/args\n")
    fake.chmod(0o755)
    path = f"{fake.parent}:{os.environ['PATH']}"
    key = "sk-local-7f3a9e"
    r = llmrun("launch", "claude", "-m", "smollm2", "--context", "2048", "--", "-p",
               "hello there", env={"PATH": path, "LLMRUN_API_KEYS": key})
    assert r.returncode == 0, r.stderr
    assert key not in r.stderr + r.stdout  # a key is printed only when asked (--print-env)
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines()
               if "=" in line)
    assert env["ANTHROPIC_BASE_URL"] == f"http://{os.environ['LLMRUN_HOST']}"
    assert env["ANTHROPIC_DEFAULT_OPUS_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "smollm2"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["ANTHROPIC_AUTH_TOKEN"] == key
    args = (tmp_path / "args").read_text().splitlines()
    assert args[0] == "--settings"
    assert json.loads(args[1])["env"]["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert args[2:] == ["-p", "hello there"]


def test_run_shows_a_thinking_models_thought(home_with_model: Path, smollm2_path: Path) -> None:
    from llmrun.store import Store
    from tests.integration.test_api_thinking import TEMPLATE

    Store(home_with_model).create("thinker", f'FROM {smollm2_path}\nTEMPLATE """{TEMPLATE}"""\n'
                                             "PARAMETER num_predict 6\n")
    shown = llmrun("run", "thinker", "Say hi", "--think", "--seed", "1")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("Thinking...\n") and len(shown.stdout) > 20
    hidden = llmrun("run", "thinker", "Say hi", "--think", "--hidethinking", "--seed", "1")
    assert hidden.returncode == 0 and "Thinking" not in hidden.stdout
    refused = llmrun("run", "smollm2", "Say hi", "--think")
    assert refused.returncode == 1 and "does not support thinking" in refused.stderr


def test_bench_prints_ratios_against_raw_llama_cpp(home_with_model: Path) -> None:
    # --against the daemon's own OpenAI endpoint: one run asks llmrun both ways
    host = os.environ["LLMRUN_HOST"]
    r = llmrun("bench", "smollm2", "--levels", "1,2", "--tokens", "4", "--no-prefix",
               "--threads", "1", "--api", "chat", "--against", f"http://{host}/v1")
    assert r.returncode == 0, r.stderr
    header, *rows = [[cell.strip() for cell in line.split("|")[1:-1]]
                     for line in r.stdout.splitlines() if line.startswith("| ")]
    col = {name: i for i, name in enumerate(header)}
    assert [(row[col["concurrency"]], row[col["server"]]) for row in rows] == [
        ("1", "llmrun /api/chat"), ("1", f"{host} /v1"),
        ("2", "llmrun /api/chat"), ("2", f"{host} /v1")]
    for row in rows:
        for name in ("tok/s", "decode tok/s", "raw decode tok/s", "decode / raw decode",
                     "raw-N tok/s", "tok/s / raw-N", "tok/s / raw-1"):
            assert float(row[col[name]]) > 0, (name, row)
    assert float(rows[0][col["schema / plain"]]) > 0  # llmrun at level 1, the default
    assert rows[1][col["schema / plain"]] == "-"  # the other server gets no schema
    assert "raw-1 (llama-cpp-python high-level Llama" in r.stdout
    bad = llmrun("bench", "smollm2", "--levels", "x")
    assert bad.returncode == 1 and "--levels" in bad.stderr
    bad = llmrun("bench", "smollm2", "--api", "grpc")
    assert bad.returncode == 1 and "--api" in bad.stderr


def test_bench_embedding_and_rerank_tables(home_with_model: Path, smollm2_path: Path) -> None:
    """--embedding and --rerank end to end on a workload of a few items: llmrun against its
    own /v1 (as against llama-server), the raw loops beside; every figure there, none
    judged (a busy machine makes any number)."""
    from llmrun.store import Store

    Store(home_with_model).create("ranker", f"FROM {smollm2_path}\nPARAMETER rerank true\n")
    host = os.environ["LLMRUN_HOST"]
    r = llmrun("bench", "ranker", "--embedding", "--rerank", "--levels", "1", "--rounds", "1",
               "--inputs", "2", "--batch", "1", "--docs", "1", "--threads", "1",
               "--against", f"http://{host}/v1")
    assert r.returncode == 0, r.stderr
    assert [line.split(":")[0] for line in r.stdout.splitlines()
            if line.startswith(("embedding:", "rerank:"))] == ["embedding", "rerank"]
    tables = [t for t in r.stdout.split("\n\n") if t.startswith("| concurrency |")]
    assert len(tables) == 2
    for table, items in zip(tables, ("inputs/s", "documents/s"), strict=True):
        header, *rows = [[c.strip() for c in line.split("|")[1:-1]]
                            for line in table.splitlines() if line.startswith("| ")]
        col = {name: i for i, name in enumerate(header)}
        assert [row[col["server"]] for row in rows] == ["llmrun /v1", f"{host} /v1"]
        for row in rows:
            for name in (items, "prompt tokens/s", f"raw {items}", "raw tokens/s", "/ raw"):
                assert float(row[col[name]]) > 0, (name, row)
        assert float(rows[1][col["llmrun /v1 / this"]]) > 0
    # a model that is not a reranker: the run says why instead of stopping
    r = llmrun("bench", "smollm2", "--rerank", "--levels", "1", "--rounds", "1", "--docs", "1",
               "--no-baselines")
    assert r.returncode == 0, r.stderr
    assert "llmrun /v1 refused this work" in r.stdout and "not a reranker" in r.stdout


def _stream_of(api: str, pieces: list[str], count: int) -> bytes:
    """A streamed answer as /api/chat (NDJSON) or /v1/chat/completions (SSE) sends it."""
    if api == "chat":
        lines = [{"message": {"role": "assistant", "content": p}, "done": False} for p in pieces]
        lines.append({"message": {"role": "assistant", "content": ""}, "done": True,
                      "eval_count": count})
        return b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    events = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    events.append({"choices": [], "usage": {"completion_tokens": count}})
    return b"".join(f"data: {json.dumps(x)}\n\n".encode() for x in events) + \
        b"data: [DONE]\n\n"


async def _serve_once(response: bytes, seen: list[dict[str, object]],
                      pieces: int = 7) -> asyncio.Server:
    """A one-connection HTTP server on a free port: records the request, then writes
    `response` in `pieces` writes cut anywhere (inside a line, a chunk header, a header)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        seen.append({"path": head.split(b" ")[1].decode(),
                     **json.loads(await reader.readexactly(length))})
        step = max(1, len(response) // pieces)
        for i in range(0, len(response), step):
            writer.write(response[i:i + step])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _chunked(body: bytes, size: int = 13) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    for i in range(0, len(body), size):
        part = body[i:i + size]
        out += f"{len(part):x}\r\n".encode() + part + b"\r\n"
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("api", ["chat", "openai"])
@pytest.mark.parametrize("framing", ["chunked", "length"])
def test_bench_reads_both_apis_streams(api: str, framing: str) -> None:
    """bench's own HTTP client (httptools, lighter than httpx on the machine it measures):
    lines cut across reads and chunks, both transfer framings, the server's count."""
    from llmrun import bench

    body = _stream_of(api, ["Once", " upon", "", " a"], 5)
    response = _chunked(body) if framing == "chunked" else (
        f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    seen: list[dict[str, object]] = []

    async def one() -> dict[str, object]:
        server = await _serve_once(response, seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await bench.one_request(f"http://127.0.0.1:{port}", "m", "hi", 5, api=api)

    r = asyncio.run(one())
    assert r["text"] == "Once upon a" and r["tokens"] == 5.0  # the server's count wins
    assert r["first"] <= r["last"]
    body_seen = seen[0]
    if api == "openai":
        assert body_seen["path"] == "/v1/chat/completions" and body_seen["max_tokens"] == 5
        assert body_seen["ignore_eos"] is True and body_seen["temperature"] == 0
        assert body_seen["stream_options"] == {"include_usage": True}
    else:
        assert body_seen["path"] == "/api/chat" and body_seen["options"]["num_predict"] == 5


def test_bench_client_reports_errors() -> None:
    """An error status raises with the server's words; so do a refused connection and an
    answer cut off before its end."""
    from llmrun import bench

    async def against(response: bytes) -> str:
        server = await _serve_once(response, [])
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(RuntimeError) as info:
                await bench.one_request(f"http://127.0.0.1:{port}", "m", "hi", 5)
        return str(info.value)

    error = b'{"error": "model not found"}'
    assert "404" in asyncio.run(against(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)))
    assert "model not found" in asyncio.run(against(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)))
    assert "no answer" in asyncio.run(against(b""))
    cut = _chunked(_stream_of("chat", ["Once", " upon"], 2))[:-20]
    assert "ended before its end" in asyncio.run(against(cut))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="cannot connect"):
        asyncio.run(bench.one_request(f"http://127.0.0.1:{port}", "m", "hi", 5))


def test_bench_decode_window_and_servers() -> None:
    from llmrun import bench

    # two waves of two requests: decoding for 2 s in all, not 4
    assert bench.union_length([(0, 1), (0.5, 1), (2, 3), (2, 2.5)]) == 2.0
    assert bench.union_length([]) == 0.0
    # together from 0.5 s to 1.0 s: the first request's tokens before 0.5 s do not count
    a = {"first": 0.0, "last": 1.0, "tokens": 11.0, "stamps": [i / 10 for i in range(11)]}
    b = {"first": 0.5, "last": 1.2, "tokens": 8.0, "stamps": [0.5 + i / 10 for i in range(8)]}
    assert bench.decode_rate([a, b]) == pytest.approx((5 + 5) / 0.5)
    assert bench.decode_rate([a]) == pytest.approx(10 / 1.0)
    c = {"first": 2.0, "last": 3.0, "tokens": 11.0, "stamps": [2 + i / 10 for i in range(11)]}
    assert bench.decode_rate([a, c]) == pytest.approx(20 / 2.0)  # waves: the union
    servers = bench.against_servers(["http://127.0.0.1:8080/v1/,localhost:9000"], "m")
    assert [(s.label, s.url, s.api) for s in servers] == [
        ("127.0.0.1:8080 /v1", "http://127.0.0.1:8080", "openai"),
        ("localhost:9000 /v1", "http://localhost:9000", "openai")]
    with pytest.raises(ValueError, match="twice"):
        bench.against_servers(["http://a:1", "http://a:1/v1"], "m")
    # each turn's ratio to its own raw loop, then the median: a slow turn (the machine
    # drifting) moves neither the ratio nor the decode rate kept
    runs = [{"tok_s": t, "decode_tok_s": d, "decode_ratio": d / raw}
            for t, d, raw in ((90, 100, 105), (40, 50, 52), (95, 99, 110))]
    kept = bench.summary(runs)
    assert kept["tok_s"] == 90 and kept["decode_tok_s"] == 99
    assert kept["decode_ratio"] == pytest.approx(100 / 105)
    row = {"tok_s": 90.0, "decode_tok_s": 99.0, "ttft_p50": 0.1, "ttft_p95": 0.2,
           "itl_ms": 10.0, "decode_ratio": 0.97}
    table = bench.BenchResult("m", Path("m.gguf"), 96, 2, {1: row}, raw_decode={1: 102.0},
                              against={"ls /v1": {1: {**row, "llmrun_over": 1.03}}}).table()
    assert "| 1 | llmrun | 90.0 | 99.0 |" in table and "| 0.97 |" in table
    assert "llmrun decode tok/s / ls /v1's, the median of each turn's ratio" in table
    assert table.rstrip().endswith("1: 1.03")


def test_home_and_files_are_private(home_with_model: Path) -> None:
    """LLMRUN_HOME holds prompts (logs), keys (config.yaml) and models: owner only."""
    home_with_model.chmod(0o755)  # as an older version left it
    r = llmrun("run", "smollm2", "Hi", "--seed", "1", env={"LLMRUN_CONTEXT_LENGTH": "512"})
    assert r.returncode == 0, r.stderr
    assert home_with_model.stat().st_mode & 0o777 == 0o700
    written = [p for p in (home_with_model / "logs").rglob("*") if p.is_file()]
    assert written, "the daemon wrote no logs"
    for path in written:
        assert path.stat().st_mode & 0o077 == 0, f"{path} is readable by others"


def test_create_through_a_running_daemon_uploads_files_as_blobs(home_with_model: Path,
                                                                 smollm2_path: Path,
                                                                 tmp_path: Path) -> None:
    """With a daemon up, `create` sends local files as blobs (the daemon reads no client
    path: it may be on another machine) and the daemon makes the model."""
    assert llmrun("run", "smollm2", "Hi", "--seed", "1").returncode == 0  # starts the daemon
    local = tmp_path / "mine.gguf"
    local.write_bytes(smollm2_path.read_bytes())
    mf = tmp_path / "Modelfile"
    mf.write_text('FROM ./mine.gguf\nPARAMETER temperature 0.2\nSYSTEM """Be brief."""\n')
    r = llmrun("create", "viadaemon", "-f", str(mf))
    assert r.returncode == 0, r.stderr
    assert "uploading mine.gguf" in r.stdout + r.stderr
    log = (home_with_model / "logs" / "server.log").read_text()
    # the same bytes as the model already in the store: the HEAD finds the blob, no upload
    assert "HEAD /api/blobs/sha256" in log and "POST /api/create" in log, log[-600:]
    shown = llmrun("show", "viadaemon", "--json")
    assert "Be brief." in shown.stdout
    mf.write_text("FROM ./missing.gguf\n")
    missing = llmrun("create", "nope", "-f", str(mf))
    assert missing.returncode == 1 and "missing.gguf: no such file" in missing.stderr


def test_serve_starts_on_a_port_its_last_daemon_just_left() -> None:
    from llmrun.daemon.main import ServeError, check_port

    # a daemon that answered a request and stopped: its side of the connection closed
    # first, so the port has a connection in TIME_WAIT (for a minute) and no listener
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()
    listener.close()
    client.close()
    check_port("127.0.0.1", port)  # no error: a new daemon may listen there
    # while a daemon listens, the port is taken
    with socket.create_server(("127.0.0.1", port)), pytest.raises(ServeError,
                                                                 match="already in use"):
        check_port("127.0.0.1", port)
