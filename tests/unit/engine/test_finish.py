"""How a sequence ends, over a fake model (tests/fakes/engine.py): its finish reasons and
statistics, stop strings, a full context, logprobs, and a failure that ends it alone."""

from __future__ import annotations

import math

import pytest

from tests.fakes.engine import FakeSampler, Rig
from tests.unit.engine.test_slots import endless


def test_the_end_of_generation_token_stops() -> None:
    rig = Rig(slots=1, n_vocab=16)
    rid = rig.submit([10, 11], max_tokens=20)
    rig.run(rid)
    done = rig.done(rid)
    assert rig.text(rid) == "<12><13><14><15>"
    assert done["finish_reason"] == "stop" and done["completion_tokens"] == 4
    assert done["prompt_tokens"] == 2 and done["stop_sequence"] is None


def test_num_predict_ends_with_length() -> None:
    rig = Rig(slots=1)
    rid = rig.submit([1], max_tokens=3)
    rig.run(rid)
    assert rig.text(rid) == "<2><3><4>"
    assert rig.done(rid)["finish_reason"] == "length"


def test_a_stop_string_ends_the_text_before_it() -> None:
    rig = Rig(slots=1)
    rid = rig.submit([1], max_tokens=20, stops=["<5>"])
    rig.run(rid)
    assert rig.text(rid) == "<2><3><4>"
    done = rig.done(rid)
    assert done["finish_reason"] == "stop" and done["stop_sequence"] == "<5>"


def test_prompt_only_reads_the_prompt_and_ends() -> None:
    rig = Rig(slots=1)
    rid = rig.submit([1, 2, 3], max_tokens=0, context=True)
    rig.run(rid)
    done = rig.done(rid)
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 0
    assert done["context"] == [1, 2, 3]
    assert rig.ctx.cells[0] == [1, 2, 3]


def test_a_full_context_ends_with_length_or_shifts() -> None:
    rig = Rig(slots=1, n_ctx=16, follow=endless)
    rid = rig.submit([1, 2, 3, 4])
    rig.run(rid)
    done = rig.done(rid)
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 12
    shifted = rig.submit([1, 2, 3, 4], max_tokens=30, shift=True, keep=2)
    rig.run(shifted)
    done = rig.done(shifted)
    assert done["finish_reason"] == "length" and done["completion_tokens"] == 30
    assert done["shifted_tokens"] > 0
    # moved cells are not what a fresh read gives: only the kept head stays
    assert rig.engine.slots[0].tokens == [1, 2] == rig.ctx.cells[0]


def test_a_memory_that_cannot_shift_ends_with_length() -> None:
    rig = Rig(slots=1, n_ctx=16, follow=endless, context={"can_shift": False})
    rid = rig.submit([1, 2, 3, 4], shift=True)
    rig.run(rid)
    assert rig.done(rid)["finish_reason"] == "length"
    assert rig.done(rid)["shifted_tokens"] == 0


def test_logprobs_of_the_sampled_token_and_the_top() -> None:
    rig = Rig(slots=1, n_vocab=8)
    rid = rig.submit([1], max_tokens=2, logprobs=2)
    rig.run(rid)
    chunks = [p for k, p in rig.events[rid] if k == "chunk"]
    first = chunks[0]["logprobs"][0]
    # the fake's logits: 10 for the next id, 0 for the 7 others
    expected = 10 - math.log(math.exp(10) + 7)
    assert first["token"] == "<2>" and first["logprob"] == pytest.approx(expected, abs=1e-5)
    assert first["top"][0] == ("<2>", pytest.approx(expected, abs=1e-5))
    assert len(first["top"]) == 2


def test_prompt_logprobs_score_every_prompt_token() -> None:
    rig = Rig(slots=1)
    first = rig.submit([1, 2, 3], max_tokens=1)
    rig.run(first)
    rid = rig.submit([1, 2, 3], max_tokens=1, prompt_logprobs=0)
    rig.run(rid)
    assert rig.started(rid)["cached_tokens"] == 0  # scored whole: cached cells hold no logits
    entries = [e for k, p in rig.events[rid] if k == "chunk" for e in p.get("prompt_logprobs", [])]
    assert [e["token"] for e in entries] == ["<1>", "<2>", "<3>"]
    assert entries[0]["logprob"] is None and entries[1]["logprob"] > -0.01


def test_a_failing_sampler_ends_its_sequence_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(slots=2, follow=endless)
    good, bad = rig.submit([1, 2]), rig.submit([20, 21])
    rig.turn(2)
    real = rig.ctx.sample

    def fragile(sampler: FakeSampler, index: int, mask: object = None) -> int:
        token = real(sampler, index, None)
        if token > 20:
            raise RuntimeError("a sampler that breaks")
        return token

    monkeypatch.setattr(rig.ctx, "sample", fragile)
    rig.turn()
    kind, payload = rig.final(bad) or ("", {})
    assert kind == "error" and payload["code"] == "internal"
    assert rig.final(good) is None
    assert rig.engine.slots[1].seq is None
    assert rig.engine.slots[1].tokens == rig.ctx.cells[1]  # its decoded cells stay usable
