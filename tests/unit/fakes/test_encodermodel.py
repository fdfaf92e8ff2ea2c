"""The BERT fixture itself (tests/fakes/encodermodel.py): well-formed GGUFs with the keys and
tensor shapes llama.cpp's bert loader asks for. Quick: no llama.cpp (that llama.cpp loads and
runs both variants is in tests/integration/test_encoders.py)."""

from __future__ import annotations

from pathlib import Path

import gguf as gg
import pytest

from llmrun.store import gguf
from tests.fakes import encodermodel


def test_embedding_model_shape(tmp_path: Path) -> None:
    info = gguf.read(encodermodel.write_tiny_bert(tmp_path / "bert.gguf",
                                                  pooling=gg.PoolingType.CLS))
    meta = info.metadata
    assert info.architecture == "bert"
    assert meta["bert.pooling_type"] == int(gg.PoolingType.CLS)
    assert meta["bert.attention.causal"] is False
    assert meta["tokenizer.ggml.model"] == "bert"
    assert meta["tokenizer.ggml.token_type_count"] == 2
    tokens, _ = encodermodel.vocabulary()
    assert tokens[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(set(tokens)) == len(tokens)  # llama.cpp aborts on a repeated token
    n_vocab = len(tokens)
    assert meta["tokenizer.ggml.tokens"].length == n_vocab
    shapes = {t.name: t.shape for t in info.tensors}
    assert shapes["token_embd.weight"] == (128, n_vocab)
    assert shapes["token_types.weight"] == (128, 2)
    assert shapes["position_embd.weight"] == (128, 512)
    assert shapes["blk.1.ffn_up.weight"] == (128, 512)
    assert "blk.2.attn_q.weight" not in shapes
    assert not any(name.startswith("cls") for name in shapes)


def test_cross_encoder_has_a_one_label_head(tmp_path: Path) -> None:
    info = gguf.read(encodermodel.write_tiny_bert(tmp_path / "rank.gguf", rank_head=True))
    assert info.metadata["bert.pooling_type"] == int(gg.PoolingType.RANK)
    shapes = {t.name: t.shape for t in info.tensors}
    assert shapes["cls.weight"] == (128, 128)
    assert shapes["cls.bias"] == (128,)
    assert shapes["cls.output.weight"] == (128, 1)
    assert shapes["cls.output.bias"] == (1,)


def test_bigger_shapes_and_seeds(tmp_path: Path) -> None:
    a = encodermodel.write_tiny_bert(tmp_path / "a.gguf").read_bytes()
    assert encodermodel.write_tiny_bert(tmp_path / "b.gguf").read_bytes() == a
    assert encodermodel.write_tiny_bert(tmp_path / "c.gguf", seed=1).read_bytes() != a
    # bge-small's shape: 384 wide, 12 heads of 32, 12 layers
    info = gguf.read(encodermodel.write_tiny_bert(tmp_path / "d.gguf", n_embd=384,
                                                  n_layer=12))
    assert info.metadata["bert.attention.head_count"] == 12
    assert info.metadata["bert.block_count"] == 12
    nomic = gguf.read(encodermodel.write_tiny_bert(tmp_path / "n.gguf", arch="nomic-bert"))
    assert nomic.architecture == "nomic-bert"
    names = {t.name for t in nomic.tensors}
    assert "position_embd.weight" not in names and "blk.1.ffn_gate.weight" in names
    with pytest.raises(ValueError, match="multiple of 32"):
        encodermodel.write_tiny_bert(tmp_path / "e.gguf", n_embd=100)
