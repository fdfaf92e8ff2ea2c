"""What a sound file declares against what libmtmd's decoder (miniaudio) makes of it.

tests/unit/engine/test_sound_headers.py builds the hostile files; here they meet the real
decoder, through the adapter (engine/llama/vision.py's Projector.decode_sound) and the
runner's path (engine/sound.py): the raw file decodes to far more than its header gives,
what the runner hands the decoder never to more than media.py declared. Real files (LAME's
frames, as an encoder writes them with tags around) decode as they did, to the sample.
"""

from __future__ import annotations

import base64
import random
import struct

import lameenc
import numpy as np
import pytest

from llmrun import media
from llmrun.engine import sound
from llmrun.engine.llama import Projector
from tests.fakes.audio import (
    MP3_FRAME_48K,
    SAMPLE_RATE,
    adpcm_wav,
    fmt_chunk,
    mp3_resync_bomb,
    riff,
    sine,
    wav,
    xing_frame,
)
from tests.integration.test_audio import mmproj, model, projector  # noqa: F401 (fixtures)


def heard(projector: Projector, data: bytes) -> np.ndarray:  # noqa: F811
    """The samples the runner's path gives `data` (ValueError where it refuses)."""
    pieces = sound.decode(base64.b64encode(data).decode(), projector.decode_sound,
                          projector.sample_rate)
    return np.concatenate([p for p, _ in pieces])


def seconds(samples: np.ndarray) -> float:
    return len(samples) / SAMPLE_RATE


def test_hostile_files_decode_to_more_than_they_declare_and_are_refused(
        projector: Projector) -> None:  # noqa: F811
    # what libmtmd's decoder makes of the raw files: the reason for each refusal
    assert seconds(projector.decode_sound(adpcm_wav())) > 19  # "0.15 ms" at data/block/rate
    assert seconds(projector.decode_sound(
        riff(fmt_chunk(1, 1, 8_000, 8, block=65_535), bytes(80_000)))) == pytest.approx(10)
    assert seconds(projector.decode_sound(riff(fmt_chunk(1, 1, 8_000, 0, block=1),
                                               MP3_FRAME_48K * 1000))) > 20  # as MP3
    assert seconds(projector.decode_sound(mp3_resync_bomb(30.0))) > 29.9  # past the junk
    assert seconds(projector.decode_sound(xing_frame(60_000) + MP3_FRAME_48K * 10)) \
        == pytest.approx(1440)
    for bad, words in [(adpcm_wav(), "MS ADPCM"), (mp3_resync_bomb(), "declares"),
                       (xing_frame(60_000) + MP3_FRAME_48K * 10, "declares 1440 s")]:
        with pytest.raises(ValueError, match=words):
            heard(projector, bad)
    # counted where it is short: the frames after the junk are all heard, and declared
    data = mp3_resync_bomb(30.0)
    assert seconds(heard(projector, data)) == pytest.approx(media.sound_seconds(data),
                                                            abs=1e-3)


def lame(samples: np.ndarray, rate: int, kbps: int, channels: int = 1) -> bytes:
    e = lameenc.Encoder()
    e.set_bit_rate(kbps)
    e.set_in_sample_rate(rate)
    e.set_channels(channels)
    e.set_quality(7)
    pcm = (np.repeat(samples, channels) * 32767).astype("<i2").tobytes()
    return bytes(e.encode(pcm) + e.flush())


@pytest.mark.parametrize("rate, kbps, channels", [(16_000, 32, 1), (44_100, 128, 2),
                                                   (48_000, 64, 1), (8_000, 8, 1)])
def test_real_mp3s_are_heard_as_the_decoder_hears_the_file(
        projector: Projector, rate: int, kbps: int, channels: int) -> None:  # noqa: F811
    frames = lame(sine(440.0, 2.0, rate), rate, kbps, channels)
    layout = media.mp3_layout(frames)
    assert layout.seconds == pytest.approx(2.0, abs=0.3)  # LAME's delay and last frame
    # as a tagger leaves it: ID3v2 (cover art inside: sync-like bytes), an Info frame that
    # counts the frames after it (the rest of it silent, as LAME writes it), APE and ID3v1
    art = random.Random(0).randbytes(4000)
    id3 = b"ID3\x04\x00\x00" + bytes((0, 0, (len(art) >> 7) & 0x7F, len(art) & 0x7F)) + art
    at = 4 + _side(frames)
    info = frames[:at] + b"Info" + struct.pack(">II", 1, layout.frames)
    info += bytes(_first_frame_bytes(frames) - len(info))
    tagged = (id3 + info + frames + b"APETAGEX" + struct.pack("<IIII", 2000, 32, 0, 0)
              + bytes(8) + b"TAG" + bytes(125))
    for data in (frames, tagged):  # heard as the decoder hears the file itself
        ours = heard(projector, data)
        np.testing.assert_array_equal(ours, projector.decode_sound(data))
        assert len(ours) <= round(media.sound_seconds(data) * SAMPLE_RATE) + 1
    # junk after the frames: dr_mp3, given the file, drops the last frame (it finds no
    # frame after it); given the frames alone, it hears them all
    np.testing.assert_array_equal(heard(projector, tagged[:-160] + bytes(300) + tagged[-160:]),
                                  heard(projector, tagged))


