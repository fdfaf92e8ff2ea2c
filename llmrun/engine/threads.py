"""How many threads to decode with, given what else the machine is running.

llama.cpp's CPU threads meet at a spinning barrier several times per layer. When one of them
loses its core to another process, the others spin until it is scheduled again, so a thread
count that needs every core collapses when anything else is busy: on 2 cores beside a one-core
busy loop, 2 threads decode at 6.7 tok/s and 1 thread at 39.6 (docs/benchmarks.md). The daemon
itself is such a process: it encodes and sends every token the runner makes.

`ThreadGovernor` watches the CPU time the rest of the machine takes (all CPU time in
/proc/stat less this process's own, so the runner's spinning threads never count against
themselves) and advises the largest thread count that leaves those cores alone, between 1 and
the configured maximum. It is asked once per decode step and reads /proc at most once a
second; llama.cpp takes a new count between two decodes (llama_set_n_threads).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmrun import config

# How long a measurement spans, and how old one may be before it says nothing about now.
WINDOW_SECONDS = 1.0
STALE_SECONDS = 5.0
# How much of a core other processes must take beyond the spare cores before a decode
# thread is given up, and how little of one they may take of the cores a thread more would
# need before it is taken back. The gap keeps the count from flapping; the daemon's own work
# (and a benchmark client's) is about a tenth of a core.
GIVE_UP = 0.5
TAKE_BACK = 0.25


@dataclass(frozen=True)
class CpuSample:
    at: float  # monotonic seconds
    busy: float  # CPU-seconds the whole machine spent busy (all cores, steal included)
    own: float  # CPU-seconds of this process (all its threads)


class ProcCpu:
    """Reads machine-wide busy time and this process's from /proc. The files are opened once,
    before the runner's sandbox closes /proc/stat to new opens, and read again in place."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK")
        try:
            self._stat: int | None = os.open("/proc/stat", os.O_RDONLY | os.O_CLOEXEC)
            self._self = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # not Linux, or /proc is not mounted: no advice
            self._stat = None

    def __call__(self) -> CpuSample | None:
        if self._stat is None:
            return None
        try:
            machine = os.pread(self._stat, 256, 0).split(b"\n", 1)[0].split()
            own = os.pread(self._self, 1024, 0).rsplit(b")", 1)[1].split()
        except OSError:
            return None
        # cpu  user nice system idle iowait irq softirq steal ...
        values = [int(v) for v in machine[1:9]]
        busy = sum(values) - values[3] - values[4]
        return CpuSample(time.monotonic(), busy / self._tick,
                         (int(own[11]) + int(own[12])) / self._tick)


class ThreadGovernor:
    """Advises a decode thread count between 1 and `max_threads` (see the module's doc)."""

    def __init__(self, max_threads: int, cores: int | None = None,
                 sample: Callable[[], CpuSample | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or config.usable_cores()
        self.threads = self.max_threads
        self.others = 0.0  # cores the rest of the machine took in the last window
        self._sample = sample or ProcCpu()
        self._clock = clock  # the samples' clock
        self._last = self._sample()

    def advise(self) -> int | None:
        """A new thread count when it should change now, else None."""
        if self._last is None:
            return None  # no /proc: keep the configured count
        if self._clock() - self._last.at < WINDOW_SECONDS:
            return None
        current = self._sample()
        if current is None:
            return None
        previous, self._last = self._last, current
        elapsed = current.at - previous.at
        if elapsed > STALE_SECONDS:
            return None  # the engine was idle: this window says little about now
        others = ((current.busy - previous.busy) - (current.own - previous.own)) / elapsed
        self.others = max(0.0, others)
        wanted = self._wanted(self.others)
        if wanted == self.threads:
            return None
        self.threads = wanted
        return wanted

    def _wanted(self, others: float) -> int:
        """The count that leaves `others` cores alone: one thread fewer once the others
        take GIVE_UP of a core more than the spare cores, one more once they leave a core
        free but TAKE_BACK; in between, the count stays."""
        down = math.floor(self.cores - others + GIVE_UP)
        up = math.floor(self.cores - others + TAKE_BACK)
        wanted = down if down < self.threads else up if up > self.threads else self.threads
        return max(1, min(self.max_threads, wanted))
