"""The daemon stops a runner whose prompt-cache directory outgrows its budget: RLIMIT_FSIZE
bounds each file a runner writes, this bounds how many (a runner taken over by a crafted
file could otherwise fill the disk with files each under the limit)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from llmrun import protocol
from llmrun.server import runners
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.runners import RunnerProcess


class FakeProc:
    pid = 4242
    returncode: int | None = None

    def kill(self) -> None:
        self.returncode = -9

    async def wait(self) -> int:
        return self.returncode or 0


def watched(tmp_path: Path, budget: int) -> RunnerProcess:
    handle = RunnerProcess(RunnerSpec((Path("m.gguf"),), 64, 1, 1, prompt_cache_size=budget),
                           tmp_path / "runner.log")
    handle.proc = FakeProc()  # type: ignore[assignment]
    handle._ready = asyncio.get_running_loop().create_future()
    handle._ready.set_result(protocol.Fatal(error="(started)"))
    handle._watch_cache(tmp_path / "cache")
    return handle


def test_a_runner_filling_its_cache_directory_is_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runners, "CACHE_WATCH_SECONDS", 0.01)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "old.kv").write_bytes(bytes(1000))  # what an earlier runner kept

    async def run() -> None:
        handle = watched(tmp_path, budget=1 << 20)
        assert handle._cache_limit == 1000 + 2 * (1 << 20) + 4 * 64 + runners.CACHE_SLACK
        q = handle._track("r1")
        watch = asyncio.create_task(handle._cache_watch())
        await asyncio.sleep(0.1)
        assert handle.alive  # within its budget: left alone
        for i in range(3):  # files each under its RLIMIT_FSIZE, together past the limit
            (tmp_path / "cache" / f"{i}.kv").write_bytes(bytes(handle._cache_limit // 2))
        await asyncio.wait_for(watch, 10)
        kind, payload = q.get_nowait()
        assert kind == "error" and "prompt-cache directory" in payload["message"]
        assert not handle.alive
        assert handle._lost_task is not None
        await handle._lost_task
        assert handle.proc is not None and handle.proc.returncode == -9

    asyncio.run(run())


def test_a_runner_within_its_budget_is_left_alone(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runners, "CACHE_WATCH_SECONDS", 0.01)
    (tmp_path / "cache").mkdir()

    async def run() -> Any:
        handle = watched(tmp_path, budget=1 << 20)
        watch = asyncio.create_task(handle._cache_watch())
        # a state being written while the budget is full: the most a legit runner holds
        (tmp_path / "cache" / "a.kv").write_bytes(bytes(1 << 20))
        (tmp_path / "cache" / ".kv-tmp").write_bytes(bytes(1 << 20))
        await asyncio.sleep(0.2)
        assert handle.alive
        handle.proc.returncode = 0  # type: ignore[union-attr]
        await asyncio.wait_for(watch, 10)

    asyncio.run(run())
