"""A fake Hugging Face Hub for tests: a threaded stdlib HTTP server on 127.0.0.1 that serves
model repos described in Python, with fault injection for downloader tests.

Checked against huggingface_hub 2.4 (which talks HTTP through `httpx2`, not `httpx`).

    hub = HubServer()                       # or HubServer(token="hf_secret", lfs_redirect=True)
    f = hub.add_file("org/repo", "model-Q4_K_M.gguf", Path("big.gguf"))  # streamed from disk
    hub.add_file("org/repo", "README.md", b"# hi\\n")                     # or bytes
    with hub:                               # start() ... stop(); or `with serve_hub() as hub:`
        api = HfApi(endpoint=hub.url)
        info = api.model_info("org/repo", files_metadata=True)
        f.cut_after = 1000                  # faults are plain attributes, settable any time
        assert f.ranges == [...]            # counters too

What it answers (everything huggingface_hub 2.4 sends for these calls):

- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}` (`HfApi.model_info`,
  `repo_info`, `repo_exists`): `id`, `sha` (a 40-hex commit), `siblings`; with `?blobs=true`
  (`files_metadata=True`) each sibling also has `size`, `blobId` and, for LFS files,
  `lfs: {sha256, size, pointerSize}`. `add_repo(info={...})` adds fields (e.g. `gguf`).
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=` (`list_repo_tree`,
  `list_repo_files`, `snapshot_download`): `{type: file, path, size, oid, lfs: {oid, size,
  pointerSize}}` and `{type: directory, path, oid}` entries; `expand` adds `lastCommit` and
  `securityFileStatus`. `HubServer(tree_page_size=n)` paginates with a `Link: rel="next"`.
- `POST /api/models/{repo}/paths-info/{rev}` (`get_paths_info`, form-encoded `paths`).
- `GET`/`HEAD /{repo}/resolve/{rev}/{filename}` (`hf_hub_url`, `hf_hub_download`,
  `get_hf_file_metadata`, `file_exists`): the bytes, with `Content-Length`,
  `Accept-Ranges: bytes`, `ETag`, `X-Repo-Commit`, `Content-Disposition` and, for LFS files,
  `X-Linked-Etag: "<sha256>"` and `X-Linked-Size`. One `Range: bytes=a-b` / `bytes=a-` /
  `bytes=-n` is honoured (206 + `Content-Range`); a start >= size gets 416 with
  `Content-Range: bytes */size`. `rev` is a branch (`main`) or the repo's commit (or a 7+
  character prefix of it); anything else is 404 `RevisionNotFound`.
- Hub-style errors: 404 with a JSON body `{"error": ...}` and `X-Error-Code: RepoNotFound` /
  `EntryNotFound` / `RevisionNotFound` (plus `X-Error-Message`), which huggingface_hub turns
  into `RepositoryNotFoundError` / `RemoteEntryNotFoundError` (a subclass of
  `EntryNotFoundError`) / `RevisionNotFoundError`.
- `HubServer(token="x")`: every request except the CDN ones (below) needs
  `Authorization: Bearer x`. Without that header: 401 with `X-Error-Code: RepoNotFound`
  (what the Hub sends for a private repo; huggingface_hub raises `RepositoryNotFoundError`).
  With a wrong token: 401 with `X-Error-Message: Invalid credentials in Authorization header`
  (huggingface_hub raises a plain `HfHubHTTPError`, status 401).
- `HubServer(lfs_redirect=True)`: like the real Hub, a resolve of an LFS file answers
  302 with the `X-Repo-Commit`/`X-Linked-*` headers and `Location:
  http://localhost:{port}/_cdn/{id}/{name}`, a different origin ("localhost" vs "127.0.0.1"),
  so huggingface_hub treats it as a CDN: it stops its HEAD at the 302 and does not send
  `Authorization` there. The CDN path needs no token (a signed URL). Default: off (the resolve
  URL serves the bytes itself). A client must follow redirects (`httpx` does not by default).
- Anything else is a plain 404 (e.g. `/api/agent-harnesses`, which huggingface_hub fetches
  once per process from `constants.ENDPOINT`: a 404 keeps it from writing a cache file).

Repos and files (`HubFile`):

- `add_file(repo_id, filename, content, *, lfs=None, sha256=None, **faults)`: `content` is
  `bytes` (kept in memory) or a `str`/`PathLike` path (size taken now, bytes streamed from disk
  per request, never loaded whole). `lfs=None` means LFS for model-like extensions (.gguf,
  .bin, .safetensors, ...) or files >= 10 MiB. The sha256 (and git blob oid) is computed once,
  lazily, and cached; pass `sha256=` to skip hashing a big file. Names are not validated, so
  hostile listings can be built: `add_file("o/r", "../../evil.gguf", b"x")`, `"/abs.gguf"`,
  `"a/../../b.gguf"` appear verbatim in `siblings`, in every tree listing (never split into
  folders) and in paths-info. (huggingface_hub's own `hf_hub_download` refuses them with
  `ValueError` before any request; `HfApi.model_info` passes them through.)
- A repo's commit is a sha1 of its file names and sizes unless `add_repo(sha=...)` pins it.

Faults, per file, plain attributes of the `HubFile` (also `add_file` keywords), read at the
start of each request:

- `cut_after=N`: a body GET sends the headers (with the full `Content-Length`) and only N
  bytes of *that response's* body, then closes the connection (the client sees EOF before the
  end of the body: `httpx.RemoteProtocolError`). N counts from the response's first byte, so a
  client resuming with `bytes=k-` gets bytes k..k+N-1 each time and always makes progress.
  `cut_times=None` (default) cuts every GET; `cut_times=k` cuts the next k GETs only (each cut
  decrements it), then the file is served whole. A response shorter than N is not cut.
- `corrupt=True`: bytes served differ from the real content (the byte at offset `size // 2`
  is inverted; same size, so a size check passes but a sha256 check fails; consistent across
  Range requests). The listing still advertises the true sha256.
- `lie_sha256="..."`: advertise this sha256 (model_info, tree, paths-info, `ETag`,
  `X-Linked-Etag`) while serving the true bytes.
- `ignore_range=True`: answer every GET 200 with the whole body.
- `delay=seconds`: sleep before each chunk (`HubServer(chunk_size=...)`, default 64 KiB).
- `fail_status=503, fail_times=k`: the next k body GETs (None: all) get that status with a
  Hub-style JSON error. HEAD is not affected.
- `extra_bytes=N`: a body GET that reaches the end of the file sends N more bytes (zeros)
  than the size the listing advertises, its `Content-Length` counting them: a server that
  says one size and sends more.
- `hide_length=True`: body GETs carry no `Content-Length` (the body ends when the
  connection closes), so only counting the bytes received can bound them.

Counters, per file (`HubFile`): `gets` (GETs that asked for the bytes: resolve GETs in direct
mode, CDN GETs in redirect mode), `ranges` (each such GET's `Range` header, None when absent),
`heads`, `redirects` (resolve requests answered 302), `cuts`, `bytes_sent`;
`reset_counters()`. Per server: `hub.requests`, every request as a `Request(method, path,
headers)` (header names lower-cased), e.g. to check a token never reached the CDN.
A handler thread counts each chunk after writing it, so a client can hold the whole body
before `bytes_sent` (or `cuts`) has it: `hub.wait_idle()` returns once every request the
server took is answered, and then the counters are final.

Pointing huggingface_hub at the server. huggingface_hub reads `HF_ENDPOINT` and
`HF_HUB_OFFLINE` once, at import, so setting the env var in a test is not enough by itself:

- `HfApi(endpoint=None)` takes `constants.ENDPOINT` when the HfApi is constructed; the
  module-level functions (`huggingface_hub.model_info`, `list_repo_tree`, ...) are methods of
  one `HfApi()` built at import (`huggingface_hub.hf_api.api`), so its `.endpoint` is frozen.
- `hf_hub_url(endpoint=None)` (and so `hf_hub_download`, `snapshot_download` without
  `endpoint=`) formats `constants.HUGGINGFACE_CO_URL_TEMPLATE`, also frozen at import;
  `hf_hub_url(..., endpoint=url)` swaps the `constants.ENDPOINT` prefix for `url`.
- offline mode is `constants.HF_HUB_OFFLINE` (every request goes through a hook that raises
  `OfflineModeIsEnabled`), not the env var.
- the token is read at call time: `HF_TOKEN` env var, then the file `constants.HF_TOKEN_PATH`.

So either pass `endpoint=hub.url` explicitly everywhere (`HfApi(endpoint=...)`,
`hf_hub_url(..., endpoint=...)`, `hf_hub_download(..., endpoint=...)`), or call
`use_hub(monkeypatch, hub)`, which sets `HF_ENDPOINT`, unsets `HF_HUB_OFFLINE`/`HF_TOKEN`,
and patches `constants.ENDPOINT`, `constants.HUGGINGFACE_CO_URL_TEMPLATE`,
`constants.HF_HUB_OFFLINE`, `constants.HF_TOKEN_PATH` and `hf_api.api.endpoint`. Code that
reads `os.environ["HF_ENDPOINT"]` at call time sees the env var either way. A fixture:

    @pytest.fixture
    def hub(monkeypatch):
        with serve_hub() as server:
            use_hub(monkeypatch, server)
            yield server

What huggingface_hub 2.4 itself does (checked in tests/unit/fakes/test_hubserver.py), for
downloader tests:
it raises `httpx2` exceptions (not `httpx` ones, not `OSError`) for transport errors; its
`hf_hub_download` needs `X-Repo-Commit` and an `ETag`/`X-Linked-Etag` on the HEAD, checks only
the size of what it downloads, never the sha256 (a `corrupt=True` file is cached silently), and
after a dropped connection retries up to 5 times, 1 s apart, resuming with `Range: bytes=N-`
only from whole 10 MiB chunks (`constants.DOWNLOAD_CHUNK_SIZE`): a smaller file starts over.
Its shared client follows redirects; plain `httpx` does not unless asked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

LFS_SUFFIXES = (".gguf", ".bin", ".safetensors", ".pt", ".pth", ".onnx", ".h5", ".msgpack",
                ".ckpt", ".model", ".zip", ".tar", ".gz", ".npy", ".npz", ".pkl")
LFS_MIN_SIZE = 10 * 1024 * 1024
DATE = "2024-01-01T00:00:00.000Z"
_RANGE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.IGNORECASE)
_HASH_CHUNK = 1 << 20
FAULTS = ("cut_after", "cut_times", "corrupt", "lie_sha256", "ignore_range", "delay",
          "fail_status", "fail_times", "extra_bytes", "hide_length")


def _unsafe_name(name: str) -> bool:
    """A name that must not be split into folders in listings (a hostile one)."""
    return name.startswith("/") or "\\" in name or ".." in name.split("/") or name == ""


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass(eq=False)
class HubFile:
    """One file of a repo: where its bytes come from, its faults and its counters."""

    repo_id: str
    rfilename: str
    source: bytes | Path
    size: int
    lfs: bool
    id: int
    # faults (read at the start of each request)
    cut_after: int | None = None
    cut_times: int | None = None
    corrupt: bool = False
    lie_sha256: str | None = None
    ignore_range: bool = False
    delay: float = 0.0
    fail_status: int | None = None
    fail_times: int | None = None
    extra_bytes: int = 0
    hide_length: bool = False
    # counters
    gets: int = 0
    heads: int = 0
    redirects: int = 0
    cuts: int = 0
    bytes_sent: int = 0
    ranges: list[str | None] = field(default_factory=list)
    _sha256: str | None = None
    _git_oid: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _hub: HubServer | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The resolve URL of this file on `main` (the server must be started)."""
        assert self._hub is not None
        return self._hub.file_url(self.repo_id, self.rfilename)

    @property
    def sha256(self) -> str:
        """The true sha256 of the content (computed once)."""
        with self._lock:
            if self._sha256 is None:
                h = hashlib.sha256()
                for chunk in self.read(0, self.size, _HASH_CHUNK):
                    h.update(chunk)
                self._sha256 = h.hexdigest()
            return self._sha256

    @property
    def advertised_sha256(self) -> str:
        return self.lie_sha256 or self.sha256

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer file the repo would hold for this file."""
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:"
                f"{self.advertised_sha256}\nsize {self.size}\n").encode()

    @property
    def git_oid(self) -> str:
        """The git blob id: of the LFS pointer for LFS files, else of the content."""
        if self.lfs:
            return _git_blob_sha1([self.pointer], len(self.pointer))
        with self._lock:
            if self._git_oid is None:
                self._git_oid = _git_blob_sha1(self.read(0, self.size, _HASH_CHUNK), self.size)
            return self._git_oid

    @property
    def etag(self) -> str:
        return f'"{self.advertised_sha256 if self.lfs else self.git_oid}"'

    def read(self, start: int, length: int, chunk_size: int) -> Iterator[bytes]:
        """The true bytes start..start+length, in chunks, streamed from disk for paths."""
        end = min(self.size, start + length)
        if isinstance(self.source, bytes):
            view = memoryview(self.source)
            for pos in range(start, end, chunk_size):
                yield bytes(view[pos:min(end, pos + chunk_size)])
            return
        with open(self.source, "rb") as fh:
            fh.seek(start)
            pos = start
            while pos < end:
                chunk = fh.read(min(chunk_size, end - pos))
                if not chunk:
                    return
                pos += len(chunk)
                yield chunk

    def reset_counters(self) -> None:
        with self._lock:
            self.gets = self.heads = self.redirects = self.cuts = self.bytes_sent = 0
            self.ranges = []


def _git_blob_sha1(chunks: Any, size: int) -> str:
    h = hashlib.sha1(f"blob {size}\0".encode())
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


@dataclass(eq=False)
class HubRepo:
    repo_id: str
    files: dict[str, HubFile] = field(default_factory=dict)
    branches: set[str] = field(default_factory=lambda: {"main"})
    info: dict[str, Any] = field(default_factory=dict)
    pinned_sha: str | None = None

    @property
    def sha(self) -> str:
        if self.pinned_sha:
            return self.pinned_sha
        h = hashlib.sha1(self.repo_id.encode())
        for name in sorted(self.files):
            h.update(f"\0{name}\0{self.files[name].size}".encode())
        return h.hexdigest()

    def has_revision(self, rev: str) -> bool:
        sha = self.sha
        return rev in self.branches or rev == sha or (
            len(rev) >= 7 and re.fullmatch(r"[0-9a-f]+", rev) is not None and sha.startswith(rev))


class HubServer:
    """A fake Hub; see the module docstring. `url` is valid after `start()`."""

    def __init__(self, *, token: str | None = None, lfs_redirect: bool = False,
                 cdn_host: str = "localhost", chunk_size: int = 64 * 1024,
                 tree_page_size: int | None = None) -> None:
        self.token = token
        self.lfs_redirect = lfs_redirect
        self.cdn_host = cdn_host
        self.chunk_size = chunk_size
        self.tree_page_size = tree_page_size
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[Request] = []
        self._by_id: dict[int, HubFile] = {}
        self._lock = threading.Lock()
        self._answering = 0  # requests whose handler has not returned yet
        self._answered = threading.Condition()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- describing repos ---------------------------------------------------------------

    def add_repo(self, repo_id: str, *, sha: str | None = None,
                 branches: tuple[str, ...] | None = None,
                 info: dict[str, Any] | None = None) -> HubRepo:
        """Create (or update) a repo. `sha` pins its commit, `branches` (default `main`) are
        the revision names it answers besides its commit, `info` adds model_info fields."""
        repo = self.repos.setdefault(repo_id, HubRepo(repo_id))
        if branches is not None:
            repo.branches = set(branches)
        if sha is not None:
            repo.pinned_sha = sha
        if info:
            repo.info.update(info)
        return repo

    def add_file(self, repo_id: str, filename: str, content: bytes | str | os.PathLike[str],
                 *, lfs: bool | None = None, sha256: str | None = None,
                 **faults: Any) -> HubFile:
        """Add a file (bytes, or a path streamed from disk) to a repo, creating the repo."""
        repo = self.repos.get(repo_id) or self.add_repo(repo_id)
        if isinstance(content, bytes | bytearray):
            source: bytes | Path = bytes(content)
            size = len(source)
        else:
            source = Path(content)
            size = source.stat().st_size
        if lfs is None:
            lfs = filename.lower().endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE
        with self._lock:
            f = HubFile(repo_id, filename, source, size, lfs, id=len(self._by_id) + 1,
                        _sha256=sha256.lower() if sha256 else None, _hub=self)
            for key, value in faults.items():
                if key not in FAULTS:
                    raise TypeError(f"unknown fault {key!r} (one of {', '.join(FAULTS)})")
                setattr(f, key, value)
            self._by_id[f.id] = f
            repo.files[filename] = f
        return f

    def file(self, repo_id: str, filename: str) -> HubFile:
        return self.repos[repo_id].files[filename]

    def remove_file(self, repo_id: str, filename: str) -> None:
        with self._lock:
            f = self.repos[repo_id].files.pop(filename)
            self._by_id.pop(f.id, None)

    def file_url(self, repo_id: str, filename: str, revision: str = "main") -> str:
        """What `hf_hub_url(repo_id, filename, revision=..., endpoint=hub.url)` returns."""
        return f"{self.url}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(filename)}"

    # -- lifecycle ----------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("HubServer not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        if self._httpd is not None:
            return self
        httpd = _Server(("127.0.0.1", 0), _Handler)
        httpd.hub = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hubserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.close_connections()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_idle(self, timeout: float = 60) -> None:
        """Returns once no request is being answered (every response written, its counters
        counted); raises TimeoutError if one is still going after `timeout` seconds."""
        with self._answered:
            if not self._answered.wait_for(lambda: self._answering == 0, timeout):
                raise TimeoutError(f"the fake Hub still answers {self._answering} request(s)")

    # -- used by the handler ------------------------------------------------------------

    def _begin(self) -> None:
        with self._answered:
            self._answering += 1

    def _end(self) -> None:
        with self._answered:
            self._answering -= 1
            self._answered.notify_all()

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)

    def _count(self, f: HubFile, **delta: int) -> None:
        with f._lock:
            for key, n in delta.items():
                setattr(f, key, getattr(f, key) + n)


@contextlib.contextmanager
def serve_hub(**kwargs: Any) -> Iterator[HubServer]:
    """`with serve_hub(token=...) as hub:` a started HubServer, stopped on exit."""
    hub = HubServer(**kwargs)
    with hub:
        yield hub


def use_hub(monkeypatch: Any, hub: HubServer | str) -> str:
    """Point huggingface_hub (and `HF_ENDPOINT`) at the server for one test; returns its URL.

    Also unsets `HF_HUB_OFFLINE`/`HF_TOKEN` and hides the token file, so that a developer's own
    login never reaches the fake Hub and auth tests see exactly the token they pass."""
    from huggingface_hub import constants, hf_api

    url = (hub if isinstance(hub, str) else hub.url).rstrip("/")
    monkeypatch.setenv("HF_ENDPOINT", url)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH",
                        os.path.join(tempfile.gettempdir(), f"hubserver-no-token-{uuid.uuid4()}"))
    monkeypatch.setattr(hf_api.api, "endpoint", url)
    return url


# -- HTTP plumbing ----------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End idle keep-alive connections so their handler threads exit."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-hub"
    timeout = 30
    server: _Server

    def setup(self) -> None:
        super().setup()
        # headers and body go out as separate writes: without this, Nagle + delayed ACK
        # add ~40 ms to every small keep-alive response
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    # -- routing --------------------------------------------------------------------------

    def _dispatch(self) -> None:
        self.hub._begin()
        try:
            self._answer()
        finally:
            self.hub._end()

    def _answer(self) -> None:
        self.body = b""
        if self.command == "POST":
            n = int(self.headers.get("Content-Length") or 0)
            self.body = self.rfile.read(n) if n else b""
        self.hub._record(Request(self.command, self.path,
                                 {k.lower(): v for k, v in self.headers.items()}))
        split = urlsplit(self.path)
        self.query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        segs = split.path.split("/")[1:]
        try:
            if segs[:1] == ["_cdn"] and len(segs) >= 2:
                return self._cdn(segs[1])
            if not self._authorized():
                return
            if segs[:1] == ["api"] and len(segs) >= 3:
                return self._api(segs[1], segs[2:])
            # `org/name/resolve/rev/file` or `name/resolve/rev/file`; prefer a known repo
            found = [n for n in (2, 1) if len(segs) > n + 2 and segs[n] == "resolve"]
            known = [n for n in found if "/".join(map(unquote, segs[:n])) in self.hub.repos]
            if found:
                n = (known or found)[0]
                return self._resolve("/".join(map(unquote, segs[:n])), unquote(segs[n + 1]),
                                     unquote("/".join(segs[n + 2:])))
            self._error(404, None, "Not Found")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _authorized(self) -> bool:
        token = self.hub.token
        if token is None:
            return True
        auth = self.headers.get("Authorization")
        if auth is None or not auth.startswith("Bearer "):
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return False
        if auth != f"Bearer {token}":
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        return True

    def _find_repo(self, segs: list[str], keywords: tuple[str, ...]
                   ) -> tuple[HubRepo | None, list[str]]:
        """Split `org/name/<keyword>/...` (or `name/<keyword>/...`) into repo and the rest."""
        for n in (2, 1):
            if len(segs) >= n and (len(segs) == n or segs[n] in keywords):
                repo_id = "/".join(unquote(s) for s in segs[:n])
                if repo_id in self.hub.repos:
                    return self.hub.repos[repo_id], segs[n:]
        return None, []

    def _api(self, kind: str, segs: list[str]) -> None:
        repo, rest = self._find_repo(segs, ("revision", "tree", "paths-info"))
        if kind != "models" or repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if not rest and self.command == "GET":
            return self._model_info(repo, None)
        if len(rest) < 2:
            return self._error(404, None, "Not Found")
        rev = unquote(rest[1])
        if not repo.has_revision(rev):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if rest[0] == "revision" and len(rest) == 2 and self.command == "GET":
            return self._model_info(repo, rev)
        if rest[0] == "tree" and self.command == "GET":
            return self._tree(repo, rev, unquote("/".join(rest[2:])).strip("/"))
        if rest[0] == "paths-info" and len(rest) == 2 and self.command == "POST":
            return self._paths_info(repo)
        self._error(404, None, "Not Found")

    # -- API endpoints --------------------------------------------------------------------

    def _model_info(self, repo: HubRepo, rev: str | None) -> None:
        blobs = self.query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for f in repo.files.values():
            s: dict[str, Any] = {"rfilename": f.rfilename}
            if blobs:
                s.update(blobId=f.git_oid, size=f.size)
                if f.lfs:
                    s["lfs"] = {"sha256": f.advertised_sha256, "size": f.size,
                                "pointerSize": len(f.pointer)}
            siblings.append(s)
        author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        data: dict[str, Any] = {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id, "modelId": repo.repo_id, "author": author, "sha": repo.sha,
            "lastModified": DATE, "createdAt": DATE, "private": self.hub.token is not None,
            "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "siblings": siblings, "spaces": [],
            "usedStorage": sum(f.size for f in repo.files.values()),
        }
        data.update(repo.info)
        self._json(200, data)

    def _entry(self, repo: HubRepo, path: str, expand: bool) -> dict[str, Any]:
        f = repo.files.get(path)
        if f is None:
            oid = hashlib.sha1(path.encode()).hexdigest()
            e: dict[str, Any] = {"type": "directory", "oid": oid, "size": 0, "path": path}
        else:
            e = {"type": "file", "oid": f.git_oid, "size": f.size, "path": f.rfilename}
            if f.lfs:
                e["lfs"] = {"oid": f.advertised_sha256, "size": f.size,
                            "pointerSize": len(f.pointer)}
            if expand:
                e["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False,
                                           "virusNames": None}, "pickleImportScan": None}
        if expand:
            e["lastCommit"] = {"id": repo.sha, "title": "Upload", "date": DATE}
        return e

    def _dirs(self, repo: HubRepo) -> set[str]:
        dirs = set()
        for name in repo.files:
            if not _unsafe_name(name):
                parts = name.split("/")
                dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        return dirs

    def _tree(self, repo: HubRepo, rev: str, path: str) -> None:
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        expand = self.query.get("expand", "").lower() in ("1", "true")
        dirs = self._dirs(repo)
        if path and path not in dirs:
            return self._error(404, "EntryNotFound", f"{path} does not exist on \"{rev}\"",
                               commit=repo.sha)
        prefix = f"{path}/" if path else ""
        names: list[str] = []
        for name in sorted(dirs | set(repo.files)):
            if name in repo.files and _unsafe_name(name):
                if not path:
                    names.append(name)  # hostile names: listed verbatim at the root
                continue
            if not name.startswith(prefix):
                continue
            if recursive or "/" not in name[len(prefix):]:
                names.append(name)
        start = int(self.query.get("cursor") or 0)
        page = self.hub.tree_page_size or len(names) or 1
        headers = {}
        if start + page < len(names):
            query = {k: v for k, v in self.query.items() if k != "cursor"}
            query["cursor"] = str(start + page)
            next_url = f"{self.hub.url}{urlsplit(self.path).path}?{urlencode(query)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._json(200, [self._entry(repo, n, expand) for n in names[start:start + page]],
                   headers)

    def _paths_info(self, repo: HubRepo) -> None:
        ctype = self.headers.get("Content-Type", "")
        if ctype.startswith("application/json"):
            form = json.loads(self.body or b"{}")
            paths = form.get("paths") or []
            expand = bool(form.get("expand"))
        else:
            parsed = parse_qs(self.body.decode())
            paths = parsed.get("paths", [])
            expand = parsed.get("expand", ["false"])[-1].lower() in ("1", "true")
        dirs = self._dirs(repo)
        out = [self._entry(repo, p, expand) for p in paths if p in repo.files or p in dirs]
        self._json(200, out)

    # -- file bytes ---------------------------------------------------------------------

    def _resolve(self, repo_id: str, rev: str, filename: str) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if not repo.has_revision(rev):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        f = repo.files.get(filename)
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found", commit=repo.sha)
        headers = {"X-Repo-Commit": repo.sha, "ETag": f.etag, "Accept-Ranges": "bytes"}
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.advertised_sha256}"'
            headers["X-Linked-Size"] = str(f.size)
        if f.lfs and self.hub.lfs_redirect:
            self.hub._count(f, redirects=1)
            location = (f"http://{self.hub.cdn_host}:{self.hub.port}/_cdn/{f.id}/"
                        f"{quote(f.rfilename.rsplit('/', 1)[-1])}")
            body = f"Found. Redirecting to {location}".encode()
            headers.update({"Location": location, "Content-Type": "text/plain; charset=utf-8"})
            return self._send(302, headers, body)
        self._serve_file(f, headers)

    def _cdn(self, file_id: str) -> None:
        f = self.hub._by_id.get(int(file_id)) if file_id.isdigit() else None
        if f is None:
            return self._send(404, {"Content-Type": "text/plain"}, b"NoSuchKey")
        self._serve_file(f, {"ETag": f'"{f.advertised_sha256}"', "Accept-Ranges": "bytes"})

    def _serve_file(self, f: HubFile, headers: dict[str, str]) -> None:
        name = f.rfilename.rsplit("/", 1)[-1]
        headers["Content-Type"] = "application/octet-stream"
        headers["Content-Disposition"] = (f"attachment; filename*=UTF-8''{quote(name)}; "
                                          f'filename="{name}";')
        if self.command == "HEAD":
            self.hub._count(f, heads=1)
            headers["Content-Length"] = str(f.size)
            return self._send(200, headers, None)
        range_header = self.headers.get("Range")
        with f._lock:
            f.gets += 1
            f.ranges.append(range_header)
            fail = f.fail_status if f.fail_times is None or f.fail_times > 0 else None
            if fail is not None and f.fail_times is not None:
                f.fail_times -= 1
            cut_after = f.cut_after if f.cut_times is None or f.cut_times > 0 else None
            corrupt, delay, ignore_range = f.corrupt, f.delay, f.ignore_range
            extra_bytes, hide_length = f.extra_bytes, f.hide_length
        if fail is not None:
            return self._error(fail, None, f"injected HTTP {fail}")
        start, length, status = 0, f.size, 200
        if range_header and not ignore_range:
            parsed = _parse_range(range_header, f.size)
            if parsed == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{f.size}"
                headers["Content-Type"] = "text/plain"
                return self._send(416, headers, b"Requested Range Not Satisfiable")
            if parsed is not None:
                start, end = parsed
                length, status = end - start + 1, 206
                headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        extra = extra_bytes if start + length == f.size else 0
        if hide_length:
            self.close_connection = True  # the end of the body is the end of the connection
        else:
            headers["Content-Length"] = str(length + extra)
        self._send(status, headers, None)
        to_send = length
        if cut_after is not None and cut_after < length:
            to_send = cut_after
        flip = f.size // 2 if corrupt else -1
        pos = start
        for chunk in f.read(start, to_send, self.hub.chunk_size):
            if delay:
                time.sleep(delay)
            if pos <= flip < pos + len(chunk):
                buf = bytearray(chunk)
                buf[flip - pos] ^= 0xFF
                chunk = bytes(buf)
            self.wfile.write(chunk)
            pos += len(chunk)
            self.hub._count(f, bytes_sent=len(chunk))
        if to_send == length:
            for done in range(0, extra, self.hub.chunk_size):
                n = min(self.hub.chunk_size, extra - done)
                self.wfile.write(bytes(n))
                self.hub._count(f, bytes_sent=n)
        self.wfile.flush()
        if to_send < length:
            with f._lock:
                f.cuts += 1
                if f.cut_times is not None:
                    f.cut_times -= 1
            self.close_connection = True  # EOF before Content-Length bytes: a dropped download

    # -- responses ----------------------------------------------------------------------

    def _send(self, status: int, headers: dict[str, str], body: bytes | None) -> None:
        self.send_response(status)
        if body is not None:
            headers.setdefault("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if body is not None and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self._send(status, {"Content-Type": "application/json; charset=utf-8", **(headers or {})},
                   body)

    def _error(self, status: int, code: str | None, message: str, *,
               commit: str | None = None) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if commit:
            headers["X-Repo-Commit"] = commit
        self._json(status, {"error": message}, headers)


def _parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(start, end) inclusive, "unsatisfiable", or None to ignore the header (serve 200)."""
    m = _RANGE.fullmatch(header)
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.groups()
    if first:
        start = int(first)
        end = int(last) if last else size - 1
        if start >= size:
            return "unsatisfiable"
        if end < start:
            return None
        return start, min(end, size - 1)
    suffix = int(last)
    if suffix == 0 or size == 0:
        return "unsatisfiable"
    return max(0, size - suffix), size - 1
