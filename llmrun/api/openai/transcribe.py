"""OpenAI's speech-to-text routes: `/v1/audio/transcriptions` and `/v1/audio/translations`.

There is no speech model here, only chat models whose projector hears: a transcription is a
chat turn, the sound file in a user message with an instruction to write down (or translate
into English) what is said, answered greedily unless `temperature` says otherwise. The form
is OpenAI's multipart one (`file`, `model`, `language`, `prompt`, `response_format`,
`temperature`, `stream`), read as it arrives by api/forms.py (python-multipart), within
bounds that such a form never reaches: one file, FORM_FIELDS text fields of at most
FIELD_BYTES each, the file within LLMRUN_MAX_AUDIO_SIZE. Each `response_format` is answered
in OpenAI's shape; the model gives no timings, so `srt`, `vtt` and `verbose_json` hold one
segment spanning the sound (its duration read from the file's header). `stream=true`
answers with server-sent `transcript.text.delta` events and one `transcript.text.done`.
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from llmrun import bounds
from llmrun.api.dialect import http_status
from llmrun.api.forms import FormError, Limits, read_form
from llmrun.api.images import from_audio
from llmrun.api.openai.errors import ApiError, api_error, engine_error_fields, error_body
from llmrun.api.openai.stream import Choices, sse, start_choices
from llmrun.request import ChatRequest, Done, EngineError, Message, Options, Stats
from llmrun.server.service import Service

Task = Literal["transcribe", "translate"]
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# Most tokens a transcript may take: about 12 minutes of speech at ~150 words a minute (the
# sound itself is bounded by its duration, media.MAX_SOUND_SECONDS)
MAX_TRANSCRIPT_TOKENS = 2048
# The form's text fields: OpenAI's have eight (model, language, prompt, response_format,
# temperature, stream, and the array fields include[] and timestamp_granularities[]), sent
# once each; repeats and unknown fields count too. FIELD_BYTES: the longest is `prompt`,
# which OpenAI caps at 224 tokens, about 1 KB.
FORM_FIELDS = 32
FIELD_BYTES = 64 * 1024


@dataclass
class Transcription:
    """A transcription request as the form gave it, checked."""

    task: Task
    request: ChatRequest
    response_format: str
    seconds: float  # the sound's duration, from its header
    language: str | None


def _check_file(name: str, size: int) -> None:
    """The sound file's size as it arrives: refused the moment it passes the limit."""
    try:
        bounds.check_audio_size(size, name)
    except EngineError as exc:
        raise FormError(http_status(exc), exc.message, name) from None


LIMITS = Limits(files=frozenset({"file"}), max_fields=FORM_FIELDS, max_field_bytes=FIELD_BYTES,
                check_file=_check_file)


