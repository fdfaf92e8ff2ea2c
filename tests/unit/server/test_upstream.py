"""Remote models (FROM http(s)://) without a server: the Modelfile's parameters,
the manifest the store makes of them, what may create one over HTTP, and the translation to
and from an OpenAI-compatible API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmrun.request import ChatRequest, Message, NamedTool, Options, Tool, ToolCall
from llmrun.server.upstream import _Reader, request_body
from llmrun.store import CreateError, Store
from llmrun.store.modelfile import parse
from llmrun.store.store import REMOTE_REFUSED, refuse_host_paths

MODELFILE = """FROM https://gpu-box.internal:8000/v1/
PARAMETER remote_model meta-llama/Llama-3.1-70B-Instruct
PARAMETER remote_replica http://10.0.0.2:8000/v1
PARAMETER remote_replica http://10.0.0.3:8000/v1
PARAMETER remote_key vllm
PARAMETER temperature 0.2
SYSTEM You are terse.
"""


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys this daemon's owner configured (what a Modelfile may name)."""
    monkeypatch.setenv("LLMRUN_REMOTE_KEYS", "vllm=VLLM_KEY")


def test_modelfile_round_trip_and_manifest(tmp_path: Path) -> None:
    mf = parse(MODELFILE)
    assert mf.remote == {"remote_model": "meta-llama/Llama-3.1-70B-Instruct",
                         "remote_replica": ["http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1"],
                         "remote_key": "vllm"}
    assert parse(mf.render()) == mf
    store = Store(tmp_path)
    m = store.create("big", MODELFILE)
    assert m.model is None and m.remote is not None
    assert m.remote.urls == ["https://gpu-box.internal:8000/v1", "http://10.0.0.2:8000/v1",
                             "http://10.0.0.3:8000/v1"]
    assert m.remote.model == "meta-llama/Llama-3.1-70B-Instruct"
    assert m.remote.key == "vllm" and m.remote.key_env is None
    assert m.parameters == {"temperature": 0.2}
    assert m.size == 0 and m.digests() == set()
    assert store.get("big")[1] == m
    again = parse(store.modelfile_of(m).render())
    assert again.from_ == m.remote.urls[0] and again.remote == mf.remote
    assert store.template_of(m) == ""
    assert store.model_info(m)["remote.model"] == m.remote.model
    # the default upstream name is the local one
    plain = store.create("other:7b", "FROM http://127.0.0.1:9/v1\n")
    assert plain.remote is not None and plain.remote.model == "other:7b"


@pytest.mark.parametrize(("text", "words"), [
    ("FROM https://user:pw@host/v1\n", "no credentials"),
    ("FROM https://host/v1?key=1\n", "no query"),
    ("FROM http:///v1\n", "with a host"),
    ("FROM http://host/v1\nPARAMETER remote_key_env 1BAD-NAME\n", "environment variable"),
    ("FROM http://host/v1\nPARAMETER remote_key_env HF_TOKEN\n", "may not name an environment"),
    ("FROM http://host/v1\nPARAMETER remote_key hf\n", "no such key is configured"),
    ("FROM http://host/v1\nPARAMETER remote_key vllm\nPARAMETER remote_key_env VLLM_KEY\n",
     "not both"),
    ("FROM http://169.254.169.254/v1\n", "cloud metadata service"),
    ("FROM http://[fe80::1]:8000/v1\n", "link-local address"),
    ("FROM http://host/v1\nPARAMETER remote_replica http://2852039166/v1\n", "metadata"),
    ("FROM http://metadata.google.internal/v1\n", "metadata"),
    ("FROM http://host/v1\nPARAMETER remote_replica ftp://x/v1\n", "http:// or https://"),
    ("FROM http://host/v1\nTEMPLATE {{ .Prompt }}\n", "own chat template"),
    ("FROM smollm2\nPARAMETER remote_model x\n", "need FROM with the http(s)://"),
])
def test_bad_remote_modelfiles_are_refused(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(CreateError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Store(tmp_path).create("x", text)
    assert Store(tmp_path).list() == []


def test_over_http_a_remote_from_needs_a_local_or_keyed_caller() -> None:
    mf = parse("FROM http://10.0.0.9:8000/v1\n")
    with pytest.raises(CreateError) as err:
        refuse_host_paths(mf)
    assert str(err.value) == REMOTE_REFUSED
    refuse_host_paths(mf, allow_remote=True)


def test_request_translation() -> None:
    req = ChatRequest(
        model="big", system="Be brief.", options=Options(temperature=0, num_predict=50,
                                                         stop=["END"], top_k=5, seed=3),
        messages=[Message(role="user", content="weather?"),
                  Message(role="assistant", tool_calls=[ToolCall(id="c1", name="w",
                                                                 arguments={"city": "Oslo"})]),
                  Message(role="tool", content="cold", tool_call_id="c1", name="w")],
        tools=[Tool(name="w", parameters={"type": "object"})],
        tool_choice=NamedTool(name="w"), parallel_tool_calls=False,
        format={"type": "object"}, format_strict=False)
    path, body = request_body(req, "upstream-name")
    assert path == "/chat/completions" and body["model"] == "upstream-name"
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert body["messages"][2]["tool_calls"][0]["function"] == {"name": "w",
                                                                "arguments": '{"city": "Oslo"}'}
    assert body["messages"][3] == {"role": "tool", "content": "cold", "tool_call_id": "c1",
                                   "name": "w"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"]["json_schema"]["strict"] is False
    assert (body["temperature"], body["max_tokens"], body["stop"], body["top_k"],
            body["seed"]) == (0, 50, ["END"], 5, 3)
    raw = ChatRequest(model="big", messages=[], prompt="Once upon")
    assert request_body(raw, "m")[0] == "/completions"
    from llmrun.request import EngineError

    with pytest.raises(EngineError, match="grammar"):
        request_body(req.model_copy(update={"grammar": "start: /a/"}), "m")


def test_reader_assembles_streamed_tool_calls_and_usage() -> None:
    r = _Reader()
    chunks = []
    for data in [
        {"choices": [{"delta": {"role": "assistant", "content": "Let me "}}]},
        {"choices": [{"delta": {"content": "check."}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_9", "function": {
            "name": "get_weather", "arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
            "arguments": 'ty": "Oslo"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9,
                                  "prompt_tokens_details": {"cached_tokens": 4}}},
    ]:
        chunks += r.read(json.loads(json.dumps(data)))
    assert "".join(c.text for c in chunks) == "Let me check."
    assert [(c.id, c.name, c.arguments) for c in r.tool_calls()] == [
        ("call_9", "get_weather", {"city": "Oslo"})]
    assert r.finish == "tool_calls" and r.usage["prompt_tokens"] == 12
    bad = _Reader()
    bad.read({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
        "name": "f", "arguments": "{oops"}}]}}]})
    from llmrun.request import EngineError

    with pytest.raises(EngineError, match="not JSON"):
        bad.tool_calls()


