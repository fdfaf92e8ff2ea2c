"""What one realtime transcription session holds, each part bounded: its configuration (a
`session.update` checked field by field), the utterance's sound so far with its server VAD,
the earlier turns its sequence keeps, its work waiting (`Jobs`) and the client's events
waiting (`Inbox`), and the count of sessions open per client (`Sessions`). A client event
refused is a `Refused`: realtime.py, which serves the WebSocket, answers it with an `error`
event and, with a close code, ends the session."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import secrets
import wave
from array import array
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from llmrun import media
from llmrun.api.openai.transcribe import chat_request
from llmrun.request import ChatRequest, Message

RATE = 24_000  # OpenAI's pcm16: 16-bit little-endian mono at 24 kHz
# One utterance's sound: a VAD-ended turn of speech is seconds long
MAX_UTTERANCE_SECONDS = 30
# Earlier utterances kept in the session's sequence: their sound and turns travel in every
# request (LLMRUN_MAX_AUDIO sound files; 2.9 MB of WAV a minute) and fill its context
HISTORY_SECONDS = 60.0
HISTORY_TURNS = 8
# ... and while the sequence holds at most this many tokens after a transcript: half the
# smallest context a model is given (2048), the rest for the next utterance (30 s of
# Qwen3-ASR's sound is 400 positions) and its transcript. A turn that does not fit the
# model's context all the same starts the sequence over and is tried again.
HISTORY_TOKENS = 1024
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
# Longest language code and prompt a session may set: both travel in every request
MAX_LANGUAGE = 3
MAX_PROMPT = 4096
MAX_MODEL_NAME = 512
# WebSocket close codes (RFC 6455): a policy bound broken, an event too large, no session
# free now (try again later)
CLOSE_POLICY, CLOSE_TOO_LARGE, CLOSE_BUSY = 1008, 1009, 1013


class Refused(Exception):
    """A client event refused: its `error` event, and `close` (a close code) when the
    session ends with it."""

    def __init__(self, message: str, param: str | None = None,
                 code: str = "invalid_value", close: int | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.close = message, param, code, close


@dataclass
class Session:
    id: str = field(default_factory=lambda: new_id("sess"))
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


def new_id(prefix: str) -> str:
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
