"""The daemon <-> runner protocol (llmrun/protocol.py): every message goes through orjson and
back to itself, the frames of a generate round are the bytes the hand-built dictionaries made,
and a frame that is no message of the protocol is refused with an error that names what is
wrong."""

from __future__ import annotations

from typing import Any

import pytest

from llmrun import ipc, jsonio, protocol
from llmrun.protocol import ProtocolError, parse_command, parse_reply
from llmrun.request import ChatRequest, Message, error_event

REQUEST = ChatRequest(model="m", messages=[Message(role="user", content="hi")])

COMMANDS: list[protocol.Command] = [
    protocol.Load(model=["/a.gguf", "/b.gguf"], ctx=4096, slots=4, threads=2,
                  adaptive_threads=True, lora=[protocol.Lora(path="/l.gguf", scale=0.5)],
                  mmproj="/p.gguf", draft_model=["/d.gguf"], kv_type="q8_0", flash_attn="on",
                  prompt_cache="/cache", prompt_cache_key="k", prompt_cache_size=1 << 30,
                  rpc=["h:1"], rpc_split=[3.0, 1.0], gpu_layers=10, device=["CUDA0"],
                  tensor_split=[0.5, 0.5], main_gpu=1, debug=True, max_frame=1 << 20),
    protocol.Load(model=["/a.gguf"], ctx=512, max_frame=ipc.MAX_FRAME),
    protocol.Generate(id="r1", request=REQUEST),
    protocol.Count(id="c1", request=REQUEST, detail=True),
    protocol.Tokenize(id="c2", text="hello", add_special=True),
    protocol.Detokenize(id="c3", tokens=[1, 2, 3]),
    protocol.Embed(id="e1", inputs=["a", "b"], truncate=True, offset=256),
    protocol.Cancel(id="r1"),
    protocol.Shutdown(),
]

EVENTS: list[tuple[str, str, Any]] = [
    ("r1", "started", {"prompt_tokens": 3, "cached_tokens": 0, "n_ctx": 512}),
    ("r1", "progress", {"total": 300, "cached": 0, "processed": 64}),
    ("r1", "chunk", {"text": "é"}),
    ("r1", "chunk", {"text": "a", "logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97],
                                                "top": []}]}),
    ("r1", "chunk", {"text": "", "thinking": "hm"}),
    ("r1", "chunk", {"text": "", "tool_calls": [{"id": "c", "name": "f", "arguments": {}}],
                     "logprobs": None}),
    ("r1", "done", {"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": "stop",
                    "stop_sequence": None, "context": [1, 2]}),
    ("r2", "error", error_event("prompt_too_long", "too long", prompt_tokens=9, n_ctx=8)),
    ("c1", "count", {"prompt_tokens": 3, "n_ctx": 512, "prompt": "hi", "tokens": [1, 2, 3]}),
    ("c2", "tokens", {"tokens": [1, 2], "pieces": ["a", [226, 130]]}),
    ("c3", "text", {"content": "abc"}),
    ("e1", "embedding_part", {"embeddings": [[0.5, 0.25]]}),
    ("e1", "embedding", {"embeddings": [[0.5, 0.25]], "prompt_tokens": 4}),
    ("", "engine", {"steps": 3, "step_seconds": 0.25}),
]

REPLIES: list[protocol.Reply] = [
    protocol.Ready(info={"n_ctx_seq": 512, "n_slots": 1, "n_ctx_train": 8192,
                         "has_template": True, "vision": False, "size": 100,
                         "sandbox": ["seccomp"], "confined": True, "sandbox_missing": [],
                         "devices": {"CUDA0": 1 << 20}}),
    protocol.Fatal(error="no such file"),
    protocol.Events(events=EVENTS),
    protocol.Events(events=[]),  # a heartbeat
]


def wire(msg: object) -> Any:
    """`msg` as the peer decodes it: through a frame and back."""
    frame = ipc.encode(msg)
    return jsonio.loads(frame[ipc.HEADER.size:])


@pytest.mark.parametrize("msg", COMMANDS, ids=lambda m: type(m).__name__)
def test_every_command_round_trips(msg: protocol.Command) -> None:
    assert parse_command(wire(msg)) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips(msg: protocol.Reply) -> None:
    back = parse_reply(wire(msg))
    if isinstance(msg, protocol.Events):  # (events are [id, kind, payload] lists on the wire)
        assert isinstance(back, protocol.Events)
        assert [tuple(e) for e in back.events] == msg.events
    else:
        assert back == msg


