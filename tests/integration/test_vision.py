"""Images through the runner on the real model and a tiny random projector.

In-process: engine/host.py's ModelHost on SmolLM2 with tests/fakes/vision.py's projector (random
weights: the answers mean nothing, but every line of the real path runs). Numerics first:
an image read in pieces beside another sequence gives what it gives alone, and what plain
llama-cpp-python (libmtmd's own helper) gives; then the cache, then hostile images.
"""

from __future__ import annotations

import base64
import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
import numpy as np
import pytest
from llama_cpp import mtmd_cpp as M

from llmrun.chat import templates
from llmrun.engine import batcher, pixels
from llmrun.engine.host import ModelHost
from llmrun.engine.llama import Context, LlamaError, Model, Projector
from llmrun.request import DEFAULT_OPTIONS, ChatRequest, Options
from llmrun.store import gguf
from tests.fakes.vision import (
    N_IMAGE_TOKENS,
    bomb_png,
    image,
    not_image,
    truncated_png,
    write_projector,
)
from tests.integration.test_isolation import Frames, assert_serving

GREEDY = {"temperature": 0.0, "seed": 1, "repeat_penalty": 1.0}
QUESTION = "Describe the picture."


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_projector(tmp_path_factory.mktemp("vision") / "mmproj.gguf")


class Host:
    """A runner (ModelHost) with a projector whose encodes are counted."""

    def __init__(self, model: Model, mmproj: Path, slots: int = 2,
                 step_budget: tuple[float, int] = (0.0, 0)) -> None:
        self.frames = Frames()
        self.ctx = Context(model, n_ctx_seq=1024, n_seq=slots, n_batch=512, n_threads=1)
        # as the daemon tells a runner: a sound's pieces, from the projector's GGUF
        self.projector = Projector(mmproj, model, 1, gguf.read(mmproj).sound_piece_seconds)
        self.encodes = 0
        encode = self.projector.encode

        def counted(chunk: Any) -> np.ndarray:
            self.encodes += 1
            return encode(chunk)

        self.projector.encode = counted  # type: ignore[method-assign]
        self.r = ModelHost(self.frames, model, self.ctx, 1024, slots, 1,  # type: ignore[arg-type]
                           step_budget=step_budget, projector=self.projector)
        self.r.engine.start()
        self._n = 0

    def ask(self, messages: list[dict[str, Any]], num_predict: int = 12,
            **fields: Any) -> tuple[str, dict[str, Any], str]:
        rid = self.send(messages, num_predict, **fields)
        kind, payload = self.frames.final(rid)
        return kind, payload, self.frames.text(rid)

    def send(self, messages: list[dict[str, Any]], num_predict: int = 12, **fields: Any) -> str:
        self._n += 1
        rid = f"v{self._n}"
        self.last = rid
        options = Options(num_predict=num_predict, **GREEDY).merged_over(DEFAULT_OPTIONS)
        self.r.generate(rid, ChatRequest(model="t", messages=messages, options=options,
                                         **fields))
        return rid

    def started(self, rid: str) -> dict[str, Any]:
        return next(p for k, p in self.frames.events[rid] if k == "started")

    def close(self) -> None:
        self.r.engine.stop()
        self.projector.close()
        self.ctx.close()


@pytest.fixture
def host(model: Model, mmproj: Path) -> Iterator[Host]:
    h = Host(model, mmproj)
    yield h
    h.close()


def user(*pictures: bytes, text: str = QUESTION) -> dict[str, Any]:
    return {"role": "user", "content": text, "images": [b64(p) for p in pictures]}


def test_same_image_same_answer_other_image_other_answer(host: Host) -> None:
    kind, a1, text1 = host.ask([user(image(1))])
    assert kind == "done", a1
    _, _, text1b = host.ask([user(image(1))])
    _, a2, text2 = host.ask([user(image(2))])
    _, plain, _ = host.ask([{"role": "user", "content": QUESTION}])
    assert text1 == text1b and text1 != text2, (text1, text2)
    # the image's 16 positions (and the line after its marker) count as prompt tokens
    assert a1["prompt_tokens"] - plain["prompt_tokens"] in (N_IMAGE_TOKENS, N_IMAGE_TOKENS + 1)
    assert a1["prompt_tokens"] == a2["prompt_tokens"]


