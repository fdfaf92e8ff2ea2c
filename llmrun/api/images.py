"""Images in requests, as every dialect carries them, made into `Message.images` (base64 text
of the image files, in order): bare base64 (Ollama's `images`, Anthropic's `base64` source),
`data:` URLs (OpenAI's `image_url`, Responses' `input_image`) and http(s) URLs (those two,
and Anthropic's `url` source).

Each image is checked here, where the dialect knows the field to name: strict base64 (line
breaks and missing padding tolerated, since encoders wrap and some strip it), an `image/*`
media type for data URLs, and its decoded size (bounds.py). The request's image count and
sizes are checked again with the other bounds before a runner is leased; decoding and pixel
limits are the runner's.

An http(s) URL makes the daemon connect wherever the caller says: the local network, a cloud
metadata address, services bound to loopback. So URLs are refused unless LLMRUN_IMAGE_URLS
is on. Then translation (synchronous) leaves the URL in `Message.images` and `fetched`
downloads it before the request goes on: GET only, redirects followed by hand and only to
http(s), the body read in pieces and dropped once over the size limit, under a deadline.
Every connection (each redirect's too) goes through the remote models' `GuardedTransport`:
link-local and cloud metadata addresses are refused however the URL spells them or its
host resolves, unless LLMRUN_REMOTE_LINK_LOCAL allows them.
Errors are `EngineError` (400, "invalid_request"), which each dialect words in its own shape.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable
from typing import Any

from llmrun import bounds, config, media
from llmrun.request import ChatRequest, EngineError, Message

log = logging.getLogger(__name__)

URL_SCHEMES = ("http://", "https://")
FETCH_TIMEOUT = 10.0  # seconds for each of connect, a read, a write
FETCH_DEADLINE = 30.0  # seconds for a whole fetch: a server trickling bytes cannot hold it
MAX_REDIRECTS = 3
# Content types a fetched image may come with besides image/*: servers that do not know
# (a bucket serving octet-stream) or say nothing; an HTML error page is refused.
UNTYPED = ("", "application/octet-stream", "binary/octet-stream")


def _invalid(message: str) -> EngineError:
    return EngineError(message, code="invalid_request")


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


def _decoded(text: Any, where: str, check_size: Callable[[int], None], *, a: str,
             kind: str, the: str) -> bytes:
    """Base64 `text` decoded, for an image or a sound file (`a`, `kind`, `the`: how the
    messages name it): whitespace dropped (encoders wrap lines: MIME every 76 characters)
    and padding restored (some encoders drop it), its size checked (`check_size`, with the
    decoded size read from the length) before decoding; 400 naming `where` if it is not
    base64 or is empty."""
    if not isinstance(text, str):
        raise _invalid(f"{where}: {a} must be a base64 string")
    data = "".join(text.split())
    if len(data) % 4 in (2, 3):
        data += "=" * (4 - len(data) % 4)
    check_size(media.decoded_size(data))
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid(f"{where}: invalid base64 {kind} data") from None
    if not raw:
        raise _invalid(f"{where}: {the} is empty")
    return raw


def from_base64(text: Any, where: str) -> str:
    """Base64 `text` checked and made canonical (no whitespace, padded), so that the bounds
    can read an image's size from its length. 400 naming `where` if it is not base64, is
    empty or decodes to more than the image size limit (checked before decoding)."""
    raw = _decoded(text, where, lambda n: bounds.check_image_size(n, where),
                   a="an image", kind="image", the="the image")
    # re-encoded: the same text unless the input had stray bits in its last character
    return base64.b64encode(raw).decode("ascii")


AUDIO_FORMATS = ("wav", "mp3")  # what OpenAI's input_audio names; the runner reads the header


def from_audio(data: Any, fmt: Any, where: str) -> str:
    """A sound file's base64 (OpenAI's `input_audio`: {data, format}), checked and made
    canonical as an image's is, against the sound file limit (LLMRUN_MAX_AUDIO_SIZE). Its
    duration and rate are the runner's to read, from the header, before decoding."""
    if fmt is not None and fmt not in AUDIO_FORMATS:
        raise _invalid(f"{where}.format: expected one of {', '.join(AUDIO_FORMATS)}, got "
                       f"{_short(str(fmt), 40)!r}")
    raw = _decoded(data, f"{where}.data", lambda n: bounds.check_audio_size(n, where),
                   a="a sound file", kind="audio", the="the sound file")
    bounds.check_sound_header(raw, where)  # duration, rate, truncation: before any runner
    return base64.b64encode(raw).decode("ascii")


