"""The daemon's handle on one runner process: start it, relay requests, survive its death.

Each request gets an id and an asyncio queue; the channel (ipc.FrameProtocol) routes the
runner's event frames to those queues as they arrive. When the process dies (crash, SIGKILL,
OOM) every request in flight gets a clear error and the handle is marked dead, so the
scheduler starts a fresh runner next time.
A watchdog does the same to a runner that has requests in flight and sends nothing for
LLMRUN_WATCHDOG (the engine sends a heartbeat at least once a second while it works).

The conversation is llmrun.protocol's: the Load message first (the spec, the placement, the
prompt-cache directory), then requests; every frame the runner sends is checked by
protocol.parse_reply before anything reads it, and one that is no message of the protocol
stops the runner (its requests fail, a fresh runner serves the next).

A runner parses untrusted model files, so what it sends is hostile input (server/runnerguard):
each frame's volume is bounded (text per event, events per frame, frames per second), its
bytes must be UTF-8 JSON, it may pass no file descriptors (ipc.SocketTransport), and its
Ready must agree with the Load. A runner past any of these is stopped like one that sends
a malformed message.

Frames are checked before they are sent: one over ipc.MAX_FRAME would make the runner drop
the channel (and every request on it), so it fails only its own request, with 413. Large
embedding and rerank batches go to the runner in pieces (server/work.py: each kind of work's
message and how its answer is read; this module only submits a request and routes its events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from llmrun import childenv, config, ipc, protocol
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Progress,
    Started,
    error_event,
)
from llmrun.server import promptdirs, runnerguard, runnerlog, work
from llmrun.server.fit import Placement
from llmrun.server.loadspec import RunnerSpec, load_message

log = logging.getLogger(__name__)
T = TypeVar("T")
LOAD_TIMEOUT = 300.0
# Seconds a finished or cancelled request's late events are still expected from its runner
# (it reads the cancel between two steps: a step is milliseconds, a long prompt's a few s)
ENDED_GRACE = 60.0


# beyond a prompt-cache directory's budget (twice: the states kept and one being written)
# and its tokens: headers and slack for a state renamed as another is removed
CACHE_SLACK = 16 << 20
CACHE_WATCH_SECONDS = 1.0


def _dir_size(directory: Path) -> int:
    """Bytes in the files directly in `directory` (a runner can make no subdirectory)."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def runner_env() -> dict[str, str]:
    """A runner's environment: the daemon's, scrubbed of credentials (childenv), plus the
    settings it reads, resolved here so that it needs no config.yaml of its own."""
    return childenv.scrubbed({"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                              "GGML_NO_BACKTRACE": "1",  # no gdb on abort (it cannot exec)
                              "LLMRUN_SANDBOX": config.sandbox_mode()})


def why_stopped(code: int | None, exc: BaseException) -> str:
    """Why a runner stopped (its exit status `code`, else `exc`), for the client: no server
    paths (the daemon's log names the runner's log, see RunnerProcess._died)."""
    if code is not None and code < 0:
        return f"it was killed by signal {signal.Signals(-code).name}"
    if code is not None:
        reason = ipc.EXIT_REASONS.get(code)
        return f"it exited with status {code}" + (f" ({reason})" if reason else "")
    return type(exc).__name__


