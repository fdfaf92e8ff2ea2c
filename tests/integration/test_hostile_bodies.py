"""Bodies built to be slow to parse, sent to a real daemon while a heartbeat polls it: a
multipart form of 100,000 empty parts (5 MB) to /v1/audio/transcriptions, and 32 MiB JSON
bodies of millions of values or deep nesting to each dialect's chat route. Each is refused
with a clear error in the caller's dialect, no heartbeat waits as long as a second (before,
the form held the event loop 30 s and `{"messages": [{}, {}, ...]}` over 80 s), and the
next good request is answered."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import Daemon, make_home
from tests.fakes.audio import sine, wav, write_projector

MiB = 1 << 20
BODY = 32 * MiB - 4096  # under the daemon's default body limit (LLMRUN_MAX_BODY_SIZE)
MAX_BEAT = 1.0  # seconds any one heartbeat may wait


@pytest.fixture(scope="module")
def ears(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    from llmrun.store import Store

    home = make_home(tmp_path_factory.mktemp("hostile-bodies"), smollm2_path)
    mmproj = write_projector(home / "mmproj-audio.gguf")
    Store(home).create("ears", f"FROM {smollm2_path}\nFROM {mmproj}\n")
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oa(ears: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=ears.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


def beside_heartbeat(d: Daemon, work: Callable[[], httpx.Response]) -> tuple[httpx.Response,
                                                                             float]:
    """`work`'s response, and the longest any `/api/version` poll waited while it ran (a poll
    that gets no answer in 5 s counts as 5 s)."""
    waits: list[float] = []
    done = threading.Event()

    def beat() -> None:
        with httpx.Client(base_url=d.url, timeout=5) as c:
            while not done.is_set():
                start = time.monotonic()
                with contextlib.suppress(httpx.TimeoutException):
                    c.get("/api/version").raise_for_status()
                waits.append(time.monotonic() - start)
                time.sleep(0.02)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        time.sleep(0.2)  # the heartbeat is going before the body is sent
        response = work()
        time.sleep(0.2)
    finally:
        done.set()
        beater.join()
    assert len(waits) > 5
    return response, max(waits)


def post(d: Daemon, path: str, body: bytes, content_type: str) -> Callable[[], httpx.Response]:
    return lambda: httpx.post(d.url + path, content=body, timeout=60,
                              headers={"Content-Type": content_type})


def form(*parts: tuple[str, bytes, str | None], boundary: str = "xyzzy") -> bytes:
    """A multipart/form-data body of (name, data, filename) parts."""
    out = bytearray()
    for name, data, filename in parts:
        disposition = f'form-data; name="{name}"' + \
            (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        out += data + b"\r\n"
    return bytes(out + f"--{boundary}--\r\n".encode())


MULTIPART = "multipart/form-data; boundary=xyzzy"


def openai_message(r: httpx.Response) -> str:
    body = r.json()
    assert body["error"]["type"] == "invalid_request_error", body
    return str(body["error"]["message"])


def test_a_form_of_100000_parts_is_refused_and_the_daemon_never_waits(
        ears: Daemon, oa: openai.OpenAI) -> None:
    tone = wav(sine(440.0, 1.0))
    body = form(("model", b"ears", None), ("file", tone, "tone.wav"),
                *[("x", b"", None)] * 100_000)
    assert len(body) > 4_000_000
    r, longest = beside_heartbeat(ears, post(ears, "/v1/audio/transcriptions", body, MULTIPART))
    assert r.status_code == 400
    assert "too many form fields: more than 32" in openai_message(r)
    assert longest < MAX_BEAT, f"a heartbeat waited {longest:.2f} s"
    # the next good transcription is answered
    assert oa.audio.transcriptions.create(model="ears", file=("tone.wav", tone)).text


def test_form_parts_past_their_bounds_are_refused_in_openais_shape(ears: Daemon,
                                                                   oa: openai.OpenAI) -> None:
    tone = wav(sine(440.0, 0.5))
    url = ears.url + "/v1/audio/transcriptions"

    def send(body: bytes, content_type: str = MULTIPART) -> httpx.Response:
        return httpx.post(url, content=body, headers={"Content-Type": content_type},
                          timeout=60)

    base = (("model", b"ears", None), ("file", tone, "tone.wav"))
    r = send(form(*base, ("prompt", b"p" * (64 * 1024 + 1), None)))  # a field too long
    assert r.status_code == 413 and "'prompt' is over 65536 bytes" in openai_message(r)
    assert r.json()["error"]["param"] == "prompt"
    r = send(form(*base, ("file", tone, "again.wav")))  # two files
    assert r.status_code == 400 and "sent twice" in openai_message(r)
    r = send(form(*base, ("other", tone, "other.wav")))  # a file in another field
    assert r.status_code == 400 and "the file goes in file" in openai_message(r)
    pads = b"".join(b"X-Pad: " + b"a" * 3000 + b"\r\n" for _ in range(3))
    r = send(b"--xyzzy\r\nContent-Disposition: form-data; name=\"model\"\r\n" + pads +
             b"\r\nears\r\n--xyzzy--\r\n")  # headers of 9 KB, each line within HTTP's
    assert r.status_code == 400 and "headers are over 8192 bytes" in openai_message(r)
    r = send(b"--xyzzy\r\nContent-Disposition: form-data; name=\"model\"\r\nX-Pad: " +
             b"a" * 20_000 + b"\r\n\r\nears\r\n--xyzzy--\r\n")  # one line of 20 KB
    assert r.status_code == 400 and "header" in openai_message(r)
    r = send(form(*base), "multipart/form-data")  # no boundary
    assert r.status_code == 400 and "no boundary" in openai_message(r)
    r = send(b"--xyzzy\r\nContent-Disposition: form-data\r\n\r\nx\r\n--xyzzy--\r\n")
    assert r.status_code == 400 and "has no name" in openai_message(r)
    # a well-formed form within every bound still works, unknown fields and all
    r = send(form(*base, ("response_format", b"text", None),
                  ("timestamp_granularities[]", b"segment", None)))
    assert r.status_code == 200 and r.text.strip()


def _fill(prefix: bytes, unit: bytes, suffix: bytes) -> bytes:
    n = (BODY - len(prefix) - len(suffix)) // len(unit)
    return prefix + (unit * n).rstrip(b",") + suffix


# each dialect's chat route, its body of 11 million empty messages, and how it words errors
DIALECTS: list[tuple[str, bytes, Callable[[dict[str, Any]], str]]] = [
    ("/v1/chat/completions", b'{"model":"smollm2","messages":[',
     lambda b: b["error"]["message"]),
    ("/api/chat", b'{"model":"smollm2","messages":[', lambda b: b["error"]),
    ("/v1/messages", b'{"model":"smollm2","max_tokens":8,"messages":[',
     lambda b: b["error"]["message"] if b["type"] == "error" else ""),
]


@pytest.mark.parametrize("path, prefix, message", DIALECTS, ids=[p for p, _, _ in DIALECTS])
def test_json_of_millions_of_values_is_refused_and_the_daemon_never_waits(
        ears: Daemon, path: str, prefix: bytes,
        message: Callable[[dict[str, Any]], str]) -> None:
    body = _fill(prefix, b"{},", b"]}")
    r, longest = beside_heartbeat(ears, post(ears, path, body, "application/json"))
    assert r.status_code == 413, r.text[:500]
    assert "more than 32768 values" in message(r.json())
    assert longest < MAX_BEAT, f"a heartbeat waited {longest:.2f} s"


def test_deep_and_wide_json_is_refused_beside_a_heartbeat(ears: Daemon,
                                                          oa: openai.OpenAI) -> None:
    half = BODY // 2 - 64
    deep = b'{"model":"smollm2","messages":[{"role":"user","content":"x"}],"x":' + \
        b"[" * half + b"]" * half + b"}"
    r, longest = beside_heartbeat(ears, post(ears, "/v1/chat/completions", deep,
                                             "application/json"))
    assert r.status_code == 400 and "nested more than 512 levels" in openai_message(r)
    assert longest < MAX_BEAT, f"a heartbeat waited {longest:.2f} s"
    # numbers where token lists go: each would be a validation error of its own
    wide = _fill(b'{"model":"smollm2","prompt":[', b"null,", b"]}")
    r, longest = beside_heartbeat(ears, post(ears, "/v1/completions", wide,
                                             "application/json"))
    assert r.status_code == 413 and "more than 32768 values" in openai_message(r)
    assert longest < MAX_BEAT, f"a heartbeat waited {longest:.2f} s"
    # just under the bound: one error, not one per null and alternative (96,001 of them took
    # the loop about a second to collect and word)
    nulls = b'{"model":"smollm2","prompt":[' + b",".join([b"null"] * 32_000) + b"]}"
    r, longest = beside_heartbeat(ears, post(ears, "/v1/completions", nulls,
                                             "application/json"))
    assert r.status_code == 400 and "item 0 is not a string" in openai_message(r)
    assert longest < MAX_BEAT, f"a heartbeat waited {longest:.2f} s"
    # a request within the bounds is answered as before
    out = oa.chat.completions.create(model="smollm2", max_tokens=4, messages=[
        {"role": "user", "content": "Say hi."}])
    assert out.choices[0].message.content is not None
