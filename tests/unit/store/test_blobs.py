"""llmrun.store.blobs: digest validation and atomic, content-addressed writes."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from llmrun.store import Store
from llmrun.store.blobs import Blobs, BlobTooLarge, DigestError, parse_digest

HEX = hashlib.sha256(b"hello").hexdigest()


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_parse_digest_accepts_colon_and_dash() -> None:
    assert parse_digest(f"sha256:{HEX}") == HEX
    assert parse_digest(f"sha256-{HEX}") == HEX


@pytest.mark.parametrize(
    "digest",
    [
        f"sha256:{HEX.upper()}",
        f"SHA256:{HEX}",
        f"sha256:{HEX[:63]}",
        f"sha256:{HEX}0",
        "sha256:../../etc/passwd",
        f"sha256:{HEX[:-2]}/x",
        f"sha512:{HEX}",
        f"md5:{HEX}",
        HEX,
        f"sha256_{HEX}",
        "",
    ],
)
def test_parse_digest_refuses(digest: str) -> None:
    with pytest.raises(DigestError) as exc:
        parse_digest(digest)
    assert str(exc.value) == f"invalid digest {digest!r}: expected sha256:<64 lowercase hex>"


def test_parse_digest_refuses_trailing_newline() -> None:
    with pytest.raises(DigestError):
        parse_digest(f"sha256:{HEX}\n")


def test_path(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    assert blobs.path(f"sha256:{HEX}") == tmp_path / "blobs" / f"sha256-{HEX}"
    assert blobs.path(f"sha256-{HEX}") == tmp_path / "blobs" / f"sha256-{HEX}"


@pytest.mark.parametrize("digest", ["sha256:../../etc/passwd", "sha256-../x", "../x"])
def test_path_refuses_traversal(tmp_path: Path, digest: str) -> None:
    blobs = Blobs(tmp_path / "blobs")
    with pytest.raises(DigestError):
        blobs.path(digest)
    with pytest.raises(DigestError):
        blobs.exists(digest)
    with pytest.raises(DigestError):
        blobs.remove(digest)


def test_writer_renames_to_digest(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    with blobs.writer() as w:
        w.write(b"hel")
        w.write(b"lo")
    assert w.digest == f"sha256:{HEX}"
    assert w.size == 5
    assert _names(blobs.root) == [f"sha256-{HEX}"]
    assert blobs.path(w.digest).read_bytes() == b"hello"
    assert blobs.exists(w.digest)
    assert blobs.size(w.digest) == 5


def test_writer_with_matching_expected(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path)
    with blobs.writer(expected=f"sha256-{HEX}") as w:
        w.write(b"hello")
    assert _names(tmp_path) == [f"sha256-{HEX}"]


def test_writer_body_raises_leaves_nothing(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    with pytest.raises(RuntimeError, match="boom"), blobs.writer() as w:
        w.write(b"partial data")
        raise RuntimeError("boom")
    assert _names(blobs.root) == []


def test_writer_interrupted_leaves_nothing(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path)
    with pytest.raises(KeyboardInterrupt), blobs.writer() as w:
        w.write(b"partial")
        raise KeyboardInterrupt
    assert _names(tmp_path) == []


def test_writer_refuses_mismatched_digest(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    expected = "sha256:" + "0" * 64
    with pytest.raises(DigestError) as exc, blobs.writer(expected) as w:
        w.write(b"hello")
    assert str(exc.value) == f"digest mismatch: expected {expected}, got sha256:{HEX}"
    assert _names(blobs.root) == []
    assert not blobs.exists(f"sha256:{HEX}")


def test_writer_refuses_malformed_expected_before_writing(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    with pytest.raises(DigestError), blobs.writer("sha256:../../etc/passwd"):
        pytest.fail("the body must not run")
    assert not blobs.root.exists()


def test_import_file(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    payload = bytes(range(256)) * 5000  # more than one 1 MiB chunk
    src.write_bytes(payload)
    blobs = Blobs(tmp_path / "blobs")
    digest, size = blobs.import_file(src)
    assert digest == "sha256:" + hashlib.sha256(payload).hexdigest()
    assert size == len(payload) == 1_280_000
    assert blobs.path(digest).read_bytes() == payload
    assert _names(blobs.root) == [f"sha256-{hashlib.sha256(payload).hexdigest()}"]
    assert src.read_bytes() == payload  # a copy, not a move


def test_import_same_content_twice_keeps_one_blob(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"hello")
    b.write_bytes(b"hello")
    blobs = Blobs(tmp_path / "blobs")
    assert blobs.import_file(a) == blobs.import_file(b) == (f"sha256:{HEX}", 5)
    assert _names(blobs.root) == [f"sha256-{HEX}"]


def test_import_missing_file(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    with pytest.raises(FileNotFoundError):
        blobs.import_file(tmp_path / "nope")
    assert not blobs.root.exists() or _names(blobs.root) == []


def test_remove(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path)
    with blobs.writer() as w:
        w.write(b"hello")
    blobs.remove(w.digest)
    assert _names(tmp_path) == []
    blobs.remove(w.digest)  # removing twice is fine


def test_digests_lists_only_valid_blob_names(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path / "blobs")
    assert blobs.digests() == set()  # no folder yet
    with blobs.writer() as w:
        w.write(b"hello")
    other = hashlib.sha256(b"other").hexdigest()
    (blobs.root / f"sha256-{other}").write_bytes(b"other")
    for junk in [
        f".incoming-{HEX}",
        f"sha256-{HEX[:10]}",
        f"sha256-{HEX.upper()}",
        f"sha256-{HEX}.partial",
        f"sha512-{HEX}",
        "README",
    ]:
        (blobs.root / junk).write_bytes(b"x")
    assert blobs.digests() == {f"sha256:{HEX}", f"sha256:{other}"}


def test_writer_past_its_limit_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path)
    with pytest.raises(BlobTooLarge, match="limit of 8 bytes"), blobs.writer(limit=8) as w:
        w.write(b"hello")
        w.write(b"world")  # refused before it is written: never more than 8 bytes on disk
    assert _names(tmp_path) == []
    with blobs.writer(limit=5) as w:
        w.write(b"hello")  # exactly the limit is fine
    assert _names(tmp_path) == [f"sha256-{HEX}"]


def test_incoming_commit_or_discard(tmp_path: Path) -> None:
    blobs = Blobs(tmp_path)
    gone = blobs.incoming()
    gone.write(b"half")
    gone.discard()
    assert _names(tmp_path) == []
    wrong = blobs.incoming(expected="sha256:" + "0" * 64)
    wrong.write(b"hello")
    with pytest.raises(DigestError):
        wrong.commit()
    assert _names(tmp_path) == []
    good = blobs.incoming(expected=f"sha256:{HEX}")
    good.write(b"hello")
    assert good.commit() == f"sha256:{HEX}"
    good.discard()  # after commit: nothing to do
    assert _names(tmp_path) == [f"sha256-{HEX}"]


def _aged(path: Path, data: bytes, age: float) -> Path:
    path.write_bytes(data)
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_prune_spares_every_blob_a_manifest_mentions(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.blobs.root.mkdir()
    model, adapter, future, orphan = (
        "sha256:" + _aged(store.blobs.root / f"sha256-{hashlib.sha256(x).hexdigest()}", x,
                          100 * 24 * 3600).name[7:]
        for x in (b"model", b"adapter", b"future field", b"orphan"))
    folder = store.manifests.root / "registry.llmrun.local" / "library"
    (folder / "good").mkdir(parents=True)
    (folder / "good" / "latest").write_text(
        f'{{"name": "good", "model": {{"digest": "{model}", "size": 5}}, '
        f'"adapters": [{{"digest": "{adapter}", "size": 7}}]}}')
    (folder / "damaged").mkdir()  # unreadable as a manifest: its digests still count
    (folder / "damaged" / "latest").write_text(f'{{"truncated": "{future}", "proj')
    assert store.prune() == [orphan.replace(":", "-")]
    assert store.blobs.digests() == {model, adapter, future}
