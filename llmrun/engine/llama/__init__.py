"""The llama.cpp adapter, as a package (its one module, model.py, until it is split)."""

from llmrun.engine.llama.model import (
    DEFAULT_SEED,
    DEVICE_TYPES,
    KV_TYPES,
    QUANT_FTYPES,
    SMALL_TILE_ROWS,
    Batch,
    C,
    Context,
    EmbdBatch,
    ImageChunk,
    LlamaError,
    LoraAdapter,
    Model,
    Projector,
    RpcWorkers,
    Sampler,
    _set_tiled_rows,
    init_backend,
    list_backends,
    list_devices,
    quantize_file,
    rpc_serve,
    small_tiles_available,
)

__all__ = ["DEFAULT_SEED", "DEVICE_TYPES", "KV_TYPES", "QUANT_FTYPES", "SMALL_TILE_ROWS", "Batch",
           "C", "Context", "EmbdBatch", "ImageChunk", "LlamaError", "LoraAdapter", "Model",
           "Projector", "RpcWorkers", "Sampler", "_set_tiled_rows", "init_backend",
           "list_backends", "list_devices", "quantize_file", "rpc_serve", "small_tiles_available"]