class RunnerProcess:
    """The daemon's handle on one runner process (whose side is engine/host.py's ModelHost)."""

    def __init__(self, spec: RunnerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.info: dict[str, Any] = {}
        self.engine_stats: dict[str, Any] = {}  # the engine's step counters (batcher.EngineStats)
        self.proc: asyncio.subprocess.Process | None = None
        self._channel: ipc.FrameProtocol | None = None
        self._ready: asyncio.Future[protocol.Reply] | None = None  # its first message
        self._queues: dict[str, runnerguard.EventQueue] = {}
        self._unread = runnerguard.Unread()  # what its clients have not read yet
        self._width: int | None = None  # its embeddings' (the first reply's)
        self._cancels: set[asyncio.Task[None]] = set()  # of requests failed here
        # requests that ended here lately (id -> when): the runner may still send their last
        # events before it reads their cancel; an id neither in flight nor here is a lie
        self._ended: dict[str, float] = {}
        self._lost_task: asyncio.Task[None] | None = None  # reporting the channel's end
        self.dead_reason: str | None = None
        self.load_seconds = 0.0
        self._last_frame = time.monotonic()  # when the runner last showed progress
        self._watch_task: asyncio.Task[None] | None = None
        self._stopping = False  # stop() was asked: the process ending is no news
        self._cache_key: str | None = None  # its prompt-cache directory, while it runs
        self.placement: Placement | None = None  # the scheduler's fit: where layers go
        self.memory = 0  # the scheduler's estimate of what the load needs, in bytes
        self._guard = runnerguard.Guard(spec.n_slots)  # bounds on what the runner sends
        self._log_thread: threading.Thread | None = None  # copying its output to the log
        self._cache_dir: Path | None = None  # its prompt-cache directory, while it runs
        self._cache_limit = 0  # bytes that directory may hold before the runner is stopped
        self._cache_task: asyncio.Task[None] | None = None  # watching that directory

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.proc is not None and self.proc.returncode is None

    @property
    def busy(self) -> int:
        return len(self._queues)

    async def start(self) -> None:
        t0 = time.perf_counter()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # its stdout and stderr: a pipe this daemon copies to the log, size-capped
        # (server/runnerlog.py), never a file the runner could grow itself
        logfile, self._log_thread = runnerlog.start(self.log_path)
        load = self._load()
        cmd = [sys.executable, "-m", "llmrun.engine.runner", "--fd", str(child.fileno())]
        try:
            # A session of its own: the signal a terminal (Ctrl+C) or `kill -TERM -PGID` sends
            # the daemon's process group would kill the runner mid-write of a prompt state.
            # The runner takes its stop from the daemon (a shutdown message, or the channel
            # closing when the daemon is gone) and finishes its writes first.
            self.proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=logfile, stderr=logfile,
                pass_fds=(child.fileno(),), env=runner_env(), start_new_session=True,
            )
        finally:
            child.close()
            os.close(logfile)
        self._ready = asyncio.get_running_loop().create_future()
        if self._cache_dir is not None:
            self._cache_task = asyncio.create_task(self._cache_watch())
        self._channel = ipc.FrameProtocol(self._on_message, self._on_lost)
        ipc.SocketTransport(parent, self._channel)
        try:
            if load.prompt_cache is not None:
                # while the runner's interpreter starts: the states earlier runners left,
                # checked before this one may read them (promptdirs.vet)
                s = self.spec
                vouched = await asyncio.to_thread(
                    promptdirs.vet_for, load.prompt_cache_key, s.model_paths[0],
                    n_ctx=s.n_ctx, n_slots=s.n_slots, kv_type=s.kv_type,
                    flash_attention=s.flash_attention)
                load = replace(load, prompt_cache_vouched=vouched)
            self._channel.write(ipc.encode(load))  # the first message: what to load, and how
            await self._channel.drain()
            msg = await asyncio.wait_for(asyncio.shield(self._ready), LOAD_TIMEOUT)
        except protocol.ProtocolError as exc:
            await self.kill()
            raise EngineError("the model runner failed to load the model: it sent a "
                              f"malformed message ({exc})") from None
        except (TimeoutError, ConnectionError) as exc:
            await self.kill()
            why = f"it sent {exc}" if isinstance(exc, ipc.BadFrame) else self._why(exc)
            raise EngineError(f"the model runner failed to start: {why}") from None
        match msg:
            case protocol.Ready(info=info):
                pid = self.proc.pid
                lie = runnerguard.check_ready(info, load, pid)
                if lie:
                    log.error("runner pid %s: its ready message %s", pid, lie)
                    await self.kill()
                    raise EngineError("the model runner failed to load the model: its ready "
                                      f"message {lie}")
                self.info = dict(info)
            case protocol.Fatal(error=error):
                await self.kill()
                raise EngineError(f"the model runner failed to load the model: {error}")
            case _:
                await self.kill()
                raise EngineError("the model runner failed to load the model: it sent "
                                  f"{msg.type!r} before saying it was ready")
        self.load_seconds = time.perf_counter() - t0
        self._watch_task = asyncio.create_task(self._watchdog(config.watchdog_seconds()))

    def _load(self) -> protocol.Load:
        """The Load message for this runner: its spec, the scheduler's placement, and the
        prompt-cache directory (prepared here, released when the runner is gone)."""
        s = self.spec
        cache_dir, cache_key = None, ""
        if s.prompt_cache_size > 0:
            cache_key = promptdirs.key(s.model_paths, s.lora_paths, s.n_ctx, s.n_slots,
                                        s.kv_type, s.flash_attention)
            try:
                cache_dir = str(promptdirs.prepare(cache_key, s.prompt_cache_size))
                self._cache_key = cache_key  # released when this runner is gone
                self._watch_cache(Path(cache_dir))
            except OSError as exc:  # the runner keeps states in memory only
                log.warning("prompt cache: cannot use %s on disk: %s", cache_key, exc)
        return load_message(s, self.placement, self.memory, cache_dir, cache_key)

    def _why(self, exc: BaseException) -> str:
        return why_stopped(self.proc.returncode if self.proc else None, exc)

    def _died(self, reason: str) -> None:
        """Mark the runner dead and fail every request in flight with `reason`."""
        if self.dead_reason is not None and self.dead_reason != "stopped":
            return  # already reported (the watchdog, then the channel closing)
        self.dead_reason = reason
        pid = self.proc.pid if self.proc else None
        log.log(logging.INFO if self._stopping else logging.ERROR, "%s (runner pid %s, log: %s)",
                reason, pid, self.log_path)
        for q in self._queues.values():
            q.put_nowait(("error", error_event("runner_failed", reason)))

    def _watch_cache(self, directory: Path) -> None:
        """Watch `directory`, the runner's prompt-cache directory, from now on: what it may
        hold is what it holds now, plus the budget, plus one state being written before the
        oldest is removed (each file is bounded by the runner's RLIMIT_FSIZE, their number
        only by this)."""
        s = self.spec
        self._cache_dir = directory
        self._cache_limit = (_dir_size(directory) + 2 * s.prompt_cache_size + 4 * s.n_ctx
                             + CACHE_SLACK)

    async def _cache_watch(self) -> None:
        """Stop a runner whose prompt-cache directory grew past its limit (looked at each
        second, from its start: it could write while it loads too): no runner keeping its
        budget gets there, one taken over by a crafted file filling the disk does."""
        while self._cache_dir is not None and self.proc is not None \
                and self.proc.returncode is None:
            await asyncio.sleep(CACHE_WATCH_SECONDS)
            if self._cache_dir is None:
                return
            size = await asyncio.to_thread(_dir_size, self._cache_dir)
            if size <= self._cache_limit:
                continue
            what = f"wrote {size} bytes to its prompt-cache directory (at most " \
                   f"{self._cache_limit})"
            if self._ready is not None and self._ready.done():
                self._stop_runner(what, "wrote more to its prompt-cache directory than its "
                                  "budget allows and was stopped")
            else:  # (start() reports the failed start)
                log.error("runner pid %s %s", self.proc.pid, what)
                self._cache_task = None  # (kill() must not cancel this task mid-kill)
                await self.kill()
            return

    async def _watchdog(self, limit: float) -> None:
        """Kill a runner that has requests in flight and sends nothing for `limit` seconds
        (its engine heartbeats every second while busy, so this is a hang, not slowness)."""
        while self.alive:
            await asyncio.sleep(min(1.0, limit / 4))
            if self._queues and time.monotonic() - self._last_frame > limit:
                self._died(f"the model runner made no progress for {limit:g} s and was "
                           "restarted")
                await self.kill()
                return

    def _track(self, req_id: str, kinds: frozenset[str] = runnerguard.GENERATE_KINDS,
               budget: int | None = None, client: bool = False) -> runnerguard.EventQueue:
        """A queue for the events of request `req_id`: those `kinds`, `budget` bytes of them
        at most; `client`: read at a client's pace (what waits counts in MAX_UNREAD)."""
        if not self._queues:
            self._last_frame = time.monotonic()  # idle until now: the watchdog starts here
        q = runnerguard.EventQueue(kinds, budget, self._unread if client else None)
        self._queues[req_id] = q
        return q

    async def _send(self, msg: protocol.Command) -> None:
        if self._channel is None or not self.alive:
            raise EngineError(f"the model runner is not running ({self.dead_reason})")
        try:
            frame = ipc.checked(ipc.encode(msg))
        except ipc.FrameTooLarge as exc:
            raise EngineError(
                f"the request is too large for the model runner: {exc.size} bytes encoded, "
                f"over the limit of {ipc.MAX_FRAME} bytes per message",
                code="too_large", details={"size": exc.size, "limit": ipc.MAX_FRAME},
            ) from None
        except (ValueError, RecursionError):
            raise EngineError("the request is nested too deeply to pass to the model runner",
                              code="invalid_request") from None
        try:
            self._channel.write(frame)
            await self._channel.drain()
        except ConnectionError:
            raise EngineError(f"the model runner is not running ({self.dead_reason})") from None

    def _on_message(self, frame: Any) -> None:
        """A message from the runner (called by the channel as each frame arrives): its
        steps' events go to their requests' queues. One that is no message of the protocol
        stops the runner (raised, it also ends the channel)."""
        self._last_frame = time.monotonic()
        try:
            self._guard.frame(frame)  # its rate and size, before its events are read
            msg = protocol.parse_reply(frame)
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)  # the first: ready, or why the model did not load
                return
            if not isinstance(msg, protocol.Events):
                raise protocol.ProtocolError(f"a {msg.type!r} message after the start")
            sizes = self._guard.events(msg.events)  # before any of them is queued
        except runnerguard.RunnerAbuse as exc:
            self._stop_runner(f"sent {exc}", f"sent {exc} and was stopped")
            raise
        except (protocol.ProtocolError, RecursionError) as exc:  # (nesting past the stack)
            self._stop_runner(f"sent a malformed message: {exc}",
                              "sent a malformed message and was stopped")
            raise
        for (req_id, kind, payload), size in zip(msg.events, sizes, strict=True):
            q = self._queues.get(req_id)
            if q is not None:
                self._queue(q, kind, payload, size)
            elif kind == "engine" and req_id == "":  # step counters, for /metrics
                self.engine_stats = payload
            elif req_id not in self._ended:
                self._stop_runner(f"sent a {kind!r} event for request {req_id[:40]!r}, which "
                                  "it was never given",
                                  "named a request it was never given and was stopped")
                raise protocol.ProtocolError(f"an event for request {req_id[:40]!r}, which "
                                             "this runner was never given")

    def _queue(self, q: runnerguard.EventQueue, kind: str, payload: Any, size: int) -> None:
        """Queue an event for its request: one of the kinds it gets, within what any answer
        to it could take, or the runner is stopped (raised, as _on_message's breaches are).
        Past MAX_UNREAD waiting, the requests whose clients read slowest fail instead."""
        why = q.over_budget(size) if kind in q.kinds else \
            f"a {kind!r} event to a request that gets none"
        if why:
            self._stop_runner(f"sent {why}", f"sent {why} and was stopped")
            raise runnerguard.RunnerAbuse(why)
        q.add((kind, payload), size)
        while self._unread.total > runnerguard.MAX_UNREAD and self._fail_slowest():
            pass

    def _fail_slowest(self) -> bool:
        """Fail the request whose client has the most unread (too_large), and cancel it in
        the runner: its late events are dropped as any ended request's are."""
        waiting = [(q.waiting, rid) for rid, q in self._queues.items() if q.unread is not None]
        if not waiting:
            return False
        size, rid = max(waiting)
        q = self._queues[rid]
        log.warning("request %s: %d bytes of its answer wait unread (its client reads more "
                    "slowly than the model writes); it is stopped", rid, size)
        self._end(rid)  # (drops what waits)
        q.put_nowait(("error", error_event(
            "too_large", f"the answer waited unread past {runnerguard.MAX_UNREAD} bytes (the "
                         "client reads more slowly than the model writes): it was stopped",
            size=size, limit=runnerguard.MAX_UNREAD)))
        task = asyncio.create_task(self._cancel(rid))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)
        return True

    async def _cancel(self, req_id: str) -> None:
        with contextlib.suppress(Exception):
            await self._send(protocol.Cancel(id=req_id))

    def _refuse(self, what: str) -> EngineError:
        """The runner sent `what`, which no honest runner sends its request: it is stopped,
        and the request gets the error this returns."""
        self._stop_runner(f"sent {what}", f"sent {what} and was stopped")
        return EngineError(self.dead_reason or f"the model runner sent {what}",
                           code="runner_failed")

    def _stop_runner(self, what: str, why: str) -> None:
        """The runner sent what no runner of the protocol sends (`what`, for the log): its
        requests fail with `why` and it is killed. Before its Ready, start() reports it."""
        pid = self.proc.pid if self.proc else None
        log.error("runner pid %s %s", pid, what)
        if self._ready is not None and self._ready.done() and self.dead_reason is None:
            self._died(f"the model runner {why}")
            self._lost_task = asyncio.create_task(self.kill())

    def _end(self, req_id: str) -> None:
        """`req_id`'s events go nowhere from now on; late ones are dropped for ENDED_GRACE s."""
        q = self._queues.pop(req_id, None)
        if q is None:
            return
        q.discard()  # what its reader left unread
        now = time.monotonic()
        self._ended[req_id] = now
        while self._ended:  # oldest first (insertion order): drop those past the grace
            first = next(iter(self._ended))
            if now - self._ended[first] <= ENDED_GRACE:
                break
            del self._ended[first]

    def _on_lost(self, exc: BaseException | None) -> None:
        """The channel ended: the runner exited or broke it (a frame over the limit)."""
        err = exc if isinstance(exc, Exception) else ipc.ChannelClosed("the channel closed")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
            self._ready.exception()  # (start() reports it, if still waiting)
            return
        if self.dead_reason is not None:
            return  # killed on purpose (a failed load, the watchdog): nothing to report
        if isinstance(err, ipc.BadFrame):  # the runner broke it: no waiting for it to exit
            self._stop_runner(f"broke the channel: {err}", f"sent {err} and was stopped")
            return
        self._lost_task = asyncio.create_task(self._report_lost(err))

    async def _report_lost(self, exc: BaseException) -> None:
        if self.proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 5)
        await self._log_written()  # its last words are in the log before anyone is told
        self._died(f"the model runner stopped: {self._why(exc)}")

    async def _log_written(self) -> None:
        """Wait (a few seconds at most) until what the runner wrote is in its log: the pipe
        ends when the process is gone."""
        if self._log_thread is not None and self._log_thread.is_alive():
            await asyncio.to_thread(self._log_thread.join, 5)

    def generate(self, req: ChatRequest) -> AsyncIterator[Started | Progress | Chunk | Done]:
        """Stream one request (merged with its model's defaults): Started, Chunks, Done; an
        error raises EngineError. Closing the iterator early cancels it in the runner."""
        return work.Generation(req).events(self)

    async def run(self, job: work.Work[T]) -> T:
        """A one-answer kind of work (server/work.py) on this runner: its answer."""
        return await job.run(self)

    @property
    def n_ctx(self) -> int:
        return self.spec.n_ctx

    @contextlib.asynccontextmanager
    async def submit(self, msg: protocol.Request, budget: int | None = None,
                     client: bool = False) -> AsyncIterator[work.Job]:
        """Send request `msg` and give its Job for the block: the events of the kinds its
        kind gets (protocol.KINDS), `budget` bytes of them at most, read at a client's pace
        if `client` (_track); once the block ends they go nowhere."""
        q = self._track(msg.id, protocol.kind_of(msg).events, budget, client)
        try:
            await self._send(msg)
            yield Job(self, msg.id, q)
        finally:
            self._end(msg.id)

    async def stop(self) -> None:
        self._stopping = True
        if self.alive:
            with contextlib.suppress(Exception):
                await self._send(protocol.Shutdown())
            try:
                assert self.proc is not None
                # the runner finishes its prompt-state writes within STOP_SECONDS
                await asyncio.wait_for(self.proc.wait(), ipc.STOP_SECONDS + 5)
            except TimeoutError:
                pass
        await self.kill()

    async def kill(self) -> None:
        self.dead_reason = self.dead_reason or "stopped"
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self.proc is not None:
            await self._log_written()
        self._cache_dir = None
        if self._cache_key is not None:
            promptdirs.release(self._cache_key)
            self._cache_key = None
        if self._channel is not None:
            self._channel.close()
        if self._watch_task is not None and self._watch_task is not asyncio.current_task():
            self._watch_task.cancel()
        if self._cache_task is not None and self._cache_task is not asyncio.current_task():
            self._cache_task.cancel()


