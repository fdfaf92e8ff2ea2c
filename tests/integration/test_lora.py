"""LoRA adapters (Modelfile ADAPTER): a tiny real LoRA GGUF for the tiny llama model, loaded
by llama.cpp, stored by `create`, refused when it is not one, and applied by a runner."""

from __future__ import annotations

import asyncio
from pathlib import Path

import gguf as gguf_writer
import numpy as np
import pytest

from llmrun.engine import llama
from llmrun.request import EngineError
from llmrun.server import memory
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.runners import RunnerProcess
from llmrun.store import CreateError, Store
from tests.fakes.tinymodel import N_EMBD, N_FF, N_HEAD, N_HEAD_KV, write_tiny_llama

HEAD_DIM = N_EMBD // N_HEAD
# numpy shape (rows, cols) = (outputs, inputs) of each adapted matrix of the tiny model
TARGETS = {
    "attn_q": (N_HEAD * HEAD_DIM, N_EMBD),
    "attn_k": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_v": (N_HEAD_KV * HEAD_DIM, N_EMBD),
    "attn_output": (N_EMBD, N_HEAD * HEAD_DIM),
    "ffn_gate": (N_FF, N_EMBD),
    "ffn_up": (N_FF, N_EMBD),
    "ffn_down": (N_EMBD, N_FF),
}
PROMPT = "hello the world"


def write_tiny_lora(path: Path, *, rank: int = 4, alpha: float = 8.0, seed: int = 1,
                    n_embd: int = N_EMBD, arch: str = "llama") -> Path:
    """A LoRA for `write_tiny_llama`'s layer 0, as convert_lora_to_gguf.py writes one.

    llama.cpp (llama-adapter.cpp) wants, for a base weight of GGUF shape ne = [n_in, n_out]:
    lora_a ne = [n_in, rank] and lora_b ne = [rank, n_out], i.e. numpy (rank, n_in) and
    (n_out, rank) like PEFT's lora_A / lora_B; the delta is scale * alpha / rank * B @ A.
    """
    rng = np.random.default_rng(seed)
    w = gguf_writer.GGUFWriter(str(path), arch)
    w.add_type(gguf_writer.GGUFType.ADAPTER)
    w.add_string(gguf_writer.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf_writer.Keys.Adapter.LORA_ALPHA, alpha)
    for name, (n_out, n_in) in TARGETS.items():
        n_in = n_in if n_in != N_EMBD else n_embd
        n_out = n_out if n_out != N_EMBD else n_embd
        a = rng.standard_normal((rank, n_in), dtype=np.float32) * 0.1
        b = rng.standard_normal((n_out, rank), dtype=np.float32) * 0.1
        w.add_tensor(f"blk.0.{name}.weight.lora_a", a)
        w.add_tensor(f"blk.0.{name}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lora-src")
    write_tiny_llama(folder / "tiny.gguf")
    write_tiny_lora(folder / "lora.gguf")
    write_tiny_lora(folder / "lora2.gguf", seed=2)
    write_tiny_lora(folder / "wide.gguf", n_embd=2 * N_EMBD)  # for another base model
    write_tiny_lora(folder / "qwen.gguf", arch="qwen2")
    (folder / "notes.gguf").write_text("not a GGUF at all\n" * 4)
    return folder


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


# -- llama.cpp: the adapter-level API -------------------------------------------------------


def _last_logits(ctx: llama.Context, batch: llama.Batch, tokens: list[int]) -> np.ndarray:
    ctx.seq_rm(0, 0)  # a fresh sequence each time: no KV cells from before the change
    batch.clear()
    for i, tok in enumerate(tokens):
        batch.add(tok, i, 0, i == len(tokens) - 1)
    assert ctx.decode(batch) == 0
    return ctx.logits(len(tokens) - 1).copy()


