"""Request bounds: what one request may ask of a runner, checked before a runner is leased.

A runner is shared by every request on its model: one request that crashed it would fail
every request in flight there, and one that stalled its step loop (a grammar whose mask
takes a second, a stop string matched against every token) would stall them all. So
nothing one request carries may crash or stall it, and each bound is checked here, in the
daemon, where a refusal costs only that request. Each function checks one kind of input
and raises `EngineError` (400, or 413 for rerank sizes) with a message naming the field,
the value and the limit; each dialect words it in its own error shape.

The schema and grammar ceilings, with their measurements, are structured/limits.py's; what
a sound file declares is read by media.py; this module words their refusals as a
request's. It sits low in the import layers (over `config`, `request`, `ipc` for its frame
limit, `media` and `structured`, all pure Python), so the daemon checks requests without
loading llama.cpp or llguidance.
"""

from __future__ import annotations

from typing import Any

from llmrun import config, ipc, media
from llmrun.request import ChatRequest, EngineError, Message, NamedTool, Tool
from llmrun.structured import limits

# -- the ceilings ----------------------------------------------------------------------------

MAX_STOP_LENGTH = 1000  # characters in one stop string (matched against every new token)
MAX_TOOLS = 512  # tools declared in one request (each is rendered into the prompt)
# Load-time options are capped by the scheduler, not refused: num_batch past this only
# grows the compute buffers (llama-server's largest default ubatch is 512, batch 2048).
MAX_NUM_BATCH = 4096
# All images of one request, decoded, as a share of the IPC frame the request travels to the
# runner in: base64 takes 4/3 of it (5/6 of the frame), the rest is left for the text.
IMAGES_FRAME_SHARE = 5 / 8

# Reranking: documents per request (Cohere's recommended most), and characters in one
# document and in the query. Every document's prompt holds the query, so the query is kept
# short; a document's limit is about what the largest contexts hold (32k tokens of ~4
# characters), and the runner still refuses a prompt longer than the model's context.
MAX_RERANK_DOCUMENTS = 1000
MAX_RERANK_DOCUMENT_CHARS = 128 * 1024
MAX_RERANK_QUERY_CHARS = 16 * 1024


def _refuse(message: str) -> EngineError:
    return EngineError(message, code="invalid_request")


# -- messages, stop strings, tools -----------------------------------------------------------


def check_messages(messages: list[Message]) -> None:
    limit = config.max_messages()
    if len(messages) > limit:
        raise _refuse(f"too many messages: {len(messages)}, the limit is {limit} "
                      "(LLMRUN_MAX_MESSAGES)")


def check_stop(stop: list[str] | None) -> None:
    """At most LLMRUN_MAX_STOP stop strings, each at most MAX_STOP_LENGTH characters: the
    client's (checked before the service puts the model's own beside them)."""
    stops = list(dict.fromkeys(stop or []))
    limit = config.max_stop()
    if len(stops) > limit:
        raise _refuse(f"too many stop strings: {len(stops)}, the limit is {limit} "
                      "(LLMRUN_MAX_STOP)")
    for s in stops:
        if len(s) > MAX_STOP_LENGTH:
            raise _refuse(f"stop string too long: {len(s)} characters, the limit is "
                          f"{MAX_STOP_LENGTH}")


def forced_tools(tools: list[Tool], choice: Any) -> list[Tool]:
    """The tools whose parameters become a grammar: all for "required", the named one for a
    named choice, none for "auto"/"none" (their schemas only reach the prompt)."""
    if isinstance(choice, NamedTool):
        return [t for t in tools if t.name == choice.name]
    return list(tools) if choice == "required" else []


def check_tools(tools: list[Tool], choice: Any, budget: limits.Budget | None = None,
                strict: bool = True) -> None:
    if len(tools) > MAX_TOOLS:
        raise _refuse(f"too many tools: {len(tools)}, the limit is {MAX_TOOLS}")
    budget = budget or limits.Budget()
    for tool in forced_tools(tools, choice):
        budget.alternatives += 1  # the grammar chooses among the forced tools
        check_schema(tool.parameters, f"tool '{tool.name}' parameters", budget, strict)


# -- images ----------------------------------------------------------------------------------


def images_total_limit() -> int:
    """Decoded bytes all images of one request may take (read at call time, as MAX_FRAME)."""
    return int(ipc.MAX_FRAME * IMAGES_FRAME_SHARE)


def check_image_size(size: int, where: str) -> None:
    limit = config.max_image_size()
    if size > limit:
        raise _refuse(f"{where}: image too large: {size} bytes, the limit is {limit} bytes "
                      "(LLMRUN_MAX_IMAGE_SIZE)")


def check_images_total(total: int, where: str = "images") -> None:
    limit = images_total_limit()
    if total > limit:
        raise _refuse(f"{where}: the request's images take {total} bytes in all, the limit "
                      f"is {limit} bytes (what one message to the model runner can carry)")


