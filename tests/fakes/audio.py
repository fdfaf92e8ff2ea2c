"""Audio test fixtures: a tiny random-weight Qwen3-ASR-style audio projector and test sounds.

The projector is a real CLIP GGUF with an audio encoder (`clip.has_audio_encoder`,
projector type `qwen3a`) that llama.cpp's multimodal library (mtmd) loads beside the
SmolLM2-135M test model. Qwen3-ASR's is the simplest audio graph to synthesise whose token
count stays small: the mel spectrogram (16 kHz, 10 ms hop) is cut into 100-frame chunks, each
goes through three stride-2 3x3 convolutions (100 frames -> 13 positions), a linear layer to
the encoder's width, a 2-layer pre-norm transformer and a 2-layer GELU MLP up to the text
model's width. So one second of sound is 26 positions (Whisper-style projectors pad every
clip to 30 s: 750 or 1500). Random weights from a seed: embeddings are deterministic but
meaningless; about 100 KB.

    from tests.fakes.audio import write_projector, wav, sine
    mmproj = write_projector(tmp_path / "mmproj-audio.gguf")  # n_embd=576: SmolLM2-135M
    data = wav(sine(440.0, 1.0))  # a 1 s 440 Hz tone as 16-bit mono PCM WAV

Key and tensor names follow llama.cpp's tools/mtmd/clip-impl.h (KEY_*, TN_*); what is
required comes from clip.cpp (load_hparams, load_tensors: PROJECTOR_TYPE_QWEN3A) and
models/qwen3a.cpp (the graph); the preprocessing is mtmd-audio.cpp's qwen3a preprocessor.

The sound generators write what a client would send: WAV files (16-bit PCM, any rate), and
the hostile ones a server must refuse before decoding them (a truncated file, a header that
claims 384 kHz, a header that claims two hours).
"""

from __future__ import annotations

import io
import struct
import wave
from pathlib import Path

import gguf
import numpy as np

from tests.fakes.clip import encoder_blocks, write_out

SAMPLE_RATE = 16_000  # what the qwen3a preprocessor expects (clip.cpp sets it, not the GGUF)
N_MEL = 16  # mel bins (real Qwen3-ASR: 128); the filterbank is computed for any count
CONV_CH = 4  # channels of the three convolutions (real: 480)
A_EMBD = 64  # encoder width (real: 1024)
A_FF = 128
A_HEAD = 4
A_LAYER = 2
TOKENS_PER_CHUNK = 13  # 100 mel frames (1 s of sound) -> 13 positions, fixed by the graph
EPS = 1e-5


