"""The vision fixtures themselves (tests/fakes/vision.py): the projector is a well-formed CLIP GGUF
and the images are what their names say. Quick tests: no model, no daemon, no llama.cpp
(that the projector runs in llama.cpp's mtmd beside SmolLM2 is for the vision tests)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from llmrun.store import gguf
from tests.fakes import vision


def test_projector_is_a_clip_gguf(tmp_path: Path) -> None:
    path = vision.write_projector(tmp_path / "mmproj.gguf")
    info = gguf.read(path)  # llmrun's own validating reader: every tensor inside the file
    assert info.architecture == "clip"
    meta = info.metadata
    assert meta["clip.projector_type"] == "mlp"
    assert meta["clip.has_vision_encoder"] is True
    assert meta["clip.vision.projection_dim"] == 576  # SmolLM2-135M's width
    assert meta["clip.vision.image_size"] == 32
    assert meta["clip.vision.patch_size"] == 8
    assert meta["clip.vision.block_count"] == 2
    assert len(meta["clip.vision.image_mean"]) == len(meta["clip.vision.image_std"]) == 3
    shapes = {t.name: t.shape for t in info.tensors}
    # GGUF order (ne): mm.0 maps the 64-wide tower to 576, mm.2 is 576 x 576
    assert shapes["mm.0.weight"] == (64, 576)
    assert shapes["mm.2.weight"] == (576, 576)
    assert shapes["v.patch_embd.weight"] == (8, 8, 3, 64)
    assert shapes["v.position_embd.weight"] == (64, 17)  # 16 patches + the class slot
    assert 500_000 < path.stat().st_size < 1_500_000


def test_projector_is_deterministic(tmp_path: Path) -> None:
    a = vision.write_projector(tmp_path / "a.gguf").read_bytes()
    assert vision.write_projector(tmp_path / "b.gguf").read_bytes() == a
    assert vision.write_projector(tmp_path / "c.gguf", seed=1).read_bytes() != a
    # a mismatched width (llama.cpp must refuse it beside SmolLM2) is still well-formed
    info = gguf.read(vision.write_projector(tmp_path / "d.gguf", n_embd=64))
    assert info.metadata["clip.vision.projection_dim"] == 64
    assert {t.name: t.shape for t in info.tensors}["mm.2.weight"] == (64, 64)


def test_images() -> None:
    one = Image.open(io.BytesIO(vision.image(1)))
    assert (one.format, one.size, one.mode) == ("PNG", (32, 32), "RGB")
    assert vision.image(1) == vision.image(1)
    assert one.tobytes() != Image.open(io.BytesIO(vision.image(2))).tobytes()
    jpeg = Image.open(io.BytesIO(vision.image(3, (100, 60), "JPEG")))
    assert (jpeg.format, jpeg.size) == ("JPEG", (100, 60))


def test_bad_images(monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = vision.bomb_png()
    assert len(bomb) < 100_000
    # Pillow's own bomb check (a global that llmrun's image code also sets) is off here, so
    # that open() reads the declared size; it decodes nothing until load().
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert Image.open(io.BytesIO(bomb)).size == (20_000, 20_000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 1024 * 1024)
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(bomb))

    cut = Image.open(io.BytesIO(vision.truncated_png()))
    assert cut.size == (64, 64)  # the header is intact...
    with pytest.raises(OSError):
        cut.load()  # ...the pixel data is not

    with pytest.raises(Image.UnidentifiedImageError):
        Image.open(io.BytesIO(vision.not_image()))
