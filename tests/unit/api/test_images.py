"""Images in, in every dialect: each dialect's image form becomes `Message.images`
(canonical base64, in order); bad base64, bad data URLs, URLs the daemon may not fetch, too
many and too large images are a 400 in the dialect's own error shape; with LLMRUN_IMAGE_URLS
on, an http URL is fetched (here from a local server) within the same size limit.

No model: the app is built in-process and the service's chat/count/token calls are replaced
by ones that run the real bounds (`Service.check`), then record the request the runner would
have got.
"""

from __future__ import annotations

import base64
import http.server
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from llmrun import bounds, ipc, media
from llmrun.api import images
from llmrun.daemon.app import create_app
from llmrun.request import ChatRequest, EngineError, Message
from llmrun.store import Store

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3  # bytes only: decoding is the runner's
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(200))
B64_PNG = base64.b64encode(PNG).decode()
B64_JPEG = base64.b64encode(JPEG).decode()
DATA_PNG = f"data:image/png;base64,{B64_PNG}"
DATA_JPEG = f"data:image/jpeg;base64,{B64_JPEG}"
CAPTURED = 409  # what the stand-in chat answers once it has recorded the request


# -- an app whose runner calls are recorded -----------------------------------------------


class Captured:
    def __init__(self) -> None:
        self.requests: list[ChatRequest] = []

    @property
    def last(self) -> ChatRequest:
        assert self.requests, "no request reached the service"
        return self.requests[-1]


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, Captured]]:
    application = create_app(Store(tmp_path / "store"))
    service = application.state.service
    seen = Captured()

    async def chat(req: ChatRequest, leased: Any = None) -> AsyncIterator[Any]:
        service.check(req)  # the real bounds, as before a lease
        seen.requests.append(req)
        # (a 4xx of a remote server's is the one code that carries its own status)
        raise EngineError("captured", code="upstream_refused", details={"status": CAPTURED})
        yield  # an async generator, as the real one

    async def count_tokens(req: ChatRequest) -> int:
        service.check(req)
        seen.requests.append(req)
        return 7

    async def rendered(req: ChatRequest) -> dict[str, Any]:
        service.check(req)
        seen.requests.append(req)
        return {"prompt": "p", "tokens": [1, 2, 3]}

    monkeypatch.setattr(service, "chat", chat)
    monkeypatch.setattr(service, "count_tokens", count_tokens)
    monkeypatch.setattr(service, "rendered", rendered)
    yield TestClient(application, base_url="http://127.0.0.1"), seen


def ollama_error(r: Any) -> str:
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    return str(r.json()["error"])


def openai_error(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param",
                                                                   "code"}
    return dict(err)