def _first_frame_bytes(data: bytes) -> int:
    frame = media._MP3_FRAMES[data[1] << 8 | data[2]]
    assert frame is not None
    return frame[0]


def _side(data: bytes) -> int:
    mono = data[3] & 0xC0 == 0xC0
    return (17 if mono else 32) if data[1] & 0x08 else (9 if mono else 17)


@pytest.mark.parametrize("data", [
    wav(sine(440.0, 1.5)),
    riff(fmt_chunk(3, 1, 16_000, 32), sine(440.0, 1.0).astype("<f4").tobytes(),
         before_data=b"LIST" + struct.pack("<I", 4) + b"INFO"),
    riff(fmt_chunk(7, 1, 8_000, 8) + b"\0\0", bytes(range(256)) * 40,
         before_data=b"fact" + struct.pack("<II", 4, 10_240)),
])
def test_real_wavs_are_heard_as_the_decoder_hears_the_file(
        projector: Projector, data: bytes) -> None:  # noqa: F811
    np.testing.assert_array_equal(heard(projector, data), projector.decode_sound(data))


def hostile_mp3(rng: random.Random) -> bytes:
    """Frames of one kind with fake headers in their bodies, junk between stretches (some
    of it sync-like, some free format, frames of other kinds), Xing tags, a cut tail."""
    table = media._MP3_FRAMES
    firsts = [b for b in range(256) if any(table[b << 8 | x] for x in range(256))]
    b1, rate_bits = rng.choice(firsts), rng.randrange(3) << 2
    out = bytearray(b"\xff")  # a file the header check takes for MP3 by its first bytes
    for _ in range(rng.randrange(1, 6)):
        if rng.random() < 0.4:
            junk = bytearray(rng.randbytes(rng.randrange(1, 300)))
            for _ in range(rng.randrange(4)):
                at = rng.randrange(len(junk))
                junk[at:at + 3] = bytes((0xFF, rng.choice(firsts), rng.randrange(256)))
            out += junk
        for _ in range(rng.randrange(1, 40)):
            while True:
                b2 = rng.randrange(16, 240) & ~0x0C | rate_bits
                frame = table[b1 << 8 | b2]
                if frame:
                    break
            body = bytearray(rng.randbytes(frame[0] - 4) if rng.random() < 0.5
                             else bytes(frame[0] - 4))
            for _ in range(rng.randrange(3)):
                at = rng.randrange(len(body))
                body[at:at + 3] = bytes((0xFF, rng.choice((b1, *firsts)),
                                         rng.randrange(240) & ~0x0C | rate_bits))
            f = bytearray(bytes((0xFF, b1, b2, rng.randrange(256))) + body[:frame[0] - 4])
            if rng.random() < 0.05:
                side = _side(bytes(f)) + (0 if b1 & 1 else 2)
                tag = rng.choice((b"Xing", b"Info")) + struct.pack(">II", 1,
                                                                   rng.randrange(300))
                f[4 + side:4 + side + 12] = tag
            out += f[:frame[0]]
    out += rng.randbytes(rng.randrange(50)) if rng.random() < 0.2 else b""
    return bytes(out)


def test_what_the_runner_hands_the_decoder_never_outlasts_what_it_declared(
        projector: Projector) -> None:  # noqa: F811
    # 300 seeded hostile files: the decoder's samples never exceed the declared length
    # (one sample of slack: the resampler's rounding); measured 7500 files so, where the
    # walk that stopped at junk was short on 147 of 318 (by up to 10 s)
    rng = random.Random(1)
    for _ in range(300):
        data = hostile_mp3(rng)
        try:
            layout = media.mp3_layout(data)
        except ValueError:
            continue
        if layout.seconds > media.MAX_SOUND_SECONDS:
            continue
        try:
            got = len(projector.decode_sound(layout.stream()))
        except ValueError:  # nothing the decoder can decode
            got = 0
        assert got <= round(layout.seconds * SAMPLE_RATE) + 1, (data.hex(), got, layout)
