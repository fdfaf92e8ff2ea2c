"""The catalog of short names (`smollm2:135m`), read from the YAML files in `modelfiles/`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from llmrun.store.names import LOCAL_NAMESPACE, ModelName


@dataclass(frozen=True)
class Source:
    kind: str  # "pypi" or "hf"
    spec: dict[str, Any]
    sha256: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class CatalogModel:
    name: str
    tag: str
    family: str
    license: str
    description: str
    sources: list[Source]
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    projector: Source | None = None  # a vision projector (mmproj GGUF) fetched with the model
    # The chat format (llmrun.chat.formats) its template is read with: recorded per family so
    # the catalog states which reader a model's calls and thought go through, and a test can
    # check that detection on the family's real template agrees.
    chat_format: str = "default"


def catalog_dir() -> Path:
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "modelfiles", here.parent / "modelfiles"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the llmrun catalog (modelfiles/) is missing from this install")


def _entries(doc: dict[str, Any]) -> dict[str, CatalogModel]:
    out: dict[str, CatalogModel] = {}
    for tag, spec in (doc.get("tags") or {}).items():
        sources = [_source(s) for s in spec.get("sources", [])]
        projector = _source(spec["projector"]) if spec.get("projector") else None
        model = CatalogModel(
            name=doc["name"],
            tag=str(tag),
            family=doc.get("family", ""),
            license=doc.get("license", ""),
            description=doc.get("description", ""),
            sources=sources,
            parameters={**(doc.get("parameters") or {}), **(spec.get("parameters") or {})},
            template=spec.get("template", doc.get("template")),
            system=spec.get("system", doc.get("system")),
            projector=projector,
            chat_format=str(doc.get("chat_format") or "default"),
        )
        for t in [str(tag), *map(str, spec.get("aliases", []))]:
            out[t] = model
    return out


def _source(s: dict[str, Any]) -> Source:
    kind = next(k for k in ("pypi", "hf") if k in s)
    return Source(kind, dict(s[kind]), s.get("sha256"), s.get("size"))


@cache
def load(root: Path | None = None) -> dict[str, dict[str, CatalogModel]]:
    """name -> tag (aliases included) -> entry."""
    root = root or catalog_dir()
    out: dict[str, dict[str, CatalogModel]] = {}
    for path in sorted(root.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        out[doc["name"]] = _entries(doc)
    return out


def closest(name: str, n: int = 3) -> list[str]:
    """Catalog names that look like `name`, for a helpful "not found"."""
    choices = [f"{model}:{tag}" for model, tags in load().items() for tag in tags]
    choices += list(load())
    return difflib.get_close_matches(name.lower(), choices, n=n, cutoff=0.5)


def lookup(name: ModelName) -> CatalogModel | None:
    if name.host or name.namespace != LOCAL_NAMESPACE:
        return None
    return load().get(name.model, {}).get(name.tag)
