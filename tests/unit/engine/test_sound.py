"""The sound header reader (llmrun/bounds.py) and engine/sound.py: what a sound file declares,
read before decoding, and refused before the decoder runs."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from llmrun import bounds
from llmrun.engine import sound
from tests.fakes.audio import (
    mp3_bomb,
    noise,
    not_audio,
    sine,
    truncated_wav,
    wav,
    wav_384khz,
    wav_long_header,
)


@pytest.mark.parametrize("seconds, rate, channels", [(1.0, 16_000, 1), (0.5, 48_000, 2),
                                                     (2.0, 8_000, 1)])
def test_a_wav_file_declares_its_duration(seconds: float, rate: int, channels: int) -> None:
    samples = np.repeat(sine(440.0, seconds, rate), channels)
    assert bounds.sound_seconds(wav(samples, rate, channels)) == pytest.approx(seconds)


def test_an_mp3_stream_is_as_long_as_its_frames() -> None:
    # 8 kHz MPEG-2.5 layer III frames of 576 samples (72 ms each)
    assert bounds.sound_seconds(mp3_bomb(7.2)) == pytest.approx(7.2, abs=0.072)
    assert bounds.sound_seconds(b"ID3\x03\x00\x00\x00\x00\x00\x04" + b"tags" + mp3_bomb(1.0)) \
        == pytest.approx(1.0, abs=0.072)


@pytest.mark.parametrize("data, words", [
    (truncated_wav(), "truncated"),
    (wav_384khz(), "384000 Hz"),
    (not_audio(), "not a sound file"),
    (b"\xff\xfb\x00\x00" * 4, "free-format"),
    (wav(noise(0.1), channels=1)[:40], "without samples"),
])
def test_malformed_headers_are_refused(data: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        bounds.sound_seconds(data)


@pytest.mark.parametrize("data", [wav_long_header(), mp3_bomb()])
def test_too_long_is_refused_before_the_decoder_runs(data: bytes) -> None:
    def decoder(_: bytes) -> np.ndarray:
        raise AssertionError("decoded")

    assert bounds.sound_seconds(data) > bounds.MAX_SOUND_SECONDS
    with pytest.raises(ValueError, match="declares"):
        sound.decode(base64.b64encode(data).decode(), decoder)
