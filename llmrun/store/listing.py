"""What `llmrun list` shows, read from the manifests as plain JSON.

Validating manifests with pydantic means importing it and building the request models
(~0.25 s), the whole start-up budget of `list` (under 0.25 s on an idle 2-core machine). A
manifest written by `Manifests.put` carries its content digest (the model's id), so the
columns of `list` need no model class. Anything this reader does not recognise (a manifest
from an older version without the stored digest, a damaged or foreign file) makes it answer
None, and the caller reads the store the validated way, which skips what it cannot parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Entry:
    name: str
    id: str
    size: int
    modified_at: datetime
    remote: bool = False  # served by another server (FROM http(s)://): no file here


def files(root: Path) -> list[Path]:
    """The manifest files under `root` (a store's manifests/: host/namespace/model/tag), not
    the temporary files of a write in progress."""
    if not root.is_dir():
        return []
    return [p for p in root.glob("*/*/*/*") if p.is_file() and not p.name.startswith(".")]


def entries(root: Path) -> list[Entry] | None:
    """The models under `root` (a store's manifests/), newest first, or None when one of the
    files needs the validated reader."""
    out = []
    for path in files(root):
        try:
            entry = _entry(json.loads(path.read_bytes()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        if entry is None:
            return None
        out.append(entry)
    return sorted(out, key=lambda e: e.modified_at, reverse=True)


def _entry(data: dict[str, Any]) -> Entry | None:
    digest, name = data["digest"], data["name"]
    own = [data["model"]] if data.get("model") is not None else []
    projector = [data["projector"]] if data.get("projector") is not None else []
    layers = [*own, *data["parts"], *data["adapters"], *projector]
    sizes = [layer["size"] for layer in layers]
    if not (isinstance(digest, str) and _DIGEST.match(digest) and isinstance(name, str)
            and all(type(s) is int and s >= 0 for s in sizes)):
        return None
    modified = datetime.fromisoformat(data["modified_at"])
    if modified.tzinfo is None:
        return None
    return Entry(name=name, id=digest[:12], size=sum(sizes), modified_at=modified,
                 remote=data.get("remote") is not None)
