"""llmrun/media.py: what a media file declares, read without decoding; and the refusals
bounds.py words from it."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from llmrun import bounds, media
from llmrun.request import EngineError
from tests.fakes.audio import mp3_bomb, not_audio, sine, wav, wav_long_header


@pytest.mark.parametrize("n", range(0, 7))
def test_decoded_size_is_the_decoded_length(n: int) -> None:
    data = bytes(range(n))
    assert media.decoded_size(base64.b64encode(data).decode()) == n


def test_piece_frames_round_and_never_vanish() -> None:
    assert media.piece_frames(0.98, 24_000) == 23_520  # 23519.99... in floating point
    assert media.piece_frames(0.98, 16_000) == 15_680
    assert media.piece_frames(1e-9, 8_000) == 1


def test_check_sound_takes_what_is_within_the_duration() -> None:
    layout = media.check_sound(wav(sine(440.0, 1.5, 16_000), 16_000))
    assert isinstance(layout, media.WavLayout)
    assert layout.seconds == pytest.approx(1.5) and layout.rate == 16_000


@pytest.mark.parametrize("data", [wav_long_header(), mp3_bomb()])
def test_check_sound_refuses_a_long_sound_as_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match=f"at most {media.MAX_SOUND_SECONDS} s are accepted"):
        media.check_sound(data)
    assert media.sound_seconds(data) > media.MAX_SOUND_SECONDS  # read, not refused


@pytest.mark.parametrize("data, words", [
    (wav_long_header(), "the sound declares 7200 s of audio"),
    (not_audio(), "not a sound file in a supported format (WAV, MP3)"),
])
def test_bounds_words_the_refusal_as_a_request_fault(data: bytes, words: str) -> None:
    with pytest.raises(EngineError) as info:
        bounds.check_sound(data, "messages[0].audio[0]")
    assert info.value.code == "invalid_request"
    assert info.value.message.startswith(f"messages[0].audio[0]: {words}")
    with pytest.raises(EngineError) as info:
        bounds.check_sound_header(data)
    assert info.value.message.startswith(f"a sound file: {words}")


def test_check_sound_header_is_the_declared_seconds() -> None:
    stereo = wav(np.repeat(sine(440.0, 0.5, 48_000), 2), 48_000, 2)
    assert bounds.check_sound_header(stereo) == pytest.approx(0.5)
