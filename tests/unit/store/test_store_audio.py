"""Audio models in the store: a projector whose GGUF says it encodes sound
(`clip.has_audio_encoder`) takes the vision projector's one path (create's two FROMs, an
`hf.co/...` pull); what it encodes is read from its header, so `show` lists `audio`, not
`vision`. (The engine hearing it: tests/integration/test_audio.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmrun.store import Store, gguf
from tests.fakes.audio import write_projector as write_audio_projector
from tests.fakes.hubserver import HubServer
from tests.fakes.tinymodel import write_tiny_llama
from tests.fakes.vision import write_projector as write_vision_projector
from tests.unit.store.test_store import write_gguf


def test_a_projector_says_what_it_encodes(tmp_path: Path) -> None:
    ears = gguf.read(write_audio_projector(tmp_path / "a.gguf"))
    eyes = gguf.read(write_vision_projector(tmp_path / "v.gguf"))
    assert (ears.is_projector, ears.modalities) == (True, ["audio"])
    assert (eyes.is_projector, eyes.modalities) == (True, ["vision"])
    assert gguf.read(write_gguf(tmp_path / "m.gguf")).modalities == []


def test_create_takes_an_audio_projector_and_show_lists_audio(tmp_path: Path) -> None:
    store = Store(home=tmp_path / "home")
    model = write_gguf(tmp_path / "model.gguf")
    ears = write_audio_projector(tmp_path / "ears.gguf")
    hearing = store.create("hearing", f"FROM {model}\nFROM {ears}\n")
    assert hearing.projector is not None
    assert store.capabilities(hearing) == ["completion", "tools", "audio"]
    info = store.projector_info(hearing)
    assert info is not None and info["clip.has_audio_encoder"] is True


@pytest.fixture
def hub_store(_isolated_home: Path) -> Store:
    return Store(_isolated_home)


def test_pull_fetches_an_audio_projector_with_the_model(hub: HubServer, hub_store: Store,
                                                        tmp_path: Path) -> None:
    repo = "org/tiny-ASR-GGUF"
    hub.add_file(repo, "tiny-ASR-Q8_0.gguf", write_tiny_llama(tmp_path / "tiny.gguf"))
    hub.add_file(repo, "mmproj-tiny-ASR-Q8_0.gguf",
                 write_audio_projector(tmp_path / "ears.gguf", n_embd=64))
    m = hub_store.pull(f"hf.co/{repo}")
    assert m.projector is not None
    assert hub_store.capabilities(m)[-1] == "audio"


def test_catalog_audio_models_pull_with_their_projector(hub: HubServer, hub_store: Store,
                                                        tmp_path: Path) -> None:
    """`qwen3-asr` (modelfiles/qwen3-asr.yaml) names its model and projector files: the
    unpinned 1.7B pulls from the Hub under those names, reads its sound in the projector's
    pieces and lists `audio`; the pinned 0.6B refuses files of other bytes and keeps
    nothing of them."""
    from llmrun.store.errors import StoreError

    model = write_tiny_llama(tmp_path / "tiny.gguf")
    ears = write_audio_projector(tmp_path / "ears.gguf", n_embd=64)
    repo = "ggml-org/Qwen3-ASR-1.7B-GGUF"
    hub.add_file(repo, "Qwen3-ASR-1.7B-Q8_0.gguf", model)
    hub.add_file(repo, "mmproj-Qwen3-ASR-1.7B-Q8_0.gguf", ears)
    m = hub_store.pull("qwen3-asr:1.7b")
    assert m.projector is not None and hub_store.capabilities(m)[-1] == "audio"
    assert hub_store.sound_piece_seconds(m) == 0.98  # a qwen3a projector
    small = "ggml-org/Qwen3-ASR-0.6B-GGUF"
    hub.add_file(small, "Qwen3-ASR-0.6B-Q8_0.gguf", model)
    hub.add_file(small, "mmproj-Qwen3-ASR-0.6B-Q8_0.gguf", ears)
    with pytest.raises(StoreError, match="differs from the catalog's"):
        hub_store.pull("qwen3-asr")
    assert [x.name for x in hub_store.list()] == ["qwen3-asr:1.7b"]


def test_a_whisper_style_projector_reads_a_sound_whole(tmp_path: Path) -> None:
    ears = gguf.read(write_audio_projector(tmp_path / "a.gguf"))
    assert ears.sound_piece_seconds == 0.98
    ears.metadata["clip.projector_type"] = "ultravox"
    assert ears.sound_piece_seconds is None
    assert gguf.read(write_vision_projector(tmp_path / "v.gguf")).sound_piece_seconds is None
