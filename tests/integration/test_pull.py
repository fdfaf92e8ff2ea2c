"""`llmrun pull` from Hugging Face, against a local server that answers the Hub's endpoints
(tests/fakes/hubserver.py) through the real huggingface_hub client: resume, digests, locks, splits,
hostile listings, a full disk."""

from __future__ import annotations

import errno
import hashlib
import re
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from llmrun.store import DigestError, ModelNotFound, PullError, Store, StoreError
from llmrun.store import pull as hub_pull
from tests.fakes.hubserver import HubServer, use_hub
from tests.fakes.tinymodel import write_tiny_llama


@pytest.fixture
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
def store(_isolated_home: Path) -> Store:
    return Store(_isolated_home)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(store: Store) -> list[str]:
    return sorted(p.name for p in store.blobs.root.iterdir()
                  if p.name.endswith(".partial") or p.name.startswith(".incoming"))


def test_pull_picks_q4_k_m_by_default(store: Store, hub: HubServer, tiny: Path) -> None:
    hub.add_file("org/tiny-GGUF", "tiny-Q8_0.gguf", tiny.read_bytes()[:100] + b"x")
    hub.add_file("org/tiny-GGUF", "tiny-Q4_K_M.gguf", tiny)
    hub.add_file("org/tiny-GGUF", "README.md", b"# tiny\n")
    steps: list[str] = []
    m = store.pull("hf.co/org/tiny-GGUF", lambda s, done, total: steps.append(s))
    assert m.name == "hf.co/org/tiny-GGUF:latest"
    assert m.model.digest == f"sha256:{sha(tiny)}"
    assert store.blobs.path(m.model.digest).read_bytes() == tiny.read_bytes()
    assert m.source == "hf.co/org/tiny-GGUF/tiny-Q4_K_M.gguf"
    assert any("default quantization Q4_K_M" in s for s in steps)
    assert leftovers(store) == []
    assert [x.name for x in store.list()] == ["hf.co/org/tiny-GGUF:latest"]


def test_tag_picks_quant_or_file_case_insensitively(store: Store, hub: HubServer,
                                                    tiny: Path, tmp_path: Path) -> None:
    other = write_tiny_llama(tmp_path / "other.gguf", seed=5)
    hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny)
    hub.add_file("org/repo", "m-Q8_0.gguf", other)
    assert store.pull("hf.co/org/repo:q8_0").model.digest == f"sha256:{sha(other)}"
    assert store.pull("huggingface.co/org/repo:m-Q4_K_M.gguf").model.digest == \
        f"sha256:{sha(tiny)}"
    with pytest.raises(PullError, match="available quantizations: Q4_K_M, Q8_0"):
        store.pull("hf.co/org/repo:iq2_xs")


def test_latest_without_q4_k_m_says_what_it_chose(store: Store, hub: HubServer,
                                                  tiny: Path) -> None:
    hub.add_file("org/repo", "m-Q8_0.gguf", tiny)
    steps: list[str] = []
    store.pull("hf.co/org/repo", lambda s, done, total: steps.append(s))
    assert any("no Q4_K_M in this repo; chose Q8_0" in s for s in steps)


def test_resume_after_cut_connection(store: Store, hub: HubServer, tiny: Path) -> None:
    f = hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny, cut_after=500_000, cut_times=1)
    with pytest.raises(PullError, match="pull again to resume"):
        store.pull("hf.co/org/repo")
    assert leftovers(store) == [f"sha256-{sha(tiny)}.partial"]
    partial = store.blobs.root / f"sha256-{sha(tiny)}.partial"
    have = partial.stat().st_size
    assert 0 < have < tiny.stat().st_size
    assert store.list() == []  # no manifest for a half-downloaded model
    m = store.pull("hf.co/org/repo")
    assert f.ranges[-1] == f"bytes={have}-"  # resumed, did not start over
    assert store.blobs.path(m.model.digest).read_bytes() == tiny.read_bytes()
    assert leftovers(store) == []


def test_server_ignoring_range_starts_over_cleanly(store: Store, hub: HubServer,
                                                   tiny: Path) -> None:
    f = hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny, cut_after=300_000, cut_times=1)
    with pytest.raises(PullError):
        store.pull("hf.co/org/repo")
    f.ignore_range = True
    m = store.pull("hf.co/org/repo")
    assert store.blobs.path(m.model.digest).read_bytes() == tiny.read_bytes()


@pytest.mark.parametrize("fault", ["corrupt", "lie"])
def test_digest_mismatch_deletes_download(store: Store, hub: HubServer, tiny: Path,
                                          fault: str) -> None:
    f = hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny)
    if fault == "corrupt":
        f.corrupt = True
    else:
        f.lie_sha256 = "ab" * 32
    with pytest.raises(DigestError, match=r"does not match its sha256.*deleted"):
        store.pull("hf.co/org/repo")
    assert list(store.blobs.root.glob("sha256-*")) == [] or \
        all(p.name.endswith(".lock") for p in store.blobs.root.glob("sha256-*"))
    assert store.list() == []


