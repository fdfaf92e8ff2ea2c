"""KV states of long prompts, kept past their slot and their runner.

A coding agent sends the same ~20k tokens of system prompt and tools with every request. The
slots' own prefix reuse (engine/slots.py) helps only while the runner that read them lives
and no other conversation took the slot; this cache keeps the state of every long prompt the
engine has read (llama.cpp's per-sequence state: the K/V cells of that sequence), so a later
request whose prompt starts the same way, in this runner or in one started next week, loads
it and reads only the rest.

Where a state is taken: at the message boundary a later request will diverge from (the
runner passes the position before the conversation's last user message, so a new session
with the same system prompt and tools, or the next turn, shares all of it), else at the end
of the prompt. On most models a state also serves a prompt that shares only part of it: it
is loaded and cut back to the shared part. Not on models with sliding-window attention
(Gemma 3): a saved state keeps only the last window of those layers (llama.cpp's format),
so it resumes exactly at its end only (`best(whole=True)`; measured: cut back by one token,
logits move by 0.4; at its end, bit-identical), which is why the boundary matters.

Two tiers: the states saved or loaded lately stay in memory (`ram_bytes`), and every state
goes to a file in `directory` (one per prompt, `<sha256 of its tokens>.kv`, written by a
thread of its own, atomically, mode 0600), the least recently used removed past `max_bytes`.
The directory belongs to one model and one set of load settings (the daemon names it by
their hash, server/runners.py), so a state is never offered to a context it does not fit.

A file an earlier runner wrote is read only if the daemon vouched for it (`vouched`: file
name -> SHA-256 of the whole file, in the Load message): the writer may have been
compromised, and whatever it wrote in the file (a key, sizes, a checksum) it could have
written for hostile bytes too, so the daemon checks each file's llama.cpp layout against the
model's shape before a later runner may read it (server/promptdirs.py, server/kvlayout.py).
This runner reads a file whole into memory, hashes the bytes it read and loads them only if
they are the ones the daemon checked (or, for a state it wrote itself, the ones it wrote);
one that is not is removed with a log line. Files not vouched for are not read at all.

File format: `LLMRUNKV`, a 4-byte little-endian header length, a JSON header (`version`,
`key`, `n_tokens`, `state_size`), the tokens as little-endian int32, the state
(llama_state_seq_get_data's bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("llmrun.runner")

MAGIC = b"LLMRUNKV"
VERSION = 2  # (1 carried a checksum in its header: the writer's word, worth nothing)
SUFFIX = ".kv"
MAX_HEADER = 4096
# A state is written in pieces of this size, so that a stop whose time is up abandons a
# write within one piece (a few ms) rather than at the end of a 58 MB state.
WRITE_PIECE = 4 << 20


@dataclass
class Entry:
    tokens: np.ndarray  # int32
    digest: str  # sha256 of the tokens: the file's name
    size: int  # bytes of state
    data: bytearray | None = None  # in memory (the RAM tier), or None: on disk only
    on_disk: bool = False
    # SHA-256 of the whole file as the daemon checked it or this runner wrote it: the only
    # bytes this runner loads from it ("": not written yet)
    sha256: str = ""


@dataclass(frozen=True)
class Hit:
    entry: Entry
    n: int  # tokens of the prompt the state covers


class _Hashed:
    """A file read through a SHA-256 of every byte read."""

    def __init__(self, fh: io.BufferedReader) -> None:
        self.fh = fh
        self.sha = hashlib.sha256()

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        self.sha.update(data)
        return data

    def readinto(self, buf: bytearray) -> int:
        n = self.fh.readinto(buf)
        self.sha.update(memoryview(buf)[:n])
        return n


def token_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PromptCache:
    """The states of prompts of at least `min_tokens`, in memory and under `directory`
    (None: memory only). Used by the engine thread; files are written by a thread of its
    own. `key` names the model and load settings; a file with another key is not used.
    `vouched`: the files earlier runners left that the daemon checked (name -> SHA-256 of
    the file); no other file is read."""

    def __init__(self, directory: Path | None, key: str, *, max_bytes: int, ram_bytes: int,
                 min_tokens: int, n_vocab: int,
                 vouched: Mapping[str, str] | None = None) -> None:
        self.directory = directory
        self.vouched = dict(vouched or {})
        self.key = key
        self.max_bytes = max_bytes
        self.ram_bytes = ram_bytes
        self.min_tokens = min_tokens
        self.n_vocab = n_vocab
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._writes: queue.SimpleQueue[tuple[Entry, bytearray] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._pending = 0  # states handed to the writer and not yet written or dropped
        self._abandon = threading.Event()  # set by close() when its time is up
        if directory is not None:
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="llmrun-prompt-cache")
            self._writer.start()

    # -- lookups (engine thread) ----------------------------------------------------------

    def best(self, prompt: list[int], whole: bool = False) -> Hit | None:
        """The saved state sharing the longest prefix with `prompt`, and that length; with
        `whole`, only states that are all a prefix of `prompt` (a model with sliding-window
        attention resumes a state exactly at its end only)."""
        if not self._entries or len(prompt) < self.min_tokens:
            return None
        p = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            entries = list(self._entries.values())
        best: Hit | None = None
        for e in entries:
            n = common_prefix(e.tokens, p)
            if whole and n < len(e.tokens):
                continue
            if best is None or n > best.n:
                best = Hit(e, n)
        return best if best is not None and best.n > 0 else None

    def load(self, entry: Entry) -> bytearray | None:
        """The state of `entry` (from memory, else its file, checked whole); None when it
        cannot be had (the file is then removed)."""
        with self._lock:
            if entry.digest in self._entries:
                self._entries.move_to_end(entry.digest)
            data = entry.data
        if data is not None:
            return data
        data = self._read(entry) if self.directory is not None else None
        if data is None:
            self._forget(entry, remove=True)
            return None
        self._remember(entry, data)
        if self.directory is not None:
            # the file's time orders the next runner's least-recently-used list
            with contextlib.suppress(OSError):
                os.utime(self._path(entry.digest))
        return data

    def in_memory(self, entry: Entry) -> bool:
        return entry.data is not None

    def load_later(self, entry: Entry, done: Callable[[bytearray | None], None]) -> None:
        """`load(entry)` on a thread of its own, then `done(data)` there: reading and checking
        a large state takes long enough to stall every other sequence if the engine's own
        thread did it."""
        threading.Thread(target=lambda: done(self.load(entry)), daemon=True,
                         name="llmrun-prompt-cache-load").start()

    def drop(self, entry: Entry) -> None:
        """Forget a state llama.cpp refused (and remove its file)."""
        log.warning("prompt cache: llama.cpp refused the state of a %d-token prefix; removed",
                    len(entry.tokens))
        self._forget(entry, remove=True)

    # -- saving (engine thread) -----------------------------------------------------------

    def covers(self, prompt: list[int]) -> bool:
        """Whether a saved state already holds all of `prompt`."""
        hit = self.best(prompt)
        return hit is not None and hit.n == len(prompt)

    def add(self, tokens: list[int], state: bytearray) -> None:
        arr = np.asarray(tokens, dtype=np.int32)
        entry = Entry(arr, token_digest(arr), len(state))
        to_disk = self.directory is not None and entry.size <= self.max_bytes
        if not to_disk and entry.size > self.ram_bytes:
            return  # no tier can hold it
        with self._lock:
            self._entries[entry.digest] = entry
        self._remember(entry, state)
        if to_disk:
            with self._lock:
                self._pending += 1
            self._writes.put((entry, state))  # the writer holds the bytes until written

    def close(self, timeout: float = 30.0) -> bool:
        """Let the writer finish the states already handed to it, for `timeout` seconds at
        most; past it the rest are dropped whole (no half-written file is left). Returns
        whether every state handed to it was written."""
        if self._writer is None or not self._writer.is_alive():
            return True
        t0 = time.monotonic()
        with self._lock:
            pending = self._pending
        self._writes.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            self._abandon.set()  # the writer stops at its next piece and removes its file
            self._writer.join(5.0)
            log.warning("prompt cache: stopped before %d state(s) were written in %.0f s; "
                        "dropped", pending, timeout)
            return False
        if pending:
            log.info("prompt cache: wrote %d state(s) in %.1f s before stopping", pending,
                     time.monotonic() - t0)
        return True

    # -- memory tier ----------------------------------------------------------------------

    def _remember(self, entry: Entry, data: bytearray) -> None:
        """Keep `data` in memory for `entry`, letting the least recently used go past the
        budget (those with no file behind them are forgotten)."""
        if len(data) > self.ram_bytes:
            return
        with self._lock:
            entry.data = data
            in_ram = [e for e in self._entries.values() if e.data is not None]
            used = sum(e.size for e in in_ram)
            for e in in_ram:  # least recently used first
                if used <= self.ram_bytes:
                    break
                if e is entry:
                    continue
                used -= e.size
                e.data = None
                if self.directory is None:
                    del self._entries[e.digest]

    def _forget(self, entry: Entry, remove: bool) -> None:
        with self._lock:
            self._entries.pop(entry.digest, None)
            entry.data = None
        if remove and self.directory is not None:
            try:
                self._path(entry.digest).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prompt cache: cannot remove %s: %s", entry.digest[:12], exc)

    # -- files ----------------------------------------------------------------------------

    def _path(self, digest: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{digest}{SUFFIX}"

    def _header(self, entry: Entry) -> bytes:
        head = json.dumps({"version": VERSION, "key": self.key, "n_tokens": len(entry.tokens),
                           "state_size": entry.size}).encode()
        return MAGIC + struct.pack("<I", len(head)) + head

    def _scan(self) -> None:
        """Index the files a previous runner left that the daemon vouched for: their tokens,
        oldest used first. What is not ours or not whole is removed (a write that died leaves
        a temporary file); a file the daemon did not vouch for is not read (it checks it as
        the next runner starts, or removes it)."""
        assert self.directory is not None
        found: list[tuple[float, Entry]] = []
        unvouched = 0
        for path in self.directory.iterdir():
            if path.name.startswith("."):
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < time.time() - 60:
                        path.unlink()  # a temporary file of a write that died
                continue
            if not path.name.endswith(SUFFIX):
                continue
            sha = self.vouched.get(path.name)
            if sha is None:
                unvouched += 1
                continue
            try:
                with path.open("rb") as fh:
                    tokens, size = self._read_header(fh)
                    if path.stat().st_size != fh.tell() + size:
                        raise ValueError("its size does not match its header")
            except (OSError, ValueError) as exc:
                log.warning("prompt cache: ignoring and removing %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            digest = token_digest(tokens)
            if path.name != f"{digest}{SUFFIX}":
                log.warning("prompt cache: removing %s: its name is not its tokens' digest",
                            path.name)
                path.unlink(missing_ok=True)
                continue
            found.append((path.stat().st_mtime,
                          Entry(tokens, digest, size, on_disk=True, sha256=sha)))
        for _, entry in sorted(found, key=lambda x: x[0]):
            self._entries[entry.digest] = entry
        if unvouched:
            log.info("prompt cache: %d file(s) the daemon has not checked: not read",
                     unvouched)
        if found:
            log.info("prompt cache: %d saved prompts (%s tokens at most) in %s", len(found),
                     max(len(e.tokens) for _, e in found), self.directory)

    def _read_header(self, fh: object) -> tuple[np.ndarray, int]:
        def read(n: int) -> bytes:
            data: bytes = fh.read(n)  # type: ignore[attr-defined]
            if len(data) != n:
                raise ValueError("cut short")
            return data

        if read(len(MAGIC)) != MAGIC:
            raise ValueError("not a prompt-cache file")
        (n,) = struct.unpack("<I", read(4))
        if n > MAX_HEADER:
            raise ValueError("header too large")
        head = json.loads(read(n))
        if not isinstance(head, dict) or head.get("version") != VERSION:
            raise ValueError("another format version")
        if head.get("key") != self.key:
            raise ValueError("saved for another model or other load settings")
        n_tokens, size = head.get("n_tokens"), head.get("state_size")
        if not (type(n_tokens) is int and 0 < n_tokens <= 1 << 24 and type(size) is int
                and size > 0):
            raise ValueError("a header field is missing or out of range")
        tokens = np.frombuffer(read(4 * n_tokens), dtype="<i4").astype(np.int32)
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ValueError("a token is outside the vocabulary")
        return tokens, size

    def _read(self, entry: Entry) -> bytearray | None:
        path = self._path(entry.digest)
        try:
            with self._lock:
                want = entry.sha256
            if not want:
                raise ValueError("it is not written yet")
            with path.open("rb") as raw:
                fh = _Hashed(raw)
                tokens, size = self._read_header(fh)
                if size != entry.size or not np.array_equal(tokens, entry.tokens):
                    raise ValueError("it changed since it was indexed")
                data = bytearray(size)
                if fh.readinto(data) != size or raw.read(1):
                    raise ValueError("its state is not the size its header says")
            # the bytes in hand, not the file (which its writer could change after a check)
            if fh.sha.hexdigest() != want:
                raise ValueError("it is not the file the daemon checked or this runner "
                                 "wrote")
        except (OSError, ValueError) as exc:
            log.warning("prompt cache: ignoring and removing %s: %s", path.name, exc)
            return None
        return data

    def _write_loop(self) -> None:
        # Hashing and writing a state (70 MB for 3,000 tokens of SmolLM2) takes a core for a
        # fifth of a second; at normal priority it takes it from llama.cpp's threads, whose
        # decode then waits at a barrier for the one descheduled (steps 2-20x as long, seen
        # right after a save). At the lowest priority it writes in their idle moments.
        # who=0: on Linux, PRIO_PROCESS with 0 is the calling thread alone, and the only
        # target the sandbox's filter lets a runner renice (engine/sandbox/seccomp.py).
        with contextlib.suppress(OSError, AttributeError):  # (not on every platform)
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        while (item := self._writes.get()) is not None:
            entry, data = item
            try:
                if entry.digest not in self._entries or self._abandon.is_set():
                    continue  # dropped before its turn
                self._write(entry, data)
            except OSError as exc:
                log.warning("prompt cache: cannot save a %d-token prompt: %s",
                            len(entry.tokens), exc)
                with self._lock:
                    self._entries.pop(entry.digest, None)
                continue
            finally:
                with self._lock:
                    self._pending -= 1
            with self._lock:
                entry.on_disk = True
            self._trim_files()

    def _write(self, entry: Entry, data: bytearray) -> None:
        assert self.directory is not None
        head = self._header(entry)
        tokens = entry.tokens.astype("<i4").tobytes()
        sha = hashlib.sha256(head)
        sha.update(tokens)
        fd, tmp = tempfile.mkstemp(prefix=".kv-", dir=self.directory)  # 0600
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(head)
                fh.write(tokens)
                view = memoryview(data)
                for at in range(0, len(view), WRITE_PIECE):
                    if self._abandon.is_set():  # a stop whose time is up: drop it whole
                        raise OSError("the runner stopped before it was written")
                    fh.write(view[at:at + WRITE_PIECE])
                    sha.update(view[at:at + WRITE_PIECE])
                fh.flush()
                os.fsync(fh.fileno())
            with self._lock:
                entry.sha256 = sha.hexdigest()  # this runner reads back what it wrote
            os.replace(tmp, self._path(entry.digest))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        log.info("prompt cache: saved a %d-token prompt (%.1f MB)", len(entry.tokens),
                 len(data) / 1e6)

    def _trim_files(self) -> None:
        """Least recently used files out until the directory is within `max_bytes`."""
        with self._lock:
            on_disk = [e for e in self._entries.values() if e.on_disk]
            used = sum(e.size for e in on_disk)
            gone = []
            for e in on_disk:
                if used <= self.max_bytes:
                    break
                used -= e.size
                gone.append(e)
                del self._entries[e.digest]
                e.data = None
        for e in gone:
            try:
                self._path(e.digest).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prompt cache: cannot remove %s: %s", e.digest[:12], exc)
