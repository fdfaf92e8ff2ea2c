"""Ollama's store endpoints through the official `ollama` client against the real daemon."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest

from llmrun.store import HOST_PATH_REFUSED, Store
from llmrun.store.store import REMOTE_REFUSED
from tests.conftest import Daemon, make_home, wait_until
from tests.fakes.vision import write_projector
from tests.integration.test_service import tiny_home

MiB = 1 << 20
DAY = 24 * 3600


@pytest.fixture(scope="module")
def store_daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path):
    d = Daemon(make_home(tmp_path_factory.mktemp("store-home"), smollm2_path)).start()
    yield d
    d.stop()


@pytest.fixture
def client(store_daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=store_daemon.url)


def test_show(client: ollama.Client) -> None:
    info = client.show("smollm2")
    assert info.details.family == "llama"
    assert info.details.quantization_level == "Q4_1"
    assert info.modelinfo["general.architecture"] == "llama"
    assert info.modelinfo["llama.context_length"] == 8192
    assert info.modelinfo["general.parameter_count"] > 100_000_000
    assert info.modelfile.startswith("FROM ")
    with pytest.raises(ollama.ResponseError) as err:
        client.show("missing")
    assert err.value.status_code == 404


def test_delete_unloads_the_runner_loaded_under_that_name(client: ollama.Client) -> None:
    """A copy shares SmolLM2's weights, so one runner serves both names under the name that
    loaded it. Deleting that name unloads it (as `ollama rm` stops a running model): `ps`
    never lists a name the store lost, and SmolLM2's next request loads under its own."""
    def ps() -> list[str]:
        return [m.model for m in client.ps().models]

    client.copy("smollm2", "smol-alias")
    try:
        client.chat(model="smol-alias", messages=[{"role": "user", "content": "Hi"}],
                    options={"num_predict": 1})
        assert ps() == ["smol-alias:latest"]
        client.chat(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                    options={"num_predict": 1})
        assert ps() == ["smol-alias:latest"]  # the same runner: the same weights
    finally:
        client.delete("smol-alias")
    assert ps() == []
    client.chat(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                options={"num_predict": 1})
    assert ps() == ["smollm2:latest"]
    # deleting another name of the same weights leaves the runner loaded under its own
    client.copy("smollm2", "smol-alias2")
    client.delete("smol-alias2")
    assert ps() == ["smollm2:latest"]
    client.generate(model="smollm2", keep_alive=0)


def test_copy_then_delete(client: ollama.Client, store_daemon: Daemon) -> None:
    client.copy("smollm2", "smol-copy")
    names = {m.model for m in client.list().models}
    assert {"smollm2:latest", "smol-copy:latest"} <= names
    client.delete("smol-copy")
    assert "smol-copy:latest" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as err:
        client.delete("smol-copy")
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.copy("missing", "x")
    assert err.value.status_code == 404


def test_create_from_model_with_parameters(client: ollama.Client) -> None:
    resp = client.create(model="terse", from_="smollm2", system="Answer in one word.",
                         parameters={"temperature": 0.1, "stop": ["\n"]})
    assert resp.status == "success"
    info = client.show("terse")
    assert "Answer in one word." in info.modelfile
    assert "temperature" in info.parameters
    out = client.chat(model="terse", messages=[{"role": "user", "content": "Hi"}],
                      options={"num_predict": 16})
    assert "\n" not in out.message.content  # the stop parameter from create applies
    client.delete("terse")


# Ollama's own ChatML template (Go text/template), as a Modelfile copied from Ollama carries it
CHATML_GO = """{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
<|im_start|>{{ .Role }}
{{ .Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_end|>
<|im_start|>assistant
{{ end }}
{{- end }}"""


