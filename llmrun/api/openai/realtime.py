"""A realtime transcription session: a WebSocket in the shape of OpenAI's Realtime API
transcription intent (`/v1/realtime?intent=transcription`).

The client streams base64 PCM16 (mono, 24 kHz: OpenAI's `pcm16`) in
`input_audio_buffer.append` events of any size and ends an utterance with
`input_audio_buffer.commit`, or lets a silence end it (`turn_detection` `server_vad`). Each
utterance is transcribed as it is committed, its text streamed back in
`conversation.item.input_audio_transcription.delta` events and one `.completed`, while the
client may go on sending the next one.

The session is one sequence in the engine, kept in one slot between its requests
(ChatRequest.session, engine/slots.py), and it grows as sound arrives: every whole piece of
the model's projector's length (media.SOUND_PIECE_SECONDS: 0.98 s for Qwen3-ASR's encoder)
is read into it at once, by a request that generates nothing (num_predict 0) and carries
the utterance's whole pieces so far as one WAV file. The runner cuts a sound into the same
pieces (engine/sound.py) and keeps each piece's embeddings by content hash, and the slot
holds what it read: each piece is encoded once and read once, and the commit adds only
the last part of a piece, the instruction and the answer. A committed utterance and its
transcript stay in the sequence: the next utterance is the next turn of the same
conversation, read after them, never before them again (up to HISTORY_SECONDS of sound or
HISTORY_TURNS turns; then the sequence starts over with the next utterance). The first
utterance's transcript is the one the same sound sent as one file to
/v1/audio/transcriptions gives: the same pieces, the same prompt. A model whose projector
reads a sound whole (Whisper-style encoders) reads each utterance at its commit.

Bounded, because a client is untrusted input (docs/security.md; the bounds on what a session
holds are realtimesession.py's, those of the connection are here):

- sessions: LLMRUN_REALTIME_SESSIONS open at once in all, and
  LLMRUN_REALTIME_SESSIONS_PER_CLIENT per API key (or client address without keys, as the
  HTTP rate limit counts them: daemon/intake.py stamps the client on the scope), so one
  client cannot take every session; the handshake itself counts against LLMRUN_RATE_LIMIT;
- what a session holds: its events waiting to be handled (INBOX_EVENTS; one is at most
  MAX_EVENT_CHARS), its jobs (at most one read waiting, MAX_PENDING commits waiting or
  being transcribed), MAX_UTTERANCE_SECONDS of sound before a commit, HISTORY_SECONDS of
  earlier turns: a few MB whatever the client sends;
- what it may ask for: LLMRUN_REALTIME_RATE events a second (a burst of twice that),
  LLMRUN_REALTIME_MAX_AUDIO of sound in all, commits of at least MIN_COMMIT_MS each;
- time: IDLE_SECONDS without a message, SEND_SECONDS for one event to leave (a client that
  stops reading is closed, not waited on).

A malformed event (not JSON, wrong types, numbers out of range, an unknown type, audio that
is not base64) is answered with an `error` event in OpenAI's shape, naming the client's
`event_id`, and the session goes on; one that breaks a bound gets its `error` event and the
session is closed with a WebSocket close code that says why (1008: a policy bound, 1009: an
event too large, 1013: no session free now). A dropped connection cancels the utterance
being transcribed, which frees its slot in the runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import orjson
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from llmrun import config, media
from llmrun.api.openai.realtimesession import (
    CLOSE_BUSY,
    CLOSE_POLICY,
    CLOSE_TOO_LARGE,
    MAX_MODEL_NAME,
    MAX_PENDING,
    MIN_COMMIT_MS,
    RATE,
    Inbox,
    Jobs,
    Refused,
    Session,
    Sessions,
    new_id,
)
from llmrun.api.openai.stream import start_choices
from llmrun.api.openai.transcribe import deltas, usage
from llmrun.request import Done, EngineError, Stats
from llmrun.server.service import Service
from llmrun.tokenbucket import TokenBucket

log = logging.getLogger(__name__)

# Most tokens of one utterance's transcript: 30 s of speech is some 80 words, 110 tokens (a
# model that babbles is cut off here, not at the end of its context)
MAX_UTTERANCE_TOKENS = 256
IDLE_SECONDS = 120.0  # a session that sends nothing this long is closed
# One event: an append of a whole utterance (30 s is 1.9 MB of base64) and room to spare
MAX_EVENT_CHARS = 4 << 20
# One event's send may wait this long for the client to read (TCP buffers full); then the
# session is closed rather than held open by a client that stopped reading
SEND_SECONDS = 30.0
MAX_EVENT_ID = 128  # the longest client event_id an error event names back
# The key daemon/intake.RateLimit writes the client's identity under in the ASGI scope
# ("key:<API key>" or "addr:<address>"): the same client its rate limit counts
CLIENT_SCOPE_KEY = "llmrun.client"


class Stalled(Exception):
    """The client stopped reading: an event could not be sent in SEND_SECONDS."""


def _error(message: str, param: str | None = None, code: str = "invalid_request",
           event_id: str | None = None) -> dict[str, Any]:
    """OpenAI's realtime `error` event; `event_id`: the client event it answers."""
    return {"type": "error", "event_id": new_id("event"),
            "error": {"type": "invalid_request_error", "code": code, "message": message,
                      "param": param, "event_id": event_id}}