def anthropic_error(r: Any) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def chat_openai(content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": role, "content": content}]}


def anthropic(content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10, "messages": [{"role": role, "content": content}]}


def image_block(data: str = B64_PNG, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": data}}


def responses(content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": "m", "input": [{"role": role, "content": content}]}


def input_image(url: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


# -- the shared checks (api/images.py) ------------------------------------------------------


def refused(call: Any, *args: Any) -> str:
    with pytest.raises(EngineError) as info:
        call(*args)
    assert info.value.code == "invalid_request"
    return info.value.message


def test_base64_is_strict_but_takes_wrapping_and_missing_padding() -> None:
    assert images.from_base64(B64_PNG, "x") == B64_PNG
    wrapped = "\n".join(B64_PNG[i:i + 76] for i in range(0, len(B64_PNG), 76)) + "\n"
    assert images.from_base64(wrapped, "x") == B64_PNG
    assert images.from_base64(B64_JPEG.rstrip("="), "x") == B64_JPEG
    assert images.from_base64("QR==", "x") == "QQ=="  # stray bits made canonical
    assert "images[2]: invalid base64" in refused(images.from_base64, "not*base64!", "images[2]")
    assert "invalid base64" in refused(images.from_base64, B64_PNG[:-5] + "-_", "x")  # urlsafe
    assert "invalid base64" in refused(images.from_base64, "QUJD" * 3 + "Q", "x")
    assert "empty" in refused(images.from_base64, "", "x")
    assert "base64 string" in refused(images.from_base64, 42, "x")


def test_data_urls() -> None:
    assert images.from_url(DATA_PNG, "u") == B64_PNG
    assert images.from_url(f"DATA:Image/PNG;BASE64,{B64_PNG}", "u") == B64_PNG
    assert images.from_url(f"data:image/png;name=a.png;base64,{B64_PNG}", "u") == B64_PNG
    assert "is not an image" in refused(images.from_url, f"data:text/plain;base64,{B64_PNG}",
                                        "u")
    assert "is not an image" in refused(images.from_url, "data:,hello", "u")
    assert "must be base64" in refused(images.from_url, "data:image/svg+xml,<svg/>", "u")
    assert "no ','" in refused(images.from_url, "data:image/png;base64", "u")
    assert "u: invalid base64" in refused(images.from_url, "data:image/png;base64,@@@@", "u")


def test_http_urls_need_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    message = refused(images.from_url, "https://example.com/cat.png", "msg.url")
    assert message.startswith("msg.url: ") and "LLMRUN_IMAGE_URLS=1" in message
    assert "scheme" in refused(images.from_url, "file:///etc/passwd", "u")
    assert "scheme" in refused(images.from_url, "ftp://example.com/a.png", "u")
    monkeypatch.setenv("LLMRUN_IMAGE_URLS", "1")
    assert images.from_url(" https://example.com/cat.png ", "u") == "https://example.com/cat.png"
    assert "scheme" in refused(images.from_url, "file:///etc/passwd", "u")


def test_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    def request(*pictures: str, per_message: int = 1) -> ChatRequest:
        return ChatRequest(model="m", messages=[
            Message(role="user", content="look", images=list(pictures[i:i + per_message]))
            for i in range(0, len(pictures), per_message)])

    bounds.check_request(request(*[B64_PNG] * 16))
    assert refused(bounds.check_request, request(*[B64_PNG] * 17, per_message=5)) == \
        "too many images: 17, the limit is 16 (LLMRUN_MAX_IMAGES)"
    monkeypatch.setenv("LLMRUN_MAX_IMAGES", "2")
    assert "3, the limit is 2" in refused(bounds.check_request, request(*[B64_PNG] * 3))
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "500")
    message = refused(bounds.check_request, request(B64_JPEG, B64_PNG))
    assert message == (f"messages[1].images[0]: image too large: {len(PNG)} bytes, the limit "
                       "is 500 bytes (LLMRUN_MAX_IMAGE_SIZE)")
    assert media.decoded_size(B64_PNG) == len(PNG) and media.decoded_size(B64_JPEG) == len(JPEG)
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "1MiB")
    monkeypatch.setattr(ipc, "MAX_FRAME", 1600)  # 1000 bytes of images in all
    assert "in all, the limit is 1000 bytes" in refused(bounds.check_request,
                                                       request(B64_PNG, B64_PNG))
    # an image URL never fetched does not reach the runner
    assert "not base64" in refused(bounds.check_request, request("https://example.com/a.png"))


# -- each dialect's form becomes Message.images ---------------------------------------------


def test_ollama_chat_and_generate(app: tuple[TestClient, Captured]) -> None:
    client, seen = app
    r = client.post("/api/chat", json={"model": "m", "stream": False, "messages": [
        {"role": "user", "content": "what are these?", "images": [B64_PNG, B64_JPEG]},
        {"role": "assistant", "content": "two pictures"},
        {"role": "user", "content": "and this?", "images": [DATA_PNG]}]})
    assert r.status_code == CAPTURED
    assert [m.images for m in seen.last.messages] == [[B64_PNG, B64_JPEG], [], [B64_PNG]]
    assert seen.last.messages[0].content == "what are these?"

    r = client.post("/api/generate", json={"model": "m", "stream": False, "system": "Be brief.",
                                           "prompt": "describe", "images": [B64_JPEG]})
    assert r.status_code == CAPTURED
    assert [(m.role, m.content, m.images) for m in seen.last.messages] == [
        ("system", "Be brief.", []), ("user", "describe", [B64_JPEG])]
    assert seen.last.prompt is None  # the template places the images

    # images alone are a prompt, not a load request
    r = client.post("/api/generate", json={"model": "m", "stream": False, "images": [B64_PNG]})
    assert r.status_code == CAPTURED and seen.last.messages[-1].images == [B64_PNG]


def test_ollama_refusals(app: tuple[TestClient, Captured]) -> None:
    client, _ = app
    for extra in ({"raw": True}, {"suffix": "end"}):
        r = client.post("/api/generate", json={"model": "m", "prompt": "x", "stream": False,
                                               "images": [B64_PNG], **extra})
        assert "raw prompts" in ollama_error(r) and "chat template" in ollama_error(r)
    r = client.post("/api/chat", json={"model": "m", "messages": [
        {"role": "user", "content": "x", "images": [B64_PNG, "%%%"]}]})
    assert ollama_error(r) == "messages[0].images[1]: invalid base64 image data"
    r = client.post("/api/generate", json={"model": "m", "prompt": "x",
                                           "images": ["data:text/html;base64,PGI+"]})
    assert "images[0]" in ollama_error(r) and "not an image" in ollama_error(r)
    r = client.post("/api/chat", json={"model": "m", "messages": [
        {"role": "user", "content": "x", "images": [B64_PNG] * 17}]})
    assert ollama_error(r) == "too many images: 17, the limit is 16 (LLMRUN_MAX_IMAGES)"


def test_ollama_image_too_large(app: tuple[TestClient, Captured],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = app
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "500")
    r = client.post("/api/generate", json={"model": "m", "prompt": "x", "images": [B64_PNG]})
    assert ollama_error(r) == (f"images[0]: image too large: {len(PNG)} bytes, the limit is "
                               "500 bytes (LLMRUN_MAX_IMAGE_SIZE)")


def test_openai_image_url_parts(app: tuple[TestClient, Captured]) -> None:
    client, seen = app
    r = client.post("/v1/chat/completions", json={"model": "m", "n": 2, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "first"},
            {"type": "image_url", "image_url": {"url": DATA_PNG, "detail": "high"}},
            {"type": "text", "text": "second"},
            {"type": "image_url", "image_url": DATA_JPEG}]}]})
    assert r.status_code == CAPTURED
    user = seen.last.messages[1]
    assert user.content == "first\nsecond" and user.images == [B64_PNG, B64_JPEG]
    assert seen.last.messages[0].images == []


