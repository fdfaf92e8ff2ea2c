"""Images in every dialect, through the real daemon and the official SDKs.

A model made of SmolLM2 and tests/fakes/vision.py's tiny random projector (two FROM lines): the
answers mean nothing, but the same image gives the same greedy answer, another image
another answer, the image's positions count in the usage, a second turn repeating the image
reads it from the slot's cache, and bad images are refused with a 400 while the runner
goes on serving.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import Daemon, make_home
from tests.fakes.vision import (
    N_IMAGE_TOKENS,
    bomb_png,
    image,
    not_image,
    truncated_png,
    write_projector,
)

GREEDY = {"temperature": 0.0, "seed": 1}
QUESTION = "What is this?"


@pytest.fixture(scope="module")
def vision_daemon(tmp_path_factory: pytest.TempPathFactory,
                  smollm2_path: Path) -> Iterator[Daemon]:
    from llmrun.store import Store

    home = make_home(tmp_path_factory.mktemp("vision-home"), smollm2_path)
    mmproj = write_projector(home / "mmproj-test.gguf")
    Store(home).create("vis", f"FROM {smollm2_path}\nFROM {mmproj}\n")
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def ol(vision_daemon: Daemon) -> ollama.Client:
    return ollama.Client(host=vision_daemon.url, timeout=120)


@pytest.fixture(scope="module")
def oa(vision_daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=vision_daemon.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def an(vision_daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=vision_daemon.url, api_key="x", max_retries=0,
                             timeout=120) as c:
        yield c


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- one turn in each dialect: (answer, prompt tokens, cached tokens) --------------------------

def ask_ollama(ol: ollama.Client, *pictures: bytes, history: list[Any] | None = None,
               model: str = "vis") -> tuple[str, int, int]:
    msg = {"role": "user", "content": QUESTION, "images": list(pictures)}
    r = ol.chat(model=model, messages=[*(history or []), msg],
                options={**GREEDY, "num_predict": 12})
    return r.message.content or "", r.prompt_eval_count or 0, -1


def ask_openai(oa: openai.OpenAI, *pictures: bytes, history: list[Any] | None = None,
               model: str = "vis") -> tuple[str, int, int]:
    parts: list[Any] = [{"type": "image_url",
                         "image_url": {"url": "data:image/png;base64," + b64(p)}}
                        for p in pictures]
    parts.append({"type": "text", "text": QUESTION})
    r = oa.chat.completions.create(model=model, messages=[*(history or []),
                                                          {"role": "user", "content": parts}],
                                   max_tokens=12, temperature=0, seed=1)
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return (r.choices[0].message.content or "", r.usage.prompt_tokens,
            details.cached_tokens or 0 if details else 0)


def ask_anthropic(an: anthropic.Anthropic, *pictures: bytes,
                  history: list[Any] | None = None, model: str = "vis") -> tuple[str, int, int]:
    blocks: list[Any] = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                      "data": b64(p)}} for p in pictures]
    blocks.append({"type": "text", "text": QUESTION})
    r = an.messages.create(model=model, max_tokens=12, extra_body={"temperature": 0},
                           messages=[*(history or []), {"role": "user", "content": blocks}])
    text = "".join(b.text for b in r.content if b.type == "text")
    cached = r.usage.cache_read_input_tokens or 0
    return text, r.usage.input_tokens + cached, cached


ASK = {"ollama": ask_ollama, "openai": ask_openai, "anthropic": ask_anthropic}


@pytest.fixture(params=list(ASK))
def dialect(request: pytest.FixtureRequest, ol: ollama.Client, oa: openai.OpenAI,
            an: anthropic.Anthropic) -> tuple[str, Any, Any]:
    client = {"ollama": ol, "openai": oa, "anthropic": an}[request.param]
    return request.param, client, ASK[request.param]


def test_same_image_same_answer_other_image_other_answer(dialect: tuple[str, Any, Any],
                                                         ol: ollama.Client) -> None:
    _, client, ask = dialect
    first, n_first, _ = ask(client, image(1))
    again, n_again, _ = ask(client, image(1))
    other, n_other, _ = ask(client, image(2))
    assert first == again and first != other, (first, other)
    # the image's positions are prompt tokens (its 16, and the line after its marker)
    _, n_plain, _ = ask_ollama(ol)
    assert n_first == n_again == n_other
    assert n_first - n_plain in (N_IMAGE_TOKENS, N_IMAGE_TOKENS + 1), (n_first, n_plain)


@pytest.mark.parametrize("name", ["openai", "anthropic"])
def test_second_turn_reads_the_image_from_the_cache(name: str, oa: openai.OpenAI,
                                                    an: anthropic.Anthropic) -> None:
    client = {"openai": oa, "anthropic": an}[name]
    ask = ASK[name]
    picture = image(10 + len(name))  # an image no other test sends
    answer, n_first, _ = ask(client, picture)
    if name == "openai":
        turn1 = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(picture)}},
            {"type": "text", "text": QUESTION}]}]
    else:
        turn1 = [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(picture)}},
            {"type": "text", "text": QUESTION}]}]
    history = [*turn1, {"role": "assistant", "content": answer or "Something."}]
    _, n_second, cached = ask(client, history=history)
    # the first turn, its image included, came from the slot's cache
    assert cached >= n_first - 1 > N_IMAGE_TOKENS, (cached, n_first, n_second)


def test_ollama_generate_takes_images(ol: ollama.Client) -> None:
    r1 = ol.generate(model="vis", prompt=QUESTION, images=[image(1)],
                     options={**GREEDY, "num_predict": 12})
    r2 = ol.generate(model="vis", prompt=QUESTION, images=[image(2)],
                     options={**GREEDY, "num_predict": 12})
    plain = ol.generate(model="vis", prompt=QUESTION, options={**GREEDY, "num_predict": 12})
    assert r1.response != r2.response
    assert (r1.prompt_eval_count or 0) - (plain.prompt_eval_count or 0) >= N_IMAGE_TOKENS


BAD = [(truncated_png(), "decoded"), (bomb_png(), "pixels"), (not_image(), "not an image")]


@pytest.mark.parametrize("bad, words", BAD, ids=["truncated", "bomb", "not-an-image"])
def test_bad_images_are_400_in_every_dialect_and_the_runner_lives(
        bad: bytes, words: str, ol: ollama.Client, oa: openai.OpenAI,
        an: anthropic.Anthropic) -> None:
    with pytest.raises(ollama.ResponseError) as e1:
        ask_ollama(ol, image(1), bad)
    assert e1.value.status_code == 400 and words in str(e1.value)
    with pytest.raises(openai.BadRequestError) as e2:
        ask_openai(oa, bad)
    assert words in str(e2.value)
    with pytest.raises(anthropic.BadRequestError) as e3:
        ask_anthropic(an, bad)
    assert words in str(e3.value)
    # the same runner answers on: its slot still holds the last good prompt's cells
    ask_openai(oa, image(1))
    _, _, cached = ask_openai(oa, image(1))
    assert cached > N_IMAGE_TOKENS


def test_images_to_a_text_model_are_400_naming_it(ol: ollama.Client, oa: openai.OpenAI,
                                                  an: anthropic.Anthropic) -> None:
    with pytest.raises(ollama.ResponseError) as e1:
        ask_ollama(ol, image(1), model="smollm2")
    assert e1.value.status_code == 400 and "smollm2" in str(e1.value)
    assert "vision" in str(e1.value)
    with pytest.raises(openai.BadRequestError, match="smollm2"):
        ask_openai(oa, image(1), model="smollm2")
    with pytest.raises(anthropic.BadRequestError, match="smollm2"):
        ask_anthropic(an, image(1), model="smollm2")


def test_show_lists_vision(vision_daemon: Daemon) -> None:
    caps = httpx.post(vision_daemon.url + "/api/show", json={"model": "vis"}).json()
    assert "vision" in caps["capabilities"]
    caps = httpx.post(vision_daemon.url + "/api/show", json={"model": "smollm2"}).json()
    assert "vision" not in caps["capabilities"]


def test_cli_run_attaches_an_image_path(vision_daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "photo.png").write_bytes(image(1))
    out = subprocess.run([sys.executable, "-m", "llmrun", "run", "vis", "--plain",
                          "-o", "temperature=0", "-o", "seed=1", "-o", "num_predict=12",
                          "What is this? ./photo.png"],
                         env={**vision_daemon.env}, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Added image './photo.png'" in out.stderr or "Added image 'photo.png'" in out.stderr
    with_image = ask_ollama(ollama.Client(host=vision_daemon.url), image(1))[0]
    assert out.stdout.strip() == with_image.strip()


class _Lines:
    """The chat's line reader, replaying given lines."""

    def __init__(self, *lines: str) -> None:
        self.lines = list(lines)
        self.save = True

    def read(self, prompt: str) -> str:
        return self.lines.pop(0)


