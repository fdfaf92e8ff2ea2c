"""Image files to pixels, inside the runner's sandbox, bounded before anything is decoded.

Image decoders are attack surface: a request's bytes reach this code, so it runs only in
the confined runner, reads the header first and refuses a file whose declared size is over
MAX_PIXELS (a decompression bomb: a few kilobytes declaring 20,000 x 20,000 pixels) before
a pixel is decoded. Pillow decodes (its decoders are fuzzed continuously; llama.cpp's own
loader is stb_image) and only the formats in FORMATS are tried.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings

from PIL import Image

# Pixels an image's header may declare (64 Mpx: 8192 x 8192, 192 MB as RGB). Its bytes were
# bounded by the daemon (LLMRUN_MAX_IMAGE_SIZE, llmrun/bounds.py) and by the IPC frame.
MAX_PIXELS = 64 * 1024 * 1024
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

# Pillow's own bomb check (a warning up to twice its limit, an error beyond) follows ours
Image.MAX_IMAGE_PIXELS = MAX_PIXELS


def preload() -> None:
    """Import the decoders now: the sandbox lets a runner open no new files later."""
    Image.init()


def decode(data_b64: str) -> tuple[int, int, bytes, str]:
    """A base64 image file as (width, height, RGB bytes, content hash). ValueError, naming
    what is wrong, for anything that is not a whole image within the bounds."""
    try:
        data = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image is not valid base64") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValueError(f"an image declares more than {MAX_PIXELS} pixels") from None
    except (OSError, ValueError, SyntaxError):  # Pillow's "cannot identify image file"
        raise ValueError(f"not an image file in a supported format "
                         f"({', '.join(FORMATS)})") from None
    with img:
        width, height = img.size
        if width < 1 or height < 1 or width * height > MAX_PIXELS:
            raise ValueError(f"an image is {width} x {height} pixels; at most {MAX_PIXELS} "
                             f"pixels are accepted")
        try:
            img.load()  # a truncated or damaged file fails here, not later in llama.cpp
            rgb = img.convert("RGB").tobytes()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise ValueError(f"an image could not be decoded ({exc})") from None
    digest = hashlib.sha256(b"%dx%d:" % (width, height) + rgb).hexdigest()
    return width, height, rgb, digest
