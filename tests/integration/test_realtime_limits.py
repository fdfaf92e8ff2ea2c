"""A hostile client of the realtime transcription session (/v1/realtime), through the real
daemon and the `websockets` client the audio tests use: floods, too many sessions, events
that break every parser, reconnect loops, sound without end. Each must get an OpenAI
`error` event (the session going on where the event alone was bad) or a close code that
says why, never unbounded memory, a dead session or a crash.

The daemon runs with small bounds (tests/conftest.Daemon's env) so each is reached in a
few events; each test uses an API key of its own, as each is a client of its own.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.conftest import Daemon, make_home
from tests.fakes.audio import noise, pcm16, write_projector

RT_RATE = 24_000
KEYS = ["flood", "pending", "bad", "rate", "audio", "a", "b", "c"]
LIMITS = {
    "LLMRUN_API_KEYS": ",".join(KEYS),
    "LLMRUN_RATE_LIMIT": "10",  # requests (and handshakes) a minute per key
    "LLMRUN_REALTIME_RATE": "40",  # events a second per session, a burst of 80
    "LLMRUN_REALTIME_MAX_AUDIO": "8s",
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    from llmrun.store import Store

    home = make_home(tmp_path_factory.mktemp("realtime-limits"), smollm2_path)
    mmproj = write_projector(home / "mmproj-audio.gguf")
    Store(home).create("ears", f"FROM {smollm2_path}\nFROM {mmproj}\n")
    d = Daemon(home, env=LIMITS).start()
    yield d
    d.stop()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def realtime(d: Daemon, key: str, **options: Any) -> ClientConnection:
    return connect(d.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
                   additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30,
                   max_size=None, **options)


def send(ws: ClientConnection, kind: Any, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def recv(ws: ClientConnection) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(ws.recv(timeout=120))
    return event


def until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    out = [recv(ws)]
    while out[-1]["type"] != kind:
        out.append(recv(ws))
    return out


def closed_code(ws: ClientConnection) -> int:
    """Read until the server closes; its close code."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=60)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code


@contextlib.contextmanager
def session(d: Daemon, key: str, model: str | None = "ears") -> Iterator[ClientConnection]:
    with realtime(d, key) as ws:
        assert recv(ws)["type"] == "transcription_session.created"
        if model:
            send(ws, "transcription_session.update",
                 session={"input_audio_transcription": {"model": model}})
            assert recv(ws)["type"] == "transcription_session.updated"
        yield ws


def test_a_flood_of_appends_is_closed_at_the_session_rate(limited: Daemon) -> None:
    """Appends as fast as the client can write them, none of its events read: past the
    session's rate (40 a second, a burst of 80) the session says so and closes (1008),
    long before 2000 events; nothing waits on a client that does not read."""
    chunk = b64(bytes(2 * 480))  # 20 ms of silence
    with realtime(limited, "flood", max_queue=None) as ws:
        sent = 0
        with contextlib.suppress(ConnectionClosed):
            for sent in range(1, 2001):  # noqa: B007 (counted for the assertion)
                send(ws, "input_audio_buffer.append", audio=chunk)
        events = []
        with contextlib.suppress(ConnectionClosed):
            while True:
                events.append(recv(ws))
        assert ws.close_code == 1008
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert errors and errors[-1]["code"] == "rate_limit_exceeded", events[-3:]
    assert "LLMRUN_REALTIME_RATE" in errors[-1]["message"]
    # and the daemon serves the next client
    with session(limited, "a", model=None):
        pass


def test_commits_faster_than_transcribed_are_refused_not_queued(limited: Daemon) -> None:
    """Twelve utterances committed at once, without reading: at most four wait (each holds
    its sound), the rest get `too_many_pending_commits` and the buffer is kept; the
    session goes on, and once the transcripts arrive a commit is taken again."""
    sound = b64(pcm16(noise(0.3, rate=RT_RATE)))
    with session(limited, "pending") as ws:
        for _ in range(12):
            send(ws, "input_audio_buffer.append", audio=sound)
            send(ws, "input_audio_buffer.commit")
        events: list[dict[str, Any]] = []

        def count(kind: str) -> int:
            return sum(e["type"] == kind for e in events)

        while count("input_audio_buffer.committed") + count("error") < 12 \
                or count("conversation.item.input_audio_transcription.completed") \
                < count("input_audio_buffer.committed"):
            events.append(recv(ws))
        committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
        refused = [e["error"] for e in events if e["type"] == "error"]
        assert refused and {r["code"] for r in refused} == {"too_many_pending_commits"}
        assert len(committed) + len(refused) == 12
        # the transcripts are in: a commit is taken again
        send(ws, "input_audio_buffer.append", audio=sound)
        send(ws, "input_audio_buffer.commit")
        done = until(ws, "conversation.item.input_audio_transcription.completed")
        assert done[0]["type"] == "input_audio_buffer.committed"


