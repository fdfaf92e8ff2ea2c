"""Pulling GGUF files from Hugging Face into the blob store: resumable, verified, atomic.

huggingface_hub does what it is good at: listing a repo's files with their LFS sha256,
building URLs and auth headers, honouring HF_ENDPOINT / HF_TOKEN / HF_HUB_OFFLINE. The bytes
we move ourselves, because (measured with huggingface_hub 2.4) it checks only the byte count
of a download, never its sha256, and deletes its temporary file when a download fails, so a
dropped connection means starting over. Here:

- bytes stream into `blobs/sha256-<hex>.partial`, hashed as they arrive (no second read);
- an interrupted pull resumes with a Range request from the partial's length;
- a finished file whose hash differs from the Hub's (or the catalog's) is deleted and the
  pull fails saying so; a good one is renamed to its digest name;
- a file lock per blob makes two pulls of the same file wait for each other instead of
  writing the same partial; the manifest is written last, by the caller;
- nothing is received past the expected size (the Hub's, or the catalog's; with none,
  LLMRUN_MAX_BLOB_SIZE): a server that sends more is refused and its bytes deleted, so a
  partial file is never larger than the file it stands for.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import httpx
from filelock import FileLock

from llmrun import config
from llmrun.store.blobs import Blobs, DigestError, parse_digest

Progress = Callable[[str, int, int], None]
CHUNK = 1 << 20
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "IQ4_XS",
                  "Q3_K_M", "Q3_K_L", "Q2_K", "BF16", "F16", "F32")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])",
                    re.IGNORECASE)


from llmrun.store.errors import PullError  # noqa: E402  (re-exported)


@dataclass(frozen=True)
class RemoteFile:
    repo: str
    path: str  # path inside the repo
    size: int
    sha256: str | None
    revision: str = "main"


def _endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _hub_transport_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub 2.x talks through `httpx2`, whose errors are not httpx's."""
    try:
        import httpx2
    except ImportError:
        return ()
    return (httpx2.HTTPError,)


def safe_repo_path(path: str) -> bool:
    """A repo file name we are willing to look at: relative, no `..`, no backslashes."""
    if not path or "\\" in path or path.startswith("/") or "\x00" in path:
        return False
    return ".." not in PurePosixPath(path).parts


def quant_of(filename: str) -> str | None:
    """The quantization named in a GGUF file name (`...-Q4_K_M.gguf` -> `Q4_K_M`)."""
    stem = _SPLIT.sub(".gguf", PurePosixPath(filename).name)
    found = _QUANT.findall(stem.removesuffix(".gguf"))
    return found[-1].upper() if found else None


def list_gguf(repo: str, revision: str | None = None) -> list[RemoteFile]:
    """The repo's .gguf model files (projector files excluded) with their sizes and sha256."""
    return list_repo(repo, revision)[0]