def write_projector(path: Path, *, n_embd: int = 576, seed: int = 0) -> Path:
    """Write a Qwen3-ASR-style audio projector GGUF to `path` whose embeddings are `n_embd`
    wide (576 for SmolLM2-135M). Deterministic from `seed`; all tensors F32 (tiny)."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.02) -> np.ndarray:
        # numpy (rows, cols) is GGUF ne = [cols, rows]; a conv kernel (out, in, kh, kw) is
        # ne = [kw, kh, in, out], as ggml_conv_2d reads it
        return rng.standard_normal(shape, dtype=np.float32) * scale

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "clip")  # general.architecture = clip
    w.add_name("tiny-qwen3a-mmproj")
    w.add_description("random-weight Qwen3-ASR-style audio projector for tests")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # What tells a projector's modality: has_audio_encoder (and no vision encoder)
    w.add_string("clip.projector_type", "qwen3a")
    w.add_bool("clip.has_vision_encoder", False)
    w.add_bool("clip.has_audio_encoder", True)
    # Required by load_hparams for the "audio" prefix
    w.add_uint32("clip.audio.embedding_length", A_EMBD)
    w.add_uint32("clip.audio.feed_forward_length", A_FF)
    w.add_uint32("clip.audio.projection_dim", n_embd)
    w.add_uint32("clip.audio.attention.head_count", A_HEAD)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", EPS)
    w.add_uint32("clip.audio.block_count", A_LAYER)
    w.add_uint32("clip.audio.num_mel_bins", N_MEL)

    # Front end: three 3x3 stride-2 convolutions (GELU after each): [100, N_MEL] per chunk
    # -> [13, N_MEL / 8] x CONV_CH, flattened and projected to A_EMBD by conv_out (no bias)
    w.add_tensor("a.conv2d.1.weight", weight(CONV_CH, 1, 3, 3, scale=0.3))
    w.add_tensor("a.conv2d.1.bias", weight(CONV_CH))
    for i in (2, 3):
        w.add_tensor(f"a.conv2d.{i}.weight", weight(CONV_CH, CONV_CH, 3, 3, scale=0.3))
        w.add_tensor(f"a.conv2d.{i}.bias", weight(CONV_CH))
    w.add_tensor("a.conv_out.weight", weight(A_EMBD, CONV_CH * (N_MEL // 8), scale=0.3))
    # Positions restart in each 100-frame chunk: 13 rows are read
    w.add_tensor("a.position_embd.weight", weight(TOKENS_PER_CHUNK, A_EMBD))

    encoder_blocks(w, "a", A_LAYER, A_EMBD, A_FF, weight, weight)
    w.add_tensor("a.post_ln.weight", ones(A_EMBD))
    w.add_tensor("a.post_ln.bias", zeros(A_EMBD))

    # The projector: Linear(A_EMBD, n_embd), GELU, Linear(n_embd, n_embd). mm.a.mlp.2's rows
    # (ne[1]) are the width mtmd checks against the text model's n_embd. A larger scale on
    # the last layer gives embeddings of a plausible size.
    w.add_tensor("mm.a.mlp.1.weight", weight(n_embd, A_EMBD, scale=0.1))
    w.add_tensor("mm.a.mlp.1.bias", weight(n_embd))
    w.add_tensor("mm.a.mlp.2.weight", weight(n_embd, n_embd, scale=0.05))
    w.add_tensor("mm.a.mlp.2.bias", weight(n_embd))

    write_out(w)
    return path


def n_positions(seconds: float) -> int:
    """Positions the projector gives `seconds` of sound at 16 kHz: 13 per started 100-frame
    chunk of the (n_samples / 160 + 1)-frame spectrogram, in windows of 800 frames."""
    frames = int(seconds * SAMPLE_RATE) // 160 + 1
    return sum(-(-min(800, frames - off) // 100) for off in range(0, frames, 800)) \
        * TOKENS_PER_CHUNK


# -- sounds ----------------------------------------------------------------------------------


def sine(freq: float, seconds: float, rate: int = SAMPLE_RATE, amp: float = 0.5) -> np.ndarray:
    """A tone as float samples in [-1, 1]."""
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def silence(seconds: float, rate: int = SAMPLE_RATE) -> np.ndarray:
    return np.zeros(int(seconds * rate), dtype=np.float32)


def noise(seconds: float, seed: int = 0, rate: int = SAMPLE_RATE) -> np.ndarray:
    """White noise from `seed` (same seed, same samples)."""
    rng = np.random.default_rng(seed)
    return (rng.uniform(-0.5, 0.5, int(seconds * rate))).astype(np.float32)


def wav(samples: np.ndarray, rate: int = SAMPLE_RATE, channels: int = 1) -> bytes:
    """`samples` (float, [-1, 1]; interleaved when `channels` > 1) as a 16-bit PCM WAV file."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm)
    return buf.getvalue()


def pcm16(samples: np.ndarray) -> bytes:
    """Raw little-endian 16-bit PCM (what OpenAI's Realtime API streams), no header."""
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def truncated_wav() -> bytes:
    """A 1 s WAV cut in the middle of its samples: the header promises more data than the
    file holds."""
    data = wav(noise(1.0, seed=3))
    return data[: len(data) // 2]


def _header(rate: int, n_bytes: int, channels: int = 1, bits: int = 16) -> bytes:
    """A canonical 44-byte RIFF/WAVE PCM header declaring `n_bytes` of sample data."""
    block = channels * bits // 8
    return (b"RIFF" + struct.pack("<I", 36 + n_bytes) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * block, block, bits)
            + b"data" + struct.pack("<I", n_bytes))


def wav_384khz() -> bytes:
    """A short WAV whose header says 384,000 samples a second (beyond any speech model's
    rate: a resampler asked to bring it down would do 24 times the work)."""
    pcm = pcm16(noise(0.1, seed=4, rate=384_000))
    return _header(384_000, len(pcm)) + pcm


