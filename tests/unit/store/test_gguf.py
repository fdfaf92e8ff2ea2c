"""llmrun.store.gguf.read: metadata of well-formed files, clear refusals of malformed ones."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf as gguf_writer
import numpy as np
import pytest

from llmrun.store import gguf
from llmrun.store.gguf import GGUFError, read

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
KEY_LEN_AT = 24  # magic (4) + version (4) + tensor count (8) + metadata count (8)


def write_gguf(path: Path, *, arch: str = "llama", context_length: int | None = 2048,
               chat_template: str | None = TEMPLATE, file_type: int | None = 0,
               tensors: dict[str, np.ndarray] | None = None) -> Path:
    w = gguf_writer.GGUFWriter(str(path), arch)
    if context_length is not None:
        w.add_context_length(context_length)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if file_type is not None:
        w.add_file_type(file_type)
    if tensors is None:
        tensors = {
            "token_embd.weight": np.zeros((4, 8), dtype=np.float32),
            "output_norm.weight": np.ones(8, dtype=np.float32),
            "output.weight": np.arange(24, dtype=np.float32).reshape(3, 8),
        }
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "model.gguf")


def test_reads_metadata(model: Path) -> None:
    info = read(model)
    assert info.version == 3
    assert info.metadata == {
        "general.architecture": "llama",
        "llama.context_length": 2048,
        "tokenizer.chat_template": TEMPLATE,
        "general.file_type": 0,
    }
    assert info.architecture == "llama"
    assert info.context_length == 2048
    assert info.arch_value("context_length") == 2048
    assert info.chat_template == TEMPLATE
    assert info.quantization == "F32"
    assert info.file_size == model.stat().st_size


def test_tensors(model: Path) -> None:
    info = read(model)
    assert len(info.tensors) == 3
    assert [t.name for t in info.tensors] == ["token_embd.weight", "output_norm.weight",
                                             "output.weight"]
    assert info.parameter_count == 4 * 8 + 8 + 3 * 8
    by_name = {t.name: t for t in info.tensors}
    # GGUF stores dimensions innermost first
    assert by_name["token_embd.weight"].shape == (8, 4)
    assert by_name["output_norm.weight"].shape == (8,)
    assert all(t.type == 0 for t in info.tensors)
    assert by_name["token_embd.weight"].nbytes == 4 * 8 * 4
    assert info.data_offset % 32 == 0
    last = max(info.tensors, key=lambda t: t.offset)
    assert info.data_offset + last.offset + last.nbytes <= info.file_size


def test_other_architecture_and_missing_optional_keys(tmp_path: Path) -> None:
    info = read(write_gguf(tmp_path / "m.gguf", arch="qwen2", context_length=None,
                           chat_template=None, file_type=None))
    assert info.architecture == "qwen2"
    assert info.context_length is None
    assert info.chat_template is None
    assert info.quantization == "unknown"
    assert info.parameter_count == 4 * 8 + 8 + 3 * 8


def test_long_arrays_are_summarised(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf_writer.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(100)])
    w.add_array("short.list", [1, 2, 3])
    w.add_tensor("w", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    info = read(path)
    tokens = info.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf.ArraySummary)
    assert (tokens.type, tokens.length) == (8, 100)
    assert info.metadata["short.list"] == [1, 2, 3]


# -- malformed files ------------------------------------------------------------------------


def _refused(path: Path) -> str:
    with pytest.raises(GGUFError) as exc:
        read(path)
    return str(exc.value)


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "random.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert _refused(path) == f"{path} is not a GGUF file (bad magic)"


def test_text_file(tmp_path: Path) -> None:
    path = tmp_path / "README.md"
    path.write_text("# Not a model\n\nThis is a text file that is long enough.\n")
    assert _refused(path) == f"{path} is not a GGUF file (bad magic)"


def test_wrong_magic(model: Path) -> None:
    data = bytearray(model.read_bytes())
    data[:4] = b"GGML"
    model.write_bytes(bytes(data))
    assert "not a GGUF file (bad magic)" in _refused(model)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert _refused(path) == f"{path} is not a GGUF file (bad magic)"


def test_nonexistent_path(tmp_path: Path) -> None:
    path = tmp_path / "missing.gguf"
    assert _refused(path) == f"cannot read {path}: No such file or directory"


def test_directory(tmp_path: Path) -> None:
    assert _refused(tmp_path).startswith(f"cannot read {tmp_path}: ")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_version(model: Path, version: int) -> None:
    data = bytearray(model.read_bytes())
    data[4:8] = struct.pack("<I", version)
    model.write_bytes(bytes(data))
    assert _refused(model) == (
        f"unsupported GGUF version {version} (llmrun reads versions 2 and 3)"
    )


def test_truncated_in_header(model: Path) -> None:
    data = model.read_bytes()
    info = read(model)
    for cut in (40, 100, info.data_offset - 40):
        model.write_bytes(data[:cut])
        assert _refused(model) == "file ends inside the header (truncated?)", cut


def test_truncated_in_tensor_data(model: Path) -> None:
    data = model.read_bytes()
    info = read(model)
    last = info.tensors[-1]
    assert last.name == "output.weight"
    model.write_bytes(data[: info.data_offset + last.offset + last.nbytes // 2])
    assert _refused(model) == (
        "tensor 'output.weight' extends past the end of the file (truncated download?)"
    )
    model.write_bytes(data[: info.data_offset + 40])
    assert _refused(model) == (
        "tensor 'token_embd.weight' extends past the end of the file (truncated download?)"
    )


def test_one_byte_short(model: Path) -> None:
    data = model.read_bytes()
    model.write_bytes(data[:-1])
    assert "extends past the end of the file" in _refused(model)


def test_tensor_offset_past_end(model: Path) -> None:
    data = bytearray(model.read_bytes())
    # the last tensor's info ends with its 8-byte offset, just before the aligned data
    name = b"output.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8 + 4
    assert struct.unpack_from("<Q", data, at)[0] == read(model).tensors[2].offset
    struct.pack_into("<Q", data, at, 1 << 30)
    model.write_bytes(bytes(data))
    assert _refused(model) == (
        "tensor 'output.weight' extends past the end of the file (truncated download?)"
    )


def test_absurd_key_length(model: Path) -> None:
    data = bytearray(model.read_bytes())
    assert struct.unpack_from("<Q", data, KEY_LEN_AT)[0] == len("general.architecture")
    struct.pack_into("<Q", data, KEY_LEN_AT, 2**40)
    model.write_bytes(bytes(data))
    assert _refused(model) == f"string of {2**40} bytes exceeds the limit of {1 << 24}"


def test_implausible_counts(model: Path) -> None:
    data = bytearray(model.read_bytes())
    struct.pack_into("<Q", data, 8, 2**62)
    model.write_bytes(bytes(data))
    assert _refused(model).startswith(f"implausible header: {2**62} tensors")


def test_unknown_value_type(model: Path) -> None:
    data = bytearray(model.read_bytes())
    at = KEY_LEN_AT + 8 + len("general.architecture")
    assert struct.unpack_from("<I", data, at)[0] == 8  # a string
    struct.pack_into("<I", data, at, 99)
    model.write_bytes(bytes(data))
    assert _refused(model) == "unknown metadata value type 99"


def test_invalid_utf8_string(model: Path) -> None:
    data = bytearray(model.read_bytes())
    at = KEY_LEN_AT + 8
    data[at] = 0xFF
    model.write_bytes(bytes(data))
    assert _refused(model) == "metadata string is not valid UTF-8"


def test_no_tensors(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "empty-model.gguf", tensors={})
    assert _refused(path) == f"{path} holds no tensors"
