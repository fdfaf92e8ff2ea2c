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

Bounded, because a client is untrusted input (docs/security.md):

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
import base64
import binascii
import contextlib
import io
import json
import logging
import math
import secrets
import wave
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from llmrun import config, media
from llmrun.api.openai.stream import start_choices
from llmrun.api.openai.transcribe import chat_request, deltas, usage
from llmrun.request import ChatRequest, Done, EngineError, Message, Stats
from llmrun.server.service import Service
from llmrun.tokenbucket import TokenBucket

log = logging.getLogger(__name__)

RATE = 24_000  # OpenAI's pcm16: 16-bit little-endian mono at 24 kHz
# One utterance's sound: a VAD-ended turn of speech is seconds long
MAX_UTTERANCE_SECONDS = 30
# Most tokens of one utterance's transcript: 30 s of speech is some 80 words, 110 tokens (a
# model that babbles is cut off here, not at the end of its context)
MAX_UTTERANCE_TOKENS = 256
# Earlier utterances kept in the session's sequence: their sound and turns travel in every
# request (LLMRUN_MAX_AUDIO sound files; 2.9 MB of WAV a minute) and fill its context
HISTORY_SECONDS = 60.0
HISTORY_TURNS = 8
# ... and while the sequence holds at most this many tokens after a transcript: half the
# smallest context a model is given (2048), the rest for the next utterance (30 s of
# Qwen3-ASR's sound is 400 positions) and its transcript. A turn that does not fit the
# model's context all the same starts the sequence over and is tried again.
HISTORY_TOKENS = 1024
IDLE_SECONDS = 120.0  # a session that sends nothing this long is closed
# Server VAD, as OpenAI's defaults: a frame is speech above THRESHOLD of full scale (RMS);
# this much silence after speech ends the utterance
VAD_THRESHOLD = 0.02
VAD_SILENCE_MS = 500
VAD_FRAME_MS = 20
# The longest silence or padding a turn_detection may name: past an utterance's bound it
# could never end one
MAX_VAD_MS = MAX_UTTERANCE_SECONDS * 1000
# The shortest utterance a commit takes (OpenAI's rule, and its error code): each commit is
# a transcription, so sound in crumbs cannot buy thousands of them
MIN_COMMIT_MS = 100
# Commits waiting or being transcribed: each holds its sound (30 s is 1.9 MB of base64 WAV);
# a client that commits faster than the model transcribes is told so, not queued
MAX_PENDING = 4
# Events received and not yet handled. The handler is behind only while a send waits for
# a client that does not read (an append takes well under a millisecond), so this is a
# client sending without reading; at 1 MiB an event that is 256 MiB, so the bytes are
# bounded too (INBOX_CHARS)
INBOX_EVENTS = 256
INBOX_CHARS = 16 << 20
# One event: an append of a whole utterance (30 s is 1.9 MB of base64) and room to spare
MAX_EVENT_CHARS = 4 << 20
# One event's send may wait this long for the client to read (TCP buffers full); then the
# session is closed rather than held open by a client that stopped reading
SEND_SECONDS = 30.0
# Longest language code and prompt a session may set: both travel in every request
MAX_LANGUAGE = 3
MAX_PROMPT = 4096
MAX_MODEL_NAME = 512
MAX_EVENT_ID = 128

# WebSocket close codes (RFC 6455): a policy bound broken, an event too large, no session
# free now (try again later)
CLOSE_POLICY, CLOSE_TOO_LARGE, CLOSE_BUSY = 1008, 1009, 1013
# The key daemon/intake.RateLimit writes the client's identity under in the ASGI scope
# ("key:<API key>" or "addr:<address>"): the same client its rate limit counts
CLIENT_SCOPE_KEY = "llmrun.client"


class Refused(Exception):
    """A client event refused: its `error` event, and `close` (a close code) when the
    session ends with it."""

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value", close: int | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.close = message, param, code, close


class Stalled(Exception):
    """The client stopped reading: an event could not be sent in SEND_SECONDS."""