def check_images_count(messages: list[Message]) -> None:
    count = sum(len(m.images) for m in messages)
    limit = config.max_images()
    if count > limit:
        raise _refuse(f"too many images: {count}, the limit is {limit} (LLMRUN_MAX_IMAGES)")


def check_audio_size(size: int, where: str) -> None:
    limit = config.max_audio_size()
    if size > limit:
        raise _refuse(f"{where}: sound file too large: {size} bytes, the limit is {limit} "
                      "bytes (LLMRUN_MAX_AUDIO_SIZE)")


def check_images(messages: list[Message]) -> None:
    """At most LLMRUN_MAX_IMAGES images and LLMRUN_MAX_AUDIO sound files, each within its
    size limit decoded (LLMRUN_MAX_IMAGE_SIZE, LLMRUN_MAX_AUDIO_SIZE), all within one runner
    message. The dialects checked each one as they read it (naming their own field); this
    holds for every request, however it was built. An entry that is not canonical base64 (an
    image URL never fetched) is refused, never sent to the runner. A sound's duration and
    sample rate are read from its header (media.py) by the dialect that took it and again
    by the runner, before it is decoded (engine/sound.py)."""
    if not any(m.images or m.audio for m in messages):
        return
    check_images_count(messages)
    n_audio = sum(len(m.audio) for m in messages)
    if n_audio > config.max_audio():
        raise _refuse(f"too many sound files: {n_audio}, the limit is {config.max_audio()} "
                      "(LLMRUN_MAX_AUDIO)")
    total = 0
    for i, m in enumerate(messages):
        for field, items, check in (("images", m.images, check_image_size),
                                    ("audio", m.audio, check_audio_size)):
            for j, data in enumerate(items):
                where = f"messages[{i}].{field}[{j}]"
                if len(data) % 4 or ":" in data[:16]:
                    raise _refuse(f"{where}: not base64 data")
                size = media.decoded_size(data)
                check(size, where)
                total += size
    check_images_total(total)


# -- sound -----------------------------------------------------------------------------------


def check_sound(data: bytes, where: str = "a sound file") -> media.SoundLayout:
    """The layout of the sound file `data` (media.check_sound); 400 naming `where` for
    another format, a coding, rate or channel count not taken, a truncated file or more than
    media.MAX_SOUND_SECONDS."""
    try:
        return media.check_sound(data)
    except ValueError as exc:
        raise _refuse(f"{where}: {exc}") from None


def check_sound_header(data: bytes, where: str = "a sound file") -> float:
    """The seconds the sound file `data` declares (check_sound)."""
    return check_sound(data, where).seconds


# -- JSON schemas and raw grammars -----------------------------------------------------------


def check_schema(schema: Any, where: str = "format", budget: limits.Budget | None = None,
                 strict: bool = True) -> None:
    """A JSON schema that will become a grammar: within every ceiling of
    structured/limits.py, and every keyword enforced (or, not `strict`, the others logged).
    `"json"` and None (a fixed grammar, or none) pass."""
    try:
        limits.check_schema(schema, where, budget, strict)
    except limits.Refused as exc:
        raise _refuse(str(exc)) from None


def check_grammar(gbnf: str | None) -> None:
    """A raw GBNF grammar: its size and how deep its groups nest (structured/limits.py)."""
    try:
        limits.check_grammar(gbnf)
    except limits.Refused as exc:
        raise _refuse(str(exc)) from None


# -- reranking -------------------------------------------------------------------------------


def check_rerank(query: str, documents: list[str]) -> None:
    """A rerank request: a query, one document or more, each within its limit (a limit
    passed is 413, `too_large`; an empty query or list 400)."""
    if not query.strip():
        raise _refuse("'query' must be a non-empty string")
    if len(query) > MAX_RERANK_QUERY_CHARS:
        raise EngineError(f"'query' is {len(query)} characters, the limit is "
                          f"{MAX_RERANK_QUERY_CHARS}", code="too_large")
    if not documents:
        raise _refuse("'documents' must hold at least one document")
    if len(documents) > MAX_RERANK_DOCUMENTS:
        raise EngineError(f"too many documents: {len(documents)}, the limit is "
                          f"{MAX_RERANK_DOCUMENTS} in one request", code="too_large")
    for i, doc in enumerate(documents):
        if len(doc) > MAX_RERANK_DOCUMENT_CHARS:
            raise EngineError(f"'documents[{i}]' is {len(doc)} characters, the limit is "
                              f"{MAX_RERANK_DOCUMENT_CHARS}", code="too_large")


# -- one request -----------------------------------------------------------------------------


def check_request(req: ChatRequest) -> None:
    """Every bound of a chat request: messages, images, stop strings, tools, the schemas that
    become one grammar (the format's, and the forced tools', share one budget), and a raw
    grammar."""
    check_messages(req.messages)
    check_images(req.messages)
    check_stop(req.options.stop)
    budget = limits.Budget()
    check_schema(req.format, "format", budget, req.format_strict)
    check_tools(req.tools, req.tool_choice, budget, req.format_strict)
    check_grammar(req.grammar)