def test_create_with_an_ollama_go_template(client: ollama.Client) -> None:
    client.create(model="smol-go", from_="smollm2", template=CHATML_GO)
    assert client.show("smol-go").template == CHATML_GO
    greedy = {"temperature": 0, "seed": 1, "num_predict": 8}
    chat = client.chat(model="smol-go", options=greedy, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    raw = client.generate(model="smol-go", raw=True, options=greedy, prompt=(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n"
        "<|im_start|>assistant\n"))
    assert chat.prompt_eval_count == raw.prompt_eval_count
    assert chat.message.content == raw.response
    client.delete("smol-go")
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="bad-go", from_="smollm2", template="{{ if .System }}unclosed")
    assert err.value.status_code == 400 and "TEMPLATE" in str(err.value)


def test_create_from_uploaded_blob(client: ollama.Client, store_daemon: Daemon,
                                   smollm2_path: Path) -> None:
    digest = client.create_blob(smollm2_path)
    assert digest.startswith("sha256:")
    assert httpx.head(f"{store_daemon.url}/api/blobs/{digest}").status_code == 200
    resp = client.create(model="from-blob", files={"model.gguf": digest})
    assert resp.status == "success"
    assert "from-blob:latest" in {m.model for m in client.list().models}
    client.delete("from-blob")


def test_create_a_vision_model_from_uploaded_files(client: ollama.Client, store_daemon: Daemon,
                                                  smollm2_path: Path, tmp_path: Path) -> None:
    """`files` may hold a model and its projector, told apart by their GGUF
    headers, whatever their names or order; show then lists `vision`."""
    model = client.create_blob(smollm2_path)
    projector = client.create_blob(write_projector(tmp_path / "model.gguf"))
    for name, files in (("seeing", {"model.gguf": model, "mmproj.gguf": projector}),
                        ("seeing-too", {"mmproj.gguf": model, "model.gguf": projector})):
        assert client.create(model=name, files=files).status == "success"
        info = client.show(name)
        assert info.capabilities == ["completion", "tools", "vision"]
        assert [line.split()[0] for line in (info.modelfile or "").splitlines()[:2]] == \
            ["FROM", "FROM"]
        shown = httpx.post(f"{store_daemon.url}/api/show", json={"model": name}).json()
        assert shown["projector_info"]["general.architecture"] == "clip"
        assert shown["model_info"]["general.architecture"] == "llama"
        assert shown["details"]["families"] == ["llama", "clip"]  # as Ollama lists one
    assert "vision" not in (client.show("smollm2").capabilities or [])
    for files, message in (
            ({"a.gguf": model, "b.gguf": model}, "are both models"),
            ({"a.gguf": projector, "b.gguf": projector}, "are both vision projectors"),
            ({"mmproj.gguf": projector}, "is a vision projector (architecture 'clip'), not a "
                                         "model"),
            ({"a.gguf": model, "b.gguf": projector, "c.gguf": projector},
             "'files' must name one .gguf blob")):
        with pytest.raises(ollama.ResponseError) as err:
            client.create(model="bad-vision", files=files)
        assert err.value.status_code == 400 and message in str(err.value), files
    blob = store_daemon.home / "blobs" / projector.replace(":", "-")
    client.delete("seeing")
    assert blob.is_file()  # still seeing-too's
    client.delete("seeing-too")
    assert not blob.exists()
    assert (store_daemon.home / "blobs" / model.replace(":", "-")).is_file()  # smollm2's


def test_cli_create_uploads_both_froms(store_daemon: Daemon, client: ollama.Client,
                                       smollm2_path: Path, tmp_path: Path) -> None:
    """`llmrun create` with a daemon up sends the model and the projector as blobs."""
    write_projector(tmp_path / "mmproj.gguf", seed=3)
    (tmp_path / "Modelfile").write_text(f"FROM ./mmproj.gguf\nFROM {smollm2_path}\n")
    r = subprocess.run([sys.executable, "-m", "llmrun", "create", "cli-seeing", "-f",
                        str(tmp_path / "Modelfile")], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL,
                       env={**os.environ, "LLMRUN_HOST": f"127.0.0.1:{store_daemon.port}"})
    assert r.returncode == 0, r.stderr
    assert "uploading mmproj.gguf" in r.stdout + r.stderr
    assert "vision" in (client.show("cli-seeing").capabilities or [])
    client.delete("cli-seeing")


