"""A model's skeleton: its GGUF metadata and tensor shapes without weights, and a model rebuilt
from it with random weights.

    python scripts/gguf_skeleton.py describe MODEL.gguf SKELETON.json.xz
    python scripts/gguf_skeleton.py build SKELETON.json.xz OUT.gguf [--seed N]
    python scripts/gguf_skeleton.py reshape SKELETON.json.xz SHAPE OUT.json.xz

`reshape` keeps a skeleton's tokenizer and chat template and gives it the architecture and
tensor shapes of a model of the size people run (`SHAPES`: Qwen2.5-7B's, Llama 3 8B's), the
vocabulary padded with control tokens to that model's embedding rows: the 8B-class model of
the benchmarks (scripts/make_big_model.sh), which no package here ships.

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


# Architectures of the size people run, as their published configs give them (Hugging Face
# config.json: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
# intermediate_size, vocab_size, rope_theta, rms_norm_eps). Speed and memory depend on these
# alone; the tokenizer only sets which text the random weights are read as.
SHAPES: dict[str, dict[str, Any]] = {
    # 7.62B parameters; Q4_K_M 4.7 GB; KV cache 56 KiB a token (f16)
    "qwen2.5-7b": {"arch": "qwen2", "n_embd": 3584, "n_layer": 28, "n_head": 28,
                   "n_head_kv": 4, "n_ff": 18944, "n_vocab": 152064, "n_ctx": 32768,
                   "rope_base": 1000000.0, "eps": 1e-6, "qkv_bias": True},
    # 8.03B parameters; Q4_K_M 4.9 GB; KV cache 128 KiB a token (f16)
    "llama3-8b": {"arch": "llama", "n_embd": 4096, "n_layer": 32, "n_head": 32,
                  "n_head_kv": 8, "n_ff": 14336, "n_vocab": 128256, "n_ctx": 8192,
                  "rope_base": 500000.0, "eps": 1e-5, "qkv_bias": False},
}
_U32, _F32, _STR = (int(t) for t in (
    gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING))
# Padding tokens are NORMAL ones with visible text, not CONTROL ones: random weights sample
# them as often as the real tokens (two in three of Qwen2.5-7B's 152064 rows are padding),
# and a control token's text is empty, so two in three tokens streamed nothing and a
# benchmark that counts streamed chunks saw a third of the rate.
_PAD = int(gguf.TokenType.NORMAL)


def reshape(skeleton: dict[str, Any], shape_name: str) -> dict[str, Any]:
    """`skeleton`'s tokenizer and template on the architecture `SHAPES[shape_name]`."""
    sh = SHAPES[shape_name]
    arch, d, kv = sh["arch"], sh["n_embd"], sh["n_head_kv"] * (sh["n_embd"] // sh["n_head"])
    fields = [f for f in skeleton["fields"]
              if f[0].startswith(("tokenizer.", "general."))
              and f[0] not in ("general.architecture", FILE_TYPE)]
    tokens = next(f for f in fields if f[0] == "tokenizer.ggml.tokens")
    n_real = len(tokens[3])
    if n_real > sh["n_vocab"]:
        raise ValueError(f"the tokenizer has {n_real} tokens, more than {shape_name}'s "
                         f"{sh['n_vocab']} embedding rows")
    pad = sh["n_vocab"] - n_real  # (Qwen's and Llama's own files pad with unused tokens too)
    for f in fields:
        if f[0] == "tokenizer.ggml.tokens":
            # not "<|pad_1|>": llama.cpp's vocabulary loader takes such text for a control
            # token's, whose text is empty when streamed, whatever the type says
            f[3] = [*f[3], *(f"[[pad_{i}]]" for i in range(pad))]
        elif f[0] == "tokenizer.ggml.token_type":
            f[3] = [*f[3], *([_PAD] * pad)]
        elif f[0] == "tokenizer.ggml.scores":
            f[3] = [*f[3], *([0.0] * pad)]
        elif f[0] == "general.name":
            f[3] = f"synthetic {shape_name} (random weights)"
    fields = [["general.architecture", _STR, None, arch], *fields,
              [f"{arch}.context_length", _U32, None, sh["n_ctx"]],
              [f"{arch}.embedding_length", _U32, None, d],
              [f"{arch}.block_count", _U32, None, sh["n_layer"]],
              [f"{arch}.feed_forward_length", _U32, None, sh["n_ff"]],
              [f"{arch}.attention.head_count", _U32, None, sh["n_head"]],
              [f"{arch}.attention.head_count_kv", _U32, None, sh["n_head_kv"]],
              [f"{arch}.rope.freq_base", _F32, None, sh["rope_base"]],
              [f"{arch}.attention.layer_norm_rms_epsilon", _F32, None, sh["eps"]]]
    if arch == "llama":
        fields.append([f"{arch}.rope.dimension_count", _U32, None, d // sh["n_head"]])
    t = [["token_embd.weight", [sh["n_vocab"], d], "F16"]]
    for i in range(sh["n_layer"]):
        b = f"blk.{i}."
        t += [[b + "attn_norm.weight", [d], "F32"], [b + "attn_q.weight", [d, d], "F16"],
              [b + "attn_k.weight", [kv, d], "F16"], [b + "attn_v.weight", [kv, d], "F16"]]
        if sh["qkv_bias"]:
            t += [[b + "attn_q.bias", [d], "F32"], [b + "attn_k.bias", [kv], "F32"],
                  [b + "attn_v.bias", [kv], "F32"]]
        t += [[b + "attn_output.weight", [d, d], "F16"], [b + "ffn_norm.weight", [d], "F32"],
              [b + "ffn_gate.weight", [sh["n_ff"], d], "F16"],
              [b + "ffn_up.weight", [sh["n_ff"], d], "F16"],
              [b + "ffn_down.weight", [d, sh["n_ff"]], "F16"]]
    t += [["output_norm.weight", [d], "F32"], ["output.weight", [sh["n_vocab"], d], "F16"]]
    return {"fields": fields, "tensors": t, "file_type": int(gguf.LlamaFileType.MOSTLY_Q4_K_M)}


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
    r = sub.add_parser("reshape", help="a skeleton's tokenizer on an 8B-class architecture")
    r.add_argument("skeleton", type=Path)
    r.add_argument("shape", choices=sorted(SHAPES))
    r.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.command == "reshape":
        with lzma.open(args.skeleton, "rt", encoding="utf-8") as f:
            shaped = reshape(json.load(f), args.shape)
        with lzma.open(args.out, "wt", encoding="utf-8") as f:
            json.dump(shaped, f)
    elif args.command == "describe":
        with lzma.open(args.skeleton, "wt", encoding="utf-8") as f:
            json.dump(describe(args.model), f)
    else:
        with lzma.open(args.skeleton, "rt", encoding="utf-8") as f:
            build(json.load(f), args.out, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
