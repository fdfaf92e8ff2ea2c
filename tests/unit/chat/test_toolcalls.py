"""llmrun.chat.toolcalls: the tolerant tool-call reader and the stream filter, over recorded
model outputs of every shape small models write and the near misses that must stay
content."""

from __future__ import annotations

import time
from typing import Any

import pytest

from llmrun.chat import toolcalls
from llmrun.chat.toolcalls import (
    MAYBE,
    NO,
    YES,
    ToolCheck,
    ToolStream,
    cut_call,
    filter_events,
    parse_calls,
    shape,
)
from llmrun.request import Chunk, PartialCall, ToolCall

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
READ = {"type": "object", "properties": {"path": {"type": "string", "minLength": 1}},
        "required": ["path"]}
CHECK = ToolCheck({"get_weather": WEATHER, "read_file": READ, "get_time": None})
ANY = ToolCheck({"a": None, "b": None, "c": None, "f": None, "get_weather": None,
                 "get_time": None})


def calls_of(text: str, family: str = "hermes", check: ToolCheck = CHECK,
             truncated: bool = False) -> tuple[list[tuple[str, dict[str, Any]]], str] | None:
    parsed = parse_calls(text, family, check, truncated)
    if parsed is None:
        return None
    return [(c.name, c.arguments) for c in parsed[0]], parsed[1]


PARIS = [("get_weather", {"city": "Paris"})]

# What small models wrote, as they wrote it (SmolLM2-135M steered by few-shot messages;
# a 0.5B Hermes model; Llama-style tags), and what the reader makes of it.
RECORDED = [
    ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', PARIS, ""),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     PARIS, ""),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', PARIS, ""),
    ('```tool_call\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', PARIS, ""),
    ('```\n{"name": "get_weather", "arguments": {"city": "Paris"}}', PARIS, ""),  # fence open
    ('I will check the weather.\n```json\n{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}\n```\nOne moment.', PARIS, "I will check the weather.\n\nOne moment."),
    ('{"function": "get_weather", "parameters": {"city": "Paris"}}', PARIS, ""),
    ('{"type": "function", "function": {"name": "get_weather", "arguments": '
     '"{\\"city\\": \\"Paris\\"}"}}', PARIS, ""),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "read_file", "arguments": {"path": "a.txt"}}]',
     [*PARIS, ("read_file", {"path": "a.txt"})], ""),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', PARIS, ""),
    ('<tool_call>\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
     '</tool_call>', PARIS, ""),
    ('<function=get_weather>{"city": "Paris"}</function>', PARIS, ""),
    ('Checking. <function=get_weather>{"city": "Paris"}', PARIS, "Checking."),
    ('{"name": "get_weather", "arguments": {"city": "Paris",},}', PARIS, ""),  # trailing commas
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', PARIS, ""),
    ('{"name": "get_time"}', [("get_time", {})], ""),
]


@pytest.mark.parametrize(("text", "calls", "rest"), RECORDED)
def test_recorded_shapes_are_calls(text: str, calls: list[Any], rest: str) -> None:
    assert calls_of(text) == (calls, rest)


@pytest.mark.parametrize("text", [
    '{"name": "get_wether", "arguments": {"city": "Paris"}}',  # an unknown name
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # fails the schema
    '{"name": "get_weather", "arguments": {"city": 3}}',  # wrong type
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}',  # not in enum
    '{"name": "read_file", "arguments": {"path": ""}}',  # minLength
    '```json\n{"name": "Alice", "age": 31}\n```',  # the JSON a user asked for
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # never closed
    '{"name": "get_weather", "arguments": "not json"}',
    '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
    '<function=nope>{"x": 1}</function>',
    "```python\nprint({'name': 'get_weather'})\n```",
    "no call at all",
    '[1, 2, {"name": "get_weather", "arguments": {"city": "Paris"}}]'[0:5],
])
def test_near_misses_stay_content(text: str) -> None:
    assert parse_calls(text, "hermes", CHECK) is None
    assert parse_calls(text, "json", CHECK) is None


def test_one_bad_block_leaves_the_good_ones() -> None:
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>')
    found = calls_of(text)
    assert found is not None
    assert found[0] == [("get_weather", {"city": "Oslo"})]
    assert "launch_rockets" in found[1]  # stays content, as the model wrote it


