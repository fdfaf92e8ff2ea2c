"""Manifests: one small JSON file per model name, pointing at blobs by digest.

`manifests/<host>/<namespace>/<model>/<tag>`; the path comes only from a validated
`ModelName`. A manifest is written last and atomically, so a model either exists whole or
not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from llmrun.request import Message, Options
from llmrun.store import listing
from llmrun.store.names import ModelName

_DIGEST_TEXT = re.compile(rb"sha256[:-]([0-9a-f]{64})")


class Layer(BaseModel):
    digest: str
    size: int


class Details(BaseModel):
    format: str = "gguf"
    family: str = ""
    parameter_size: str = ""
    quantization_level: str = ""
    context_length: int | None = None


class Remote(BaseModel):
    """A model another server runs (FROM http(s)://...): the base URLs of its
    OpenAI-compatible `/v1` API (replicas, in order), its name there, and the name of the
    key it sends, one the daemon's owner configured (LLMRUN_REMOTE_KEYS; the key itself is
    never stored). `key_env`, an environment variable's name, is what older versions
    wrote: it is sent only if a configured key reads that variable."""

    urls: list[str]
    model: str
    key: str | None = None
    key_env: str | None = None


class Manifest(BaseModel):
    schema_version: int = 1
    name: str
    model: Layer | None = None  # None only for a remote model
    remote: Remote | None = None
    parts: list[Layer] = Field(default_factory=list)  # further files of a split GGUF, in order
    adapters: list[Layer] = Field(default_factory=list)
    # a vision projector (an mmproj GGUF, architecture `clip`) the runner loads beside the model
    projector: Layer | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: list[Message] = Field(default_factory=list)
    license: list[str] = Field(default_factory=list)
    details: Details = Field(default_factory=Details)
    source: str = ""
    modified_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    def options(self) -> Options:
        return Options.model_validate(self.parameters)

    @model_validator(mode="after")
    def _model_or_remote(self) -> Manifest:
        if (self.model is None) == (self.remote is None):
            raise ValueError("a manifest names a model file or a remote server, not both")
        return self

    @property
    def layer(self) -> Layer:
        """The model file's blob (a local model's; a remote model has none)."""
        if self.model is None:
            raise ValueError(f"{self.name} is served by a remote server: it has no model file")
        return self.model

    @property
    def layers(self) -> list[Layer]:
        """Every blob the model needs: model file, its parts, adapters, projector."""
        own = [self.model] if self.model is not None else []
        projector = [self.projector] if self.projector is not None else []
        return [*own, *self.parts, *self.adapters, *projector]

    def digests(self) -> set[str]:
        return {x.digest for x in self.layers}

    @property
    def size(self) -> int:
        return sum(x.size for x in self.layers)

    def serialize(self) -> bytes:
        # the digest goes along (not a field: reading ignores it) so `llmrun list` can show
        # the id without validating the file (store/listing.py)
        body = json.loads(self.model_dump_json())
        body["digest"] = self.digest
        return json.dumps(body, indent=2).encode()

    @property
    def digest(self) -> str:
        """Identity of the content (not the name): same weights and settings, same digest."""
        # without a projector the field is left out, so models made before it existed keep
        # their ids (and the digest stored in their manifests stays right)
        skip = {"name", "modified_at", "source"} | ({"projector"} if self.projector is None
                                                   else set())
        body = self.model_dump_json(exclude=skip)
        return hashlib.sha256(body.encode()).hexdigest()

    @property
    def id(self) -> str:
        return self.digest[:12]


class Manifests:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: ModelName) -> Path:
        return self.root.joinpath(*name.manifest_path().parts)

    def get(self, name: ModelName) -> Manifest | None:
        p = self.path(name)
        if not p.is_file():
            return None
        return Manifest.model_validate_json(p.read_bytes())

    def put(self, name: ModelName, manifest: Manifest) -> None:
        p = self.path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        _write(p, manifest)

    def store_digests(self) -> int:
        """Rewrite the manifests written before they carried their digest (so `llmrun list`
        can read them without validation); the caller holds the store's lock. Returns how
        many were rewritten; a file that does not validate is left as it is."""
        done = 0
        for p in listing.files(self.root):
            try:
                data = json.loads(p.read_bytes())
                if not isinstance(data, dict) or "digest" in data:
                    continue
                _write(p, Manifest.model_validate(data))
                done += 1
            except ValueError:
                continue
        return done

    def delete(self, name: ModelName) -> bool:
        p = self.path(name)
        if not p.is_file():
            return False
        p.unlink()
        # prune empty folders up to the root so `list` never sees stale directories
        for parent in p.parents:
            if parent == self.root or not parent.is_relative_to(self.root):
                break
            try:
                parent.rmdir()
            except OSError:
                break
        return True

    def all(self) -> list[Manifest]:
        out = []
        for p in listing.files(self.root):
            try:
                out.append(Manifest.model_validate_json(p.read_bytes()))
            except ValueError:
                continue  # a foreign or damaged file is not a model; never crash `list`
        return out

    def referenced(self) -> set[str]:
        """Every digest any file under manifests/ mentions, read as text rather than parsed:
        a damaged manifest, one still being written, or one with fields this version does not
        know (a projector) still protects its blobs from garbage collection."""
        out: set[str] = set()
        if not self.root.is_dir():
            return out
        for p in self.root.rglob("*"):
            if p.is_file():
                out.update("sha256:" + m.decode() for m in _DIGEST_TEXT.findall(p.read_bytes()))
        return out


def _write(path: Path, manifest: Manifest) -> None:
    """Atomically: a reader sees the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(manifest.serialize())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
