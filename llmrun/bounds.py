"""Request bounds: what one request may ask of a runner, checked before a runner is leased.

A runner is shared by every request on its model, so nothing one request carries may crash
or stall it (docs: design.md, "Nothing one request carries ... can stop, crash or stall the
engine"). Each function here checks one kind of input and raises `EngineError` (400) with a
message naming the field, the value and the limit; each dialect words it in its own error
shape. This module sits at the floor: it imports only `config`, `request`, `ipc` (its frame
limit) and the standard library, so the daemon checks requests without loading llama.cpp.

JSON schemas (Ollama `format`, OpenAI `response_format`, Anthropic `output_config.format`,
and the parameters of a tool the model is forced to call) are enforced by llguidance
(engine/constraint.py), which implements repetition and numeric bounds natively: `maxLength`,
`maxItems` and `{m,n}` cost the same whatever their value, so they are not bounded here.
Two things are:

1. Keywords. Each schema keyword is one llguidance enforces (SUPPORTED), an annotation that
   constrains nothing (ANNOTATIONS), or neither: then a 400 naming it, or, when the client
   asked for non-strict output (`format_strict` False), a logged warning and the keyword is
   ignored. Never silently ignored. `format` is checked the same way against FORMATS.
2. Size and shape, where llguidance's cost grows. Measured here (llguidance 1.9.1, SmolLM2's
   49k vocabulary; "mask" is the first mask computation, on the engine's step):
   - maxLength 200,000, minLength 100,000, maxItems 200,000, `a{0,200000}`: ~1 ms.
   - nesting: llguidance reads the schema with serde_json's recursion limit of 128 levels of
     JSON (an object level of a schema is two: `properties`, then the name), so 64 object
     levels fail to compile (cleanly); a chain of 2000 `$ref`s: 22 ms.
   - `enum` of 10,000 values: 0.06 s to compile, 0.06 s to build a matcher; 50,000: 0.26 s;
     100,000 hits llguidance's lexer limit (a clean error). 1000 `anyOf` objects: 0.13 s.
   - 1000 optional properties: 0.1 s compile, 0.2 s matcher, 20 ms per mask step.
   - a `const` string of N characters: the first mask takes ~4.5 us per character (256 KB:
     1.3 s of a stalled engine), hence MAX_LITERAL_CHARS.
For comparison, OpenAI's structured outputs allow 10 levels of nesting, 5000 properties
and 1000 enum values in all.
"""

from __future__ import annotations

import bisect
import logging
import re
import struct
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from llmrun import config, ipc
from llmrun.request import ChatRequest, EngineError, Message, NamedTool, Tool

# -- the ceilings (see the measurements above) ------------------------------------------------

# JSON nesting (objects and arrays; a `$ref` counts as the depth of what it points to):
# well under the 128 JSON levels llguidance can read.
MAX_SCHEMA_DEPTH = 64
# Values in one request's schemas (objects, arrays, strings, numbers...).
MAX_SCHEMA_NODES = 20_000
# Characters of keys and strings in one request's schemas (consts, enum values, names).
MAX_SCHEMA_CHARS = 256 * 1024
# One `const` or `enum` string: its first mask costs ~4.5 us per character (16k: ~70 ms).
MAX_LITERAL_CHARS = 16 * 1024
# `enum`, `anyOf`/`oneOf` and type-list entries in all (10,000: ~0.12 s to build).
MAX_ALTERNATIVES = 10_000
MAX_PATTERN_LENGTH = 1000
MAX_PATTERN_NESTING = 32  # groups in groups
# A raw grammar (ChatRequest.grammar: llama-server's `grammar` field; Lark or GBNF).
MAX_GRAMMAR_BYTES = 1 << 20
MAX_GRAMMAR_NESTING = 1000  # the GBNF-to-Lark converter recurses into each group

# Schema keywords llguidance enforces (tests/integration/test_bounds.py checks each against it).
SUPPORTED = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
    "prefixItems", "items", "required", "additionalProperties", "properties",
    "patternProperties", "minProperties", "maxProperties", "anyOf", "oneOf", "allOf",
    "$ref", "$defs", "definitions",
    "nullable",  # OpenAPI's; engine/constraint.py rewrites it as a type union
})
# Keywords that describe and constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly",
})
# `format` values llguidance enforces (it refuses the others).
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uuid", "uri"})
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")

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

log = logging.getLogger(__name__)



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


