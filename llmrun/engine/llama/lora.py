"""LoRA adapters: an adapter GGUF loaded for a model (Context.set_loras applies it), with
llama.cpp's own words when it refuses one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import llama_cpp.llama_cpp as C

from llmrun.engine.llama.lib import LlamaError, init_backend, log, meta_str
from llmrun.engine.llama.model import Model


class _ErrorLog(logging.Handler):
    """Collects llama.cpp's error lines (they arrive through on_log) while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        head, sep, rest = msg.partition(": ")
        self.lines.append(rest if sep and head.isidentifier() else msg)  # drop "func: "


class LoraAdapter:
    """A LoRA adapter GGUF (general.type `adapter`) loaded for `model`; Context.set_loras
    applies it. llama.cpp also frees an adapter with its model, so close() it before the
    model's close() (afterwards close() only forgets the pointer)."""

    def __init__(self, model: Model, path: Path) -> None:
        init_backend()
        if not model.ptr:
            raise LlamaError(f"cannot load LoRA adapter {Path(path).name}: the model is closed")
        if not Path(path).is_file():
            raise LlamaError(f"LoRA adapter {Path(path).name}: no such file")
        errors = _ErrorLog()
        log.addHandler(errors)
        try:
            ptr = C.llama_adapter_lora_init(model.ptr, str(path).encode())
        finally:
            log.removeHandler(errors)
        if not ptr:
            why = "; ".join(errors.lines) or "see the log"
            raise LlamaError(f"llama.cpp could not load the LoRA adapter {Path(path).name}: "
                             f"{why}")
        self.ptr = ptr
        self.model = model
        self.path = path

    def meta(self, key: str) -> str | None:
        """A metadata value of the adapter GGUF as text (e.g. `adapter.lora.alpha`)."""
        return meta_str(C.llama_adapter_meta_val_str, self.ptr, key, 1 << 12)

    def close(self) -> None:
        if self.ptr:
            if self.model.ptr:  # else llama_model_free already freed it
                C.llama_adapter_lora_free(self.ptr)
            self.ptr = None
