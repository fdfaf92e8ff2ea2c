"""Vision models in the store: a text model and its projector (an mmproj GGUF,
architecture `clip`) from a Modelfile's two FROMs, from an `hf.co/...` pull or the catalog;
kept by cp, freed by rm and prune; listed as `vision` by show. (`/api/create` with `files`
holding both: tests/integration/test_api_store.py; the engine loading them:
tests/integration/test_vision.py.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmrun.store import HOST_PATH_REFUSED, CreateError, PullError, Store, listing
from llmrun.store import pull as hub_pull
from llmrun.store.manifests import Manifest
from tests.fakes.hubserver import HubServer
from tests.fakes.tinymodel import write_tiny_llama
from tests.fakes.vision import write_projector
from tests.unit.store.test_store import write_gguf

DAY = 24 * 3600


def digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def blob_names(store: Store) -> set[str]:
    """The finished blobs (not partial downloads, not lock files)."""
    return {d.replace(":", "-") for d in store.blobs.digests()}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(home=tmp_path / "home")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A model and a projector whose names say the opposite of what they are: the store must
    tell them apart by their headers."""
    folder = tmp_path / "src"
    folder.mkdir()
    write_gguf(folder / "mmproj-looks-like-a-projector.gguf")  # a llama model
    write_projector(folder / "model-Q4_K_M.gguf")  # the projector
    write_gguf(folder / "other-model.gguf", seed=2.0)
    write_projector(folder / "other-projector.gguf", seed=1)
    return folder


MODEL = "./mmproj-looks-like-a-projector.gguf"
PROJECTOR = "./model-Q4_K_M.gguf"


# -- create from two FROMs ------------------------------------------------------------------

def test_two_froms_make_a_model_with_its_projector(store: Store, src: Path) -> None:
    m = store.create("seeing", f"FROM {MODEL}\nFROM {PROJECTOR}\nPARAMETER temperature 0.1\n",
                     base_dir=src)
    model, projector = src / MODEL, src / PROJECTOR
    assert m.model is not None and m.projector is not None
    assert (m.model.digest, m.projector.digest) == (digest(model), digest(projector))
    assert m.projector.size == projector.stat().st_size
    assert m.size == model.stat().st_size + projector.stat().st_size
    assert m.digests() == {digest(model), digest(projector)}
    assert m.details.family == "llama"  # the model's, not the projector's
    assert m.parameters == {"temperature": 0.1}
    path = store.projector_path(m)
    assert path is not None and path.read_bytes() == projector.read_bytes()
    assert store.model_paths(m) == [store.model_path(m)]  # the projector is no model part
    assert store.get("seeing")[1] == m
    store.verify(m)


