"""Tiny but real BERT-family GGUFs: an encoder-only embedding model and a cross-encoder.

Random weights (fixed seed) in llama.cpp's `bert` architecture: token, token-type and
position embeddings, an embedding layer norm, post-norm blocks (attention with biases,
GELU feed-forward), non-causal attention and the header's pooling type. With `rank_head`,
the classification head of a BERT/XLM-R sequence classifier (`cls`: dense + tanh,
`cls.output`: one label) and RANK pooling, as convert_hf_to_gguf.py writes bge-reranker.

The vocabulary is WordPiece in llama.cpp's "phantom space" form (what the converter writes):
a word-initial piece is "▁word", a continuation ("##ing" in Hugging Face) is "ing". Single
letters, digits and punctuation in both forms mean every ASCII word tokenizes, a few
hundred common words keep ordinary test sentences short; anything else becomes [UNK].

    from tests.fakes.encodermodel import write_tiny_bert
    path = write_tiny_bert(tmp_path / "bert.gguf")                      # mean pooling
    path = write_tiny_bert(tmp_path / "rerank.gguf", rank_head=True)    # cross-encoder
    path = write_tiny_bert(tmp_path / "nomic.gguf", arch="nomic-bert")  # nomic-embed-text's

Key and tensor names follow llama.cpp's src/models/bert.cpp (load_arch_tensors),
src/llama-model.cpp (load_hparams), src/llama-vocab.cpp (the "bert" tokenizer model) and
gguf-py's constants (MODEL_TENSOR.CLS -> "cls", CLS_OUT -> "cls.output").
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HEAD_DIM = 32  # bge-small's: 384 wide, 12 heads
N_TOKEN_TYPES = 2  # sentence A / B, as BERT's type_vocab_size
EPS = 1e-12  # BERT's layer_norm_eps

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD, UNK, CLS, SEP, MASK = range(5)

_WORDS = [word for line in (
    "the a an and or of to in on at for with by from as is are was were be been it its this that",
    "these those there here what which who how why when where not no yes can will would should do",
    "does did has have had he she they we you i my your our their his her them us me",
    "cat cats dog dogs sat mat bird fish sky blue red green sun moon sea water fire tree trees",
    "city capital paris france germany berlin london england italy rome spain madrid europe",
    "language model models embedding embeddings vector search query document documents text",
    "computer science data machine learning fast slow quick brown fox jumps over lazy",
    "good bad big small new old first last one two three many more most some all any each",
    "hello world day night time year people man woman child house car road book books",
) for word in line.split()]
_CONTINUATIONS = ["ing", "ed", "s", "es", "er", "ly", "tion", "ment"]
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
_PUNCT = ".,!?;:'\"-()"


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and token types of the tiny WordPiece vocabulary (special tokens first)."""
    tt = gguf.TokenType
    tokens = list(SPECIAL)
    types = [tt.CONTROL] * len(SPECIAL)
    # dict.fromkeys: the word "a" and the letter "▁a" are one token (llama.cpp asserts that
    # no text appears twice)
    pieces = list(dict.fromkeys([f"▁{w}" for w in _WORDS] + [f"▁{c}" for c in _CHARS + _PUNCT]
                                + list(_CHARS) + _CONTINUATIONS))
    tokens += pieces
    types += [tt.NORMAL] * len(pieces)
    return tokens, [int(t) for t in types]


