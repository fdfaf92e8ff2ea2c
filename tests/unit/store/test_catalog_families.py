"""Each catalog family names the chat format (llmrun.chat.formats) its template is read with,
and that name is what detection gives on the family's real template from llama.cpp's corpus
(tests/fakes/templates/): a catalog entry whose `chat_format` disagrees with what the runner
would detect on the model's own template is caught here."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmrun.chat import formats
from llmrun.store import catalog, names

ROOT = Path(__file__).resolve().parents[3]
MODELFILES = ROOT / "modelfiles"
CORPUS = ROOT / "tests" / "fakes" / "templates"

# The family's own template, as llama.cpp's corpus keeps it (a sibling size of the same
# release where the corpus has only that one: gpt-oss-120b's harmony template is the 20B's,
# Llama 3.2 3B's is the 1B's that Ultravox speaks through, Gemma 4 31B's is the E4B's and 26B's).
OWN: dict[str, str] = {
    "gpt-oss": "openai-gpt-oss-120b.jinja",
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "glm-4.7-flash": "GLM-4.7-Flash.jinja",
    "deepseek-r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "devstral": "unsloth-mistral-Devstral-Small-2507.jinja",
    "llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "llama3.2": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "ultravox": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "gemma4": "google-gemma-4-31B-it.jinja",
    "mistral-small3.2": "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "granite4": "ibm-granite-granite-4.0.jinja",
    "nemotron-3-nano": "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "lfm2": "LFM2-8B-A1B.jinja",
    "qwen2.5": "Qwen-Qwen2.5-7B-Instruct.jinja",
}
# Tags whose model is not the family's main one: the R1 distill onto Llama 3.1 has its own
# template in the corpus; R1-0528-Qwen3-8B carries R1's template with its tool-call sections,
# which the corpus has as llama.cpp's own copy of it.
OWN_BY_TAG: dict[str, str] = {
    "deepseek-r1:8b-llama-distill-q4_k_m": "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
    "deepseek-r1:8b": "llama-cpp-deepseek-r1.jinja",
}
# Families the corpus has no template of: the nearest one that is there, of the same maker and
# call syntax, stands in (Qwen2.5-Coder's template is Qwen2.5's with the same Hermes calls;
# Mistral 7B v0.3 writes [TOOL_CALLS] as Mistral Nemo does; Phi-4-mini is Phi-3.5's
# <|user|>/<|end|> format).
NEAREST: dict[str, str] = {
    "qwen2.5-coder": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "phi4-mini": "microsoft-Phi-3.5-mini-instruct.jinja",
}
# Gemma 3's own template is in the catalog itself (gemma3:270m's, from google/gemma-3-*-it),
# and the corpus has none: every gemma3 tag is checked against it.
CATALOG_TEMPLATE: dict[str, str] = {"gemma3": "gemma3:270m"}
# Models that are not chatted with through a template of tool calls: embedding and reranking
# models, speech recognition, and the SmolLM2/SmolVLM ChatML that writes no call markers. Their
# entries keep the default format, which is what detection gives on no template at all.
NO_TEMPLATE: frozenset[str] = frozenset({
    "bge-m3", "bge-reranker-v2-m3", "nomic-embed-text", "qwen3-embedding", "qwen3-reranker",
    "qwen3-asr", "smollm2", "smolvlm",
})
# Format names other helpers are adding now. Until they are merged, an entry naming one is an
# expected failure here; any other unknown name is a typo and fails.
PENDING: frozenset[str] = frozenset({
    "seed-oss", "minimax-m2", "nemotron", "lfm2", "apertus", "deepseek-r1", "deepseek-v3.2",
    "command-r7b", "granite", "functionary-v3.1", "functionary-v3.2", "firefunction-v2",
    "gemma4", "apriel",
})


def entries() -> list[catalog.CatalogModel]:
    seen: dict[int, catalog.CatalogModel] = {}
    for tags in catalog.load(MODELFILES).values():
        for entry in tags.values():
            seen.setdefault(id(entry), entry)
    return list(seen.values())


def entry_id(entry: catalog.CatalogModel) -> str:
    return f"{entry.name}:{entry.tag}"


ENTRIES = entries()
FILES = sorted(p.name for p in MODELFILES.glob("*.yaml"))


def template_of(entry: catalog.CatalogModel) -> str | None:
    """The text of the real template `entry`'s model is read with (None: it has none)."""
    if entry.template:  # the catalog's own, which the runner uses over the GGUF's
        return entry.template
    key = entry_id(entry)
    name = OWN_BY_TAG.get(key) or OWN.get(entry.name) or NEAREST.get(entry.name)
    if name:
        return (CORPUS / name).read_text(encoding="utf-8")
    if entry.name in CATALOG_TEMPLATE:
        other = catalog.lookup(names.parse(CATALOG_TEMPLATE[entry.name]))
        assert other is not None and other.template, CATALOG_TEMPLATE[entry.name]
        return other.template
    assert entry.name in NO_TEMPLATE, f"{key}: name its family's template in this test"
    return None