def wav_long_header(hours: float = 2.0) -> bytes:
    """A small file whose header declares `hours` of 16 kHz sound (the data chunk's size),
    followed by one second of it: the duration must be read from the header and refused,
    not discovered by decoding."""
    declared = int(hours * 3600 * SAMPLE_RATE) * 2
    return _header(SAMPLE_RATE, declared) + pcm16(noise(1.0, seed=5))


def mp3_bomb(seconds: float = 1500.0) -> bytes:
    """A valid MP3 stream of the smallest frames there are (MPEG-2.5 layer III, 8 kbit/s,
    8 kHz mono: 72 bytes for 72 ms) adding up to `seconds`: about a megabyte that decodes
    to 25 minutes (48 MB of float samples at 16 kHz). Only walking the frames' headers
    before decoding finds how long it is; MP3 has no header for the whole file."""
    header = bytes((0xFF, 0xE3, 0x18, 0xC0))  # sync, 2.5, layer III, no CRC; 8 kbps, 8 kHz
    frame = header + bytes(72 - len(header))
    return frame * max(1, round(seconds / 0.072))


def not_audio() -> bytes:
    """Bytes no audio decoder recognises."""
    return b"this is not a sound, just some text\x00\x01\x02 that no decoder knows\n" * 8


# -- hand-built headers: what a decoder believes and a length check must not miss ----------


def riff(fmt: bytes, samples: bytes, before_data: bytes = b"") -> bytes:
    """A RIFF/WAVE file of the format chunk body `fmt` and the data chunk `samples`, with
    `before_data` (whole chunks) between them."""
    body = (b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + before_data
            + b"data" + struct.pack("<I", len(samples)) + samples)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def fmt_chunk(tag: int, channels: int, rate: int, bits: int, block: int | None = None,
              byte_rate: int | None = None) -> bytes:
    """A 16-byte format chunk body; the block alignment and byte rate are the coding's own
    unless given."""
    block = channels * bits // 8 if block is None else block
    return struct.pack("<HHIIHH", tag, channels, rate,
                       rate * block if byte_rate is None else byte_rate, block, bits)


def extensible(sub: int, channels: int, rate: int, bits: int) -> bytes:
    """A WAVE_FORMAT_EXTENSIBLE format chunk body whose subformat is the GUID of tag `sub`
    (KSDATAFORMAT_SUBTYPE_PCM is sub 1)."""
    return (fmt_chunk(0xFFFE, channels, rate, bits) + struct.pack("<HHI", 22, bits, 4)
            + struct.pack("<H", sub) + bytes.fromhex("0000000010008000" "00aa00389b71"))


def adpcm_wav(n_bytes: int = 80_000, block: int = 65_535) -> bytes:
    """An MS ADPCM WAV (format 2) whose block alignment says its `n_bytes` hold a fraction
    of a block (0.15 ms at data / block / rate): miniaudio's dr_wav decodes about two
    samples a byte (80 KB: 20 s at 8 kHz), whatever the alignment says."""
    return riff(fmt_chunk(2, 1, 8_000, 4, block=block, byte_rate=4_000) + b"\0\0",
                bytes(n_bytes))


# MPEG-1 layer III, no CRC, 32 kbit/s, 48 kHz, mono: 96 bytes for 24 ms (1152 samples)
MP3_FRAME_48K = bytes((0xFF, 0xFB, 0x14, 0xC0)) + bytes(92)


def mp3_resync_bomb(seconds: float = 1500.0) -> bytes:
    """One frame, a junk byte, then frames adding up to `seconds` (about 6 MB for 25 min):
    a walk that stops at the junk reads 24 ms; a decoder scans past it and decodes them
    all."""
    return MP3_FRAME_48K + b"\0" + MP3_FRAME_48K * round(seconds / 0.024)


def xing_frame(count: int, frame: bytes = MP3_FRAME_48K) -> bytes:
    """`frame` (MPEG-1 mono: 17 bytes of side information) holding a Xing tag that says the
    stream has `count` frames: dr_mp3 makes that many frames' worth of samples."""
    return frame[:21] + b"Xing" + struct.pack(">II", 1, count) + frame[33:]
