"""Sound in chat, through the real daemon and the official SDKs.

A model made of SmolLM2 and tests/fakes/audio.py's tiny random audio projector (two FROM
lines, as a vision model is made): the store tells it by its GGUF (`show` lists `audio`), the
same sound gives the same greedy answer and another sound another, its positions count in the
usage, and what cannot be heard is a 400 naming why, while the runner goes on serving.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llmrun.media import SOUND_PIECE_SECONDS, piece_frames
from tests.conftest import Daemon, make_home
from tests.fakes.audio import (
    adpcm_wav,
    mp3_bomb,
    mp3_resync_bomb,
    n_positions,
    noise,
    not_audio,
    pcm16,
    silence,
    sine,
    truncated_wav,
    wav,
    wav_384khz,
    wav_long_header,
    write_projector,
)

GREEDY = {"temperature": 0.0, "seed": 1}


@pytest.fixture(scope="module")
def audio_daemon(tmp_path_factory: pytest.TempPathFactory,
                 smollm2_path: Path) -> Iterator[Daemon]:
    from llmrun.store import Store

    home = make_home(tmp_path_factory.mktemp("audio-home"), smollm2_path)
    mmproj = write_projector(home / "mmproj-audio.gguf")
    Store(home).create("ears", f"FROM {smollm2_path}\nFROM {mmproj}\n")
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oa(audio_daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=audio_daemon.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ask_openai(oa: openai.OpenAI, sound: bytes, fmt: str = "wav",
               model: str = "ears") -> tuple[str, int]:
    r = oa.chat.completions.create(
        model=model, max_tokens=8, **GREEDY,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What do you hear?"},
            {"type": "input_audio", "input_audio": {"data": b64(sound), "format": fmt}}]}])
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def test_openai_input_audio_reaches_the_model(oa: openai.OpenAI) -> None:
    tone, n_tone = ask_openai(oa, wav(sine(440.0, 1.0)))
    again, _ = ask_openai(oa, wav(sine(440.0, 1.0)))
    other, n_other = ask_openai(oa, wav(noise(2.0)))
    assert tone == again and other != tone
    # the sound's positions are in the prompt: 2 s take more of them than 1 s
    assert n_other - n_tone == n_positions(2.0) - n_positions(1.0)


def test_show_lists_audio_not_vision(audio_daemon: Daemon) -> None:
    caps = httpx.post(audio_daemon.url + "/api/show", json={"model": "ears"}).json()
    assert "audio" in caps["capabilities"] and "vision" not in caps["capabilities"]
    caps = httpx.post(audio_daemon.url + "/api/show", json={"model": "smollm2"}).json()
    assert "audio" not in caps["capabilities"]


def test_sound_to_a_model_that_cannot_hear_is_400_naming_it(oa: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"smollm2.*no audio projector"):
        ask_openai(oa, wav(sine(440.0, 0.5)), model="smollm2")
    with pytest.raises(openai.BadRequestError, match="format"):
        ask_openai(oa, wav(sine(440.0, 0.5)), fmt="ogg")


def test_anthropic_has_no_audio_blocks(audio_daemon: Daemon) -> None:
    with anthropic.Anthropic(base_url=audio_daemon.url, api_key="x", max_retries=0) as an, \
            pytest.raises(anthropic.BadRequestError, match="no audio blocks"):
        an.messages.create(model="ears", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "audio", "source": {"type": "base64", "data": b64(wav(sine(1.0, 0.5)))}},
        ]}])  # type: ignore[list-item]


# each hostile file and the words its 400 must hold: in chat and in the transcription form
HOSTILE_SOUNDS = [
    (truncated_wav(), "truncated"),
    (wav_long_header(), "7200 s"),
    (wav_384khz(), "384000 Hz"),
    (mp3_bomb(), "declares"),
    (not_audio(), "not a sound file"),
    (adpcm_wav(), r"format 0x0002 \(MS ADPCM\)"),  # a coding whose length is not its header's
    (mp3_resync_bomb(), "declares"),  # hours of frames after a junk byte
]


@pytest.mark.parametrize("bad, words", HOSTILE_SOUNDS)
def test_hostile_sounds_are_400_and_the_runner_serves_on(oa: openai.OpenAI, bad: bytes,
                                                         words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words):
        ask_openai(oa, bad, fmt="mp3" if bad[:1] == b"\xff" else "wav")
    assert ask_openai(oa, wav(sine(440.0, 1.0)))[0]  # the same runner answers


def test_responses_and_ollama_carry_sound_as_chat_completions_does(
        audio_daemon: Daemon, oa: openai.OpenAI) -> None:
    tone = wav(sine(440.0, 1.0))
    expected, _ = ask_openai(oa, tone)
    r = oa.responses.create(model="ears", max_output_tokens=8, temperature=0.0, input=[{
        "role": "user", "content": [
            {"type": "input_text", "text": "What do you hear?"},
            {"type": "input_audio", "input_audio": {"data": b64(tone), "format": "wav"}}]}],
    )  # type: ignore[list-item]
    assert r.output_text == expected
    body = {"model": "ears", "stream": False, "options": {**GREEDY, "num_predict": 8},
            "messages": [{"role": "user", "content": "What do you hear?",
                          "audio": [b64(tone)]}]}
    out = httpx.post(audio_daemon.url + "/api/chat", json=body, timeout=120).json()
    assert out["message"]["content"] == expected


# -- /v1/audio/transcriptions and /v1/audio/translations ------------------------------------


def transcribe(oa: openai.OpenAI, sound: bytes, name: str = "tone.wav", **kw: Any) -> Any:
    return oa.audio.transcriptions.create(model="ears", file=(name, sound), **kw)


def test_transcription_is_the_model_hearing_the_file(oa: openai.OpenAI) -> None:
    tone, other = wav(sine(440.0, 1.0)), wav(noise(1.0))
    first = transcribe(oa, tone)
    assert first.text and first.text == transcribe(oa, tone).text
    assert transcribe(oa, other).text != first.text
    assert first.usage.type == "tokens" and first.usage.input_tokens > n_positions(1.0)
    # a translation asks the model something else about the same sound
    translated = oa.audio.translations.create(model="ears", file=("tone.wav", tone))
    assert translated.text and translated.text != first.text


def test_every_response_format_has_its_shape(oa: openai.OpenAI) -> None:
    tone = wav(sine(440.0, 1.5))
    text = transcribe(oa, tone).text
    assert transcribe(oa, tone, response_format="text") == text + "\n"
    assert transcribe(oa, tone, response_format="srt") == \
        f"1\n00:00:00,000 --> 00:00:01,500\n{text}\n\n"
    assert transcribe(oa, tone, response_format="vtt") == \
        f"WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n{text}\n\n"
    verbose = transcribe(oa, tone, response_format="verbose_json", language="en")
    # (the language is in the instruction: compare with the same request's json answer)
    assert (verbose.text, verbose.duration, verbose.language) == \
        (transcribe(oa, tone, language="en").text, 1.5, "en")
    assert verbose.segments is not None and len(verbose.segments) == 1
    assert (verbose.segments[0].start, verbose.segments[0].end) == (0.0, 1.5)


def test_streamed_transcription_adds_up_to_the_whole(oa: openai.OpenAI) -> None:
    tone = wav(sine(440.0, 1.0))
    whole = transcribe(oa, tone).text
    events = list(transcribe(oa, tone, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert events[-1].text == whole
    assert "".join(e.delta for e in events[:-1]).strip() == whole


def test_transcription_form_errors_name_the_field(audio_daemon: Daemon,
                                                  oa: openai.OpenAI) -> None:
    tone = wav(sine(440.0, 0.5))
    with pytest.raises(openai.BadRequestError, match="response_format"):
        transcribe(oa, tone, response_format="docx")
    with pytest.raises(openai.BadRequestError, match="json or text"):
        transcribe(oa, tone, response_format="srt", stream=True)
    with pytest.raises(openai.BadRequestError, match="no audio projector"):
        oa.audio.transcriptions.create(model="smollm2", file=("t.wav", tone))
    url = audio_daemon.url + "/v1/audio/transcriptions"
    r = httpx.post(url, data={"model": "ears"})  # a urlencoded form
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    r = httpx.post(url, files={"model": (None, "ears")})  # a form without its file
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


@pytest.mark.parametrize("bad, words", HOSTILE_SOUNDS)
def test_hostile_files_are_400_beside_an_untouched_stream(oa: openai.OpenAI, bad: bytes,
                                                          words: str) -> None:
    stream = oa.chat.completions.create(
        model="ears", max_tokens=24, stream=True, **GREEDY,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Tell me a story."}])
    chunks = iter(stream)
    first = next(chunks)
    with pytest.raises(openai.BadRequestError, match=words):
        transcribe(oa, bad, name="bad.wav")
    rest = list(chunks)
    assert [c.choices[0].finish_reason for c in [first, *rest] if c.choices][-1] == "length"
    assert transcribe(oa, wav(sine(440.0, 1.0))).text  # the runner serves on


def test_the_cli_prints_the_transcript(audio_daemon: Daemon, oa: openai.OpenAI,
                                       tmp_path: Path) -> None:
    tone = wav(sine(440.0, 1.5))
    (tmp_path / "tone.wav").write_bytes(tone)
    env = {**os.environ, "LLMRUN_HOME": str(audio_daemon.home),
           "LLMRUN_HOST": f"127.0.0.1:{audio_daemon.port}"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmrun", "transcribe", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    text = transcribe(oa, tone).text
    out = cli("ears", str(tmp_path / "tone.wav"))
    assert out.returncode == 0 and out.stdout == text + "\n", out.stderr
    out = cli("ears", str(tmp_path / "tone.wav"), "--format", "srt")
    assert out.stdout == f"1\n00:00:00,000 --> 00:00:01,500\n{text}\n\n", out.stderr
    (tmp_path / "notes.txt").write_bytes(not_audio())
    bad = cli("ears", str(tmp_path / "notes.txt"))
    assert bad.returncode == 1 and "not a sound file" in bad.stderr and not bad.stdout
    bad = cli("smollm2", str(tmp_path / "tone.wav"))
    assert bad.returncode == 1 and "no audio projector" in bad.stderr


# -- the realtime transcription session (WebSocket) ---------------------------------------------

RT_RATE = 24_000  # OpenAI's pcm16


def realtime(d: Daemon, **headers: str) -> Any:
    from websockets.sync.client import connect

    return connect(d.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
                   additional_headers=headers, open_timeout=30, max_size=None)


def send(ws: Any, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def until(ws: Any, kind: str) -> list[dict[str, Any]]:
    """Every event up to and including the first of type `kind`."""
    out: list[dict[str, Any]] = []
    while not out or out[-1]["type"] != kind:
        out.append(json.loads(ws.recv(timeout=120)))
        assert out[-1]["type"] != "error" or kind == "error", out[-1]
    return out


def chunks(pcm: bytes, sizes: list[int]) -> list[bytes]:
    """`pcm` cut into pieces of the given sample counts (the last takes the rest)."""
    out, at = [], 0
    for n in sizes:
        out.append(pcm[at:at + 2 * n])
        at += 2 * n
    return [*out, pcm[at:]]


@contextlib.contextmanager
def open_session(d: Daemon, vad: dict[str, Any] | None = None) -> Iterator[Any]:
    with realtime(d) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "transcription_session.created"
        send(ws, "transcription_session.update", session={
            "input_audio_format": "pcm16", "turn_detection": vad,
            "input_audio_transcription": {"model": "ears"}})
        assert until(ws, "transcription_session.updated")[-1]["session"][
            "input_audio_transcription"]["model"] == "ears"
        yield ws


SIZES = [1, 480, 24000, 7, 9600, 333, 24000, 12, 8000]  # samples; the 10th takes the rest
PIECE = piece_frames(SOUND_PIECE_SECONDS["qwen3a"], RT_RATE)  # samples in a piece
HEAD = 40  # at most this many tokens around an utterance's sound (template, marks, instruction)


def stream_utterances(ws: Any, pcm: bytes, commit_after: set[int]) -> list[dict[str, Any]]:
    """Send `pcm` in SIZES' ten chunks, committing after the chunks numbered in
    `commit_after` (and after the last); each utterance's completed event, in order."""
    pieces = chunks(pcm, SIZES)
    assert len(pieces) == 10 and b"".join(pieces) == pcm
    commits = 0
    for i, piece in enumerate(pieces):
        send(ws, "input_audio_buffer.append", audio=b64(piece))
        if i in commit_after or i == len(pieces) - 1:
            send(ws, "input_audio_buffer.commit")
            commits += 1
    done = []
    for _ in range(commits):
        events = until(ws, "conversation.item.input_audio_transcription.completed")
        deltas = [e["delta"] for e in events
                  if e["type"] == "conversation.item.input_audio_transcription.delta"]
        assert "".join(deltas).strip() == events[-1]["transcript"]
        done.append(events[-1])
    return done