class Job:
    """One request in flight on a RunnerProcess (server/work.Job): its events' queue, and
    the runner's verdicts on what it sent."""

    def __init__(self, runner: RunnerProcess, req_id: str, q: runnerguard.EventQueue) -> None:
        self.runner = runner
        self.id = req_id
        self.q = q

    async def get(self) -> tuple[str, Any]:
        return await self.q.get()

    def get_nowait(self) -> tuple[str, Any]:
        return self.q.get_nowait()

    def empty(self) -> bool:
        return self.q.empty()

    def refuse(self, what: str) -> EngineError:
        return self.runner._refuse(what)

    def fail(self, what: str, why: str) -> EngineError:
        self.runner._stop_runner(what, why)
        return EngineError(f"the model runner failed ({self.runner.dead_reason})",
                           code="runner_failed")

    def read(self, decode: Callable[..., T], *payload: Any) -> T:
        """An event as its request reads it. parse_reply checks the outer shape of what
        pydantic reads later (logprobs, tool calls): a payload that passed it but that the
        model cannot read is the runner's lie, and stops it."""
        try:
            return decode(*payload)
        except ValidationError as exc:
            self.runner._stop_runner(f"sent an event its request cannot read: {exc}",
                                     "sent an event its request cannot read and was stopped")
            raise EngineError(self.runner.dead_reason or "the model runner failed",
                              code="runner_failed") from None

    def check_vectors(self, vectors: list[list[Any]]) -> None:
        """Embeddings of finite numbers, all of the width this runner's first had."""
        why, self.runner._width = runnerguard.check_vectors(vectors, self.runner._width)
        if why:
            raise self.refuse(why)

    async def cancel(self) -> None:
        """Stop it in the runner (a request that ended needs none)."""
        if self.runner.alive:
            with contextlib.suppress(Exception):
                await self.runner._send(protocol.Cancel(id=self.id))