@dataclass
class Session:
    id: str = field(default_factory=lambda: _id("sess"))
    model: str = ""
    language: str | None = None
    prompt: str | None = None
    vad: bool = False
    silence_ms: int = VAD_SILENCE_MS
    threshold: float = VAD_THRESHOLD
    # bytes of PCM16 the model's projector encodes on its own (None: it reads a sound
    # whole, or the model is not known yet): the utterance is read in such pieces
    piece_bytes: int | None = None
    pcm: bytearray = field(default_factory=bytearray)  # the utterance's sound so far
    read: int = 0  # of it, the bytes sent to be read (whole pieces)
    heard: bool = False  # speech in the buffer since its start (server VAD)
    quiet_ms: int = 0  # trailing silence (server VAD)
    last_item: str | None = None
    # the sequence's earlier turns (each utterance, then its transcript) and their sound
    history: list[Message] = field(default_factory=list)
    history_seconds: float = 0.0
    # sound appended over the session's life, and the most it may be (LLMRUN_REALTIME_MAX_AUDIO)
    total_seconds: float = 0.0
    max_seconds: float = math.inf

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 2 / RATE

    def config(self) -> dict[str, Any]:
        return {"object": "realtime.transcription_session", "input_audio_format": "pcm16",
                "input_audio_transcription": {"model": self.model, "language": self.language,
                                              "prompt": self.prompt},
                "turn_detection": {"type": "server_vad", "threshold": self.threshold,
                                   "silence_duration_ms": self.silence_ms}
                if self.vad else None}

    def update(self, session: Any) -> None:
        """Apply a session.update, every field checked first: a refused update changes
        nothing. Fields OpenAI's API has and llmrun does not use are ignored."""
        if not isinstance(session, dict):
            raise Refused("'session' must be an object", "session", "invalid_type")
        fmt = session.get("input_audio_format", "pcm16")
        if fmt != "pcm16":
            raise Refused("only input_audio_format 'pcm16' (24 kHz mono) is supported",
                          "session.input_audio_format")
        model, language, prompt = self.model, self.language, self.prompt
        spec = session.get("input_audio_transcription")
        if spec is not None:
            where = "session.input_audio_transcription"
            if not isinstance(spec, dict):
                raise Refused(f"'{where}' must be an object or null", where, "invalid_type")
            model = _text(spec.get("model"), f"{where}.model", MAX_MODEL_NAME) or model
            language = _text(spec.get("language"), f"{where}.language", MAX_LANGUAGE) \
                or language
            if language is not None and not language.isalpha():
                raise Refused("'language' must be an ISO-639-1 code such as 'en'",
                              f"{where}.language")
            prompt = _text(spec.get("prompt"), f"{where}.prompt", MAX_PROMPT) or prompt
        vad, silence_ms, threshold = self.vad, self.silence_ms, self.threshold
        if "turn_detection" in session:
            td, where = session["turn_detection"], "session.turn_detection"
            if td is not None and not isinstance(td, dict):
                raise Refused(f"'{where}' must be an object or null", where, "invalid_type")
            vad = td is not None
            if td is not None:
                if td.get("type", "server_vad") != "server_vad":
                    raise Refused("only turn_detection type 'server_vad' (or null) is "
                                  "supported", f"{where}.type")
                silence_ms = _integer(td.get("silence_duration_ms"),
                                      f"{where}.silence_duration_ms", 0, MAX_VAD_MS,
                                      VAD_SILENCE_MS)
                threshold = _number(td.get("threshold"), f"{where}.threshold", 0.0, 1.0,
                                    VAD_THRESHOLD)
                # OpenAI's padding before speech: checked as it would be, not used (the
                # whole buffer is transcribed)
                _integer(td.get("prefix_padding_ms"), f"{where}.prefix_padding_ms", 0,
                         MAX_VAD_MS, 0)
        if model != self.model:
            self.forget()
        self.model, self.language, self.prompt = model, language, prompt
        self.vad, self.silence_ms, self.threshold = vad, silence_ms, threshold

    def append(self, audio: Any) -> bool:
        """Add a base64 PCM16 chunk; True when server VAD heard the utterance end."""
        if not isinstance(audio, str):
            raise Refused("'audio' must be base64 PCM16", "audio", "invalid_type")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise Refused("'audio' is not valid base64", "audio") from None
        if len(pcm) % 2:
            raise Refused("PCM16 audio must be a whole number of 2-byte samples", "audio")
        seconds = len(pcm) / 2 / RATE
        if self.seconds + seconds > MAX_UTTERANCE_SECONDS:
            raise Refused(f"an utterance may hold at most {MAX_UTTERANCE_SECONDS} s of "
                          "sound; commit it first", "audio", "input_audio_buffer_full",
                          CLOSE_POLICY)
        if self.total_seconds + seconds > self.max_seconds:
            raise Refused(f"a session may be sent at most {self.max_seconds:g} s of sound "
                          "(LLMRUN_REALTIME_MAX_AUDIO); open a new session", "audio",
                          "session_audio_limit", CLOSE_POLICY)
        self.total_seconds += seconds
        self.pcm += pcm
        return self.vad and self._speech_ended(pcm) \
            and len(self.pcm) >= MIN_COMMIT_MS * RATE // 1000 * 2

    def whole_pieces(self) -> str | None:
        """The utterance's whole pieces so far as a WAV file, when a piece was completed
        since the last; None otherwise."""
        if not self.piece_bytes:
            return None
        whole = len(self.pcm) // self.piece_bytes * self.piece_bytes
        if whole <= self.read:
            return None
        self.read = whole
        return _wav(bytes(self.pcm[:whole]))

    def _speech_ended(self, pcm: bytes) -> bool:
        """Server VAD over the new chunk, in 20 ms frames: speech, then enough silence."""
        samples = array("h", pcm[: len(pcm) // 2 * 2])
        n = RATE * VAD_FRAME_MS // 1000
        limit = (self.threshold * 32768) ** 2
        for start in range(0, len(samples), n):
            frame = samples[start:start + n]
            if sum(x * x for x in frame) / max(1, len(frame)) > limit:
                self.heard, self.quiet_ms = True, 0
            elif self.heard:
                self.quiet_ms += VAD_FRAME_MS * len(frame) // n
        return self.heard and self.quiet_ms >= self.silence_ms

    def take(self) -> str:
        """The utterance's sound as a WAV file; the buffer starts again."""
        sound = _wav(bytes(self.pcm))
        self.pcm, self.read = bytearray(), 0
        self.heard, self.quiet_ms = False, 0
        return sound

    def _asking(self, sound: str, num_predict: int = 0) -> ChatRequest:
        """transcribe.py's request for `sound` alone, with the session's language and prompt."""
        return chat_request("transcribe", self.model, [sound], self.language, self.prompt, 0.0,
                            True, num_predict=num_predict)

    def turn(self, sound: str, num_predict: int) -> ChatRequest:
        """The request reading (num_predict 0) or transcribing `sound` as the sequence's
        next turn, after the earlier ones."""
        req = self._asking(sound, num_predict)
        return req.model_copy(update={"messages": [*self.history, *req.messages],
                                      "session": self.id})

    def remember(self, sound: str, transcript: str, tokens: int) -> None:
        """Keep a transcribed utterance in the sequence (`tokens`: what the sequence holds
        with it), or start the sequence over when it has held enough."""
        seconds = media.decoded_size(sound) / 2 / RATE
        if self.history_seconds + seconds > HISTORY_SECONDS or tokens > HISTORY_TOKENS \
                or len(self.history) // 2 >= HISTORY_TURNS:
            self.forget()
            return
        self.history += [*self._asking(sound).messages,
                         Message(role="assistant", content=transcript)]
        self.history_seconds += seconds

    def forget(self) -> None:
        """Start the sequence over: the next utterance is its first turn."""
        self.history, self.history_seconds = [], 0.0


def _text(value: Any, param: str, longest: int) -> str | None:
    """A string field: None when absent or null, else at most `longest` characters."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise Refused(f"'{param}' must be a string", param, "invalid_type")
    if len(value) > longest:
        raise Refused(f"'{param}' may be at most {longest} characters", param)
    return value.strip()


def _integer(value: Any, param: str, low: int, high: int, default: int) -> int:
    """An integer field from `low` to `high` (a float with no fraction counts, as JSON has
    one number type); `default` when absent or null. Compared before any conversion: a
    huge number is an error, never an OverflowError."""
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        if not low <= value <= high:
            raise Refused(f"'{param}' must be from {low} to {high}", param)
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(f"'{param}' must be an integer from {low} to {high}", param,
                      "invalid_type")
    if not low <= value <= high:
        raise Refused(f"'{param}' must be from {low} to {high}", param)
    return value


def _number(value: Any, param: str, low: float, high: float, default: float) -> float:
    """A number field from `low` to `high` (NaN is neither); `default` when absent or null."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refused(f"'{param}' must be a number from {low:g} to {high:g}", param,
                      "invalid_type")
    if not low <= value <= high:
        raise Refused(f"'{param}' must be from {low:g} to {high:g}", param)
    return float(value)


def _wav(pcm: bytes) -> str:
    """PCM16 at RATE as a base64 WAV file (what the runner reads, header first)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(RATE)
        f.writeframes(pcm)
    return base64.b64encode(out.getvalue()).decode("ascii")


def _error(message: str, param: str | None = None, code: str = "invalid_request",
           event_id: str | None = None) -> dict[str, Any]:
    """OpenAI's realtime `error` event; `event_id`: the client event it answers."""
    return {"type": "error", "event_id": _id("event"),
            "error": {"type": "invalid_request_error", "code": code, "message": message,
                      "param": param, "event_id": event_id}}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


class Sessions:
    """The sessions open now, in all and per client (one event loop: no lock needed). A
    client is at most the sessions open, so the table is as small as they are."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def admit(self, client: str, most: int, per_client: int) -> str | None:
        """Count a new session of `client` in; else why not."""
        if self.open[client] >= per_client:
            return (f"this client has {self.open[client]} transcription sessions open, the most "
                    f"one API key or address may (LLMRUN_REALTIME_SESSIONS_PER_CLIENT="
                    f"{per_client}); close one first")
        if self.open.total() >= most:
            return (f"too many transcription sessions open (at most {most}, "
                    "LLMRUN_REALTIME_SESSIONS); try again later")
        self.open[client] += 1
        return None

    def leave(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]


_sessions = Sessions()


class Jobs:
    """The session's work, in order: (None, wav) reads the utterance's whole pieces so far
    into the model; (item id, wav) transcribes a committed utterance. A read waiting is
    replaced by a newer one (which holds every piece the older would have read: the slot
    ends up the same), so at most one waits; commits are counted until transcribed
    (`pending`), and the caller keeps them to MAX_PENDING."""

    def __init__(self) -> None:
        self.items: deque[tuple[str | None, str]] = deque()
        self.pending = 0
        self._ready = asyncio.Event()

    def read(self, sound: str) -> None:
        if self.items and self.items[-1][0] is None:
            self.items[-1] = (None, sound)
        else:
            self.items.append((None, sound))
        self._ready.set()

    def commit(self, item: str, sound: str) -> None:
        self.items.append((item, sound))
        self.pending += 1
        self._ready.set()

    async def next(self) -> tuple[str | None, str]:
        while not self.items:
            self._ready.clear()
            await self._ready.wait()
        return self.items.popleft()


class Inbox:
    """The client's events as the reader parsed them, bounded (INBOX_EVENTS, INBOX_CHARS).
    `stop`: a bound the client broke (a flood, its rate, an event too large), which the
    session answers before anything still queued; None in the queue: the client left."""

    def __init__(self) -> None:
        self.items: deque[tuple[dict[str, Any] | Refused, int] | None] = deque()
        self.chars = 0
        self.stop: Refused | None = None
        self._ready = asyncio.Event()

    def full(self, chars: int) -> bool:
        return len(self.items) >= INBOX_EVENTS or self.chars + chars > INBOX_CHARS

    def put(self, event: dict[str, Any] | Refused | None, chars: int = 0) -> None:
        self.items.append(None if event is None else (event, chars))
        self.chars += chars
        self._ready.set()

    def halt(self, why: Refused) -> None:
        self.stop = why
        self._ready.set()

    async def get(self) -> dict[str, Any] | Refused | None:
        while not self.items and self.stop is None:
            self._ready.clear()
            await self._ready.wait()
        if self.stop is not None:
            return self.stop
        got = self.items.popleft()
        if got is None:
            return None
        self.chars -= got[1]
        return got[0]


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
        await _send(ws, {"type": "transcription_session.created", "event_id": _id("event"),
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
        await _send(ws, {"type": "transcription_session.updated", "event_id": _id("event"),
                         "session": s.config()})
    elif kind == "input_audio_buffer.append":
        ended = s.append(msg.get("audio"))
        if ended:
            await _send(ws, {"type": "input_audio_buffer.speech_stopped",
                             "event_id": _id("event")})
            await _commit(ws, s, jobs)
        elif s.model and (sound := s.whole_pieces()) is not None:
            jobs.read(sound)  # read what was heard so far into the model now
    elif kind == "input_audio_buffer.commit":
        await _commit(ws, s, jobs)
    elif kind == "input_audio_buffer.clear":
        s.take()
        await _send(ws, {"type": "input_audio_buffer.cleared", "event_id": _id("event")})
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
    item = _id("item")
    await _send(ws, {"type": "input_audio_buffer.committed", "event_id": _id("event"),
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
                    "event_id": _id("event"), **base, "delta": delta})
        finally:
            await started.close()
        if item is None:
            return  # a read: nothing to say
        transcript = "".join(parts).strip()
        s.remember(sound, transcript, usage(stats)["total_tokens"])
        await _send(ws, {"type": "conversation.item.input_audio_transcription.completed",
                         "event_id": _id("event"), **base,
                         "transcript": transcript, "usage": usage(stats)})
    except EngineError as exc:
        await _send(ws, {**_error(exc.message), **base})