def test_ten_chunks_of_any_size_give_what_the_whole_file_gives(audio_daemon: Daemon,
                                                              oa: openai.OpenAI) -> None:
    """The session reads each whole piece of sound into its sequence as it arrives: at the
    commit the model already holds every whole piece, and the transcript is the one the
    same sound sent as one file to /v1/audio/transcriptions gives, greedily."""
    samples = sine(440.0, 3.5, RT_RATE)
    with open_session(audio_daemon) as ws:
        (done,) = stream_utterances(ws, pcm16(samples), set())
    # read before the commit: the three whole pieces (the commit adds the last half
    # second, the instruction and the turn's end)
    read = done["usage"]["input_token_details"]["cached_tokens"]
    assert read >= 3 * n_positions(0.98)
    assert done["usage"]["input_tokens"] - read < n_positions(0.98) + HEAD
    whole = oa.audio.transcriptions.create(model="ears", file=("a.wav", wav(samples, RT_RATE)))
    assert done["transcript"] == whole.text
    assert done["usage"]["input_tokens"] == whole.usage.input_tokens  # type: ignore[union-attr]


def test_the_sessions_sequence_grows_and_is_never_read_again(audio_daemon: Daemon,
                                                             oa: openai.OpenAI) -> None:
    """Two utterances in one session, a chat stream beside it all the while: the second
    utterance is read after the first and its transcript, which its slot still holds (only
    the sound and text after them are read), and each commit brings its transcript."""
    first_sound, second_sound = pcm16(noise(2.2, 1, RT_RATE)), pcm16(noise(2.5, 2, RT_RATE))
    neighbour = []

    def chat() -> None:
        gaps, last = [], time.perf_counter()
        for _ in oa.chat.completions.create(model="ears", messages=[{
                "role": "user", "content": "Tell me a long story."}], max_tokens=120,
                stream=True, **GREEDY):  # type: ignore[call-overload]
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        neighbour.append(max(gaps[1:]))

    beside = threading.Thread(target=chat)
    beside.start()
    with open_session(audio_daemon) as ws:
        first, = stream_utterances(ws, first_sound, set())
        second, = stream_utterances(ws, second_sound, set())
    beside.join()
    assert first["transcript"] and second["transcript"]
    held = second["usage"]["input_token_details"]["cached_tokens"]
    # the first turn whole (its sound, instruction and transcript) and the second's pieces
    assert held >= first["usage"]["total_tokens"] - 2 + 2 * n_positions(0.98)
    assert second["usage"]["input_tokens"] - held < n_positions(0.98) + HEAD
    # (a timing, printed and not asserted: a busy machine may stretch it)
    print(f"largest gap of the chat stream beside the session: {neighbour[0] * 1000:.0f} ms")