def test_blob_upload_with_wrong_digest_is_refused(store_daemon: Daemon) -> None:
    body = b"not what the digest says"
    wrong = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    r = httpx.post(f"{store_daemon.url}/api/blobs/{wrong}", content=body)
    assert r.status_code == 400
    assert "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{store_daemon.url}/api/blobs/{wrong}").status_code == 404
    blobs = store_daemon.home / "blobs"
    assert not [p for p in blobs.iterdir() if p.name.startswith(".incoming")]
    r = httpx.head(f"{store_daemon.url}/api/blobs/sha256:..%2F..%2Fetc%2Fpasswd")
    assert r.status_code in (400, 404)


def test_create_errors(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="bad", from_="smollm2", parameters={"nonsense": 1})
    assert err.value.status_code == 400 and "nonsense" in str(err.value)
    with pytest.raises(ollama.ResponseError) as err:
        client.create(model="bad", files={"model.gguf": "sha256:" + "0" * 64})
    assert "no such blob" in str(err.value)


# -- create over HTTP names blobs and models, never the server's files ---------------------

def test_create_from_a_host_path_is_refused_alike_whether_it_exists_or_not(
        store_daemon: Daemon) -> None:
    blobs = store_daemon.home / "blobs"
    own_model = str(next(blobs.glob("sha256-*")))  # a GGUF the daemon can read
    before = sorted(p.name for p in blobs.iterdir())
    url = "http://127.0.0.1:9/v1"
    for path in ["/etc/shadow", "/nope.gguf", own_model, "../x.gguf", "~/x.gguf",
                 "./x.gguf", url]:
        for body in ({"from": path}, {"files": {"model.gguf": path}},
                     {"files": {"model.gguf": path, "mmproj.gguf": path}},
                     {"from": "smollm2", "adapters": {"lora.gguf": path}},
                     {"modelfile": f"FROM {path}\n"},
                     {"modelfile": f"FROM smollm2\nADAPTER {path}\n"}):
            if body in ({"modelfile": f"FROM {url}\n"}, {"from": url}):
                continue  # a remote model: below
            for stream in (False, True):
                r = httpx.post(f"{store_daemon.url}/api/create",
                               json={"model": "stolen", "stream": stream, **body})
                assert (r.status_code, r.json()) == (400, {"error": HOST_PATH_REFUSED}), body
    assert sorted(p.name for p in blobs.iterdir()) == before  # nothing was imported
    names = {m["name"] for m in httpx.get(f"{store_daemon.url}/api/tags").json()["models"]}
    assert "stolen:latest" not in names
    # a server's URL would make a remote model, which over HTTP only a daemon whose owner
    # set LLMRUN_REMOTE_CREATE=1 creates, loopback caller or not
    # (tests/integration/test_remote_keys.py)
    for body in ({"modelfile": f"FROM {url}\n"}, {"from": url}):
        r = httpx.post(f"{store_daemon.url}/api/create",
                       json={"model": "remote-one", "stream": False, **body})
        assert (r.status_code, r.json()) == (400, {"error": REMOTE_REFUSED}), body
    assert sorted(p.name for p in blobs.iterdir()) == before


def test_create_from_a_name_never_reads_a_file_of_that_name(store_daemon: Daemon) -> None:
    # the daemon runs in the repository root, where README.md exists: a name, not a file
    r = httpx.post(f"{store_daemon.url}/api/create",
                   json={"model": "x", "from": "README.md", "stream": False})
    assert r.status_code == 400
    assert r.json()["error"] == ("FROM README.md: not a model in the store and not in the "
                                 "catalog")


# -- blob uploads: capped, and nothing left behind ---------------------------------------------

