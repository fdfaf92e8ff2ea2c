"""The model store as its users hold it: `Store` is the `Storage` (storage.py: blobs,
manifests, the table of names and its upkeep) with what is built on it: `create`
(create.py), `pull` (fetch.py) and what `show` describes (describe.py). `llmrun.store`
re-exports `Store` and the errors; `llmrun list` reads the manifests through
`llmrun.store.listing` instead, without this module's imports."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from pathlib import Path

from llmrun.store import create as creating
from llmrun.store import describe, gguf, modelfile
from llmrun.store.describe import capabilities, human_params
from llmrun.store.manifests import Layer, Manifest
from llmrun.store.references import HOST_PATH_REFUSED, REMOTE_REFUSED, refuse_host_paths
from llmrun.store.storage import ORPHAN_AGE, TEMP_AGE, Progress, Storage

# Names callers import from this module, the store's front door, though they live lower down.
__all__ = ["HOST_PATH_REFUSED", "ORPHAN_AGE", "REMOTE_REFUSED", "TEMP_AGE", "Progress",
           "Store", "human_params", "refuse_host_paths"]


class Store(Storage):
    # -- building models --------------------------------------------------------------------

    def import_gguf(self, path: Path) -> tuple[Layer, gguf.GGUFInfo]:
        """Validate a local GGUF file, then copy it into the blob store."""
        return creating.import_gguf(self, path)

    def create(self, name: str, source: str | modelfile.Modelfile,
               base_dir: Path | None = None, progress: Progress | None = None,
               quantize: str | None = None, allow_paths: bool = True,
               allow_remote: bool = True) -> Manifest:
        """Create `name` from a Modelfile: store/create.py's `create` says what FROM may
        name and what `allow_paths` and `allow_remote` refuse. A FROM naming a model the
        store lacks pulls it."""
        return creating.create(self, name, source, self.pull, base_dir, progress, quantize,
                               allow_paths, allow_remote)

    def pull(self, name: str, progress: Progress | None = None) -> Manifest:
        """Fetch a model: `hf.co/org/repo[:quant]`, or a catalog name from its sources."""
        # fetch.py loads httpx and pull.py (~0.3 s): show, cp and rm use a Store, never pull
        from llmrun.store import fetch

        return fetch.pull(self, name, progress)

    # -- what `show` says -----------------------------------------------------------------

    def modelfile_of(self, manifest: Manifest) -> modelfile.Modelfile:
        """The model as a Modelfile (what `show --modelfile` prints)."""
        return describe.modelfile_of(self, manifest)

    def template_of(self, manifest: Manifest) -> str:
        """The chat template the model renders with: the Modelfile's, else its GGUF's."""
        return describe.template_of(self, manifest)

    def model_info(self, manifest: Manifest) -> dict[str, object]:
        """The GGUF's scalar metadata (arrays shown by length), as Ollama's `model_info`;
        for a remote model, where it is served."""
        return describe.model_info(self, manifest)

    def projector_info(self, manifest: Manifest) -> dict[str, object] | None:
        """The vision projector's metadata, as model_info (Ollama's `projector_info`)."""
        return describe.projector_info(self, manifest)

    def capabilities(self, manifest: Manifest,
                     info: Mapping[str, object] | None = None) -> builtins.list[str]:
        """What clients may ask of the model (`show`; Open WebUI and VS Code read it)."""
        info = self.model_info(manifest) if info is None else info
        modalities = self.projector_modalities(manifest)
        return capabilities(self.template_of(manifest), info,
                            vision="vision" in modalities, audio="audio" in modalities,
                            rerank=manifest.options().reranks())

    def projector_modalities(self, manifest: Manifest) -> builtins.list[str]:
        """What the model's projector encodes ("vision", "audio"), from its GGUF."""
        return describe.projector_modalities(self, manifest)
