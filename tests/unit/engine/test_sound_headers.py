"""Sound headers that lie to a length check (llmrun/media.py) but not to the decoder.

miniaudio (inside libmtmd) decodes what a file's coding says, scans an MP3 past junk for the
next frame, and takes a Xing tag's frame count for the output's length: a check that reads
the header otherwise lets hours through a file that "declares" seconds. Each hostile file
here is built by hand; tests/integration/test_sound_decoder.py runs the same files through
the real decoder. The runner gives the decoder only what was read (engine/sound.py): a WAV
it writes, an MP3's frames end to end.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import struct
import time
from collections.abc import Callable

import numpy as np
import pytest

from llmrun import config, media
from llmrun.engine import sound
from tests.fakes.audio import (
    MP3_FRAME_48K,
    adpcm_wav,
    extensible,
    fmt_chunk,
    mp3_resync_bomb,
    riff,
    sine,
    xing_frame,
)

TONE = (sine(440.0, 1.0) * 32767).astype("<i2").tobytes()  # 1 s of 16-bit, 16 kHz


def given_to_decoder(data: bytes) -> bytes:
    """The bytes engine/sound.py hands the decoder for `data`."""
    seen: list[bytes] = []

    def decoder(b: bytes) -> np.ndarray:
        seen.append(b)
        return np.zeros(16_000, dtype=np.float32)

    sound.decode(base64.b64encode(data).decode(), decoder, 16_000)
    (only,) = seen
    return only


# -- WAV -------------------------------------------------------------------------------------


@pytest.mark.parametrize("data, words", [
    (adpcm_wav(), r"format 0x0002 \(MS ADPCM\)"),
    (riff(fmt_chunk(0x11, 1, 8_000, 4, block=65_535, byte_rate=4_000), bytes(80_000)),
     r"format 0x0011 \(IMA ADPCM\)"),
    (riff(extensible(2, 1, 8_000, 4), bytes(80_000)), r"extensible, subformat 0x0002"),
    (riff(extensible(1, 1, 8_000, 16)[:-1] + b"\x00", TONE), "extensible, subformat"),
    (riff(fmt_chunk(0x55, 1, 16_000, 0, block=1, byte_rate=2_000), bytes(80_000)),
     r"0x0055 \(MPEG layer III\)"),
    # PCM of whole bytes decodes to data / (channels x bits / 8) frames, whatever the block
    (riff(fmt_chunk(1, 1, 8_000, 8, block=65_535), bytes(80_000)),
     "block alignment is 65535 bytes"),
    # a bit depth dr_wav refuses: miniaudio then tries its MP3 decoder on the same bytes
    (riff(fmt_chunk(1, 1, 8_000, 0, block=1), MP3_FRAME_48K * 1000), "0-bit PCM"),
    (riff(fmt_chunk(1, 1, 16_000, 12, block=2), TONE), "12-bit PCM"),
    (riff(fmt_chunk(3, 1, 16_000, 16), TONE), "16-bit IEEE float"),
    (riff(fmt_chunk(1, 1, 16_000, 16, byte_rate=1), TONE), "byte rate is 1"),
])
def test_a_wav_whose_length_its_header_does_not_give_is_refused(data: bytes,
                                                                words: str) -> None:
    with pytest.raises(ValueError, match=words):
        media.sound_seconds(data)
    with pytest.raises(ValueError, match=words):
        given_to_decoder(data)


@pytest.mark.parametrize("fmt, n_bytes, seconds", [
    (fmt_chunk(1, 1, 16_000, 8), 16_000, 1.0),
    (fmt_chunk(1, 2, 44_100, 16), 44_100 * 4, 1.0),
    (fmt_chunk(1, 1, 48_000, 24), 48_000 * 3 // 2, 0.5),
    (fmt_chunk(1, 1, 16_000, 32), 64_000, 1.0),
    (fmt_chunk(3, 1, 16_000, 32), 64_000, 1.0),
    (fmt_chunk(3, 2, 16_000, 64), 16_000 * 16, 1.0),
    (fmt_chunk(7, 1, 8_000, 8) + b"\0\0", 8_000, 1.0),  # mu-law, as telephony writes it
    (fmt_chunk(6, 1, 8_000, 8) + b"\0\0", 4_000, 0.5),  # A-law
    (extensible(1, 2, 48_000, 24), 48_000 * 6, 1.0),
    (extensible(3, 1, 16_000, 32), 64_000, 1.0),
])
def test_real_codings_declare_their_length(fmt: bytes, n_bytes: int, seconds: float) -> None:
    data = riff(fmt, bytes(n_bytes), before_data=b"LIST" + struct.pack("<I", 4) + b"INFO")
    assert media.sound_seconds(data) == pytest.approx(seconds)


def test_the_decoder_is_given_a_wav_written_from_what_was_read() -> None:
    # an extensible file with a LIST chunk: the decoder gets one plain 16-byte format chunk
    # and the samples, nothing else of the file
    data = riff(extensible(1, 1, 16_000, 16), TONE,
                before_data=b"LIST" + struct.pack("<I", 4) + b"INFO")
    assert given_to_decoder(data) == riff(fmt_chunk(1, 1, 16_000, 16), TONE)
    # of two format chunks, the last before the data is read, as dr_wav reads it
    other = b"fmt " + struct.pack("<I", 16) + fmt_chunk(1, 2, 8_000, 8)
    layout = media.wav_layout(riff(fmt_chunk(3, 1, 16_000, 32), TONE, before_data=other))
    assert (layout.tag, layout.channels, layout.rate, layout.bits) == (1, 2, 8_000, 8)


# -- MP3 -------------------------------------------------------------------------------------


def test_junk_between_frames_does_not_end_the_walk() -> None:
    # one 24 ms frame, a zero byte, 25 minutes of frames: the decoder scans past the byte
    data = mp3_resync_bomb(1500.0)
    assert len(data) < config.max_audio_size()  # within the upload limit
    assert media.sound_seconds(data) > media.MAX_SOUND_SECONDS  # (the walk stops there)
    assert media.sound_seconds(mp3_resync_bomb(10.0)) == pytest.approx(10.0, abs=0.024)
    with pytest.raises(ValueError, match="declares"):
        given_to_decoder(data)


def test_the_decoder_is_given_the_frames_and_nothing_else() -> None:
    frames = [MP3_FRAME_48K[:4] + bytes([i]) * 92 for i in range(30)]
    data = (b"ID3\x04\x00\x10" + b"\x00\x00\x00\x08" + b"tag body" + b"3DI" + bytes(7)
            + b"".join(frames[:10]) + b"\x00junk\xff\xfb"  # junk, a sync of nothing
            + b"".join(frames[10:]) + MP3_FRAME_48K[:50]  # a last frame cut short
            + b"APETAGEX" + struct.pack("<IIII", 2000, 32, 0, 0) + bytes(8)  # an APE footer
            + b"TAG" + bytes(125))
    assert given_to_decoder(data) == b"".join(frames)
    assert media.sound_seconds(data) == pytest.approx(30 * 0.024)


def test_a_xing_tag_claims_count() -> None:
    # dr_mp3 takes the first frame's Xing count for the length of its output: 60,000 frames
    # (24 minutes) from one frame and ten more
    with pytest.raises(ValueError, match="declares 1440 s"):
        given_to_decoder(xing_frame(60_000) + MP3_FRAME_48K * 10)
    # an honest Info/Xing frame (as LAME writes: the count of the frames after it) passes
    data = xing_frame(10) + MP3_FRAME_48K * 10
    assert media.sound_seconds(data) == pytest.approx(11 * 0.024)
    # a claim in any frame counts: which one dr_mp3 reads first depends on what decodes
    data = MP3_FRAME_48K * 3 + xing_frame(200) + MP3_FRAME_48K * 3
    assert media.sound_seconds(data) == pytest.approx(200 * 0.024)
    # MPEG-2 layer III, 8 kbit/s, 22.05 kHz, stereo: 26 bytes, the tag at 21, its count
    # past the frame: in the last frame, dr_mp3 would read it from beyond the stream
    tiny = b"\xff\xf3\x10\x00" + bytes(22)
    with pytest.raises(ValueError, match="cut-off Xing"):
        media.sound_seconds(tiny * 3 + tiny[:21] + b"Xing\x00")


@pytest.mark.parametrize("data, words", [
    # 48 kHz frames, then 44.1 kHz ones: dr_mp3 would play both at the first's rate
    (MP3_FRAME_48K * 10 + b"\xff\xfb\x10\xc0" + bytes(100) + b"\xff\xfb\x10\xc0"
     + bytes(100) + (b"\xff\xfb\x10\xc0" + bytes(100)) * 8, "change MPEG version"),
    (b"\xff\xfb\x00\x00" * 4, "free-format"),
    (MP3_FRAME_48K[:4] + bytes(10) + b"\xff\xfb\x14\xc0\x01" * 5000,
     "frame headers that no frames follow"),
    # frames whose last 128 bytes begin as an ID3v1 tag's (then junk, so the file's own
    # last 128 bytes do not): the decoder would cut the stream there
    (MP3_FRAME_48K * 8 + MP3_FRAME_48K[:64] + b"TAG" + MP3_FRAME_48K[67:] + MP3_FRAME_48K
     + b"\x00", "ID3v1 or APE tag"),
])
def test_what_the_decoder_reads_otherwise_is_refused(data: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        media.sound_seconds(data)


def test_a_frame_before_junk_at_the_start_is_the_decoders_to_skip() -> None:
    # 0xFF 0xFF 0xFB: the frame's header is the second 0xFF (a lookahead finds it)
    assert media.sound_seconds(b"\xff" + MP3_FRAME_48K * 10) == pytest.approx(0.24)


def fastest(f: Callable[[], object]) -> float:
    """The shortest of two runs of `f`, in seconds (a refusal is a run too)."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        with contextlib.suppress(ValueError):
            f()
        times.append(time.perf_counter() - t0)
    return min(times)


def test_the_walk_of_25_mib_costs_less_than_reading_its_base64() -> None:
    # the daemon decodes a request's base64 before the walk: the walk of the largest upload
    # stays within a few times that (measured: 0.2 to 0.8 of it), whatever the bytes
    rng = np.random.default_rng(0)
    mib25 = 25 << 20
    frame = b"\xff\xfb\xe0\x00" + bytes(1040)  # 320 kbit/s, 44.1 kHz: 655 s, walked whole
    files = [frame * (mib25 // len(frame)),
             MP3_FRAME_48K + rng.integers(0, 256, mib25, dtype=np.uint8).tobytes(),
             (MP3_FRAME_48K + b"\0") * (mib25 // 97)]
    for data in files:
        encoded = base64.b64encode(data)
        walk = fastest(functools.partial(media.sound_seconds, data))
        b64 = fastest(functools.partial(base64.b64decode, encoded, validate=True))
        assert walk < 10 * b64 + 0.05, (walk, b64)
