"""Creating a model from a Modelfile: FROM a GGUF file, an uploaded blob, a model in the
store or the catalog (pulled), or a remote server; a second FROM naming the vision projector;
ADAPTER LoRAs; quantizing on the way in. Everything is checked before anything is imported,
and a refused create removes the blobs it imported that nothing else references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llmrun.store import gguf, modelfile, names
from llmrun.store import quantize as quant
from llmrun.store.describe import details_of
from llmrun.store.errors import CreateError, ModelNotFound
from llmrun.store.manifests import Layer, Manifest
from llmrun.store.references import (
    is_blob_ref,
    is_remote,
    local_file,
    refuse_host_paths,
    remote_manifest,
)
from llmrun.store.storage import Progress, Storage

# how a FROM naming a model the store lacks gets it (Store.pull: fetch.py, which loads httpx)
Pull = Callable[[str, Progress | None], Manifest]


def import_gguf(store: Storage, path: Path) -> tuple[Layer, gguf.GGUFInfo]:
    """Validate a local GGUF file, then copy it into the blob store."""
    try:
        info = gguf.read(path)
    except gguf.GGUFError as exc:
        raise CreateError(str(exc)) from None
    _refuse_adapter(info, str(path))
    _refuse_projector(info, str(path))
    digest, size = store.blobs.import_file(path)
    return Layer(digest=digest, size=size), info


def create(store: Storage, name: str, source: str | modelfile.Modelfile, pull: Pull,
           base_dir: Path | None = None, progress: Progress | None = None,
           quantize: str | None = None, allow_paths: bool = True,
           allow_remote: bool = True) -> Manifest:
    """Create `name` from Modelfile text (or a parsed Modelfile). FROM may be a GGUF path,
    `sha256:<hex>` of a blob already in the store, a model name (pulled if needed), or the
    `http(s)://` base URL of an OpenAI-compatible API that serves the model (remote); a
    model the store lacks is fetched with `pull`.

    `allow_paths=False` is for remote callers (the HTTP API): FROM and ADAPTER may then
    only name blobs or models, and the file system is never looked at for them; a remote
    FROM also needs `allow_remote` (the daemon's loopback or key-holding callers)."""
    target = names.parse(name)
    if isinstance(source, str):
        try:
            mf = modelfile.parse(source)
        except modelfile.ModelfileError as exc:
            raise CreateError(str(exc)) from None
    else:
        mf = source
        try:
            mf.options()
        except ValueError as exc:
            raise CreateError(f"invalid parameters: {exc}") from None
    if mf.template:
        from llmrun.chat import templates  # (jinja2: only for a Modelfile's TEMPLATE)

        try:  # a template that cannot compile fails here, not at the first chat
            templates.check(mf.template)
        except templates.TemplateError as exc:
            raise CreateError(f"TEMPLATE: {exc}") from None
    if mf.extra_from and any(is_remote(ref) for ref in mf.froms):
        raise CreateError("a remote model (FROM http(s)://...) takes one FROM: its server "
                          "runs the model, and any vision projector, itself")
    if not allow_paths:
        refuse_host_paths(mf, allow_remote)
    if is_remote(mf.from_) or mf.remote:
        if quantize or mf.adapters:
            raise CreateError("a remote model (FROM http(s)://...) cannot be quantized or "
                              "given adapters here: its server runs it")
        return store.put(target, remote_manifest(mf, target))
    base_dir = base_dir or Path.cwd()
    adapters = [_adapter_source(store, ref, base_dir) for ref in mf.adapters]  # before FROM
    model_ref, projector = _split_from(store, mf, base_dir, allow_paths)  # and this
    base = _resolve_from(store, model_ref, base_dir, progress, pull, allow_paths)
    if quantize:  # the model only: llama.cpp's quantizer does not take projectors
        base = _quantized(store, base, quantize, progress)
    if adapters:
        base = _with_adapters(store, base, adapters, progress)
    if projector is not None:
        base = _with_projector(store, base, *projector, progress)
    params = {**base.parameters, **mf.parameters}
    manifest = base.model_copy(update={
        "parameters": params,
        "template": mf.template if mf.template is not None else base.template,
        "system": mf.system if mf.system is not None else base.system,
        "messages": mf.messages or base.messages,
        "license": mf.license or base.license,
    })
    if progress:
        progress("writing manifest", 0, 0)
    return store.put(target, manifest)


def _quantized(store: Storage, base: Manifest, qtype: str, progress: Progress | None) -> Manifest:
    if base.parts:
        raise CreateError("quantizing a split GGUF is not supported; merge it first")
    try:
        tmp = quant.quantize(
            store.model_path(base), qtype, store.blobs.root,
            progress=(lambda i, n: progress(f"quantizing to {qtype.upper()}", i, n))
            if progress else None)
    except quant.QuantizeError as exc:
        raise CreateError(str(exc)) from None
    digest, size = store.blobs.adopt(tmp)
    store.remove_unreferenced(base.layer.digest)  # the unquantized import, if only ours
    info = gguf.read(store.blobs.path(digest))
    return base.model_copy(update={"model": Layer(digest=digest, size=size),
                                   "details": details_of(info)})


def _adapter_source(store: Storage, ref: str, base_dir: Path) -> tuple[str, Path, gguf.GGUFInfo]:
    """Check an ADAPTER (a LoRA GGUF path relative to `base_dir`, or `sha256:<hex>` of a
    blob) before anything is imported: (ref, file, header)."""
    if is_blob_ref(ref):
        path = store.blobs.path(ref.lstrip("@"))
        if not path.is_file():
            raise CreateError(f"ADAPTER {ref}: no such blob (upload it to /api/blobs first)")
    else:
        path = Path(ref).expanduser()
        if not path.is_absolute():
            path = base_dir / path
        if not path.is_file():
            raise CreateError(f"ADAPTER {ref}: no such file ({path})")
    try:
        info = gguf.read(path)
    except gguf.GGUFError as exc:
        raise CreateError(f"ADAPTER {ref}: {exc}") from None
    kind = info.metadata.get("general.type", "model")
    if kind != "adapter":
        raise CreateError(f"ADAPTER {ref}: {path.name} is not a LoRA adapter (its general.type "
                          f"is {kind!r}); name a model with FROM, and its LoRA with ADAPTER")
    lora = info.metadata.get("adapter.type")
    if lora != "lora":
        raise CreateError(f"ADAPTER {ref}: {path.name} is a {lora!r} adapter; only LoRA "
                          "adapters (adapter.type 'lora') are supported")
    return ref, path, info


def _with_adapters(store: Storage, base: Manifest,
                   adapters: list[tuple[str, Path, gguf.GGUFInfo]],
                   progress: Progress | None) -> Manifest:
    """Import checked ADAPTERs as blobs, after those `base` already has. On a refusal, the
    blobs this create imported and nothing references are removed again."""
    layers: list[Layer] = []
    try:
        for ref, path, info in adapters:
            family = base.details.family
            if family and family != "unknown" and info.architecture != family:
                raise CreateError(f"ADAPTER {ref}: a LoRA for {info.architecture!r} models "
                                  f"cannot apply to a {family!r} model")
            if progress:
                progress(f"importing adapter {path.name}", 0, path.stat().st_size)
            digest, size = store.blobs.import_file(path)
            layers.append(Layer(digest=digest, size=size))
    except BaseException:
        imported = [x.digest for x in layers]
        if base.source != "blob":
            imported.append(base.layer.digest)  # the FROM file import, if only ours
        for digest in imported:
            store.remove_unreferenced(digest)
        raise
    return base.model_copy(update={"adapters": [*base.adapters, *layers]})


def _resolve_from(store: Storage, ref: str, base_dir: Path, progress: Progress | None,
                  pull: Pull, allow_paths: bool = True) -> Manifest:
    if is_blob_ref(ref):
        digest = ref.lstrip("@")
        if not store.blobs.exists(digest):
            raise CreateError(f"FROM {ref}: no such blob (upload it to /api/blobs first)")
        try:
            info = gguf.read(store.blobs.path(digest))
        except gguf.GGUFError as exc:
            raise CreateError(str(exc)) from None
        _refuse_adapter(info, f"FROM {ref}")
        _refuse_projector(info, f"FROM {ref}")
        layer = Layer(digest=digest.replace("-", ":", 1), size=store.blobs.size(digest))
        return Manifest(name="", model=layer, details=details_of(info), source="blob")
    if allow_paths:
        local = _resolve_local(store, ref, base_dir, progress)
        if local is not None:
            return local
    try:
        return store.get(ref)[1]
    except ModelNotFound:
        pass
    try:
        return pull(ref, progress)
    except ModelNotFound:
        what = "not a file, not" if allow_paths else "not"
        raise CreateError(f"FROM {ref}: {what} a model in the store and not in "
                          "the catalog") from None


def _resolve_local(store: Storage, ref: str, base_dir: Path,
                   progress: Progress | None) -> Manifest | None:
    """FROM a GGUF file on this machine (None: `ref` is no file, nor looks like one)."""
    path = local_file(ref, base_dir)
    if path is None:
        return None
    if progress:
        progress(f"importing {path.name}", 0, path.stat().st_size)
    layer, info = import_gguf(store, path)
    return Manifest(name="", model=layer, details=details_of(info), source=str(path))


def _split_from(store: Storage, mf: modelfile.Modelfile, base_dir: Path,
                allow_paths: bool) -> tuple[str, tuple[str, Path] | None]:
    """The model's FROM, and the vision projector's FROM and file when a second FROM
    names one. Told apart by the GGUF architecture (a projector's is `clip`) in either
    order, never by file names; checked before anything is imported or pulled."""
    if not mf.extra_from:
        return mf.from_, None
    found = [(ref, _projector_file(store, ref, base_dir, allow_paths)) for ref in mf.froms]
    projectors = [(ref, path) for ref, path in found if path is not None]
    models = [ref for ref, path in found if path is None]
    if not projectors:
        raise CreateError(f"FROM {models[0]} and FROM {models[1]} are both models: a "
                          "second FROM may only name the first one's vision projector (an "
                          "mmproj GGUF, architecture 'clip')")
    if not models:
        raise CreateError(f"FROM {projectors[0][0]} and FROM {projectors[1][0]} are both "
                          "vision projectors: one FROM names the model they serve")
    return models[0], projectors[0]


def _projector_file(store: Storage, ref: str, base_dir: Path, allow_paths: bool) -> Path | None:
    """The file `ref` names when it is a vision projector; None when it is a model (a
    model file, or a model name: a name never stands for a projector)."""
    if is_blob_ref(ref):
        if not store.blobs.exists(ref.lstrip("@")):
            raise CreateError(f"FROM {ref}: no such blob (upload it to /api/blobs first)")
        path = store.blobs.path(ref.lstrip("@"))
    else:
        local = local_file(ref, base_dir) if allow_paths else None
        if local is None:
            return None
        path = local
    try:
        info = gguf.read(path)
    except gguf.GGUFError as exc:
        raise CreateError(f"FROM {ref}: {exc}") from None
    return path if info.is_projector else None


def _with_projector(store: Storage, base: Manifest, ref: str, path: Path,
                    progress: Progress | None) -> Manifest:
    """`base` with the checked projector as its own (one it had is replaced)."""
    if is_blob_ref(ref):
        digest = ref.lstrip("@").replace("-", ":", 1)
        layer = Layer(digest=digest, size=store.blobs.size(digest))
    else:
        if progress:
            progress(f"importing projector {path.name}", 0, path.stat().st_size)
        try:
            digest, size = store.blobs.import_file(path)
        except BaseException:
            if base.source != "blob":
                store.remove_unreferenced(base.layer.digest)  # the FROM import, if ours
            raise
        layer = Layer(digest=digest, size=size)
    return base.model_copy(update={"projector": layer})


def _refuse_adapter(info: gguf.GGUFInfo, what: str) -> None:
    """FROM must name a model: a LoRA adapter GGUF alone cannot be loaded."""
    if info.metadata.get("general.type") == "adapter":
        raise CreateError(f"{what} is a LoRA adapter, not a model: name its base model with "
                          "FROM and the adapter with ADAPTER")


def _refuse_projector(info: gguf.GGUFInfo, what: str) -> None:
    """A projector alone cannot be loaded: it turns images into a model's embeddings."""
    if info.is_projector:
        raise CreateError(f"{what} is a vision projector (architecture 'clip'), not a model: "
                          "name the model it serves with a FROM line beside it")
