"""Sound files to samples, inside the runner's sandbox, bounded before anything is decoded.

Audio decoders are attack surface, as image decoders are (engine/pixels.py): a request's
bytes reach this code, so it runs only in the confined runner. The header is read here, in
Python, and a file is refused before a sample is decoded when it declares more than
MAX_SECONDS, a sample rate outside what speech models take, or more data than it holds (a
truncated file). An MP3 has no header for the whole file: its frames are walked (their
headers only) and the duration they add up to is bounded the same way, so a bomb (a few
megabytes of minimal frames that decode to hours) never reaches the decoder. Then libmtmd's
own helper (miniaudio) decodes and resamples to the projector's rate. Only WAV and MP3 are
taken (what OpenAI's `input_audio` names); anything else is refused by its first bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Callable

import numpy as np

MAX_SECONDS = 20 * 60  # a sound's declared duration (OpenAI transcribes 25 MB: ~25 min mp3)
MIN_RATE, MAX_RATE = 8_000, 48_000  # sample rates taken (telephone to studio)
MAX_CHANNELS = 8
FORMATS = ("WAV", "MP3")

# MPEG audio frame headers (ISO 11172-3, 13818-3): kbit/s by [version is MPEG-1][layer],
# sample rates by version; layer is 1, 2 or 3
_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def decode(data_b64: str, decoder: Callable[[bytes], np.ndarray]) -> tuple[np.ndarray, str]:
    """A base64 sound file as (mono float32 samples at the projector's rate, content hash);
    `decoder` is the projector's (Projector.decode_sound). ValueError, naming what is wrong,
    for anything that is not a whole WAV or MP3 file within the bounds."""
    try:
        data = base64.b64decode(data_b64, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a sound file is not valid base64") from None
    seconds = duration(data)
    if seconds > MAX_SECONDS:
        raise ValueError(f"a sound file declares {seconds:.0f} s of audio; at most "
                         f"{MAX_SECONDS} s are accepted")
    samples = decoder(data)
    if not len(samples):
        raise ValueError("a sound file holds no samples")
    digest = hashlib.sha256(b"pcm:" + samples.tobytes()).hexdigest()
    return samples, digest


def duration(data: bytes) -> float:
    """The seconds a WAV or MP3 file declares, read from its headers alone; ValueError for
    another format, a rate or channel count out of bounds, or a truncated file."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _wav_seconds(data)
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return _mp3_seconds(data)
    raise ValueError(f"not a sound file in a supported format ({', '.join(FORMATS)})")


def _check_rate(rate: int) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"a sound file's sample rate is {rate} Hz; {MIN_RATE} to {MAX_RATE} "
                         "Hz are accepted")


def _wav_seconds(data: bytes) -> float:
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise ValueError("a WAV file's format chunk is truncated")
            fmt = struct.unpack_from("<HHIIHH", data, body)
        elif kind == b"data":
            if fmt is None:
                raise ValueError("a WAV file's samples come before its format")
            _tag, channels, rate, _byte_rate, block, _bits = fmt
            _check_rate(rate)
            if not 1 <= channels <= MAX_CHANNELS or block < 1:
                raise ValueError(f"a WAV file with {channels} channels; 1 to {MAX_CHANNELS} "
                                 "are accepted")
            seconds: float = size / block / rate
            if seconds <= MAX_SECONDS and body + size > len(data):
                raise ValueError(f"a WAV file is truncated: it declares {size} bytes of "
                                 f"samples and holds {len(data) - body}")
            return seconds
        pos = body + size + (size & 1)  # chunks are padded to an even size
    raise ValueError("a WAV file without samples (no data chunk)")


def _mp3_seconds(data: bytes) -> float:
    pos = 0
    if data[:3] == b"ID3" and len(data) >= 10:  # an ID3v2 tag: its size is 4 x 7 bits
        size = 0
        for b in data[6:10]:
            size = size << 7 | (b & 0x7F)
        pos = 10 + size
    seconds, frames = 0.0, 0
    while pos + 4 <= len(data):
        h = struct.unpack_from(">I", data, pos)[0]
        if h >> 21 != 0x7FF:
            break  # trailing tags (ID3v1, APE) or junk: the frames ended
        version, layer = h >> 19 & 3, 4 - (h >> 17 & 3)
        bitrate_index, rate_index, padding = h >> 12 & 15, h >> 10 & 3, h >> 9 & 1
        if version == 1 or layer == 4 or rate_index == 3 or bitrate_index == 15:
            raise ValueError("an MP3 file with an invalid frame header")
        if bitrate_index == 0:  # free format: a frame's length is not in its header
            raise ValueError("free-format MP3 is not accepted")
        mpeg1 = version == 3
        rate = _RATES[version][rate_index]
        _check_rate(rate)
        kbps = _BITRATES[(mpeg1, layer)][bitrate_index]
        if layer == 1:
            length, samples = (12 * kbps * 1000 // rate + padding) * 4, 384
        else:
            per = 144 if layer == 2 or mpeg1 else 72
            length, samples = per * kbps * 1000 // rate + padding, 1152 if per == 144 else 576
        seconds += samples / rate
        frames += 1
        if seconds > MAX_SECONDS:
            return seconds  # enough to refuse it
        pos += length
    if not frames:
        raise ValueError("an MP3 file without audio frames")
    return seconds
