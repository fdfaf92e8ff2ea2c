"""The step loop over a fake model (tests/fakes/engine.py): the prompt budget beside
generating streams, the split decode of a mixed step, and a decode that fails."""

from __future__ import annotations

import threading
from typing import Any

from tests.fakes.engine import Rig
from tests.unit.engine.test_slots import endless


def prompt_rows(rig: Rig, seq: int) -> list[int]:
    """Rows of sequence `seq` in each decode that read more than one of its rows."""
    counts = [sum(s == seq for s, _, _ in rows) for rows in rig.ctx.decoded]
    return [n for n in counts if n > 1]


def test_a_long_prompt_is_read_in_chunks_beside_a_stream() -> None:
    rig = Rig(slots=2, follow=endless, step_budget=(0.0, 16))
    stream = rig.submit([1, 2])
    rig.turn(2)
    long = rig.submit(list(range(1, 101)))
    rig.turn()
    slot = next(s for s in rig.engine.slots if s.seq is not None and s.seq.id == long)
    generated = len(rig.text(stream))
    steps = 0
    while rig.started(long) and not any(k == "chunk" for k in rig.kinds(long)):
        rig.turn()
        steps += 1
        assert len(rig.text(stream)) > generated, "the stream stalled behind the prompt"
        generated = len(rig.text(stream))
    # 16 tokens a step while the other generates: 100 tokens take 7 steps
    assert prompt_rows(rig, slot.seq_id) == [16] * 6 + [4]
    assert 6 <= steps <= 7
    progress = [p["processed"] for k, p in rig.events[long] if k == "progress"]
    assert progress == [16, 32, 48, 64, 80, 96]
    assert rig.engine.stats.mixed_steps == 7
    assert rig.engine.stats.budget_tokens == 16


def test_a_mixed_step_decodes_the_stream_first_and_the_prompt_apart() -> None:
    rig = Rig(slots=2, follow=endless, step_budget=(0.0, 16))
    rig.submit([1, 2])
    rig.turn(2)
    long = rig.submit(list(range(1, 101)))
    n = len(rig.ctx.decoded)
    rig.turn(2)
    stream_slot = next(s.seq_id for s in rig.engine.slots if s.seq and s.seq.id != long)
    split = rig.ctx.decoded[n:]
    # each step: one decode of the generating row, then one of the prompt's chunk
    assert [s for s, _, _ in split[0]] == [stream_slot]
    assert len(split[1]) == 16 and all(s != stream_slot for s, _, _ in split[1])


def test_alone_a_prompt_is_read_in_batches() -> None:
    rig = Rig(slots=2, follow=endless, context={"n_batch": 32})
    rid = rig.submit(list(range(1, 101)), max_tokens=1)
    rig.run(rid)
    assert prompt_rows(rig, 0) == [32, 32, 32, 4]
    assert rig.engine.stats.mixed_steps == 0


def test_a_short_prompt_that_fits_goes_before_a_long_one() -> None:
    rig = Rig(slots=3, follow=endless, step_budget=(0.0, 16))
    rig.submit([1, 2])
    rig.turn(2)
    long = rig.submit(list(range(1, 101)), max_tokens=1)
    rig.turn()
    short = rig.submit([5, 6, 7, 8], max_tokens=1)
    rig.run(short)
    assert rig.final(long) is None  # the short one passed the long one still being read


def test_a_failed_decode_fails_the_requests_in_flight_and_forgets_the_slots() -> None:
    rig = Rig(slots=2, follow=endless)
    a, b = rig.submit([1, 2, 3]), rig.submit([7, 8])
    rig.turn(2)
    rig.ctx.fail_next = 1
    rig.turn()
    for rid in (a, b):
        kind, payload = rig.final(rid) or ("", {})
        assert kind == "error" and "KV cache is full" in payload["message"]
    assert all(s.seq is None and s.tokens == [] for s in rig.engine.slots)
    assert rig.ctx.cells == [[], []]
    after = rig.submit([1, 2, 3], max_tokens=1)
    rig.run(after)
    assert rig.started(after)["cached_tokens"] == 0


def test_the_step_counters_go_out_when_a_sequence_ends() -> None:
    rig = Rig(slots=1)
    rig.run(rig.submit([1, 2, 3], max_tokens=3))
    assert rig.stats and rig.stats[-1]["steps"] == rig.engine.stats.steps >= 3
    assert rig.stats[-1]["prompt_tokens"] == 3


def test_the_engine_thread_answers_and_stops() -> None:
    rig = Rig(slots=2)
    done = threading.Event()
    emit = rig.engine.emit

    def emit_and_tell(events: list[tuple[str, str, Any]]) -> None:
        emit(events)
        if all(rig.final(r) is not None for r in ("r1", "r2")):
            done.set()

    rig.engine.emit = emit_and_tell
    rig.engine.start()
    try:
        rig.submit([1, 2], max_tokens=3)
        rig.submit([5], max_tokens=2)
        assert done.wait(10)
    finally:
        rig.engine.stop()
    assert rig.text("r1") == "<3><4><5>" and rig.text("r2") == "<6><7>"
    assert not rig.engine._thread.is_alive()


def test_a_failing_step_fails_every_request_and_reports_the_fault() -> None:
    rig = Rig(slots=1, follow=endless)
    fatal: list[BaseException] = []
    ended = threading.Event()

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        ended.set()

    def broken_step() -> None:
        raise RuntimeError("a bug in the step")

    rig.engine.on_fatal = on_fatal
    rig.engine._step = broken_step  # type: ignore[method-assign]
    running, waiting = rig.submit([1, 2]), rig.submit([3])
    rig.engine.start()
    try:
        assert ended.wait(10)
    finally:
        rig.engine.stop()
    assert isinstance(fatal[0], RuntimeError)
    for rid in (running, waiting):
        kind, payload = rig.final(rid) or ("", {})
        assert kind == "error" and payload["code"] == "runner_failed"
