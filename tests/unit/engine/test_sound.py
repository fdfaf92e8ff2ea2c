"""The sound header reader (llmrun/media.py) and engine/sound.py: what a sound file declares,
read before decoding, and refused before the decoder runs."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from llmrun import media
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
    assert media.sound_seconds(wav(samples, rate, channels)) == pytest.approx(seconds)


def test_an_mp3_stream_is_as_long_as_its_frames() -> None:
    # 8 kHz MPEG-2.5 layer III frames of 576 samples (72 ms each)
    assert media.sound_seconds(mp3_bomb(7.2)) == pytest.approx(7.2, abs=0.072)
    assert media.sound_seconds(b"ID3\x03\x00\x00\x00\x00\x00\x04" + b"tags" + mp3_bomb(1.0)) \
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
        media.sound_seconds(data)


@pytest.mark.parametrize("data", [wav_long_header(), mp3_bomb()])
def test_too_long_is_refused_before_the_decoder_runs(data: bytes) -> None:
    def decoder(_: bytes) -> np.ndarray:
        raise AssertionError("decoded")

    assert media.sound_seconds(data) > media.MAX_SOUND_SECONDS
    with pytest.raises(ValueError, match="declares"):
        sound.decode(base64.b64encode(data).decode(), decoder, 16_000)


def samples_of(data: bytes) -> np.ndarray:
    """A stand-in for the projector's decoder: a WAV file's frames as they are (no
    resampling), so what a piece holds can be checked frame by frame."""
    layout = media.wav_layout(data)
    pcm = np.frombuffer(data[layout.start:layout.start + layout.size], dtype="<i2")
    return (pcm.reshape(-1, layout.channels)[:, 0] / 32768).astype(np.float32)


@pytest.mark.parametrize("rate, channels", [(16_000, 1), (24_000, 1), (48_000, 2)])
def test_a_wav_is_cut_at_its_own_rate_into_whole_frames(rate: int, channels: int) -> None:
    frames = noise(2.5, rate=rate)
    data = wav(np.repeat(frames, channels), rate, channels)
    pieces = sound.decode(base64.b64encode(data).decode(), samples_of, 16_000, 0.98)
    step = media.piece_frames(0.98, rate)
    assert [len(p) for p, _ in pieces] == [step, step, len(frames) - 2 * step]
    whole = np.concatenate([p for p, _ in pieces])
    np.testing.assert_array_equal(whole, samples_of(data))  # nothing lost, nothing doubled
    # a piece is the same piece wherever it comes from: sent alone, it hashes the same
    first = sound.decode(base64.b64encode(wav(np.repeat(frames[:step], channels), rate,
                                              channels)).decode(), samples_of, 16_000, 0.98)
    assert [d for _, d in first] == [pieces[0][1]]


def test_without_a_piece_length_a_sound_is_one_piece() -> None:
    data = wav(noise(2.5))
    (only,) = sound.decode(base64.b64encode(data).decode(), samples_of, 16_000)
    assert len(only[0]) == 40_000


def test_other_formats_are_cut_at_the_projectors_rate() -> None:
    decoded = noise(2.5)  # what an MP3's decoder gives at the projector's rate

    pieces = sound.decode(base64.b64encode(mp3_bomb(2.5)).decode(), lambda _: decoded,
                          16_000, 0.98)
    assert [len(p) for p, _ in pieces] == [15_680, 15_680, 40_000 - 2 * 15_680]


def test_a_tail_too_short_to_hold_a_word_is_dropped_and_a_sound_that_short_refused() -> None:
    frames = noise(1.965)  # two pieces and 5 ms
    pieces = sound.decode(base64.b64encode(wav(frames)).decode(), samples_of, 16_000, 0.98)
    assert [len(p) for p, _ in pieces] == [15_680, 15_680]
    with pytest.raises(ValueError, match="at least 10 ms"):
        sound.decode(base64.b64encode(wav(noise(0.005))).decode(), samples_of, 16_000, 0.98)
    with pytest.raises(ValueError, match="at least 10 ms"):
        sound.decode(base64.b64encode(wav(noise(0.005))).decode(), samples_of, 16_000)
