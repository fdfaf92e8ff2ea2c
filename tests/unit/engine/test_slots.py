"""Slots over a fake model (tests/fakes/engine.py): admission and placement, cancels, prefix
reuse, and the prompt cache's save and restore bookkeeping."""

from __future__ import annotations

from llmrun.engine.promptcache import PromptCache
from tests.fakes.engine import Rig


def endless(last: int, n_vocab: int) -> int:
    """A continuation that never ends: ids 1..n_vocab-1 round and round."""
    return last % (n_vocab - 1) + 1


def test_requests_take_free_slots_and_the_rest_wait() -> None:
    rig = Rig(slots=2)
    a, b, c = (rig.submit([1, 2, 3], max_tokens=4) for _ in range(3))
    rig.turn()
    assert rig.kinds(a)[0] == "started" and rig.kinds(b)[0] == "started"
    assert c not in rig.events  # no free slot: it waits, unannounced
    seqs = {slot.seq.id: slot.seq_id for slot in rig.engine.slots if slot.seq is not None}
    assert seqs.keys() == {a, b} and len(set(seqs.values())) == 2
    rig.run(a, b, c)
    assert rig.started(c) == {"prompt_tokens": 3, "cached_tokens": 2, "n_ctx": 256}
    for rid in (a, b, c):
        assert rig.text(rid) == "<4><5><6><7>"
        assert rig.done(rid)["finish_reason"] == "length"
    assert all(slot.seq is None for slot in rig.engine.slots)


def test_a_request_goes_to_the_slot_holding_its_prefix() -> None:
    rig = Rig(slots=2)
    first = rig.submit([1, 2, 3], max_tokens=1)
    second = rig.submit([10, 11, 12, 13], max_tokens=1)
    rig.run(first, second)
    again = rig.submit([10, 11, 12, 13, 14, 15], max_tokens=1)
    rig.run(again)
    holder = next(s for s in rig.engine.slots if s.tokens[:4] == [10, 11, 12, 13])
    assert rig.started(again)["cached_tokens"] == 4
    assert rig.ctx.cells[holder.seq_id] == holder.tokens  # the bookkeeping matches the cells


def test_a_shared_prefix_is_not_decoded_again() -> None:
    rig = Rig(slots=1)
    prompt = list(range(1, 41))
    first = rig.submit(prompt, max_tokens=2)
    rig.run(first)
    before = rig.ctx.rows_of(0)
    assert before == 40 + 1  # the prompt, then one generated token (the last is not decoded)
    second = rig.submit([*prompt, 50, 51], max_tokens=2)
    rig.run(second)
    assert rig.started(second)["cached_tokens"] == 40
    assert rig.ctx.rows_of(0) - before == 2 + 1  # the two new prompt tokens and one output
    assert rig.done(second)["cached_tokens"] == 40
    # the same prompt again: its last token is read again, for logits to sample from
    third = rig.submit([*prompt, 50, 51], max_tokens=1)
    rig.run(third)
    assert rig.started(third)["cached_tokens"] == 41


def test_a_memory_that_cannot_drop_a_tail_starts_the_slot_over() -> None:
    rig = Rig(slots=1, context={"can_cut": False})
    first = rig.submit([1, 2, 3, 4], max_tokens=2)
    rig.run(first)
    second = rig.submit([1, 2, 9], max_tokens=1)
    rig.run(second)
    assert rig.started(second)["cached_tokens"] == 0
    assert rig.ctx.cells[0] == [1, 2, 9]


def test_cancel_mid_generation_frees_the_slot() -> None:
    rig = Rig(slots=1, follow=endless)
    rid = rig.submit([1, 2, 3])
    rig.turn(5)
    assert rig.final(rid) is None and rig.engine.slots[0].seq is not None
    rig.engine.cancel(rid)
    rig.turn()
    done = rig.done(rid)
    assert done["finish_reason"] == "cancel" and done["completion_tokens"] >= 4
    assert rig.engine.slots[0].seq is None
    assert rig.model.samplers[0].closed
    # what it decoded stays in the slot for the next request to reuse
    assert rig.ctx.cells[0] == rig.engine.slots[0].tokens
    nxt = rig.submit([1, 2, 3, 4, 5], max_tokens=1)
    rig.run(nxt)
    assert rig.started(nxt)["cached_tokens"] == 4


