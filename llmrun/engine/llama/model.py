"""A loaded model and what reads it token by token: the weights and vocabulary (Model), the
token batches a decode reads (Batch) and the sampler chains that pick tokens (Sampler).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
import numpy as np

from llmrun.engine.llama.backends import devices_array
from llmrun.engine.llama.lib import DEFAULT_SEED, LlamaError, init_backend, meta_str

# Architectures llama.cpp builds without a KV cache (llama_model::create_memory gives them
# none): encoders whose attention sees the whole input at once, which a generation context
# cannot decode token by token. The GGUF's {arch}.attention.causal = false says the same of
# converted models; the list covers files that leave the key out.
ENCODER_ARCHS = frozenset({"bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert",
                           "nomic-bert-moe", "neo-bert", "eurobert", "modern-bert"})
# Rank-pooled architectures whose graph ends in a softmax over the head's labels (llama.cpp's
# build_pooling: Qwen3-Reranker as converted, labels ["yes", "no"]): output 0 is already a
# probability, where a one-label head (BERT, XLM-R cross-encoders) gives a logit.
RANK_SOFTMAX_ARCHS = frozenset({"qwen3", "qwen3vl"})


class Model:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: Path | list[Path], n_gpu_layers: int = 0,
                 tensor_split: list[float] | None = None, *, main_gpu: int = 0,
                 devices: list[str] | None = None, mmap: bool = True) -> None:
        """Load one GGUF file, or the parts of a split GGUF in order. `n_gpu_layers`: the
        last layers (the output layer counts as one) placed on devices other than the CPU:
        `devices` (ggml names, in order; default every GPU and RPC worker ggml has), split
        by `tensor_split` (proportions, one per device) or by their free memory; with
        `main_gpu` >= 0 and no split, all of them on that one device. `mmap` False reads
        the weights into memory rather than mapping the file (Ollama's use_mmap)."""
        init_backend()
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # (this llama.cpp has `load_mode` where older ones had `use_mmap`: a ctypes structure
        # takes an unknown attribute without a word, so the field is named as it is)
        params.load_mode = C.LLAMA_LOAD_MODE_AUTO if mmap else C.LLAMA_LOAD_MODE_NONE
        self.n_gpu_layers = n_gpu_layers
        keep: list[Any] = []  # arrays llama.cpp reads during the load only
        if devices:
            keep.append(devices_array(devices))
            params.devices = ctypes.cast(keep[-1], ctypes.c_void_p)
        if tensor_split:
            split = (ctypes.c_float * C.LLAMA_MAX_DEVICES)(*tensor_split[:C.LLAMA_MAX_DEVICES])
            keep.append(split)
            params.tensor_split = split
        elif main_gpu >= 0 and devices and n_gpu_layers > 0:
            params.split_mode = C.LLAMA_SPLIT_MODE_NONE  # one device holds them all
            params.main_gpu = main_gpu
        paths = path if isinstance(path, list) else [path]
        if len(paths) == 1:
            ptr = C.llama_model_load_from_file(str(paths[0]).encode(), params)
        else:
            arr = (ctypes.c_char_p * len(paths))(*(str(p).encode() for p in paths))
            ptr = C.llama_model_load_from_splits(arr, len(paths), params)
        if not ptr:
            raise LlamaError(f"llama.cpp could not load {Path(paths[0]).name}")
        self.ptr = ptr
        self.vocab = C.llama_model_get_vocab(ptr)
        self.n_vocab: int = C.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = C.llama_model_n_ctx_train(ptr)
        # sliding-window attention (Gemma 3): most layers see only the last n_swa positions,
        # and a saved sequence state keeps only those: it resumes exactly at its end only
        self.n_swa: int = C.llama_model_n_swa(ptr)
        self.add_bos: bool = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.add_eos: bool = bool(C.llama_vocab_get_add_eos(self.vocab))
        self.size: int = C.llama_model_size(ptr)
        self.n_params: int = C.llama_model_n_params(ptr)
        self.n_layer: int = C.llama_model_n_layer(ptr)
        self.n_head: int = C.llama_model_n_head(ptr)
        self.n_embd: int = C.llama_model_n_embd(ptr)
        self.arch: str = self.meta("general.architecture") or ""
        pooling = self.meta(f"{self.arch}.pooling_type")
        # the header's pooling type (C.LLAMA_POOLING_TYPE_*), -1 when it declares none
        self.pooling: int = int(pooling) if pooling and pooling.lstrip("-").isdigit() else -1
        self.n_cls_out: int = C.llama_model_n_cls_out(ptr)  # outputs of a classifier head
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    def meta(self, key: str) -> str | None:
        return meta_str(C.llama_model_meta_val_str, self.ptr, key, 1 << 16)

    @property
    def encoder_only(self) -> bool:
        """Whether this model only encodes (BERT and kin): no causal attention, no KV cache,
        nothing to generate with; it embeds, or with rank pooling scores pairs."""
        return self.meta(f"{self.arch}.attention.causal") == "false" \
            or self.arch in ENCODER_ARCHS

    @property
    def rank_pooling(self) -> bool:
        """Whether the GGUF declares rank pooling: a classification head (a cross-encoder
        reranker) whose output is the score."""
        return self.pooling == C.LLAMA_POOLING_TYPE_RANK

    @property
    def rank_softmax(self) -> bool:
        """With rank pooling, whether llama.cpp's graph already turned the head's outputs
        into probabilities (see RANK_SOFTMAX_ARCHS)."""
        return self.arch in RANK_SOFTMAX_ARCHS

    def pair_tokens(self, first: list[int], second: list[int]) -> list[int]:
        """Two token sequences (tokenized without specials) as one input of a pair
        classifier, the way llama-server's format_prompt_rerank joins a query and a
        document: BOS first A [EOS] [SEP] B [EOS], each special as the vocabulary's add_bos,
        add_eos and add_sep flags ask, SEP standing in for a missing EOS."""
        v = self.vocab
        eos = C.llama_vocab_eos(v)
        if eos < 0:
            eos = C.llama_vocab_sep(v)
        add_eos = [eos] if C.llama_vocab_get_add_eos(v) else []
        return [*([C.llama_vocab_bos(v)] if C.llama_vocab_get_add_bos(v) else []), *first,
                *add_eos, *([C.llama_vocab_sep(v)] if C.llama_vocab_get_add_sep(v) else []),
                *second, *add_eos]

    def head_dims(self) -> tuple[int, int]:
        """The width of an attention head's keys and of its values (GGUF's key_length and
        value_length, which most architectures leave at n_embd / n_head)."""
        arch = self.meta("general.architecture")
        default = self.n_embd // max(self.n_head, 1)
        dims = []
        for kind in ("key_length", "value_length"):
            value = self.meta(f"{arch}.attention.{kind}")
            dims.append(int(value) if value and value.isdigit() else default)
        return dims[0], dims[1]

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF's chat template, or its template called `name` (tokenizer.chat_template.
        <name>: "rerank" is a reranker's prompt with {query} and {document})."""
        raw = C.llama_model_chat_template(self.ptr, name.encode() if name else None)
        return raw.decode("utf-8", "replace") if raw else None

    def token_text(self, token: int) -> str:
        """The vocabulary's text for a special token (e.g. '<|im_end|>'), for templates."""
        raw = C.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def special_texts(self, markers: Iterable[str] = ()) -> list[str]:
        """The texts of the tokens that only parsing special tokens makes (control and
        unknown ones), and of the user-defined ones among `markers`: a user-defined token
        is parsed always, and most are plain text (Gemma's `<table>`, runs of spaces), but
        llama.cpp makes some markers user-defined on load (gpt-oss's `<|channel|>`)."""
        known = set(markers)
        out = []
        for token in range(self.n_vocab):
            attr = C.llama_token_get_attr(self.vocab, token)
            if attr & (C.LLAMA_TOKEN_ATTR_CONTROL | C.LLAMA_TOKEN_ATTR_UNKNOWN) or (
                    attr & C.LLAMA_TOKEN_ATTR_USER_DEFINED and self.token_text(token) in known):
                text = self.token_text(token)
                if text:
                    out.append(text)
        return out

    @property
    def bos(self) -> int:
        return C.llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return C.llama_vocab_eos(self.vocab)

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) tokens for fill-in-the-middle, if the model has them."""
        toks = (C.llama_vocab_fim_pre(self.vocab), C.llama_vocab_fim_suf(self.vocab),
                C.llama_vocab_fim_mid(self.vocab))
        return None if any(t < 0 for t in toks) else toks

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise LlamaError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token as generated text (special tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        buf = self._piece_buf
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        out = buf.raw[:n]
        self._pieces[token] = out
        return out

    def sampler(self, *, temperature: float, top_k: int, top_p: float, min_p: float,
                typical_p: float, repeat_last_n: int, repeat_penalty: float,
                presence_penalty: float, frequency_penalty: float, seed: int) -> Sampler:
        """A sampler chain over this model's vocabulary (see Sampler)."""
        return Sampler(self, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       typical_p=typical_p, repeat_last_n=repeat_last_n,
                       repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, seed=seed)

    def close(self) -> None:
        if self.ptr:
            C.llama_model_free(self.ptr)
            self.ptr = None


