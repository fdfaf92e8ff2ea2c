"""scripts/gguf_skeleton.py reshape: the 8B-class benchmark model's skeleton keeps the small
model's tokenizer and takes the large architecture's shapes, its vocabulary padded to the
embedding's rows."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gguf_skeleton


def _small() -> dict[str, Any]:
    s, u = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.UINT32)
    arr, i32 = int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.INT32)
    return {"fields": [["general.architecture", s, None, "llama"],
                       ["general.name", s, None, "tiny"],
                       ["llama.block_count", u, None, 2],
                       ["tokenizer.ggml.tokens", arr, s, ["a", "b", "c"]],
                       ["tokenizer.ggml.token_type", arr, i32, [1, 1, 3]],
                       ["tokenizer.chat_template", s, None, "{{ messages }}"]],
            "tensors": [["token_embd.weight", [3, 8], "F16"]], "file_type": 1}


def test_qwen_shape_pads_the_vocabulary_and_has_every_tensor() -> None:
    out = gguf_skeleton.reshape(_small(), "qwen2.5-7b")
    fields = {f[0]: f[3] for f in out["fields"]}
    assert fields["general.architecture"] == "qwen2"
    assert "llama.block_count" not in fields and fields["qwen2.block_count"] == 28
    assert fields["tokenizer.chat_template"] == "{{ messages }}"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 152064 and tokens[:3] == ["a", "b", "c"]
    assert set(types[3:]) == {int(gguf.TokenType.NORMAL)}  # visible when sampled
    shapes = {name: shape for name, shape, _ in out["tensors"]}
    assert shapes["token_embd.weight"] == [152064, 3584]
    assert shapes["blk.27.attn_k.weight"] == [512, 3584]  # 4 KV heads of 128
    assert shapes["blk.0.ffn_down.weight"] == [3584, 18944] and "blk.0.attn_q.bias" in shapes
    params = sum(math.prod(s) for s in shapes.values())
    assert 7.5e9 < params < 7.7e9  # Qwen2.5-7B: 7.62B


def test_a_tokenizer_larger_than_the_shape_is_refused() -> None:
    small = _small()
    small["fields"][3][3] = ["t"] * 200_000
    small["fields"][4][3] = [1] * 200_000
    with pytest.raises(ValueError, match="more than"):
        gguf_skeleton.reshape(small, "llama3-8b")