def test_concurrent_pulls_of_one_model(store: Store, hub: HubServer, tiny: Path) -> None:
    f = hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny, delay=0.002)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            Store(store.home).pull("hf.co/org/repo")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert f.gets == 1  # the others waited on the blob's lock, then found it done
    assert len([p for p in store.blobs.root.glob("sha256-*") if not p.name.endswith(".lock")]) \
        == 1
    assert leftovers(store) == []


def _write_split(tiny: Path, out_dir: Path) -> list[Path]:
    """Split the tiny model's tensors over two GGUF files, as gguf-split does."""
    reader = gguf.GGUFReader(tiny)
    tensors = list(reader.tensors)
    half = len(tensors) // 2
    paths = []
    for no, chunk in enumerate((tensors[:half], tensors[half:])):
        path = out_dir / f"big-Q4_K_M-{no + 1:05d}-of-00002.gguf"
        w = gguf.GGUFWriter(path, arch="llama")
        if no == 0:
            for field in reader.fields.values():
                if field.name.startswith("GGUF.") or field.name == "general.architecture":
                    continue
                w.add_key_value(field.name, field.contents(), field.types[0],
                                field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY
                                else None)
        w.add_uint16("split.no", no)
        w.add_uint16("split.count", 2)
        w.add_int32("split.tensors.count", len(tensors))
        for t in chunk:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def test_split_gguf_is_pulled_whole_and_in_order(store: Store, hub: HubServer, tiny: Path,
                                                 tmp_path: Path) -> None:
    parts = _write_split(tiny, tmp_path)
    hub.add_file("org/big", parts[1].name, parts[1])  # listed out of order on purpose
    hub.add_file("org/big", parts[0].name, parts[0])
    m = store.pull("hf.co/org/big")
    assert m.model.digest == f"sha256:{sha(parts[0])}"
    assert [p.digest for p in m.parts] == [f"sha256:{sha(parts[1])}"]
    assert m.size == parts[0].stat().st_size + parts[1].stat().st_size
    from llmrun.engine.llama import Model

    loaded = Model(store.model_paths(m))  # llama.cpp loads the parts as one model
    loaded.close()


def test_split_with_a_missing_part_is_refused(store: Store, hub: HubServer, tiny: Path,
                                              tmp_path: Path) -> None:
    parts = _write_split(tiny, tmp_path)
    hub.add_file("org/big", parts[0].name, parts[0])
    with pytest.raises(PullError, match="missing parts"):
        store.pull("hf.co/org/big")


def test_hostile_listing_never_touches_the_file_system(store: Store, hub: HubServer,
                                                       tiny: Path, tmp_path: Path) -> None:
    for evil in ("../../evil-Q4_K_M.gguf", "/abs-Q4_K_M.gguf", "a/../../b-Q4_K_M.gguf",
                 "..\\\\win-Q4_K_M.gguf"):
        hub.add_file("org/evil", evil, tiny)
    with pytest.raises(PullError, match="has no GGUF files"):
        store.pull("hf.co/org/evil")
    hub.add_file("org/evil", "good-Q8_0.gguf", tiny)
    m = store.pull("hf.co/org/evil")
    assert m.source.endswith("good-Q8_0.gguf")
    assert not (store.home.parent / "evil-Q4_K_M.gguf").exists()
    assert not Path("/abs-Q4_K_M.gguf").exists()