def list_repo(repo: str, revision: str | None = None,
              ) -> tuple[list[RemoteFile], list[RemoteFile]]:
    """The repo's .gguf files with their sizes and sha256, in one listing: (model files,
    vision projector files). Repos mark projectors `mmproj` in the name (llama.cpp's `-hf`
    relies on it too); the name only sorts the listing, the downloaded file's header is
    what makes it a projector."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if _offline():
        raise PullError("HF_HUB_OFFLINE is set: cannot reach Hugging Face to pull")
    api = HfApi(endpoint=_endpoint(), token=_token())
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except RepositoryNotFoundError:
        raise PullError(f"Hugging Face repo '{repo}' not found (or it needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise PullError(f"revision '{revision}' not found in '{repo}'") from None
    # (mypy reads no starred tuple of exception types; evaluated only when one is raised)
    except (HfHubHTTPError, httpx.HTTPError, OSError,  # type: ignore[misc]
            *_hub_transport_errors()) as exc:
        raise PullError(f"cannot list '{repo}' on Hugging Face: {exc}") from None
    files: list[RemoteFile] = []
    projectors: list[RemoteFile] = []
    for s in info.siblings or []:
        name = s.rfilename
        if not name.lower().endswith(".gguf"):
            continue
        if not safe_repo_path(name):
            continue  # a hostile listing: never let a remote name near the file system
        lfs = s.lfs
        sha = lfs.sha256 if lfs is not None else None
        size = lfs.size if lfs is not None else (s.size or 0)
        found = RemoteFile(repo, name, int(size or 0), sha, info.sha or revision or "main")
        (projectors if _is_projector_name(name) else files).append(found)
    if not files:
        raise PullError(f"Hugging Face repo '{repo}' has no GGUF files")
    return files, projectors


def _is_projector_name(path: str) -> bool:
    return "mmproj" in PurePosixPath(path).name.lower()


def choose_projector(projectors: list[RemoteFile], model: RemoteFile,
                     ) -> tuple[RemoteFile | None, str]:
    """The projector to fetch with `model`, and why (None: the repo has none).

    llama-server's `-hf` takes the one the Hub's manifest API names; that API is not the
    listing we read, so the choice is made here, to the same end: the projector that goes
    with the model file chosen. In order: one in the model's quantization (Q8_0 with Q8_0);
    else one of the same precision family (Q4_0 with Q4_K_M; F16 with BF16: the bits per
    weight the user chose); else F16, the precision projectors are made in and the one every
    repo offers; else the first by name, so the choice never depends on listing order. Ties
    go to F16 (BF16 model, F16 and F32 projectors: F16)."""
    if not projectors:
        return None, ""
    ordered = sorted(projectors, key=lambda f: (quant_of(f.path) != "F16", f.path))
    quant = quant_of(model.path)
    for f in ordered:
        if quant and quant_of(f.path) == quant:
            return f, f"projector {PurePosixPath(f.path).name} (same quantization)"
    family = _precision_family(quant)
    for f in ordered:
        if family and _precision_family(quant_of(f.path)) == family:
            return f, f"projector {PurePosixPath(f.path).name} (same precision family)"
    for f in ordered:
        if quant_of(f.path) == "F16":
            return f, f"projector {PurePosixPath(f.path).name} (F16)"
    return ordered[0], f"projector {PurePosixPath(ordered[0].path).name}"


def _precision_family(quant: str | None) -> str | None:
    """Q4_K_M, Q4_0 and IQ4_XS are `4` (bits); F16, BF16 and F32 `float`."""
    if quant is None:
        return None
    if quant in ("F16", "BF16", "F32"):
        return "float"
    m = re.match(r"I?Q(\d)", quant)
    return m.group(1) if m else None


def choose(files: list[RemoteFile], tag: str) -> tuple[list[RemoteFile], str]:
    """Pick the file(s) for a tag: a quant name (case-insensitive), or a file name; `latest`
    means Q4_K_M when present, else the first of DEFAULT_QUANTS the repo has. Split files
    (-00001-of-0000N) come back whole and in order. Returns (files, why) for the output."""
    groups: dict[str, list[RemoteFile]] = {}
    for f in files:
        key = _SPLIT.sub(".gguf", f.path)
        groups.setdefault(key, []).append(f)
    by_name = {PurePosixPath(k).name.lower(): k for k in groups}
    by_path = {k.lower(): k for k in groups}
    wanted = tag.lower()
    if wanted in by_path or wanted in by_name or f"{wanted}.gguf" in by_name:
        key = by_path.get(wanted) or by_name.get(wanted) or by_name[f"{wanted}.gguf"]
        return _ordered(groups[key]), f"file {PurePosixPath(key).name}"
    by_quant: dict[str, str] = {}
    for key in groups:
        q = quant_of(key)
        if q and q not in by_quant:
            by_quant[q] = key
    if wanted != "latest":
        if wanted.upper() in by_quant:
            return _ordered(groups[by_quant[wanted.upper()]]), f"quantization {wanted.upper()}"
        have = ", ".join(sorted(by_quant)) or "none recognised"
        raise PullError(f"no GGUF file for tag '{tag}' (available quantizations: {have})")
    for q in DEFAULT_QUANTS:
        if q in by_quant:
            why = "default quantization Q4_K_M" if q == "Q4_K_M" else \
                f"no Q4_K_M in this repo; chose {q}"
            return _ordered(groups[by_quant[q]]), why
    key = min(groups, key=lambda k: sum(f.size for f in groups[k]))
    return _ordered(groups[key]), f"chose the smallest file, {PurePosixPath(key).name}"


def _ordered(parts: list[RemoteFile]) -> list[RemoteFile]:
    if len(parts) == 1 and not _SPLIT.search(parts[0].path):
        return parts
    numbered = []
    for p in parts:
        m = _SPLIT.search(p.path)
        if not m:
            raise PullError(f"{p.path}: not a split GGUF part")
        numbered.append((int(m.group(1)), int(m.group(2)), p))
    numbered.sort(key=lambda t: t[0])
    total = numbered[0][1]
    if [n for n, _, _ in numbered] != list(range(1, total + 1)):
        raise PullError(f"split GGUF {parts[0].path} is missing parts "
                        f"(have {len(numbered)} of {total})")
    return [p for _, _, p in numbered]


def file_url(f: RemoteFile) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(f.repo, f.path, revision=f.revision, endpoint=_endpoint())


def download(blobs: Blobs, url: str, *, sha256: str | None, size: int | None,
             progress: Progress | None = None, label: str = "pulling",
             client: httpx.Client | None = None) -> tuple[str, int]:
    """Download `url` into the store as a blob; returns (digest, size).

    With a known sha256 the download resumes from an existing `.partial` and is verified;
    without one (rare: a non-LFS file) it is hashed and stored under what it hashes to.
    """
    if sha256 is not None:
        expected = f"sha256:{parse_digest('sha256:' + sha256.lower())}"
        if blobs.exists(expected):
            n = blobs.size(expected)
            if progress:
                progress(f"{label} (already here)", n, n)
            return expected, n
        blobs.root.mkdir(parents=True, exist_ok=True)
        final = blobs.path(expected)
        partial = final.with_name(final.name + ".partial")
        with FileLock(str(final) + ".lock"):
            if blobs.exists(expected):  # another pull finished it while we waited
                return expected, blobs.size(expected)
            _fetch(url, partial, size, progress, label, client)
            digest = _hash_file_digest(partial)  # filled by _fetch via the sidecar hash
            if digest != expected:
                partial.unlink(missing_ok=True)
                raise DigestError(f"downloaded file does not match its sha256 (expected "
                                  f"{expected}, got {digest}); the bad download was deleted, "
                                  "pull again")
            os.replace(partial, final)
            return expected, final.stat().st_size
    blobs.root.mkdir(parents=True, exist_ok=True)
    partial = blobs.root / f".pull-{hashlib.sha256(url.encode()).hexdigest()[:16]}.partial"
    with FileLock(str(partial) + ".lock"):
        partial.unlink(missing_ok=True)
        _fetch(url, partial, size, progress, label, client)
        digest = _hash_file_digest(partial)
        os.replace(partial, blobs.path(digest))
        return digest, blobs.size(digest)


# The running hash of each partial file, so resuming within one process does not re-read it.
_hashers: dict[Path, tuple[int, hashlib._Hash]] = {}


def _hash_file_digest(path: Path) -> str:
    state = _hashers.pop(path, None)
    if state is not None and state[0] == path.stat().st_size:
        return "sha256:" + state[1].hexdigest()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _seed_hash(partial: Path) -> tuple[int, hashlib._Hash]:
    """Hash of the bytes already in a partial file (read once, when resuming)."""
    h = hashlib.sha256()
    n = 0
    if partial.exists():
        with open(partial, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                n += len(chunk)
    return n, h


def _too_long(url: str, limit: int, size: int | None) -> PullError:
    what = f"the {limit} bytes expected" if size is not None else \
        f"LLMRUN_MAX_BLOB_SIZE ({limit} bytes)"
    return PullError(f"{httpx.URL(url).host} sent more than {what}; refusing the download "
                     "(nothing was kept)")


def _content_length(r: httpx.Response) -> int:
    try:
        return max(0, int(r.headers.get("content-length") or 0))
    except ValueError:
        return 0  # unusable: the byte count below still bounds the download


def _fetch(url: str, partial: Path, size: int | None, progress: Progress | None, label: str,
           client: httpx.Client | None) -> None:
    from huggingface_hub.utils import build_hf_headers

    limit = size if size is not None else config.max_blob_size()
    have, hasher = _seed_hash(partial)
    if size is not None and have > size:  # not ours to resume: start over
        partial.unlink()
        have, hasher = 0, hashlib.sha256()
    headers = build_hf_headers(token=_token(), library_name="llmrun")
    if have:
        headers["Range"] = f"bytes={have}-"
    own = client is None
    http = client or httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0))
    try:
        if size is not None and have == size:
            _hashers[partial] = (have, hasher)
            return
        with http.stream("GET", url, headers=headers) as r:
            if r.status_code == 416 and size is not None and have == size:
                _hashers[partial] = (have, hasher)
                return
            if r.status_code in (401, 403):
                raise PullError(f"access denied by {httpx.URL(url).host} "
                                "(a gated or private repo: set HF_TOKEN)")
            if r.status_code == 404:
                raise PullError(f"file not found: {url}")
            if r.status_code >= 400:
                raise PullError(f"download failed: HTTP {r.status_code} from {url}")
            mode = "ab"
            if have and r.status_code != 206:  # the server ignored Range: start over
                have, hasher, mode = 0, hashlib.sha256(), "wb"
            announced = have + _content_length(r)
            if announced > limit:  # refused before a byte is written
                if mode == "wb":
                    partial.unlink(missing_ok=True)
                raise _too_long(url, limit, size)
            total = size or announced or 0
            with open(partial, mode) as out:
                for chunk in r.iter_bytes():  # as it arrives: a cut loses nothing written
                    if have + len(chunk) > limit:  # a server that says less than it sends
                        out.close()
                        partial.unlink(missing_ok=True)
                        raise _too_long(url, limit, size)
                    out.write(chunk)
                    hasher.update(chunk)
                    have += len(chunk)
                    if progress:
                        progress(label, have, total)
                out.flush()
                os.fsync(out.fileno())
        if size is not None and have != size:
            raise PullError(f"download ended early ({have} of {size} bytes); pull again to "
                            "resume")
        _hashers[partial] = (have, hasher)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise PullError(f"disk full while writing {partial.parent}: free space and pull "
                            "again to resume (the partial download is kept)") from None
        raise
    except httpx.HTTPError as exc:
        raise PullError(f"download interrupted ({type(exc).__name__}: {exc}); pull again to "
                        f"resume from byte {have}") from None
    finally:
        if own:
            http.close()