class Batch:
    """A reusable llama_batch; each token belongs to one sequence."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = C.llama_batch_init(capacity, 0, 1)
        self._token = self.raw.token
        self._pos = self.raw.pos
        self._n_seq = self.raw.n_seq_id
        self._seq = self.raw.seq_id
        self._logits = self.raw.logits
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token; returns its index (the row of its logits when requested)."""
        i = self.n
        self._token[i] = token
        self._pos[i] = pos
        self._n_seq[i] = 1
        self._seq[i][0] = seq
        self._logits[i] = logits
        self.n = i + 1
        return i

    def rows(self, start: int, stop: int) -> Any:
        """A llama_batch over rows start..stop-1 of this one (no copy: its arrays, offset),
        valid while this batch lives; llama.cpp numbers its rows from 0."""
        view = C.llama_batch()
        view.n_tokens = stop - start
        for name in ("token", "pos", "n_seq_id", "seq_id", "logits"):
            field = getattr(self.raw, name)
            size = ctypes.sizeof(field._type_)
            address = ctypes.cast(field, ctypes.c_void_p).value or 0
            setattr(view, name, ctypes.cast(address + start * size, type(field)))
        return view

    def close(self) -> None:
        if self.raw is not None:
            C.llama_batch_free(self.raw)
            self.raw = None


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Sampler:
    """A llama.cpp sampler chain (runs in C; sampling adds no per-token Python work).

    Structured output does not live here: the batcher computes a token mask per constrained
    sequence (engine/constraint.py, llguidance) and samples with `sample_masked`, which runs
    this same chain over the allowed tokens only.
    """

    def __init__(self, model: Model, *, temperature: float, top_k: int, top_p: float,
                 min_p: float, typical_p: float, repeat_last_n: int, repeat_penalty: float,
                 presence_penalty: float, frequency_penalty: float, seed: int) -> None:
        params = C.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = C.llama_sampler_chain_init(params)
        self.ptr = chain
        self.n_vocab = model.n_vocab
        self._cand: np.ndarray | None = None  # candidates buffer, made on first masked use
        add = C.llama_sampler_chain_add
        penalized = repeat_penalty != 1.0 or presence_penalty or frequency_penalty
        # greedy alone: the chain would pick the first highest logit and keep no state, so
        # Context.sample takes the argmax itself (see there)
        self.greedy = temperature <= 0.0 and not penalized
        if penalized:
            last_n = model.n_ctx_train if repeat_last_n == -1 else repeat_last_n
            add(chain, C.llama_sampler_init_penalties(
                model.n_vocab, last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature <= 0.0:
            add(chain, C.llama_sampler_init_greedy())
            return
        if top_k > 0:
            add(chain, C.llama_sampler_init_top_k(top_k))
        if 0.0 < typical_p < 1.0:
            add(chain, C.llama_sampler_init_typical(typical_p, 1))
        if 0.0 < top_p < 1.0:
            add(chain, C.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            add(chain, C.llama_sampler_init_min_p(min_p, 1))
        add(chain, C.llama_sampler_init_temp(temperature))
        add(chain, C.llama_sampler_init_dist(DEFAULT_SEED if seed < 0 else seed & 0xFFFFFFFF))

    def accept(self, token: int) -> None:
        """Show the chain a token (the prompt, for penalties)."""
        C.llama_sampler_accept(self.ptr, token)

    def sample_masked(self, logits: np.ndarray, mask: np.ndarray) -> int:
        """Sample from `logits` restricted to the tokens `mask` allows (llguidance's bitmask:
        bit t%32 of int32 word t//32), with this chain; the chain accepts the token.

        The chain runs over the allowed tokens only, as candidates copied out of `logits`
        (llama.cpp's own buffer, which is never written): with few tokens allowed, as inside
        JSON, that is a small array rather than the whole vocabulary, and truncation and
        temperature apply to the constrained distribution. Greedy picks the best allowed
        token, so a constrained greedy run is exactly the unconstrained one while the model
        follows the format."""
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.n_vocab]
        ids = np.flatnonzero(allowed)
        if len(ids) == 0:
            raise LlamaError("the grammar allows no token here (the schema cannot be "
                             "completed with this model's vocabulary)")
        if self._cand is None:
            self._cand = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        cand = self._cand[: len(ids)]
        cand["id"] = ids
        cand["logit"] = logits[ids]
        cand["p"] = 0.0
        arr = C.llama_token_data_array(
            data=cand.ctypes.data_as(C.llama_token_data_p), size=len(cand), selected=-1,
            sorted=False)
        C.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        token = int(cand["id"][arr.selected])
        C.llama_sampler_accept(self.ptr, token)
        return token

    def close(self) -> None:
        if self.ptr:
            C.llama_sampler_free(self.ptr)
