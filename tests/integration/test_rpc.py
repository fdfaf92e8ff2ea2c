"""One model over several hosts through llama.cpp's RPC backend, on loopback: two
`llmrun rpc-worker` processes and a daemon configured with both. The split model's greedy
answer is the local one token for token; losing a worker mid-stream ends that stream with an
error and the daemon stays up; the model loads again once the worker is back."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon, make_home, wait_until

ASK = {"model": "smollm2", "prompt": "Write a short poem about the sea.", "stream": False,
       "options": {"temperature": 0, "num_predict": 48}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Worker:
    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Worker:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmrun", "rpc-worker", "--port", str(self.port),
                 "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)

        def listening() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_until(listening, what="the RPC worker to listen")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory,
          smollm2_path: Path) -> Iterator[tuple[Daemon, list[Worker]]]:
    root = tmp_path_factory.mktemp("rpc")
    workers = [Worker(root / f"worker{i}.log").start() for i in range(2)]
    home = make_home(root / "home", smollm2_path)
    d = Daemon(home, env={"LLMRUN_RPC_WORKERS": ",".join(w.endpoint for w in workers)}).start()
    yield d, workers
    d.stop()
    for w in workers:
        w.stop()


def test_a_worker_refuses_a_public_address_without_insecure() -> None:
    done = subprocess.run([sys.executable, "-m", "llmrun", "rpc-worker", "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--insecure" in done.stderr


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    """A daemon of its own, as fresh as the split one. Not the suite's shared daemon: a slot
    there may hold this prompt's system prompt as an earlier, longer prompt read it, through
    flash attention's tiled path (64 rows or more), whose last bits differ from the row-by-row
    path a short prompt read whole takes; reused, it can change the greedy answer (seen once
    in CI, and reproduced by sending a 64+ token prompt with the same system prompt first)."""
    d = Daemon(make_home(tmp_path_factory.mktemp("rpc-local") / "home", smollm2_path)).start()
    yield d
    d.stop()


def test_split_model_answers_as_the_local_one(local: Daemon,
                                              split: tuple[Daemon, list[Worker]]) -> None:
    remote, workers = split
    local_answer = httpx.post(local.url + "/api/generate", json=ASK, timeout=300).json()
    spread = httpx.post(remote.url + "/api/generate", json=ASK, timeout=300).json()
    assert spread["response"] == local_answer["response"]
    assert spread["context"] == local_answer["context"]  # prompt and output, token for token
    ps = httpx.get(remote.url + "/api/ps").json()["models"]
    placement = ps[0]["rpc"]
    assert [w["endpoint"] for w in placement["workers"]] == [w.endpoint for w in workers]
    assert placement["local_layers"] == 0 and placement["layers"] > 2
    shown = subprocess.run([sys.executable, "-m", "llmrun", "ps"], env=remote.env,
                           capture_output=True, text=True, timeout=60)
    assert workers[0].endpoint in shown.stdout


def test_losing_a_worker_ends_the_stream_and_the_model_comes_back(
        split: tuple[Daemon, list[Worker]]) -> None:
    remote, workers = split
    events: list[dict[str, object]] = []
    with httpx.stream("POST", remote.url + "/v1/completions", timeout=300, json={
            "model": "smollm2", "prompt": "Once upon a time", "stream": True,
            "max_tokens": 4000, "ignore_eos": True}) as r:  # runs until the worker is gone
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 3:
                workers[1].stop()
    assert "error" in events[-1] and len(events) < 4000, events[-1]
    assert httpx.get(remote.url + "/api/version").status_code == 200  # the daemon stays up
    failed = httpx.post(remote.url + "/api/generate", json=ASK, timeout=300)
    assert failed.status_code >= 500 and workers[1].endpoint in failed.text
    workers[1].start()  # the same port again
    again = httpx.post(remote.url + "/api/generate", json=ASK, timeout=300)
    assert again.status_code == 200 and again.json()["response"]
