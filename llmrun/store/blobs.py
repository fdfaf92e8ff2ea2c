"""Content-addressed blobs: `LLMRUN_HOME/blobs/sha256-<64 hex>`.

A digest is the only thing that ever becomes a file name here, and it is checked against a
strict pattern first: a digest such as `sha256:../../etc/passwd` is how Ollama's path
traversal (CVE-2024-37032) happened. Every write goes to a temporary file in the same folder
and is renamed into place only once its hash is known, so a crash never leaves a
half-written blob under a real name.
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


from llmrun.store.errors import DigestError  # noqa: E402  (re-exported)


def parse_digest(digest: str) -> str:
    """Return the 64 hex characters of `sha256:<hex>` or `sha256-<hex>`; refuse anything else."""
    m = _DIGEST.fullmatch(digest)
    if not m:
        raise DigestError(f"invalid digest {digest!r}: expected sha256:<64 lowercase hex>")
    return m.group(1)


class BlobWriter:
    """Hashes bytes as they are written; see `Blobs.writer`."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self._fh.write(data)
        self._hash.update(data)
        self.size += len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


class Blobs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        return self.root / f"sha256-{parse_digest(digest)}"

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    @contextmanager
    def writer(self, expected: str | None = None) -> Iterator[BlobWriter]:
        """Write a new blob; on success it is renamed to its digest, on any error removed.

        With `expected`, data that hashes differently is refused (DigestError) and discarded.
        """
        if expected is not None:
            parse_digest(expected)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".incoming-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as fh:
                w = BlobWriter(fh)
                yield w
                fh.flush()
                os.fsync(fh.fileno())
            if expected is not None and expected.replace("-", ":", 1) != w.digest:
                raise DigestError(f"digest mismatch: expected {expected}, got {w.digest}")
            os.replace(tmp, self.path(w.digest))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

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
