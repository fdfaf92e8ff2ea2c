"""The decode thread count follows the CPU other processes take (engine/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun.engine.batcher import Engine, SeqParams
from llmrun.engine.llama import Context, Model
from llmrun.engine.threads import CpuSample, ProcCpu, ThreadGovernor
from tests.conftest import wait_until
from tests.integration.test_engine import GREEDY, Harness


class FakeMachine:
    """CPU samples on a clock the test moves: `others` cores busy besides this process."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def run(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.now, self.busy, self.own)


def governor(machine: FakeMachine, cores: int = 2, max_threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(max_threads, cores=cores, sample=machine.sample,
                          clock=lambda: machine.now)


def test_a_busy_core_beside_the_decode_costs_it_one_thread_and_gives_it_back() -> None:
    m = FakeMachine()
    g = governor(m)
    m.run(1.0, others=0.1)  # the daemon and its clients: a tenth of a core
    assert g.advise() is None and g.threads == 2
    m.run(1.0, others=0.67)  # a busy loop, sharing two cores with two spinning threads
    assert g.advise() == 1
    m.run(1.0, others=1.0)
    assert g.advise() is None and g.threads == 1
    m.run(1.0, others=0.05)  # the busy loop ended
    assert g.advise() == 2


def test_the_count_holds_between_the_two_thresholds() -> None:
    m = FakeMachine()
    g = governor(m)
    for others in (0.45, 0.3, 0.45):  # below GIVE_UP at two threads: no change
        m.run(1.0, others)
        assert g.advise() is None and g.threads == 2
    m.run(1.0, 0.8)
    assert g.advise() == 1
    for others in (0.5, 0.3, 0.45):  # above TAKE_BACK at one thread: no change
        m.run(1.0, others)
        assert g.advise() is None and g.threads == 1


def test_many_cores_and_a_smaller_maximum() -> None:
    m = FakeMachine()
    g = governor(m, cores=16, max_threads=4)
    m.run(1.0, others=10.0)  # six cores still free: four threads fit
    assert g.advise() is None and g.threads == 4
    m.run(1.0, others=14.0)  # two free
    assert g.advise() == 2
    m.run(1.0, others=15.9)
    assert g.advise() == 1
    m.run(1.0, others=40.0)  # more than the machine (steal, rounding): still one
    assert g.advise() is None and g.threads == 1


def test_it_reads_once_a_window_and_ignores_a_window_spanning_idle_time() -> None:
    m = FakeMachine()
    g = governor(m)
    m.run(0.5, others=2.0)
    assert g.advise() is None and g.threads == 2  # not a full window yet: nothing read
    m.run(30.0, others=0.0)
    m.run(0.0, others=2.0)
    assert g.advise() is None and g.threads == 2  # idle for 30 s: no judgement, new baseline
    m.run(1.0, others=1.5)
    assert g.advise() == 1


def test_no_proc_means_no_advice() -> None:
    g = ThreadGovernor(4, cores=4, sample=lambda: None, clock=lambda: 100.0)
    assert g.advise() is None and g.threads == 4


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")
def test_proc_cpu_counts_this_process_and_the_machine() -> None:
    read = ProcCpu()
    a = read()
    spin = 0
    while (b := read()) is not None and b.own - a.own < 0.05:  # type: ignore[union-attr]
        spin += 1
    assert a is not None and b is not None
    assert b.own > a.own and b.busy >= a.busy + (b.own - a.own) * 0.5
    assert b.at > a.at


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


class Flipper:
    """A governor that changes the thread count at every step: 1, 2, 1, 2, ..."""

    def __init__(self) -> None:
        self.threads = 1
        self.others = 0.0
        self.changes = 0

    def advise(self) -> int:
        self.threads = 3 - self.threads
        self.changes += 1
        return self.threads


def test_changing_the_thread_count_mid_decode_changes_no_token(model: Model) -> None:
    plain = Harness(model, slots=2)
    try:
        want = plain.wait(plain.submit("Write a poem about cats.", max_tokens=40),
                          plain.submit("Why is the sky blue?", max_tokens=40))
    finally:
        plain.close()
    flipping = Harness(model, slots=2)
    flipper = Flipper()
    flipping.engine.governor = flipper  # type: ignore[assignment]
    try:
        got = flipping.wait(flipping.submit("Write a poem about cats.", max_tokens=40),
                            flipping.submit("Why is the sky blue?", max_tokens=40))
    finally:
        flipping.close()
    assert flipper.changes >= 40
    assert got == want


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_busy_loop_beside_the_engine_takes_a_thread_from_it(model: Model) -> None:
    cores = len(os.sched_getaffinity(0))
    ctx = Context(model, n_ctx_seq=4096, n_seq=1, n_batch=512, n_threads=cores)
    gov = ThreadGovernor(cores)
    engine = Engine(model, ctx, n_ctx_seq=4096, n_slots=1, emit=lambda events: None,
                    governor=gov)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    engine.start()
    try:
        prompt = model.tokenize("Once upon a time", add_special=True)
        engine.submit("long", prompt, SeqParams(sampling=dict(GREEDY), max_tokens=4000))
        # whatever else this machine runs only adds to the busy loop's core
        wait_until(lambda: gov.threads < cores, timeout=120, what="a thread given up")
    finally:
        hog.kill()
        hog.wait()
        engine.cancel("long")
        engine.stop()
        ctx.close()