def test_chat_attaches_an_image_path_for_a_vision_model_only(
        vision_daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmrun.cli.repl import Session, _turn
    from llmrun.client import Client

    monkeypatch.chdir(tmp_path)
    (tmp_path / "photo.png").write_bytes(image(1))
    sent: list[list[dict[str, Any]]] = []

    def stream(session: Session, messages: list[dict[str, Any]]) -> str:
        sent.append(messages)
        return "An answer."

    client = Client(vision_daemon.url)
    for model, attached in (("vis", True), ("smollm2", False)):
        session = Session(model)
        assert _turn(client, session, stream, _Lines("What is in photo.png?"))  # type: ignore[arg-type]
        question = sent[-1][-1]
        if attached:
            assert question == {"role": "user", "content": "What is in ?",
                                "images": [b64(image(1))]}
        else:  # a text model gets the words as typed
            assert question == {"role": "user", "content": "What is in photo.png?"}
        assert session.history[-1] == {"role": "assistant", "content": "An answer."}


def test_responses_api_takes_input_image(oa: openai.OpenAI) -> None:
    def ask(picture: bytes) -> tuple[str, int]:
        r = oa.responses.create(model="vis", max_output_tokens=12, temperature=0, input=[
            {"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64," + b64(picture),
                 "detail": "auto"},
                {"type": "input_text", "text": QUESTION}]}])
        assert r.usage is not None
        return r.output_text, r.usage.input_tokens

    (first, n1), (again, n2), (other, _) = ask(image(1)), ask(image(1)), ask(image(2))
    assert first == again and first != other and n1 == n2
    _, n_plain, _ = ask_openai(oa)
    assert n1 - n_plain in (N_IMAGE_TOKENS, N_IMAGE_TOKENS + 1)


def test_counting_tokens_counts_the_image(an: anthropic.Anthropic) -> None:
    blocks: list[Any] = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                      "data": b64(image(1))}},
                         {"type": "text", "text": QUESTION}]
    counted = an.messages.count_tokens(model="vis", messages=[{"role": "user",
                                                               "content": blocks}])
    _, used, _ = ask_anthropic(an, image(1))
    assert counted.input_tokens == used  # (input + cache reads: the whole prompt)
    plain = an.messages.count_tokens(model="vis", messages=[{"role": "user",
                                                             "content": QUESTION}])
    assert counted.input_tokens - plain.input_tokens in (N_IMAGE_TOKENS, N_IMAGE_TOKENS + 1)