_sessions = Sessions()


async def _send(ws: WebSocket, event: dict[str, Any]) -> None:
    try:
        await asyncio.wait_for(ws.send_json(event), SEND_SECONDS)
    except TimeoutError:
        raise Stalled from None


def _client(ws: WebSocket) -> str:
    """Who opened the session, as the HTTP rate limit counts clients."""
    stamped = ws.scope.get(CLIENT_SCOPE_KEY)
    if isinstance(stamped, str):
        return stamped
    return "addr:" + (ws.client.host if ws.client else "")


async def session(ws: WebSocket, service: Service) -> None:
    """Serve one WebSocket transcription session until the client closes it (or a bound)."""
    await ws.accept()
    client = _client(ws)
    refusal = _sessions.admit(client, config.realtime_sessions(),
                              config.realtime_sessions_per_client())
    if refusal is not None:
        with contextlib.suppress(Exception):
            await _send(ws, _error(refusal, code="too_many_sessions"))
            await ws.close(CLOSE_BUSY, "too_many_sessions")
        return
    try:
        await _serve(ws, service)
    finally:
        _sessions.leave(client)


async def _serve(ws: WebSocket, service: Service) -> None:
    s = Session(model=ws.query_params.get("model", "")[:MAX_MODEL_NAME],
                max_seconds=config.realtime_max_audio())
    s.piece_bytes = _piece_bytes(service, s.model)
    inbox = Inbox()
    reader = asyncio.create_task(_read(ws, inbox, config.realtime_rate()))
    jobs = Jobs()
    writer = asyncio.create_task(_transcribe_each(ws, service, s, jobs))
    writer.add_done_callback(lambda _: inbox.put(None))  # the session ends with it
    close: tuple[int, str] = (1000, "")
    try:
        await _send(ws, {"type": "transcription_session.created", "event_id": new_id("event"),
                         "session": {"id": s.id, **s.config()}})
        while True:
            try:
                msg = await asyncio.wait_for(inbox.get(), IDLE_SECONDS)
            except TimeoutError:
                await _send(ws, _error(f"no message in {IDLE_SECONDS:.0f} s: session closed",
                                       code="idle"))
                break
            if msg is None or writer.done():
                break
            event_id = None
            try:
                if isinstance(msg, Refused):
                    raise msg
                event_id = _event_id(msg)
                await _handle(ws, service, s, msg, jobs)
            except Refused as exc:
                await _send(ws, _error(exc.message, exc.param, exc.code, event_id))
                if exc.close is not None:
                    close = (exc.close, exc.code)
                    break
    except (WebSocketDisconnect, Stalled):
        pass
    finally:
        reader.cancel()
        writer.cancel()  # a dropped connection cancels the utterance being transcribed
        await asyncio.gather(reader, writer, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(*close), SEND_SECONDS)


