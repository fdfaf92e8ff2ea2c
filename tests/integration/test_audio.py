"""Audio through the runner on the real model and a tiny random audio projector.

tests/fakes/audio.py's Qwen3-ASR-style projector beside SmolLM2 (random weights: what it hears
means nothing, but libmtmd's whole audio path runs: mel spectrogram, convolutions, encoder,
projector). First the adapter (engine/llama/vision.py's Projector) alone, then the runner.
"""

from __future__ import annotations

import base64
import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from llmrun.engine.llama import ImageChunk, LlamaError, Model, Projector
from llmrun.media import SOUND_PIECE_SECONDS, piece_frames
from tests.fakes.audio import (
    SAMPLE_RATE,
    TOKENS_PER_CHUNK,
    mp3_bomb,
    n_positions,
    noise,
    not_audio,
    silence,
    sine,
    truncated_wav,
    wav,
    wav_384khz,
    wav_long_header,
    write_projector,
)
from tests.fakes.vision import image
from tests.fakes.vision import write_projector as write_vision_projector
from tests.integration.test_isolation import assert_serving
from tests.integration.test_vision import Host, assert_first_token_as_plain


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_projector(tmp_path_factory.mktemp("audio") / "mmproj-audio.gguf")


@pytest.fixture(scope="module")
def projector(model: Model, mmproj: Path) -> Iterator[Projector]:
    p = Projector(mmproj, model, 1)
    yield p
    p.close()


def chunks_of(projector: Projector, samples: np.ndarray, digest: str) -> list[ImageChunk]:
    parts = projector.tokenize(f"Listen: {projector.marker} What is it?", [(samples, digest)],
                               True)
    assert isinstance(parts[0], list) and isinstance(parts[-1], list)  # text around it
    return [p for p in parts if isinstance(p, ImageChunk)]


def test_the_projector_says_it_hears_and_does_not_see(projector: Projector) -> None:
    assert projector.audio and not projector.vision
    assert projector.sample_rate == SAMPLE_RATE