def _age(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def _plant(store: Store) -> dict[str, Path]:
    """Files a previous daemon left in the store, with their ages."""
    def blob(data: bytes, age: float) -> Path:
        with store.blobs.writer() as w:
            w.write(data)
        return _age(store.blobs.path(w.digest), age)

    def temp(name: str, age: float) -> Path:
        (store.blobs.root / name).write_bytes(b"half")
        return _age(store.blobs.root / name, age)

    return {
        "referenced": _age(store.model_path(store.get("tiny")[1]), 30 * DAY),
        "old orphan": blob(b"uploaded long ago, never used", 2 * DAY),
        "new orphan": blob(b"uploaded a minute ago", 60),
        "crashed upload": temp(".incoming-crashed", 2 * 3600),
        "live upload": temp(".incoming-live", 0),
        "old partial pull": temp(f"sha256-{'a' * 64}.partial", 2 * DAY),
        "new partial pull": temp(f"sha256-{'b' * 64}.partial", 3600),
    }


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dict[str, Path]]]:
    """A daemon with a 1 MiB blob cap, started on a store holding old leftovers."""
    home = tiny_home(tmp_path_factory.mktemp("capped-home"), ["tiny"])
    planted = _plant(Store(home))
    d = Daemon(home, env={"LLMRUN_MAX_BLOB_SIZE": "1MiB"}).start()
    yield d, planted
    d.stop()


def _files(d: Daemon) -> set[str]:
    return {p.name for p in (d.home / "blobs").iterdir() if not p.name.endswith(".lock")}


def test_daemon_start_prunes_unused_blobs_and_crashed_writes(
        capped: tuple[Daemon, dict[str, Path]]) -> None:
    d, planted = capped
    gone = {k for k, p in planted.items() if not p.exists()}
    assert gone == {"old orphan", "crashed upload", "old partial pull"}
    r = httpx.post(f"{d.url}/api/generate", timeout=120,
                   json={"model": "tiny", "prompt": "hi", "stream": False,
                         "options": {"num_predict": 1}})
    assert r.status_code == 200  # the old but referenced model blob is intact


def test_blob_over_the_cap_is_413_and_leaves_nothing(
        capped: tuple[Daemon, dict[str, Path]]) -> None:
    d, _ = capped
    before = _files(d)
    big = bytes(MiB + 1)
    digest = "sha256:" + hashlib.sha256(big).hexdigest()
    r = httpx.post(f"{d.url}/api/blobs/{digest}", content=big)  # Content-Length says so
    assert r.status_code == 413 and "LLMRUN_MAX_BLOB_SIZE" in r.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: stopped by counting
        for _ in range(4):
            yield bytes(MiB // 2)

    streamed = "sha256:" + hashlib.sha256(bytes(2 * MiB)).hexdigest()
    r = httpx.post(f"{d.url}/api/blobs/{streamed}", content=chunks())
    assert r.status_code == 413 and "LLMRUN_MAX_BLOB_SIZE" in r.json()["error"]
    for x in (digest, streamed):
        assert httpx.head(f"{d.url}/api/blobs/{x}").status_code == 404
    assert _files(d) == before
    small = b"within the cap"
    ok = "sha256:" + hashlib.sha256(small).hexdigest()
    assert httpx.post(f"{d.url}/api/blobs/{ok}", content=small).status_code == 201
    assert httpx.head(f"{d.url}/api/blobs/{ok}").status_code == 200


def test_a_client_gone_mid_upload_leaves_nothing(capped: tuple[Daemon, dict[str, Path]]) -> None:
    d, _ = capped
    before = _files(d)
    digest = "sha256:" + hashlib.sha256(bytes(500_000)).hexdigest()
    head = (f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\n"
            "Content-Length: 500000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", d.port)) as s:
        s.sendall(head + bytes(100_000))
        wait_until(lambda: _files(d) - before)  # the upload is being written
    wait_until(lambda: _files(d) == before)  # and once the client is gone, removed
    assert httpx.head(f"{d.url}/api/blobs/{digest}").status_code == 404
