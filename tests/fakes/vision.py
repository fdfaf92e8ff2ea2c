"""Vision test fixtures: a tiny random-weight LLaVA-1.5-style projector and test images.

The projector is a real CLIP GGUF that llama.cpp's multimodal library (mtmd) loads beside the
SmolLM2-135M test model: a 2-layer, 64-wide ViT over 32 x 32 images in 8 x 8 patches (16 image
tokens), then the LLaVA-1.5 MLP projector (mm.0, GELU, mm.2) up to the text model's width.
Random weights from a seed, so embeddings are deterministic but meaningless; about 1 MB.

    from tests.fakes.vision import write_projector, image
    mmproj = write_projector(tmp_path / "mmproj.gguf")  # n_embd=576 matches SmolLM2-135M
    png = image(1)  # 32 x 32 random pixels

Key and tensor names follow llama.cpp's tools/mtmd/clip-impl.h (KEY_*, TN_*); what is
required comes from clip.cpp (load_hparams, load_tensors) and models/llava.cpp (the graph).
"""

from __future__ import annotations

import io
import struct
import zlib
from functools import cache
from pathlib import Path

import gguf
import numpy as np
from PIL import Image

from tests.fakes.clip import encoder_blocks, write_out

IMAGE_SIZE = 32
PATCH_SIZE = 8
N_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16: the MLP projector keeps every patch
V_EMBD = 64  # vision tower width
V_FF = 128  # != V_EMBD, else clip.cpp takes ffn_up/ffn_down for a legacy swapped pair
V_HEAD = 4
V_LAYER = 2  # llava uses the second-to-last layer's output, so only layer 0 is computed
EPS = 1e-5
# OpenAI CLIP's normalisation, as LLaVA-1.5's converter writes it
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

BOMB_SIDE = 20_000


def write_projector(path: Path, *, n_embd: int = 576, seed: int = 0) -> Path:
    """Write a LLaVA-1.5-style CLIP projector GGUF to `path` whose image embeddings are
    `n_embd` wide (576 for SmolLM2-135M; anything else must be refused beside that model).
    Deterministic from `seed`; matrices in F16, norms, biases and embeddings in F32."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        # numpy (rows, cols) is GGUF ne = [cols, rows]. A small scale keeps every
        # activation near unit size (layer norms rescale anyway), so nothing overflows F16.
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def vector(n: int) -> np.ndarray:  # biases and embeddings
        return rng.standard_normal(n, dtype=np.float32) * 0.02

    def ones(n: int) -> np.ndarray:  # a layer norm's weight
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:  # its bias
        return np.zeros(n, dtype=np.float32)

    w = gguf.GGUFWriter(str(path), "clip")  # general.architecture = clip
    w.add_name("tiny-llava-mmproj")
    w.add_description("random-weight LLaVA-1.5-style projector for tests")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # "mlp" selects LLaVA-1.5's graph (models/llava.cpp); without has_vision_encoder the
    # loader finds no modality and mtmd_init_from_file fails
    w.add_string("clip.projector_type", "mlp")
    w.add_bool("clip.has_vision_encoder", True)
    # Legacy keys LLaVA-1.5 converters write; llama.cpp ignores them, kept for realism
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_llava_projector", True)
    # Required by load_hparams (head_dim and head_count_kv are optional, derived)
    w.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    w.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    w.add_uint32("clip.vision.embedding_length", V_EMBD)
    w.add_uint32("clip.vision.feed_forward_length", V_FF)
    w.add_uint32("clip.vision.projection_dim", n_embd)
    w.add_uint32("clip.vision.attention.head_count", V_HEAD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", EPS)
    w.add_uint32("clip.vision.block_count", V_LAYER)
    # Optional keys, but load_hparams throws unless each has at least 3 values
    w.add_array("clip.vision.image_mean", IMAGE_MEAN)
    w.add_array("clip.vision.image_std", IMAGE_STD)
    # No clip.use_gelu / use_silu: the FFN uses quick-GELU, as OpenAI CLIP does

    # Embeddings. The patch embedding is a conv kernel (out, in, kh, kw), so GGUF ne is
    # [kw, kh, 3, V_EMBD]. The class embedding is optional in llava's graph but LLaVA-1.5
    # has one: positions then cover 1 + 16 slots, and the projector skips the class slot.
    w.add_tensor("v.class_embd", vector(V_EMBD))
    w.add_tensor("v.patch_embd.weight", weight(V_EMBD, 3, PATCH_SIZE, PATCH_SIZE))
    # Required in practice: build_llava adds get_rows(position_embd) unconditionally
    w.add_tensor("v.position_embd.weight",
                 rng.standard_normal((N_IMAGE_TOKENS + 1, V_EMBD), dtype=np.float32) * 0.02)
    w.add_tensor("v.pre_ln.weight", ones(V_EMBD))  # optional, CLIP has it
    w.add_tensor("v.pre_ln.bias", zeros(V_EMBD))
    # No v.post_ln: LLaVA takes the second-to-last layer, before any post-layernorm

    # q/k/v are optional to the loader but the graph multiplies by them; attn_out is
    # required
    encoder_blocks(w, "v", V_LAYER, V_EMBD, V_FF, weight, vector)

    # LLaVA-1.5 projector: Linear(V_EMBD, n_embd), GELU, Linear(n_embd, n_embd). Both biases
    # are required by the graph; mm.2's rows (ne[1]) are the width mtmd checks against the
    # text model's n_embd. A larger scale on mm.2 gives embeddings of a plausible size.
    w.add_tensor("mm.0.weight", weight(n_embd, V_EMBD))
    w.add_tensor("mm.0.bias", vector(n_embd))
    w.add_tensor("mm.2.weight", (rng.standard_normal((n_embd, n_embd), dtype=np.float32)
                                 * 0.05).astype(np.float16))
    w.add_tensor("mm.2.bias", vector(n_embd))

    write_out(w)
    return path


def image(seed: int, size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE), fmt: str = "PNG") -> bytes:
    """An RGB image file of random pixels from `seed` (width, height = `size`) in Pillow's
    format `fmt` ("PNG", "JPEG", "WEBP", ...). Same seed, same bytes."""
    width, height = size
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)  # (h, w, 3) uint8 is RGB
    return buf.getvalue()


def truncated_png() -> bytes:
    """A 64 x 64 PNG cut in the middle of its pixel data: the header opens, decoding fails.
    Random pixels do not compress, so the IDAT is long and the cut lands well inside it."""
    data = image(7, (64, 64))
    idat = data.index(b"IDAT")
    return data[:idat + (len(data) - idat) // 2]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))


@cache  # compressing 50 MB of zero rows takes a moment; do it once per process
def bomb_png() -> bytes:
    """A complete, valid 1-bit greyscale PNG of BOMB_SIDE x BOMB_SIDE black pixels in under
    50 KB: a decompression bomb (400 Mpx, 1.2 GB as RGB) that only a size check before
    decoding stops. Pillow's own open() refuses it unless Image.MAX_IMAGE_PIXELS is raised."""
    row = b"\x00" * (1 + (BOMB_SIDE + 7) // 8)  # filter byte "none", then the packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(BOMB_SIDE)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", BOMB_SIDE, BOMB_SIDE, 1, 0, 0, 0, 0)  # 1-bit grey
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat)
            + _chunk(b"IEND", b""))


def not_image() -> bytes:
    """Bytes no image decoder recognises (text with a NUL, no known magic number)."""
    return b"this is not an image, just some text\x00\x01\x02 that no decoder knows\n" * 4
