"""The daemon's side of each kind of work a runner does (llmrun.protocol.KINDS): what it
sends the runner and how it reads the answer back.

Each kind is one class here: it builds its message (protocol.py), submits it to a runner
(`Submitter`: RunnerProcess, which sends it and routes its events to its `Job`) and decodes
the events into the result its callers get, checking what a runner could lie about (the
number of embeddings or scores, their range, tool calls against the request's tools). A
one-answer kind is run with `runner.run(work)`; generation streams (`Generation.events`).
Large embedding and rerank batches go to the runner in pieces, so no frame either way nears
ipc.MAX_FRAME and other requests interleave.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from llmrun import ipc, protocol
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Progress,
    Started,
    Stats,
)
from llmrun.server import runnerguard

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
EMBED_PIECE = 256  # inputs per embed message: replies stay small, other requests interleave
_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    """A request id, unique in this daemon (`prefix`: which kind, for the logs)."""
    return f"{prefix}{next(_ids)}"


class Job(Protocol):
    """One message in flight on a runner (RunnerProcess.submit): its events, and the
    runner's verdicts on what it sent."""

    async def get(self) -> tuple[str, Any]: ...

    def get_nowait(self) -> tuple[str, Any]: ...

    def empty(self) -> bool: ...

    # the runner sent `what`, which no honest runner sends: it is stopped; the request's error
    def refuse(self, what: str) -> EngineError: ...

    # as refuse, the log's `what` and the requests' `why` apart ("failed (...)" to the client)
    def fail(self, what: str, why: str) -> EngineError: ...

    # an event as its request reads it (a payload the model cannot read stops the runner)
    def read(self, decode: Callable[..., T], *payload: Any) -> T: ...

    def check_vectors(self, vectors: list[list[Any]]) -> None: ...

    async def cancel(self) -> None: ...


class Submitter(Protocol):
    """What a kind needs of a runner: RunnerProcess."""

    @property
    def n_ctx(self) -> int: ...

    def submit(self, msg: protocol.Request, budget: int | None = None,
               client: bool = False) -> AbstractAsyncContextManager[Job]: ...


class Work(Protocol[T_co]):
    """A one-answer kind of work: `run` sends it through `runner` and returns its answer;
    `kind` is its message's type, `what` names it where it cannot be done (a remote model:
    server/service.RemoteRunner)."""

    @property
    def kind(self) -> str: ...

    @property
    def what(self) -> str: ...

    async def run(self, runner: Submitter) -> T_co: ...


def pieces(inputs: list[str], limit: int) -> Iterator[tuple[int, list[str]]]:
    """(offset, inputs) pieces of at most EMBED_PIECE inputs whose JSON fits `limit` bytes
    (an input too large on its own is a piece alone, refused when sent)."""
    piece: list[str]
    start, piece, size = 0, [], 0
    for i, text in enumerate(inputs):
        n = len(json.dumps(text, ensure_ascii=False).encode()) + 1
        if piece and (len(piece) >= EMBED_PIECE or size + n > limit):
            yield start, piece
            start, piece, size = i, [], 0
        piece.append(text)
        size += n
    if piece:
        yield start, piece


async def answer(runner: Submitter, msg: protocol.Request) -> tuple[Job, dict[str, Any]]:
    """Send a one-answer message and take the payload of the event that answers it (its
    kind's final one); an error event raises the EngineError it describes."""
    final = protocol.kind_of(msg).final
    async with runner.submit(msg) as job:
        kind, payload = await job.get()
    if kind not in final:
        raise EngineError.from_event(payload)
    return job, payload


# -- generate ------------------------------------------------------------------------------


def is_plain(payload: dict[str, Any]) -> bool:
    """A chunk payload of text alone (nearly every token's): no logprobs, thought or calls."""
    return len(payload) == 1


def decode_chunk(payload: dict[str, Any]) -> Chunk:
    """A chunk event's payload as a Chunk. Plain text is built without validating nested
    fields: this runs once per token of every stream."""
    if is_plain(payload):
        return Chunk(text=payload["text"])
    return Chunk.model_validate(payload)


def decode_event(kind: str, payload: Any) -> Started | Chunk | Done:
    """A generate request's event; an error event (or one this side does not know) raises
    the EngineError it describes."""
    if kind == "chunk":
        return decode_chunk(payload)
    if kind == "started":
        return Started.model_validate(payload)
    if kind == "done":
        return Done(stats=Stats.model_validate(payload))
    if kind == "error":
        raise EngineError.from_event(payload)
    raise EngineError(f"the model runner sent an unexpected {kind!r} event")


@dataclass(frozen=True)
class Generation:
    """Generate for `request` (merged with its model's defaults)."""

    kind: ClassVar[str] = "generate"  # its message's type: protocol.KINDS
    request: ChatRequest
    what: ClassVar[str] = "generating"

    async def events(self, runner: Submitter
                     ) -> AsyncIterator[Started | Progress | Chunk | Done]:
        """Started, Chunks, Done; an error raises EngineError. Closing the iterator early
        cancels the request in the runner."""
        req = self.request
        msg = protocol.Generate(id=new_id("r"), request=req)
        budget = runnerguard.answer_budget(req, runner.n_ctx)
        async with runner.submit(msg, budget=budget, client=True) as job:
            finished = False
            held: tuple[str, Any] | None = None  # taken from the queue while merging, not sent
            try:
                while True:
                    if held is None:
                        kind, payload = await job.get()
                    else:
                        (kind, payload), held = held, None
                    if kind == "chunk" and is_plain(payload) and not job.empty():
                        # The client reads slower than the model writes: the plain text
                        # waiting goes out as one chunk, so the slower side pays once, not
                        # per token.
                        parts = [payload["text"]]
                        while not job.empty():
                            item = job.get_nowait()
                            if item[0] != "chunk" or not is_plain(item[1]):
                                held = item
                                break
                            parts.append(item[1]["text"])
                        payload = {"text": "".join(parts)}
                    if kind == "chunk":
                        chunk = job.read(decode_chunk, payload)
                        if chunk.tool_calls or chunk.partial_call:  # what an agent acts on
                            why = await asyncio.to_thread(runnerguard.check_calls,
                                                          req.model_dump(), chunk)
                            if why:
                                raise job.refuse(why)
                        yield chunk
                        continue
                    if kind == "progress":
                        if req.progress:
                            yield job.read(Progress.model_validate, payload)
                        continue
                    finished = kind in ("done", "error")  # (no cancel for a request that ended)
                    yield job.read(decode_event, kind, payload)
                    if finished:
                        return
            finally:
                if not finished:
                    await job.cancel()


