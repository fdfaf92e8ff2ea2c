"""The model store: blobs + manifests under LLMRUN_HOME, the table of names over them (get,
list, copy, remove, the files a model loads), and their upkeep (verify, prune). `create`
(create.py), `pull` (fetch.py) and what `show` describes (describe.py) work on a `Store`
through the methods here. `llmrun.store` re-exports `Store` and the errors; `llmrun list`
reads the manifests through `llmrun.store.listing` instead, without this module's imports."""

from __future__ import annotations

import builtins
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from filelock import FileLock, Timeout

from llmrun import config
from llmrun.store import create as creating
from llmrun.store import describe, gguf, modelfile, names
from llmrun.store.blobs import Blobs
from llmrun.store.describe import capabilities, human_params
from llmrun.store.errors import ModelNotFound, StoreError
from llmrun.store.manifests import Layer, Manifest, Manifests
from llmrun.store.names import ModelName
from llmrun.store.references import HOST_PATH_REFUSED, REMOTE_REFUSED, refuse_host_paths

# What other modules import from here, where these lived before create.py, describe.py and
# references.py took them.
__all__ = ["HOST_PATH_REFUSED", "ORPHAN_AGE", "REMOTE_REFUSED", "TEMP_AGE", "Progress",
           "Store", "human_params", "refuse_host_paths"]

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (status, completed, total)

ORPHAN_AGE = 24 * 3600.0  # an unreferenced blob younger than this may be a create in progress
TEMP_AGE = 3600.0  # a temporary file untouched this long belongs to a write that died


class Store:
    def __init__(self, home: Path | None = None) -> None:
        self.home = home or config.home()
        self.blobs = Blobs(self.home / "blobs")
        self.manifests = Manifests(self.home / "manifests")
        config.make_private(self.home)
        # One lock for every change to manifests and for garbage collection of blobs, so a
        # `rm` never deletes a blob that a concurrent `create` is about to reference.
        self.lock = FileLock(self.home / "store.lock")
        # what a projector says of sound pieces, by its blob's digest (blobs never change):
        # read once, not with every request's runner spec (scheduler.spec_for)
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

    def import_gguf(self, path: Path) -> tuple[Layer, gguf.GGUFInfo]:
        """Validate a local GGUF file, then copy it into the blob store."""
        return creating.import_gguf(self, path)

    def create(self, name: str, source: str | modelfile.Modelfile,
               base_dir: Path | None = None, progress: Progress | None = None,
               quantize: str | None = None, allow_paths: bool = True,
               allow_remote: bool = True) -> Manifest:
        """Create `name` from a Modelfile: store/create.py's `create` says what FROM may
        name and what `allow_paths` and `allow_remote` refuse."""
        return creating.create(self, name, source, base_dir, progress, quantize,
                               allow_paths, allow_remote)

    def pull(self, name: str, progress: Progress | None = None) -> Manifest:
        """Fetch a model: `hf.co/org/repo[:quant]`, or a catalog name from its sources."""
        from llmrun.store import fetch  # (httpx and huggingface_hub: only when pulling)

        return fetch.pull(self, name, progress)

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

    # -- what `show` says -----------------------------------------------------------------

    def modelfile_of(self, manifest: Manifest) -> modelfile.Modelfile:
        """The model as a Modelfile (what `show --modelfile` prints)."""
        return describe.modelfile_of(self, manifest)

    def template_of(self, manifest: Manifest) -> str:
        """The chat template the model renders with: the Modelfile's, else its GGUF's."""
        return describe.template_of(self, manifest)

    def model_info(self, manifest: Manifest) -> dict[str, object]:
        """The GGUF's scalar metadata (arrays shown by length), as Ollama's `model_info`;
        for a remote model, where it is served."""
        return describe.model_info(self, manifest)

    def projector_info(self, manifest: Manifest) -> dict[str, object] | None:
        """The vision projector's metadata, as model_info (Ollama's `projector_info`)."""
        return describe.projector_info(self, manifest)

    def capabilities(self, manifest: Manifest,
                     info: Mapping[str, object] | None = None) -> builtins.list[str]:
        """What clients may ask of the model (`show`; Open WebUI and VS Code read it)."""
        info = self.model_info(manifest) if info is None else info
        modalities = self.projector_modalities(manifest)
        return capabilities(self.template_of(manifest), info,
                            vision="vision" in modalities, audio="audio" in modalities,
                            rerank=manifest.options().reranks())

    def projector_modalities(self, manifest: Manifest) -> builtins.list[str]:
        """What the model's projector encodes ("vision", "audio"), from its GGUF."""
        return describe.projector_modalities(self, manifest)

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