@pytest.mark.parametrize("filename", FILES)
def test_every_file_parses_into_entries_with_sources(filename: str) -> None:
    doc = yaml.safe_load((MODELFILES / filename).read_text(encoding="utf-8"))
    assert isinstance(doc.get("chat_format"), str) and doc["chat_format"].strip(), filename
    parsed = catalog._entries(doc)
    assert parsed, f"{filename} gives no entries"
    for tag, entry in parsed.items():
        assert entry.sources, f"{filename}:{tag} has no source"
        assert entry.chat_format == doc["chat_format"], f"{filename}:{tag}"


def test_every_family_names_its_template() -> None:
    """A family added to the catalog without a template here fails, rather than going unchecked."""
    mapped = set(OWN) | set(NEAREST) | set(CATALOG_TEMPLATE) | NO_TEMPLATE
    assert set(catalog.load(MODELFILES)) <= mapped, set(catalog.load(MODELFILES)) - mapped
    assert not set(OWN) & set(NEAREST) and not (set(OWN) | set(NEAREST)) & NO_TEMPLATE
    for name in {*OWN.values(), *OWN_BY_TAG.values(), *NEAREST.values()}:
        assert (CORPUS / name).is_file(), name
    for key in OWN_BY_TAG:
        assert catalog.lookup(names.parse(key)) is not None, key


@pytest.mark.parametrize("entry", ENTRIES, ids=entry_id)
def test_chat_format_is_what_its_template_is_detected_as(entry: catalog.CatalogModel) -> None:
    text = template_of(entry)
    if entry.chat_format not in formats.BY_NAME:
        assert entry.chat_format in PENDING, f"{entry_id(entry)}: no format {entry.chat_format!r}"
        pytest.xfail(reason="format not merged yet")
    assert formats.detect(text).name == entry.chat_format, entry_id(entry)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.name in NO_TEMPLATE], ids=entry_id)
def test_models_without_call_templates_keep_the_default(entry: catalog.CatalogModel) -> None:
    assert entry.chat_format == "default"


def test_chat_format_defaults_when_a_file_names_none() -> None:
    doc = {"name": "m", "family": "f", "license": "l", "description": "d",
           "tags": {"1b": {"aliases": ["latest"],
                           "sources": [{"hf": {"repo": "o/r", "file": "m.gguf"}}]}}}
    parsed = catalog._entries(doc)
    assert {e.chat_format for e in parsed.values()} == {"default"}
    parsed = catalog._entries({**doc, "chat_format": "harmony"})
    assert parsed["1b"].chat_format == parsed["latest"].chat_format == "harmony"


def test_the_families_people_run_are_listed() -> None:
    """The tags of the brief, each resolving to its family (and a projector where it sees)."""
    for name in ("gpt-oss:20b", "qwen3:14b", "qwen3:32b", "qwen3:30b", "qwen3-coder:30b",
                 "glm-4.7-flash", "deepseek-r1:1.5b", "deepseek-r1:7b", "deepseek-r1:8b",
                 "deepseek-r1:14b", "deepseek-r1:32b", "devstral:24b", "llama3.1:8b",
                 "gemma3:12b", "gemma3:27b", "gemma4", "mistral-small3.2:24b", "granite4",
                 "phi4-mini", "nemotron-3-nano:30b", "lfm2"):
        assert catalog.lookup(names.parse(name)) is not None, name
    for name in ("gemma3:12b", "gemma3:27b", "mistral-small3.2", "gemma4:e4b"):
        entry = catalog.lookup(names.parse(name))
        assert entry is not None and entry.projector is not None, name
    latest = {"gpt-oss": "20b", "qwen3-coder": "30b", "deepseek-r1": "8b", "llama3.1": "8b",
              "devstral": "24b", "mistral-small3.2": "24b", "gemma3": "4b", "qwen3": "8b"}
    for model, tag in latest.items():
        entry = catalog.lookup(names.parse(model))
        assert entry is not None and entry.tag == tag, model
