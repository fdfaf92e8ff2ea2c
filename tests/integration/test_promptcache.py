"""The prompt cache (engine/promptcache.py): states of long prompts kept past their slot and
their runner.

Its files are read back by a later runner, so the tests try to break that: damaged, cut,
foreign and mismatched files, a budget, and, on the real model, that a restored prompt
answers exactly as one read from scratch (flash attention off: with it on, llama.cpp's
attention takes other code paths by batch shape, so even plain prefix reuse is not
bit-exact; docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from llmrun.engine import promptcache
from llmrun.engine.llama import Model
from llmrun.engine.promptcache import SUFFIX, PromptCache
from llmrun.server import kvlayout
from tests.conftest import Daemon, make_home, runner_pids, wait_until
from tests.integration.test_engine import Harness

VOCAB = 1000


def make(directory: Path | None, vouched: dict[str, str] | None = None,
         **kw: int) -> PromptCache:
    """A cache on `directory`; `vouched`, the files the daemon would have vouched for (by
    default every file there as it is now: these tests try the runner's own checks)."""
    args = {"max_bytes": 1 << 20, "ram_bytes": 1 << 20, "min_tokens": 4, "n_vocab": VOCAB}
    if vouched is None and directory is not None:
        vouched = as_they_are(directory)
    return PromptCache(directory, "key-1", **{**args, **kw}, vouched=vouched)


def as_they_are(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in directory.glob(f"*{SUFFIX}")}


def state(n: int, seed: int = 0) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())


def saved(cache: PromptCache, tokens: list[int], data: bytearray) -> None:
    """Add a state and wait until its file is written."""
    cache.add(tokens, data)
    assert cache.directory is not None
    wait_until(lambda: len(list(cache.directory.glob(f"*{SUFFIX}"))) >= 1
               and not list(cache.directory.glob(".kv-*")), what="the state's file")


def test_longest_shared_prefix_wins(tmp_path: Path) -> None:
    cache = make(None)
    cache.add([1, 2, 3, 4, 5, 6], state(10, 1))
    cache.add([1, 2, 3, 9, 9, 9, 9, 9], state(10, 2))
    hit = cache.best([1, 2, 3, 4, 5, 7, 7])
    assert hit is not None and hit.n == 5 and list(hit.entry.tokens) == [1, 2, 3, 4, 5, 6]
    assert cache.load(hit.entry) == state(10, 1)
    assert cache.best([8, 8, 8, 8, 8]) is None  # nothing shared
    assert cache.best([1, 2, 3]) is None  # shorter than min_tokens: never looked up
    assert cache.covers([1, 2, 3, 4, 5, 6]) and not cache.covers([1, 2, 3, 4, 5, 6, 7])


def test_memory_tier_keeps_the_most_recent_within_its_budget() -> None:
    cache = make(None, ram_bytes=25)
    cache.add([1] * 5, state(10, 1))
    cache.add([2] * 5, state(10, 2))
    hit = cache.best([1] * 5)
    assert hit is not None and cache.load(hit.entry) is not None  # 1 is now the most recent
    cache.add([3] * 5, state(10, 3))  # over budget: 2, least recently used, goes
    assert cache.best([2] * 5) is None
    assert cache.best([1] * 5) is not None and cache.best([3] * 5) is not None
    cache.add([4] * 5, state(30, 4))  # larger than the whole budget: not kept at all
    assert cache.best([4] * 5) is None


def test_a_state_outlives_its_cache_on_disk(tmp_path: Path) -> None:
    tokens = list(range(1, 40))
    data = state(5000)
    cache = make(tmp_path)
    saved(cache, tokens, data)
    cache.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    later = make(tmp_path, ram_bytes=0)  # a new runner, nothing in memory
    hit = later.best([*tokens[:30], 999])
    assert hit is not None and hit.n == 30
    assert later.load(hit.entry) == data


def test_the_writer_yields_the_cpu_to_the_engine(tmp_path: Path) -> None:
    """Hashing and writing a state runs at the lowest priority: at normal priority it took a
    core from llama.cpp's threads (decode steps 2-20x as long right after a save)."""
    cache = make(tmp_path)
    saved(cache, list(range(1, 40)), state(5000))  # the writer is running by now
    writer = cache._writer
    assert writer is not None and writer.native_id is not None
    try:
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == 19
    finally:
        cache.close()


