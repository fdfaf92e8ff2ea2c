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
the model's projector's length (bounds.SOUND_PIECE_SECONDS: 0.98 s for Qwen3-ASR's encoder)
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

Bounded: at most MAX_SESSIONS at once, MAX_UTTERANCE_SECONDS of sound in one utterance,
IDLE_SECONDS without a message; a session that breaks a bound gets an `error`
event and is closed. A dropped connection cancels the utterance being transcribed, which
frees its slot in the runner.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import logging
import secrets
import wave
from array import array
from dataclasses import dataclass, field
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from llmrun import bounds
from llmrun.api.openai.errors import ApiError
from llmrun.api.openai.stream import start_choices
from llmrun.api.openai.transcribe import chat_request, deltas, usage
from llmrun.request import ChatRequest, Done, EngineError, Message, Stats
from llmrun.server.service import Service

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
MAX_SESSIONS = 8  # sessions open at once (each holds a model's slot while it transcribes)
IDLE_SECONDS = 120.0  # a session that sends nothing this long is closed
# Server VAD, as OpenAI's defaults: a frame is speech above THRESHOLD of full scale (RMS);
# this much silence after speech ends the utterance
VAD_THRESHOLD = 0.02
VAD_SILENCE_MS = 500
VAD_FRAME_MS = 20

_open = 0  # sessions open now (one event loop: no lock needed)
# The session's jobs, in order: (None, wav) reads the utterance's whole pieces so far into
# the model; (item id, wav) transcribes a committed utterance; None ends
Work = asyncio.Queue[tuple[str | None, str] | None]


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
        if not isinstance(session, dict):
            raise ApiError(400, "'session' must be an object", "session")
        fmt = session.get("input_audio_format", "pcm16")
        if fmt != "pcm16":
            raise ApiError(400, "only input_audio_format 'pcm16' (24 kHz mono) is supported",
                           "session.input_audio_format")
        spec = session.get("input_audio_transcription") or {}
        if isinstance(spec, dict):
            model = str(spec.get("model") or self.model)
            if model != self.model:
                self.model = model
                self.forget()
            self.language = spec.get("language") or self.language
            self.prompt = spec.get("prompt") or self.prompt
        if "turn_detection" in session:
            td = session["turn_detection"]
            self.vad = isinstance(td, dict) and td.get("type", "server_vad") == "server_vad"
            if self.vad:
                self.silence_ms = int(td.get("silence_duration_ms") or VAD_SILENCE_MS)
                self.threshold = float(td.get("threshold") or VAD_THRESHOLD)

    def append(self, audio: Any) -> bool:
        """Add a base64 PCM16 chunk; True when server VAD heard the utterance end."""
        if not isinstance(audio, str):
            raise ApiError(400, "'audio' must be base64 PCM16", "audio")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "'audio' is not valid base64", "audio") from None
        if len(pcm) % 2:
            raise ApiError(400, "PCM16 audio must be a whole number of 2-byte samples",
                           "audio")
        if self.seconds + len(pcm) / 2 / RATE > MAX_UTTERANCE_SECONDS:
            raise ApiError(400, f"an utterance may hold at most {MAX_UTTERANCE_SECONDS} s of "
                                "sound; commit it first", "audio")
        self.pcm += pcm
        return self.vad and self._speech_ended(pcm)

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
        seconds = bounds.image_bytes(sound) / 2 / RATE
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


