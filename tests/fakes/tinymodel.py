"""A tiny but real llama-architecture GGUF that llama.cpp loads, quantizes and runs.

Random weights (fixed seed), a SentencePiece-style ("llama") vocabulary of 3 special tokens,
256 byte-fallback tokens, characters and a few merged pieces. Dimensions are multiples of 256
(QK_K) so every K-quant applies to every matrix, and the whole file is about 1.5 MB at F16.

    from tests.fakes.tinymodel import write_tiny_llama
    path = write_tiny_llama(tmp_path / "tiny-f16.gguf")
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_EMBD = 256  # a multiple of 256, so K-quants (Q4_K_M, ...) quantize every row
N_FF = 512
N_HEAD = 4
N_HEAD_KV = 2  # grouped-query attention, as most current models
N_LAYER = 1
N_CTX = 256

_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-"
# merged pieces, each reachable from two shorter ones (SentencePiece merges pairs)
_MERGES = ["he", "ll", "in", "er", "or", "th", "▁t", "▁th", "▁the", "▁a", "▁h", "▁he", "▁hell",
           "▁hello"]


FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]  # ids 3, 4, 5 with fim=True


def vocabulary(fim: bool = False, specials: tuple[str, ...] = ()
               ) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny SentencePiece vocabulary: `specials` are
    control tokens after the FIM ones (ids from 3, or 6 with `fim`)."""
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", *(FIM_TOKENS if fim else []), *specials]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL, *([tt.CONTROL] * 3 if fim else []),
             *([tt.CONTROL] * len(specials))]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [tt.BYTE] * 256
    pieces = ["▁", *_CHARS, *_MERGES]
    tokens += pieces
    types += [tt.NORMAL] * len(pieces)
    # SentencePiece merges the highest-scoring pieces first: longer pieces score higher.
    scores = [0.0] * (len(tokens) - len(pieces)) + [float(len(p)) - i * 1e-3
                                                      for i, p in enumerate(pieces)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(path: Path, *, dtype: type = np.float16, n_layer: int = N_LAYER,
                     seed: int = 0, fim: bool = False, pooling: int | None = None,
                     specials: tuple[str, ...] = (), chat_template: str | None = None,
                     n_ctx: int = N_CTX, favour: int | None = None) -> Path:
    """Write a tiny llama model to `path`: matrices in `dtype` (float16 or float32), 1-D norms
    in float32 (as convert_hf_to_gguf.py writes them); general.file_type set to match. With
    `fim`, the vocabulary has fill-in-the-middle tokens (ids 3, 4, 5). `pooling`: the
    header's pooling type (gguf.PoolingType), as an embedding model or a reranker declares it
    (the header only: no classification head is written). `specials`: further control
    tokens (vocabulary); `chat_template`: the template in its metadata (default: a plain
    "role: content" one); `n_ctx`: its training context. With `specials`, the tokenizer adds
    no space before the text (tokenizer.ggml.add_space_prefix false, as Gemma's): llama.cpp's
    SentencePiece tokenizer would otherwise write one after every special token as well,
    which no chat template of these families expects. `favour`: a token the model writes
    wherever it may (its logit some 15 above the others': every embedding holds 1.0 in its
    first dimension, which the final norm keeps the largest, and only this token's output
    row reads it)."""
    tokens, scores, types = vocabulary(fim, specials)
    n_vocab = len(tokens)
    head_dim = N_EMBD // N_HEAD
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy (rows, cols) is GGUF ne = [cols, rows]: cols is the row length llama.cpp sees
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(dtype)

    def norm() -> np.ndarray:
        return np.ones(N_EMBD, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == np.float16
                    else gguf.LlamaFileType.ALL_F32)
    w.add_context_length(n_ctx)
    if pooling is not None:
        w.add_pooling_type(gguf.PoolingType(pooling))
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if fim:
        w.add_uint32("tokenizer.ggml.fim_pre_token_id", 3)
        w.add_uint32("tokenizer.ggml.fim_suf_token_id", 4)
        w.add_uint32("tokenizer.ggml.fim_mid_token_id", 5)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if specials:
        w.add_add_space_prefix(False)
    w.add_chat_template(chat_template or (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    ))

    embd = matrix(n_vocab, N_EMBD)
    if favour is not None:
        embd[:, 0] = 1.0
    w.add_tensor("token_embd.weight", embd)
    for i in range(n_layer):
        blk = f"blk.{i}"
        w.add_tensor(f"{blk}.attn_norm.weight", norm())
        w.add_tensor(f"{blk}.attn_q.weight", matrix(N_HEAD * head_dim, N_EMBD))
        w.add_tensor(f"{blk}.attn_k.weight", matrix(N_HEAD_KV * head_dim, N_EMBD))
        w.add_tensor(f"{blk}.attn_v.weight", matrix(N_HEAD_KV * head_dim, N_EMBD))
        w.add_tensor(f"{blk}.attn_output.weight", matrix(N_EMBD, N_HEAD * head_dim))
        w.add_tensor(f"{blk}.ffn_norm.weight", norm())
        w.add_tensor(f"{blk}.ffn_gate.weight", matrix(N_FF, N_EMBD))
        w.add_tensor(f"{blk}.ffn_up.weight", matrix(N_FF, N_EMBD))
        w.add_tensor(f"{blk}.ffn_down.weight", matrix(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", norm())
    out = matrix(n_vocab, N_EMBD)  # (the same draws as ever: earlier models stay the same)
    if favour is not None:
        out[:, 0] = 0.0
        out[favour, 0] = 1.0
    w.add_tensor("output.weight", out)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
