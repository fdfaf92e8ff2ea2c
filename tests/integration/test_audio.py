"""Audio through the runner on the real model and a tiny random audio projector.

tests/fakes/audio.py's Qwen3-ASR-style projector beside SmolLM2 (random weights: what it hears
means nothing, but libmtmd's whole audio path runs: mel spectrogram, convolutions, encoder,
projector). First the adapter (engine/llama/vision.py's Projector) alone, then the runner.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llmrun.engine.llama import ImageChunk, LlamaError, Model, Projector
from tests.fakes.audio import (
    SAMPLE_RATE,
    n_positions,
    noise,
    silence,
    sine,
    write_projector,
)


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