def test_second_turn_reads_the_image_from_the_cache(host: Host) -> None:
    turn1 = [user(image(3))]
    kind, first, answer = host.ask(turn1)
    assert kind == "done" and host.encodes == 1
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And the colours?"}]
    rid = host.send(turn2)
    kind, second = host.frames.final(rid)
    assert kind == "done", second
    # the slot held the whole first turn, image included: nothing encoded again
    assert second["cached_tokens"] >= first["prompt_tokens"] - 1
    assert host.encodes == 1
    # a different image at the same place is not mistaken for it (same length, same text)
    kind, third, _ = host.ask([user(image(4))])
    assert kind == "done" and host.encodes == 2
    assert third["cached_tokens"] < first["prompt_tokens"] - N_IMAGE_TOKENS


def test_an_image_sent_again_is_not_encoded_again(host: Host) -> None:
    kind, _, answer = host.ask([user(image(8))])
    assert kind == "done" and host.encodes == 1
    # the first turn's image again, later in the conversation, beside a new one: only the
    # new one is encoded (the other comes from the slot, then from the embeddings kept)
    turn2 = [user(image(8)), {"role": "assistant", "content": answer},
             user(image(8), image(9), text="And these two?")]
    kind, stats, _ = host.ask(turn2)
    assert kind == "done" and host.encodes == 2, stats
    # the same twice in one message: the same positions' ids, each read
    kind, both, _ = host.ask([user(image(9), image(9))])
    assert kind == "done" and host.encodes == 2, both


def test_image_read_in_pieces_beside_a_stream_equals_alone(
        model: Model, mmproj: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 5 rows per step while another sequence generates: the image takes four steps
    monkeypatch.setattr(batcher, "MIN_PROMPT_CHUNK", 5)
    monkeypatch.setattr(batcher, "FLASH_PROMPT_CHUNK", 5)
    monkeypatch.setattr(batcher, "SMALL_TILE_CHUNK", 5)
    alone = Host(model, mmproj)
    try:
        _, _, expected = alone.ask([user(image(5), image(6))], num_predict=16,
                                   logprobs=3)
        lp_alone = [e for k, p in alone.frames.events["v1"] if k == "chunk"
                    for e in p.get("logprobs") or []]
    finally:
        alone.close()
    h = Host(model, mmproj, step_budget=(0.0, 5))
    try:
        stream = h.send([{"role": "user", "content": "Tell me a long story."}], num_predict=200)
        while not any(k == "chunk" for k, _ in h.frames.events.get(stream, [])):
            with h.frames.cond:
                h.frames.cond.wait(0.05)
        rid = h.send([user(image(5), image(6))], num_predict=16, logprobs=3)
        kind, stats = h.frames.final(rid)
        assert kind == "done", stats
        assert h.frames.text(rid) == expected
        lp = [e for k, p in h.frames.events[rid] if k == "chunk" for e in p.get("logprobs") or []]
        assert [e["token"] for e in lp] == [e["token"] for e in lp_alone]
        np.testing.assert_allclose([e["logprob"] for e in lp],
                                   [e["logprob"] for e in lp_alone], atol=1e-3)
        progress = [p for k, p in h.frames.events[rid] if k == "progress"]
        assert len(progress) >= 4, progress  # read over several steps
        assert h.frames.final(stream)[0] == "done"
    finally:
        h.close()


def test_images_beside_each_other_and_text_answer_as_alone(model: Model, mmproj: Path) -> None:
    # three at once on three slots (the encoder takes one sequence's images at a time):
    # each answer is the one it gets alone
    asks = [[user(image(20))], [user(image(21), image(22))],
            [{"role": "user", "content": "Name three colours."}]]
    alone = []
    for messages in asks:
        h = Host(model, mmproj, slots=3)
        try:
            kind, _, text = h.ask(messages, num_predict=16)
            assert kind == "done"
            alone.append(text)
        finally:
            h.close()
    h = Host(model, mmproj, slots=3)
    try:
        rids = [h.send(messages, num_predict=16) for messages in asks]
        for rid, expected in zip(rids, alone, strict=True):
            assert h.frames.final(rid)[0] == "done"
            assert h.frames.text(rid) == expected
        assert h.encodes == 3  # each image once
        assert_serving(h.r, h.frames)
    finally:
        h.close()


def png_bitmap(png: bytes) -> Callable[[Any], Any]:
    """An mtmd bitmap of `png`'s pixels, made when a libmtmd context is at hand."""
    def make(_: Any) -> Any:
        w, h, rgb, _digest = pixels.decode(b64(png))
        return M.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb))
    return make