def _event_id(msg: dict[str, Any]) -> str | None:
    """The client's event_id, to name in an error about its event."""
    value = msg.get("event_id")
    return value[:MAX_EVENT_ID] if isinstance(value, str) else None


async def _read(ws: WebSocket, inbox: Inbox, rate: int) -> None:
    """Receive and parse the client's events into `inbox`, each charged to the session's
    rate; a bound broken stops reading (the session answers it and closes)."""
    loop = asyncio.get_running_loop()
    bucket = TokenBucket.full(rate, 2.0 * rate, loop.time()) if rate > 0 else None
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            if bucket is not None and not bucket.take(1.0, loop.time()):
                inbox.halt(Refused(f"more than {rate} events a second (LLMRUN_REALTIME_RATE): "
                                   "session closed", None, "rate_limit_exceeded",
                                   CLOSE_POLICY))
                return
            text = message.get("text")
            chars = len(text) if text is not None else len(message.get("bytes") or b"")
            if chars > MAX_EVENT_CHARS:
                inbox.halt(Refused(f"an event may be at most {MAX_EVENT_CHARS >> 20} MiB",
                                   None, "event_too_large", CLOSE_TOO_LARGE))
                return
            if inbox.full(chars):
                inbox.halt(Refused(f"{len(inbox.items)} events ({inbox.chars >> 10} KiB) are "
                                   "waiting: the client sends faster than the session "
                                   "handles them (or does not read its events); session "
                                   "closed", None, "too_many_events", CLOSE_POLICY))
                return
            inbox.put(_parse(text), chars)
    except (WebSocketDisconnect, RuntimeError):
        pass
    inbox.put(None)


def _parse(text: str | None) -> dict[str, Any] | Refused:
    if text is None:
        return Refused("binary frames are not events: send each event as JSON text", None,
                       "invalid_event")
    try:
        msg = orjson.loads(text)  # refuses NaN, infinities, lone surrogates, 1024+ levels
    except orjson.JSONDecodeError as exc:
        return Refused(f"the event is not valid JSON: {str(exc)[:200]}", None, "invalid_json")
    if not isinstance(msg, dict):
        return Refused("an event must be a JSON object", None, "invalid_event")
    return msg


def _piece_bytes(service: Service, model: str) -> int | None:
    """Bytes of PCM16 at RATE in a piece of `model`'s projector (None: none, or no such
    model: its requests will say so)."""
    if not model:
        return None
    try:
        seconds = service.store.sound_piece_seconds(service.resolve(model).manifest)
    except Exception:  # an unknown or broken model: the commit's request answers why
        return None
    return media.piece_frames(seconds, RATE) * 2 if seconds else None


async def _handle(ws: WebSocket, service: Service, s: Session, msg: dict[str, Any],
                  jobs: Jobs) -> None:
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise Refused("'type' must be a string naming a client event", "type", "invalid_type")
    if kind in ("transcription_session.update", "session.update"):
        model = s.model
        s.update(msg.get("session"))
        if s.model != model:
            s.piece_bytes = _piece_bytes(service, s.model)
        await _send(ws, {"type": "transcription_session.updated", "event_id": new_id("event"),
                         "session": s.config()})
    elif kind == "input_audio_buffer.append":
        ended = s.append(msg.get("audio"))
        if ended:
            await _send(ws, {"type": "input_audio_buffer.speech_stopped",
                             "event_id": new_id("event")})
            await _commit(ws, s, jobs)
        elif s.model and (sound := s.whole_pieces()) is not None:
            jobs.read(sound)  # read what was heard so far into the model now
    elif kind == "input_audio_buffer.commit":
        await _commit(ws, s, jobs)
    elif kind == "input_audio_buffer.clear":
        s.take()
        await _send(ws, {"type": "input_audio_buffer.cleared", "event_id": new_id("event")})
    else:
        raise Refused(f"unknown event type {kind[:60]!r}", "type", "unknown_event")