def test_each_commit_is_an_utterance_transcribed_in_order(audio_daemon: Daemon) -> None:
    with open_session(audio_daemon) as ws:
        for seconds in (1.0, 2.0):  # the second is sent while the first is transcribed
            send(ws, "input_audio_buffer.append",
                 audio=b64(pcm16(noise(seconds, rate=RT_RATE))))
            send(ws, "input_audio_buffer.commit")
        first = until(ws, "conversation.item.input_audio_transcription.completed")
        second = until(ws, "conversation.item.input_audio_transcription.completed")
    items = [e for e in first + second if e["type"] == "input_audio_buffer.committed"]
    assert len(items) == 2 and items[1]["previous_item_id"] == items[0]["item_id"]
    assert first[-1]["item_id"] == items[0]["item_id"]
    assert second[-1]["item_id"] == items[1]["item_id"]
    # the second is the sequence's second turn: read after the first and its transcript
    assert second[-1]["usage"]["input_tokens"] > first[-1]["usage"]["total_tokens"]


def test_a_silence_ends_an_utterance_with_server_vad(audio_daemon: Daemon) -> None:
    vad = {"type": "server_vad", "threshold": 0.05, "silence_duration_ms": 300}
    with open_session(audio_daemon, vad) as ws:
        send(ws, "input_audio_buffer.append", audio=b64(pcm16(sine(440.0, 1.0, RT_RATE))))
        send(ws, "input_audio_buffer.append", audio=b64(pcm16(silence(0.2, RT_RATE))))
        send(ws, "input_audio_buffer.append", audio=b64(pcm16(silence(0.2, RT_RATE))))
        events = until(ws, "conversation.item.input_audio_transcription.completed")
    kinds = [e["type"] for e in events]
    assert kinds.index("input_audio_buffer.speech_stopped") \
        < kinds.index("input_audio_buffer.committed")