def test_adapter_changes_logits(files: Path) -> None:
    model = llama.Model(files / "tiny.gguf")
    ctx = llama.Context(model, n_ctx_seq=64, n_seq=1, n_batch=32, n_threads=1)
    batch = llama.Batch(32)
    lora = llama.LoraAdapter(model, files / "lora.gguf")
    try:
        assert lora.meta("adapter.type") == "lora"
        assert float(lora.meta("adapter.lora.alpha") or 0) == 8.0
        assert lora.meta("no.such.key") is None
        tokens = model.tokenize(PROMPT, add_special=True)
        base = _last_logits(ctx, batch, tokens)
        assert np.isfinite(base).all()

        ctx.set_loras([lora], [1.0])
        tuned = _last_logits(ctx, batch, tokens)
        assert np.isfinite(tuned).all()
        assert np.abs(tuned - base).max() > 0.05 * np.abs(base).max()

        ctx.set_loras([lora], [0.5])  # a smaller scale: a smaller change
        half = _last_logits(ctx, batch, tokens)
        assert 0 < np.abs(half - base).max() < np.abs(tuned - base).max()

        ctx.set_loras([lora], [0.0])  # scale 0 is no adapter at all
        np.testing.assert_array_equal(_last_logits(ctx, batch, tokens), base)

        ctx.set_loras([lora], [1.0])
        np.testing.assert_array_equal(_last_logits(ctx, batch, tokens), tuned)
        ctx.set_loras([], [])  # removed
        np.testing.assert_array_equal(_last_logits(ctx, batch, tokens), base)
        with pytest.raises(ValueError):
            ctx.set_loras([lora], [])
    finally:
        lora.close()
        batch.close()
        ctx.close()
        model.close()
    lora.close()  # twice is harmless


def test_adapter_refusals_name_the_reason(files: Path) -> None:
    model = llama.Model(files / "tiny.gguf")
    try:
        with pytest.raises(llama.LlamaError, match=r"wide\.gguf.*incorrect shape"):
            llama.LoraAdapter(model, files / "wide.gguf")
        with pytest.raises(llama.LlamaError, match=r"arch mismatch"):
            llama.LoraAdapter(model, files / "qwen.gguf")
        with pytest.raises(llama.LlamaError, match=r"general\.type.*'adapter'"):
            llama.LoraAdapter(model, files / "tiny.gguf")
        with pytest.raises(llama.LlamaError, match=r"missing\.gguf: no such file"):
            llama.LoraAdapter(model, files / "missing.gguf")
        lora = llama.LoraAdapter(model, files / "lora.gguf")  # still loads after failures
    finally:
        model.close()
    lora.close()  # after the model: llama.cpp freed it already; only the pointer goes


# -- the store: create / show / rm ----------------------------------------------------------


def test_create_records_adapter_and_rm_frees_it(files: Path, tmp_path: Path) -> None:
    store = Store(home=tmp_path / "home")
    created = store.create("tuned", "FROM ./tiny.gguf\nADAPTER ./lora.gguf\n", base_dir=files)
    assert len(created.adapters) == 1
    lora_path = store.blobs.path(created.adapters[0].digest)
    assert lora_path.read_bytes() == (files / "lora.gguf").read_bytes()
    assert created.size == created.model.size + created.adapters[0].size
    assert store.adapter_paths(created) == [lora_path]
    store.verify(created)
    shown = store.modelfile_of(created).render()
    assert f"ADAPTER {lora_path}\n" in shown

    # FROM a model inherits its adapters; new ADAPTER lines come after them
    more = store.create("tuned2", "FROM tuned\nADAPTER ./lora2.gguf\n", base_dir=files)
    assert more.adapters[0] == created.adapters[0]
    assert len(more.adapters) == 2 and more.model == created.model
    # and `show --modelfile` output creates the same model again
    again = store.create("again", store.modelfile_of(more).render())
    assert again.adapters == more.adapters and again.digest == more.digest

    store.remove("tuned2")
    store.remove("again")
    assert lora_path.is_file()  # still used by "tuned"
    store.remove("tuned")
    assert _tree(store.blobs.root) == []


@pytest.mark.parametrize(
    ("modelfile", "named"),
    [
        ("FROM ./tiny.gguf\nADAPTER ./tiny.gguf\n", "tiny.gguf"),  # a model as ADAPTER
        ("FROM ./lora.gguf\n", "lora.gguf"),  # an adapter as FROM
        ("FROM ./tiny.gguf\nADAPTER ./missing.gguf\n", "missing.gguf"),
        ("FROM ./tiny.gguf\nADAPTER ./notes.gguf\n", "notes.gguf"),  # not a GGUF
        ("FROM ./tiny.gguf\nADAPTER ./lora.gguf\nADAPTER ./qwen.gguf\n", "qwen.gguf"),
        ("FROM ./tiny.gguf\nADAPTER sha256:" + "0" * 64 + "\n", "sha256:" + "0" * 64),
    ],
)
def test_create_refusals(files: Path, tmp_path: Path, modelfile: str, named: str) -> None:
    store = Store(home=tmp_path / "home")
    with pytest.raises(CreateError) as err:
        store.create("bad", modelfile, base_dir=files)
    assert named in str(err.value)
    assert _tree(store.blobs.root) == []
    assert store.list() == []