def test_frames_are_the_bytes_the_dictionaries_made() -> None:
    # the generate round as the daemon and runner wrote it by hand before the types
    assert ipc.encode(protocol.Generate(id="r1", request=REQUEST)) == ipc.encode(
        {"type": "generate", "id": "r1", "request": REQUEST.model_dump()})
    assert ipc.encode(protocol.Events(events=EVENTS)) == ipc.encode(
        {"type": "events", "events": EVENTS})
    assert ipc.encode(protocol.Cancel(id="r1")) == ipc.encode({"type": "cancel", "id": "r1"})
    assert ipc.encode(protocol.Shutdown()) == ipc.encode({"type": "shutdown"})
    assert ipc.encode(protocol.Embed(id="e", inputs=["a"], truncate=False, offset=0)) == \
        ipc.encode({"type": "embed", "id": "e", "inputs": ["a"], "truncate": False,
                    "offset": 0})


@pytest.mark.parametrize(("frame", "says"), [
    ({"type": "generate!", "id": "r1", "request": {}}, "unknown message type 'generate!'"),
    ({"id": "r1"}, "missing type"),
    ([1, 2], "expected an object"),
    ({"type": "generate", "request": {}}, "generate: missing id"),
    ({"type": "generate", "id": 7, "request": {}}, "generate.id: expected a string, got 7"),
    ({"type": "generate", "id": "r", "request": "x"}, "generate.request: expected an object"),
    ({"type": "tokenize", "id": "r", "text": "a", "add_special": 1},
     "tokenize.add_special: expected a boolean"),
    ({"type": "detokenize", "id": "r", "tokens": ["1"]}, "expected a list of integers"),
    ({"type": "embed", "id": "r", "inputs": ["a", 2]}, "embed.inputs[1]: expected a string"),
    ({"type": "cancel", "id": "r", "padding": "x" * (1 << 20)}, "cancel: unknown field 'padding'"),
    ({"type": "load", "model": ["/a"], "ctx": True, "max_frame": 1}, "load.ctx: expected an "
                                                                     "integer, got True"),
    ({"type": "load", "model": ["/a"], "ctx": 1}, "load: missing max_frame"),
    ({"type": "load", "model": ["/a"], "ctx": 1, "max_frame": 1, "kv_type": "f32"},
     "load.kv_type: expected one of"),
    ({"type": "load", "model": ["/a"], "ctx": 1, "max_frame": 1, "lora": [{"scale": 1.0}]},
     "load.lora[0]: missing path"),
])
def test_a_malformed_command_is_refused(frame: Any, says: str) -> None:
    with pytest.raises(ProtocolError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_command(frame)


@pytest.mark.parametrize(("frame", "says"), [
    ({"type": "welcome"}, "unknown message type 'welcome'"),
    ({"type": "ready", "info": {"n_ctx_seq": 1}}, "ready.info: missing"),
    ({"type": "fatal"}, "fatal: missing error"),
    ({"type": "events"}, "events: missing events"),
    ({"type": "events", "events": {}}, "events: expected a list"),
    ({"type": "events", "events": [["r", "chunk"]]}, r"events\[0\]: expected \[id, kind"),
    ({"type": "events", "events": [[1, "chunk", {"text": "a"}]]},
     r"events\[0\]: expected a string id"),
    ({"type": "events", "events": [["r", "shout", {}]]}, "unknown event kind 'shout'"),
    ({"type": "events", "events": [["r", "chunk", {"text": 5}]]}, r"\(chunk\).text: expected a"),
    ({"type": "events", "events": [["r", "chunk", {"txt": "a"}]]}, r"\(chunk\): missing text"),
    ({"type": "events", "events": [["r", "chunk", {"text": "a", "x": "y" * (1 << 20)}]]},
     "unknown field 'x'"),
    ({"type": "events", "events": [["r", "started", {"prompt_tokens": 1, "cached_tokens": 0}]]},
     "missing n_ctx"),
    ({"type": "events", "events": [["r", "chunk", {"text": "", "logprobs": [[[]]]}]]},
     "logprobs: expected list"),
    ({"type": "events", "events": [["r", "done", {"finish_reason": "bored"}]]},
     "finish_reason: expected one of"),
    ({"type": "events", "events": [["r", "done", {"total_ns": 5}]]}, "unknown field 'total_ns'"),
    ({"type": "events", "events": [["r", "done", {"completion_tokens": "2"}]]},
     "completion_tokens: expected an integer"),
    ({"type": "events", "events": [["r", "error", {"code": "x", "message": "m",
                                                   "blob": ["y"]}]]}, "blob: expected a number"),
    ({"type": "events", "events": [["", "engine", {"steps": "many"}]]}, "steps: expected a num"),
    ({"type": "events", "events": [], "more": 1}, "unknown field 'more'"),
])
def test_a_malformed_reply_is_refused(frame: Any, says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        parse_reply(frame)


def test_an_oversized_field_is_named_without_being_repeated() -> None:
    with pytest.raises(ProtocolError) as err:
        parse_command({"type": "tokenize", "id": "r", "text": ["x" * (1 << 20)]})
    assert len(str(err.value)) < 200


def test_a_message_orjson_refuses_is_written_alike() -> None:
    """A schema with an integer beyond 64 bits (found by the fuzzer: `maximum:
    -9223372036854775809`) makes orjson refuse the Generate frame; the standard library then
    writes the dataclass the same way, and the runner reads the message back (orjson reads
    an integer beyond 64 bits as the nearest float)."""
    huge = -9223372036854775809
    req = ChatRequest(model="m", messages=[Message(role="user", content="hi")],
                      format={"type": "integer", "maximum": huge})
    msg = protocol.Generate(id="r1", request=req)
    frame = jsonio.dumps(msg)
    back = parse_command(jsonio.loads(frame))
    assert isinstance(back, protocol.Generate) and back.id == "r1"
    assert isinstance(back.request.format, dict)
    assert back.request.format["maximum"] == float(huge)
    assert back.request.messages == msg.request.messages


@pytest.mark.parametrize(("payload", "says"), [
    ({"text": "x", "logprobs": [{"token": "x", "logprob": float("nan")}]}, "finite"),
    ({"text": "x", "logprobs": [{"token": "x", "logprob": float("-inf")}]}, "finite"),
    ({"text": "x", "logprobs": [{"token": "x", "id": 1 << 60, "logprob": -0.5}]}, "within"),
])
def test_numbers_no_client_can_read_are_refused(payload: dict[str, Any], says: str) -> None:
    """A runner taken over could send NaN or Infinity (the standard library's fallback reads
    those literals), a negative count or an integer past 2**53: none reaches a dialect's JSON
    or /metrics."""
    with pytest.raises(ProtocolError, match=says):
        parse_reply({"type": "events", "events": [["r1", "chunk", payload]]})


@pytest.mark.parametrize(("kind", "payload", "says"), [
    ("done", {"prompt_tokens": -5, "completion_tokens": 1}, "a count"),
    ("done", {"prompt_tokens": 1 << 60, "completion_tokens": 1}, "within"),
    ("started", {"prompt_tokens": 3, "cached_tokens": 0, "n_ctx": -1}, "a count"),
    ("done", {"completion_tokens": 1, "prompt_ns": -15}, "a count"),
    ("engine", {"steps": float("inf")}, "finite"),
    ("embedding", {"embeddings": [[0.5]], "prompt_tokens": 1 << 54}, "within"),
])
def test_counts_are_checked_in_every_event(kind: str, payload: dict[str, Any],
                                           says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        parse_reply({"type": "events", "events": [["r1", kind, payload]]})
    sane = {k: 1 if isinstance(v, int) else 0.5 if isinstance(v, float) else [[0.5]]
            for k, v in payload.items()}
    parse_reply({"type": "events", "events": [["r1", kind, sane]]})  # the same, sane: passes


def test_what_the_model_wrote_is_data_not_counts() -> None:
    """A tool call's arguments are the model's: a negative or huge number there is no lie."""
    call = {"id": "c1", "name": "move", "arguments": {"dx": -5, "big": 1e300, "n": -(1 << 60)}}
    parse_reply({"type": "events", "events": [["r1", "chunk", {"text": "", "tool_calls": [call],
                                                               "partial_call": {"dx": -1}}]]})


def test_an_image_s_stand_in_ids_are_token_ids() -> None:
    """Images sit in token lists as negative stand-in ids (Ollama's `context` after an
    image): not a negative count."""
    parse_reply({"type": "events", "events": [["r1", "done", {
        "prompt_tokens": 9, "completion_tokens": 1, "context": [1, -734, -734, 2]}]]})


def test_a_request_that_does_not_validate_fails_only_itself() -> None:
    """A Generate of the right shape whose request no ChatRequest reads is the request's
    fault, not a broken peer's: RefusedRequest names its id (the runner answers an error
    event for it and goes on)."""
    with pytest.raises(protocol.RefusedRequest) as err:
        parse_command({"type": "generate", "id": "r9", "request": {"model": "m",
                                                                   "messages": "x"}})
    assert err.value.id == "r9"


def test_every_kind_of_work_is_one_row_its_events_checked_by_their_payloads() -> None:
    for name, kind in protocol.KINDS.items():
        assert kind.message.__dataclass_fields__["type"].default == name
        assert kind.final <= kind.events and "error" in kind.events
        assert all(event in protocol.PAYLOADS for event in kind.events)
    assert {"error"} | {e for k in protocol.KINDS.values() for e in k.final} == protocol.FINAL
