"""Read and validate a GGUF file's header before llama.cpp ever sees it.

Model files are untrusted input: llama.cpp's own loader has had heap overflows on crafted
headers. This reader walks the whole header with hard limits (string lengths, element counts,
dimensions), checks every tensor's data lies inside the file, and keeps the scalar metadata
(architecture, context length, chat template, ...) for `show` and the scheduler. Large arrays
(the tokenizer's vocabulary) are walked but not kept.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from llmrun.media import SOUND_PIECE_SECONDS

MAGIC = b"GGUF"
MAX_STRING = 1 << 24  # 16 MiB: chat templates are a few KiB, nothing legitimate comes close
MAX_ARRAY = 1 << 24
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 4
KEEP_ARRAY = 64  # arrays up to this length are kept in metadata

# GGUF metadata value types
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9

# ggml tensor types: (elements per block, bytes per block), from ggml.c's type traits
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}

# general.file_type values, for naming a file's quantization
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


PROJECTOR_ARCHITECTURE = "clip"


class GGUFError(ValueError):
    """The file is not a GGUF model llmrun is willing to hand to llama.cpp."""


@dataclass
class ArraySummary:
    """A metadata array too long to keep: its element type and length."""

    type: int
    length: int


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    nbytes: int


@dataclass
class GGUFInfo:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0
    file_size: int = 0

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @property
    def is_projector(self) -> bool:
        """A vision projector (mmproj): llama.cpp's converters give every one, whatever
        the model it serves, the architecture `clip`; a file's name proves nothing."""
        return self.architecture == PROJECTOR_ARCHITECTURE

    @property
    def modalities(self) -> list[str]:
        """What a projector encodes, as its GGUF says (`clip.has_vision_encoder`,
        `clip.has_audio_encoder`): "vision", "audio" or both. A projector that says
        neither is a LLaVA-era vision one (written before the keys existed)."""
        if not self.is_projector:
            return []
        out = [kind for kind, key in (("vision", "clip.has_vision_encoder"),
                                      ("audio", "clip.has_audio_encoder"))
               if self.metadata.get(key)]
        return out or ["vision"]

    @property
    def sound_piece_seconds(self) -> float | None:
        """The length of sound this projector encodes on its own (media.SOUND_PIECE_SECONDS,
        by its audio projector's type); None: it reads a sound whole."""
        if "audio" not in self.modalities:
            return None
        kind = self.metadata.get("clip.audio.projector_type") \
            or self.metadata.get("clip.projector_type")
        return SOUND_PIECE_SECONDS.get(str(kind))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def context_length(self) -> int | None:
        value = self.arch_value("context_length")
        return int(value) if isinstance(value, int) else None

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def parameter_count(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total

    @property
    def quantization(self) -> str:
        ft = self.metadata.get("general.file_type")
        if isinstance(ft, int) and ft in FILE_TYPES:
            return FILE_TYPES[ft]
        return "unknown"


class _Reader:
    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh = fh
        self.size = size

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise GGUFError("file ends inside the header (truncated?)")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def skip(self, n: int) -> None:
        if self.fh.tell() + n > self.size:
            raise GGUFError("file ends inside the header (truncated?)")
        self.fh.seek(n, 1)

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > MAX_STRING:
            raise GGUFError(f"string of {n} bytes exceeds the limit of {MAX_STRING}")
        try:
            return self.read(n).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError("metadata string is not valid UTF-8") from exc

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth > 0:
                raise GGUFError("nested metadata arrays are not supported")
            etype = self.unpack("<I")
            n = self.unpack("<Q")
            if n > MAX_ARRAY:
                raise GGUFError(f"metadata array of {n} elements exceeds the limit")
            if etype not in _SCALARS and etype not in (_STRING, _ARRAY):
                raise GGUFError(f"unknown metadata array element type {etype}")
            if n <= KEEP_ARRAY:
                return [self.value(etype, depth + 1) for _ in range(n)]
            if etype in _SCALARS:
                self.skip(n * struct.calcsize(_SCALARS[etype]))
            else:
                for _ in range(n):
                    self.value(etype, depth + 1)
            return ArraySummary(etype, n)
        raise GGUFError(f"unknown metadata value type {vtype}")


def read(path: Path) -> GGUFInfo:
    """Parse and validate `path`; raise GGUFError with a reason a person can act on."""
    try:
        size = path.stat().st_size
        fh = open(path, "rb")  # noqa: SIM115 (closed by the `with fh` below)
    except OSError as exc:
        raise GGUFError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with fh:
        r = _Reader(fh, size)
        if size < 24 or fh.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"unsupported GGUF version {version} (llmrun reads versions 2 and 3)")
        n_tensors = r.unpack("<Q")
        n_kv = r.unpack("<Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise GGUFError(f"implausible header: {n_tensors} tensors, {n_kv} metadata entries")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.unpack("<I"))
        tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if not 0 < n_dims <= MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            ttype = r.unpack("<I")
            offset = r.unpack("<Q")
            if ttype not in GGML_TYPES:
                raise GGUFError(f"tensor {name!r} has unknown type {ttype}")
            _, block, type_size = GGML_TYPES[ttype]
            elements = 1
            for d in shape:
                if d == 0 or d > 1 << 40:
                    raise GGUFError(f"tensor {name!r} has an invalid dimension {d}")
                elements *= d
            if shape[0] % block:
                raise GGUFError(f"tensor {name!r}: row of {shape[0]} is not a multiple of {block}")
            tensors.append(TensorInfo(name, shape, ttype, offset, elements // block * type_size))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"invalid general.alignment {alignment!r}")
        pos = fh.tell()
        data_offset = (pos + alignment - 1) // alignment * alignment
        for t in tensors:
            if t.offset % alignment:
                raise GGUFError(f"tensor {t.name!r} is not aligned to {alignment} bytes")
            if data_offset + t.offset + t.nbytes > size:
                raise GGUFError(
                    f"tensor {t.name!r} extends past the end of the file (truncated download?)"
                )
        if not tensors and "split.count" not in metadata:
            raise GGUFError(f"{path} holds no tensors")
        return GGUFInfo(version, metadata, tensors, data_offset, size)
