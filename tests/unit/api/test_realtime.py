"""The realtime session's bounded parts, without a daemon: what it holds (jobs, events
waiting), who it admits, and the number checks that replaced `int()` on client input."""

from __future__ import annotations

import asyncio

import pytest

from llmrun.api.openai import realtime, realtimesession
from llmrun.api.openai.realtimesession import (
    INBOX_EVENTS,
    MAX_PENDING,
    Inbox,
    Jobs,
    Refused,
    Session,
    Sessions,
)


def test_a_waiting_read_is_replaced_by_a_newer_one() -> None:
    """A thousand pieces read while the model is busy leave one read waiting, the newest
    (it holds every piece the others would have read), and the commits behind it in order."""
    jobs = Jobs()
    for n in range(1000):
        jobs.read(f"wav{n}")
    jobs.commit("item1", "utterance")
    jobs.read("next")
    assert list(jobs.items) == [(None, "wav999"), ("item1", "utterance"), (None, "next")]
    assert jobs.pending == 1
    assert asyncio.run(jobs.next()) == (None, "wav999")


def test_the_inbox_is_bounded_and_a_bound_jumps_the_queue() -> None:
    inbox = Inbox()
    for _ in range(INBOX_EVENTS):
        assert not inbox.full(10)
        inbox.put({"type": "input_audio_buffer.append"}, 10)
    assert inbox.full(10)
    assert Inbox().full(realtimesession.INBOX_CHARS + 1)
    inbox.halt(Refused("flood", code="too_many_events", close=1008))
    got = asyncio.run(inbox.get())
    assert isinstance(got, Refused) and got.code == "too_many_events"


def test_sessions_per_client_and_in_all() -> None:
    s = Sessions()
    assert s.admit("key:a", 3, 2) is None
    assert s.admit("key:a", 3, 2) is None
    assert "PER_CLIENT" in (s.admit("key:a", 3, 2) or "")
    assert s.admit("key:b", 3, 2) is None
    assert "LLMRUN_REALTIME_SESSIONS)" in (s.admit("key:c", 3, 2) or "")
    s.leave("key:a")
    assert s.admit("key:c", 3, 2) is None
    for client in ("key:a", "key:b", "key:c"):
        s.leave(client)
    assert not s.open  # nothing left behind for clients gone


@pytest.mark.parametrize("value, code", [
    ("abc", "invalid_type"), (True, "invalid_type"), (2.5, "invalid_type"), ([], "invalid_type"),
    (10 ** 400, "invalid_value"), (1e300, "invalid_value"), (-1, "invalid_value"),
    (float("nan"), "invalid_type"),
])
def test_a_bad_silence_is_refused_and_changes_nothing(value: object, code: str) -> None:
    s = Session(model="ears")
    with pytest.raises(Refused) as refused:
        s.update({"input_audio_transcription": {"language": "fr"},
                  "turn_detection": {"silence_duration_ms": value}})
    assert refused.value.code == code
    assert refused.value.param == "session.turn_detection.silence_duration_ms"
    assert (s.vad, s.language, s.silence_ms) == (False, None, realtimesession.VAD_SILENCE_MS)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.1, 1.5, 10 ** 400])
def test_a_bad_threshold_is_refused(value: object) -> None:
    with pytest.raises(Refused) as refused:
        Session().update({"turn_detection": {"threshold": value}})
    assert refused.value.param == "session.turn_detection.threshold"


def test_commits_wait_at_most_max_pending() -> None:
    async def go() -> list[str]:
        s, jobs, codes = Session(model="ears"), Jobs(), []

        class Quiet:
            async def send_json(self, event: object) -> None:
                pass

        for _ in range(MAX_PENDING + 3):
            s.append("AAAA" * 2000)  # 6000 samples: 250 ms
            try:
                await realtime._commit(Quiet(), s, jobs)  # type: ignore[arg-type]
                codes.append("committed")
            except Refused as exc:
                codes.append(exc.code)
        return codes

    codes = asyncio.run(go())
    assert codes == ["committed"] * MAX_PENDING + ["too_many_pending_commits"] * 3