def test_cancel_of_a_waiting_request_ends_it_without_a_slot() -> None:
    rig = Rig(slots=1, follow=endless)
    running = rig.submit([1, 2])
    waiting = rig.submit([5, 6])
    rig.turn(2)
    rig.engine.cancel(waiting)
    rig.turn()
    assert rig.kinds(waiting) == ["done"]
    assert rig.done(waiting)["finish_reason"] == "cancel"
    assert rig.final(running) is None  # the other goes on


def test_cancel_mid_prompt_keeps_the_prefix_read() -> None:
    rig = Rig(slots=2, follow=endless, step_budget=(0.0, 16))
    stream = rig.submit([1, 2])
    rig.turn(2)  # generating: a long prompt beside it is read 16 tokens a step
    long = rig.submit(list(range(1, 101)))
    rig.turn(3)
    slot = next(s for s in rig.engine.slots if s.seq is not None and s.seq.id == long)
    rig.engine.cancel(long)
    rig.turn()
    assert rig.done(long)["finish_reason"] == "cancel"
    assert 0 < len(slot.tokens) < 100 and slot.tokens == list(range(1, len(slot.tokens) + 1))
    assert rig.ctx.cells[slot.seq_id] == slot.tokens
    assert rig.final(stream) is None


def cache(min_tokens: int = 16) -> PromptCache:
    return PromptCache(None, "fake", max_bytes=1 << 20, ram_bytes=1 << 20,
                       min_tokens=min_tokens, n_vocab=512)


def test_a_long_prompt_is_saved_and_restored_into_another_slot_state() -> None:
    pc = cache()
    rig = Rig(slots=1, n_vocab=512, n_ctx=512, prompt_cache=pc)
    prompt = list(range(1, 201))
    first = rig.submit(prompt, max_tokens=2)
    rig.run(first)
    assert pc.covers(prompt)  # kept once the prompt was read
    other = rig.submit(list(range(300, 340)), max_tokens=1)  # the slot now holds another
    rig.run(other)
    assert rig.ctx.cells[0][:40] == list(range(300, 340))
    again = rig.submit([*prompt, 400, 401], max_tokens=1)
    rig.run(again)
    assert rig.started(again)["cached_tokens"] == 200  # from the saved state
    assert rig.ctx.cells[0][:202] == [*prompt, 400, 401]
    assert rig.engine.slots[0].tokens == rig.ctx.cells[0]
    pc.close()


def test_a_prompt_is_saved_at_its_save_point_and_restored_up_to_it() -> None:
    pc = cache()
    rig = Rig(slots=1, n_vocab=512, n_ctx=512, prompt_cache=pc)
    prompt = list(range(1, 201))
    first = rig.submit(prompt, max_tokens=1, save_at=150)
    rig.run(first)
    assert pc.covers(prompt[:150]) and not pc.covers(prompt)
    rig.run(rig.submit(list(range(300, 340)), max_tokens=1))
    again = rig.submit([*prompt[:150], 450], max_tokens=1)
    rig.run(again)
    assert rig.started(again)["cached_tokens"] == 150
    pc.close()


def test_a_small_gain_is_not_worth_a_restore() -> None:
    pc = cache()
    rig = Rig(slots=1, n_vocab=512, n_ctx=512, prompt_cache=pc)
    prompt = list(range(1, 101))
    rig.run(rig.submit(prompt, max_tokens=1))
    # the slot still holds 60 of the prompt: the saved 100 give only 40 more (under 64)
    rig.run(rig.submit([*prompt[:60], 300], max_tokens=1))
    again = rig.submit([*prompt, 301], max_tokens=1)
    rig.run(again)
    assert rig.started(again)["cached_tokens"] == 60
    pc.close()


def test_a_short_or_mostly_cached_prompt_is_not_saved() -> None:
    pc = cache(min_tokens=32)
    rig = Rig(slots=1, n_vocab=512, n_ctx=512, prompt_cache=pc)
    rig.run(rig.submit(list(range(1, 21)), max_tokens=1))
    assert not pc.covers(list(range(1, 21)))
    rig.run(rig.submit(list(range(1, 41)), max_tokens=1))  # 20 new tokens of 40
    assert not pc.covers(list(range(1, 41)))
    pc.close()
