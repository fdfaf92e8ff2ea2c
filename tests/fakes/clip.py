"""What the synthetic projectors (tests/fakes/vision.py, audio.py) share: a CLIP GGUF's
pre-norm transformer blocks, named as llama.cpp's tools/mtmd/clip-impl.h names them (TN_*),
and writing the file out."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np


def encoder_blocks(w: gguf.GGUFWriter, prefix: str, n_layer: int, width: int, ff: int,
                   weight: Callable[..., np.ndarray], bias: Callable[[int], np.ndarray]) -> None:
    """`n_layer` blocks of `width` (attention, then an FFN of `ff`), under `prefix` ("v" or
    "a"): q/k/v/out with biases, a layer norm (weight 1, bias 0) before each half; ffn_up is
    fc1 (width -> ff), ffn_down fc2. `weight(rows, cols)` and `bias(n)` make the values."""
    for il in range(n_layer):
        blk = f"{prefix}.blk.{il}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(f"{blk}.{name}.weight", weight(width, width))
            w.add_tensor(f"{blk}.{name}.bias", bias(width))
        for norm in ("ln1", "ln2"):
            w.add_tensor(f"{blk}.{norm}.weight", np.ones(width, dtype=np.float32))
            w.add_tensor(f"{blk}.{norm}.bias", np.zeros(width, dtype=np.float32))
        w.add_tensor(f"{blk}.ffn_up.weight", weight(ff, width))
        w.add_tensor(f"{blk}.ffn_up.bias", bias(ff))
        w.add_tensor(f"{blk}.ffn_down.weight", weight(width, ff))
        w.add_tensor(f"{blk}.ffn_down.bias", bias(width))


def write_out(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
