"""llmrun.store.quantize: real llama.cpp quantization of a tiny llama model, and refusals."""

from __future__ import annotations

import stat
import sys
import threading
import time
from pathlib import Path

import gguf as gguf_writer
import numpy as np
import pytest

from llmrun.engine import llama
from llmrun.engine.quantizer import main
from llmrun.store import CreateError, gguf
from llmrun.store.quantize import QUANT_TYPES, QuantizeError, quantize, source_quantization
from tests.fakes.tinymodel import N_EMBD, N_FF, write_tiny_llama

pytestmark = pytest.mark.model  # llama.cpp quantizes, in this process or in a child


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("src") / "tiny-f16.gguf")


@pytest.fixture(scope="module")
def tiny_q8(tiny_f16: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize(tiny_f16, "Q8_0", tmp_path_factory.mktemp("q8"))


def matrix_types(path: Path) -> dict[str, str]:
    """Type names of the 2-D tensors (1-D norms stay F32 in every quantization)."""
    info = gguf.read(path)
    return {t.name: gguf.GGML_TYPES[t.type][0] for t in info.tensors if len(t.shape) == 2}


def assert_runs(path: Path) -> None:
    """llama.cpp loads the model and decodes a prompt to finite logits."""
    model = llama.Model(path)
    try:
        tokens = model.tokenize("hello the world", add_special=True)
        assert tokens[0] == model.bos
        ctx = llama.Context(model, n_ctx_seq=64, n_seq=1, n_batch=32, n_threads=1)
        batch = llama.Batch(32)
        try:
            for i, tok in enumerate(tokens):
                batch.add(tok, i, 0, i == len(tokens) - 1)
            assert ctx.decode(batch) == 0
            assert np.isfinite(ctx.logits(len(tokens) - 1)).all()
        finally:
            batch.close()
            ctx.close()
    finally:
        model.close()


def test_tiny_model_is_a_real_model(tiny_f16: Path) -> None:
    info = gguf.read(tiny_f16)
    assert info.quantization == "F16"
    assert set(matrix_types(tiny_f16).values()) == {"F16"}
    assert_runs(tiny_f16)


def test_q8_0(tiny_f16: Path, tiny_q8: Path) -> None:
    info = gguf.read(tiny_q8)
    assert info.quantization == "Q8_0"
    assert set(matrix_types(tiny_q8).values()) == {"Q8_0"}
    assert info.file_size < tiny_f16.stat().st_size * 0.6
    assert info.metadata["tokenizer.ggml.model"] == "llama"  # metadata is carried over
    assert_runs(tiny_q8)


def test_q4_k_m_case_insensitive_with_progress(tiny_f16: Path, tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    out = quantize(tiny_f16, "q4_k_m", tmp_path, progress=lambda i, n: seen.append((i, n)))
    assert out.parent == tmp_path
    assert list(tmp_path.iterdir()) == [out]
    info = gguf.read(out)
    assert info.quantization == "Q4_K_M"
    types = matrix_types(out)
    # Q4_K_M: Q4_K mostly, Q6_K for output.weight and (some) attn_v / ffn_down
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["output.weight"] == "Q6_K"
    assert info.file_size < tiny_f16.stat().st_size * 0.4
    n = len(info.tensors)
    assert seen == [(i, n) for i in range(1, n + 1)]
    llama.Model(out).close()


def test_from_f32(tmp_path: Path) -> None:
    # in-process (each child process costs about a second of imports): llmrun accepts F32
    # sources and llama.cpp quantizes them
    src = write_tiny_llama(tmp_path / "tiny-f32.gguf", dtype=np.float32)
    info = gguf.read(src)
    assert info.quantization == "F32"
    assert source_quantization(info) is None
    out = tmp_path / "tiny-q4_0.gguf"
    llama.quantize_file(src, out, "Q4_0", n_threads=1)
    assert gguf.read(out).quantization == "Q4_0"
    assert set(matrix_types(out).values()) <= {"Q4_0", "Q6_K"}  # llama.cpp keeps output Q6_K
    assert out.stat().st_size < src.stat().st_size / 4
    llama.Model(out).close()


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_every_type_in_process(tiny_f16: Path, tmp_path: Path, qtype: str) -> None:
    # llama.cpp itself, without the child process (milliseconds each on the tiny model)
    out = tmp_path / f"tiny-{qtype}.gguf"
    llama.quantize_file(tiny_f16, out, qtype.lower(), n_threads=1)
    info = gguf.read(out)
    assert info.quantization == qtype
    if qtype not in ("F16", "BF16"):
        assert info.file_size < tiny_f16.stat().st_size * 0.6
    llama.Model(out).close()


def test_k_quant_dims() -> None:
    # every matrix row (embedding or FFN width) is a whole number of 256-element K-quant blocks
    assert N_EMBD % 256 == 0
    assert N_FF % 256 == 0


def test_type_names_match_engine() -> None:
    assert set(QUANT_TYPES) == set(llama.QUANT_FTYPES)
    assert {"Q4_K_M", "Q4_0", "Q5_K_M", "Q8_0", "Q6_K", "Q4_K_S", "Q5_0", "Q5_1", "Q2_K",
            "Q3_K_M", "F16", "BF16"} <= set(QUANT_TYPES)


def test_unknown_type(tiny_f16: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match=r"unknown quantization type 'Q9_X'.*Q4_K_M"):
        quantize(tiny_f16, "Q9_X", tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(llama.LlamaError, match=r"unknown quantization type 'iq2_xs'.*Q8_0"):
        llama.quantize_file(tiny_f16, tmp_path / "x.gguf", "iq2_xs")
    assert list(tmp_path.iterdir()) == []


def test_refuses_quantized_input(tiny_q8: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match=r"already quantized \(Q8_0\)"):
        quantize(tiny_q8, "Q4_K_M", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_names_quantized_tensors_without_file_type(tmp_path: Path) -> None:
    q4 = gguf_writer.GGMLQuantizationType.Q4_0
    w = gguf_writer.GGUFWriter(str(tmp_path / "m.gguf"), "llama")  # no general.file_type
    data = np.zeros((4, 64), dtype=np.float32)
    w.add_tensor("blk.0.attn_q.weight", gguf_writer.quants.quantize(data, q4), raw_dtype=q4)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = gguf.read(tmp_path / "m.gguf")
    assert info.quantization == "unknown"
    assert source_quantization(info) == "Q4_0"
    with pytest.raises(QuantizeError, match=r"already quantized \(Q4_0\)"):
        quantize(tmp_path / "m.gguf", "Q8_0", tmp_path / "out")


@pytest.mark.parametrize("content", [b"", b"not a model at all, just some text\n" * 4,
                                     b"GGUF\x03\x00\x00\x00" + b"\xff" * 16])
def test_refuses_non_gguf(tmp_path: Path, content: bytes) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(QuantizeError, match=r"cannot quantize model\.gguf: "):
        quantize(src, "Q8_0", out)
    assert not out.exists() or list(out.iterdir()) == []


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="cannot read"):
        quantize(tmp_path / "nope.gguf", "Q8_0", tmp_path)


def test_llama_cpp_failure_is_reported_and_cleaned_up(tmp_path: Path) -> None:
    # passes llmrun's checks (a well-formed F16 GGUF) but llama.cpp refuses it
    src = tmp_path / "odd.gguf"
    w = gguf_writer.GGUFWriter(str(src), "nonesuch")
    w.add_file_type(gguf_writer.LlamaFileType.MOSTLY_F16)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    with pytest.raises(QuantizeError) as err:
        quantize(src, "Q8_0", out)
    msg = str(err.value)
    assert msg.startswith("quantizing odd.gguf to Q8_0 failed: the quantizer exited with status 1")
    assert "unknown model architecture: 'nonesuch'" in msg  # the tail of llama.cpp's log
    assert list(out.iterdir()) == []


def fake_quantizer(tmp_path: Path, body: str) -> str:
    """A stand-in for `python -m llmrun.store.quantize` (the parent runs sys.executable)."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_crash_is_reported_and_cleaned_up(tiny_f16: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", fake_quantizer(
        tmp_path, 'echo "[   1/  12] output.weight"\n'
                  'echo "ggml.c:1234: GGML_ASSERT(ok) failed" >&2\n'
                  ': > "$4"\nkill -ABRT $$'))
    out = tmp_path / "out"
    with pytest.raises(QuantizeError, match=r"(?s)crashed \(SIGABRT\).*GGML_ASSERT\(ok\) failed"):
        quantize(tiny_f16, "Q8_0", out)
    assert list(out.iterdir()) == []


def test_cancel_kills_the_child(tiny_f16: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", fake_quantizer(tmp_path, "exec sleep 60"))
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    out = tmp_path / "out"
    start = time.monotonic()
    with pytest.raises(QuantizeError, match="was cancelled"):
        quantize(tiny_f16, "Q8_0", out, cancel=cancel)
    assert time.monotonic() - start < 30  # killed, not waited for (it sleeps 60 s)
    assert list(out.iterdir()) == []


@pytest.mark.timeout(60)
def test_failing_progress_callback_does_not_stall(tiny_f16: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # far more log than a pipe buffer holds: the log must keep being drained
    monkeypatch.setattr(sys, "executable", fake_quantizer(
        tmp_path, 'i=0; while [ $i -lt 20000 ]; do i=$((i+1)); echo "[ $i/20000] t"; done\n'
                  'cp "$3" "$4"'))
    calls = []

    def progress(i: int, n: int) -> None:
        calls.append(i)
        raise RuntimeError("callback bug")

    out = quantize(tiny_f16, "Q8_0", tmp_path / "out", progress=progress)
    assert calls == [1]
    assert out.stat().st_size == tiny_f16.stat().st_size


def test_child_usage() -> None:
    assert main([]) == 2


def test_create_with_quantize(tmp_path: Path) -> None:
    from llmrun.store import Store

    src = write_tiny_llama(tmp_path / "tiny-f16.gguf")
    store = Store(tmp_path / "home")
    m = store.create("tiny-q8", f"FROM {src}\n", quantize="q8_0")
    assert m.details.quantization_level == "Q8_0"
    assert m.size < src.stat().st_size
    # only the quantized file stays: the F16 import was used once and dropped
    blobs = [p for p in store.blobs.root.iterdir() if p.name.startswith("sha256-")]
    assert [p.name for p in blobs] == [m.model.digest.replace(":", "-")]
    with pytest.raises(CreateError, match="already quantized"):
        store.create("again", "FROM tiny-q8\n", quantize="Q4_0")
