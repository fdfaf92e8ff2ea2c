"""The llama.cpp the engine runs is the build scripts/llama-wheel.sh made: AMX off, and
llmrun's patches to llama.cpp (scripts/llama-patches) applied, the ones in this checkout."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun.engine import llama
from llmrun.engine.llama import Batch, Context, Model, small_tiles_available

pytestmark = pytest.mark.model  # needs the installed llama-cpp-python

ROOT = Path(__file__).resolve().parents[2]


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


@contextlib.contextmanager
def _flash_context(path: Path, n_ctx_seq: int,
                   n_seq: int = 1) -> Iterator[tuple[Context, Batch]]:
    """A flash-attention context of `n_seq` sequences (one KV stream each, as the engine's)
    on the model at `path`, and a batch of 512."""
    model = Model(path)
    ctx = Context(model, n_ctx_seq=n_ctx_seq, n_seq=n_seq, n_batch=512, n_threads=2,
                  flash_attn=True)
    batch = Batch(512)
    try:
        yield ctx, batch
    finally:
        batch.close()
        ctx.close()
        model.close()


def _row_digests(ctx: Context, batch: Batch, tokens: list[int], chunk: int,
                 small_tiles: bool = False) -> list[bytes]:
    """The digest of every row's logits, the prompt read alone in chunks of `chunk`."""
    ctx.seq_rm(0, 0)
    out = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        batch.clear()
        for i, tok in enumerate(piece):
            batch.add(tok, start + i, 0, True)
        assert ctx.decode(batch, small_tiles=small_tiles) == 0
        out += [hashlib.sha256(ctx.logits(i).tobytes()).digest() for i in range(len(piece))]
    return out


@pytest.mark.parametrize(("env", "said"), [
    ({"LLMRUN_BACKEND": "metal"}, "must be auto, cpu, cuda or vulkan, not 'metal'"),
    # asked for on a machine without a driver (as here): built for another machine, with the
    # architecture named; a malformed one stops before anything is fetched or built
    ({"LLMRUN_BACKEND": "cuda", "LLMRUN_CUDA_ARCH": "9.0"}, "without its dot (e.g. 90)"),
])
def test_the_wheel_script_refuses_a_bad_backend_before_building(
        env: dict[str, str], said: str, tmp_path: Path) -> None:
    done = subprocess.run([str(ROOT / "scripts" / "llama-wheel.sh"), "python3"],
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not (tmp_path / ".cache").exists()  # nothing fetched, nothing cached


def test_small_tiles_read_a_prompt_as_one_large_chunk_does(smollm2_path: Path) -> None:
    """scripts/llama-patches/0003: with `small_tiles`, flash attention sums a ubatch of 17
    rows or more in its tiled path, where a row's numbers do not depend on the other rows,
    so the step budget's small chunks read a prompt exactly as one large chunk does, to the
    last bit. Without it (every other decode), nothing changes: under 64 rows the row-by-row
    path, another order of sums."""
    assert small_tiles_available()
    with _flash_context(smollm2_path, 1024) as (ctx, batch):
        # 612 tokens: every chunking below ends on a piece of 17 rows or more
        tokens = [100 + (i * 7919) % 20000 for i in range(612)]
        whole = _row_digests(ctx, batch, tokens, 512)
        for chunk in (17, 18, 36, 102):
            assert _row_digests(ctx, batch, tokens, chunk, small_tiles=True) == whole, chunk
        # under 17 rows, and without the switch (it is off again after each decode), the
        # row-by-row path: the checks above can fail
        assert _row_digests(ctx, batch, tokens, 16, small_tiles=True) != whole
        default = _row_digests(ctx, batch, tokens, 36)
        assert default != whole
        # the switch is the calling thread's: set here, a decode on another thread (as the
        # image encoder's) keeps the default
        llama._set_tiled_rows(llama.SMALL_TILE_ROWS)
        try:
            other: list[list[bytes]] = []
            t = threading.Thread(target=lambda: other.append(
                _row_digests(ctx, batch, tokens, 36)))
            t.start()
            t.join()
        finally:
            llama._set_tiled_rows(0)
        assert other == [default]


def test_masked_tiles_are_remembered_per_graph_only(gemma3_path: Path) -> None:
    """scripts/llama-patches/0004: the tiled kernel remembers which mask tiles are fully
    masked for the rest of the graph it computes. Gemma 3's sliding layers over llmrun's
    full-size cache mask nearly every tile of a long context, and consecutive 64-token
    pieces reuse one mask buffer of one shape, where the same mask row and tile are masked
    in one piece and live in the next: a memo that outlived its graph would skip live tiles
    and change the numbers. Read in such pieces, the prompt's logits equal one large chunk's,
    to the last bit (in the tiled path a row's sums do not depend on the chunk)."""
    with _flash_context(gemma3_path, 2048) as (ctx, batch):
        # 1,536 tokens: three times the sliding window; each piece below has 64 rows or more
        tokens = [300 + (i * 7919) % 200000 for i in range(1536)]
        whole = _row_digests(ctx, batch, tokens, 512)
        assert _row_digests(ctx, batch, tokens, 64) == whole
        assert _row_digests(ctx, batch, tokens, 128) == whole


def _read(ctx: Context, batch: Batch, seq: int, tokens: list[int]) -> None:
    for start in range(0, len(tokens), 512):
        batch.clear()
        for i, tok in enumerate(tokens[start:start + 512]):
            batch.add(tok, start + i, seq, False)
        assert ctx.decode(batch) == 0


@pytest.mark.parametrize("length", [300, 1500])
def test_a_decode_row_is_summed_alike_whatever_the_threads_and_neighbours(
        smollm2_path: Path, length: int) -> None:
    """scripts/llama-patches/0005: flash attention cuts a decode row's KV at fixed 256-cell
    boundaries. llama.cpp cut it into one chunk per thread, and only for a row decoded alone
    over 512 cells or more (a row beside others was summed in one pass), so past 256 tokens
    a greedy answer changed with the thread count, which the engine adapts to the machine's
    load (engine/threads.py), and with the streams decoded beside it. The next token's
    logits of a `length`-token sequence are the same to the last bit with 1 thread and 2,
    alone and beside a longer sequence's row (whose length sets the KV view's)."""
    mine = [100 + (i * 7919) % 20000 for i in range(length)]
    other = [200 + (i * 104729) % 20000 for i in range(2000)]
    with _flash_context(smollm2_path, 2048, n_seq=2) as (ctx, batch):
        _read(ctx, batch, 0, mine)
        _read(ctx, batch, 1, other)

        def next_row(threads: int, beside: bool) -> bytes:
            ctx.set_threads(threads)
            batch.clear()
            batch.add(7, length, 0, True)
            if beside:
                batch.add(8, len(other), 1, True)
            assert ctx.decode(batch) == 0
            row = hashlib.sha256(ctx.logits(0).tobytes()).digest()
            ctx.seq_rm(0, length)  # the next call decodes the same position again
            ctx.seq_rm(1, len(other))
            return row

        alone = next_row(2, beside=False)
        assert next_row(1, beside=False) == alone
        assert next_row(2, beside=True) == alone
        assert next_row(1, beside=True) == alone