@pytest.mark.parametrize("damage", ["state", "tokens", "cut", "grown", "key", "magic",
                                    "vocab", "header"])
def test_damaged_or_foreign_files_are_ignored_and_removed(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    tokens = list(range(1, 40))
    cache = make(tmp_path)
    saved(cache, tokens, state(5000))
    cache.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    checked = as_they_are(tmp_path)  # the daemon checked it; then a runner changed it
    raw = bytearray(path.read_bytes())
    head_end = 12 + int.from_bytes(raw[8:12], "little")
    if damage == "state":
        raw[-100] ^= 0xFF  # found only when the state is read: its checksum
    elif damage == "tokens":
        raw[head_end + 8] ^= 0x01  # its name is no longer its tokens' digest
    elif damage == "cut":
        raw = raw[:-1]
    elif damage == "grown":
        raw += b"\0"
    elif damage == "key":
        raw = raw.replace(b'"key-1"', b'"key-2"')
    elif damage == "magic":
        raw[0:8] = b"GGUFGGUF"
    elif damage == "vocab":
        raw[head_end:head_end + 4] = (VOCAB + 5).to_bytes(4, "little")
    elif damage == "header":
        raw[8:12] = (1 << 30).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="llmrun.runner"):
        later = make(tmp_path, checked, ram_bytes=0)
        hit = later.best(tokens)
        got = later.load(hit.entry) if hit is not None else None
    assert got is None
    assert not path.exists()
    assert "prompt cache: ignoring and removing" in caplog.text or \
        "prompt cache: removing" in caplog.text


def test_disk_budget_removes_the_least_recently_used(tmp_path: Path) -> None:
    cache = make(tmp_path, max_bytes=2500, ram_bytes=0)
    for i in range(3):
        cache.add([i + 1] * 10, state(1000, i))
        want = min(i + 1, 2)
        wait_until(lambda want=want: not list(tmp_path.glob(".kv-*"))
                   and len(list(tmp_path.glob(f"*{SUFFIX}"))) == want, what="the writer")
    cache.close()
    later = make(tmp_path)
    assert later.best([1] * 10) is None  # the oldest went
    assert later.best([2] * 10) is not None and later.best([3] * 10) is not None


def test_a_dead_write_leaves_nothing_a_later_cache_uses(tmp_path: Path) -> None:
    (tmp_path / ".kv-abandoned").write_bytes(b"half a state")
    old = os.stat(tmp_path / ".kv-abandoned").st_mtime - 3600
    os.utime(tmp_path / ".kv-abandoned", (old, old))
    (tmp_path / f"{'0' * 64}{SUFFIX}").write_bytes(b"LLMRUNKV")
    cache = make(tmp_path)
    assert cache.best([1] * 10) is None
    assert list(tmp_path.iterdir()) == []


def test_a_stop_finishes_the_writes_it_started(tmp_path: Path) -> None:
    cache = make(tmp_path, max_bytes=64 << 20, ram_bytes=0)
    tokens = list(range(1, 40))
    cache.add(tokens, state(24 << 20))  # handed to the writer; close() must not lose it
    assert cache.close(timeout=60)
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob(f"*{SUFFIX}")]
    again = make(tmp_path, max_bytes=64 << 20, ram_bytes=0)
    hit = again.best(tokens)
    assert hit is not None and hit.n == len(tokens)
    assert again.load(hit.entry) == state(24 << 20)


