"""The daemon as a long-running service: keep-alive, eviction, queue bounds, disconnects,
shutdown, pid files. Real daemon subprocesses; tiny random-weight models where the model's
output does not matter (they load in milliseconds)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from llmrun.store import Store
from tests.conftest import Daemon, make_home, wait_until
from tests.fakes.tinymodel import write_tiny_llama


def tiny_home(root: Path, names: list[str]) -> Path:
    store = Store(root)
    for i, name in enumerate(names):
        path = write_tiny_llama(root / f"{name}.gguf", seed=i)
        store.create(name, f"FROM {path}\n")
    return root


def loaded(url: str) -> list[str]:
    return [m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]]


def busy(url: str) -> int:
    """Requests the only loaded model is serving or has queued."""
    return httpx.get(f"{url}/api/ps").json()["models"][0]["slots_busy"]


def gen(url: str, model: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/api/generate", timeout=120,
                      json={"model": model, "prompt": "hello", "stream": False,
                            "options": {"num_predict": 2}, **body})


def test_keep_alive_expiry_unloads(tmp_path: Path) -> None:
    d = Daemon(tiny_home(tmp_path, ["a"])).start()
    try:
        assert gen(d.url, "a", keep_alive="1s").status_code == 200
        assert loaded(d.url) == ["a:latest"]
        wait_until(lambda: loaded(d.url) == [], what="unloaded once its 1 s keep-alive ended")
        # negative keep_alive: loaded for good (that it then stays loaded is the scheduler's,
        # tested with its clock in tests/unit/server/test_scheduler.py; here, that -1 reaches it)
        assert gen(d.url, "a", keep_alive=-1).status_code == 200
        (model,) = httpx.get(f"{d.url}/api/ps").json()["models"]
        assert model["expires_at"] == "2318-01-01T00:00:00Z"
    finally:
        d.stop()


def test_lru_model_evicted_at_the_limit(tmp_path: Path) -> None:
    d = Daemon(tiny_home(tmp_path, ["a", "b", "c"]),
               env={"LLMRUN_MAX_LOADED_MODELS": "2"}).start()
    try:
        for name in ("a", "b"):
            assert gen(d.url, name).status_code == 200
        assert sorted(loaded(d.url)) == ["a:latest", "b:latest"]
        assert gen(d.url, "a").status_code == 200  # a is now the most recently used
        assert gen(d.url, "c").status_code == 200
        assert sorted(loaded(d.url)) == ["a:latest", "c:latest"]  # b was least recent
    finally:
        d.stop()


def test_num_ctx_change_reloads(tmp_path: Path) -> None:
    d = Daemon(tiny_home(tmp_path, ["a"])).start()
    try:
        gen(d.url, "a", options={"num_predict": 1, "num_ctx": 128})
        assert httpx.get(f"{d.url}/api/ps").json()["models"][0]["context_length"] == 128
        gen(d.url, "a", options={"num_predict": 1, "num_ctx": 256})
        assert httpx.get(f"{d.url}/api/ps").json()["models"][0]["context_length"] == 256
    finally:
        d.stop()


def test_kv_cache_types_answer_and_shrink_the_estimate(tmp_path: Path,
                                                      smollm2_path: Path) -> None:
    """LLMRUN_KV_CACHE_TYPE, the Modelfile's and the request's kv_cache_type. A
    q8_0 and a q4_0 cache still answer the question; /api/ps shows each runner's type and a
    memory estimate that shrinks with it; flash attention off falls back to f16 (llama.cpp
    cannot quantize the V cache without it)."""
    home = make_home(tmp_path / "home", smollm2_path)
    Store(home).create("smol-q4", f"FROM {smollm2_path}\nPARAMETER kv_cache_type q4_0\n")
    d = Daemon(home, env={"LLMRUN_KV_CACHE_TYPE": "q8_0", "LLMRUN_MAX_LOADED_MODELS": "1"})
    d.start()
    try:
        seen: dict[str, tuple[int, str]] = {}
        for label, model, options in (
                ("q8_0", "smollm2", {}),  # the environment's
                ("f16", "smollm2", {"kv_cache_type": "f16"}),  # the request's
                ("q4_0", "smol-q4", {}),  # the Modelfile's
                ("off", "smollm2", {"flash_attention": "off"})):
            r = httpx.post(f"{d.url}/api/chat", timeout=300, json={
                "model": model, "stream": False, "messages": [
                    {"role": "user", "content": "What is the capital of France?"}],
                "options": {"temperature": 0, "num_predict": 24, **options}})
            assert r.status_code == 200, r.text
            (m,) = httpx.get(f"{d.url}/api/ps").json()["models"]
            seen[label] = (m["size"], m["kv_cache_type"], m["flash_attention"])
            assert "Paris" in r.json()["message"]["content"], (label, r.json())
        assert seen["q8_0"][1:] == ("q8_0", "auto") and seen["q4_0"][1] == "q4_0"
        assert seen["f16"][1] == "f16" and seen["off"][1:] == ("f16", "off")
        assert seen["q4_0"][0] < seen["q8_0"][0] < seen["f16"][0] == seen["off"][0]
        # the estimate counts the KV cache's bytes: 2048 tokens x 2 slots x 30 layers x
        # 2 x 3 heads x 64, at 2 bytes (f16) and 34/32 (q8_0)
        kv_f16 = 2048 * 2 * 30 * 2 * 3 * 64 * 2
        assert seen["f16"][0] - seen["q8_0"][0] == pytest.approx(kv_f16 * (1 - 34 / 64), rel=0.01)
        log = (home / "logs").glob("*.log")
        assert any("KV q4_0" in p.read_text() for p in log)
    finally:
        d.stop()


def test_queue_overflow_is_503_at_once(tmp_path: Path, smollm2_path: Path) -> None:
    """With one slot and a queue of one, a third request is refused while the first decodes
    and the second waits. The first runs until the test hangs up, so the 503 came while both
    were still running, however slow the machine."""
    d = Daemon(make_home(tmp_path, smollm2_path),
               env={"LLMRUN_NUM_PARALLEL": "1", "LLMRUN_MAX_QUEUE": "1"}).start()
    try:
        gen(d.url, "smollm2")  # loaded
        # no end of turn before the context's end (2048 tokens): it runs until the test
        # hangs up
        endless = {"model": "smollm2", "prompt": "Write a long story about a dragon.",
                   "format": {"type": "string", "minLength": 8000},
                   "options": {"num_predict": 100000}}
        with ThreadPoolExecutor(1) as pool:
            with httpx.stream("POST", f"{d.url}/api/generate", json=endless,
                              timeout=120) as decoding:
                lines = decoding.iter_lines()  # (kept: an iterator collected closes the stream)
                assert json.loads(next(lines))["done"] is False
                queued = pool.submit(gen, d.url, "smollm2", options={"num_predict": 4})
                wait_until(lambda: busy(d.url) == 2, what="one request decoding, one queued")
                r = gen(d.url, "smollm2")
                assert r.status_code == 503
                assert r.headers["retry-after"] == "1"
                assert "server busy" in r.json()["error"]
                # refused at once, not after waiting: both are still there
                assert busy(d.url) == 2 and not queued.done()
            # hung up: the first is cancelled, and the one that waited is served
            r = queued.result()
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True and r.json()["eval_count"] == 4
    finally:
        d.stop()


def test_client_disconnect_frees_the_slot(tmp_path: Path, smollm2_path: Path) -> None:
    d = Daemon(make_home(tmp_path, smollm2_path), env={"LLMRUN_NUM_PARALLEL": "1"}).start()
    try:
        endless = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story"}],
                   "options": {"num_predict": 100000}}
        with httpx.stream("POST", f"{d.url}/api/chat", json=endless, timeout=60) as r:
            next(r.iter_lines())  # generating; now hang up
        # non-streaming too: the client gives up after a second
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{d.url}/api/chat", json={**endless, "stream": False}, timeout=1.0)
        # with one slot, this only finishes if both abandoned sequences were cancelled
        t0 = time.monotonic()
        r = gen(d.url, "smollm2", options={"num_predict": 4})
        assert r.status_code == 200 and r.json()["eval_count"] == 4
        assert time.monotonic() - t0 < 30  # an abandoned sequence would run to num_ctx
        models = httpx.get(f"{d.url}/api/ps").json()["models"]
        assert models[0]["slots_busy"] == 0
    finally:
        d.stop()


def test_sigterm_during_stream_ends_cleanly(tmp_path: Path, smollm2_path: Path) -> None:
    d = Daemon(make_home(tmp_path, smollm2_path)).start()
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story"}],
            "options": {"num_predict": 100000}}
    lines = []
    with httpx.stream("POST", f"{d.url}/api/chat", json=body, timeout=60) as r:
        it = r.iter_lines()
        lines.append(next(it))
        runners = subprocess.run(["pgrep", "-P", str(d.proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert runners
        d.proc.send_signal(signal.SIGTERM)
        # the server may close the stream when its grace period ends
        with contextlib.suppress(httpx.HTTPError):
            for line in it:
                lines.append(line)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status says SIGTERM
    assert d.proc.wait(60) in (0, -signal.SIGTERM)  # (bounds a hang: the grace is 10 s)
    assert "Application shutdown complete" in d.log.read_text()
    for line in lines:
        json.loads(line)  # every line that arrived is whole
    for pid in runners:  # no orphaned runner processes
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_stale_pid_file_is_replaced(tmp_path: Path) -> None:
    home = tiny_home(tmp_path, ["a"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (home / "daemon.pid").write_text(f"{dead.pid}\n")
    d = Daemon(home).start()
    try:
        assert (home / "daemon.pid").read_text().strip() == str(d.proc.pid)
        # a second daemon on the same home (another port) is refused while this one lives
        other = Daemon(home)
        proc = subprocess.run([sys.executable, "-m", "llmrun", "serve"], env=other.env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert f"pid {d.proc.pid}" in proc.stderr
    finally:
        d.stop()
    assert not (home / "daemon.pid").exists()  # removed on a clean exit
    assert os.path.exists(home)


def test_settings_from_config_yaml(tmp_path: Path) -> None:
    home = tiny_home(tmp_path, ["a"])
    (home / "config.yaml").write_text("LLMRUN_CONTEXT_LENGTH: 192\nllmrun_keep_alive: 7m\n")
    d = Daemon(home, env={"LLMRUN_CONTEXT_LENGTH": ""}).start()
    try:
        gen(d.url, "a")
        models = httpx.get(f"{d.url}/api/ps").json()["models"]
        assert models[0]["context_length"] == 192  # from config.yaml
    finally:
        d.stop()
    help_text = subprocess.run([sys.executable, "-m", "llmrun", "serve", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    for name in ("LLMRUN_HOST", "LLMRUN_KEEP_ALIVE", "LLMRUN_NUM_PARALLEL", "LLMRUN_MAX_QUEUE",
                 "LLMRUN_API_KEYS", "LLMRUN_ORIGINS", "LLMRUN_CONTEXT_LENGTH"):
        assert name in help_text


def test_fill_in_the_middle_and_context(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.create("fim", f"FROM {write_tiny_llama(tmp_path / 'fim.gguf', fim=True)}\n")
    store.create("plain", f"FROM {write_tiny_llama(tmp_path / 'plain.gguf')}\n")
    d = Daemon(tmp_path).start()
    try:
        # suffix: <s> <fim_prefix> prefix <fim_suffix> suffix <fim_middle>, then the middle
        r = gen(d.url, "fim", prompt="hello", suffix="the end")
        assert r.status_code == 200, r.text
        body = r.json()
        n, ctx = body["prompt_eval_count"], body["context"]
        assert ctx[:2] == [1, 3] and ctx[n - 1] == 5 and ctx[2:n - 1].count(4) == 1
        assert len(ctx) == n + body["eval_count"]
        r = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
            "model": "fim", "prompt": "hello", "suffix": "the end", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n
        r = gen(d.url, "plain", suffix="the end")
        assert r.status_code == 400 and "does not support insert" in r.json()["error"]

        # context: an earlier exchange's tokens come before the new prompt
        first = gen(d.url, "plain").json()
        second = gen(d.url, "plain", context=first["context"]).json()
        # (the tiny model adds BOS; the one inside the context stays, the new one goes)
        assert second["prompt_eval_count"] == len(first["context"]) + \
            first["prompt_eval_count"] - 1
        assert second["context"][:len(first["context"])] == first["context"]
        r = gen(d.url, "plain", context=[10**6])
        assert r.status_code == 400 and "vocabulary" in r.json()["error"]
        assert "context" not in gen(d.url, "plain", raw=True).json()
    finally:
        d.stop()


def test_load_options_are_capped(tmp_path: Path) -> None:
    """Per-request load options past what can help are capped, not honoured one reload each."""
    from llmrun.request import Options
    from llmrun.server.scheduler import Scheduler

    store = Store(tiny_home(tmp_path, ["a"]))
    _, manifest = store.get("a")
    spec = Scheduler(store, tmp_path).spec_for(
        manifest, Options(num_ctx=10**7, num_batch=10**6, num_thread=10**4))
    assert spec.n_ctx == manifest.details.context_length  # the trained context
    assert spec.n_batch == 4096
    assert spec.n_threads == len(os.sched_getaffinity(0))  # the cores it may run on
    assert not spec.adaptive_threads  # a count the request chose is kept


def test_other_load_options_wait_for_the_busy_runner(daemon: Daemon) -> None:
    """A request with another num_ctx, sent while a stream runs, waits until the runner is
    idle and then reloads it: the stream completes, and no second runner starts beside it."""
    assert gen(daemon.url, "smollm2").status_code == 200  # loaded, default context
    count = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to 500."}],
             "options": {"num_predict": 100, "temperature": 0}}
    finished: list[str] = []

    def other() -> httpx.Response:
        r = gen(daemon.url, "smollm2", options={"num_predict": 2, "num_ctx": 1024})
        finished.append("other")
        return r

    with httpx.stream("POST", f"{daemon.url}/api/chat", json=count, timeout=120) as stream, \
            ThreadPoolExecutor(1) as pool:
        lines = stream.iter_lines()
        first = json.loads(next(lines))  # the runner is busy with this stream
        waiting = pool.submit(other)
        rest = [json.loads(line) for line in lines]
        finished.append("stream")
        r = waiting.result()
    assert all("error" not in x for x in [first, *rest]) and rest[-1]["done"] is True
    assert r.status_code == 200, r.text
    assert finished == ["stream", "other"]
    (model,) = httpx.get(f"{daemon.url}/api/ps").json()["models"]
    assert model["context_length"] == 1024
    assert gen(daemon.url, "smollm2").status_code == 200  # back to the default context


# A test-only sitecustomize, on the daemon's PYTHONPATH (childenv passes PYTHON* variables to
# runners): a runner started for the gated model file waits, before it loads anything, until
# the test creates the gate file. Nothing in llmrun knows of it.
# (the runner learns its model from its first message, Load: the gate wraps the parser of it)
GATE = '''\
import os, time
from llmrun import protocol
parse = protocol.parse_command
def gated(msg):
    command = parse(msg)
    if isinstance(command, protocol.Load) and any(p.endswith({blob!r}) for p in command.model):
        open({entered!r}, "w").close()
        while not os.path.exists({gate!r}):
            time.sleep(0.01)
    return command
protocol.parse_command = gated
'''


def test_a_loaded_model_answers_while_another_loads(tmp_path: Path, smollm2_path: Path) -> None:
    """A request for a loaded model is answered while a second model's runner is still
    loading: the second load is held by a gate the test opens, not by timing."""
    home = make_home(tmp_path / "home", smollm2_path)
    store = Store(home)
    slow = store.create("slow", f"FROM {write_tiny_llama(tmp_path / 'slow.gguf')}\n")
    gates = tmp_path / "gates"
    gates.mkdir()
    entered, gate = gates / "entered", gates / "open"
    (gates / "sitecustomize.py").write_text(GATE.format(
        blob=store.model_paths(slow)[0].name, entered=str(entered), gate=str(gate)))
    path = os.pathsep.join(filter(None, [str(gates), os.environ.get("PYTHONPATH")]))
    d = Daemon(home, env={"PYTHONPATH": path}).start()
    try:
        assert gen(d.url, "smollm2").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(gen, d.url, "slow")
            wait_until(lambda: entered.exists() or loading.done(),
                       what="the slow runner waiting at the gate")
            assert not loading.done()
            r = httpx.post(f"{d.url}/api/generate", timeout=60, json={
                "model": "smollm2", "prompt": "hello", "stream": False,
                "options": {"num_predict": 2}})
            assert r.status_code == 200 and r.json()["done"] is True
            assert r.json()["load_duration"] == 0
            assert loaded(d.url) == ["smollm2:latest"]  # a model still loading is not shown
            assert not loading.done()
            gate.touch()
            assert loading.result().status_code == 200
        models = httpx.get(f"{d.url}/api/ps").json()["models"]
        assert sorted(m["name"] for m in models) == ["slow:latest", "smollm2:latest"]
        assert all(m["reload_pending"] is False and m["slots_busy"] == 0 for m in models)
    finally:
        gate.touch()  # never leave a runner waiting
        d.stop()
