"""The fake Hub (tests/fakes/hubserver.py) against the real huggingface_hub client and httpx."""

from __future__ import annotations

import hashlib
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from huggingface_hub import (
    HfApi,
    constants,
    file_download,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.fakes.hubserver import HubFile, HubServer, serve_hub, use_hub

REPO = "org/tiny-GGUF"
GGUF = "tiny-Q4_K_M.gguf"
PAYLOAD = bytes(range(256)) * 40  # 10240 bytes
README = b"# tiny\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def populate(hub: HubServer) -> None:
    hub.add_file(REPO, GGUF, PAYLOAD)
    hub.add_file(REPO, "README.md", README)
    hub.add_file(REPO, "sub/part-Q8_0.gguf", b"sub-file")


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with serve_hub() as server:
        populate(server)
        use_hub(monkeypatch, server)
        yield server


@pytest.fixture
def api(hub: HubServer) -> HfApi:
    return HfApi(endpoint=hub.url, token=False)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module: a new httpx.Client costs ~70 ms (its SSL context)."""
    with httpx.Client() as client:
        yield client


def test_model_info_with_files_metadata(hub: HubServer, api: HfApi) -> None:
    info = api.model_info(REPO, revision=None, files_metadata=True)
    assert info.id == REPO
    assert info.sha is not None and len(info.sha) == 40
    by_name = {s.rfilename: s for s in info.siblings or []}
    assert set(by_name) == {GGUF, "README.md", "sub/part-Q8_0.gguf"}
    gguf = by_name[GGUF]
    assert gguf.size == len(PAYLOAD)
    assert gguf.lfs is not None
    assert gguf.lfs.sha256 == sha256(PAYLOAD)
    assert gguf.lfs.size == len(PAYLOAD)
    assert gguf.lfs.pointer_size == len(hub.file(REPO, GGUF).pointer)
    readme = by_name["README.md"]
    assert readme.lfs is None and readme.size == len(README)
    # a git blob id, as `git hash-object` computes it
    assert readme.blob_id == hashlib.sha1(b"blob %d\0" % len(README) + README).hexdigest()

    bare = api.model_info(REPO)
    assert bare.siblings is not None and all(s.size is None for s in bare.siblings)


def test_model_info_revisions(hub: HubServer, api: HfApi) -> None:
    sha = api.model_info(REPO).sha
    assert sha is not None
    assert api.model_info(REPO, revision="main").sha == sha
    assert api.model_info(REPO, revision=sha).sha == sha
    assert api.model_info(REPO, revision=sha[:7]).sha == sha
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="nope")
    hub.add_repo(REPO, branches=("main", "v2"), sha="a" * 40, info={"gguf": {"total": 1}})
    info = api.model_info(REPO, revision="v2")
    assert info.sha == "a" * 40 and info.gguf == {"total": 1}


def test_list_repo_tree_and_paths_info(hub: HubServer, api: HfApi) -> None:
    entries = {e.path: e for e in api.list_repo_tree(REPO, recursive=True, expand=True)}
    assert set(entries) == {GGUF, "README.md", "sub", "sub/part-Q8_0.gguf"}
    gguf = entries[GGUF]
    assert gguf.size == len(PAYLOAD)
    assert gguf.lfs is not None and gguf.lfs.sha256 == sha256(PAYLOAD)
    assert gguf.lfs.size == len(PAYLOAD)
    assert gguf.last_commit is not None and gguf.security is not None
    assert entries["README.md"].lfs is None
    assert type(entries["sub"]).__name__ == "RepoFolder"

    top = {e.path for e in api.list_repo_tree(REPO)}
    assert top == {GGUF, "README.md", "sub"}
    assert {e.path for e in api.list_repo_tree(REPO, "sub")} == {"sub/part-Q8_0.gguf"}
    assert sorted(api.list_repo_files(REPO)) == sorted([GGUF, "README.md", "sub/part-Q8_0.gguf"])
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, "missing"))

    infos = api.get_paths_info(REPO, [GGUF, "sub", "missing"])
    assert [i.path for i in infos] == [GGUF, "sub"]
    assert infos[0].lfs is not None and infos[0].lfs.sha256 == sha256(PAYLOAD)


def test_tree_pagination() -> None:
    with serve_hub(tree_page_size=1) as hub:
        populate(hub)
        api = HfApi(endpoint=hub.url, token=False)
        paths = [e.path for e in api.list_repo_tree(REPO, recursive=True)]
        assert len(paths) == 4
        assert sum("/tree/" in r.path for r in hub.requests) == 4


def test_hf_hub_url_and_download(hub: HubServer, tmp_path: Path) -> None:
    url = hf_hub_url(REPO, GGUF)  # endpoint from the patched constants
    assert url == f"{hub.url}/{REPO}/resolve/main/{GGUF}" == hub.file_url(REPO, GGUF)
    path = hf_hub_download(REPO, GGUF, cache_dir=tmp_path)
    assert Path(path).read_bytes() == PAYLOAD
    f = hub.file(REPO, GGUF)
    assert (f.heads, f.gets, f.ranges) == (1, 1, [None])

    sha = HfApi(endpoint=hub.url).model_info(REPO).sha
    assert sha is not None
    nested = hf_hub_download(REPO, "sub/part-Q8_0.gguf", revision=sha, cache_dir=tmp_path,
                             endpoint=hub.url)
    assert Path(nested).read_bytes() == b"sub-file"
    assert Path(hf_hub_download(REPO, "README.md", cache_dir=tmp_path)).read_bytes() == README


def test_file_streamed_from_disk(http: httpx.Client, hub: HubServer, tmp_path: Path) -> None:
    src = tmp_path / "big.gguf"
    data = hashlib.sha256(b"seed").digest() * 40_000  # 1.28 MB, several chunks
    src.write_bytes(data)
    f = hub.add_file(REPO, "big.gguf", src)
    assert f.size == len(data) and f.sha256 == sha256(data)
    r = http.get(hub.file_url(REPO, "big.gguf"), headers={"Range": "bytes=1000000-"})
    assert r.status_code == 206 and r.content == data[1_000_000:]
    path = hf_hub_download(REPO, "big.gguf", cache_dir=tmp_path / "cache")
    assert Path(path).read_bytes() == data


def test_snapshot_download(hub: HubServer, tmp_path: Path) -> None:
    folder = Path(snapshot_download(REPO, cache_dir=tmp_path, allow_patterns=["*.gguf"]))
    assert (folder / GGUF).read_bytes() == PAYLOAD
    assert (folder / "sub" / "part-Q8_0.gguf").read_bytes() == b"sub-file"
    assert not (folder / "README.md").exists()


def test_range_requests(http: httpx.Client, hub: HubServer) -> None:
    url = hub.file_url(REPO, GGUF)
    size = len(PAYLOAD)
    r = http.get(url, headers={"Range": "bytes=100-"})
    assert r.status_code == 206
    assert r.content == PAYLOAD[100:]
    assert r.headers["content-range"] == f"bytes 100-{size - 1}/{size}"
    assert r.headers["content-length"] == str(size - 100)

    r = http.get(url, headers={"Range": "bytes=5-9"})
    assert (r.status_code, r.content) == (206, PAYLOAD[5:10])
    r = http.get(url, headers={"Range": "bytes=-4"})
    assert (r.status_code, r.content) == (206, PAYLOAD[-4:])

    r = http.get(url, headers={"Range": f"bytes={size}-"})
    assert r.status_code == 416
    assert r.headers["content-range"] == f"bytes */{size}"

    r = http.head(url)
    assert r.status_code == 200
    assert r.headers["content-length"] == str(size)
    assert r.headers["x-linked-etag"] == r.headers["etag"] == f'"{sha256(PAYLOAD)}"'
    assert r.headers["x-linked-size"] == str(size)
    assert r.headers["x-repo-commit"] == hub.repos[REPO].sha
    assert r.headers["accept-ranges"] == "bytes"
    f = hub.file(REPO, GGUF)
    assert f.ranges == ["bytes=100-", "bytes=5-9", "bytes=-4", f"bytes={size}-"]
    assert (f.gets, f.heads) == (4, 1)


def test_not_found_errors(http: httpx.Client, hub: HubServer, api: HfApi,
                          tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing", files_metadata=True)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", GGUF, cache_dir=tmp_path)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.gguf", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, GGUF, revision="nope", cache_dir=tmp_path)
    assert not api.file_exists(REPO, "missing.gguf")
    assert api.file_exists(REPO, GGUF)
    assert not api.repo_exists("org/missing")

    r = http.get(hub.file_url(REPO, "missing.gguf"))
    assert r.status_code == 404
    assert r.headers["x-error-code"] == "EntryNotFound"
    assert r.json() == {"error": "Entry not found"}
    r = http.get(hub.file_url("org/missing", GGUF))
    assert (r.status_code, r.headers["x-error-code"]) == (404, "RepoNotFound")


def test_cut_after_fails_a_download_midway(http: httpx.Client, hub: HubServer) -> None:
    f = hub.file(REPO, GGUF)
    f.cut_after = 1000
    got = bytearray()
    with pytest.raises(httpx.RemoteProtocolError), http.stream("GET", f.url) as r:
        assert r.status_code == 200
        assert r.headers["content-length"] == str(len(PAYLOAD))
        for chunk in r.iter_bytes():
            got += chunk
    assert bytes(got) == PAYLOAD[:1000]
    # every time (cut_times=None): a resume gets the next 1000 bytes, then is cut again
    with pytest.raises(httpx.RemoteProtocolError), http.stream(
            "GET", f.url, headers={"Range": "bytes=1000-"}) as r:
        assert r.status_code == 206
        for chunk in r.iter_bytes():
            got += chunk
    assert bytes(got) == PAYLOAD[:2000]
    assert (f.cuts, f.ranges) == (2, [None, "bytes=1000-"])

    f.cut_times = 1  # once more, then whole
    with pytest.raises(httpx.RemoteProtocolError):
        http.get(f.url)
    assert http.get(f.url).content == PAYLOAD
    assert (f.cuts, f.cut_times, f.gets) == (3, 0, 4)


def test_hf_hub_download_resumes_after_a_cut(hub: HubServer, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # huggingface_hub sleeps 1 s before resuming; skip that (it is the only use of `time` there)
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda _s: None))
    f = hub.file(REPO, GGUF)
    f.cut_after, f.cut_times = 4000, 1
    path = hf_hub_download(REPO, GGUF, cache_dir=tmp_path / "a")
    assert Path(path).read_bytes() == PAYLOAD
    # it keeps only whole DOWNLOAD_CHUNK_SIZE (10 MiB) chunks: cut within one, it starts over
    assert f.ranges == [None, None]
    assert f.cuts == 1

    f.reset_counters()
    f.cut_after, f.cut_times = 4096, 1
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    path = hf_hub_download(REPO, GGUF, cache_dir=tmp_path / "b")
    assert Path(path).read_bytes() == PAYLOAD
    assert f.ranges == [None, "bytes=4096-"]


def test_corrupt_serves_other_bytes_of_the_same_size(http: httpx.Client, hub: HubServer,
                                                     api: HfApi, tmp_path: Path) -> None:
    f = hub.file(REPO, GGUF)
    f.corrupt = True
    body = http.get(f.url).content
    assert len(body) == len(PAYLOAD) and body != PAYLOAD
    assert sha256(body) != sha256(PAYLOAD)
    # consistent across ranges, so a resumed download is corrupt the same way
    tail = http.get(f.url, headers={"Range": "bytes=5000-"}).content
    assert tail == body[5000:]
    info = api.model_info(REPO, files_metadata=True)
    lfs = {s.rfilename: s.lfs for s in info.siblings or []}[GGUF]
    assert lfs is not None and lfs.sha256 == sha256(PAYLOAD)  # advertises the true hash
    # huggingface_hub checks only the size: it keeps the corrupt file without complaint
    path = hf_hub_download(REPO, GGUF, cache_dir=tmp_path)
    assert Path(path).read_bytes() == body


def test_lie_sha256_is_advertised_everywhere(http: httpx.Client, hub: HubServer,
                                             api: HfApi) -> None:
    f = hub.file(REPO, GGUF)
    f.lie_sha256 = "0" * 64
    info = api.model_info(REPO, files_metadata=True)
    lfs = {s.rfilename: s.lfs for s in info.siblings or []}[GGUF]
    assert lfs is not None and lfs.sha256 == "0" * 64
    tree = {e.path: e for e in api.list_repo_tree(REPO, recursive=True)}
    assert tree[GGUF].lfs.sha256 == "0" * 64  # type: ignore[union-attr]
    r = http.get(f.url)
    assert r.headers["x-linked-etag"] == '"' + "0" * 64 + '"'
    assert r.content == PAYLOAD


def test_ignore_range_and_fail_status(http: httpx.Client, hub: HubServer) -> None:
    f = hub.file(REPO, GGUF)
    f.ignore_range = True
    r = http.get(f.url, headers={"Range": "bytes=100-"})
    assert (r.status_code, r.content) == (200, PAYLOAD)
    assert "content-range" not in r.headers

    f.fail_status, f.fail_times = 503, 1
    r = http.get(f.url)
    assert r.status_code == 503 and "error" in r.json()
    assert http.get(f.url).status_code == 200


def test_delay_per_chunk(http: httpx.Client) -> None:
    with serve_hub(chunk_size=1024) as hub:
        f = hub.add_file(REPO, GGUF, PAYLOAD, delay=0.01)  # 10 chunks
        start = time.monotonic()
        assert http.get(hub.file_url(REPO, GGUF)).content == PAYLOAD
        assert time.monotonic() - start >= 0.1
        hub.wait_idle()  # the server counts the last chunk after the client may have read it
        assert f.bytes_sent == len(PAYLOAD)


def test_wait_idle_waits_for_the_handler_to_finish(http: httpx.Client) -> None:
    """The race `wait_idle` closes, made certain: the client has the whole body while the
    handler has yet to count its chunk."""
    with serve_hub() as hub:
        f = hub.add_file(REPO, GGUF, PAYLOAD)  # one chunk
        release = threading.Event()
        count = hub._count

        def held(file: HubFile, **delta: int) -> None:
            release.wait(60)
            count(file, **delta)

        hub._count = held  # type: ignore[method-assign]
        assert http.get(f.url).content == PAYLOAD
        assert f.bytes_sent == 0
        with pytest.raises(TimeoutError):
            hub.wait_idle(timeout=0.2)
        release.set()
        hub.wait_idle()
        assert f.bytes_sent == len(PAYLOAD)


def test_token_auth(http: httpx.Client, monkeypatch: pytest.MonkeyPatch,
                    tmp_path: Path) -> None:
    with serve_hub(token="hf_secret") as hub:
        populate(hub)
        use_hub(monkeypatch, hub)
        url = hub.file_url(REPO, GGUF)
        assert http.get(url).status_code == 401
        assert http.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
        r = http.get(url, headers={"Authorization": "Bearer hf_secret"})
        assert (r.status_code, r.content) == (200, PAYLOAD)

        with pytest.raises(RepositoryNotFoundError) as missing:
            HfApi(endpoint=hub.url, token=False).model_info(REPO)
        assert missing.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError) as wrong:
            HfApi(endpoint=hub.url, token="nope").model_info(REPO)
        assert wrong.value.response.status_code == 401
        assert not isinstance(wrong.value, RepositoryNotFoundError)
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download(REPO, GGUF, cache_dir=tmp_path)

        info = HfApi(endpoint=hub.url, token="hf_secret").model_info(REPO, files_metadata=True)
        assert info.id == REPO
        monkeypatch.setenv("HF_TOKEN", "hf_secret")  # read at call time
        assert Path(hf_hub_download(REPO, GGUF, cache_dir=tmp_path)).read_bytes() == PAYLOAD


def test_lfs_redirect_like_the_hub(http: httpx.Client, monkeypatch: pytest.MonkeyPatch,
                                   tmp_path: Path) -> None:
    with serve_hub(token="hf_secret", lfs_redirect=True) as hub:
        populate(hub)
        use_hub(monkeypatch, hub)
        auth = {"Authorization": "Bearer hf_secret"}
        r = http.get(hub.file_url(REPO, GGUF), headers=auth)
        assert r.status_code == 302
        assert r.headers["location"].startswith(f"http://localhost:{hub.port}/_cdn/")
        assert r.headers["x-linked-etag"] == f'"{sha256(PAYLOAD)}"'
        r = http.get(hub.file_url(REPO, GGUF), headers=auth | {"Range": "bytes=10-"},
                      follow_redirects=True)
        assert (r.status_code, r.content) == (206, PAYLOAD[10:])

        hub.requests.clear()
        path = hf_hub_download(REPO, GGUF, cache_dir=tmp_path, token="hf_secret")
        assert Path(path).read_bytes() == PAYLOAD
        cdn = [q for q in hub.requests if q.path.startswith("/_cdn/")]
        assert [q.method for q in cdn] == ["GET"]  # HEAD stopped at the 302
        assert "authorization" not in cdn[0].headers  # the token never left the "Hub"
        f = hub.file(REPO, GGUF)
        assert (f.redirects, f.gets) == (3, 2)
        # small files are not LFS: served directly, never redirected
        r = http.get(hub.file_url(REPO, "README.md"), headers=auth)
        assert (r.status_code, r.content) == (200, README)


def test_hostile_names_are_listed_verbatim(hub: HubServer, api: HfApi,
                                           tmp_path: Path) -> None:
    evil = ["../../evil.gguf", "/abs.gguf", "a/../../b.gguf"]
    for name in evil:
        hub.add_file(REPO, name, b"pwned")
    info = api.model_info(REPO, files_metadata=True)
    names = [s.rfilename for s in info.siblings or []]
    assert set(evil) <= set(names)
    lfs = {s.rfilename: s.lfs for s in info.siblings or []}
    assert lfs["../../evil.gguf"].sha256 == sha256(b"pwned")  # type: ignore[union-attr]
    assert set(evil) <= {e.path for e in api.list_repo_tree(REPO, recursive=True)}
    assert set(evil) <= {e.path for e in api.list_repo_tree(REPO)}
    # huggingface_hub's own downloader refuses such names before sending anything
    sent = len(hub.requests)
    for name in evil:
        with pytest.raises(ValueError, match="Invalid filename"):
            hf_hub_download(REPO, name, cache_dir=tmp_path)
    assert len(hub.requests) == sent


def test_module_level_functions_follow_use_hub(hub: HubServer) -> None:
    import huggingface_hub

    info = huggingface_hub.model_info(REPO, files_metadata=True)  # the import-time HfApi()
    assert info.id == REPO
    assert HfApi().endpoint == hub.url
