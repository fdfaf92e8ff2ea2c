"""The context a model is loaded with where nothing names one, through the real daemon: by
memory, capped at the model's trained context (SmolLM2: 8192); and a client's
X-Llmrun-Num-Ctx (what `llmrun launch` has each agent send), refused in the path's dialect
when it is no context."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, make_home


def loaded(api: httpx.Client) -> list[tuple[str, int]]:
    return [(m["name"], m["context_length"]) for m in api.get("/api/ps").json()["models"]]


@pytest.fixture(scope="module")
def auto_daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
                ) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("context-home"), smollm2_path)
    d = Daemon(home, env={"LLMRUN_CONTEXT_LENGTH": "0"}).start()
    yield d
    d.stop()


def test_nothing_named_loads_by_memory_capped_at_the_trained_context(
        auto_daemon: Daemon) -> None:
    with httpx.Client(base_url=auto_daemon.url, timeout=120) as api:
        r = api.post("/api/chat", json={"model": "smollm2", "messages": []})
        assert r.status_code == 200, r.text
        # this machine's free memory holds far more than 8192 tokens of SmolLM2's KV cache
        # (about 180 KiB a token for both slots): the trained context caps it
        assert loaded(api) == [("smollm2:latest", 8192)]


def test_the_clients_context_header(api: httpx.Client) -> None:
    body = {"model": "smollm2", "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}]}
    r = api.post("/v1/chat/completions", json=body, headers={"X-Llmrun-Num-Ctx": "4096"})
    assert r.status_code == 200, r.text
    assert ("smollm2:latest", 4096) in loaded(api)
    # a request's own num_ctx wins over the header
    r = api.post("/api/chat", json={"model": "smollm2", "messages": [],
                                    "options": {"num_ctx": 1024}},
                 headers={"X-Llmrun-Num-Ctx": "4096"})
    assert r.status_code == 200, r.text
    assert ("smollm2:latest", 1024) in loaded(api)
    for bad in ("0", "-1", "4k", "１０２４".encode(), "99999999999", ""):
        r = api.post("/v1/messages", json=body, headers={"X-Llmrun-Num-Ctx": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["type"] == "error" and "X-Llmrun-Num-Ctx" in \
            r.json()["error"]["message"]
        r = api.post("/v1/chat/completions", json=body, headers={"X-Llmrun-Num-Ctx": bad})
        assert r.status_code == 400 and "X-Llmrun-Num-Ctx" in r.json()["error"]["message"]
    # the shared daemon's later tests expect SmolLM2 at its default context: unload it
    r = api.post("/api/generate", json={"model": "smollm2", "keep_alive": 0})
    assert r.status_code == 200, r.text
