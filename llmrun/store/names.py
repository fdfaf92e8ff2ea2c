"""Model names: `name[:tag]`, `namespace/name[:tag]` and `hf.co/{org}/{repo}[:{quant}]`.

A name becomes a path under `manifests/`, so every component is checked against a strict
rule before it touches the file system, and the error says which rule it broke.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

DEFAULT_TAG = "latest"
HF_HOSTS = ("hf.co", "huggingface.co")
LOCAL_NAMESPACE = "library"
_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_TAG = re.compile(r"^[a-z0-9_][a-z0-9._-]*$")
MAX_COMPONENT = 80
MAX_TAG = 128
MAX_NAME = 350


from llmrun.store.errors import InvalidName  # noqa: E402  (re-exported)


@dataclass(frozen=True)
class ModelName:
    host: str  # "" for local and catalog names, "hf.co" for Hugging Face
    namespace: str  # "library" for plain names, the org for hf.co
    model: str
    tag: str

    @property
    def is_hf(self) -> bool:
        return self.host == "hf.co"

    def __str__(self) -> str:
        if self.host:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace != LOCAL_NAMESPACE:
            prefix = f"{self.namespace}/"
        else:
            prefix = ""
        return f"{prefix}{self.model}:{self.tag}"

    @property
    def short(self) -> str:
        """The name as users write it, without `:latest`."""
        s = str(self)
        return s[: -len(":latest")] if s.endswith(":latest") else s

    def manifest_path(self) -> PurePosixPath:
        # lower-cased: names match case-insensitively (an hf.co repo keeps its case for the
        # Hub, where it matters, but `hf.co/Org/Repo` and `hf.co/org/repo` are one model here)
        return PurePosixPath(self.host or "local", self.namespace.lower(), self.model.lower(),
                             self.tag.lower())


def _check(component: str, what: str, pattern: re.Pattern[str], limit: int) -> None:
    if not component:
        raise InvalidName(f"{what} is empty")
    if len(component) > limit:
        raise InvalidName(f"{what} {component!r} is longer than {limit} characters")
    if ".." in component:
        raise InvalidName(f"{what} {component!r} must not contain '..'")
    if "/" in component or "\\" in component:
        raise InvalidName(f"{what} {component!r} must not contain a path separator")
    if not pattern.fullmatch(component):
        raise InvalidName(
            f"{what} {component!r} may only use letters, digits, '.', '_' and '-', "
            "and must start with a letter or digit"
        )


def parse(name: str) -> ModelName:
    """Parse and validate a model name. Plain names are lower-cased; a Hugging Face repo keeps
    its case (the Hub's repo ids are case-sensitive), its quantization tag is lower-cased."""
    text = name.strip()
    if not text:
        raise InvalidName("model name is empty")
    if len(text) > MAX_NAME:
        raise InvalidName(f"model name is longer than {MAX_NAME} characters")
    for prefix in ("https://", "http://"):
        if text.lower().startswith(prefix):
            text = text[len(prefix) :]
    if text.split("/", 1)[0].lower() not in HF_HOSTS:
        text = text.lower()
    path, sep, tag = text.rpartition(":")
    if not sep or "/" in tag:
        path, tag = text, DEFAULT_TAG
    tag = tag.lower()
    _check(tag, "tag", _TAG, MAX_TAG)
    parts = path.split("/")
    host = ""
    if parts[0].lower() in HF_HOSTS:
        host = "hf.co"
        parts = parts[1:]
        if len(parts) != 2:
            raise InvalidName("a Hugging Face name is hf.co/{org}/{repo}[:{quant}]")
        namespace, model = parts
    elif len(parts) == 1:
        namespace, model = LOCAL_NAMESPACE, parts[0]
    elif len(parts) == 2:
        namespace, model = parts
    else:
        raise InvalidName(f"model name {name!r} has too many '/' components")
    _check(namespace, "namespace", _COMPONENT, MAX_COMPONENT)
    _check(model, "model name", _COMPONENT, MAX_COMPONENT)
    return ModelName(host, namespace, model, tag)
