"""The scheduler's runners without processes: FakeRunner answers at once (or when a test lets
it), and Farm, the scheduler's runner factory, keeps them for a test to steer and plays the
machine's free memory. Steered with asyncio Events, never with sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from llmrun.request import ChatRequest, Chunk, Done, EngineError, Started, Stats
from llmrun.server import work
from llmrun.server.fit import Placement
from llmrun.server.loadspec import RunnerSpec
from llmrun.store import Store

MiB = 1 << 20
RUNNER_MEMORY = 300 * MiB  # what a live fake runner takes from the free memory


class FakeRunner:
    """A runner without a process. start() waits for its model's gate when the test set one
    (and fails if the test said so); generate() answers at once, or once `finish` is set if
    the farm held answers when it was made; it fails once the runner has died."""

    def __init__(self, farm: Farm, spec: RunnerSpec) -> None:
        self.farm = farm
        self.spec = spec
        self.model = spec.model_paths[0]
        self.info: dict[str, Any] = {"n_ctx_seq": spec.n_ctx, "sandbox": ["fake"],
                                     "confined": True}
        self.engine_stats: dict[str, Any] = {}
        self.placement: Placement | None = None
        self.memory = 0
        self.load_seconds = 0.0
        self.started = self.stopped = self.dead = False
        self.in_flight = 0
        self.finish = asyncio.Event()  # generate() answers once set
        if not farm.hold_answers:
            self.finish.set()
        self.entered = asyncio.Event()  # start() was called

    @property
    def alive(self) -> bool:
        return self.started and not self.stopped and not self.dead

    @property
    def busy(self) -> int:
        return self.in_flight

    async def start(self) -> None:
        side_by_side = [r for r in self.farm.runners if r.model == self.model and r.alive]
        self.farm.side_by_side = max(self.farm.side_by_side, len(side_by_side))
        self.entered.set()
        self.farm.entered(self.model).set()
        gate = self.farm.gates.get(self.model)
        if gate is not None:
            await gate.wait()
        if self.model in self.farm.failing:
            raise EngineError("the model runner failed to load the model: bad tensor")
        self.load_seconds = 0.25
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def die(self) -> None:
        """As when the process is killed: what is in flight fails."""
        self.dead = True
        self.finish.set()

    async def generate(self, req: ChatRequest) -> AsyncIterator[Started | Chunk | Done]:
        self.in_flight += 1
        try:
            yield Started(prompt_tokens=3, n_ctx=self.spec.n_ctx)
            await self.finish.wait()
            if self.dead:
                raise EngineError("the model runner stopped: it was killed by signal SIGKILL")
            yield Chunk(text="hi")
            yield Done(stats=Stats(prompt_tokens=3, completion_tokens=1))
        finally:
            self.in_flight -= 1

    async def run(self, job: Any) -> Any:
        """A one-answer kind of work (server/work.py), answered by its kind in ANSWERS."""
        return ANSWERS[type(job)](job)


# What a FakeRunner answers each kind of work: fixed counts and tokens, unit vectors, and
# rerank scores by which a longer document scores higher (an order a test can predict).
ANSWERS: dict[type, Callable[[Any], Any]] = {
    work.Counting: lambda job: {"prompt_tokens": 3, "n_ctx": 512, "prompt": "hi",
                                "tokens": [1, 2, 3]},
    work.Tokenizing: lambda job: {"tokens": [1] * len(job.text), "pieces": list(job.text)},
    work.Detokenizing: lambda job: {"content": "x" * len(job.tokens)},
    work.Embedding: lambda job: ([[1.0] for _ in job.inputs], len(job.inputs)),
    work.Reranking: lambda job: ([len(d) / (1 + len(d)) for d in job.documents],
                                 len(job.documents)),
}


class Farm:
    """The scheduler's runner factory: makes FakeRunners and keeps them for the test to steer,
    and plays the machine's free memory (less RUNNER_MEMORY for each live runner)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.runners: list[FakeRunner] = []
        self.gates: dict[Path, asyncio.Event] = {}  # start() for this model waits for it
        self.failing: set[Path] = set()  # start() for this model fails
        self._entered: dict[Path, asyncio.Event] = {}
        self.hold_answers = False  # runners made now answer only once their `finish` is set
        self.memory = 1 << 40
        self.side_by_side = 0  # most runners of one model alive when another started

    def __call__(self, spec: RunnerSpec, log_path: Path) -> FakeRunner:
        runner = FakeRunner(self, spec)
        self.runners.append(runner)
        return runner

    def free(self) -> int:
        return self.memory - RUNNER_MEMORY * sum(r.alive for r in self.runners)

    def path(self, name: str) -> Path:
        _, manifest = self.store.get(name)
        return self.store.model_paths(manifest)[0]

    def gate(self, name: str) -> asyncio.Event:
        """Hold `name`'s loads in start() until the returned event is set."""
        return self.gates.setdefault(self.path(name), asyncio.Event())

    def entered(self, model: str | Path) -> asyncio.Event:
        """Set once a runner for `model` (a name or its file) is in start()."""
        path = self.path(model) if isinstance(model, str) else model
        return self._entered.setdefault(path, asyncio.Event())

    def of(self, name: str) -> list[FakeRunner]:
        return [r for r in self.runners if r.model == self.path(name)]