def check_tools(tools: list[Tool], choice: Any, budget: Budget | None = None,
                strict: bool = True) -> None:
    if len(tools) > MAX_TOOLS:
        raise _refuse(f"too many tools: {len(tools)}, the limit is {MAX_TOOLS}")
    budget = budget or Budget()
    for tool in forced_tools(tools, choice):
        budget.alternatives += 1  # the grammar chooses among the forced tools
        check_schema(tool.parameters, f"tool '{tool.name}' parameters", budget, strict)


# -- images ----------------------------------------------------------------------------------


def image_bytes(data: str) -> int:
    """The decoded size of an image in canonical base64 (api/images.py makes every image so),
    from its length alone: the bounds are checked without decoding."""
    return len(data) // 4 * 3 - data[-2:].count("=")


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
    sample rate are read from its header by the runner, before it is decoded
    (engine/sound.py)."""
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
                size = image_bytes(data)
                check(size, where)
                total += size
    check_images_total(total)


# -- sound -----------------------------------------------------------------------------------
# What a sound file declares, read from its headers alone (no sample is decoded): the daemon
# refuses with it before a runner is leased, the runner again before its decoder runs
# (engine/sound.py), and the runner gives the decoder only what was read here: a WAV file
# it writes from the format and samples read, an MP3's frames end to end. An MP3 has no
# header for the whole file: its frames are walked (their 4-byte headers only), so a bomb
# (a megabyte of minimal frames that decode to hours) is measured, not decoded.

MAX_SOUND_SECONDS = 20 * 60  # a sound's declared duration (OpenAI transcribes 25 MB: ~25 min mp3)
MIN_RATE, MAX_RATE = 8_000, 48_000  # sample rates taken (telephone to studio)
MAX_CHANNELS = 8
SOUND_FORMATS = ("WAV", "MP3")
# The length of sound a projector encodes on its own, by its type (`clip.projector_type`):
# a sound is read as consecutive pieces of it, each encoded once, so a stream's pieces can
# be read as they arrive and give what the whole file gives. Qwen3-ASR's encoder (qwen3a)
# convolves chunks of 100 mel frames (10 ms each) and normalises over what it is given, so a
# piece's rows depend on nothing outside it; n samples give n / 160 + 1 frames at 16 kHz, so
# 0.98 s (99 frames, with room for the sample a resampler may add) fills one chunk, where
# 1 s (101 frames) would take two and twice the positions. Whisper-style encoders pad every
# input to 30 s (a short piece would cost a 30 s pass and its positions): they, and types
# not listed, read a sound whole.
SOUND_PIECE_SECONDS = {"qwen3a": 0.98}


def piece_frames(seconds: float, rate: int) -> int:
    """Sample frames in a piece of `seconds` at `rate` (rounded: 0.98 * 24000 is
    23519.99... in floating point)."""
    return max(1, round(seconds * rate))


# -- WAV: a RIFF file's format chunk says how its samples are coded, and dr_wav (miniaudio's
# WAV decoder, inside libmtmd) believes it: an ADPCM file (MS 0x0002, IMA 0x0011) decodes to
# about two samples a byte whatever its block alignment says, and a PCM file of whole bytes
# to data / (channels x bits / 8) frames whatever its block alignment says (measured: 80 KB
# of MS ADPCM declaring a 65,535-byte block, so 0.15 ms at data / block / rate, decoded to
# 20 s). So only codings whose length the header gives exactly are taken, each with the one
# block alignment and byte rate that coding has; a file that dr_wav would refuse (a bit
# depth of 0, say) is refused here too, because miniaudio then tries its MP3 decoder on the
# same bytes, which resyncs to any frames a data chunk holds (measured: 72 s decoded from a
# "WAV" declaring 0.1 ms). The runner hands the decoder a WAV file it writes itself from what
# was read here (engine/sound.py), so no chunk, second format chunk or extension field read
# differently by dr_wav can change what is decoded.

WAVE_FORMAT_EXTENSIBLE = 0xFFFE
# The codings taken: format tag -> (name, the bit depths dr_wav decodes). A-law and mu-law
# are one byte a sample: their length is as exact as PCM's.
WAV_CODINGS = {1: ("PCM", (8, 16, 24, 32)), 3: ("IEEE float", (32, 64)), 6: ("A-law", (8,)),
               7: ("mu-law", (8,))}
_WAV_NAMES = {2: "MS ADPCM", 0x11: "IMA ADPCM", 0x31: "GSM 6.10", 0x50: "MPEG",
              0x55: "MPEG layer III", 0x0161: "WMA"}
# KSDATAFORMAT_SUBTYPE_PCM and its kin: the format tag, then these 14 bytes
_SUBFORMAT_TAIL = bytes.fromhex("0000000010008000" "00aa00389b71")


@dataclass(frozen=True)
class WavLayout:
    """Where a WAV file's samples are and how they are coded, from its chunks' headers."""

    tag: int  # a key of WAV_CODINGS (an extensible file's subformat)
    channels: int
    rate: int
    bits: int
    start: int  # the samples' first byte
    size: int  # the samples' bytes, as the data chunk declares them

    @property
    def block(self) -> int:
        """Bytes of one frame (a sample of every channel)."""
        return self.channels * self.bits // 8

    @property
    def fmt(self) -> bytes:
        """The format chunk's body as the runner writes it for the decoder: the plain
        16-byte form of this coding (an extensible file's subformat as its tag)."""
        return struct.pack("<HHIIHH", self.tag, self.channels, self.rate,
                           self.rate * self.block, self.block, self.bits)

    @property
    def seconds(self) -> float:
        return self.size / self.block / self.rate


def _wav_coding(fmt: bytes) -> tuple[int, int, int, int]:
    """A format chunk's (tag, channels, rate, bits); ValueError, naming what is wrong, for a
    coding not in WAV_CODINGS or a block alignment or byte rate other than its own."""
    tag, channels, rate, byte_rate, block, bits = struct.unpack_from("<HHIIHH", fmt)
    named = f"0x{tag:04X}" + (f" ({_WAV_NAMES[tag]})" if tag in _WAV_NAMES else "")
    if tag == WAVE_FORMAT_EXTENSIBLE:
        # dr_wav refuses an extension of any other size (and reads no subformat without it)
        if len(fmt) < 40 or struct.unpack_from("<H", fmt, 16)[0] != 22:
            raise ValueError("a WAV file's extensible format chunk is truncated")
        guid = fmt[24:40]
        sub = struct.unpack_from("<H", guid)[0]
        tag = sub if guid[2:] == _SUBFORMAT_TAIL else -1
        named = f"extensible, subformat {guid.hex()}" if tag < 0 else \
            f"extensible, subformat 0x{sub:04X}" + (f" ({_WAV_NAMES[sub]})"
                                                   if sub in _WAV_NAMES else "")
    if tag not in WAV_CODINGS:
        accepted = ", ".join(f"{name} ({t})" for t, (name, _) in WAV_CODINGS.items())
        raise ValueError(f"a WAV file in format {named}: only {accepted} are accepted, "
                         "whose length the header gives")
    name, depths = WAV_CODINGS[tag]
    if bits not in depths:
        raise ValueError(f"a WAV file of {bits}-bit {name}: "
                         f"{', '.join(map(str, depths))}-bit {name} is accepted")
    if not 1 <= channels <= MAX_CHANNELS:
        raise ValueError(f"a WAV file with {channels} channels; 1 to {MAX_CHANNELS} "
                         "are accepted")
    _check_rate(rate)
    if block != channels * bits // 8:
        raise ValueError(f"a WAV file whose block alignment is {block} bytes: "
                         f"{channels} channel(s) of {bits}-bit {name} take "
                         f"{channels * bits // 8}")
    if byte_rate != rate * block:
        raise ValueError(f"a WAV file whose byte rate is {byte_rate}: {rate} Hz of "
                         f"{block}-byte frames make {rate * block}")
    return tag, channels, rate, bits


def wav_layout(data: bytes) -> WavLayout:
    """A WAV file's layout; ValueError for a coding, rate or channel count not taken, or a
    truncated file (one declaring no more than MAX_SOUND_SECONDS, which is refused anyway).
    As dr_wav does, the last format chunk before the first data chunk is the one read."""
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise ValueError("a WAV file's format chunk is truncated")
            fmt = data[body:body + size]
        elif kind == b"data":
            if fmt is None:
                raise ValueError("a WAV file's samples come before its format")
            layout = WavLayout(*_wav_coding(fmt), start=body, size=size)
            if layout.seconds <= MAX_SOUND_SECONDS and body + size > len(data):
                raise ValueError(f"a WAV file is truncated: it declares {size} bytes of "
                                 f"samples and holds {len(data) - body}")
            return layout
        pos = body + size + (size & 1)  # chunks are padded to an even size
    raise ValueError("a WAV file without samples (no data chunk)")


# -- MP3: no header gives a whole file's length, so its frames are walked (4-byte headers,
# read as dr_mp3, miniaudio's MP3 decoder, reads them), and what is walked is what the
# decoder is given: the runner hands it only the frames found here, end to end (Mp3Layout.
# stream), never the file. A decoder scans past anything between frames for the next sync,
# so a walk that stopped at junk undercounted (measured: one 24 ms frame, a zero byte, then
# 2000 frames: 48 s decoded from a file declaring 24 ms), and one that resyncs its own way
# can be led astray by bytes that look like frames. Given only frames of one kind (one MPEG
# version, layer and sample rate: what dr_mp3's header comparison checks), each beginning
# where the last ends, dr_mp3 decodes exactly those frames: each is in sync with the next,
# and after a frame it cannot decode it finds the next at its first byte (its own search
# confirms a header by the frames that follow, and they all follow). So junk, tags and
# other files' frames are not counted because they are not decoded, and no tag reaches the
# decoders (miniaudio tries its FLAC decoder before dr_mp3, and it skips an ID3v2 tag by
# its own reading of the tag's size, then decodes any FLAC stream it finds). What dr_mp3
# reads from the frames other than audio is refused or counted: an end it would cut (a
# last frame whose bytes read as an ID3v1 or APE tag's), and a Xing/Info tag's frame count,
# which becomes the decoder's output length whatever the frames hold (measured: one frame
# claiming 60,000 frames decoded to 1440 s of samples; a count of 2^32 - 1 asks for
# terabytes), so the largest count a frame claims is counted.

# dr_mp3's bitrate table (kbit/s / 2) by [MPEG-1][layer bits - 1][bitrate index]; the layer
# bits are 3 for layer I, 2 for II, 1 for III
_HALFRATE = (
    ((0, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80),
     (0, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80),
     (0, 16, 24, 28, 32, 40, 48, 56, 64, 72, 80, 88, 96, 112, 128)),
    ((0, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160),
     (0, 16, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192),
     (0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224)),
)
# The first two bytes of a header dr_mp3 takes (ma_dr_mp3_hdr_valid): MPEG-1 and MPEG-2 of
# any layer, MPEG-2.5 of layer III only (a lookahead: in 0xFF 0xFF 0xFB, the header is the
# second 0xFF's)
_MP3_SYNC = re.compile(rb"\xff(?=[\xe2\xe3\xf2-\xf7\xfa-\xff])")
MP3_CONFIRM = 3  # frames that must follow a frame found after junk (or the end of the file)
MP3_MAX_MISSES = 4096  # sync-like bytes that are not frames: past these a file is refused


def _mp3_frames() -> list[tuple[int, int, int] | None]:
    """(bytes, samples, rate) of a frame by its header's second and third bytes
    (`b1 << 8 | b2`), as dr_mp3 computes them (ma_dr_mp3_hdr_frame_bytes, _padding,
    _frame_samples, _sample_rate_hz); None for a header dr_mp3 does not take and for free
    format (bitrate 0: no length in the header, a frame as short as its side information
    stands for 1152 samples)."""
    table: list[tuple[int, int, int] | None] = [None] * 65536
    for b1 in range(256):
        layer = b1 >> 1 & 3
        if not ((b1 & 0xF0) == 0xF0 or (b1 & 0xFE) == 0xE2) or not layer:
            continue
        mpeg1, not25 = b1 & 0x08, b1 & 0x10
        samples = 384 if layer == 3 else 576 if (b1 & 14) == 2 else 1152
        for b2 in range(256):
            bitrate, rate_index = b2 >> 4, b2 >> 2 & 3
            if bitrate in (0, 15) or rate_index == 3:
                continue
            rate = (44100, 48000, 32000)[rate_index] >> (not mpeg1) >> (not not25)
            n = samples * 2 * _HALFRATE[bool(mpeg1)][layer - 1][bitrate] * 125 // rate
            if layer == 3:
                n &= ~3
            if b2 & 2:
                n += 4 if layer == 3 else 1
            table[b1 << 8 | b2] = (n, samples, rate)
    return table


_MP3_FRAMES = _mp3_frames()


def _mp3_kind(b1: int, b2: int) -> int:
    """What dr_mp3's header comparison compares: version and layer, and sample rate."""
    return (b1 & 0xFE) << 8 | (b2 & 0x0C)


@dataclass(frozen=True)
class Mp3Layout:
    """An MP3 file's audio frames, as its walk found them."""

    rate: int
    samples: int  # samples (per channel) in a frame: 384, 576 or 1152
    frames: int  # frames found (the walk stops once they pass MAX_SOUND_SECONDS)
    claimed: int  # the largest frame count a Xing/Info tag in a frame claims
    # the frames end to end are source[start:end] (none if the walk stopped early): the
    # file itself where its frames are one stretch, so the daemon's check copies nothing
    source: bytes = dataclass_field(default=b"", repr=False, compare=False)
    start: int = 0
    end: int = 0

    @property
    def seconds(self) -> float:
        return max(self.frames, self.claimed) * self.samples / self.rate

    def stream(self) -> bytes:
        """The frames end to end: what the decoder is given, never the file."""
        return self.source[self.start:self.end]


def _mp3_bounds(data: bytes) -> tuple[int, int]:
    """Where an MP3 file's frames may be: after its ID3v2 tags, before an APE and an ID3v1
    tag at its end (dr_mp3 skips the same; a tag elsewhere is walked past as junk)."""
    start = 0
    while data[start:start + 3] == b"ID3" and start + 10 <= len(data):
        size = 0
        for b in data[start + 6:start + 10]:  # 4 x 7 bits
            size = size << 7 | (b & 0x7F)
        start += 10 + size + (10 if data[start + 5] & 0x10 else 0)  # an ID3v2.4 footer
    if start > len(data):
        raise ValueError("an MP3 file whose ID3v2 tag runs past its end")
    end = len(data)
    if end - start >= 128 and data[end - 128:end - 125] == b"TAG":
        end -= 128
    if end - start >= 32 and data[end - 32:end - 24] == b"APETAGEX":  # a footer
        size, flags = struct.unpack_from("<I", data, end - 20)[0], data[end - 9]
        size += 32 if flags & 0x80 else 0  # and a header
        if 32 <= size <= end - start:
            end -= size
    return start, end


def _mp3_confirmed(data: bytes, at: int, end: int, kind: int) -> bool:
    """Whether a frame at `at` is followed by MP3_CONFIRM frames of its kind, or by frames
    of its kind up to `end` (less than a header left)."""
    for _ in range(MP3_CONFIRM + 1):
        if end - at < 4:
            return True
        b1, b2 = data[at + 1], data[at + 2]
        frame = _MP3_FRAMES[b1 << 8 | b2]
        if data[at] != 0xFF or frame is None or _mp3_kind(b1, b2) != kind \
                or at + frame[0] > end:
            return False
        at += frame[0]
    return True


def mp3_layout(data: bytes) -> Mp3Layout:
    """An MP3 file's frames; ValueError for a file without any, or with frames of two kinds
    (a change of MPEG version, layer or sample rate), or junk that looks like frames past
    MP3_MAX_MISSES, or what dr_mp3 would read from it other than its frames."""
    start, end = _mp3_bounds(data)
    runs: list[tuple[int, int]] = []  # stretches of consecutive frames
    starts: list[int] = []  # each frame's first byte in the stream
    kind = samples = rate = frames = length = misses = 0
    most = 0.0  # frames in MAX_SOUND_SECONDS
    free = False
    pos = start
    while True:
        # the next frame: at `pos` if it is one of the kind, else the next sync a frame
        # confirms (frames of another kind that confirm themselves: refused)
        at = -1
        for m in _MP3_SYNC.finditer(data, pos, end):
            q = m.start()
            if q + 4 > end:
                break
            b1, b2 = data[q + 1], data[q + 2]
            frame = _MP3_FRAMES[b1 << 8 | b2]
            if frame is not None:
                k = _mp3_kind(b1, b2)
                if (not kind or k == kind) and _mp3_confirmed(data, q, end, k):
                    at = q
                    break
                if kind and k != kind and _mp3_confirmed(data, q, end, k):
                    raise ValueError("an MP3 file whose frames change MPEG version, layer or "
                                     "sample rate is not accepted")
            elif b2 >> 4 == 0 and b2 >> 2 & 3 != 3:
                free = True
            misses += 1
            if misses > MP3_MAX_MISSES:
                raise ValueError(f"an MP3 file with more than {MP3_MAX_MISSES} frame "
                                 "headers that no frames follow")
        if at < 0:
            break
        if not kind:
            b1, b2 = data[at + 1], data[at + 2]
            kind = _mp3_kind(b1, b2)
            _, samples, rate = _MP3_FRAMES[b1 << 8 | b2]  # type: ignore[misc]
            _check_rate(rate)
            most = MAX_SOUND_SECONDS * rate / samples
        run = pos = at
        while end - pos >= 4:  # the frames that follow, each where the last ends
            b1, b2 = data[pos + 1], data[pos + 2]
            frame = _MP3_FRAMES[b1 << 8 | b2]
            if data[pos] != 0xFF or frame is None or (b1 & 0xFE) << 8 | (b2 & 0x0C) != kind \
                    or pos + frame[0] > end:  # (_mp3_kind, inline: the walk's hot loop)
                break
            starts.append(length + pos - run)
            pos += frame[0]
            frames += 1
            if frames > most:  # enough to refuse it
                return Mp3Layout(rate, samples, frames, 0)
        runs.append((run, pos))
        length += pos - run
    if not frames:
        raise ValueError("free-format MP3 is not accepted" if free else
                         "an MP3 file without audio frames")
    if len(runs) == 1:
        (a, b), source = runs[0], data
    else:
        a, b, source = 0, length, b"".join(data[a:b] for a, b in runs)
    if (length > 128 and source[b - 128:b - 125] == b"TAG") \
            or (length > 32 and source[b - 32:b - 24] == b"APETAGEX"):
        raise ValueError("an MP3 file whose last frame ends as an ID3v1 or APE tag does "
                         "(its decoder would cut it there)")
    return Mp3Layout(rate, samples, frames, _mp3_claimed(source, a, b, starts), source, a, b)


def _mp3_claimed(source: bytes, a: int, b: int, starts: list[int]) -> int:
    """The largest frame count a Xing or Info tag claims in the frames `source[a:b]`, whose
    frames start at `starts` (from `a`), read where dr_mp3 reads it: after a frame's header,
    CRC and layer III side information (for any layer: dr_mp3 does not look at it), in the
    stream's bytes (a short frame's tag runs into the next). dr_mp3 reads only the first
    frame it decodes; which that is depends on the frames' contents, so every frame's is
    read."""
    claimed = 0
    for at in _found(source, b"Xing", a, b) + _found(source, b"Info", a, b):
        first = bisect.bisect_right(starts, at - a) - 1
        for s in starts[max(0, first - 2):first + 1]:  # a tag is at most 38 bytes in
            s += a
            mono = source[s + 3] & 0xC0 == 0xC0
            side = (17 if mono else 32) if source[s + 1] & 0x08 else (9 if mono else 17)
            if s + 4 + (0 if source[s + 1] & 1 else 2) + side != at:
                continue
            if at + 12 > b:
                raise ValueError("an MP3 file whose last frame holds a cut-off Xing tag")
            if source[at + 7] & 1:  # the frame count is there
                claimed = max(claimed, struct.unpack_from(">I", source, at + 8)[0])
    return claimed


def _found(data: bytes, word: bytes, a: int, b: int) -> list[int]:
    """Where `word` is in `data[a:b]` (bytes.find, no copy; a regular expression of two
    words takes four times as long)."""
    out, at = [], data.find(word, a, b)
    while at >= 0:
        out.append(at)
        at = data.find(word, at + 1, b)
    return out


SoundLayout = WavLayout | Mp3Layout


def sound_layout(data: bytes) -> SoundLayout:
    """A WAV or MP3 file's layout, read from its headers alone; ValueError for another
    format, a coding, rate or channel count not taken, or a truncated file."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return wav_layout(data)
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return mp3_layout(data)
    raise ValueError(f"not a sound file in a supported format ({', '.join(SOUND_FORMATS)})")


def sound_seconds(data: bytes) -> float:
    """The seconds a WAV or MP3 file declares (sound_layout)."""
    return sound_layout(data).seconds


def check_sound(data: bytes, where: str = "a sound file") -> SoundLayout:
    """The layout of the sound file `data`; 400 naming `where` for another format, a coding,
    rate or channel count not taken, a truncated file or more than MAX_SOUND_SECONDS."""
    try:
        layout = sound_layout(data)
    except ValueError as exc:
        raise _refuse(f"{where}: {exc}") from None
    if layout.seconds > MAX_SOUND_SECONDS:
        raise _refuse(f"{where}: the sound declares {layout.seconds:.0f} s of audio; at most "
                      f"{MAX_SOUND_SECONDS} s are accepted")
    return layout


def check_sound_header(data: bytes, where: str = "a sound file") -> float:
    """The seconds the sound file `data` declares (check_sound)."""
    return check_sound(data, where).seconds


def _check_rate(rate: int) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"a sound file's sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} "
                         "Hz are accepted")


# -- JSON schemas ----------------------------------------------------------------------------


@dataclass
class Budget:
    """What the schemas of one request have used so far (one grammar holds them all)."""

    nodes: int = 0
    chars: int = 0
    alternatives: int = 0


class _Schema:
    """One schema's checks. Walks are iterative, so a deeply nested schema meets the depth
    check, not Python's recursion limit."""

    def __init__(self, root: dict[str, Any], where: str, budget: Budget,
                 strict: bool = True) -> None:
        self.root = root
        self.strict = strict
        self.where = where
        self.budget = budget
        self.ref_depths: dict[str, int] = {}  # $ref -> depth of its target, refs followed
        self.resolving: set[str] = set()

    def refuse(self, what: str, at: str) -> EngineError:
        at = at if len(at) < 200 else at[:200] + "..."
        return _refuse(f"{self.where}: {what} (at {at or '/'}); structured output cannot "
                       "enforce this schema")

    def check(self) -> None:
        stack: list[tuple[str, Any]] = [("", self.root)]
        while stack:
            at, value = stack.pop()
            self.count(at, value)
            if isinstance(value, dict):
                self.check_node(value, at)
                stack.extend((f"{at}/{k}", child) for k, child in value.items())
            elif isinstance(value, list):
                stack.extend((f"{at}/{i}", child) for i, child in enumerate(value))
        self.depth(self.root, "", 1)  # after the size checks: the size bounds this walk
        self.keywords()

    def keywords(self) -> None:
        """Every keyword at a schema position (not inside `enum`, `const`, `default` or a
        property's name) is enforced or an annotation; else a 400 naming it, or a warning
        when the client asked for non-strict output."""
        stack: list[tuple[str, Any]] = [("", self.root)]
        while stack:
            at, node = stack.pop()
            if not isinstance(node, dict):
                continue  # true/false schemas, or a malformed value llguidance reports
            for key in node:
                if key not in SUPPORTED and key not in ANNOTATIONS:
                    self.unsupported(f"the keyword {key!r} is not supported", f"{at}/{key}")
            fmt = node.get("format")
            if fmt is not None and fmt not in FORMATS:
                self.unsupported(f"'format' {str(fmt)[:40]!r} is not supported (supported: "
                                 f"{', '.join(sorted(FORMATS))})", f"{at}/format")
            for key in _SUBSCHEMA:
                if isinstance(node.get(key), dict):
                    stack.append((f"{at}/{key}", node[key]))
            for key in _SUBSCHEMA_LISTS:
                if isinstance(node.get(key), list):
                    stack.extend((f"{at}/{key}/{i}", s) for i, s in enumerate(node[key]))
            for key in _SUBSCHEMA_MAPS:
                if isinstance(node.get(key), dict):
                    stack.extend((f"{at}/{key}/{name}", s) for name, s in node[key].items())

    def unsupported(self, what: str, at: str) -> None:
        if self.strict:
            raise self.refuse(what, at)
        log.warning("%s: %s (at %s); not enforced (the client asked for non-strict output)",
                    self.where, what, at[:200])

    def depth(self, value: Any, at: str, base: int) -> int:
        """How deep `value` nests (1: a scalar) when every `$ref` in it is followed into its
        target, as the converter recurses; refused once `base` plus that passes the limit.
        A ref already being followed adds nothing (the converter does not recurse there)."""
        deepest = 1
        stack: list[tuple[str, Any, int]] = [(at, value, 1)]
        while stack:
            at, node, d = stack.pop()
            if base + d - 1 > MAX_SCHEMA_DEPTH:
                raise self.refuse(f"nested over {MAX_SCHEMA_DEPTH} levels deep", at)
            deepest = max(deepest, d)
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref not in self.resolving:
                    deepest = max(deepest, d + self.ref_depth(ref, at, base + d))
                stack.extend((f"{at}/{k}", child, d + 1) for k, child in node.items())
            elif isinstance(node, list):
                stack.extend((f"{at}/{i}", child, d + 1) for i, child in enumerate(node))
        return deepest

    def ref_depth(self, ref: str, at: str, base: int) -> int:
        if ref not in self.ref_depths:
            self.resolving.add(ref)
            try:
                self.ref_depths[ref] = self.depth(self.resolve(ref, at), ref, base)
            finally:
                self.resolving.discard(ref)
        if base + self.ref_depths[ref] - 1 > MAX_SCHEMA_DEPTH:
            raise self.refuse(f"nested over {MAX_SCHEMA_DEPTH} levels deep", at)
        return self.ref_depths[ref]

    def count(self, at: str, value: Any) -> None:
        b = self.budget
        b.nodes += 1
        if isinstance(value, str):
            b.chars += len(value)
        elif isinstance(value, dict):
            b.chars += sum(len(k) for k in value if isinstance(k, str))
        if b.nodes > MAX_SCHEMA_NODES:
            raise self.refuse(f"over {MAX_SCHEMA_NODES} values in all", at)
        if b.chars > MAX_SCHEMA_CHARS:
            raise self.refuse(f"over {MAX_SCHEMA_CHARS} characters of names and strings "
                              "in all", at)

    def resolve(self, ref: str, at: str) -> Any:
        """The target of a local `$ref` ('#' for the root, '#/$defs/x'), with JSON
        Pointer's escapes ('~1' is '/', '~0' is '~')."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise self.refuse(f"'$ref' {ref[:100]!r}: only local references ('#', '#/...') "
                              "are supported", at)
        target: Any = self.root
        for raw in ref[2:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise self.refuse(f"'$ref' {ref[:100]!r} points to nothing", at)
            target = target[part]
        return target

    def check_node(self, node: dict[str, Any], at: str) -> None:
        alts = sum(len(v) for k in ("enum", "anyOf", "oneOf", "type")
                   if isinstance(v := node.get(k), list))
        self.budget.alternatives += alts
        if self.budget.alternatives > MAX_ALTERNATIVES:
            raise self.refuse(f"over {MAX_ALTERNATIVES} alternatives ('enum', 'anyOf', "
                              "'oneOf' entries) in all", at)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.check_pattern(pattern, at)
        self.check_literals(node, at)

    def check_literals(self, node: dict[str, Any], at: str) -> None:
        """Property names and `enum`/`const` strings become literals of the grammar: a huge
        one stalls the first mask (a 256 KB `const` took 1.3 s). Control characters in them
        are fine: llguidance writes them escaped (llama.cpp's GBNF wrote them raw, and a
        property named "\x04" made it abort the runner)."""
        props = node.get("properties")
        literals = list(props) if isinstance(props, dict) else []
        enum = node.get("enum")
        literals += enum if isinstance(enum, list) else []
        literals.append(node.get("const"))
        for text in literals:
            if isinstance(text, str) and len(text) > MAX_LITERAL_CHARS:
                raise self.refuse(f"a 'const' or 'enum' string of {len(text)} characters, "
                                  f"over the limit of {MAX_LITERAL_CHARS}", at)

    def check_pattern(self, pattern: str, at: str) -> None:
        at = f"{at}/pattern"
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise self.refuse(f"'pattern' of {len(pattern)} characters, over the limit of "
                              f"{MAX_PATTERN_LENGTH}", at)
        depth = 0
        for c in re.sub(r"\\.", "", pattern):
            depth += (c == "(") - (c == ")")
            if depth > MAX_PATTERN_NESTING:
                raise self.refuse(f"'pattern' groups nested over {MAX_PATTERN_NESTING} "
                                  "deep", at)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def check_schema(schema: Any, where: str = "format", budget: Budget | None = None,
                 strict: bool = True) -> None:
    """A JSON schema that will become a grammar: within every ceiling of this module, and
    every keyword enforced (or, not `strict`, the others logged). `"json"` and None (a fixed
    grammar, or none) pass."""
    if isinstance(schema, dict):
        _Schema(schema, where, budget or Budget(), strict).check()


def check_grammar(gbnf: str | None) -> None:
    """A raw GBNF grammar: its size and how deep its groups nest."""
    if gbnf is None:
        return
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise _refuse(f"grammar: {len(gbnf)} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    # literals ("..."), character classes ([...]) and comments (# ...) hold no groups
    bare = re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*', "", gbnf)
    depth = 0
    for c in bare:
        depth += (c == "(") - (c == ")")
        if depth > MAX_GRAMMAR_NESTING:
            raise _refuse(f"grammar: groups nested over {MAX_GRAMMAR_NESTING} deep")


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
    budget = Budget()
    check_schema(req.format, "format", budget, req.format_strict)
    check_tools(req.tools, req.tool_choice, budget, req.format_strict)
    check_grammar(req.grammar)