def test_openai_refusals(app: tuple[TestClient, Captured],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = app
    part = {"type": "image_url", "image_url": {"url": DATA_PNG}}
    for role in ("system", "developer", "assistant"):
        err = openai_error(client.post("/v1/chat/completions",
                                       json=chat_openai([part], role)))
        assert err["param"] == "messages[0].content[0]"
        assert f"only allowed for messages with role 'user', but this message with role " \
               f"'{role}'" in err["message"]
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%%"}}
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai(
        [{"type": "text", "text": "x"}, bad])))
    assert err["param"] == "messages[0].content[1].image_url"
    assert "invalid base64" in err["message"]
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai(
        [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}])))
    assert "LLMRUN_IMAGE_URLS" in err["message"]
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai(
        [{"type": "image_url", "image_url": {"detail": "low"}}])))
    assert "expected an image URL" in err["message"]
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai([part] * 17)))
    assert err["message"] == "too many images: 17, the limit is 16 (LLMRUN_MAX_IMAGES)"
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "500")
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai([part])))
    assert "LLMRUN_MAX_IMAGE_SIZE" in err["message"]
    assert err["param"] == "messages[0].content[0].image_url"


def test_openai_apply_template_passes_images(app: tuple[TestClient, Captured]) -> None:
    client, seen = app
    r = client.post("/apply-template", json=chat_openai(
        [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": DATA_PNG}}]))
    assert r.status_code == 200, r.text
    assert seen.last.messages[0].images == [B64_PNG]


def test_anthropic_image_blocks(app: tuple[TestClient, Captured]) -> None:
    client, seen = app
    body = {"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, image_block(),
                                     image_block(B64_JPEG, "image/jpeg")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "screen"}, image_block(B64_JPEG)]},
            {"type": "text", "text": "and?"}]}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == CAPTURED
    got = [(m.role, m.content, m.images) for m in seen.last.messages]
    assert got == [("user", "look", [B64_PNG, B64_JPEG]), ("assistant", "", []),
                   ("tool", "screen", [B64_JPEG]), ("user", "and?", [])]
    # count_tokens reads the same images
    r = client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200 and r.json() == {"input_tokens": 7}
    assert seen.last.messages[2].images == [B64_JPEG]
    # an image before a tool result stays before it
    r = client.post("/v1/messages", json=anthropic([
        image_block(), {"type": "tool_result", "tool_use_id": "t0", "content": "ok"}]))
    assert [(m.role, m.images) for m in seen.last.messages] == [("user", [B64_PNG]),
                                                                 ("tool", [])]