def test_session_errors_are_events_and_bounds_close_it(audio_daemon: Daemon) -> None:
    with open_session(audio_daemon) as ws:
        send(ws, "input_audio_buffer.commit")
        assert "empty" in until(ws, "error")[-1]["error"]["message"]
        send(ws, "input_audio_buffer.append", audio="%%%")
        assert "base64" in until(ws, "error")[-1]["error"]["message"]
        send(ws, "response.create")
        assert "unknown event" in until(ws, "error")[-1]["error"]["message"]
        send(ws, "transcription_session.update", session={"input_audio_format": "g711_ulaw"})
        assert "pcm16" in until(ws, "error")[-1]["error"]["message"]
        # 31 s of sound in one utterance: refused, and the session ends
        send(ws, "input_audio_buffer.append", audio=b64(bytes(2 * RT_RATE * 31)))
        assert "at most 30 s" in until(ws, "error")[-1]["error"]["message"]
        from websockets.exceptions import ConnectionClosed
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)


def test_a_foreign_origin_cannot_open_a_session(audio_daemon: Daemon) -> None:
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus) as refused, \
            realtime(audio_daemon, Origin="https://evil.example"):
        pass
    assert refused.value.response.status_code == 403


def test_a_dropped_session_leaves_the_runner_serving(audio_daemon: Daemon,
                                                     oa: openai.OpenAI) -> None:
    with open_session(audio_daemon) as ws:
        send(ws, "input_audio_buffer.append", audio=b64(pcm16(noise(2.0, rate=RT_RATE))))
        send(ws, "input_audio_buffer.commit")
        until(ws, "input_audio_buffer.committed")
        ws.close()  # while its utterance is being transcribed
    assert transcribe(oa, wav(sine(440.0, 1.0))).text