def test_a_stop_past_its_time_drops_the_write_whole(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from llmrun.engine import promptcache

    # one byte per write call: this 64 MB state would take far longer than the stop allows
    # (an 8 MB one was written whole in about 2 s here, sometimes before the stop was asked)
    monkeypatch.setattr(promptcache, "WRITE_PIECE", 1)
    cache = make(tmp_path, max_bytes=256 << 20, ram_bytes=0)
    cache.add(list(range(1, 40)), state(64 << 20))
    wait_until(lambda: list(tmp_path.glob(".kv-*")), what="the write to start")
    assert not cache.close(timeout=0.2)
    assert list(tmp_path.iterdir()) == []  # no half-written state, no temporary file


def test_the_daemon_removes_a_killed_writers_file_before_a_runner_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmrun.server import promptdirs as daemon_side

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    directory = daemon_side.prepare("mine", budget=1 << 30)
    (directory / ".kv-0n2g6z8l").write_bytes(b"half a state")  # written now: <1 minute old
    # a second runner of the same settings (a reload overlapping its predecessor): the
    # first may be writing that file, so it stays
    daemon_side.prepare("mine", budget=1 << 30)
    assert (directory / ".kv-0n2g6z8l").exists()
    daemon_side.release("mine")
    daemon_side.release("mine")
    # no runner uses the directory: whatever is half-written there was left by a dead one
    daemon_side.prepare("mine", budget=1 << 30)
    assert list(directory.iterdir()) == []
    daemon_side.release("mine")


# -- on the real model --------------------------------------------------------------------

SYSTEM = ("You are a careful assistant for a software team. " + " ".join(
    f"Rule {i}: keep answers short, cite the file and line, and never invent an API "
    f"(rule number {i})." for i in range(40)))


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


def checked_by_daemon(directory: Path, model_path: Path, key: str, *, slots: int,
                      flash_attention: str = "auto", n_ctx: int = 2048) -> dict[str, str]:
    """What the daemon vouches for in `directory` (server/kvlayout.py): every state file
    there, each of which must pass its check (genuine states do)."""
    layout = kvlayout.layout_of(model_path, key=key, n_ctx=n_ctx, n_slots=slots,
                                kv_type="f16", flash_attention=flash_attention)
    return {p.name: kvlayout.check(p, layout)[0] for p in directory.glob(f"*{SUFFIX}")}


def _chat(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_a_restored_prompt_answers_exactly_as_a_cold_one(model: Model, smollm2_path: Path,
                                                         tmp_path: Path) -> None:
    def cache(vouched: dict[str, str] | None = None) -> PromptCache:
        return PromptCache(tmp_path, "smollm2", max_bytes=1 << 30, ram_bytes=0,
                           min_tokens=256, n_vocab=model.n_vocab, vouched=vouched)

    first = Harness(model, slots=2, n_ctx=2048, flash_attn=False, prompt_cache=cache())
    try:
        r = first.submit(_chat("Why is the sky blue?"), max_tokens=4)
        first.wait(r)
        assert first.started[r]["cached_tokens"] == 0
        n_system = len(first.tokens(_chat("")))  # (the system prompt and a bit)
        assert first.started[r]["prompt_tokens"] > 600
    finally:
        first.engine.prompt_cache.close()  # type: ignore[union-attr]
        first.close()
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1

    question = _chat("Name three prime numbers.")
    cold = Harness(model, slots=2, n_ctx=2048, flash_attn=False)
    try:
        rc = cold.submit(question, max_tokens=24, logprobs=3)
        (cold_text,) = cold.wait(rc)
    finally:
        cold.close()
    # a new runner: the state comes from its file, which the daemon checked
    vouched = checked_by_daemon(tmp_path, smollm2_path, "smollm2", slots=2,
                                flash_attention="off")
    warm = Harness(model, slots=2, n_ctx=2048, flash_attn=False,
                   prompt_cache=cache(vouched))
    try:
        rw = warm.submit(question, max_tokens=24, logprobs=3)
        (warm_text,) = warm.wait(rw)
    finally:
        warm.close()
    assert warm.started[rw]["cached_tokens"] >= n_system - 8
    assert warm_text == cold_text and len(cold_text) > 10
    assert warm.logprobs[rw] == cold.logprobs[rc]  # the same numbers, to the last bit


def _cached_tokens(d: Daemon, user: str) -> tuple[int, int]:
    """The prompt's tokens and how many of them came from a cache, for one OpenAI request
    with the long system prompt."""
    r = httpx.post(d.url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "messages": _chat(user), "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("who", ["group", "cgroup"])
def test_a_group_stop_right_after_a_long_prompt_keeps_its_state(
        smollm2_path: Path, tmp_path: Path, who: str) -> None:
    """SIGTERM to the daemon's process group (`kill -TERM -PGID`, a terminal's signal), or
    to the runners too (systemd's stop signals every process of the service's cgroup), the
    moment the answer to a long prompt arrives, while its state is still being written: the
    runner finishes the write, so the next daemon restores the prefix, and no temporary file
    is left behind."""
    home = make_home(tmp_path / "home", smollm2_path)
    d = Daemon(home, env={"LLMRUN_PROMPT_CACHE_SIZE": "1GiB", "LLMRUN_NUM_PARALLEL": "1",
                          "LLMRUN_PROMPT_CACHE_MIN_TOKENS": "256"}).start()
    try:
        n, cached = _cached_tokens(d, "Why is the sky blue?")
        assert n > 600 and cached == 0
        assert d.proc is not None
        runners = runner_pids(d.proc.pid)
        if who == "cgroup":
            for pid in runners:
                os.kill(pid, signal.SIGTERM)
        d.signal_group(signal.SIGTERM)
        assert runners and not [p for p in runners if Path(f"/proc/{p}").exists()]
        files = list((home / "prompt-cache").glob("*/*"))
        logs = "".join(p.read_text(errors="replace") for p in (home / "logs").glob("*"))
        assert [f.suffix for f in files] == [SUFFIX], (files, logs[-4000:])  # whole, alone

        d.start()
        n2, cached2 = _cached_tokens(d, "Name three prime numbers.")
        assert cached2 >= n - 32, (n, n2, cached2)  # all but the last user message
    finally:
        d.stop()


def test_a_prefix_evicted_from_its_slot_comes_back_from_memory(model: Model) -> None:
    cache = PromptCache(None, "smollm2", max_bytes=1 << 30, ram_bytes=1 << 30,
                        min_tokens=256, n_vocab=model.n_vocab)
    h = Harness(model, slots=1, n_ctx=2048, prompt_cache=cache)
    try:
        h.wait(h.submit(_chat("Why is the sky blue?"), max_tokens=2))
        other = "A different long system prompt. " * 120  # takes the only slot
        h.wait(h.submit([{"role": "system", "content": other},
                         {"role": "user", "content": "Hi"}], max_tokens=2))
        r = h.submit(_chat("Name three prime numbers."), max_tokens=2)
        h.wait(r)
        assert h.started[r]["cached_tokens"] > 600
        # and what the slot believes it holds is what its cells hold
        wait_until(lambda: h.engine.slots[0].seq is None, what="the slot free")
        slot = h.engine.slots[0]
        assert h.ctx.seq_pos_max(slot.seq_id) == len(slot.tokens) - 1
    finally:
        h.close()


def close(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 0.1) -> bool:
    """Same tokens, log-probabilities within `tol`."""
    return len(a) == len(b) and all(
        x["token"] == y["token"] and abs(x["logprob"] - y["logprob"]) <= tol
        for x, y in zip(a, b, strict=True))


def test_sliding_window_states_resume_at_their_end_only(gemma3_path: Path,
                                                        tmp_path: Path) -> None:
    """Gemma 3 keeps only the last window in most layers, and so does its saved state: a
    state is taken at the boundary the caller names (the runner names the one before the
    last user message) and restored only where a prompt holds all of it, with the same
    numbers as a cold read; a longer state sharing only part of the prompt is not used."""
    gemma = Model(gemma3_path)
    assert gemma.n_swa > 0
    try:
        system = gemma.tokenize(SYSTEM, add_special=True)
        first = system + gemma.tokenize(" Question: why is the sky blue?", add_special=False)
        second = system + gemma.tokenize(" Question: name three prime numbers.",
                                         add_special=False)

        def run(prompt: list[int], cache: PromptCache | None,
                save_at: int | None = None) -> tuple[Harness, str]:
            h = Harness(gemma, slots=1, n_ctx=2048, prompt_cache=cache)
            rid = h.submit_tokens(prompt, logprobs=2, save_at=save_at)
            h.wait(rid)
            h.close()
            if cache is not None:
                cache.close()
            return h, rid

        def cache(folder: Path) -> PromptCache:
            folder.mkdir(exist_ok=True)  # (its states, as the daemon checks them)
            vouched = checked_by_daemon(folder, gemma3_path, "gemma", slots=1)
            return PromptCache(folder, "gemma", max_bytes=1 << 30, ram_bytes=0,
                               min_tokens=256, n_vocab=gemma.n_vocab, vouched=vouched)

        run(first, cache(tmp_path / "boundary"), save_at=len(system))
        assert len(list((tmp_path / "boundary").glob(f"*{SUFFIX}"))) == 1
        # On this model llama.cpp's numbers depend on how a prompt is cut into batches, so
        # the cold reference reads `second` cut where `first` was: at the boundary.
        cold, rc = run(second, cache(tmp_path / "cold"), save_at=len(system))
        warm, rw = run(second, cache(tmp_path / "boundary"))
        assert cold.started[rc]["cached_tokens"] == 0
        assert warm.started[rw]["cached_tokens"] == len(system) - len(system) % 64
        # The same numbers to the last bit, with flash attention on (its default): a
        # restored state puts the sliding-window layers' cells elsewhere in the cache
        # (llama.cpp keeps only the window), and the state is kept at a multiple of 64
        # tokens so that the shift is whole tiles of the attention's sums.
        assert len(system) % 64 != 0  # (the boundary named is not aligned: it is moved)
        assert warm.logprobs[rw] == cold.logprobs[rc]
        assert warm.text[rw] == cold.text[rc]

        # the whole state of a longer first prompt: it shares only the system part
        longer = first + gemma.tokenize(" Explain it in detail, step by step." * 12,
                                        add_special=False)
        assert len(longer) - len(longer) % 64 > len(system) + 64
        run(longer, cache(tmp_path / "whole"))
        assert len(list((tmp_path / "whole").glob(f"*{SUFFIX}"))) == 1
        plain, rc = run(second, None)
        partial, rp = run(second, cache(tmp_path / "whole"))
        assert partial.started[rp]["cached_tokens"] == 0
        assert partial.logprobs[rp] == plain.logprobs[rc]
    finally:
        gemma.close()


class SlowDisk(PromptCache):
    """A cache whose file reads wait until the test lets them go."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reading = threading.Event()
        self.go = threading.Event()

    def _read(self, entry: Any) -> bytearray | None:
        self.reading.set()
        assert self.go.wait(120)
        return super()._read(entry)


def test_a_state_read_from_disk_stalls_no_other_sequence(model: Model, smollm2_path: Path,
                                                        tmp_path: Path) -> None:
    """A restore reads and checks tens of MB: it happens off the engine thread, so a sequence
    already decoding keeps going while it lasts, and a request cancelled meanwhile ends."""
    def cache(cls: type[PromptCache] = PromptCache) -> PromptCache:
        return cls(tmp_path, "smollm2", max_bytes=1 << 30, ram_bytes=0, min_tokens=256,
                   n_vocab=model.n_vocab,
                   vouched=checked_by_daemon(tmp_path, smollm2_path, "smollm2", slots=2))

    first = Harness(model, slots=2, n_ctx=2048, prompt_cache=cache())
    try:
        first.wait(first.submit(_chat("Why is the sky blue?"), max_tokens=2))
    finally:
        first.engine.prompt_cache.close()  # type: ignore[union-attr]
        first.close()
    slow = cache(SlowDisk)
    assert isinstance(slow, SlowDisk)
    h = Harness(model, slots=2, n_ctx=2048, prompt_cache=slow)  # (the same: see key())
    try:
        busy = h.submit("Tell me a long story about a dragon.", max_tokens=400)
        wait_until(lambda: h.text.get(busy), what="the first sequence decoding")
        restored = h.submit(_chat("Name three prime numbers."), max_tokens=4)
        assert slow.reading.wait(60)
        before = len(h.text.get(busy, ""))
        # the read is held: the other sequence still produces text meanwhile
        wait_until(lambda: len(h.text.get(busy, "")) > before + 40,
                   what="the decoding sequence going on while a state is read")
        assert restored not in h.started
        cancelled = h.submit(_chat("And the capital of Peru?"), max_tokens=4)
        h.engine.cancel(cancelled)
        wait_until(lambda: cancelled in h.final, what="the cancelled request's end")
        assert h.final[cancelled][1]["finish_reason"] == "cancel"
        slow.go.set()
        h.wait(restored)
        assert h.started[restored]["cached_tokens"] > 600
        h.engine.cancel(busy)
        wait_until(lambda: busy in h.final, what="the long sequence's end")
    finally:
        slow.go.set()
        h.close()


# -- the daemon's side: one directory per model and load settings, one budget ------------


def test_each_load_setting_names_its_own_directory() -> None:
    from llmrun.server import promptdirs as daemon_side

    base = dict(model_paths=(Path("blobs/sha256-a"),), lora_paths=(), n_ctx=4096, n_slots=4,
                kv_type="f16", flash_attention="auto")
    names = {daemon_side.key(**base)}  # type: ignore[arg-type]
    for field, other in (("model_paths", (Path("blobs/sha256-b"),)),
                         ("lora_paths", (Path("blobs/sha256-c"),)), ("n_ctx", 8192),
                         ("n_slots", 2), ("kv_type", "q8_0"), ("flash_attention", "off")):
        names.add(daemon_side.key(**{**base, field: other}))  # type: ignore[arg-type]
    assert len(names) == 7
    assert daemon_side.key(**base) == daemon_side.key(**base)  # type: ignore[arg-type]


def test_the_daemon_keeps_all_directories_within_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmrun.server import promptdirs as daemon_side

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    root = tmp_path / "prompt-cache"
    for i, name in enumerate(("old", "newer", "newest")):
        (root / name).mkdir(parents=True)
        f = root / name / "x.kv"
        f.write_bytes(b"\0" * 1000)
        os.utime(f, (1000.0 + i, 1000.0 + i))
    kept = daemon_side.prepare("mine", budget=2500)  # three others of 1,000 bytes: one goes
    assert kept == root / "mine" and stat.S_IMODE(kept.stat().st_mode) == 0o700
    assert sorted(p.name for p in root.iterdir()) == ["mine", "newer", "newest"]
    # "mine" is in use (its runner runs) and "newer" is the new runner's own: "newest" goes
    daemon_side.prepare("newer", budget=500)
    assert sorted(p.name for p in root.iterdir()) == ["mine", "newer"]
    daemon_side.release("mine")
    daemon_side.release("newer")
    daemon_side.prepare("other", budget=500)  # none in use now but its own
    assert sorted(p.name for p in root.iterdir()) == ["other"]
    daemon_side.release("other")


# -- a state planted by a compromised runner never reaches the next runner's loader -------


def _cells_at(state: bytes | bytearray) -> tuple[int, int]:
    """Where the (first) cache's one stream with cells has its cell count, and that count."""
    (n_stream,) = struct.unpack_from("<I", state, 8)
    at = 12
    for _ in range(n_stream):
        (cells,) = struct.unpack_from("<I", state, at)
        if cells:
            return at, cells
        at += 4
    raise AssertionError("no cells")


def hostile(state: bytearray, how: str) -> bytearray:
    """`state` (a genuine one) with its llama.cpp layout made wrong in one way, each a way
    a compromised runner might try to drive the next one's state loader."""
    bad = bytearray(state)
    at, cells = _cells_at(bad)
    meta = at + 4  # cells x (pos, n_seq_id, seq_id)
    layers = meta + 12 * cells + 4  # (after v_trans)
    if how == "cell count":
        struct.pack_into("<I", bad, at, cells + 1)
    elif how == "layer count":
        struct.pack_into("<I", bad, layers, struct.unpack_from("<I", bad, layers)[0] - 1)
    elif how == "row size":
        struct.pack_into("<Q", bad, layers + 8, 2 * struct.unpack_from("<Q", bad, layers + 8)[0])
    elif how == "KV type":
        struct.pack_into("<i", bad, layers + 4, 0)  # f32 where the context holds f16
    elif how == "position":  # llama.cpp's loader takes positions as they are
        struct.pack_into("<i", bad, meta + 12 * (cells - 1), 1 << 30)
    elif how == "sequences per cell":
        struct.pack_into("<I", bad, meta + 4, 2)
    elif how == "stream count":
        struct.pack_into("<I", bad, 8, 7)
    elif how == "cut short":
        del bad[-1000:]
    elif how == "grown":
        bad += bytes(4096)
    return bad


HOSTILE = ["cell count", "layer count", "row size", "KV type", "position",
           "sequences per cell", "stream count", "cut short", "grown"]


@pytest.fixture(scope="module")
def genuine_state(model: Model) -> tuple[list[int], bytearray]:
    """A real SmolLM2 state: 300 tokens in sequence 1 of a 2-slot context, flash attention
    off (V transposed)."""
    from llmrun.engine.llama.context import Context
    from llmrun.engine.llama.model import Batch

    ctx = Context(model, n_ctx_seq=2048, n_seq=2, n_batch=512, n_threads=2, flash_attn=False)
    try:
        tokens = model.tokenize(SYSTEM, add_special=True)[:300]
        batch = Batch(512)
        for i, t in enumerate(tokens):
            batch.add(t, i, 1, i == len(tokens) - 1)
        assert ctx.decode(batch) == 0
        return tokens, ctx.state_seq_get(1)
    finally:
        ctx.close()


@pytest.mark.parametrize("how", HOSTILE)
def test_the_daemon_removes_a_planted_state_before_a_runner_may_read_it(
        model: Model, smollm2_path: Path, genuine_state: tuple[list[int], bytearray],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        how: str) -> None:
    """A compromised runner writes a state whose header, key, tokens, sizes and file name
    are all right (it writes it with the runner's own code) and whose llama.cpp layout is
    not: the daemon finds it as the next runner starts, removes it with a log line, and
    that runner is not told it may read it; the genuine state beside it is."""
    from llmrun.server import promptdirs

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    name = promptdirs.key((smollm2_path,), (), 2048, 2, "f16", "off")
    directory = promptdirs.prepare(name, budget=1 << 30)
    tokens, state = genuine_state
    writer = PromptCache(directory, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                         n_vocab=model.n_vocab)
    writer.add(tokens, state)
    planted = [*tokens, *tokens[1:40]]  # a longer prefix of a later prompt: it would win
    writer.add(planted, hostile(state, how))
    assert writer.close()
    bad = directory / f"{promptcache.token_digest(np.asarray(planted, dtype=np.int32))}{SUFFIX}"
    assert bad.exists()
    with caplog.at_level(logging.WARNING, logger="llmrun.server.promptdirs"):
        vouched = promptdirs.vet_for(name, smollm2_path, n_ctx=2048, n_slots=2,
                                     kv_type="f16", flash_attention="off")
    promptdirs.release(name)
    assert not bad.exists()
    assert f"refused and removed {bad.name}" in caplog.text
    assert list(vouched) == [p.name for p in directory.iterdir()]  # the genuine one
    # the next runner: the planted file is not offered, the genuine one restores whole
    later = PromptCache(directory, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                        n_vocab=model.n_vocab, vouched=vouched)
    hit = later.best([*planted, 5])
    assert hit is not None and hit.n == len(tokens)
    assert later.load(hit.entry) == state


def test_a_planted_file_swapped_in_after_the_check_is_not_read(
        model: Model, smollm2_path: Path, genuine_state: tuple[list[int], bytearray],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """A runner alive beside the new one (a reload overlaps) rewrites a file the daemon
    checked: the new runner hashes the bytes it read and refuses them. A file that came
    after the check is not read at all."""
    from llmrun.server import promptdirs

    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    name = promptdirs.key((smollm2_path,), (), 2048, 2, "f16", "off")
    directory = promptdirs.prepare(name, budget=1 << 30)
    tokens, state = genuine_state
    writer = PromptCache(directory, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                         n_vocab=model.n_vocab)
    writer.add(tokens, state)
    assert writer.close()
    vouched = promptdirs.vet_for(name, smollm2_path, n_ctx=2048, n_slots=2, kv_type="f16",
                                 flash_attention="off")
    promptdirs.release(name)
    assert len(vouched) == 1
    (path,) = directory.glob(f"*{SUFFIX}")
    later = PromptCache(directory, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                        n_vocab=model.n_vocab, vouched=vouched)
    # now the other runner writes its hostile state over it, with the runner's own code
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = PromptCache(elsewhere, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                        n_vocab=model.n_vocab)
    other.add(tokens, hostile(state, "position"))
    assert other.close()
    shutil.copyfile(elsewhere / path.name, path)
    planted = [*tokens, 7, 7]
    other = PromptCache(elsewhere, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                        n_vocab=model.n_vocab)
    other.add(planted, hostile(state, "layer count"))
    assert other.close()
    shutil.copy(elsewhere / f"{promptcache.token_digest(np.asarray(planted))}{SUFFIX}",
                directory)
    hit = later.best([*tokens, 5])
    assert hit is not None
    with caplog.at_level(logging.WARNING, logger="llmrun.runner"):
        assert later.load(hit.entry) is None
    assert "not the file the daemon checked" in caplog.text and not path.exists()
    # a runner started now, before the daemon saw the newer file, does not read it
    assert len(list(directory.glob(f"*{SUFFIX}"))) == 1
    assert PromptCache(directory, name, max_bytes=1 << 30, ram_bytes=0, min_tokens=4,
                       n_vocab=model.n_vocab, vouched=vouched).best([*planted, 5]) is None


@pytest.mark.timeout(600)
def test_a_restarted_daemon_refuses_a_planted_state_and_restores_the_genuine_one(
        model: Model, smollm2_path: Path, tmp_path: Path) -> None:
    """End to end: a runner leaves a genuine state; a hostile one, written as a compromised
    runner would (a longer prefix of the next prompt, so it would be the one loaded), sits
    beside it. The next daemon's runner never hands it to llama.cpp (the daemon removed it
    first, with a log line), and restores the genuine one."""
    home = make_home(tmp_path / "home", smollm2_path)
    d = Daemon(home, env={"LLMRUN_PROMPT_CACHE_SIZE": "1GiB", "LLMRUN_NUM_PARALLEL": "1",
                          "LLMRUN_PROMPT_CACHE_MIN_TOKENS": "256"}).start()
    try:
        n, cached = _cached_tokens(d, "Why is the sky blue?")
        assert cached == 0
        d.stop()
        (genuine,) = (home / "prompt-cache").glob(f"*/*{SUFFIX}")
        raw = genuine.read_bytes()
        head_len = int.from_bytes(raw[8:12], "little")
        head = raw[12:12 + head_len]
        key = head.split(b'"key": "')[1].split(b'"')[0].decode()
        n_tokens = int(head.split(b'"n_tokens": ')[1].split(b",")[0])
        at = 12 + head_len
        tokens = np.frombuffer(raw[at:at + 4 * n_tokens], dtype="<i4").tolist()
        state = bytearray(raw[at + 4 * n_tokens:])
        # what follows the kept prefix in the next prompt: the last user turn's opening
        follow = model.tokenize("<|im_start|>user\n", add_special=False)
        planted = [*tokens, *follow]
        writer = PromptCache(genuine.parent, key, max_bytes=1 << 30, ram_bytes=0,
                             min_tokens=4, n_vocab=model.n_vocab)
        writer.add(planted, hostile(state, "layer count"))
        assert writer.close()
        bad = genuine.parent / f"{promptcache.token_digest(np.asarray(planted))}{SUFFIX}"
        assert bad.exists()

        d.start()
        n2, cached2 = _cached_tokens(d, "Name three prime numbers.")
        logs = "".join(p.read_text(errors="replace")
                       for p in [*(home / "logs").glob("*"), d.log] if p.is_file())
        assert f"refused and removed {bad.name}" in logs, logs[-3000:]
        assert "llama.cpp refused" not in logs  # the loader never saw it
        assert not bad.exists() and genuine.exists()
        assert cached2 >= n - 32, (n, n2, cached2)  # the genuine state, restored
    finally:
        d.stop()


def test_the_daemon_reads_the_format_the_runner_writes() -> None:
    """The daemon may not import the engine: the format's constants are written twice."""
    assert (kvlayout.MAGIC, kvlayout.VERSION, kvlayout.MAX_HEADER, kvlayout.SUFFIX) == \
        (promptcache.MAGIC, promptcache.VERSION, promptcache.MAX_HEADER, promptcache.SUFFIX)