def test_disk_full_keeps_partial_and_writes_no_manifest(store: Store, hub: HubServer,
                                                        tiny: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny)
    real_open = open

    class Full:
        def __init__(self, fh) -> None:
            self.fh, self.written = fh, 0

        def write(self, data: bytes) -> int:
            if self.written + len(data) > 400_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.fh.write(data)

        def __getattr__(self, name: str):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

    def fake_open(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        return Full(fh) if str(path).endswith(".partial") and "a" in mode else fh

    monkeypatch.setattr(hub_pull, "open", fake_open, raising=False)
    with pytest.raises(PullError, match="disk full"):
        store.pull("hf.co/org/repo")
    assert store.list() == []
    assert leftovers(store)  # kept for resume
    monkeypatch.undo()
    use_hub(monkeypatch, hub)
    m = store.pull("hf.co/org/repo")
    assert store.blobs.path(m.model.digest).read_bytes() == tiny.read_bytes()


def test_errors_name_the_problem(store: Store, hub: HubServer, tiny: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    hub.add_file("org/docs", "README.md", b"no models here")
    with pytest.raises(PullError, match="has no GGUF files"):
        store.pull("hf.co/org/docs")
    with pytest.raises(PullError, match="not found"):
        store.pull("hf.co/org/nothing")
    with pytest.raises(ModelNotFound, match="did you mean: smollm2"):
        store.pull("smolm2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PullError, match="HF_HUB_OFFLINE"):
        store.pull("hf.co/org/docs")


def test_catalog_sha256_is_enforced(store: Store, hub: HubServer, tiny: Path) -> None:
    # smollm2:360m pins its file's sha256 in the catalog; a Hub serving other bytes under
    # that name is refused, whatever the Hub's own metadata says.
    hub.add_file("bartowski/SmolLM2-360M-Instruct-GGUF", "SmolLM2-360M-Instruct-Q4_K_M.gguf",
                 tiny)
    with pytest.raises(StoreError, match="differs from the catalog"):
        store.pull("smollm2:360m")
    assert store.list() == []


@pytest.mark.parametrize(("name", "repo", "file", "pinned"), [
    ("bge-m3", "ggml-org/bge-m3-Q8_0-GGUF", "bge-m3-q8_0.gguf", "aa473d51"),
    ("nomic-embed-text:v1.5-query", "nomic-ai/nomic-embed-text-v1.5-GGUF",
     "nomic-embed-text-v1.5.Q8_0.gguf", "3e243421"),
    ("qwen3-embedding", "Qwen/Qwen3-Embedding-0.6B-GGUF", "Qwen3-Embedding-0.6B-Q8_0.gguf",
     "06507c7b"),
    ("bge-reranker-v2-m3", "gpustack/bge-reranker-v2-m3-GGUF", "bge-reranker-v2-m3-Q8_0.gguf",
     "a43c7c9b"),
    ("qwen3-reranker:0.6b", "ggml-org/Qwen3-Reranker-0.6B-Q8_0-GGUF",
     "qwen3-reranker-0.6b-q8_0.gguf", "22c9979c"),
])
def test_retrieval_names_pull_their_pinned_files(store: Store, hub: HubServer, tiny: Path,
                                                 name: str, repo: str, file: str,
                                                 pinned: str) -> None:
    # the Hub here serves the tiny model under each catalog file's name: the pull goes to
    # that very repo and file, and the catalog's sha256 refuses what is not the real one
    hub.add_file(repo, file, tiny)
    with pytest.raises(StoreError, match=f"{re.escape(repo)}/{re.escape(file)}: the Hub's "
                                         f"sha256 [0-9a-f]+ differs from the catalog's "
                                         f"{pinned}"):
        store.pull(name)
    assert store.list() == []


def test_tampered_blob_is_refused(store: Store, hub: HubServer, tiny: Path) -> None:
    hub.add_file("org/repo", "m-Q4_K_M.gguf", tiny)
    m = store.pull("hf.co/org/repo")
    store.verify(m)
    path = store.blobs.path(m.model.digest)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="modified on disk"):
        store.verify(m)


def test_pull_real_model_through_daemon(smollm2_path: Path, tmp_path: Path) -> None:
    import ollama

    from tests.conftest import Daemon

    with HubServer() as server:
        server.add_file("test/SmolLM2-GGUF", "SmolLM2-135M-Instruct-Q4_K_M.gguf", smollm2_path)
        home = tmp_path / "home"
        home.mkdir()
        daemon = Daemon(home, env={"HF_ENDPOINT": server.url}).start()
        try:
            client = ollama.Client(host=daemon.url)
            events = list(client.pull("hf.co/test/SmolLM2-GGUF", stream=True))
            assert events[-1].status == "success"
            sized = [e for e in events if e.total]
            assert sized and sized[-1].completed == sized[-1].total == 98362432
            out = client.chat(model="hf.co/test/SmolLM2-GGUF",
                              messages=[{"role": "user", "content": "Hi"}],
                              options={"num_predict": 4})
            assert out.eval_count == 4
            with pytest.raises(ollama.ResponseError):
                client.pull("hf.co/test/missing-repo")
        finally:
            daemon.stop()


@pytest.mark.parametrize("fault", [{"extra_bytes": 4096},  # Content-Length says so
                                   {"extra_bytes": 4096, "hide_length": True}])  # only counting
def test_body_longer_than_advertised_is_refused(store: Store, hub: HubServer, tiny: Path,
                                                fault: dict[str, object]) -> None:
    hub.add_file("org/long-GGUF", "long-Q4_K_M.gguf", tiny, **fault)
    with pytest.raises(PullError, match=f"sent more than the {tiny.stat().st_size} bytes "
                                        "expected"):
        store.pull("hf.co/org/long-GGUF")
    assert leftovers(store) == []
    assert store.blobs.digests() == set() and store.list() == []


def test_without_an_expected_size_the_blob_cap_bounds_a_pull(
        store: Store, hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    f = hub.add_file("org/raw", "big.bin", b"x" * 300_000, hide_length=True)
    monkeypatch.setenv("LLMRUN_MAX_BLOB_SIZE", "100KiB")
    with pytest.raises(PullError, match=r"LLMRUN_MAX_BLOB_SIZE \(102400 bytes\)"):
        hub_pull.download(store.blobs, f.url, sha256=None, size=None)
    assert leftovers(store) == [] and store.blobs.digests() == set()
    monkeypatch.setenv("LLMRUN_MAX_BLOB_SIZE", "1MiB")  # within the cap it is stored
    digest, size = hub_pull.download(store.blobs, f.url, sha256=None, size=None)
    assert size == 300_000 and store.blobs.digests() == {digest}
