"""The daemon's side of the prompt cache (the states themselves: engine/promptcache.py).

Each model and set of load settings that shape its KV cache (weights, adapters, context per
sequence, slots, KV type, flash attention) has its own directory under LLMRUN_HOME/prompt-cache,
named by their hash: a runner only ever sees states that fit its context, and the sandbox
lets it write there and nowhere else. A runner keeps its own directory within the budget;
before one starts, the daemon removes the directories no running runner uses, least recently
used first, until all of them together fit it too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections import Counter
from pathlib import Path

from llmrun import config

log = logging.getLogger(__name__)

FORMAT = 1  # engine/promptcache.py's file format and the state layout it expects


def key(model_paths: tuple[Path, ...], lora_paths: tuple[Path, ...], n_ctx: int,
        n_slots: int, kv_type: str = "f16", flash_attention: str = "auto") -> str:
    """The name of the directory for these load settings (model files are named by their
    digest in the store, so their paths stand for their content). The number of slots is
    one: llama.cpp refuses a sequence state saved in a context of another stream count."""
    body = json.dumps({"format": FORMAT, "model": [str(p) for p in model_paths],
                       "lora": [str(p) for p in lora_paths], "n_ctx": n_ctx,
                       "n_slots": n_slots, "kv_type": kv_type,
                       "flash_attention": flash_attention}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


# directories of runners alive now (a count: a reload may overlap the runner it replaces);
# another runner's directory is never removed under it
_in_use: Counter[str] = Counter()


def prepare(name: str, budget: int) -> Path:
    """The directory for key `name`, made (0700) and marked in use until `release(name)`,
    with the directories no runner uses trimmed, least recently used first, to the budget."""
    root = config.make_private(config.home() / "prompt-cache")
    directory = config.make_private(root / name)
    if not _in_use[name]:
        _remove_unfinished(directory)
    _in_use[name] += 1
    _make_room(root, budget)
    return directory


def release(name: str) -> None:
    _in_use[name] -= 1
    if _in_use[name] <= 0:
        del _in_use[name]


def _remove_unfinished(directory: Path) -> None:
    """Remove the temporary files (`.`-named: a state being written) of a runner that was
    killed mid-write. Only while no runner of this daemon uses the directory, so no write
    in progress is touched; the runner itself removes only those older than a minute, as
    it cannot tell a dead writer's file from a live neighbour's."""
    for f in directory.iterdir():
        if f.name.startswith("."):
            log.info("prompt cache: removing %s, left by a write that did not finish", f.name)
            try:
                f.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prompt cache: cannot remove %s: %s", f, exc)


def _usage(directory: Path) -> tuple[int, float]:
    """Bytes in `directory` and when it was last used (its newest file)."""
    size, newest = 0, 0.0
    for f in directory.iterdir():
        try:
            st = f.stat()
        except OSError:
            continue
        size += st.st_size
        newest = max(newest, st.st_mtime)
    return size, newest


def _make_room(root: Path, budget: int) -> None:
    others = []
    total = 0
    for d in root.iterdir():
        if not d.is_dir():
            continue
        size, newest = _usage(d)
        total += size
        if d.name not in _in_use:
            others.append((newest, size, d))
    for _, size, d in sorted(others):
        if total <= budget:
            break
        log.info("prompt cache: removing %s (%.1f MB) to stay within %d MB", d.name,
                 size / 1e6, budget // 1_000_000)
        shutil.rmtree(d, ignore_errors=True)
        total -= size