def test_rpc_settings_are_checked() -> None:
    from llmrun import config

    assert config.parse_rpc_workers(" 10.0.0.5:50052, [::1]:7,10.0.0.5:50052") == (
        "10.0.0.5:50052", "[::1]:7")
    for bad in ("10.0.0.5", "host:0", "host:70000", ":5", "host:x"):
        with pytest.raises(ValueError):
            config.parse_rpc_workers(bad)
    assert config.parse_rpc_split("3,1") == "3,1" and config.parse_rpc_split("") == ""
    for bad in ("0,0", "1,-1", "a", "inf,1"):
        with pytest.raises(ValueError):
            config.parse_rpc_split(bad)


def test_ps_says_where_layers_live() -> None:
    from llmrun.cli.daemon import _processor

    assert _processor({"name": "m"}) == "100% CPU"
    placed = {"rpc": {"layers": 31, "local_layers": 0, "workers": [
        {"endpoint": "10.0.0.5:50052", "share": 0.75}, {"endpoint": "10.0.0.6:50052",
                                                         "share": 0.25}]}}
    assert _processor(placed) == ("0/31 layers here; rest on 10.0.0.5:50052 75%, "
                                  "10.0.0.6:50052 25%")


def test_failover_and_health_checks_without_a_network() -> None:
    """The first replica refuses connections, the second answers: the answer comes from the
    second and the first is down; once the first answers /models again, a health check
    brings it back up."""
    import asyncio

    import httpx

    from llmrun.request import Done
    from llmrun.server.upstream import Upstream
    from llmrun.store.manifests import Remote

    first_up = False
    sse = ('data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
           'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], '
           '"usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n')

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a" and not first_up:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": []})
        assert request.headers.get("authorization") is None  # no key variable set
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def scenario() -> None:
        nonlocal first_up
        up = Upstream("big", Remote(urls=["http://a/v1", "http://b/v1"], model="m"),
                      transport=httpx.MockTransport(handle))
        events = [e async for e in up.chat(ChatRequest(model="big", messages=[
            Message(role="user", content="hello")]))]
        text = "".join(getattr(e, "text", "") for e in events)
        done = events[-1]
        assert text == "hi" and isinstance(done, Done) and done.stats.prompt_tokens == 3
        assert [r["state"] for r in up.health()] == ["down", "up"]
        await up.probe()
        assert up.health()[0]["state"] == "down"  # still refusing
        first_up = True
        await up.probe()
        assert [r["state"] for r in up.health()] == ["up", "up"]
        await up.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("status", "body", "expected"), [
    (400, '{"error": {"message": "bad schema"}}', (400, "bad schema")),
    (200, "data: {not json\n\n", (502, "malformed stream")),
    (200, 'data: {"error": {"message": "out of memory"}}\n\n', (502, "out of memory")),
    (503, "busy", (503, "no replica")),
])
def test_upstream_failures_are_clear_errors(status: int, body: str,
                                            expected: tuple[int, str]) -> None:
    """What a remote server may answer badly becomes an EngineError with a status and words
    a client can act on (the upstream's own 4xx, 502 for a broken stream, 503 when no
    replica answers): never a hang, never a crash of the daemon's request."""
    import asyncio

    import httpx

    from llmrun.api.dialect import http_status
    from llmrun.request import EngineError
    from llmrun.server.upstream import Upstream
    from llmrun.store.manifests import Remote

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, text=body, headers={"content-type": "text/event-stream"})

    async def scenario() -> None:
        up = Upstream("big", Remote(urls=["http://a/v1"], model="m"),
                      transport=httpx.MockTransport(handle))
        with pytest.raises(EngineError) as err:
            async for _ in up.chat(ChatRequest(model="big", messages=[
                    Message(role="user", content="hello")])):
                pass
        await up.close()
        assert http_status(err.value) == expected[0] and expected[1] in err.value.message

    asyncio.run(scenario())