def reference_first_logits(model: Model, mmproj: Path, prompt: str,
                           bitmap_of: Callable[[Any], Any]) -> np.ndarray:
    """The next-token logits after `prompt` (with libmtmd's default marker for the image or
    sound that `bitmap_of(mtmd context)` makes), evaluated by plain llama-cpp-python:
    mtmd_tokenize and mtmd_helper_eval_chunks."""
    params = C.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 1024, 512, 512
    params.n_threads = params.n_threads_batch = 1
    lctx = C.llama_init_from_model(model.ptr, params)
    mp = M.mtmd_context_params_default()
    mp.use_gpu, mp.n_threads, mp.warmup = False, 1, False
    mctx = M.mtmd_init_from_file(str(mmproj).encode(), model.ptr, mp)
    try:
        bitmap = bitmap_of(mctx)
        chunks = M.mtmd_input_chunks_init()
        raw = prompt.encode()
        text = M.mtmd_input_text(raw, len(raw), model.add_bos, True)
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(text),
                               (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        n_past = C.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, 512, True,
                                         ctypes.byref(n_past)) == 0
        out = np.ctypeslib.as_array(C.llama_get_logits_ith(lctx, -1),
                                    shape=(model.n_vocab,)).copy()
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bitmap)
        return out
    finally:
        M.mtmd_free(mctx)
        C.llama_free(lctx)


def test_first_token_matches_plain_llama_cpp_python(host: Host, model: Model,
                                                     mmproj: Path) -> None:
    png = image(7)
    assert_first_token_as_plain(host, model, mmproj, user(png), png_bitmap(png))


def assert_first_token_as_plain(host: Host, model: Model, mmproj: Path,
                                message: dict[str, Any], bitmap_of: Callable[[Any], Any]) -> None:
    """The runner's first token for `message` (one image or sound, then its text) has the
    top 5 and their log-probabilities that plain llama-cpp-python gives."""
    rid = host.send([message], num_predict=1, logprobs=5)
    kind, _ = host.frames.final(rid)
    assert kind == "done"
    (ours,) = [e for k, p in host.frames.events[rid] if k == "chunk"
               for e in p.get("logprobs") or []]
    source = model.chat_template() or ""
    prompt = templates.render(source, [{"role": "user",
                                        "content": M.mtmd_default_marker().decode() + "\n"
                                        + message["content"]}], add_generation_prompt=True)
    logits = reference_first_logits(model, mmproj, prompt, bitmap_of)
    log_z = float(np.log(np.exp(logits.astype(np.float64) - logits.max()).sum()) + logits.max())
    ranked = np.argsort(-logits)[:5]
    assert [model.piece(int(t)).decode() for t in ranked] == [t for t, _ in ours["top"]]
    np.testing.assert_allclose([float(logits[t]) - log_z for t in ranked],
                               [lp for _, lp in ours["top"]], atol=1e-3)


@pytest.mark.parametrize("bad, words", [
    (truncated_png(), "could not be decoded"),
    (bomb_png(), "pixels"),
    (not_image(), "not an image"),
])
def test_hostile_images_fail_alone(host: Host, bad: bytes, words: str) -> None:
    stream = host.send([{"role": "user", "content": "Tell me a story."}], num_predict=40)
    kind, err, _ = host.ask([user(image(1), bad)])
    assert kind == "error" and err["code"] == "invalid_request" and words in err["message"], err
    assert host.frames.final(stream)[0] == "done"  # the neighbour was not touched
    assert host.encodes == 0  # refused before anything was encoded
    assert_serving(host.r, host.frames)


def test_bad_base64_and_text_only_runner(host: Host, model: Model) -> None:
    kind, err, _ = host.ask([{"role": "user", "content": "hi", "images": ["%%%"]}])
    assert kind == "error" and "base64" in err["message"]
    frames = Frames()
    ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=512, n_threads=1)
    text_only = ModelHost(frames, model, ctx, 256, 1, 1)  # type: ignore[arg-type]
    text_only.engine.start()
    try:
        options = Options(num_predict=4, **GREEDY).merged_over(DEFAULT_OPTIONS)
        text_only.generate("x", ChatRequest(model="t", messages=[user(image(1))],
                                            options=options))
        kind, err = frames.final("x")
        assert kind == "error" and "no vision projector" in err["message"]
    finally:
        text_only.engine.stop()
        ctx.close()


def test_projector_of_another_width_is_refused(model: Model, tmp_path: Path) -> None:
    wrong = write_projector(tmp_path / "wide.gguf", n_embd=64)
    with pytest.raises(LlamaError, match="width"):
        Projector(wrong, model, 1)
