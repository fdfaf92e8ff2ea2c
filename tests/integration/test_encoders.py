"""Encoder-only models: the synthetic BERT (tests/fakes/encodermodel.py) as plain
llama-cpp-python loads and runs it, the reference every daemon answer below is held to."""

from __future__ import annotations

import math
from pathlib import Path

import gguf as gg
import numpy as np
import pytest

from tests.fakes.encodermodel import SEP, write_tiny_bert

SENTENCES = ["The cat sat on the mat.", "Paris is the capital of France!",
             "A quick brown fox jumps over the lazy dog", "zebra"]


def plain_embeddings(path: Path, pooling: int, texts: list[str]) -> np.ndarray:
    """What llama-cpp-python's own high-level API gives: normalised, one row per text."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), embedding=True, pooling_type=pooling, n_threads=1,
                          verbose=False)
    return np.array(llm.embed(texts, normalize=True), dtype=np.float64)


def plain_rank_logits(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """The head's output for each (query, document), one pair per decode, with the pair
    built as llama-server's format_prompt_rerank builds it for this vocabulary (add_bos,
    add_sep, no add_eos): [CLS] query [SEP] document. Written out here, not taken from
    llmrun, so a change to the engine's pair shows as a mismatch."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
                          n_threads=1, verbose=False)
    out = []
    for query, doc in pairs:
        tokens = [llm.token_bos(), *llm.tokenize(query.encode(), add_bos=False), SEP,
                  *llm.tokenize(doc.encode(), add_bos=False)]
        llm._batch.reset()
        llm._batch.add_sequence(tokens, 0, True)
        llm._ctx.decode(llm._batch)
        out.append(float(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[0]))
        llm._ctx.kv_cache_clear()
    return out


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {"mean": write_tiny_bert(root / "bert-mean.gguf"),
            "cls": write_tiny_bert(root / "bert-cls.gguf", pooling=gg.PoolingType.CLS),
            "rank": write_tiny_bert(root / "bert-rank.gguf", rank_head=True)}


def test_llama_cpp_loads_and_runs_the_synthetic_bert(models: dict[str, Path]) -> None:
    import llama_cpp

    mean = plain_embeddings(models["mean"], llama_cpp.LLAMA_POOLING_TYPE_MEAN, SENTENCES)
    cls = plain_embeddings(models["cls"], llama_cpp.LLAMA_POOLING_TYPE_CLS, SENTENCES)
    assert mean.shape == cls.shape == (4, 128)
    assert np.allclose(np.linalg.norm(mean, axis=1), 1)
    # distinct texts, distinct vectors; the two poolings differ
    assert len({tuple(np.round(v, 4)) for v in mean}) == 4
    assert not np.allclose(mean, cls, atol=1e-2)
    llm = llama_cpp.Llama(str(models["mean"]), vocab_only=True, verbose=False)
    # every word of the test sentences is a piece of the vocabulary, not [UNK] (id 1)
    assert 1 not in llm.tokenize(" ".join(SENTENCES[:3]).encode())


def test_llama_cpp_scores_pairs_with_the_rank_head(models: dict[str, Path]) -> None:
    logits = plain_rank_logits(models["rank"], [("capital of france", s) for s in SENTENCES])
    assert all(math.isfinite(x) for x in logits)
    # a head that spreads its outputs, so scores mean something to compare
    assert max(logits) - min(logits) > 0.1, logits
