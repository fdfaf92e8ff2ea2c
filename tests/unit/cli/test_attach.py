"""The CLI attaches image files a prompt names (llmrun/cli/attach.py), as Ollama's CLI does."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from llmrun.cli import attach


def test_paths_found_taken_out_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.png").write_bytes(b"png bytes")
    (tmp_path / "my photos").mkdir()
    (tmp_path / "my photos" / "b.JPG").write_bytes(b"jpeg bytes")
    text, paths = attach.find("what is in ./a.png?")
    assert (text, paths) == ("what is in ?", [Path("a.png")])
    text, paths = attach.find('compare a.png with "my photos/b.JPG".')
    assert text == "compare with ." and paths == [Path("a.png"), Path("my photos/b.JPG")]
    text, paths = attach.find(r"and my\ photos/b.JPG too")
    assert text == "and too" and paths == [Path("my photos/b.JPG")]
    msg, _ = attach.message("describe a.png")
    assert msg == {"role": "user", "content": "describe",
                   "images": [base64.b64encode(b"png bytes").decode()]}


def test_words_that_are_not_image_files_stay(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    for text in ("is missing.png a file?", "read notes.txt", "a .png extension", "'unclosed.png"):
        assert attach.find(text) == (text, [])
    assert attach.message("read notes.txt") == ({"role": "user", "content": "read notes.txt"},
                                                [])


def test_an_image_over_the_limit_is_refused(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "4")
    (tmp_path / "big.png").write_bytes(b"12345")
    with pytest.raises(ValueError, match="at most 4"):
        attach.message("look at big.png")