def from_data_url(url: str, where: str) -> str:
    """The base64 of a `data:image/...;base64,...` URL. A data URL of another media type, or
    without `;base64`, is refused: its text would not be an image."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise _invalid(f"{where}: invalid data URL (no ',' before the data)")
    params = [p.strip().lower() for p in header.split(";")]
    media = params[0] or "text/plain"  # RFC 2397's default
    if not media.startswith("image/"):
        raise _invalid(f"{where}: a data URL of type {_short(media, 40)!r} is not an image; "
                       "send data:image/png;base64,... (or jpeg, gif, webp)")
    if "base64" not in params[1:]:
        raise _invalid(f"{where}: the image data URL must be base64 "
                       f"(data:{media};base64,...)")
    return from_base64(payload, where)


def from_url(url: Any, where: str) -> str:
    """An image named by URL: a data URL's base64; an http(s) URL as is, to be downloaded
    by `fetched` (only when LLMRUN_IMAGE_URLS allows it); any other scheme refused."""
    if not isinstance(url, str) or not url.strip():
        raise _invalid(f"{where}: expected an image URL (data:image/...;base64,... or "
                       "http(s)://...)")
    url = url.strip()
    lowered = url[:16].lower()
    if lowered.startswith("data:"):
        return from_data_url(url, where)
    if lowered.startswith(URL_SCHEMES):
        if not config.image_urls():
            raise _invalid(f"{where}: image URLs are not fetched by this server (set "
                           "LLMRUN_IMAGE_URLS=1 on the daemon to allow it); send the image "
                           "inline as base64 (a data:image/...;base64,... URL)")
        return url
    raise _invalid(f"{where}: unsupported image URL scheme in {_short(url, 40)!r}; send a "
                   "data:image/...;base64,... URL")


def from_media_type(media_type: Any, data: Any, where: str) -> str:
    """Base64 `data` declared as `media_type` (Anthropic's base64 source)."""
    if not isinstance(media_type, str) or not media_type.lower().startswith("image/"):
        raise _invalid(f"{where}.media_type: expected an image type (image/jpeg, image/png, "
                       f"image/gif or image/webp), got {media_type!r}")
    return from_base64(data, f"{where}.data")


def is_url(image: str) -> bool:
    return image[:8].lower().startswith(URL_SCHEMES)


# -- downloading URLs ----------------------------------------------------------------------


async def fetched(req: ChatRequest) -> ChatRequest:
    """`req` with every image URL its messages hold (left by `from_url`) replaced by the
    image downloaded; `req` itself when there is none."""
    if not any(is_url(image) for m in req.messages for image in m.images):
        return req
    bounds.check_images_count(req.messages)  # before any download: never fetch 1000 URLs
    if not config.image_urls():  # a request built elsewhere must not slip past the setting
        raise _invalid("image URLs are not fetched by this server (set LLMRUN_IMAGE_URLS=1 "
                       "on the daemon to allow it)")
    import httpx  # here: only a daemon that fetches images needs a client

    from llmrun.server.upstream import GuardedTransport

    # decoded bytes of the request's images so far: inline ones count from the start
    used = sum(media.decoded_size(i) for m in req.messages for i in m.images if not is_url(i))
    messages: list[Message] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(FETCH_TIMEOUT), follow_redirects=False,
                                 transport=GuardedTransport(config.remote_link_local())
                                 ) as client:
        for m in req.messages:
            images = []
            for image in m.images:
                if is_url(image):
                    raw = await _download(client, image, used)
                    used += len(raw)
                    image = base64.b64encode(raw).decode("ascii")
                images.append(image)
            messages.append(m.model_copy(update={"images": images}) if images else m)
    return req.model_copy(update={"messages": messages})


async def _download(client: Any, url: str, used: int) -> bytes:
    """The image at `url`; `used`: decoded bytes the request's other images take."""
    where = f"image URL {_short(url)!r}"
    log.info("fetching an image for a request: %s", _short(url, 200))  # the daemon connects
    try:
        async with asyncio.timeout(FETCH_DEADLINE):
            raw = await _get(client, url, where, used)
    except TimeoutError:
        raise _invalid(f"{where}: no complete answer within {FETCH_DEADLINE:g} s") from None
    if not raw:
        raise _invalid(f"{where}: the image is empty")
    return raw


async def _get(client: Any, url: str, where: str, used: int) -> bytes:
    import httpx

    from llmrun.server.upstream import AddressRefused

    for _ in range(MAX_REDIRECTS + 1):
        try:
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    target = response.url.join(response.headers.get("location", ""))
                    if target.scheme not in ("http", "https"):
                        raise _invalid(f"{where}: redirected to a {target.scheme}: URL; only "
                                       "http(s) is followed")
                    url = str(target)
                    continue
                if response.status_code != 200:
                    raise _invalid(f"{where}: the server answered HTTP "
                                   f"{response.status_code}")
                kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if not kind.startswith("image/") and kind not in UNTYPED:
                    raise _invalid(f"{where}: the server sent {_short(kind, 40)!r}, not an "
                                   "image")
                return await _body(response, where, used)
        except AddressRefused as exc:
            raise _invalid(f"{where}: {exc}") from None
        except httpx.HTTPError as exc:
            detail = f": {_short(str(exc))}" if str(exc) else ""
            raise _invalid(f"{where}: could not fetch it ({type(exc).__name__}{detail})"
                           ) from None
    raise _invalid(f"{where}: more than {MAX_REDIRECTS} redirects")


async def _body(response: Any, where: str, used: int) -> bytes:
    """The response's body, read in pieces and given up once over the per-image limit (or
    the request's total), whatever Content-Length said."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit():  # refused before a byte of the body is read
        bounds.check_image_size(int(declared), where)
        bounds.check_images_total(used + int(declared), where)
    parts: list[bytes] = []
    size = 0
    async for piece in response.aiter_bytes():
        size += len(piece)
        bounds.check_image_size(size, where)
        bounds.check_images_total(used + size, where)
        parts.append(piece)
    return b"".join(parts)
