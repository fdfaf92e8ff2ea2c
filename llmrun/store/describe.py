"""What `show` says about a stored model: its Modelfile, chat template, GGUF metadata, the
projector's, its capabilities; and the `details` a manifest keeps from a GGUF header."""

from __future__ import annotations

from collections.abc import Mapping

from llmrun.store import gguf, modelfile
from llmrun.store.manifests import Details, Manifest
from llmrun.store.storage import Storage


def human_params(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def details_of(info: gguf.GGUFInfo) -> Details:
    return Details(
        family=info.architecture,
        parameter_size=human_params(info.parameter_count),
        quantization_level=info.quantization,
        context_length=info.context_length,
    )


def modelfile_of(store: Storage, manifest: Manifest) -> modelfile.Modelfile:
    """The model as a Modelfile (what `show --modelfile` prints)."""
    if manifest.remote is not None:  # the key's configured name, never the key
        r = manifest.remote
        remote: dict[str, object] = {"remote_model": r.model}
        if len(r.urls) > 1:
            remote["remote_replica"] = r.urls[1:]
        if r.key:
            remote["remote_key"] = r.key
        elif r.key_env:  # an older manifest's (sent only if a configured key reads it)
            remote["remote_key_env"] = r.key_env
        return modelfile.Modelfile(
            from_=r.urls[0], parameters=dict(manifest.parameters), system=manifest.system,
            messages=list(manifest.messages), license=list(manifest.license),
            remote=remote)
    projector = store.projector_path(manifest)
    return modelfile.Modelfile(
        from_=str(store.model_path(manifest)),
        extra_from=[str(projector)] if projector is not None else [],
        parameters=dict(manifest.parameters),
        template=manifest.template, system=manifest.system,
        messages=list(manifest.messages), license=list(manifest.license),
        adapters=[str(p) for p in store.adapter_paths(manifest)])


def template_of(store: Storage, manifest: Manifest) -> str:
    """The chat template the model renders with: the Modelfile's, else its GGUF's."""
    if manifest.template:
        return manifest.template
    if manifest.remote is not None:
        return ""  # its server's own
    return gguf.read(store.model_path(manifest)).chat_template or ""


def model_info(store: Storage, manifest: Manifest) -> dict[str, object]:
    """The GGUF's scalar metadata (arrays shown by length), as Ollama's `model_info`; for a
    remote model, where it is served."""
    if manifest.remote is not None:
        return {"general.architecture": "remote", "remote.urls": manifest.remote.urls,
                "remote.model": manifest.remote.model}
    return _scalar_info(gguf.read(store.model_path(manifest)))


def projector_modalities(store: Storage, manifest: Manifest) -> list[str]:
    """What the model's projector encodes ("vision", "audio"); none without one."""
    path = store.projector_path(manifest)
    return gguf.read(path).modalities if path is not None else []


def projector_info(store: Storage, manifest: Manifest) -> dict[str, object] | None:
    """The vision projector's metadata, as model_info (Ollama's `projector_info`)."""
    path = store.projector_path(manifest)
    return _scalar_info(gguf.read(path)) if path is not None else None


# llama.cpp's encoder-only architectures (src/llama-arch.cpp, the BERT family): their
# output is a pooled vector or a rank, never a next token, so they embed and cannot chat
ENCODER_ARCHITECTURES = frozenset({
    "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
    "jina-bert-v3", "eurobert"})
# llama.cpp's LLAMA_POOLING_TYPE_*, as GGUF's {arch}.pooling_type holds them
NO_POOLING = 0
RANK_POOLING = 4


def pooling(info: Mapping[str, object]) -> int | None:
    """The pooling type the GGUF declares ({arch}.pooling_type); None if it declares none."""
    value = info.get(f"{info.get('general.architecture')}.pooling_type")
    try:
        return int(str(value)) if value is not None else None
    except ValueError:
        return None


def cross_encoder(info: Mapping[str, object]) -> bool:
    """Whether GGUF metadata (Store.model_info) declares rank pooling: a classification head
    (bge-reranker, jina-reranker, and Qwen3-Reranker as llama.cpp converts it) whose output
    is the score, not a vocabulary to ask for yes or no."""
    return pooling(info) == RANK_POOLING


def embedding_only(info: Mapping[str, object]) -> bool:
    """Whether the GGUF is an embedding model, not a chat model: an encoder-only
    architecture, or any model declaring a pooling type (llama.cpp's converter writes one
    only for embedding models and rerankers: Qwen3-Embedding is a qwen3 with `last`)."""
    if info.get("general.architecture") in ENCODER_ARCHITECTURES:
        return True
    kind = pooling(info)
    return kind is not None and kind > NO_POOLING


def capabilities(template: str, info: Mapping[str, object], vision: bool = False,
                 rerank: bool = False, audio: bool = False) -> list[str]:
    """Every chat model takes tools here: a template without tool support gets them in a
    system preamble. `vision` is having a projector: images need one, whatever the template
    says. `rerank`: the Modelfile makes a chat model a reranker (PARAMETER rerank...); it
    still chats. What the GGUF itself is comes first: a rank-pooled model only reranks, an
    embedding model (encoder-only, or pooled) only embeds, whatever its template says."""
    from llmrun.chat import formats  # (~0.5 s with jinja2: only once capabilities are asked)

    if cross_encoder(info):
        return ["rerank"]
    if embedding_only(info):
        return ["embedding"]
    out = ["completion", "tools"]
    if "tokenizer.ggml.fim_pre_token_id" in info:
        out.append("insert")
    # (gpt-oss thinks in channels; no probe: the daemon never renders a template)
    if formats.detect(template, probe=False).think_pair(template):
        out.append("thinking")
    if vision:
        out.append("vision")
    if audio:  # its projector encodes sound
        out.append("audio")
    if rerank:
        out.append("rerank")
    return out


def _scalar_info(info: gguf.GGUFInfo) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in info.metadata.items():
        if isinstance(value, gguf.ArraySummary):
            out[key] = None  # Ollama leaves the big tokenizer arrays out unless verbose
        elif key != "tokenizer.chat_template":
            out[key] = value
    out["general.parameter_count"] = info.parameter_count
    return out
