"""The prompt cache (engine/promptcache.py): states of long prompts kept past their slot and
their runner.

Its files are read back by a later runner, so the tests try to break that: damaged, cut,
foreign and mismatched files, a budget, and, on the real model, that a restored prompt
answers exactly as one read from scratch (flash attention off: with it on, llama.cpp's
attention takes other code paths by batch shape, so even plain prefix reuse is not
bit-exact; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from llmrun.engine.llama import Model
from llmrun.engine.promptcache import SUFFIX, PromptCache
from tests.conftest import Daemon, make_home, runner_pids, wait_until
from tests.integration.test_engine import Harness

VOCAB = 1000


def make(directory: Path | None, **kw: int) -> PromptCache:
    args = {"max_bytes": 1 << 20, "ram_bytes": 1 << 20, "min_tokens": 4, "n_vocab": VOCAB}
    return PromptCache(directory, "key-1", **{**args, **kw})


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
        later = make(tmp_path, ram_bytes=0)
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

    # one byte per write call: this 8 MB state would take far longer than the stop allows
    monkeypatch.setattr(promptcache, "WRITE_PIECE", 1)
    cache = make(tmp_path, max_bytes=64 << 20, ram_bytes=0)
    cache.add(list(range(1, 40)), state(8 << 20))
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


def _chat(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_a_restored_prompt_answers_exactly_as_a_cold_one(model: Model, tmp_path: Path) -> None:
    def cache() -> PromptCache:
        return PromptCache(tmp_path, "smollm2", max_bytes=1 << 30, ram_bytes=0,
                           min_tokens=256, n_vocab=model.n_vocab)

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
    # a new runner: the state comes from its file
    warm = Harness(model, slots=2, n_ctx=2048, flash_attn=False, prompt_cache=cache())
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
            folder.mkdir(exist_ok=True)
            return PromptCache(folder, "gemma", max_bytes=1 << 30, ram_bytes=0,
                               min_tokens=256, n_vocab=gemma.n_vocab)

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


def test_a_state_read_from_disk_stalls_no_other_sequence(model: Model, tmp_path: Path) -> None:
    """A restore reads and checks tens of MB: it happens off the engine thread, so a sequence
    already decoding keeps going while it lasts, and a request cancelled meanwhile ends."""
    def cache(cls: type[PromptCache] = PromptCache) -> PromptCache:
        return cls(tmp_path, "smollm2", max_bytes=1 << 30, ram_bytes=0, min_tokens=256,
                   n_vocab=model.n_vocab)

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
