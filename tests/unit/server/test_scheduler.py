"""The scheduler with fake runners: loads, leases, queue bounds, keep-alive, eviction, reloads
and crashes, in milliseconds. No model, no subprocess; the fakes are steered with asyncio
Events, never with sleeps. The store holds tiny real GGUFs, so the file checks and memory
estimates run as they do in the daemon (about 258 MiB each: mostly the compute allowance)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Message,
    Options,
    Started,
)
from llmrun.server.fit import Device
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.scheduler import Lease, Scheduler
from llmrun.server.service import Service
from llmrun.store import Store
from tests.fakes.scheduler import FakeRunner, Farm, MiB
from tests.fakes.tinymodel import write_tiny_llama

T = TypeVar("T")
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("scheduler-store")
    store = Store(root)
    for i, name in enumerate(["a", "b", "c"]):
        store.create(name, f"FROM {write_tiny_llama(root / f'{name}.gguf', seed=i)}\n")
    return store


def run(test: Awaitable[T]) -> T:
    """Run a test's coroutine; one that hangs fails in a minute, not at the suite's timeout
    (the bound is only for a hang: these tests take milliseconds)."""
    return asyncio.run(asyncio.wait_for(test, 60))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def scheduler(store: Store, tmp_path: Path) -> AsyncIterator[tuple[Scheduler, Farm]]:
    farm = Farm(store)
    sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free)
    try:
        yield sched, farm
    finally:
        await sched.shutdown()


def loaded(sched: Scheduler) -> list[str]:
    return sorted(m.name for m in sched.models())


def waiting(sched: Scheduler) -> int:
    """Requests waiting in the scheduler, for a load or for a runner to be idle (white box:
    nothing outside the scheduler and its tests reads its table)."""
    return sum(m.waiting for m in sched._models.values())


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until `condition` holds (no clock: the bound of `run` fails a
    wait that never ends)."""
    while not condition():
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def holding(sched: Scheduler, name: str, **options: Any) -> AsyncIterator[Lease]:
    async with sched.use(name, Options(**options)) as lease:
        yield lease


async def lease_in_task(sched: Scheduler, name: str, release: asyncio.Event,
                        keep_alive: float | None = None,
                        **options: Any) -> tuple[Lease, asyncio.Task[FakeRunner]]:
    """A task that holds a lease on `name` until `release` is set; returns once it holds it."""
    got: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()

    async def hold() -> FakeRunner:
        async with sched.use(name, Options(**options), keep_alive) as lease:
            got.set_result(lease)
            await release.wait()
            return lease.runner  # type: ignore[return-value]

    task = asyncio.create_task(hold())
    done, _ = await asyncio.wait([got, task], return_when=asyncio.FIRST_COMPLETED)
    if got not in done:
        task.result()  # raises what the lease raised
    return got.result(), task


def test_queue_bound_is_503_at_once(store: Store, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_NUM_PARALLEL", "1")
    monkeypatch.setenv("LLMRUN_MAX_QUEUE", "1")

    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, _):
            release = asyncio.Event()
            _, decoding = await lease_in_task(sched, "a", release)
            _, queued = await lease_in_task(sched, "a", release)  # in the runner's queue
            with pytest.raises(EngineError) as err:
                await lease_in_task(sched, "a", release)  # no await blocked: refused at once
            assert (err.value.code, err.value.retry_after) == ("busy", 1)
            assert "server busy: 2 requests for 'a'" in err.value.message
            release.set()
            await asyncio.gather(decoding, queued)
            async with holding(sched, "a"):  # room again
                pass

    run(go())