async def _commit(ws: WebSocket, s: Session, jobs: Jobs) -> None:
    if len(s.pcm) < MIN_COMMIT_MS * RATE // 1000 * 2:
        raise Refused(f"the input audio buffer is empty or too short: a commit needs at "
                      f"least {MIN_COMMIT_MS} ms of sound, it holds {s.seconds * 1000:.0f} ms",
                      "input_audio_buffer", "input_audio_buffer_commit_empty")
    if not s.model:
        raise Refused("no model: set session.input_audio_transcription.model",
                      "session.input_audio_transcription.model",
                      "missing_required_parameter")
    if jobs.pending >= MAX_PENDING:
        raise Refused(f"{jobs.pending} utterances are already waiting to be transcribed (at "
                      f"most {MAX_PENDING}): the buffer is kept, commit it again once a "
                      "transcript arrives", "input_audio_buffer", "too_many_pending_commits")
    item = new_id("item")
    await _send(ws, {"type": "input_audio_buffer.committed", "event_id": new_id("event"),
                     "previous_item_id": s.last_item, "item_id": item})
    s.last_item = item
    jobs.commit(item, s.take())


async def _transcribe_each(ws: WebSocket, service: Service, s: Session, jobs: Jobs) -> None:
    """Read the pieces into the model as they come, and transcribe the committed
    utterances, in order, streaming each one's text. Each request is built when its turn
    comes: a read after a commit follows that commit's transcript in the sequence."""
    while True:
        # every read runs, in order (each adds only its new pieces: the earlier ones are in
        # the slot), so the commit always finds the whole pieces read
        item, sound = await jobs.next()
        try:
            await _transcribe(ws, service, s, item, sound)
        except (Stalled, WebSocketDisconnect):
            raise
        except Exception:  # a bug must not end the session silently: say so, go on
            log.exception("realtime transcription failed")
            await _send(ws, {**_error("transcription failed", code="server_error"),
                             "item_id": item, "content_index": 0})
        finally:
            if item is not None:
                jobs.pending -= 1


async def _transcribe(ws: WebSocket, service: Service, s: Session, item: str | None,
                      sound: str) -> None:
    base = {"item_id": item, "content_index": 0}
    num_predict = 0 if item is None else MAX_UTTERANCE_TOKENS
    try:
        started = await start_choices(service, [s.turn(sound, num_predict)])
        if isinstance(started, Response) and s.history \
                and started.status_code == 400 and b"context" in bytes(started.body):
            s.forget()  # the earlier turns and this one outgrew the context
            started = await start_choices(service, [s.turn(sound, num_predict)])
        if isinstance(started, Response):  # refused before it started: its message
            body = json.loads(bytes(started.body) or b"{}")
            message = (body.get("error") or {}).get("message", "transcription failed")
            await _send(ws, {**_error(message), **base})
            return
        parts: list[str] = []
        stats: Stats | None = None
        try:
            async for delta in deltas(started):
                if isinstance(delta, Done):
                    stats = delta.stats
                    break
                parts.append(delta)
                await _send(ws, {
                    "type": "conversation.item.input_audio_transcription.delta",
                    "event_id": new_id("event"), **base, "delta": delta})
        finally:
            await started.close()
        if item is None:
            return  # a read: nothing to say
        transcript = "".join(parts).strip()
        s.remember(sound, transcript, usage(stats)["total_tokens"])
        await _send(ws, {"type": "conversation.item.input_audio_transcription.completed",
                         "event_id": new_id("event"), **base,
                         "transcript": transcript, "usage": usage(stats)})
    except EngineError as exc:
        await _send(ws, {**_error(exc.message), **base})
