"""The daemon's side of the prompt cache (the states themselves: engine/promptcache.py).

Each model and set of load settings that shape its KV cache (weights, adapters, context per
sequence, slots, KV type, flash attention) has its own directory under LLMRUN_HOME/prompt-cache,
named by their hash: a runner only ever sees states that fit its context, and the sandbox
lets it write there and nowhere else. A runner keeps its own directory within the budget;
before one starts, the daemon removes the directories no running runner uses, least recently
used first, until all of them together fit it too.

A state a runner wrote is read by the next runner of the model only once the daemon checked
it (`vet`): the writer may have been compromised and have chosen bytes for llama.cpp's state
loader to parse. As a runner starts, the daemon checks each file in its directory it has not
checked before against the model's KV layout (server/kvlayout.py) and removes those that
fail; the SHA-256 of each file it checked goes to the runner in its Load message, and the
runner reads no file of an earlier runner whose bytes do not hash to it. The daemon keeps
those digests beside the directory (`<key>.vouched`, where no runner may write), so a file
is checked once, not at every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from llmrun import config
from llmrun.server import kvlayout

log = logging.getLogger(__name__)

FORMAT = 2  # engine/promptcache.py's file format and the state layout it expects


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
        _vouched_path(d.name).unlink(missing_ok=True)
        total -= size


# -- what a runner may read of its predecessors' states ----------------------------------

VOUCHED = ".vouched"  # beside the directory: <key>.vouched, the daemon's alone
_vet_locks: dict[str, threading.Lock] = {}  # one vetting per directory at a time
_vet_locks_lock = threading.Lock()


def _vouched_path(name: str) -> Path:
    return config.home() / "prompt-cache" / f"{name}{VOUCHED}"


def _read_vouched(name: str) -> dict[str, tuple[int, int, str]]:
    """The files the daemon checked before: name -> (inode, size, SHA-256)."""
    try:
        raw = json.loads(_vouched_path(name).read_bytes())
    except (OSError, ValueError):
        return {}
    if type(raw) is not dict:
        return {}
    return {k: (v[0], v[1], v[2]) for k, v in raw.items()
            if type(v) is list and len(v) == 3 and type(v[0]) is int and type(v[1]) is int
            and type(v[2]) is str}


def _write_vouched(name: str, vouched: dict[str, tuple[int, int, str]]) -> None:
    path = _vouched_path(name)
    fd, tmp = tempfile.mkstemp(prefix=".vouched-", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({k: list(v) for k, v in vouched.items()}, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def vet(name: str, layout: kvlayout.Layout | kvlayout.Unchecked) -> dict[str, str]:
    """Check the state files of directory `name` that were not checked before against
    `layout` (the model's, for the settings `name` stands for), removing each that fails or,
    when the layout is `Unchecked`, every one; returns file name -> SHA-256 of each file a
    runner may read. Files being written (`.`-named) are left to their writer. Blocking (it
    reads each new state whole): call it off the event loop."""
    with _vet_locks_lock:
        lock = _vet_locks.setdefault(name, threading.Lock())
    with lock:
        directory = config.home() / "prompt-cache" / name
        known = _read_vouched(name)
        kept: dict[str, tuple[int, int, str]] = {}
        t0, checked, size = time.perf_counter(), 0, 0
        for path in sorted(directory.iterdir()):
            if path.name.startswith("."):
                continue
            try:
                st = path.lstat()
                if path.is_dir() and not path.is_symlink():
                    raise ValueError("a directory")
                old = known.get(path.name)
                if old is not None and old[:2] == (st.st_ino, st.st_size):
                    kept[path.name] = old  # checked before, and the same file since
                    continue
                if isinstance(layout, kvlayout.Unchecked):
                    raise layout
                sha, ino, n = kvlayout.check(path, layout)
                kept[path.name] = (ino, n, sha)
                checked += 1
                size += n
            except (OSError, ValueError) as exc:
                log.warning("prompt cache: refused and removed %s, which the next runner "
                            "would have read: %s", path.name, exc)
                with contextlib.suppress(OSError):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
        if checked:
            ms = (time.perf_counter() - t0) * 1000
            log.info("prompt cache: checked %d state(s), %.1f MB, in %.0f ms (%.2f ms/MB)",
                     checked, size / 1e6, ms, ms / max(size / 1e6, 1e-9))
        if kept != known:
            try:
                _write_vouched(name, kept)
            except OSError as exc:  # the runner still gets them; the next start checks again
                log.warning("prompt cache: cannot record the checked states: %s", exc)
        return {k: v[2] for k, v in kept.items()}


def vet_for(name: str, model: Path, *, n_ctx: int, n_slots: int, kv_type: str,
            flash_attention: str) -> dict[str, str]:
    """`vet` against the layout of `model` (its first GGUF part) with these settings; {}
    (nothing read) when the directory cannot be read."""
    try:
        layout: kvlayout.Layout | kvlayout.Unchecked = kvlayout.layout_of(
            model, key=name, n_ctx=n_ctx, n_slots=n_slots, kv_type=kv_type,
            flash_attention=flash_attention)
    except kvlayout.Unchecked as exc:
        log.info("prompt cache: %s: states are kept for their own runner only (%s)",
                 model.name, exc)
        layout = exc
    try:
        return vet(name, layout)
    except OSError as exc:
        log.warning("prompt cache: cannot check the states of %s: %s", name, exc)
        return {}
