"""The only package that calls llama-cpp-python's low-level API.

llama-cpp-python is pinned (0.3.36) because these ctypes bindings follow llama.cpp's C API,
which changes between releases; when it does, this package is the one that changes. Everything
here is a thin, typed wrapper: ownership (free on close), buffers and return-code checks.

Its modules, each over the ones after it:
  context   a llama context: KV cache, decode, logits, embeddings, sequence states
  lora      LoRA adapters for a model
  vision    the vision projector (libmtmd): image chunks and their embedding rows
  quantization  quantizing a GGUF file
  model     the weights and vocabulary, token batches, sampler chains
  backends  ggml's backends and devices, and the RPC backend (other hosts' devices)
  lib       the library itself: its log, the backend's start, LlamaError, the small-tile hook

Callers import from here (`from llmrun.engine.llama import Model`), not from the modules.
"""

import llama_cpp.llama_cpp as C

from llmrun.engine.llama.backends import (
    DEVICE_TYPES,
    RpcWorkers,
    list_backends,
    list_devices,
    rpc_serve,
)
from llmrun.engine.llama.context import KV_TYPES, Context
from llmrun.engine.llama.lib import (
    DEFAULT_SEED,
    SMALL_TILE_ROWS,
    LlamaError,
    init_backend,
    set_tiled_rows,
    small_tiles_available,
)
from llmrun.engine.llama.lora import LoraAdapter
from llmrun.engine.llama.model import Batch, Model, Sampler
from llmrun.engine.llama.quantization import QUANT_FTYPES, quantize_file
from llmrun.engine.llama.vision import EmbdBatch, ImageChunk, Projector

# The patched CPU backend's setter (None without the patch), by the name the build check
# (tests/integration/test_llama_build.py) calls it with to compare the two attention paths directly.
_set_tiled_rows = set_tiled_rows

__all__ = [
    "DEFAULT_SEED",
    "DEVICE_TYPES",
    "KV_TYPES",
    "QUANT_FTYPES",
    "SMALL_TILE_ROWS",
    "Batch",
    "C",
    "Context",
    "EmbdBatch",
    "ImageChunk",
    "LlamaError",
    "LoraAdapter",
    "Model",
    "Projector",
    "RpcWorkers",
    "Sampler",
    "init_backend",
    "list_backends",
    "list_devices",
    "quantize_file",
    "rpc_serve",
    "set_tiled_rows",
    "small_tiles_available",
]
