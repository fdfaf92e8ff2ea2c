"""The daemon treats what its runners send as hostile input: a runner whose code is the
attacker's (tests/fakes/hostile/sitecustomize.py, on the PYTHONPATH the runners inherit)
answers a request with an attack on its channel instead. Each attack fails that request with
a clear error (no hang), the runner is stopped and a fresh one serves the next request, the
daemon stays up, and another model's greedy stream, running meanwhile, is exactly what it is
when nobody attacks."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, make_home
from tests.integration.test_service import tiny_home

HOSTILE = Path(__file__).resolve().parents[1] / "fakes" / "hostile"
VICTIM = {"model": "smollm2", "prompt": "Count from 1 to 100, one number per line.",
          "stream": True, "options": {"temperature": 0, "num_predict": 40, "seed": 1}}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("hostile-home"), smollm2_path)
    tiny_home(home, ["a"])
    path = os.pathsep.join(p for p in (str(HOSTILE), os.environ.get("PYTHONPATH")) if p)
    d = Daemon(home, {"PYTHONPATH": path, "LLMRUN_MAX_LOADED_MODELS": "3"}).start()
    yield d
    d.stop()


def victim_text(url: str, started: threading.Event | None = None) -> str:
    """The victim model's greedy answer, streamed (`started` is set at its first chunk)."""
    parts = []
    with httpx.stream("POST", f"{url}/api/generate", json=VICTIM, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            chunk = json.loads(line)
            assert "error" not in chunk, chunk
            parts.append(chunk.get("response", ""))
            if started is not None:
                started.set()
    return "".join(parts)


@pytest.fixture(scope="module")
def baseline(hostile: Daemon) -> str:
    text = victim_text(hostile.url)
    assert len(text) > 20
    return text


# The tool the tool-call attacks' requests offer (strict: the schema is the call's contract).
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file", "strict": True,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"], "additionalProperties": False}}}


def attack(url: str, name: str) -> httpx.Response:
    if name.startswith("embed"):
        return httpx.post(f"{url}/api/embed", timeout=60,
                          json={"model": "a", "input": [f"HOSTILE:{name}", "another"]})
    if name in ("invented_call", "bad_arguments"):
        return httpx.post(f"{url}/api/chat", timeout=60, json={
            "model": "a", "stream": False, "tools": [READ_FILE],
            "messages": [{"role": "user", "content": f"HOSTILE:{name}"}],
            "options": {"num_predict": 4}})
    return httpx.post(f"{url}/api/generate", timeout=60, json={
        "model": "a", "prompt": f"HOSTILE:{name}", "stream": False,
        "options": {"num_predict": 4}})


ATTACKS = {  # the attack, and what the error it ends in says
    "never_given": "never given",
    "big_text": "characters",  # megabytes of text in one event
    "big_thinking": "characters",
    "many_events": "events in one frame",
    "bad_utf8": "not UTF-8",
    "surrogate": "lone surrogate",  # a \ud800 escape
    "nan_usage": "malformed",
    "infinite_logprob": "malformed",
    "huge_count": "malformed",  # (orjson reads 10**30 as a float: no count)
    "not_json": "not JSON",
    "over_limit": "over the limit",
    "flood": "frames a second",  # millions of tiny frames
    "second_ready": "malformed",
    "pass_fd": "file descriptors",
    "embed_parts": "more embeddings",
    "invented_call": "a tool its request did not offer",  # the agent would run it
    "bad_arguments": "whose arguments its schema refuses",
    "embed_string": "not a number",  # a string inside a vector
    "embed_width": "numbers from one model",  # vectors of two widths
    "answer_flood": "more than any answer to its request could",
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_an_attack_fails_its_request_and_touches_nothing_else(hostile: Daemon, baseline: str,
                                                              name: str) -> None:
    # a fresh runner for `a` (the last attack's was stopped) serves an honest request
    assert httpx.post(f"{hostile.url}/api/generate", timeout=60, json={
        "model": "a", "prompt": "hello", "stream": False,
        "options": {"num_predict": 2}}).status_code == 200
    started = threading.Event()
    result: list[str | BaseException] = []

    def run_victim() -> None:
        try:
            result.append(victim_text(hostile.url, started))
        except BaseException as exc:  # reported below
            result.append(exc)

    victim = threading.Thread(target=run_victim)
    victim.start()
    try:
        assert started.wait(60), "the victim's stream did not start"
        r = attack(hostile.url, name)
    finally:
        victim.join(120)
    assert r.status_code == 500, r.text
    assert ATTACKS[name] in r.json()["error"], r.json()
    assert "stopped" in r.json()["error"]
    assert result == [baseline]
    assert httpx.get(f"{hostile.url}/health", timeout=10).status_code == 200


def test_no_descriptor_a_runner_passes_reaches_the_daemon(hostile: Daemon) -> None:
    r = attack(hostile.url, "pass_fd")
    assert "file descriptors" in r.json()["error"]
    logs = "".join(p.read_text(errors="replace") for p in hostile.home.rglob("*.log"))
    inodes = re.findall(r"HOSTILE pipe inode (\d+)", logs)
    assert inodes
    assert hostile.proc is not None
    fds = Path(f"/proc/{hostile.proc.pid}/fd")
    held = set()
    for fd in fds.iterdir():
        try:
            held.add(os.readlink(fd))
        except OSError:
            continue  # closed meanwhile
    assert not held & {f"pipe:[{i}]" for i in inodes}


def test_a_ready_that_claims_what_was_not_asked_is_a_load_error(hostile: Daemon) -> None:
    r = httpx.post(f"{hostile.url}/api/generate", timeout=60, json={
        "model": "a", "prompt": "hi", "stream": False,
        "options": {"num_predict": 2, "num_ctx": 200}})  # (sitecustomize's LIAR_CTX)
    assert r.status_code == 500, r.text
    assert "ready message claims 9 slots, but 2 were asked for" in r.json()["error"]
    assert httpx.get(f"{hostile.url}/health", timeout=10).status_code == 200
