"""Image files named in a prompt, attached to it (as Ollama's CLI does for vision models).

`llmrun run MODEL "what is in ./photo.png?"`: a word of the prompt that is the path of an
existing image file (quoted, or with backslash-escaped spaces, `~` allowed) is taken out of
the text and sent as an image. Only for a model that reads images: for any other the prompt
goes as written.
"""

from __future__ import annotations

import base64
import re
import sys
from pathlib import Path

from llmrun import config
from llmrun.client import APIError, Client

EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")

# a quoted path, or a run of non-space characters and escaped spaces, ending in an image
# extension (any case)
_PATH = re.compile(r"""(?:'([^']+)'|"([^"]+)"|((?:[^\s'"\\]|\\ )+))""")


def find(text: str) -> tuple[str, list[Path]]:
    """`text` without the image files it names, and those files (that exist), in order."""
    found: list[Path] = []
    out: list[str] = []
    last = 0
    for m in _PATH.finditer(text):
        raw = next(g for g in m.groups() if g is not None).replace("\\ ", " ")
        candidate = raw.rstrip(".,;:!?)")  # "look at photo.png." ends a sentence
        if not candidate.lower().endswith(EXTENSIONS):
            continue
        path = Path(candidate).expanduser()
        if not path.is_file():
            continue
        found.append(path)
        out.append(text[last:m.start()])
        out.append(raw[len(candidate):])  # the punctuation after it stays
        last = m.end()
    out.append(text[last:])
    return re.sub(r"[ \t]{2,}", " ", "".join(out)).strip(), found


def message(text: str) -> tuple[dict[str, object], list[Path]]:
    """A user message with the image files `text` names attached (base64, as Ollama's API
    takes them), and the files; ValueError for one too large to send."""
    rest, paths = find(text)
    pictures = []
    limit = config.max_image_size()  # the daemon's (the same setting, on this machine)
    for path in paths:
        size = path.stat().st_size
        if size > limit:
            raise ValueError(f"{path} is {size} bytes; an image may be at most {limit} "
                             f"(LLMRUN_MAX_IMAGE_SIZE)")
        pictures.append(base64.b64encode(path.read_bytes()).decode())
    if not pictures:
        return {"role": "user", "content": text}, []
    return {"role": "user", "content": rest, "images": pictures}, paths


def user_turn(client: Client, model: str, text: str) -> dict[str, object]:
    """The user message for `text`: with the image files it names attached when `model`
    reads images (each one announced on stderr, as Ollama does), else the text as it is."""
    if not find(text)[1]:
        return {"role": "user", "content": text}
    try:
        vision = "vision" in client.show(model).get("capabilities", [])
    except APIError:
        vision = False  # (an unknown model: the chat request says so)
    if not vision:
        return {"role": "user", "content": text}
    msg, paths = message(text)
    for path in paths:
        sys.stderr.write(f"Added image '{path}'\n")
    return msg
