"""A model's skeleton: its GGUF metadata and tensor shapes without weights, and a model rebuilt
from it with random weights.

    python scripts/gguf_skeleton.py describe MODEL.gguf SKELETON.json.xz
    python scripts/gguf_skeleton.py build SKELETON.json.xz OUT.gguf [--seed N]

Why: the GPU check (scripts/gpu_check.sh) runs on a machine that reaches no package index and
receives at most 64 MiB of files, and the test models are 98 and 253 MB. Their skeletons are
a few MB: every metadata key with its exact GGUF type (architecture, tokenizer, chat template),
every tensor's name, shape and type. Rebuilt there, the model has the real one's architecture,
shapes and tokenizer, with weights drawn from a seeded normal distribution: matrices in F16
(std 0.02), 1-D tensors in F32 (biases near 0; norms, rope factors and the rest near 1), so
activations stay finite. `file_type` in the skeleton is the real file's, to quantize the
rebuilt one as the real one was (llama-quantize). What the GPU
check measures, speed and the GPU's agreement with the CPU on the same weights, does not
depend on what the weights are; the answers it reads are not text.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

FILE_TYPE = "general.file_type"
MOSTLY_F16 = 1
STD = 0.02


def describe(src: Path) -> dict[str, Any]:
    """The skeleton of the GGUF at `src`: metadata (key, GGUF type, array element type,
    value) and tensors (name, shape in numpy's order, type name)."""
    reader = gguf.GGUFReader(src)
    fields = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or not field.types:
            continue  # the header's own fields: the writer makes its own
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        if main == gguf.GGUFValueType.ARRAY and len(field.types) > 2:
            raise ValueError(f"{field.name}: arrays of arrays are not supported")
        fields.append([field.name, int(main), None if sub is None else int(sub),
                       field.contents()])
    tensors = [[t.name, [int(n) for n in reversed(t.shape.tolist())], t.tensor_type.name]
               for t in reader.tensors]
    file_type = next((f[3] for f in fields if f[0] == FILE_TYPE), MOSTLY_F16)
    return {"fields": fields, "tensors": tensors, "file_type": int(file_type)}


def _weights(name: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if len(shape) == 1:  # biases near 0; norms, rope factors and the rest near 1; in F32
        base = 0.0 if name.endswith(".bias") else 1.0
        return (base + STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    return (STD * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)


def build(skeleton: dict[str, Any], out: Path, seed: int = 0) -> None:
    """Write the model the skeleton describes, weights from `seed`, to `out`, one tensor in
    memory at a time."""
    fields = {name: (main, sub, value) for name, main, sub, value in skeleton["fields"]}
    arch = str(fields.pop("general.architecture")[2])
    writer = gguf.GGUFWriter(out, arch)
    for name, (main, sub, value) in fields.items():
        if name == FILE_TYPE:
            value = MOSTLY_F16
        writer.add_key_value(name, value, gguf.GGUFValueType(main),
                             None if sub is None else gguf.GGUFValueType(sub))
    plan = []
    for name, shape, _type in skeleton["tensors"]:
        dtype = np.float32 if len(shape) == 1 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
        plan.append((name, shape))
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, shape) in enumerate(plan):
        writer.write_tensor_data(_weights(name, shape, np.random.default_rng([seed, i])))
    writer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("describe", help="a GGUF's skeleton, as xz-compressed JSON")
    d.add_argument("model", type=Path)
    d.add_argument("skeleton", type=Path)
    b = sub.add_parser("build", help="a GGUF with random weights from a skeleton")
    b.add_argument("skeleton", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.command == "describe":
        with lzma.open(args.skeleton, "wt", encoding="utf-8") as f:
            json.dump(describe(args.model), f)
    else:
        with lzma.open(args.skeleton, "rt", encoding="utf-8") as f:
            build(json.load(f), args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