@pytest.mark.parametrize("seconds", [0.3, 1.0, 2.5, 9.0])
def test_a_sound_takes_the_positions_its_length_gives(projector: Projector,
                                                      seconds: float) -> None:
    chunks = chunks_of(projector, sine(440.0, seconds), f"tone{seconds}")
    # one chunk per 8 s window (libmtmd's qwen3a preprocessor), named by the sound's hash
    assert len(chunks) == int(seconds // 8) + 1
    assert sum(c.n_tokens for c in chunks) == n_positions(seconds)
    assert [c.digest for c in chunks] == [f"tone{seconds}.{k}" for k in range(len(chunks))]


def test_encoding_is_deterministic_and_hears_the_difference(projector: Projector) -> None:
    def rows(samples: np.ndarray, digest: str) -> np.ndarray:
        (chunk,) = chunks_of(projector, samples, digest)
        out = projector.encode(chunk)
        assert out.shape == (chunk.n_tokens, 576) and np.isfinite(out).all()
        return out

    tone = rows(sine(440.0, 1.0), "a")
    np.testing.assert_array_equal(tone, rows(sine(440.0, 1.0), "b"))  # same sound, same rows
    for other in (sine(1500.0, 1.0), silence(1.0), noise(1.0)):
        assert np.abs(rows(other, "c") - tone).max() > 1e-2


def test_projector_of_another_width_is_refused(model: Model, tmp_path: Path) -> None:
    with pytest.raises(LlamaError, match="width"):
        Projector(write_projector(tmp_path / "wide.gguf", n_embd=64), model, 1)


# -- the runner ------------------------------------------------------------------------------


@pytest.fixture
def host(model: Model, mmproj: Path) -> Iterator[Host]:
    h = Host(model, mmproj)
    yield h
    h.close()


def hear(*sounds: bytes, text: str = "What do you hear?") -> dict[str, Any]:
    return {"role": "user", "content": text, "audio": [b64(s) for s in sounds]}


def test_same_sound_same_answer_other_sound_other_answer(host: Host) -> None:
    answers = {}
    for name, data in (("tone", wav(sine(440.0, 1.0))), ("again", wav(sine(440.0, 1.0))),
                       ("noise", wav(noise(1.0))), ("48k", wav(sine(440.0, 1.0, 48_000),
                                                                48_000))):
        kind, payload, text = host.ask([hear(data)], num_predict=8)
        assert kind == "done", payload
        answers[name] = text
        assert host.started(host.last)["prompt_tokens"] > n_positions(1.0)
    assert answers["tone"] == answers["again"]
    assert answers["noise"] != answers["tone"]
    # the same tone at 48 kHz, resampled to the projector's 16 kHz, is not silence or noise
    assert answers["48k"] != answers["noise"]


@pytest.mark.parametrize("rate", [SAMPLE_RATE, 24_000, 48_000])
def test_a_long_sound_is_read_in_pieces_each_encoded_once(host: Host, rate: int) -> None:
    """A sound is read in the projector's pieces (0.98 s for Qwen3-ASR's: one encoder chunk
    each), cut at the file's own rate, each piece encoded on its own: a file that begins with
    a file already heard encodes only what follows, its slot reads only what follows, and
    the model hears one sound (the projector's begin and end marks once, not per piece)."""
    samples = noise(2.5, rate=rate)
    step = piece_frames(SOUND_PIECE_SECONDS["qwen3a"], rate)
    first = [hear(wav(samples[:step], rate))]
    kind, payload, _ = host.ask(first, num_predict=1)
    assert kind == "done" and host.encodes == 1, payload
    one = host.started(host.last)
    kind, payload, answer = host.ask([hear(wav(samples, rate))], num_predict=8)
    assert kind == "done" and host.encodes == 3, payload  # the two new pieces only
    whole = host.started(host.last)
    assert whole["prompt_tokens"] - one["prompt_tokens"] == 2 * TOKENS_PER_CHUNK
    # the slot held the first piece: read from where it ends (the two new pieces, then
    # the end mark and the text after the sound, some 20 tokens of SmolLM2's)
    assert whole["cached_tokens"] > TOKENS_PER_CHUNK
    assert whole["prompt_tokens"] - whole["cached_tokens"] < 2 * TOKENS_PER_CHUNK + 24
    kind, _, again = host.ask([hear(wav(samples, rate))], num_predict=8)
    assert host.encodes == 3 and again == answer


@pytest.mark.parametrize("kept", [True, False])
def test_a_session_keeps_its_slot_while_others_come(host: Host, kept: bool) -> None:
    """A session's requests go to the slot it used last, and a request of no session that
    shares the start of its prompt (the template's head, then another sound) takes the
    other free slot instead of cutting the session's sequence back: the session's next
    request reads only what is new. Without a session (kept False) that request takes the
    slot with the longer common prefix, the session's, and the next one reads the sound
    again."""
    samples = noise(2.5, seed=3)
    step = piece_frames(SOUND_PIECE_SECONDS["qwen3a"], SAMPLE_RATE)
    session = {"session": "sess_1"} if kept else {}
    kind, payload, _ = host.ask([hear(wav(samples[:2 * step]))], num_predict=0, **session)
    assert kind == "done", payload
    held = host.started(host.last)["prompt_tokens"]
    host.ask([hear(wav(noise(0.5, seed=4)))], num_predict=4)  # the same head, then not
    kind, payload, _ = host.ask([hear(wav(samples))], num_predict=4, **session)
    assert kind == "done", payload
    cached = host.started(host.last)["cached_tokens"]
    if kept:  # the head, both pieces and the begin mark: all but the end mark and the text
        assert cached > held - 24 and cached >= 2 * TOKENS_PER_CHUNK
    else:
        assert cached < held - 24


def test_a_sound_too_short_to_hold_a_word_is_refused(host: Host) -> None:
    kind, err, _ = host.ask([hear(wav(sine(440.0, 0.005)))])
    assert kind == "error" and "at least 10 ms" in err["message"], err
    assert_serving(host.r, host.frames)


@pytest.mark.parametrize("bad, words", [
    (truncated_wav(), "truncated"),
    (wav_long_header(), "declares 7200 s"),
    (wav_384khz(), "384000 Hz"),
    (mp3_bomb(), "declares"),
    (not_audio(), "not a sound file"),
])
def test_hostile_sounds_fail_alone(host: Host, bad: bytes, words: str) -> None:
    stream = host.send([{"role": "user", "content": "Tell me a story."}], num_predict=40)
    kind, err, _ = host.ask([hear(wav(sine(440.0, 0.5)), bad)])
    assert kind == "error" and err["code"] == "invalid_request" and words in err["message"], err
    assert host.frames.final(stream)[0] == "done"  # the neighbour was not touched
    assert host.encodes == 0  # refused before anything was encoded
    assert_serving(host.r, host.frames)


def test_a_model_without_an_audio_projector_refuses_sound(host: Host, model: Model,
                                                          tmp_path: Path) -> None:
    seeing = Host(model, write_vision_projector(tmp_path / "mmproj.gguf"))
    try:
        kind, err, _ = seeing.ask([hear(wav(sine(440.0, 0.5)))])
        assert kind == "error" and "no audio projector" in err["message"], err
    finally:
        seeing.close()
    kind, err, _ = host.ask([{"role": "user", "content": "hi", "images": [b64(image(1))]}])
    assert kind == "error" and "no vision projector" in err["message"], err


def test_first_token_matches_plain_llama_cpp_python(host: Host, model: Model,
                                                     mmproj: Path) -> None:
    """libmtmd's own path: its helper decodes the same WAV file (miniaudio) into a bitmap
    and evaluates the chunks itself."""
    data = wav(sine(440.0, 0.9))  # one piece: libmtmd reads what the runner reads

    def bitmap_of(mctx: Any) -> Any:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return M.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(data), False)

    assert_first_token_as_plain(host, model, mmproj, hear(data), bitmap_of)
