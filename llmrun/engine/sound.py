"""Sound files to samples, inside the runner's sandbox, bounded before anything is decoded.

Audio decoders are attack surface, as image decoders are (engine/pixels.py): a request's
bytes reach this code, so it runs only in the confined runner. The header is read first, in
Python (llmrun/bounds.py's check_sound_header, which the daemon applies too), and a file is
refused before a sample is decoded when it declares too long a sound, a sample rate outside
what speech models take, or more data than it holds (a truncated file); an MP3's frames are
walked, so a bomb never reaches the decoder. Then libmtmd's own helper (miniaudio) decodes
and resamples to the projector's rate. Only WAV and MP3 are taken (what OpenAI's
`input_audio` names); anything else is refused by its first bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable

import numpy as np

from llmrun import bounds
from llmrun.request import EngineError


def decode(data_b64: str, decoder: Callable[[bytes], np.ndarray]) -> tuple[np.ndarray, str]:
    """A base64 sound file as (mono float32 samples at the projector's rate, content hash);
    `decoder` is the projector's (Projector.decode_sound). ValueError, naming what is wrong,
    for anything that is not a whole WAV or MP3 file within the bounds."""
    try:
        data = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a sound file is not valid base64") from None
    try:  # the daemon checked it too, but a request may be built anywhere
        bounds.check_sound_header(data)
    except EngineError as exc:  # worded as the runner words a request's fault
        raise ValueError(exc.message) from None
    samples = decoder(data)
    if not len(samples):
        raise ValueError("a sound file holds no samples")
    digest = hashlib.sha256(b"pcm:" + samples.tobytes()).hexdigest()
    return samples, digest