def test_events_that_break_the_parsers_are_errors_and_the_session_goes_on(
        limited: Daemon) -> None:
    update = "transcription_session.update"
    td = "session.turn_detection"
    hostile: list[tuple[str | bytes, str, str | None]] = [  # (frame, code, param)
        ("not json{", "invalid_json", None),
        ('{"type": "input_audio_buffer.append", "audio": NaN}', "invalid_json", None),
        ('{"type": "x", "n": 1e400}', "invalid_json", None),
        ("[" * 5000 + "]" * 5000, "invalid_json", None),
        ("[1, 2]", "invalid_event", None),
        (b"\x00\x01binary", "invalid_event", None),
        (json.dumps({"type": 5}), "invalid_type", "type"),
        (json.dumps({"type": ["session.update"]}), "invalid_type", "type"),
        (json.dumps({"type": "response.create"}), "unknown_event", "type"),
        (json.dumps({"type": update, "session": "yes"}), "invalid_type", "session"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "silence_duration_ms": "abc"}}}), "invalid_type", f"{td}.silence_duration_ms"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "silence_duration_ms": 10 ** 30}}}), "invalid_value", f"{td}.silence_duration_ms"),
        ('{"type": "' + update + '", "session": {"turn_detection": {"silence_duration_ms": '
         + str(10 ** 400) + "}}}", "invalid_json", None),  # past a double: infinity
        (json.dumps({"type": update, "session": {"turn_detection": {
            "silence_duration_ms": -1}}}), "invalid_value", f"{td}.silence_duration_ms"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "silence_duration_ms": True}}}), "invalid_type", f"{td}.silence_duration_ms"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "silence_duration_ms": 2.5}}}), "invalid_type", f"{td}.silence_duration_ms"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "threshold": "high"}}}), "invalid_type", f"{td}.threshold"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "threshold": 1e308}}}), "invalid_value", f"{td}.threshold"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "prefix_padding_ms": {}}}}), "invalid_type", f"{td}.prefix_padding_ms"),
        (json.dumps({"type": update, "session": {"turn_detection": {
            "type": "semantic_vad"}}}), "invalid_value", f"{td}.type"),
        (json.dumps({"type": update, "session": {"turn_detection": "on"}}), "invalid_type",
         td),
        (json.dumps({"type": update, "session": {"input_audio_transcription": [1]}}),
         "invalid_type", "session.input_audio_transcription"),
        (json.dumps({"type": update, "session": {"input_audio_transcription": {
            "model": {"name": "ears"}}}}), "invalid_type",
         "session.input_audio_transcription.model"),
        (json.dumps({"type": update, "session": {"input_audio_transcription": {
            "language": ["en"]}}}), "invalid_type", "session.input_audio_transcription.language"),
        (json.dumps({"type": update, "session": {"input_audio_transcription": {
            "prompt": "x" * 100_000}}}), "invalid_value",
         "session.input_audio_transcription.prompt"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": 123}), "invalid_type",
         "audio"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_value",
         "audio"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "AQ=="}), "invalid_value",
         "audio"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "\ud800"}),
         "invalid_json", None),
        (json.dumps({"type": "input_audio_buffer.append", "audio": b64(bytes(200))}) [:-2]
         + "}", "invalid_json", None),
    ]
    with session(limited, "bad") as ws:
        for n, (frame, code, param) in enumerate(hostile):
            if isinstance(frame, str) and frame.startswith("{"):
                with contextlib.suppress(ValueError):  # name the event, when it is one
                    frame = json.dumps({**json.loads(frame), "event_id": f"evt_{n}"})
            ws.send(frame)
            event = recv(ws)
            assert event["type"] == "error", (frame, event)
            error = event["error"]
            assert error["type"] == "invalid_request_error"
            assert (error["code"], error["param"]) == (code, param), (frame, error)
            assert error["message"]
            if code not in ("invalid_json", "invalid_event"):  # an event it could read
                assert error["event_id"] == f"evt_{n}"
        # none of it changed the session: a good update and a good utterance work
        send(ws, "transcription_session.update", session={"turn_detection": {
            "type": "server_vad", "silence_duration_ms": 400, "threshold": 0.5}})
        got = recv(ws)
        assert got["type"] == "transcription_session.updated", got
        assert got["session"]["turn_detection"]["silence_duration_ms"] == 400
        assert got["session"]["input_audio_transcription"]["model"] == "ears"
        send(ws, "input_audio_buffer.append", audio=b64(pcm16(noise(0.5, rate=RT_RATE))))
        send(ws, "input_audio_buffer.commit")
        events = until(ws, "conversation.item.input_audio_transcription.completed")
        assert not [e for e in events if e["type"] == "error"], events