# -- one-answer kinds ------------------------------------------------------------------------


@dataclass(frozen=True)
class Counting:
    """How many tokens `request`'s prompt renders to (nothing is generated); with `detail`,
    the prompt and its tokens too: the count reply (protocol.CountReply)."""

    kind: ClassVar[str] = "count"  # its message's type: protocol.KINDS
    request: ChatRequest
    detail: bool = False

    @property
    def what(self) -> str:
        return "count" if self.detail else "counting tokens"

    async def run(self, runner: Submitter) -> dict[str, Any]:
        _, reply = await answer(runner, protocol.Count(id=new_id("c"), request=self.request,
                                                       detail=self.detail))
        return dict(reply)


@dataclass(frozen=True)
class Tokenizing:
    """`text`'s tokens and each one's piece (protocol.TokensReply)."""

    kind: ClassVar[str] = "tokenize"  # its message's type: protocol.KINDS
    text: str
    add_special: bool = False
    what: ClassVar[str] = "tokenize"

    async def run(self, runner: Submitter) -> dict[str, Any]:
        _, reply = await answer(runner, protocol.Tokenize(
            id=new_id("c"), text=self.text, add_special=self.add_special))
        return dict(reply)


@dataclass(frozen=True)
class Detokenizing:
    """The text of `tokens` (protocol.TextReply)."""

    kind: ClassVar[str] = "detokenize"  # its message's type: protocol.KINDS
    tokens: list[int]
    what: ClassVar[str] = "detokenize"

    async def run(self, runner: Submitter) -> dict[str, Any]:
        _, reply = await answer(runner, protocol.Detokenize(id=new_id("c"),
                                                            tokens=self.tokens))
        return dict(reply)


@dataclass(frozen=True)
class Embedding:
    """L2-normalised embeddings of `inputs` and the number of tokens they took."""

    kind: ClassVar[str] = "embed"  # its message's type: protocol.KINDS
    inputs: list[str]
    truncate: bool
    what: ClassVar[str] = "embedding"

    async def run(self, runner: Submitter) -> tuple[list[list[float]], int]:
        vectors: list[list[float]] = []
        n_tokens = 0
        for offset, piece in pieces(self.inputs, ipc.MAX_FRAME // 2):
            got, n = await self._piece(runner, offset, piece)
            vectors += got
            n_tokens += n
        return vectors, n_tokens

    async def _piece(self, runner: Submitter, offset: int,
                     inputs: list[str]) -> tuple[list[list[float]], int]:
        msg = protocol.Embed(id=new_id("e"), inputs=inputs, truncate=self.truncate,
                             offset=offset)
        vectors: list[list[float]] = []
        async with runner.submit(msg) as job:
            while True:
                kind, payload = await job.get()
                if kind == "embedding_part":  # a reply too large for one frame
                    job.check_vectors(payload["embeddings"])
                    vectors += payload["embeddings"]
                    if len(vectors) > len(inputs):  # parts without end would fill memory
                        raise job.fail("sent more embeddings than inputs",
                                       "sent more embeddings than it was given inputs and was "
                                       "stopped")
                elif kind == "embedding":
                    job.check_vectors(payload["embeddings"])
                    vectors += payload["embeddings"]
                    if len(vectors) != len(inputs):
                        raise job.refuse(f"{len(vectors)} embeddings for {len(inputs)} inputs")
                    return vectors, payload["prompt_tokens"]
                else:
                    raise EngineError.from_event(payload)


@dataclass(frozen=True)
class Reranking:
    """Each document's relevance to `query` (0 to 1, in order) and the prompt tokens read;
    `request` (merged with the Modelfile) says how the prompts are written. A long list goes
    in pieces, as embeddings do; the query travels with each."""

    kind: ClassVar[str] = "rerank"  # its message's type: protocol.KINDS
    request: ChatRequest
    query: str
    documents: list[str]
    what: ClassVar[str] = "reranking"

    async def run(self, runner: Submitter) -> tuple[list[float], int]:
        scores: list[float] = []
        n_tokens = 0
        room = ipc.MAX_FRAME // 2 - len(json.dumps(self.query, ensure_ascii=False).encode())
        for offset, piece in pieces(self.documents, max(room, 1)):
            msg = protocol.Rerank(id=new_id("k"), request=self.request, query=self.query,
                                  documents=piece, offset=offset)
            job, reply = await answer(runner, msg)
            got = reply["scores"]
            if len(got) != len(piece) or any(not 0.0 <= s <= 1.0 for s in got):
                raise job.fail("sent rerank scores that do not fit its documents",
                               "sent rerank scores that do not fit its documents and was "
                               "stopped")
            scores += [float(s) for s in got]
            n_tokens += reply["prompt_tokens"]
        return scores, n_tokens