def test_refusals_keep_blobs_of_other_models(files: Path, tmp_path: Path) -> None:
    store = Store(home=tmp_path / "home")
    good = store.create("good", "FROM ./tiny.gguf\nADAPTER ./lora.gguf\n", base_dir=files)
    before = _tree(store.blobs.root)
    with pytest.raises(CreateError, match="qwen"):
        store.create("bad", "FROM good\nADAPTER ./lora2.gguf\nADAPTER ./qwen.gguf\n",
                     base_dir=files)
    assert _tree(store.blobs.root) == before
    with pytest.raises(CreateError, match="LoRA adapter, not a model"):
        store.create("bad", f"FROM {good.adapters[0].digest}\n")
    # an ADAPTER may name a blob already in the store, as FROM may
    by_digest = store.create("by-digest", f"FROM good\nADAPTER {good.adapters[0].digest}\n")
    assert by_digest.adapters == [good.adapters[0], good.adapters[0]]


# -- the runner process ---------------------------------------------------------------------


def _spec(files: Path, *loras: Path) -> RunnerSpec:
    return RunnerSpec(model_paths=(files / "tiny.gguf",), n_ctx=64, n_slots=1, n_threads=1,
                      n_batch=32, lora_paths=loras)


def test_runner_spec_is_hashable_and_compares_loras(files: Path) -> None:
    plain, tuned = _spec(files), _spec(files, files / "lora.gguf")
    assert plain != tuned and tuned == _spec(files, files / "lora.gguf")
    assert len({plain, tuned, _spec(files, files / "lora.gguf")}) == 2


def test_scheduler_spec_and_file_check(files: Path, tmp_path: Path) -> None:
    from llmrun.request import Options
    from llmrun.server.scheduler import Scheduler

    store = Store(home=tmp_path / "home")
    m = store.create("tuned", "FROM ./tiny.gguf\nADAPTER ./lora.gguf\n", base_dir=files)
    sched = Scheduler(store, tmp_path / "logs")
    spec = sched.spec_for(m, Options())
    assert spec.lora_paths == (store.blobs.path(m.adapters[0].digest),)
    assert spec != sched.spec_for(store.create("plain", "FROM ./tiny.gguf\n", base_dir=files),
                                  Options())
    memory.check_files(store, set(), "tuned", m, spec)
    with open(spec.lora_paths[0], "r+b") as fh:  # tamper with the adapter blob
        fh.seek(-4, 2)
        fh.write(b"\xff" * 4)
    with pytest.raises(EngineError, match="modified on disk"):
        memory.check_files(store, set(), "tuned", m, spec)


def test_runner_with_lora(files: Path, tmp_path: Path) -> None:
    async def go() -> str:
        runner = RunnerProcess(_spec(files, files / "lora.gguf"), tmp_path / "runner.log")
        await runner.start()
        try:
            assert runner.alive and runner.info["n_ctx_seq"] == 64
        finally:
            await runner.stop()
        return (tmp_path / "runner.log").read_text()

    assert "applied LoRA adapters: lora.gguf x1" in asyncio.run(go())


@pytest.mark.parametrize(("lora", "problem"), [
    ("missing.gguf", r"missing\.gguf: no such file"),
    ("wide.gguf", r"wide\.gguf.*incorrect shape"),
])
def test_runner_bad_lora(files: Path, tmp_path: Path, lora: str, problem: str) -> None:
    async def go() -> None:
        runner = RunnerProcess(_spec(files, files / lora), tmp_path / "runner.log")
        try:
            await runner.start()
        finally:
            await runner.kill()

    with pytest.raises(EngineError, match=problem):
        asyncio.run(go())


def test_lora_in_the_load_message() -> None:
    """Adapters travel in the runner's Load message as a path and a scale each, so a colon
    in a path is part of the path."""
    from llmrun import jsonio, protocol

    load = protocol.Load(model=["/m.gguf"], ctx=64, max_frame=1 << 20,
                         lora=[protocol.Lora(path="/x:y/a.gguf"),
                               protocol.Lora(path="/x/a.gguf", scale=0.5)])
    back = protocol.parse_command(jsonio.loads(jsonio.dumps(load)))
    assert back == load
    assert isinstance(back, protocol.Load) and back.lora[0] == protocol.Lora(path="/x:y/a.gguf")
    assert back.lora[1].scale == 0.5
