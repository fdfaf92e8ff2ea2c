"""The store's exceptions, in one place so every store module raises from one tree::

    StoreError
     ├── ModelNotFound   no manifest (or catalog entry) for that name
     ├── InvalidName     a name that breaks a rule (also a ValueError)
     ├── DigestError     a malformed digest, or data that does not hash to it (also ValueError)
     ├── CreateError     a Modelfile or file that cannot become a model
     ├── BlobTooLarge    an upload past LLMRUN_MAX_BLOB_SIZE
     └── PullError       a download that could not complete; says what to do next
"""

from __future__ import annotations


class StoreError(Exception):
    pass


class ModelNotFound(StoreError):
    def __init__(self, name: str, suggestions: list[str] | None = None) -> None:
        message = f"model '{name}' not found, try pulling it first"
        if suggestions:
            message += f" (did you mean: {', '.join(suggestions)}?)"
        super().__init__(message)
        self.name = name
        self.suggestions = suggestions or []


class InvalidName(StoreError, ValueError):
    pass


class DigestError(StoreError, ValueError):
    pass


class CreateError(StoreError):
    pass


class PullError(StoreError):
    pass


class BlobTooLarge(StoreError):
    pass
