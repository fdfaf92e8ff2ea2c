"""multipart/form-data bodies, read as they arrive and bounded while they are read.

OpenAI's speech-to-text routes take a form: one file and a handful of short text fields. The
standard library's MIME parser reads a whole body at once, in one call on the event loop, and
builds an object for every part: 100,000 empty parts (5 MB) held the daemon's loop for 30 s,
every other request and stream waiting. Here python-multipart (the streaming parser Starlette
uses) is fed the body chunk by chunk as the server hands it over (at most about 64 KiB
each: uvicorn stops reading the socket past that until the app takes it), so the loop turns
between chunks; and each bound below is checked the moment it is passed, so a hostile form
stops being parsed within the chunk that crosses it. What the parser has to do per byte
(part headers, which it reads byte by byte in Python) is bounded in all: headers per part, and
parts per form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

# RFC 2046 boundaries are at most 70 characters; some clients pad theirs, none this far.
MAX_BOUNDARY = 200
# One part's headers (Content-Disposition, Content-Type): a browser's or an SDK's are a few
# hundred bytes; python-multipart reads them a byte at a time in Python, so they are bounded.
MAX_PART_HEADER_BYTES = 8 * 1024


class FormError(Exception):
    """A form refused: `status` (400, or 413 for a part too large), and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class Limits:
    """What one form may hold. `files`: the names of the file fields; a part named so is
    read as a file (into memory, up to `check_file(size)`, which raises when a file grows past
    its limit), any other part as a text field of at most `max_field_bytes`."""

    files: frozenset[str]
    max_fields: int
    max_field_bytes: int
    check_file: Callable[[str, int], None]


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # name: (filename, data)


class _Reader:
    """python-multipart's callbacks, building the form and checking each bound as it goes."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.form = Form()
        self.fields = 0
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.header_bytes = 0
        self.disposition = b""
        self.name = ""
        self.filename: str | None = None
        self.data = bytearray()
        self.is_file = False

    def on_part_begin(self) -> None:
        self.header_bytes = 0
        self.disposition = b""
        self.data = bytearray()

    def _header_bytes(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > MAX_PART_HEADER_BYTES:
            raise FormError(400, f"a form part's headers are over {MAX_PART_HEADER_BYTES} "
                                 "bytes")

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes(end - start)
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes(end - start)
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        if bytes(self.header_name).lower() == b"content-disposition":
            self.disposition = bytes(self.header_value)
        self.header_name, self.header_value = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        raw = options.get(b"name")
        if raw is None:
            raise FormError(400, "a form part has no name (Content-Disposition: form-data; "
                                 "name=...)")
        self.name = raw.decode("utf-8", "replace")
        filename = options.get(b"filename")
        self.filename = filename.decode("utf-8", "replace") if filename is not None else None
        self.is_file = self.name in self.limits.files
        if self.is_file:
            if self.name in self.form.files:
                raise FormError(400, f"'{self.name}' was sent twice: one file only", self.name)
        else:
            if self.filename is not None:
                raise FormError(400, f"a file was sent in '{self.name}'; the file goes in "
                                     f"{' or '.join(sorted(self.limits.files))}", self.name)
            self.fields += 1
            if self.fields > self.limits.max_fields:
                raise FormError(400, f"too many form fields: more than "
                                     f"{self.limits.max_fields}")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        size = len(self.data) + end - start
        if self.is_file:
            self.limits.check_file(self.name, size)
        elif size > self.limits.max_field_bytes:
            raise FormError(413, f"form field '{self.name[:64]}' is over "
                                 f"{self.limits.max_field_bytes} bytes", self.name[:64])
        self.data += data[start:end]

    def on_part_end(self) -> None:
        if self.is_file:
            self.form.files[self.name] = (self.filename or self.name, bytes(self.data))
        else:
            self.form.fields[self.name] = self.data.decode("utf-8", "replace")
        self.data = bytearray()


def _boundary(content_type: str) -> bytes:
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise FormError(400, "expected a multipart/form-data body")
    boundary = options.get(b"boundary")
    if not boundary:
        raise FormError(400, "the multipart/form-data body has no boundary in its "
                             "Content-Type")
    if len(boundary) > MAX_BOUNDARY:
        raise FormError(400, f"the multipart boundary is over {MAX_BOUNDARY} bytes")
    return boundary


async def _drain(request: Request) -> None:
    """Read what the client still sends (the daemon's body limit bounds it) and drop it, so
    the client, still sending, reads the refusal rather than a reset connection."""
    try:
        async for _ in request.stream():
            pass
    except (ClientDisconnect, RuntimeError):  # gone, or the stream already ended
        pass


async def read_form(request: Request, limits: Limits) -> Form:
    """The request's form, read chunk by chunk; FormError at the first bound it passes (or
    when it is not a well-formed form). Exceptions that `limits.check_file` raises pass
    through, after the rest of the body is drained."""
    boundary = _boundary(request.headers.get("content-type", ""))
    reader = _Reader(limits)
    parser = MultipartParser(boundary, {
        "on_part_begin": reader.on_part_begin, "on_part_data": reader.on_part_data,
        "on_part_end": reader.on_part_end, "on_header_field": reader.on_header_field,
        "on_header_value": reader.on_header_value, "on_header_end": reader.on_header_end,
        "on_headers_finished": reader.on_headers_finished})
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except FormParserError as exc:
        await _drain(request)
        raise FormError(400, f"the multipart/form-data body could not be read: {exc}") \
            from None
    except ClientDisconnect:
        raise
    except Exception:
        await _drain(request)
        raise
    return reader.form
