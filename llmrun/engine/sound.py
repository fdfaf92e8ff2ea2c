"""Sound files to samples, inside the runner's sandbox, bounded before anything is decoded.

Audio decoders are attack surface, as image decoders are (engine/pixels.py): a request's
bytes reach this code, so it runs only in the confined runner. The header is read first, in
Python (llmrun/media.py's check_sound, which the daemon applies too), and a file is
refused before a sample is decoded when it declares too long a sound, a coding whose length
its header does not give (ADPCM), a sample rate outside what speech models take, or more
data than it holds (a truncated file); an MP3's frames are walked, so a bomb never reaches
the decoder. Then libmtmd's own helper (miniaudio) decodes and resamples to the projector's
rate, given only what was read: a WAV file written here from the coding and samples read,
an MP3's frames end to end (no tag, no junk between frames: miniaudio tries its decoders in
turn and each reads a file its own way, so bytes the header walk skipped could otherwise be
decoded). Only WAV and MP3 are taken (what OpenAI's
`input_audio` names); anything else is refused by its first bytes. FLAC is not: its header
declares a length, but only decoding its frames tells what they hold (a frame of one
constant value stands for 65,535 samples in a few bytes), so no header walk bounds it.

A sound is read in pieces of its projector's length where it has one (decode).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Callable

import numpy as np

from llmrun import media

# The shortest sound read: libmtmd asserts (aborting the process) on fewer than two
# samples, and no word is said in less. A sound's last piece shorter than this is dropped
# (a resampler's output often ends one sample past a whole second).
MIN_PIECE_SECONDS = 0.01


def decode(data_b64: str, decoder: Callable[[bytes], np.ndarray], rate: int,
           piece_seconds: float | None = None) -> list[tuple[np.ndarray, str]]:
    """A base64 sound file as pieces of mono float32 samples at the projector's `rate`, each
    with its content hash: the whole sound as one piece, or consecutive pieces of
    `piece_seconds` (the projector's, media.SOUND_PIECE_SECONDS), each to be encoded on its
    own. `decoder` is the projector's (Projector.decode_sound). ValueError, naming what is
    wrong, for anything that is not a whole WAV or MP3 file within the bounds.

    A WAV is cut at its own rate, before resampling, into WAV files of whole pieces: a
    stream sent as such files (a realtime session's pieces) and the same sound sent as one
    file give the same samples, to the bit, where cutting after resampling would not (a
    resampler's filter reads across the cut). Other formats are decoded whole and cut at the
    projector's rate. A last piece shorter than MIN_PIECE_SECONDS is dropped, and a sound
    shorter than that is refused."""
    try:
        data = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a sound file is not valid base64") from None
    try:  # the daemon checked it too, but a request may be built anywhere
        layout = media.check_sound(data)
    except ValueError as exc:  # worded as the daemon words it (bounds.check_sound)
        raise ValueError(f"a sound file: {exc}") from None
    if isinstance(layout, media.Mp3Layout):  # its frames, not the file (media.py)
        whole = decoder(layout.stream())
        if not piece_seconds:
            return [_hashed(whole, rate)]
    else:  # a WAV file written from what was read, never the file
        samples = data[layout.start:layout.start + layout.size]
        step = media.piece_frames(piece_seconds, layout.rate) * layout.block \
            if piece_seconds else layout.size
        if layout.size <= step:  # one piece
            return [_hashed(decoder(_wav(layout, samples)), rate)]
        return [_hashed(decoder(_wav(layout, samples[at:at + step])), rate)
                for at in _starts(len(samples), step, layout.rate * layout.block)]
    step = media.piece_frames(piece_seconds, rate)
    return [_hashed(whole[at:at + step], rate) for at in _starts(len(whole), step, rate)]


def _starts(n: int, step: int, per_second: int) -> list[int]:
    """Where the pieces of `n` units (`per_second` of them a second) begin, `step` apart: a
    last piece shorter than MIN_PIECE_SECONDS is dropped, unless it is the only one."""
    return [at for at in range(0, n, step)
            if at == 0 or n - at >= MIN_PIECE_SECONDS * per_second]


def _wav(layout: media.WavLayout, samples: bytes) -> bytes:
    """A WAV file of `samples`, in the coding `layout` read: its plain 16-byte format chunk
    and one data chunk, nothing the file had besides (what dr_wav reads of it is what
    media.py read)."""
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(layout.fmt)) + layout.fmt \
        + b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _hashed(samples: np.ndarray, rate: int) -> tuple[np.ndarray, str]:
    if len(samples) < MIN_PIECE_SECONDS * rate:
        raise ValueError(f"a sound file holds {len(samples) / rate * 1000:.1f} ms of sound; "
                         f"at least {MIN_PIECE_SECONDS * 1000:.0f} ms are needed")
    return samples, hashlib.sha256(b"pcm:" + samples.tobytes()).hexdigest()