async def read(request: Request) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """The form's text fields and its `file` (name, bytes); ApiError for a form refused."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, "expected a multipart/form-data body (the sound in 'file')")
    try:
        form = await read_form(request, LIMITS)
    except FormError as exc:
        raise ApiError(exc.status, exc.message, exc.param) from None
    return form.fields, form.files.get("file")


def instruction(task: Task, language: str | None, prompt: str | None) -> str:
    """What the model is asked to do with the sound (it follows the message's sound)."""
    if task == "translate":
        text = "Translate the speech in this audio into English. Reply with the English " \
               "translation only."
    else:
        text = "Transcribe the speech in this audio exactly as spoken. Reply with the " \
               "transcript only."
        if language:
            text += f" The speech is in the language with ISO-639-1 code '{language}'."
    if prompt:
        text += f" Context and spellings to follow: {prompt}"
    return text


def parse(task: Task, fields: dict[str, str], upload: tuple[str, bytes] | None) -> Transcription:
    """The form's fields and file, checked: ApiError (400) naming the field at fault."""
    if upload is None or not upload[1]:
        raise ApiError(400, "a sound file is required in 'file'", "file")
    model = fields.get("model", "").strip()
    if not model:
        raise ApiError(400, "'model' is required", "model")
    fmt = fields.get("response_format", "json") or "json"
    if fmt not in FORMATS:
        raise ApiError(400, f"'response_format' must be one of {', '.join(FORMATS)}",
                       "response_format")
    try:
        temperature = float(fields.get("temperature") or 0.0)
    except ValueError:
        raise ApiError(400, "'temperature' must be a number", "temperature") from None
    if not 0.0 <= temperature <= 1.0:
        raise ApiError(400, "'temperature' must be between 0 and 1", "temperature")
    stream = fields.get("stream", "false").strip().lower()
    if stream not in ("true", "false", "1", "0", ""):
        raise ApiError(400, "'stream' must be true or false", "stream")
    streaming = stream in ("true", "1")
    if streaming and fmt not in ("json", "text"):
        raise ApiError(400, "stream=true answers with transcript.text events: "
                            "'response_format' must be json or text", "stream")
    language = fields.get("language", "").strip() or None
    if language is not None and not (language.isalpha() and len(language) <= 3):
        raise ApiError(400, "'language' must be an ISO-639-1 code such as 'en'", "language")
    data = base64.b64encode(upload[1]).decode("ascii")
    try:
        sound = from_audio(data, None, "file")
        seconds = bounds.check_sound_header(upload[1], "file")
    except EngineError as exc:
        raise ApiError(http_status(exc), exc.message, "file") from None
    prompt = fields.get("prompt", "").strip() or None
    request = chat_request(task, model, [sound], language, prompt, temperature, streaming)
    return Transcription(task, request, fmt, seconds, language)


def chat_request(task: Task, model: str, sounds: list[str], language: str | None,
                 prompt: str | None, temperature: float, stream: bool,
                 num_predict: int = MAX_TRANSCRIPT_TOKENS) -> ChatRequest:
    """The chat turn that transcribes (or translates) `sounds`, checked base64 files heard
    one after the other (num_predict 0: only read them into the model's memory)."""
    return ChatRequest(
        model=model, stream=stream,
        messages=[Message(role="user", content=instruction(task, language, prompt),
                          audio=sounds)],
        options=Options(temperature=temperature, num_predict=num_predict))


# -- answers ----------------------------------------------------------------------------------


def usage(stats: Stats | None) -> dict[str, Any]:
    """OpenAI's token usage; `cached_tokens`: the prompt's part the model already held
    (a realtime session's pieces read before the commit)."""
    prompt = stats.prompt_tokens if stats else 0
    output = stats.completion_tokens if stats else 0
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": output,
            "total_tokens": prompt + output,
            "input_token_details": {"cached_tokens": stats.cached_tokens if stats else 0}}


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(t: Transcription, text: str, stats: Stats | None) -> Response:
    """The transcript `text` in the form's response_format."""
    fmt = t.response_format
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt == "srt":
        return PlainTextResponse(f"1\n{_clock(0, ',')} --> {_clock(t.seconds, ',')}\n{text}\n\n")
    if fmt == "vtt":
        return PlainTextResponse(f"WEBVTT\n\n{_clock(0, '.')} --> {_clock(t.seconds, '.')}\n"
                                 f"{text}\n\n", media_type="text/vtt")
    if fmt == "verbose_json":
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": t.seconds, "text": text,
                   "tokens": [], "temperature": t.request.options.temperature or 0.0,
                   "avg_logprob": 0.0, "compression_ratio": 0.0, "no_speech_prob": 0.0}
        return JSONResponse({"task": t.task, "language": t.language or "unknown",
                             "duration": t.seconds, "text": text, "segments": [segment],
                             "usage": {"type": "duration",
                                       "seconds": math.ceil(t.seconds)}})
    return JSONResponse({"text": text, "usage": usage(stats)})


async def answer(service: Service, t: Transcription) -> Response:
    """Run the transcription and answer whole, or as transcript.text events."""
    started = await start_choices(service, [t.request])
    if isinstance(started, Response):
        return started
    if t.request.stream:
        return StreamingResponse(_events(started), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    parts: list[str] = []
    stats: Stats | None = None
    try:
        async for _, event in started.events():
            if isinstance(event, Done):
                stats = event.stats
            else:
                parts.append(event.text)
    except (EngineError, ApiError) as exc:
        return api_error(exc)
    finally:
        await started.close()
    return render(t, "".join(parts).strip(), stats)


async def deltas(choices: Choices) -> AsyncIterator[str | Done]:
    """A transcript's text as it comes, then its Done. The first words lose their leading
    space, as the whole text is stripped: the deltas add up to the whole."""
    heard = False
    async for _, event in choices.events():
        if isinstance(event, Done):
            yield event
            return
        delta = event.text if heard else event.text.lstrip()
        heard = heard or bool(delta)
        if delta:
            yield delta


async def _events(choices: Choices) -> AsyncIterator[bytes]:
    parts: list[str] = []
    try:
        async for delta in deltas(choices):
            if isinstance(delta, Done):
                yield sse({"type": "transcript.text.done", "text": "".join(parts).strip(),
                           "usage": usage(delta.stats)})
            else:
                parts.append(delta)
                yield sse({"type": "transcript.text.delta", "delta": delta})
    except EngineError as exc:
        status, message, param, code, _ = engine_error_fields(exc)
        yield sse(error_body(status, message, param, code))
    finally:
        await choices.close()
