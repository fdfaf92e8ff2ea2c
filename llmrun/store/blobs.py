"""Content-addressed blobs: `LLMRUN_HOME/blobs/sha256-<64 hex>`.

A digest is the only thing that ever becomes a file name here, and it is checked against a
strict pattern first: a digest such as `sha256:../../etc/passwd` is how Ollama's path
traversal (CVE-2024-37032) happened. Every write goes to a temporary file in the same folder
and is renamed into place only once its hash is known, so a crash never leaves a
half-written blob under a real name.

Temporary files are dot-files in the blobs folder (`.incoming-*` for writes, `.quantize-*`,
`.pull-*`), plus `sha256-<hex>.partial` for a pull that can resume; `leftovers()` lists them
so the store can remove the ones a crash left behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
CHUNK = 1 << 20


from llmrun.store.errors import BlobTooLarge, DigestError  # noqa: E402  (re-exported)


def parse_digest(digest: str) -> str:
    """Return the 64 hex characters of `sha256:<hex>` or `sha256-<hex>`; refuse anything else."""
    m = _DIGEST.fullmatch(digest)
    if not m:
        raise DigestError(f"invalid digest {digest!r}: expected sha256:<64 lowercase hex>")
    return m.group(1)


class BlobWriter:
    """Hashes bytes as they are written, refusing to grow past `limit`; see `Blobs.writer`."""

    def __init__(self, fh: BinaryIO, limit: int | None = None) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self.limit = limit
        self.size = 0

    def write(self, data: bytes) -> None:
        # checked before writing, so a refused blob never puts more than `limit` bytes on disk
        if self.limit is not None and self.size + len(data) > self.limit:
            raise BlobTooLarge(f"blob is larger than the limit of {self.limit} bytes "
                               "(LLMRUN_MAX_BLOB_SIZE)")
        self._fh.write(data)
        self._hash.update(data)
        self.size += len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


class Incoming(BlobWriter):
    """A blob being written to a temporary file: `write` as bytes arrive, then `commit`
    (fsync, check the digest, rename into place) or `discard`. For callers that cannot keep
    a `with` block around their writes (an async upload commits in a worker thread)."""

    def __init__(self, blobs: Blobs, tmp: Path, fh: BinaryIO, expected: str | None,
                 limit: int | None) -> None:
        super().__init__(fh, limit)
        self._blobs = blobs
        self.tmp = tmp
        self.expected = expected
        self._done = False

    def commit(self) -> str:
        """Make the blob visible under its digest; on any failure nothing is left."""
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            if self.expected is not None and self.expected.replace("-", ":", 1) != self.digest:
                raise DigestError(f"digest mismatch: expected {self.expected}, got {self.digest}")
            os.replace(self.tmp, self._blobs.path(self.digest))
            self._done = True
        finally:
            self.discard()
        return self.digest

    def discard(self) -> None:
        """Remove the temporary file (a no-op once committed or discarded)."""
        if self._done:
            return
        self._done = True
        self._fh.close()
        self.tmp.unlink(missing_ok=True)


class Blobs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        return self.root / f"sha256-{parse_digest(digest)}"

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    def incoming(self, expected: str | None = None, limit: int | None = None) -> Incoming:
        """Start a new blob in a temporary file; the caller must `commit` or `discard` it."""
        if expected is not None:
            parse_digest(expected)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".incoming-", dir=self.root)
        return Incoming(self, Path(tmp), os.fdopen(fd, "wb"), expected, limit)

    @contextmanager
    def writer(self, expected: str | None = None,
               limit: int | None = None) -> Iterator[Incoming]:
        """Write a new blob; on success it is renamed to its digest, on any error removed.

        With `expected`, data that hashes differently is refused (DigestError) and discarded;
        with `limit`, a write past that many bytes raises BlobTooLarge.
        """
        w = self.incoming(expected, limit)
        try:
            yield w
            w.commit()
        finally:
            w.discard()

    def import_file(self, src: Path) -> tuple[str, int]:
        """Copy a file into the store, hashing as it copies. Returns (digest, size)."""
        with open(src, "rb") as fh, self.writer() as w:
            while chunk := fh.read(CHUNK):
                w.write(chunk)
        return w.digest, w.size

    def adopt(self, path: Path) -> tuple[str, int]:
        """Move a finished file (already in this folder) into the store under its digest."""
        h = hashlib.sha256()
        size = 0
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
        digest = "sha256:" + h.hexdigest()
        os.replace(path, self.path(digest))
        return digest, size

    def remove(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def digests(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        out = set()
        for p in self.root.iterdir():
            if _DIGEST.fullmatch(p.name):
                out.add("sha256:" + p.name[7:])
        return out

    def leftovers(self) -> list[Path]:
        """Temporary files of writes and pulls (finished or not; lock files excluded)."""
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir()
                if not p.name.endswith(".lock") and not _DIGEST.fullmatch(p.name)
                and (p.name.startswith(".") or p.name.endswith(".partial")) and p.is_file()]