def test_anthropic_refusals(app: tuple[TestClient, Captured],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = app
    message = anthropic_error(client.post("/v1/messages",
                                          json=anthropic([image_block()], "assistant")))
    assert message.startswith("messages.0.content.0: image blocks are allowed only in user")
    r = client.post("/v1/messages", json={**anthropic("hi"), "system": [image_block()]})
    assert "system.0" in anthropic_error(r)
    message = anthropic_error(client.post("/v1/messages", json=anthropic(
        [{"type": "text", "text": "x"}, image_block("nope!")])))
    assert message == "messages.0.content.1.source.data: invalid base64 image data"
    message = anthropic_error(client.post("/v1/messages", json=anthropic(
        [image_block(media_type="application/pdf")])))
    assert message.startswith("messages.0.content.0.source.media_type: expected an image")
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    message = anthropic_error(client.post("/v1/messages", json=anthropic([url])))
    assert "messages.0.content.0.source.url" in message and "LLMRUN_IMAGE_URLS" in message
    files = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
    assert "Files API" in anthropic_error(client.post("/v1/messages", json=anthropic([files])))
    message = anthropic_error(client.post("/v1/messages", json=anthropic([image_block()] * 17)))
    assert message == "too many images: 17, the limit is 16 (LLMRUN_MAX_IMAGES)"
    r = client.post("/v1/messages/count_tokens", json=anthropic([image_block()] * 17))
    assert "too many images" in anthropic_error(r)
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "500")
    message = anthropic_error(client.post("/v1/messages", json=anthropic([image_block()])))
    assert message.startswith("messages.0.content.0.source.data: image too large")


def test_responses_input_image(app: tuple[TestClient, Captured]) -> None:
    client, seen = app
    body = {"model": "m", "store": False, "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                     input_image(DATA_PNG)]},
        {"role": "user", "content": [input_image(DATA_JPEG)]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "screen"}, input_image(DATA_JPEG)]}]}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == CAPTURED
    got = [(m.role, m.content, m.images) for m in seen.last.messages]
    # the two user items are one turn (templates want roles to alternate), images in order
    assert got == [("system", "Be brief.", []), ("user", "look", [B64_PNG, B64_JPEG]),
                   ("assistant", "", []), ("tool", "screen", [B64_JPEG])]
    r = client.post("/v1/responses/input_tokens", json=body)
    assert r.status_code == 200 and r.json()["input_tokens"] == 7
    assert seen.last.messages[1].images == [B64_PNG, B64_JPEG]


def test_responses_refusals(app: tuple[TestClient, Captured],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = app
    err = openai_error(client.post("/v1/responses", json=responses(
        [{"type": "input_image", "file_id": "file-abc"}])))
    assert err["param"] == "input[0].content[0].file_id" and "Files API" in err["message"]
    for role in ("system", "developer", "assistant"):
        err = openai_error(client.post("/v1/responses",
                                       json=responses([input_image(DATA_PNG)], role)))
        assert err["param"] == "input[0].content[0]" and "only in user" in err["message"]
    err = openai_error(client.post("/v1/responses", json=responses(
        [input_image("data:image/png;base64,***")])))
    assert err["param"] == "input[0].content[0].image_url"
    assert "invalid base64" in err["message"]
    err = openai_error(client.post("/v1/responses", json=responses(
        [input_image("https://example.com/x.png")])))
    assert "LLMRUN_IMAGE_URLS" in err["message"]
    err = openai_error(client.post("/v1/responses", json=responses(
        [input_image(DATA_PNG)] * 17)))
    assert err["message"] == "too many images: 17, the limit is 16 (LLMRUN_MAX_IMAGES)"
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "500")
    err = openai_error(client.post("/v1/responses", json=responses([input_image(DATA_PNG)])))
    assert "image too large" in err["message"] and "LLMRUN_MAX_IMAGE_SIZE" in err["message"]


# -- image URLs, when the setting allows them ---------------------------------------------


