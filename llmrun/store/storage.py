"""The store's files and the table of names over them: blobs and manifests under LLMRUN_HOME,
the lock every change takes, reading and writing manifests (get, list, put, copy, remove),
the files a model loads, and their upkeep (verify, prune). What builds on it (create.py,
fetch.py, describe.py) takes a `Storage`; `llmrun.store.store.Store` puts them together."""

from __future__ import annotations

import builtins
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from llmrun import config
from llmrun.store import gguf, names
from llmrun.store.blobs import Blobs
from llmrun.store.errors import ModelNotFound, StoreError
from llmrun.store.manifests import Manifest, Manifests
from llmrun.store.names import ModelName

log = logging.getLogger(__name__)

# what create and pull report as they go: (status, completed, total)
Progress = Callable[[str, int, int], None]

ORPHAN_AGE = 24 * 3600.0  # an unreferenced blob younger than this may be a create in progress
TEMP_AGE = 3600.0  # a temporary file untouched this long belongs to a write that died


class Storage:
    def __init__(self, home: Path | None = None) -> None:
        self.home = home or config.home()
        self.blobs = Blobs(self.home / "blobs")
        self.manifests = Manifests(self.home / "manifests")
        config.make_private(self.home)
        # One lock for every change to manifests and for garbage collection of blobs, so a
        # `rm` never deletes a blob that a concurrent `create` is about to reference.
        self.lock = FileLock(self.home / "store.lock")
        # what a projector says of sound pieces, by its blob's digest (blobs never change):
        # read once per projector (its GGUF header), since every load's spec asks for it
        self._sound_pieces: dict[str, float | None] = {}

    # -- reading --------------------------------------------------------------------------

    def get(self, name: str | ModelName) -> tuple[ModelName, Manifest]:
        parsed = names.parse(name) if isinstance(name, str) else name
        manifest = self.manifests.get(parsed)
        if manifest is None:
            raise ModelNotFound(parsed.short)
        return parsed, manifest

    def list(self) -> list[Manifest]:
        return sorted(self.manifests.all(), key=lambda m: m.modified_at, reverse=True)

    def store_digests(self) -> None:
        """Give manifests of older versions their stored digest (store/listing.py), when the
        store is free: a busy store or a read-only one is left for another time."""
        try:
            with self.lock.acquire(timeout=0.1):
                self.manifests.store_digests()
        except (Timeout, OSError) as exc:
            log.debug("manifests left without their digest: %s", exc)

    def model_path(self, manifest: Manifest) -> Path:
        return self.blobs.path(manifest.layer.digest)

    def projector_path(self, manifest: Manifest) -> Path | None:
        """The vision projector (mmproj GGUF) a runner loads beside the model, if it has one."""
        if manifest.projector is None:
            return None
        return self.blobs.path(manifest.projector.digest)

    def model_paths(self, manifest: Manifest) -> builtins.list[Path]:
        """The GGUF file(s) to load, in order (several for a split model)."""
        return [self.blobs.path(x.digest) for x in (manifest.layer, *manifest.parts)]

    def adapter_paths(self, manifest: Manifest) -> builtins.list[Path]:
        """The LoRA adapter GGUF files to apply on top of the model, in order."""
        return [self.blobs.path(x.digest) for x in manifest.adapters]

    # -- writing --------------------------------------------------------------------------

    def put(self, name: ModelName, manifest: Manifest) -> Manifest:
        """Write `manifest` as `name`, once every blob it names is in the store."""
        manifest = manifest.model_copy(update={"name": str(name)})
        with self.lock:
            for digest in manifest.digests():
                if not self.blobs.exists(digest):
                    raise StoreError(f"blob {digest} vanished before the manifest was written")
            self.manifests.put(name, manifest)
        return manifest

    def remove(self, name: str) -> None:
        parsed, manifest = self.get(name)
        with self.lock:
            self.manifests.delete(parsed)
            in_use = set().union(*(m.digests() for m in self.manifests.all()))
            for digest in manifest.digests() - in_use:
                self.blobs.remove(digest)

    def copy(self, src: str, dst: str) -> Manifest:
        _, manifest = self.get(src)
        return self.put(names.parse(dst), manifest)

    def remove_unreferenced(self, digest: str) -> None:
        """Remove a blob unless a manifest names it (one a failed create or pull imported)."""
        with self.lock:
            if not any(digest in m.digests() for m in self.manifests.all()):
                self.blobs.remove(digest)

    # -- what the projector says -----------------------------------------------------------

    def sound_piece_seconds(self, manifest: Manifest) -> float | None:
        """The length of sound the model's projector encodes on its own (None: whole, or
        no audio projector), from its GGUF (media.SOUND_PIECE_SECONDS)."""
        layer = manifest.projector
        if layer is None:
            return None
        if layer.digest not in self._sound_pieces:
            path = self.blobs.path(layer.digest)
            self._sound_pieces[layer.digest] = gguf.read(path).sound_piece_seconds
        return self._sound_pieces[layer.digest]

    # -- upkeep ---------------------------------------------------------------------------

    def verify(self, manifest: Manifest) -> None:
        """Refuse a model whose blobs are missing or no longer hash to their names."""
        for layer in manifest.layers:
            path = self.blobs.path(layer.digest)
            if not path.is_file():
                raise StoreError(f"{manifest.name}: blob {layer.digest} is missing; pull or "
                                 "create the model again")
            if path.stat().st_size != layer.size or _file_digest(path) != layer.digest:
                raise StoreError(f"{manifest.name}: blob {layer.digest} was modified on disk "
                                 "(its content no longer matches its digest); pull or create "
                                 "the model again")

    def prune(self, orphan_age: float = ORPHAN_AGE,
              temp_age: float = TEMP_AGE) -> builtins.list[str]:
        """Remove blobs no manifest mentions once they are `orphan_age` seconds old (uploads
        nobody created a model from; a younger one may belong to a create in progress), and
        temporary files left by writes that died (untouched for `temp_age`; a resumable pull's
        `.partial` is kept for `orphan_age`). Returns the names removed. Run at daemon start."""
        now = time.time()
        removed: list[str] = []

        def drop(path: Path, age: float) -> None:
            try:
                if now - path.stat().st_mtime >= age:
                    path.unlink()
                    removed.append(path.name)
            except FileNotFoundError:
                pass  # finished or cleaned by someone else meanwhile
            except OSError as exc:  # never a reason to keep the daemon from starting
                log.warning("cannot remove %s: %s", path.name, exc.strerror or exc)

        with self.lock:  # no manifest can start referencing a blob while we decide
            for digest in self.blobs.digests() - self.manifests.referenced():
                drop(self.blobs.path(digest), orphan_age)
        for path in self.blobs.leftovers():
            drop(path, orphan_age if path.name.startswith("sha256-") else temp_age)
        if removed:
            log.info("removed %d unreferenced blob(s) and stale temporary file(s)", len(removed))
        return removed


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
