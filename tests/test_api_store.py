"""Ollama's store endpoints through the official `ollama` client against the real daemon."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import ollama
import pytest

from tests.conftest import Daemon, make_home


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