def test_parallel_hermes_and_string_arguments() -> None:
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n'
            '<tool_call>\n{"name": "b", "parameters": {}}\n</tool_call>\n'
            '<tool_call>{"name": "c"}')  # no closing tag: the model stopped right after
    assert calls_of(text, check=ANY) == ([("a", {"x": 1}), ("b", {}), ("c", {})], "")
    parsed = parse_calls(text, "hermes", ANY)
    assert parsed and len({c.id for c in parsed[0]}) == 3
    assert parsed[0][0].id.startswith("call_") and len(parsed[0][0].id) == 29


def test_truncated_output_keeps_whole_calls() -> None:
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "a'
    assert calls_of(text, check=ANY, truncated=True) == ([("a", {})], "")
    assert parse_calls('<tool_call>{"name": "a", "argu', "hermes", ANY, truncated=True) is None
    text = '[{"name": "a", "arguments": {}}, {"name": "a", "argu'
    assert calls_of(text, "json", ANY, truncated=True) == ([("a", {})], "")
    text = '{"name": "a", "arguments": {}}\n{"name": "b", "argu'
    assert calls_of(text, "json", ANY, truncated=True) == ([("a", {})], "")


def test_llama3_tag_and_pythonic() -> None:
    tagged = calls_of('<|python_tag|>{"name": "get_time", "parameters": {}}; '
                      '{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3")
    assert tagged == ([("get_time", {}), ("get_weather", {"city": "Rome"})], "")
    py = calls_of('[get_weather(city="Lima", unit="c"), get_time()]', "llama3")
    assert py == ([("get_weather", {"city": "Lima", "unit": "c"}), ("get_time", {})], "")
    for text in ('{"name": "Ada", "parameters": {}}', "[get_weather(city=open('x'))]",
                 "[__import__('os')]", '[get_weather(town="Lima")]'):
        assert parse_calls(text, "llama3", CHECK) is None, text


def test_mistral_both_forms() -> None:
    listed = calls_of('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}, '
                      '"id": "abcdefghi"}, {"name": "get_time", "arguments": {}}]', "mistral")
    assert listed == ([("get_weather", {"city": "Nice"}), ("get_time", {})], "")
    args = calls_of('[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time'
                    "[ARGS]{}", "mistral")
    assert args == ([("get_weather", {"city": "Nice"}), ("get_time", {})], "")
    assert parse_calls("[TOOL_CALLS]get_weather[ARGS]{oops", "mistral", CHECK) is None
    assert parse_calls('[TOOL_CALLS]get_weather[ARGS]{"town": "Nice"}', "mistral", CHECK) is None


def test_hostile_outputs_are_bounded() -> None:
    """Deep nesting, many call-shaped places and schemas with backtracking regexes: the
    reader answers at once and never raises."""
    deep = '{"name": "a", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    assert parse_calls(deep, "json", ANY) is None
    many = '{"name": "x", "arguments": {"s": "' + "{" * 200_000 + '"}} ' * 50
    t0 = time.perf_counter()
    assert parse_calls(many, "json", ANY) is None
    assert parse_calls('{"name": "' * 100_000, "json", ANY) is None
    assert time.perf_counter() - t0 < 20  # linear (MAX_TRIES scans), not quadratic
    redos = ToolCheck({"f": {"type": "object",
                             "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}})
    t0 = time.perf_counter()
    found = calls_of('{"name": "f", "arguments": {"s": "' + "a" * 40 + '!"}}', check=redos)
    assert found == ([("f", {"s": "a" * 40 + "!"})], "")  # patterns are not run here
    assert time.perf_counter() - t0 < 5
    broken = ToolCheck({"f": {"$ref": "https://example.com/schema.json"}})
    assert calls_of('{"name": "f", "arguments": {}}', check=broken) == ([("f", {})], "")


# -- shapes, while streaming -------------------------------------------------------------------

NAMES = frozenset({"get_weather", "read_file"})


@pytest.mark.parametrize(("text", "verdict"), [
    ("{", MAYBE), ('{"', MAYBE), ('{ "name" :', MAYBE), ('{"name": "get_w', MAYBE),
    ('{"name": "get_weather"', YES), ('{\n  "name": "read_file",', YES),
    ('[{"name": "get_weather"', YES), ('{"type": "function", "function": {"name": "read_file"',
                                       YES),
    ('{"function": "get_weather"', YES), ('{"name": "Alice"', NO), ('{"age": 3}', NO),
    ("`", MAYBE), ("```", MAYBE), ("```json", MAYBE), ("```json\n", MAYBE),
    ('```json\n{"name": "get_weather"', YES), ("```python\n", NO), ("```python\nx = 1", NO),
    ("``x", NO), ("<", MAYBE), ("<tool", MAYBE), ("<tool_call>", YES), ("<function=x>", YES),
    ("< b", NO), ("<b>", NO), ("[", MAYBE), ("[1, 2]", NO), ("[TOOL_CALLS]", YES),
    ("{" + " " * 400, NO),
])
def test_shape(text: str, verdict: int) -> None:
    assert shape(text, NAMES) == verdict


def feed(stream: ToolStream, pieces: list[str]) -> tuple[str, toolcalls.Finished]:
    out = "".join(stream.push(p)[0] for p in pieces)
    return out, stream.finish()


def pieces_of(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(("text", "calls", "rest"), RECORDED)
def test_stream_leaks_nothing_of_a_call(text: str, calls: list[Any], rest: str) -> None:
    """Fed three characters at a time, as tokens come: the call's text is never released
    as content; what came before it is released as it comes."""
    out, end = feed(ToolStream("hermes", CHECK), pieces_of(text))
    assert [(c.name, c.arguments) for c in end.calls] == calls
    assert "get_weather" not in out and "get_time" not in out
    assert out.strip() == "" or rest.startswith(out.strip())


def test_stream_releases_what_is_not_a_call_at_once() -> None:
    stream = ToolStream("hermes", CHECK)
    released = [stream.push(p)[0] for p in ["Use ", "a dict ", "{", "'a': 1", "} here."]]
    assert released == ["Use ", "a dict ", "", "{'a': 1", "} here."]
    out, end = feed(ToolStream("hermes", CHECK), pieces_of('Here: {"name": "Alice", "age": 3}'))
    assert out == 'Here: {"name": "Alice", "age": 3}' and not end.calls
    out, end = feed(ToolStream("hermes", CHECK), pieces_of("```python\nprint(1)\n```"))
    assert out + end.text == "```python\nprint(1)\n```" and not end.calls
    # a call that fails its schema is held to the end, then released whole
    text = '{"name": "get_weather", "arguments": {"town": "Paris"}}'
    out, end = feed(ToolStream("hermes", CHECK), pieces_of(text))
    assert out == "" and end.text == text and not end.calls


def test_stream_holds_markup_split_across_chunks() -> None:
    s = ToolStream("hermes", ANY)
    pieces = ["Sure", ", one moment. <", "tool", "_ca", "ll>\n{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Paris\"}}\n</tool_", "call>"]
    released = [s.push(p)[0] for p in pieces]
    assert all("<" not in text for text in released)
    assert "".join(released) == "Sure, one moment. "
    end = s.finish()
    assert [c.name for c in end.calls] == ["get_weather"] and end.text == ""


def test_stream_partial_markers() -> None:
    out, end = feed(ToolStream("hermes", ANY), ["a <", "b and <tool", "box>"])
    assert out + end.text == "a <b and <toolbox>" and not end.calls
    out, end = feed(ToolStream("hermes", ANY), ["x <tool_call>", "oops"])
    assert out == "x " and end.text == "<tool_call>oops" and not end.calls
    out, end = feed(ToolStream("hermes", ANY), ["ends with <tool_c"])
    assert out == "ends with " and end.text == "<tool_c"


def test_stream_not_parallel_keeps_the_first_call() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}'
    _, end = feed(ToolStream("hermes", ANY, parallel=False), [text])
    assert [c.name for c in end.calls] == ["a"]


def test_repeated_calls_are_dropped() -> None:
    one = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
    same = '<tool_call>{"name": "f", "arguments": {"b": 2, "a": 1}}</tool_call>\n'
    other = '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>'
    _, end = feed(ToolStream("hermes", ANY), [one, same, other, one])
    assert [c.arguments for c in end.calls] == [{"a": 1, "b": 2}, {"a": 2}]


def lp(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top": []}


def test_filter_events_payloads_and_finish_reason() -> None:
    streams = {"r1": ToolStream("hermes", CHECK), "r2": ToolStream("hermes", CHECK)}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events = filter_events(streams, [
        ("r1", "started", {"prompt_tokens": 5, "cached_tokens": 0, "n_ctx": 64}),
        ("r1", "chunk", {"text": "Hi "}), ("r1", "chunk", {"text": call}),
        ("r0", "chunk", {"text": "other request"}),
        ("r1", "done", {"finish_reason": "stop", "completion_tokens": 9}),
        ("r2", "chunk", {"text": "<tool"}), ("r2", "done", {"finish_reason": "cancel"}),
    ])
    assert events.pop(0)[1] == "started"  # passes untouched
    assert events[0] == ("r1", "chunk", {"text": "Hi "})
    assert events[1] == ("r0", "chunk", {"text": "other request"})
    rid, kind, payload = events[2]
    assert (rid, kind) == ("r1", "chunk") and payload["text"] == ""
    assert [ToolCall.model_validate(c).name for c in payload["tool_calls"]] == ["get_weather"]
    assert events[3] == ("r1", "done", {"finish_reason": "tool_calls", "completion_tokens": 9})
    assert events[4] == ("r2", "done", {"finish_reason": "cancel"})
    assert streams == {}


def test_filter_events_logprobs_follow_their_text() -> None:
    streams = {"r": ToolStream("hermes", ANY)}
    events = filter_events(streams, [
        ("r", "chunk", {"text": "ok ", "logprobs": [lp("ok ")]}),
        ("r", "chunk", {"text": "<", "logprobs": [lp("<")]}),
        ("r", "chunk", {"text": "b", "logprobs": [lp("b")]}),
        ("r", "done", {"finish_reason": "length"}),
    ])
    texts = [e[2]["text"] for e in events if e[1] == "chunk"]
    tokens = [x["token"] for e in events if e[1] == "chunk" for x in e[2]["logprobs"]]
    assert "".join(texts) == "ok <b" and tokens == ["ok ", "<", "b"]
    assert events[-1] == ("r", "done", {"finish_reason": "length"})
    streams = {"r": ToolStream("hermes", ANY)}  # a call: its logprobs ride on its chunk
    events = filter_events(streams, [
        ("r", "chunk", {"text": '<tool_call>{"name": "f"}</tool_call>',
                        "logprobs": [lp("<tool_call>")]}),
        ("r", "done", {"finish_reason": "stop"})])
    assert events[0][2]["logprobs"][0]["token"] == "<tool_call>"


def test_filter_events_truncated_call() -> None:
    streams = {"r": ToolStream("hermes", ANY)}
    events = filter_events(streams, [
        ("r", "chunk", {"text": '<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"na'}),
        ("r", "done", {"finish_reason": "length"})])
    assert [c["name"] for c in events[0][2]["tool_calls"]] == ["f"]
    assert events[1][2]["finish_reason"] == "tool_calls"
    streams = {"r": ToolStream("hermes", ANY)}  # cut inside the only call: content, "length"
    events = filter_events(streams, [("r", "chunk", {"text": '<tool_call>{"na'}),
                                     ("r", "done", {"finish_reason": "length"})])
    assert events == [("r", "chunk", {"text": '<tool_call>{"na'}),
                      ("r", "done", {"finish_reason": "length"})]


# -- a call the token limit cut off -----------------------------------------------------------

# SmolLM2's forced call at 14, 16, 18, 20, 22 and 24 tokens (greedy, tool_choice required)
FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Paris'
FORCED_CUTS = [FORCED[:FORCED.index(end) + len(end)]
               for end in ('get_weather",', '"arguments', '": {', '{\n  "', '"city":', "Paris")]


@pytest.mark.parametrize(("text", "found"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     ("get_weather", '{"city": "Par')),
    ('```json\n{"function": "read_file", "parameters": {"pa', ("read_file", '{"pa')),
    ('{"type": "function", "function": {"name": "get_time", "arguments": ',
     ("get_time", "")),
    ('<function=get_weather>{"city": ', ("get_weather", '{"city":')),
    ('[TOOL_CALLS]get_weather[ARGS]{"ci', ("get_weather", '{"ci')),
    ('[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS] {', ("get_weather", "{")),
    # the last call begun is the one cut
    ('{"name": "get_time", "arguments": {}}\n{"name": "read_file", "arguments": {"path',
     ("read_file", '{"path')),
    ('{"name": "get_weather", "arguments', None),  # its arguments not begun
    ('{"name": "get_weath', None),
    ('{"name": "send_mail", "arguments": {"to', None),  # not one of the tools
    ('{"name": "get_weather\\q", "arguments": {', None),  # not a JSON string
])
def test_cut_call(text: str, found: tuple[str, str] | None) -> None:
    assert cut_call(text, CHECK.names) == found


def test_cut_call_forced_needs_only_the_name() -> None:
    assert cut_call('{"name": "get_weather", "argu', CHECK.names, begun=False) == \
        ("get_weather", "")
    assert cut_call('{"name": "get_weather", "argu', CHECK.names) is None
    # a model echoing the tool list (Gemma 3) names a tool with no arguments: no call
    echo = '{"type": "function", "function": {"name": "get_weather", "description": "Wea'
    assert cut_call(echo, CHECK.names) is None


def test_cut_call_is_bounded() -> None:
    hostile = '{"name": "' * 20_000 + '{"name": "get_weather", "arguments": {'
    started = time.perf_counter()
    assert cut_call(hostile, CHECK.names) is None  # past MAX_TRIES heads: not looked for
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("text", FORCED_CUTS)
def test_a_forced_call_cut_off_is_a_partial_call_never_text(text: str) -> None:
    """Cut anywhere after the name was whole, a forced call ends as a PartialCall with the
    arguments' text as far as it got; nothing of it is released as text."""
    out, end = feed_cut(ToolStream("hermes", CHECK, forced=True), pieces_of(text))
    assert out == "" and end.text == "" and not end.calls
    assert end.partial is not None and end.partial.name == "get_weather"
    assert text.endswith(end.partial.arguments) and "name" not in end.partial.arguments


def feed_cut(stream: ToolStream, pieces: list[str]) -> tuple[str, toolcalls.Finished]:
    out = "".join(stream.push(p)[0] for p in pieces)
    return out, stream.finish(truncated=True)


def test_a_forced_call_cut_before_its_name() -> None:
    for text in ("<tool_call>\n", '<tool_call>\n{"name": "get_', '{"name": "get_wea'):
        # the one tool it can name (a named choice, or the only tool): a partial call
        out, end = feed_cut(ToolStream("json", CHECK, forced=True, only="get_weather"),
                            pieces_of(text))
        assert out + end.text == "" and end.partial == PartialCall(
            id=end.partial.id, name="get_weather", arguments="")  # type: ignore[union-attr]
        # one of several: nothing to report, and still no text
        out, end = feed_cut(ToolStream("json", CHECK, forced=True), pieces_of(text))
        assert out + end.text == "" and not end.calls and end.partial is None
    # nothing of the answer written (cut while thinking): no call either
    end = ToolStream("hermes", CHECK, forced=True, only="get_weather").finish(truncated=True)
    assert end.partial is None and not end.calls


def test_a_call_cut_after_its_arguments_is_whole() -> None:
    """Only the call's closing brace (or tag) was cut: its arguments are whole and valid,
    so it is a call, as the reader takes one whose `</tool_call>` is missing."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}'
    for forced in (True, False):
        _, end = feed_cut(ToolStream("hermes", CHECK, forced=forced), pieces_of(text))
        assert [(c.name, c.arguments) for c in end.calls] == PARIS and end.partial is None
    # whole but failing the schema: still cut
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}'
    _, end = feed_cut(ToolStream("hermes", CHECK, forced=True), pieces_of(text))
    assert not end.calls and end.partial and end.partial.arguments == '{"town": "Paris"}'


def test_an_auto_call_cut_off_inside_its_arguments_is_a_partial_call() -> None:
    """tool_choice auto: a call whose arguments had begun is a call cut off; before that,
    what was held goes out as text, as it did (it may be an echo of the tool list)."""
    text = '```json\n{"name": "get_weather", "arguments": {"city": "Pa'
    out, end = feed_cut(ToolStream("hermes", CHECK), ["Sure. ", *pieces_of(text)])
    assert out == "Sure. " and end.text == "" and end.partial is not None
    assert (end.partial.name, end.partial.arguments) == ("get_weather", '{"city": "Pa')
    out, end = feed_cut(ToolStream("hermes", CHECK), pieces_of('{"name": "get_weather"'))
    assert out + end.text == '{"name": "get_weather"' and end.partial is None
    # not cut by the token limit: released as text, as before
    out, end = feed(ToolStream("hermes", CHECK), pieces_of(text))
    assert out + end.text == text and end.partial is None


def test_filter_events_partial_call() -> None:
    streams = {"r": ToolStream("hermes", CHECK, forced=True)}
    events = filter_events(streams, [
        ("r", "chunk", {"text": FORCED, "logprobs": [lp("<tool_call>")]}),
        ("r", "done", {"finish_reason": "length", "completion_tokens": 24})])
    (rid, kind, payload), done = events
    assert (rid, kind, payload["text"]) == ("r", "chunk", "")
    assert payload["logprobs"] == [lp("<tool_call>")]  # the call's tokens ride with it
    cut = Chunk.model_validate(payload).partial_call  # as the daemon reads it
    assert cut is not None and (cut.name, cut.arguments) == \
        ("get_weather", '{\n  "city": "Paris')
    assert cut.id.startswith("call_")
    assert done == ("r", "done", {"finish_reason": "length", "completion_tokens": 24})


@pytest.mark.parametrize(("arguments", "written", "cut_strings"), [
    ('{\n  "city": "Paris', {}, {"city": "Paris"}),
    ('{"city": "Paris", "days": 3', {"city": "Paris", "days": 3},
     {"city": "Paris", "days": 3}),
    ('{"city": "Paris", "un', {"city": "Paris"}, {"city": "Paris"}),
    ("", {}, {}),
    ("{", {}, {}),
    ('{"input": "ls -', {}, {"input": "ls -"}),
])
def test_partial_call_written(arguments: str, written: dict[str, Any],
                              cut_strings: dict[str, Any]) -> None:
    cut = PartialCall(id="call_1", name="f", arguments=arguments)
    assert cut.written() == written and cut.written(cut_strings=True) == cut_strings


# -- the checker both sides use (the runner reading calls, the daemon checking them again) -----


@pytest.mark.parametrize("arguments", [
    {"city": float("nan")}, {"city": float("inf")},  # the IPC writes them as null
    {"city": ("Paris",)}, {"city": {"Paris"}}, {"city": b"Paris"},  # a Python-style call's
    {"city": {1: "Paris"}},  # a key that is no string
    ["Paris"], "Paris",  # no object
])
def test_arguments_that_would_change_on_the_ipc_make_no_call(arguments: Any) -> None:
    """What the runner accepts must reach the daemon as it was checked, for the daemon to
    reach the same verdict: JSON data only, whatever the schema allows."""
    assert not ToolCheck({"f": None}).accepts("f", arguments)
    assert ToolCheck({"f": None}).accepts("f", {"city": ["Paris", 1.5, None, True, {}]})


def test_arguments_nested_past_the_readers_depth_make_no_call() -> None:
    def nested(depth: int) -> dict[str, Any]:
        value: dict[str, Any] = {}
        for _ in range(depth - 1):
            value = {"a": value}
        return value

    check = ToolCheck({"f": None})
    assert check.accepts("f", nested(toolcalls.MAX_DEPTH))
    assert not check.accepts("f", nested(toolcalls.MAX_DEPTH + 1))
    # a Python-style call's text, nested past it, is no call either (ast reads ~200 levels)
    deep = "f(a=" + "[" * 150 + "]" * 150 + ")"
    assert calls_of(f"<|python_tag|>{deep}", "llama3", check) is None