def test_handshakes_count_against_the_rate_limit(limited: Daemon) -> None:
    """LLMRUN_RATE_LIMIT=10: five HTTP requests and five handshakes spend the key's bucket;
    the next handshake is a 429 with Retry-After, in OpenAI's error shape."""
    headers = {"Authorization": "Bearer rate"}
    start = time.monotonic()
    for _ in range(5):
        assert httpx.get(limited.url + "/v1/models", headers=headers).status_code == 200
    opened = 0
    with pytest.raises(InvalidStatus) as refused:
        for opened in range(20):  # noqa: B007 (counted for the assertion)
            with realtime(limited, "rate"):
                pass
    # the HTTP requests spent half the bucket (a token comes back every 6 s)
    assert opened <= 5 + (time.monotonic() - start) / 6
    response = refused.value.response
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) >= 1
    body = json.loads(response.body or b"{}")
    assert "LLMRUN_RATE_LIMIT" in body["error"]["message"]
    # another key's bucket is its own
    with session(limited, "b", model=None):
        pass


def test_sound_over_a_sessions_life_is_bounded(limited: Daemon) -> None:
    """LLMRUN_REALTIME_MAX_AUDIO=8s: clearing the buffer does not reset the total; the
    append past it gets `session_audio_limit` and the session is closed (1008)."""
    three = b64(pcm16(noise(3.0, rate=RT_RATE)))
    with session(limited, "audio", model=None) as ws:
        for _ in range(2):
            send(ws, "input_audio_buffer.append", audio=three)
            send(ws, "input_audio_buffer.clear")
            assert recv(ws)["type"] == "input_audio_buffer.cleared"
        send(ws, "input_audio_buffer.append", audio=three)
        error = recv(ws)["error"]
        assert error["code"] == "session_audio_limit"
        assert "8 s" in error["message"] and "LLMRUN_REALTIME_MAX_AUDIO" in error["message"]
        assert closed_code(ws) == 1008


def test_sessions_are_counted_per_client_and_in_all(tmp_path: Path,
                                                    smollm2_path: Path) -> None:
    """Two sessions per key, three in all: a client's third is refused (1013) while another
    client still opens one; then the daemon's cap refuses every client."""
    d = Daemon(make_home(tmp_path, smollm2_path), env={
        "LLMRUN_API_KEYS": "a,b,c", "LLMRUN_REALTIME_SESSIONS": "3",
        "LLMRUN_REALTIME_SESSIONS_PER_CLIENT": "2"}).start()
    try:
        with session(d, "a", model=None), session(d, "a", model=None):
            with realtime(d, "a") as third:
                error = recv(third)["error"]
                assert error["code"] == "too_many_sessions"
                assert "LLMRUN_REALTIME_SESSIONS_PER_CLIENT" in error["message"]
                assert closed_code(third) == 1013
            # another client has room; then the daemon's three are open
            with session(d, "b", model=None), realtime(d, "c") as fourth:
                error = recv(fourth)["error"]
                assert error["code"] == "too_many_sessions"
                assert "LLMRUN_REALTIME_SESSIONS)" in error["message"]
                assert closed_code(fourth) == 1013
    finally:
        d.stop()
