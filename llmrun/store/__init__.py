"""The model store: blobs + manifests under LLMRUN_HOME (`llmrun.store.store.Store`).

This package imports nothing heavy by itself: `Store` and `Manifest` load on first use, so
`llmrun list` can read the manifests through `llmrun.store.listing` without pydantic, the
chat templates or filelock: pydantic and the request models alone take ~0.25 s to import, the
whole start-up budget of `list` on an idle 2-core machine. The errors are light and load here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from llmrun.store.errors import (
    BlobTooLarge,
    CreateError,
    DigestError,
    InvalidName,
    ModelNotFound,
    PullError,
    StoreError,
)

if TYPE_CHECKING:
    from llmrun.store.manifests import Manifest
    from llmrun.store.references import HOST_PATH_REFUSED, refuse_host_paths
    from llmrun.store.store import Store

__all__ = ["HOST_PATH_REFUSED", "BlobTooLarge", "CreateError", "DigestError", "InvalidName",
           "Manifest", "ModelNotFound", "PullError", "Store", "StoreError",
           "refuse_host_paths"]

_LAZY = {"Store": "llmrun.store.store", "HOST_PATH_REFUSED": "llmrun.store.references",
         "refuse_host_paths": "llmrun.store.references", "Manifest": "llmrun.store.manifests"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