def write_tiny_bert(path: Path, *, pooling: int = gguf.PoolingType.MEAN,
                    rank_head: bool = False, seed: int = 0, n_layer: int = 2,
                    n_embd: int = 128, n_ctx: int = 512, arch: str = "bert") -> Path:
    """Write a random-weight BERT GGUF to `path`. `pooling` is the header's pooling type
    (gguf.PoolingType: MEAN, CLS, LAST); `rank_head` adds the one-label classification head
    and sets pooling to RANK whatever `pooling` says. `n_embd` must be a multiple of 32
    (heads are 32 wide; 384 with 12 layers is bge-small's shape); `n_ctx` is the trained
    context (the position-embedding rows). Matrices in F16, norms, biases and embeddings'
    rows that llama.cpp adds (token types) in F32; deterministic from `seed`. `arch`
    "nomic-bert" writes nomic-embed-text's variant instead (src/models/nomic-bert.cpp):
    rotary positions in place of position embeddings, a gated (SwiGLU) feed-forward."""
    if n_embd % HEAD_DIM:
        raise ValueError(f"n_embd must be a multiple of {HEAD_DIM}, got {n_embd}")
    tokens, types = vocabulary()
    n_vocab = len(tokens)
    n_head = n_embd // HEAD_DIM
    n_ff = 4 * n_embd
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
        # numpy (rows, cols) is GGUF ne = [cols, rows]: cols is the row length llama.cpp sees
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np.float16)

    def vector(n: int, scale: float = 0.02) -> np.ndarray:
        return rng.standard_normal(n, dtype=np.float32) * scale

    def ones(n: int) -> np.ndarray:  # a layer norm's weight
        return np.ones(n, dtype=np.float32)

    if arch not in ("bert", "nomic-bert"):
        raise ValueError(f"arch must be bert or nomic-bert, got {arch!r}")
    nomic = arch == "nomic-bert"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-bert-reranker" if rank_head else "tiny-bert")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(EPS)
    w.add_causal_attention(False)
    if nomic:
        w.add_rope_freq_base(1000.0)  # nomic-embed-text-v1.5's
    w.add_pooling_type(gguf.PoolingType.RANK if rank_head else gguf.PoolingType(pooling))
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(N_TOKEN_TYPES)
    # BERT's specials; [CLS] is the BOS llama.cpp prepends, [SEP] what it appends (add_sep)
    w.add_bos_token_id(CLS)
    w.add_sep_token_id(SEP)
    w.add_unk_token_id(UNK)
    w.add_pad_token_id(PAD)
    w.add_mask_token_id(MASK)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_sep_token(True)

    w.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, 1.0))
    w.add_tensor("token_types.weight", vector(N_TOKEN_TYPES * n_embd).reshape(N_TOKEN_TYPES,
                                                                               n_embd))
    if not nomic:
        w.add_tensor("position_embd.weight", matrix(n_ctx, n_embd, 0.5))
    w.add_tensor("token_embd_norm.weight", ones(n_embd))
    w.add_tensor("token_embd_norm.bias", vector(n_embd))
    for i in range(n_layer):
        blk = f"blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"{blk}.{name}.weight", matrix(n_embd, n_embd, n_embd ** -0.5))
            w.add_tensor(f"{blk}.{name}.bias", vector(n_embd))
        w.add_tensor(f"{blk}.attn_output_norm.weight", ones(n_embd))
        w.add_tensor(f"{blk}.attn_output_norm.bias", vector(n_embd))
        w.add_tensor(f"{blk}.ffn_up.weight", matrix(n_ff, n_embd, n_embd ** -0.5))
        w.add_tensor(f"{blk}.ffn_up.bias", vector(n_ff))
        w.add_tensor(f"{blk}.ffn_down.weight", matrix(n_embd, n_ff, n_ff ** -0.5))
        w.add_tensor(f"{blk}.ffn_down.bias", vector(n_embd))
        if nomic:
            w.add_tensor(f"{blk}.ffn_gate.weight", matrix(n_ff, n_embd, n_embd ** -0.5))
        w.add_tensor(f"{blk}.layer_output_norm.weight", ones(n_embd))
        w.add_tensor(f"{blk}.layer_output_norm.bias", vector(n_embd))
    if rank_head:
        # scales near 1/sqrt(fan-in) so the logits spread over a few units: sigmoid scores
        # then differ visibly between pairs instead of all sitting at 0.5
        w.add_tensor("cls.weight", matrix(n_embd, n_embd, 2 * n_embd ** -0.5))
        w.add_tensor("cls.bias", vector(n_embd))
        w.add_tensor("cls.output.weight", matrix(1, n_embd, 3 * n_embd ** -0.5))
        w.add_tensor("cls.output.bias", vector(1))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
