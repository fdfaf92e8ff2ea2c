"""The llama.cpp the engine runs is the build scripts/llama-wheel.sh made: AMX off, and
llmrun's patches to llama.cpp (scripts/llama-patches) applied, the ones in this checkout."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import subprocess
from pathlib import Path

import pytest

from llmrun.engine.llama import Batch, Context, Model

pytestmark = pytest.mark.model  # needs the installed llama-cpp-python

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_llama_cpp_is_the_safe_build_with_this_checkouts_patches() -> None:
    dist = md.distribution("llama-cpp-python")
    marker = Path(dist.locate_file("llama_cpp/.llmrun-safe-build"))
    assert marker.exists(), "llama-cpp-python was not installed by scripts/llama-wheel.sh"
    fields = marker.read_text().split()
    lib = Path(dist.locate_file("llama_cpp/lib/libggml-cpu.so"))
    # the library is the one the script installed (not a later default build over it)
    assert fields[0] == hashlib.sha256(lib.read_bytes()).hexdigest()
    digest = subprocess.run(["bash", str(ROOT / "scripts/llama-sources.sh"), "--digest"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert f"patches={digest}" in fields, (
        "the installed llama.cpp was built with other patches than scripts/llama-patches "
        "holds: run `make install`")



def _row_digests(ctx: Context, batch: Batch, tokens: list[int], chunk: int) -> list[bytes]:
    """The digest of every row's logits, the prompt read alone in chunks of `chunk`."""
    ctx.seq_rm(0, 0)
    out = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        batch.clear()
        for i, tok in enumerate(piece):
            batch.add(tok, start + i, 0, True)
        assert ctx.decode(batch) == 0
        out += [hashlib.sha256(ctx.logits(i).tobytes()).digest() for i in range(len(piece))]
    return out


def test_a_prompts_logits_do_not_depend_on_its_chunk_size_from_17_tokens(
        smollm2_path: Path) -> None:
    """scripts/llama-patches/0003: flash attention sums a ubatch of 17 rows or more in its
    tiled path, where a row's numbers do not depend on the other rows, so the step budget's
    small chunks read a prompt exactly as one large chunk does, to the last bit. (Unpatched,
    only chunks of 64 or more did; a chunk under 17 rows sums row by row, differently.)"""
    model = Model(smollm2_path)
    ctx = Context(model, n_ctx_seq=1024, n_seq=1, n_batch=512, n_threads=2, flash_attn=True)
    batch = Batch(512)
    try:
        # 612 tokens: every chunking below ends on a piece of 17 rows or more
        tokens = [100 + (i * 7919) % 20000 for i in range(612)]
        whole = _row_digests(ctx, batch, tokens, 512)
        for chunk in (17, 18, 36, 102):
            assert _row_digests(ctx, batch, tokens, chunk) == whole, chunk
        # the row-by-row path is another order of sums: the check above can fail
        assert _row_digests(ctx, batch, tokens, 16) != whole
    finally:
        batch.close()
        ctx.close()
        model.close()