ROUTES: dict[str, tuple[int, dict[str, str], bytes]] = {
    "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
    "/untyped": (200, {}, JPEG),
    "/page": (200, {"Content-Type": "text/html"}, b"<html></html>"),
    "/missing": (404, {"Content-Type": "text/plain"}, b"no"),
    "/moved": (302, {"Location": "/cat.png"}, b""),
    "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
    "/loop": (302, {"Location": "/loop"}, b""),
    "/to-metadata": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b""),
    "/big": (200, {"Content-Type": "image/png"}, PNG * 8),
    "/empty": (200, {"Content-Type": "image/png"}, b""),
}


class Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/big-unsized":  # no Content-Length: the reader must count
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(PNG * 8)
            return
        status, headers, body = ROUTES.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_urls_are_fetched_when_allowed(app: tuple[TestClient, Captured], server: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    client, seen = app
    monkeypatch.setenv("LLMRUN_IMAGE_URLS", "1")
    r = client.post("/v1/chat/completions", json={"model": "m", "n": 2, "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"{server}/cat.png"}},
            {"type": "image_url", "image_url": {"url": DATA_JPEG}},
            {"type": "image_url", "image_url": {"url": f"{server}/moved"}}]}]})
    assert r.status_code == CAPTURED
    assert seen.last.messages[0].images == [B64_PNG, B64_JPEG, B64_PNG]
    url = {"type": "image", "source": {"type": "url", "url": f"{server}/untyped"}}
    r = client.post("/v1/messages", json=anthropic([url]))
    assert r.status_code == CAPTURED and seen.last.messages[0].images == [B64_JPEG]
    r = client.post("/v1/messages/count_tokens", json=anthropic([url]))
    assert r.status_code == 200 and seen.last.messages[0].images == [B64_JPEG]
    r = client.post("/v1/responses", json=responses([input_image(f"{server}/cat.png")]))
    assert r.status_code == CAPTURED and seen.last.messages[0].images == [B64_PNG]


def test_fetched_urls_are_bounded(app: tuple[TestClient, Captured], server: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = app
    monkeypatch.setenv("LLMRUN_IMAGE_URLS", "1")
    monkeypatch.setenv("LLMRUN_MAX_IMAGE_SIZE", "1KiB")

    def fetch(path: str) -> str:
        r = client.post("/v1/chat/completions", json=chat_openai(
            [{"type": "image_url", "image_url": {"url": f"{server}{path}"}}]))
        return str(openai_error(r)["message"])

    assert "image too large" in fetch("/big") and "LLMRUN_MAX_IMAGE_SIZE" in fetch("/big")
    assert "image too large" in fetch("/big-unsized")
    assert "not an image" in fetch("/page")
    assert "HTTP 404" in fetch("/missing")
    assert "only http(s) is followed" in fetch("/to-file")
    assert "redirects" in fetch("/loop")
    # the cloud's metadata service, behind a redirect: refused before connecting
    assert "refused: 169.254.169.254" in fetch("/to-metadata")
    assert "empty" in fetch("/empty")
    message = anthropic_error(client.post("/v1/messages", json=anthropic(
        [{"type": "image", "source": {"type": "url", "url": f"{server}/big"}}])))
    assert "image too large" in message
    # the count is checked before anything is downloaded
    many = [{"type": "image_url", "image_url": {"url": f"{server}/cat.png"}}] * 17
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai(many)))
    assert "too many images: 17" in err["message"]


def test_unreachable_url(app: tuple[TestClient, Captured],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = app
    monkeypatch.setenv("LLMRUN_IMAGE_URLS", "1")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai(
        [{"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/a.png"}}])))
    assert "could not fetch it (ConnectError" in err["message"]


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/",
                                 "http://2852039166/", "http://[::ffff:169.254.169.254]/",
                                 "http://[fe80::1]/a.png"])
def test_link_local_image_urls_are_refused(app: tuple[TestClient, Captured], url: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An image URL may not make the daemon read a cloud's metadata service (or any other
    link-local address), however it is spelled."""
    client, _ = app
    monkeypatch.setenv("LLMRUN_IMAGE_URLS", "1")
    err = openai_error(client.post("/v1/chat/completions", json=chat_openai(
        [{"type": "image_url", "image_url": {"url": url}}])))
    assert "refused" in err["message"] and "LLMRUN_REMOTE_LINK_LOCAL" in err["message"]
