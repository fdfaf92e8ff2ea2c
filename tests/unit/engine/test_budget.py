"""The thinking budget (engine/budget.py): the thought's tokens counted from its opener, the
end marker forced once the budget is spent, and the answer after it; through the engine over
the fake model (token t reads "<t>", each token followed by the next), where a budgeted
sequence changes nothing of its neighbours' tokens in the same batch."""

from __future__ import annotations

import random

from llmrun.engine.budget import ThoughtBudget
from tests.fakes.engine import Rig

CLOSE = [60, 61]  # the end marker's tokens: "<60><61>"


def budget(limit: int, opener: bytes | None = b"<4>") -> ThoughtBudget:
    return ThoughtBudget(limit, list(CLOSE), b"<60><61>", opener)


def feed(b: ThoughtBudget, pieces: list[bytes]) -> list[int | None]:
    """What the budget forces after each piece."""
    out = []
    for p in pieces:
        b.feed(0, p)
        out.append(b.forced())
    return out


def test_the_thought_is_counted_from_its_opener_and_closed_at_the_limit() -> None:
    b = budget(2)
    assert feed(b, [b"  ", b"<4", b">"]) == [None, None, None]
    assert b.state == "inside" and b.used == 0
    assert feed(b, [b"a", b"b"]) == [None, 60]
    assert b.state == "closing" and b.active
    assert feed(b, [b"<60>", b"<61>"]) == [61, None]
    assert b.state == "after" and not b.active
    assert feed(b, [b"x"] * 5) == [None] * 5  # the answer: nothing more forced


def test_a_thought_the_model_ends_itself_is_left_alone() -> None:
    b = budget(3)
    assert feed(b, [b"<4>hm", b"<60", b"><61>", b"more", b"more", b"more"]) == [None] * 6
    assert b.state == "after" and b.used == 3  # ended at its limit, by the model itself


def test_an_answer_without_a_thought_has_nothing_to_end() -> None:
    b = budget(1)
    assert feed(b, [b"\n", b"Hello", b"x", b"y"]) == [None] * 4
    assert b.state == "after"
    b = budget(1)
    assert feed(b, [b"<", b"5>"]) == [None, None] and b.state == "after"  # not the opener


def test_a_thought_the_prompt_opened_counts_from_the_first_token() -> None:
    b = budget(3, opener=None)
    assert feed(b, [b"a", b"b", b"c"]) == [None, None, 60]


def test_one_piece_holding_the_opener_and_more() -> None:
    b = budget(2)
    assert feed(b, [b"<4>and thought"]) == [None]  # a token of the thought already
    assert feed(b, [b"x"]) == [60]
    b = budget(1)
    assert feed(b, [b"<4>"]) == [None]  # the opener alone is not
    assert feed(b, [b"x"]) == [60]


def run_engine(budgets: dict[int, ThoughtBudget | None],
               prompts: list[list[int]]) -> list[str]:
    rig = Rig(slots=len(prompts), n_vocab=64)
    rids = [rig.submit(p, max_tokens=12, budget=budgets.get(i)) for i, p in enumerate(prompts)]
    rig.run(*rids)
    return [rig.text(r) for r in rids]


def test_the_engine_forces_the_end_marker_then_the_answer_follows() -> None:
    [text] = run_engine({0: budget(3)}, [[1, 2, 3]])
    # thought <5><6><7> (3 tokens after the opener <4>), the marker forced, the rest sampled
    assert text == "<4><5><6><7><60><61><62><63>"
    [free] = run_engine({}, [[1, 2, 3]])
    assert free == "".join(f"<{t}>" for t in range(4, 16))


def test_a_budgeted_sequence_leaves_its_batch_neighbours_as_they_were() -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    prompts[0] = [1, 2, 3]
    alone = run_engine({}, prompts)
    budgeted = run_engine({0: budget(2)}, prompts)
    assert budgeted[0] == "<4><5><6><60><61><62><63>" != alone[0]
    assert budgeted[1:] == alone[1:]


def test_markers_split_any_way_are_found() -> None:
    """The opener and the model's own end marker, in pieces cut anywhere (tokens of any
    size, unicode around them): the thought opens and ends the same."""
    rng = random.Random(3)
    text = "\n <4>Zürich ✓ thinks<60><61>Antwort".encode()
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(1, 12)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        b = budget(10_000)
        assert feed(b, pieces) == [None] * len(pieces)
        assert b.state == "after" and 0 < b.used <= len(pieces)
    one = budget(10_000)
    feed(one, [bytes([c]) for c in text])  # byte by byte
    assert one.state == "after"