def test_the_order_of_the_froms_does_not_matter(store: Store, src: Path) -> None:
    one = store.create("one", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    two = store.create("two", f"FROM {PROJECTOR}\nFROM {MODEL}\n", base_dir=src)
    assert (two.model, two.projector) == (one.model, one.projector)
    assert two.id == one.id  # the same content, the same id
    assert len(blob_names(store)) == 2


def test_a_model_without_projector_keeps_its_id(store: Store, src: Path) -> None:
    """Manifests written before projectors existed have no such field: they still read, and
    their id (stored in the file for `llmrun list`) is the one computed now."""
    m = store.create("plain", f"FROM {MODEL}\n", base_dir=src)
    assert m.projector is None and store.projector_path(m) is None
    path = store.manifests.path(store.get("plain")[0])
    data = json.loads(path.read_bytes())
    old = {k: v for k, v in data.items() if k not in ("projector", "digest")}
    assert Manifest.model_validate(old).id == data["digest"][:12] == m.id


@pytest.mark.parametrize(("text", "message"), [
    (f"FROM {MODEL}\nFROM ./other-model.gguf\n",
     f"FROM {MODEL} and FROM ./other-model.gguf are both models: a second FROM may only name "
     "the first one's vision projector (an mmproj GGUF, architecture 'clip')"),
    (f"FROM {PROJECTOR}\nFROM ./other-projector.gguf\n",
     f"FROM {PROJECTOR} and FROM ./other-projector.gguf are both vision projectors: one FROM "
     "names the model they serve"),
    (f"FROM {PROJECTOR}\n",
     f"{{src}}/{PROJECTOR[2:]} is a vision projector (architecture 'clip'), not a model: name "
     "the model it serves with a FROM line beside it"),
    (f"FROM http://127.0.0.1:9/v1\nFROM {PROJECTOR}\n",
     "a remote model (FROM http(s)://...) takes one FROM: its server runs the model, and any "
     "vision projector, itself"),
    (f"FROM {PROJECTOR}\nFROM http://127.0.0.1:9/v1\n",
     "a remote model (FROM http(s)://...) takes one FROM: its server runs the model, and any "
     "vision projector, itself"),
    (f"FROM {MODEL}\nFROM {PROJECTOR}\nFROM ./other-projector.gguf\n",
     "Modelfile line 3: at most two FROM lines: a model and its vision projector (an mmproj "
     "GGUF)"),
    (f"FROM {MODEL}\nFROM ./missing-mmproj.gguf\n", "FROM ./missing-mmproj.gguf: no such file"),
    (f"FROM {MODEL}\nFROM sha256:{'0' * 64}\n",
     f"FROM sha256:{'0' * 64}: no such blob (upload it to /api/blobs first)"),
], ids=["two-models", "two-projectors", "projector-alone", "remote-then-projector",
        "projector-then-remote", "three-froms", "missing-file", "missing-blob"])
def test_create_errors_import_nothing(store: Store, src: Path, text: str, message: str) -> None:
    with pytest.raises(CreateError) as exc:
        store.create("bad", text, base_dir=src)
    assert str(exc.value) == message.replace("{src}", str(src))
    assert blob_names(store) == set()
    assert store.list() == []


def test_a_projector_is_no_adapter_either(store: Store, src: Path) -> None:
    with pytest.raises(CreateError, match="is not a LoRA adapter"):
        store.create("bad", f"FROM {MODEL}\nADAPTER {PROJECTOR}\n", base_dir=src)


def test_create_from_uploaded_blobs_in_either_order(store: Store, src: Path) -> None:
    """What `/api/create` does with `files` holding both (paths refused: blobs only)."""
    with store.blobs.writer() as w:
        w.write((src / MODEL).read_bytes())
    with store.blobs.writer() as p:
        p.write((src / PROJECTOR).read_bytes())
    for text in (f"FROM {w.digest}\nFROM {p.digest}\n", f"FROM {p.digest}\nFROM {w.digest}\n"):
        m = store.create("uploaded", text, allow_paths=False)
        assert m.model is not None and m.projector is not None
        assert (m.model.digest, m.projector.digest) == (w.digest, p.digest)
    with pytest.raises(CreateError) as exc:  # a host path as the second FROM: refused alike
        store.create("stolen", f"FROM {w.digest}\nFROM {src / PROJECTOR}\n", allow_paths=False)
    assert str(exc.value) == HOST_PATH_REFUSED
    with pytest.raises(CreateError, match="is a vision projector"):
        store.create("alone", f"FROM {p.digest}\n", allow_paths=False)


def test_a_model_made_from_one_with_a_projector_keeps_it(store: Store, src: Path) -> None:
    base = store.create("base", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    derived = store.create("derived", 'FROM base\nSYSTEM "Describe images."\n',
                           base_dir=src / "elsewhere")
    assert (derived.model, derived.projector) == (base.model, base.projector)
    assert derived.system == "Describe images."
    # a second FROM naming another projector replaces it; the model stays
    other = store.create("other", "FROM base\nFROM ./other-projector.gguf\n", base_dir=src)
    assert other.model == base.model
    assert other.projector is not None
    assert other.projector.digest == digest(src / "other-projector.gguf")
    # a model name never stands for a projector, whatever it holds
    with pytest.raises(CreateError, match="are both models"):
        store.create("bad", "FROM base\nFROM derived\n", base_dir=src)


def test_show_modelfile_writes_both_froms_back(store: Store, src: Path) -> None:
    m = store.create("seeing", f"FROM {PROJECTOR}\nFROM {MODEL}\nPARAMETER top_k 5\n",
                     base_dir=src)
    text = store.modelfile_of(m).render()
    assert text.startswith(f"FROM {store.model_path(m)}\nFROM {store.projector_path(m)}\n")
    again = store.create("again", text, base_dir=src)  # what it prints creates it again
    assert again.id == m.id


def test_capabilities_and_projector_info(store: Store, src: Path) -> None:
    seeing = store.create("seeing", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    plain = store.create("plain", f"FROM {MODEL}\n", base_dir=src)
    assert store.capabilities(seeing) == ["completion", "tools", "vision"]
    assert store.capabilities(plain) == ["completion", "tools"]
    info = store.projector_info(seeing)
    assert info is not None
    assert info["general.architecture"] == "clip"
    assert info["clip.vision.projection_dim"] == 576
    assert isinstance(info["general.parameter_count"], int)
    assert store.projector_info(plain) is None
    assert store.model_info(seeing)["general.architecture"] == "llama"


# -- cp, rm, prune, list ----------------------------------------------------------------------

def test_copy_keeps_the_projector_and_rm_frees_it_last(store: Store, src: Path) -> None:
    m = store.create("seeing", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    copy = store.copy("seeing", "me/copy:v1")
    assert copy.projector == m.projector
    projector = store.projector_path(m)
    assert projector is not None
    # another model shares the projector, not the text model
    store.create("shares", f"FROM ./other-model.gguf\nFROM {PROJECTOR}\n", base_dir=src)
    store.remove("seeing")
    assert projector.is_file() and store.model_path(copy).is_file()
    store.remove("me/copy:v1")
    assert projector.is_file()  # still the projector of `shares`
    assert not store.model_path(copy).exists()
    store.remove("shares")
    assert not projector.exists()
    assert blob_names(store) == set()


def test_prune_keeps_a_referenced_projector_and_frees_an_orphan(store: Store,
                                                                src: Path) -> None:
    m = store.create("seeing", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    projector = store.projector_path(m)
    assert projector is not None
    old = time.time() - 2 * DAY
    for path in (projector, store.model_path(m)):
        os.utime(path, (old, old))
    assert store.prune() == []
    assert projector.is_file()
    # a model whose manifest this version could not read (a damaged one) still protects it
    path = store.manifests.path(store.get("seeing")[0])
    path.write_bytes(path.read_bytes().replace(b'"model"', b'"modl"'))
    assert store.prune() == []
    path.unlink()
    assert sorted(store.prune()) == sorted([projector.name, store.model_path(m).name])


def test_list_counts_the_projector(store: Store, src: Path) -> None:
    m = store.create("seeing", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    fast = listing.entries(store.home / "manifests")
    assert fast is not None
    assert [(e.name, e.id, e.size) for e in fast] == [("seeing:latest", m.id, m.size)]


# -- the CLI's show, with no daemon ---------------------------------------------------------------

def llmrun(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmrun", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "LLMRUN_HOME": str(home)},
                          stdin=subprocess.DEVNULL)


def test_cli_show_lists_vision(store: Store, src: Path) -> None:
    store.create("seeing", f"FROM {MODEL}\nFROM {PROJECTOR}\n", base_dir=src)
    store.create("plain", f"FROM {MODEL}\n", base_dir=src)
    shown = llmrun("show", "seeing", home=store.home)
    assert shown.returncode == 0, shown.stderr
    # the last section of these two models (no parameters, system prompt or license)
    assert shown.stdout.split("Capabilities\n", 1)[1].split() == ["completion", "tools", "vision"]
    assert "Projector" in shown.stdout and "clip" in shown.stdout
    plain = llmrun("show", "plain", home=store.home).stdout
    assert plain.split("Capabilities\n", 1)[1].split() == ["completion", "tools"]
    assert "Projector" not in plain
    as_json = json.loads(llmrun("show", "seeing", "--json", home=store.home).stdout)
    assert as_json["capabilities"] == ["completion", "tools", "vision"]
    assert as_json["projector_info"]["general.architecture"] == "clip"
    modelfile = llmrun("show", "seeing", "--modelfile", home=store.home).stdout
    assert [line.split()[0] for line in modelfile.splitlines()[:2]] == ["FROM", "FROM"]
    listed = llmrun("list", home=store.home)
    assert listed.returncode == 0 and "seeing:latest" in listed.stdout


# -- pulls from the Hub --------------------------------------------------------------------------

@pytest.fixture
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vision-hub")
    return {
        "model": write_tiny_llama(folder / "tiny.gguf"),
        "model8": write_tiny_llama(folder / "tiny8.gguf", seed=8),
        "f16": write_projector(folder / "f16.gguf", n_embd=64, seed=1),
        "q8": write_projector(folder / "q8.gguf", n_embd=64, seed=2),
        "bf16": write_projector(folder / "bf16.gguf", n_embd=64, seed=3),
    }


@pytest.fixture
def hub_store(_isolated_home: Path) -> Store:
    return Store(_isolated_home)


def test_pull_fetches_the_projector_with_the_model(hub: HubServer, files: dict[str, Path],
                                                   hub_store: Store) -> None:
    store = hub_store
    repo = "org/tiny-VL-GGUF"
    hub.add_file(repo, "tiny-VL-Q4_K_M.gguf", files["model"])
    hub.add_file(repo, "tiny-VL-Q8_0.gguf", files["model8"])
    hub.add_file(repo, "mmproj-tiny-VL-Q8_0.gguf", files["q8"])
    hub.add_file(repo, "mmproj-tiny-VL-f16.gguf", files["f16"])
    steps: list[str] = []
    m = store.pull(f"hf.co/{repo}", lambda s, done, total: steps.append(s))
    assert m.model is not None and m.projector is not None
    assert m.model.digest == digest(files["model"])
    # Q4_K_M: no projector in that quantization nor in 4 bits; F16 is next
    assert m.projector.digest == digest(files["f16"])
    assert any("projector mmproj-tiny-VL-f16.gguf (F16)" in s for s in steps)
    assert store.capabilities(m)[-1] == "vision"
    assert m.source == f"hf.co/{repo}/tiny-VL-Q4_K_M.gguf"
    q8 = store.pull(f"hf.co/{repo}:q8_0")
    assert q8.projector is not None and q8.projector.digest == digest(files["q8"])
    assert not [p for p in store.blobs.root.iterdir() if p.name.endswith(".partial")]


def test_a_repo_without_projector_pulls_as_before(hub: HubServer, files: dict[str, Path],
                                                  hub_store: Store) -> None:
    store = hub_store
    hub.add_file("org/text-GGUF", "text-Q4_K_M.gguf", files["model"])
    m = store.pull("hf.co/org/text-GGUF")
    assert m.projector is None and "vision" not in store.capabilities(m)
    assert blob_names(store) == {f"sha256-{digest(files['model'])[7:]}"}


def test_a_cut_projector_download_leaves_no_blob_and_resumes(
        hub: HubServer, files: dict[str, Path], hub_store: Store) -> None:
    store = hub_store
    repo = "org/cut-GGUF"
    hub.add_file(repo, "cut-F16.gguf", files["model"])
    size = files["bf16"].stat().st_size
    f = hub.add_file(repo, "mmproj-cut-BF16.gguf", files["bf16"], cut_after=size // 3,
                     cut_times=1)
    with pytest.raises(PullError, match="pull again to resume"):
        store.pull(f"hf.co/{repo}")
    assert store.list() == []  # no manifest without its projector
    name = f"sha256-{digest(files['bf16'])[7:]}"
    assert name not in blob_names(store)  # never a half-written blob
    assert (store.blobs.root / f"{name}.partial").is_file()
    m = store.pull(f"hf.co/{repo}")
    assert f.ranges[-1] == f"bytes={size // 3}-"  # resumed
    assert m.projector is not None and m.projector.digest == digest(files["bf16"])
    path = store.projector_path(m)
    assert path is not None and path.read_bytes() == files["bf16"].read_bytes()
    assert not [p for p in store.blobs.root.iterdir() if p.name.endswith(".partial")]


def test_a_file_named_mmproj_must_be_a_projector(hub: HubServer, files: dict[str, Path],
                                                 hub_store: Store) -> None:
    store = hub_store
    hub.add_file("org/odd-GGUF", "odd-Q4_K_M.gguf", files["model"])
    hub.add_file("org/odd-GGUF", "mmproj-odd-f16.gguf", files["model8"])  # a llama model
    with pytest.raises(PullError, match=r"mmproj-odd-f16.gguf is not a vision projector "
                                        r"\(its architecture is 'llama'\)"):
        store.pull("hf.co/org/odd-GGUF")
    assert store.list() == []
    assert f"sha256-{digest(files['model8'])[7:]}" not in blob_names(store)


def test_catalog_entry_with_a_projector(hub: HubServer, files: dict[str, Path],
                                        hub_store: Store) -> None:
    """`smolvlm` (modelfiles/smolvlm.yaml) names its model and projector files; served here
    by the local Hub under those names."""
    store = hub_store
    repo = "ggml-org/SmolVLM-256M-Instruct-GGUF"
    hub.add_file(repo, "SmolVLM-256M-Instruct-Q8_0.gguf", files["model"])
    hub.add_file(repo, "SmolVLM-256M-Instruct-f16.gguf", files["model8"])
    hub.add_file(repo, "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf", files["q8"])
    hub.add_file(repo, "mmproj-SmolVLM-256M-Instruct-f16.gguf", files["f16"])
    m = store.pull("smolvlm")
    assert m.name == "smolvlm:latest"
    assert m.model is not None and m.model.digest == digest(files["model"])
    assert m.projector is not None and m.projector.digest == digest(files["q8"])
    hub.remove_file(repo, "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf")
    with pytest.raises(PullError, match=r"has no file mmproj-SmolVLM-256M-Instruct-Q8_0\.gguf"):
        store.pull("smolvlm:256m-instruct-q8_0")


# -- choosing the projector -----------------------------------------------------------------------

def remote(*names: str) -> list[hub_pull.RemoteFile]:
    return [hub_pull.RemoteFile("o/r", n, 1, None) for n in names]


@pytest.mark.parametrize(("model", "projectors", "chosen"), [
    ("m-Q8_0.gguf", ["mmproj-f16.gguf", "mmproj-Q8_0.gguf"], "mmproj-Q8_0.gguf"),
    ("m-Q4_K_M.gguf", ["mmproj-Q8_0.gguf", "mmproj-f16.gguf"], "mmproj-f16.gguf"),
    ("m-Q4_K_M.gguf", ["mmproj-Q8_0.gguf", "mmproj-Q4_0.gguf"], "mmproj-Q4_0.gguf"),
    ("m-BF16.gguf", ["mmproj-Q8_0.gguf", "mmproj-F32.gguf", "mmproj-f16.gguf"],
     "mmproj-f16.gguf"),
    ("m-BF16.gguf", ["mmproj-Q8_0.gguf", "mmproj-F32.gguf"], "mmproj-F32.gguf"),
    ("m-Q4_K_M.gguf", ["mmproj-b.gguf", "mmproj-a.gguf"], "mmproj-a.gguf"),
    ("model.gguf", ["mmproj-BF16.gguf", "mmproj-F16.gguf"], "mmproj-F16.gguf"),
])
def test_choose_projector(model: str, projectors: list[str], chosen: str) -> None:
    f, why = hub_pull.choose_projector(remote(*projectors), remote(model)[0])
    assert f is not None and f.path == chosen and chosen in why
    assert hub_pull.choose_projector([], remote(model)[0]) == (None, "")
