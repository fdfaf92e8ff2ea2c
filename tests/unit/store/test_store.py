"""llmrun.store.Store: create, list, get, copy and remove models in a temporary home."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf as gguf_writer
import numpy as np
import pytest

from llmrun.store import CreateError, InvalidName, ModelNotFound, Store, listing


def write_gguf(path: Path, *, arch: str = "llama", seed: float = 0.0) -> Path:
    w = gguf_writer.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_chat_template("{{ messages }}")
    w.add_file_type(1)  # MOSTLY_F16, reported as the quantization level
    w.add_tensor("token_embd.weight", np.full((4, 8), seed, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tree(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(home=tmp_path / "home")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    write_gguf(folder / "model.gguf")
    return folder


MODELFILE = (
    "FROM ./model.gguf\n"
    "PARAMETER temperature 0.3\n"
    "PARAMETER stop <|end|>\n"
    'SYSTEM """You are terse."""\n'
)


def test_create_and_list(store: Store, src: Path) -> None:
    gguf_bytes = (src / "model.gguf").read_bytes()
    digest = "sha256:" + hashlib.sha256(gguf_bytes).hexdigest()
    created = store.create("x", MODELFILE, base_dir=src)
    assert created.name == "x:latest"
    assert created.model.digest == digest
    assert created.model.size == len(gguf_bytes)
    assert created.size == len(gguf_bytes)
    assert created.parameters == {"temperature": 0.3, "stop": ["<|end|>"]}
    assert created.system == "You are terse."
    assert created.template is None
    assert created.source == str(src / "model.gguf")
    assert created.details.format == "gguf"
    assert created.details.family == "llama"
    assert created.details.quantization_level == "F16"
    assert created.details.context_length == 4096
    assert created.details.parameter_size == "40"

    listed = store.list()
    assert [m.name for m in listed] == ["x:latest"]
    assert listed[0] == created
    assert _tree(store.home / "blobs") == [f"sha256-{digest[7:]}"]
    assert _tree(store.home / "manifests") == [
        "local", "local/library", "local/library/x", "local/library/x/latest",
    ]
    assert store.model_path(created) == store.home / "blobs" / f"sha256-{digest[7:]}"


def test_fast_listing_agrees_with_the_validated_one(store: Store, src: Path) -> None:
    """`llmrun list` reads manifests as plain JSON (store/listing.py): it must show what the
    validated reader shows, newest first, for models with parameters, messages and copies."""
    store.create("a", MODELFILE, base_dir=src)
    store.create("b", MODELFILE + 'MESSAGE user """hi"""\n', base_dir=src)
    store.copy("a", "ns/c:v1")
    fast = listing.entries(store.home / "manifests")
    assert fast is not None
    assert [(e.name, e.id, e.size, e.modified_at) for e in fast] == [
        (m.name, m.id, m.size, m.modified_at) for m in store.list()]


def test_get(store: Store, src: Path) -> None:
    created = store.create("x", MODELFILE, base_dir=src)
    name, manifest = store.get("x:latest")
    assert str(name) == "x:latest"
    assert manifest == created
    assert store.get("X")[1] == created
    assert manifest.options().temperature == 0.3


def test_get_missing_model(store: Store) -> None:
    with pytest.raises(ModelNotFound) as exc:
        store.get("nope")
    assert str(exc.value) == "model 'nope' not found, try pulling it first"
    assert exc.value.name == "nope"


def test_get_invalid_name(store: Store) -> None:
    with pytest.raises(InvalidName):
        store.get("../../etc/passwd")


def test_copy_shares_the_blob(store: Store, src: Path) -> None:
    created = store.create("x", MODELFILE, base_dir=src)
    copied = store.copy("x", "me/y:v2")
    assert copied.name == "me/y:v2"
    assert copied.model == created.model
    assert copied.parameters == created.parameters
    assert sorted(m.name for m in store.list()) == ["me/y:v2", "x:latest"]
    assert len(_tree(store.home / "blobs")) == 1


def test_copy_missing_source(store: Store) -> None:
    with pytest.raises(ModelNotFound, match="model 'nope' not found"):
        store.copy("nope", "y")


def test_remove_keeps_shared_blob_until_last_copy(store: Store, src: Path) -> None:
    created = store.create("x", MODELFILE, base_dir=src)
    store.copy("x", "me/y:v2")
    blob = store.model_path(created)

    store.remove("x")
    assert [m.name for m in store.list()] == ["me/y:v2"]
    assert blob.is_file()
    assert _tree(store.home / "manifests") == ["local", "local/me", "local/me/y", "local/me/y/v2"]
    with pytest.raises(ModelNotFound):
        store.get("x")

    store.remove("me/y:v2")
    assert store.list() == []
    assert not blob.exists()
    assert _tree(store.home / "blobs") == []
    assert _tree(store.home / "manifests") == []  # empty folders pruned


def test_remove_missing_model(store: Store) -> None:
    with pytest.raises(ModelNotFound, match=r"^model 'nope' not found, try pulling it first$"):
        store.remove("nope")


def test_create_from_non_gguf_file(store: Store, tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_text("this is not a model, just some text\n" * 4)
    with pytest.raises(CreateError) as exc:
        store.create("x", "FROM ./model.gguf\n", base_dir=tmp_path)
    assert str(exc.value) == f"{tmp_path / 'model.gguf'} is not a GGUF file (bad magic)"
    assert _tree(store.home / "blobs") == []
    assert _tree(store.home / "manifests") == []
    assert store.list() == []


def test_create_from_truncated_gguf(store: Store, src: Path) -> None:
    path = src / "model.gguf"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CreateError, match="extends past the end of the file"):
        store.create("x", "FROM ./model.gguf\n", base_dir=src)
    assert _tree(store.home / "blobs") == []
    assert _tree(store.home / "manifests") == []


@pytest.mark.parametrize("ref", ["./missing.gguf", "missing.gguf", "/no/such/dir/m.gguf"])
def test_create_from_missing_path(store: Store, tmp_path: Path, ref: str) -> None:
    with pytest.raises(CreateError) as exc:
        store.create("x", f"FROM {ref}\n", base_dir=tmp_path)
    assert str(exc.value) == f"FROM {ref}: no such file"
    assert store.list() == []


def test_create_from_unknown_model(store: Store, tmp_path: Path) -> None:
    with pytest.raises(CreateError) as exc:
        store.create("x", "FROM nope\n", base_dir=tmp_path)
    assert str(exc.value) == (
        "FROM nope: not a file, not a model in the store and not in the catalog")


def test_create_with_bad_modelfile(store: Store, src: Path) -> None:
    with pytest.raises(CreateError) as exc:
        store.create("x", "FROM ./model.gguf\nPARAMETER top_p 2\n", base_dir=src)
    assert str(exc.value) == "Modelfile line 2: invalid value '2' for parameter top_p"
    assert _tree(store.home / "blobs") == []


def test_create_with_adapter_is_refused(store: Store, src: Path) -> None:
    with pytest.raises(CreateError, match="ADAPTER"):
        store.create("x", "FROM ./model.gguf\nADAPTER ./lora.gguf\n", base_dir=src)
    assert _tree(store.home / "blobs") == []


def test_create_with_invalid_name(store: Store, src: Path) -> None:
    with pytest.raises(InvalidName):
        store.create("../evil", MODELFILE, base_dir=src)
    assert _tree(store.home / "blobs") == []


def test_create_from_existing_model_inherits_and_overrides(store: Store, src: Path) -> None:
    base = store.create("base", MODELFILE, base_dir=src)
    derived = store.create(
        "derived:v1",
        "FROM base\nPARAMETER temperature 0.9\nPARAMETER top_k 10\n",
        base_dir=src / "elsewhere",
    )
    assert derived.name == "derived:v1"
    assert derived.model == base.model
    assert derived.details == base.details
    assert derived.parameters == {"temperature": 0.9, "stop": ["<|end|>"], "top_k": 10}
    assert derived.system == "You are terse."
    assert len(_tree(store.home / "blobs")) == 1
    # the base is unchanged
    assert store.get("base")[1].parameters == {"temperature": 0.3, "stop": ["<|end|>"]}

    again = store.create("third", 'FROM derived:v1\nSYSTEM "Be loud."\n', base_dir=src)
    assert again.system == "Be loud."
    assert again.parameters == derived.parameters

    store.remove("base")
    store.remove("derived:v1")
    assert store.model_path(again).is_file()


def test_create_from_absolute_path(store: Store, src: Path, tmp_path: Path) -> None:
    created = store.create("abs", f"FROM {src / 'model.gguf'}\n", base_dir=tmp_path)
    assert created.source == str(src / "model.gguf")
    assert created.parameters == {}


def test_create_replaces_an_existing_name(store: Store, src: Path) -> None:
    store.create("x", MODELFILE, base_dir=src)
    write_gguf(src / "other.gguf", seed=1.0)
    replaced = store.create("x", "FROM ./other.gguf\n", base_dir=src)
    assert [m.name for m in store.list()] == ["x:latest"]
    assert store.get("x")[1] == replaced
    assert replaced.parameters == {}
