"""Quantizing a GGUF file with llama.cpp (llmrun/engine/quantizer.py runs it in a child
process, since llama.cpp may abort on a malformed model).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp.llama_cpp as C

from llmrun.engine.llama.lib import LlamaError, init_backend

# Quantization types quantize_file accepts: llama.cpp's llama_ftype for each. Not the IQ* and
# Q2_K_S types: llama.cpp refuses those without an importance matrix.
QUANT_FTYPES: dict[str, int] = {
    "Q4_0": C.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_1": C.LLAMA_FTYPE_MOSTLY_Q4_1,
    "Q5_0": C.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": C.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q8_0": C.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q2_K": C.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q3_K_S": C.LLAMA_FTYPE_MOSTLY_Q3_K_S,
    "Q3_K_M": C.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q3_K_L": C.LLAMA_FTYPE_MOSTLY_Q3_K_L,
    "Q4_K_S": C.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "Q4_K_M": C.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_S": C.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    "Q5_K_M": C.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": C.LLAMA_FTYPE_MOSTLY_Q6_K,
    "F16": C.LLAMA_FTYPE_MOSTLY_F16,
    "BF16": C.LLAMA_FTYPE_MOSTLY_BF16,
}


def quantize_file(src: Path, dst: Path, ftype: str, n_threads: int = 0) -> None:
    """Quantize the GGUF model `src` to `ftype` (a QUANT_FTYPES name, any case) into `dst`.

    Blocks until done, with no progress reports (llama.cpp has no callback for it) and no way
    to interrupt it; llama.cpp may also abort() the process on a malformed model. Callers run
    it in a child process (llmrun.store.quantize). Already-quantized tensors are refused
    (allow_requantize stays off). `n_threads` <= 0 uses every core.
    """
    name = ftype.strip().upper()
    if name not in QUANT_FTYPES:
        raise LlamaError(f"unknown quantization type {ftype!r}; "
                         f"accepted: {', '.join(QUANT_FTYPES)}")
    init_backend()
    params = C.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[name]
    params.nthread = n_threads
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LlamaError(f"llama.cpp could not quantize {src} to {name} (error {rc}; "
                         "its log says why)")