def test_queue_bound_counts_requests_waiting_for_a_load(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_NUM_PARALLEL", "1")
    monkeypatch.setenv("LLMRUN_MAX_QUEUE", "1")

    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            gate = farm.gate("a")
            first = asyncio.create_task(lease_in_task(sched, "a", asyncio.Event()))
            second = asyncio.create_task(lease_in_task(sched, "a", asyncio.Event()))
            await until(lambda: waiting(sched) == 2)
            with pytest.raises(EngineError, match="server busy") as err:
                await lease_in_task(sched, "a", asyncio.Event())
            assert err.value.code == "busy"
            gate.set()
            (one, _), (two, _) = await first, await second
            assert one.runner is two.runner and len(farm.of("a")) == 1

    run(go())


def test_keep_alive_expiry(store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            async with sched.use("a", Options(), keep_alive=1.0):
                pass
            (state,) = sched.models()
            assert state.expires_at.endswith("Z") and state.slots_busy == 0
            await sched.reap(now=time.monotonic())
            assert loaded(sched) == ["a:latest"]
            await sched.reap(now=time.monotonic() + 1.5)
            assert loaded(sched) == [] and farm.of("a")[0].stopped
            # negative: forever
            async with sched.use("a", Options(), keep_alive=math.inf):
                pass
            assert sched.models()[0].expires_at == "2318-01-01T00:00:00Z"
            await sched.reap(now=time.monotonic() + 1e9)
            assert loaded(sched) == ["a:latest"]

    run(go())


def test_keep_alive_zero_unloads_once_idle(store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, _):
            release = asyncio.Event()
            _, task = await lease_in_task(sched, "a", release, keep_alive=0)
            assert loaded(sched) == ["a:latest"]  # busy: stays while it runs
            release.set()
            runner = await task
            assert runner.stopped and loaded(sched) == []

            # `llmrun stop` while busy: unloaded when the request ends
            release = asyncio.Event()
            _, task = await lease_in_task(sched, "a", release)
            assert await sched.unload_name("a")
            assert loaded(sched) == ["a:latest"]
            release.set()
            assert (await task).stopped and loaded(sched) == []
            assert not await sched.unload_name("a")

    run(go())


def test_a_removed_name_unloads_its_runner_once_idle(store: Store, tmp_path: Path) -> None:
    """`rm` of a name whose runner is serving: the request finishes on it, then it goes; a
    name of other weights, or one not loaded, is left alone."""
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, _):
            release = asyncio.Event()
            _, task = await lease_in_task(sched, "a", release)
            await sched.forget("b:latest")  # not loaded: nothing happens
            await sched.forget("a:latest")
            assert loaded(sched) == ["a:latest"]  # busy: its request goes on
            release.set()
            runner = await task
            assert runner.stopped and loaded(sched) == []
            # idle: at once
            release = asyncio.Event()
            release.set()
            await (await lease_in_task(sched, "a", release))[1]
            assert loaded(sched) == ["a:latest"]
            await sched.forget("a:latest")
            assert loaded(sched) == []

    run(go())


def test_lru_eviction_by_model_count(store: Store, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_MAX_LOADED_MODELS", "2")

    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            for name in ("a", "b", "a", "c"):  # a used again: b is the least recent
                async with holding(sched, name):
                    pass
            assert loaded(sched) == ["a:latest", "c:latest"]
            assert farm.of("b")[0].stopped and not farm.of("a")[0].stopped

    run(go())


def test_lru_eviction_by_memory_and_never_a_busy_model(store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            farm.memory = 700 * MiB  # room for two fake runners, each needs ~258 MiB free
            for name in ("a", "b", "a"):
                async with holding(sched, name):
                    pass
            async with holding(sched, "c"):
                assert loaded(sched) == ["a:latest", "c:latest"]  # b, least recent, went
                assert farm.of("b")[0].stopped
                # a and c busy: neither is evicted for b, which cannot fit
                async with holding(sched, "a"):
                    with pytest.raises(EngineError, match="is available") as err:
                        await lease_in_task(sched, "b", asyncio.Event())
                    assert err.value.code == "insufficient_memory"
                    assert loaded(sched) == ["a:latest", "c:latest"]
            assert len(farm.of("b")) == 2 and not farm.of("b")[1].started

    run(go())


def test_two_loads_at_once_do_not_count_the_same_free_memory(store: Store,
                                                             tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            farm.memory = 400 * MiB  # room for one ~258 MiB estimate, not two
            gates = [farm.gate("a"), farm.gate("b")]
            tasks = [asyncio.create_task(lease_in_task(sched, n, asyncio.Event()))
                     for n in ("a", "b")]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            (refused,) = done  # while the other waits in start(), its memory counted as used
            with pytest.raises(EngineError) as err:
                refused.result()
            assert err.value.code == "insufficient_memory"
            for gate in gates:
                gate.set()
            (ok,) = pending
            await ok
            assert sum(r.started for r in farm.runners) == 1 and len(loaded(sched)) == 1

    run(go())


def test_other_load_options_wait_for_the_busy_runner_then_reload_once(
        store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            release = asyncio.Event()
            _, stream = await lease_in_task(sched, "a", release, num_ctx=128)
            assert not sched.models()[0].reload_pending
            other_done = asyncio.Event()
            other = asyncio.create_task(lease_in_task(sched, "a", other_done, num_ctx=200))
            await until(lambda: sched.models()[0].reload_pending)
            same = asyncio.create_task(lease_in_task(sched, "a", asyncio.Event(),
                                                     num_ctx=128))
            await until(lambda: waiting(sched) == 2)
            assert not same.done()  # the busy runner's options, but a reload waits: so does it
            (state,) = sched.models()
            assert state.context_length == 128 and len(farm.of("a")) == 1
            release.set()  # the stream ends: the runner drains, then reloads once
            await stream
            lease, _ = await other
            assert lease.runner.info["n_ctx_seq"] == 200
            assert [r.spec.n_ctx for r in farm.of("a")] == [128, 200]
            assert farm.of("a")[0].stopped and farm.side_by_side == 0
            assert sched.models()[0].reload_pending  # `same` waits for `other` in turn
            other_done.set()
            lease, _ = await same
            assert [r.spec.n_ctx for r in farm.of("a")] == [128, 200, 128]
            assert lease.runner is farm.of("a")[2] and farm.side_by_side == 0

    run(go())


def test_a_crashed_runner_fails_its_requests_and_the_next_gets_a_fresh_one(
        store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            service = Service(store, sched)
            req = ChatRequest(model="a", messages=[Message(role="user", content="hi")])
            farm.hold_answers = True
            events = service.chat(req)
            assert isinstance(await anext(events), Started)  # the runner is busy with it
            (first,) = farm.of("a")
            farm.hold_answers = False
            first.die()
            # the next request gets a fresh runner, even while the dead one is still held
            got = [e async for e in service.chat(req) if not isinstance(e, Started)]
            assert [type(e) for e in got] == [Chunk, Done]
            assert isinstance(got[1], Done) and got[1].stats.load_ns == 250_000_000
            second = farm.of("a")[1]
            assert second.alive and loaded(sched) == ["a:latest"] and not first.stopped
            with pytest.raises(EngineError, match="killed by signal"):
                await anext(events)  # the request on the dead runner fails
            assert first.stopped  # stopped once its last request ended

            # dead while idle: the next request replaces it too
            second.die()
            assert await service.count_tokens(req) == 3
            assert len(farm.of("a")) == 3 and second.stopped and farm.side_by_side == 0

    run(go())


def test_a_loaded_model_is_served_while_another_loads(store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            async with holding(sched, "a"):
                pass
            gate = farm.gate("b")
            loading = asyncio.create_task(lease_in_task(sched, "b", asyncio.Event()))
            await farm.entered("b").wait()  # b's load is under way, held in start()
            async with holding(sched, "a") as lease:  # answered while b loads
                assert lease.load_seconds == 0.0
            assert loaded(sched) == ["a:latest"]  # a loading model is not shown yet
            gate.set()
            lease, _ = await loading
            assert lease.load_seconds == 0.25 and loaded(sched) == ["a:latest", "b:latest"]

    run(go())


def test_requests_for_a_loading_model_share_one_load(store: Store, tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            gate = farm.gate("a")

            async def gone() -> None:
                async with holding(sched, "a"):
                    pass

            first = asyncio.create_task(gone())
            await farm.entered("a").wait()
            others = [asyncio.create_task(lease_in_task(sched, "a", asyncio.Event()))
                      for _ in range(2)]
            await until(lambda: waiting(sched) == 3)
            first.cancel()  # the one that began the load goes away: the load goes on
            await until(lambda: waiting(sched) == 2)
            gate.set()
            leases = [lease for lease, _ in await asyncio.gather(*others)]
            assert len(farm.of("a")) == 1 and first.cancelled()
            assert all(x.runner is farm.of("a")[0] and x.load_seconds == 0.25 for x in leases)

    run(go())


def test_a_failed_load_fails_each_waiter_and_leaves_no_entry(store: Store,
                                                             tmp_path: Path) -> None:
    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            gate = farm.gate("a")
            farm.failing.add(farm.path("a"))
            waiters = [asyncio.create_task(lease_in_task(sched, "a", asyncio.Event()))
                       for _ in range(3)]
            await until(lambda: waiting(sched) == 3)
            gate.set()
            errors = await asyncio.gather(*waiters, return_exceptions=True)
            assert all(isinstance(e, EngineError) and "bad tensor" in e.message
                       for e in errors)
            assert len({id(e) for e in errors}) == 3  # each its own
            assert loaded(sched) == [] and farm.of("a")[0].stopped
            farm.failing.clear()
            async with holding(sched, "a"):  # the next request loads afresh
                assert loaded(sched) == ["a:latest"] and len(farm.of("a")) == 2

    run(go())


def test_a_model_file_that_fails_its_check_starts_no_runner(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    store.create("d", f"FROM {write_tiny_llama(tmp_path / 'd.gguf')}\n")

    async def go() -> None:
        async with scheduler(store, tmp_path) as (sched, farm):
            with open(farm.path("d"), "r+b") as fh:  # tamper with the blob
                fh.seek(-4, 2)
                fh.write(b"\xff" * 4)
            with pytest.raises(EngineError, match="modified on disk"):
                async with holding(sched, "d"):
                    pass
            assert not farm.entered("d").is_set() and loaded(sched) == []

    run(go())


def test_shutdown_cancels_a_load_and_its_waiters_hear_why(store: Store,
                                                          tmp_path: Path) -> None:
    async def go() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm,
                          free_memory=farm.free)
        farm.gate("a")
        waiter = asyncio.create_task(lease_in_task(sched, "a", asyncio.Event()))
        await farm.entered("a").wait()
        await sched.shutdown()
        with pytest.raises(EngineError, match="shutting down"):
            await waiter
        assert farm.of("a")[0].stopped and loaded(sched) == []

    run(go())


# -- the fit at load: fake devices -------------------------------------------------------------

def gpu_devices(free: int) -> Callable[[], Awaitable[list[Device]]]:
    async def listing() -> list[Device]:
        return [Device("CPU", "cpu", 1 << 40, 1 << 40),
                Device("FakeGPU0", "gpu", free, free, "a fake GPU")]
    return listing


def test_a_model_that_fits_goes_to_the_gpu_and_ps_says_so(store: Store,
                                                          tmp_path: Path) -> None:
    async def main() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free,
                          devices=gpu_devices(64 << 30))
        try:
            async with holding(sched, "a"):
                pass
            runner = farm.of("a")[0]
            assert runner.placement.devices == ("FakeGPU0",)
            assert runner.placement.n_gpu_layers == runner.placement.layers
            (state,) = sched.models()
            # every layer on the GPU: ps's size is the GPU's part ("100% GPU", as Ollama's
            # full offload), the host's (input embeddings, buffers) only in `devices`
            assert 0 < state.vram == state.memory and set(state.devices) == {"CPU", "FakeGPU0"}
            assert state.devices["CPU"] > 0 and state.devices["FakeGPU0"] == state.vram
            async with holding(sched, "b", num_gpu=0):
                pass
            assert farm.of("b")[0].placement.n_gpu_layers == 0
            assert next(m for m in sched.models() if m.name.startswith("b")).vram == 0
        finally:
            await sched.shutdown()
    run(main())


def test_a_load_that_fails_on_the_gpu_is_retried_with_fewer_layers(store: Store,
                                                                 tmp_path: Path) -> None:
    async def main() -> None:
        farm = Farm(store)
        tried: list[int] = []
        made = farm.__call__

        def factory(spec: RunnerSpec, log_path: Path) -> FakeRunner:
            runner = made(spec, log_path)
            start = runner.start

            async def start_on_gpu() -> None:
                layers = runner.placement.n_gpu_layers
                tried.append(layers)
                if layers > 0:
                    raise EngineError("the model runner failed to load the model: "
                                      "out of device memory")
                await start()
            runner.start = start_on_gpu  # type: ignore[method-assign]
            return runner

        sched = Scheduler(store, tmp_path / "logs", runner_factory=factory,
                          free_memory=farm.free, devices=gpu_devices(64 << 30))
        try:
            async with holding(sched, "a") as lease:
                assert lease.runner.placement.n_gpu_layers == 0
            assert tried[0] > 0 and tried[-1] == 0 and tried == sorted(tried, reverse=True)
            assert len(tried) >= 2 and sched.models()[0].vram == 0
        finally:
            await sched.shutdown()
    run(main())


def test_no_gpu_listed_is_the_cpu_as_before(store: Store, tmp_path: Path) -> None:
    async def main() -> None:
        async def cpu_only() -> list[Device]:
            return [Device("CPU", "cpu", 1 << 40, 1 << 40)]
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free,
                          devices=cpu_only)
        try:
            async with holding(sched, "a"):
                pass
            (state,) = sched.models()
            assert farm.of("a")[0].placement.n_gpu_layers == 0
            assert state.vram == 0 and state.devices == {"CPU": state.memory}
        finally:
            await sched.shutdown()
    run(main())


def test_the_default_context_follows_memory_once_and_what_names_one_wins(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing names a context: a fake 30 GiB GPU gets Ollama's 32k, a CPU with room the
    largest step (capped at the model's trained 1M); chosen at the first load and kept when
    free memory falls, so the next request reuses the runner. A request's num_ctx, or
    LLMRUN_CONTEXT_LENGTH, wins over it."""
    monkeypatch.delenv("LLMRUN_CONTEXT_LENGTH", raising=False)
    big = write_tiny_llama(tmp_path / "long.gguf", n_ctx=1 << 20)
    store.create("long", f"FROM {big}\n")
    store.create("long2", f"FROM {write_tiny_llama(tmp_path / 'l2.gguf', seed=9, n_ctx=1 << 20)}\n")

    async def main() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free,
                          devices=gpu_devices(30 << 30))
        try:
            async with holding(sched, "long") as lease:
                assert lease.runner.spec.n_ctx == 32768  # type: ignore[attr-defined]
        finally:
            await sched.shutdown()
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free)
        try:
            async with holding(sched, "long2"):
                pass
            assert farm.of("long2")[0].spec.n_ctx == 262144
            farm.memory = 1 << 30  # memory falls: the choice stands, the runner is reused
            async with holding(sched, "long2"):
                pass
            assert len(farm.of("long2")) == 1
            async with holding(sched, "long2", num_ctx=4096):
                pass
            assert farm.of("long2")[-1].spec.n_ctx == 4096
            monkeypatch.setenv("LLMRUN_CONTEXT_LENGTH", "8192")
            async with holding(sched, "long2"):
                pass
            assert farm.of("long2")[-1].spec.n_ctx == 8192
        finally:
            await sched.shutdown()
    run(main())