def _wav(pcm: bytes) -> str:
    """PCM16 at RATE as a base64 WAV file (what the runner reads, header first)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(RATE)
        f.writeframes(pcm)
    return base64.b64encode(out.getvalue()).decode("ascii")


def _error(message: str, param: str | None = None, code: str = "invalid_request") -> dict[str, Any]:
    return {"type": "error", "event_id": _id("event"),
            "error": {"type": "invalid_request_error", "code": code, "message": message,
                      "param": param}}


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


async def session(ws: WebSocket, service: Service) -> None:
    """Serve one WebSocket transcription session until the client closes it (or a bound)."""
    global _open
    await ws.accept()
    if _open >= MAX_SESSIONS:
        await ws.send_json(_error(f"too many transcription sessions (at most {MAX_SESSIONS})",
                                  code="busy"))
        await ws.close(1013)
        return
    _open += 1
    s = Session(model=ws.query_params.get("model", ""))
    s.piece_bytes = _piece_bytes(service, s.model)
    inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    reader = asyncio.create_task(_read(ws, inbox))
    work: Work = asyncio.Queue()
    writer = asyncio.create_task(_transcribe_each(ws, service, s, work))
    try:
        await ws.send_json({"type": "transcription_session.created", "event_id": _id("event"),
                            "session": {"id": s.id, **s.config()}})
        while True:
            try:
                msg = await asyncio.wait_for(inbox.get(), IDLE_SECONDS)
            except TimeoutError:
                await ws.send_json(_error(f"no message in {IDLE_SECONDS:.0f} s: session closed",
                                          code="idle"))
                break
            if msg is None or writer.done():
                break
            try:
                await _handle(ws, service, s, msg, work)
            except ApiError as exc:
                await ws.send_json(_error(exc.message, exc.param))
                if exc.param == "audio" and "at most" in exc.message:
                    break  # a bound: the session ends
    except WebSocketDisconnect:
        pass
    finally:
        _open -= 1
        reader.cancel()
        writer.cancel()  # a dropped connection cancels the utterance being transcribed
        await asyncio.gather(reader, writer, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ws.close()


async def _read(ws: WebSocket, inbox: asyncio.Queue[dict[str, Any] | None]) -> None:
    try:
        while True:
            text = await ws.receive_text()
            try:
                msg = json.loads(text)
            except json.JSONDecodeError:
                msg = {"type": "invalid"}
            await inbox.put(msg if isinstance(msg, dict) else {"type": "invalid"})
    except (WebSocketDisconnect, RuntimeError):
        await inbox.put(None)


def _piece_bytes(service: Service, model: str) -> int | None:
    """Bytes of PCM16 at RATE in a piece of `model`'s projector (None: none, or no such
    model: its requests will say so)."""
    if not model:
        return None
    try:
        seconds = service.store.sound_piece_seconds(service.resolve(model).manifest)
    except Exception:  # an unknown or broken model: the commit's request answers why
        return None
    return bounds.piece_frames(seconds, RATE) * 2 if seconds else None


async def _handle(ws: WebSocket, service: Service, s: Session, msg: dict[str, Any],
                  work: Work) -> None:
    kind = msg.get("type")
    if kind in ("transcription_session.update", "session.update"):
        model = s.model
        s.update(msg.get("session"))
        if s.model != model:
            s.piece_bytes = _piece_bytes(service, s.model)
        await ws.send_json({"type": "transcription_session.updated", "event_id": _id("event"),
                            "session": s.config()})
    elif kind == "input_audio_buffer.append":
        ended = s.append(msg.get("audio"))
        if ended:
            await ws.send_json({"type": "input_audio_buffer.speech_stopped",
                                "event_id": _id("event")})
            await _commit(ws, s, work)
        elif s.model and (sound := s.whole_pieces()) is not None:
            await work.put((None, sound))  # read what was heard so far into the model now
    elif kind == "input_audio_buffer.commit":
        await _commit(ws, s, work)
    elif kind == "input_audio_buffer.clear":
        s.take()
        await ws.send_json({"type": "input_audio_buffer.cleared", "event_id": _id("event")})
    else:
        raise ApiError(400, f"unknown event type {str(kind)[:60]!r}", "type")


async def _commit(ws: WebSocket, s: Session, work: Work) -> None:
    if not s.pcm:
        raise ApiError(400, "the input audio buffer is empty: nothing to commit",
                       "input_audio_buffer")
    if not s.model:
        raise ApiError(400, "no model: set session.input_audio_transcription.model",
                       "session.input_audio_transcription.model")
    item = _id("item")
    await ws.send_json({"type": "input_audio_buffer.committed", "event_id": _id("event"),
                        "previous_item_id": s.last_item, "item_id": item})
    s.last_item = item
    await work.put((item, s.take()))


async def _transcribe_each(ws: WebSocket, service: Service, s: Session,
                           work: Work) -> None:
    """Read the pieces into the model as they come, and transcribe the committed
    utterances, in order, streaming each one's text. Each request is built when its turn
    comes: a read after a commit follows that commit's transcript in the sequence."""
    while (job := await work.get()) is not None:
        # every read runs, in order (each adds only its new piece: the earlier ones are in
        # the slot), so the commit always finds the whole pieces read
        item, sound = job
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
                await ws.send_json({**_error(message), **base})
                continue
            parts: list[str] = []
            stats: Stats | None = None
            try:
                async for delta in deltas(started):
                    if isinstance(delta, Done):
                        stats = delta.stats
                        break
                    parts.append(delta)
                    await ws.send_json({
                        "type": "conversation.item.input_audio_transcription.delta",
                        "event_id": _id("event"), **base, "delta": delta})
            finally:
                await started.close()
            if item is None:
                continue  # a read: nothing to say
            transcript = "".join(parts).strip()
            s.remember(sound, transcript, usage(stats)["total_tokens"])
            await ws.send_json({"type": "conversation.item.input_audio_transcription.completed",
                                "event_id": _id("event"), **base,
                                "transcript": transcript, "usage": usage(stats)})
        except EngineError as exc:
            await ws.send_json({**_error(exc.message), **base})
