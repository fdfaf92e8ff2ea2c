"""The families that write each argument between tags of its own (formats/xml.py's
Seed-OSS, Tencent Hy3 and GLM, formats/invoke.py's MiniMax M2, DeepSeek V3.2/V4 DSML and
Kimi K3, formats/nested.py's MiniMax M3):
their outputs as llama.cpp's tests (tests/test-chat.cpp) give them, and the checks every
family passes (formatcases.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmrun.chat.formats import BY_NAME
from llmrun.request import Tool
from tests.unit.chat.formatcases import (
    CHECKS,
    detected,
    only_these_are,
    read_alike,
    run,
    written_as_its_template_writes,
)

FAMILIES = ["seed-oss", "minimax-m2", "deepseek-v3.2", "deepseek-v4", "kimi-k3", "hunyuan",
            "ling", "glm"]
# (MiniMax M3's values are typed by the schema alone: its own test of the whole-read check)
SPECIAL = Tool(name="special_function", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]})
OPTIONAL = Tool(name="special_function_with_opt", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}},
    "required": ["arg1"]})
TODO = Tool(name="todo_list", parameters={"type": "object", "properties": {"todos": {
    "type": "array", "items": {"type": "object", "properties": {
        "item": {"type": "string"}, "selected": {"type": "boolean"}}}}}, "required": ["todos"]})
EDIT = Tool(name="edit", parameters={"type": "object", "properties": {
    "filename": {"type": "string"}, "oldString": {"type": "string"},
    "newString": {"type": "string"}}, "required": ["filename", "oldString", "newString"]})
EMPTY = Tool(name="empty_args", parameters={"type": "object", "properties": {}})
TIME = Tool(name="get_time", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


DETECTED = dict([
    ("ByteDance-Seed-OSS.jinja", "seed-oss"),
    ("MiniMax-M2.jinja", "minimax-m2"),
    ("deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-v3.2"),
    ("deepseek-ai-DeepSeek-V4.jinja", "deepseek-v4"),
    ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "deepseek-v4"),
    ("tencent-Hy3.jinja", "hunyuan"),
    ("Kimi-K3.jinja", "kimi-k3"),
    ("MiniMax-M3.jinja", "minimax-m3"),
    # K2 Thinking writes K2's sections (llama.cpp reads it with its Kimi K2 parser)
    ("Kimi-K2-Thinking.jinja", "kimi-k2"),
    # Ling 3.0 writes GLM's calls (`<tool_call>NAME\n<arg_key>..`, its template's own
    # instructions and history), in `<role>` turns; its thought may end at a call
    ("inclusionai-ling-3.0-flash.jinja", "ling"),
    # Qwen3-Coder's `<function=` calls without Seed's blocks stay Qwen3-Coder's
    ("Qwen3-Coder.jinja", "qwen3-coder"),
])


@pytest.mark.parametrize(("template", "name"), list(DETECTED.items()))
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert detected(template) == name


def test_no_other_corpus_template_is_one_of_these() -> None:
    only_these_are([f for f in FAMILIES if f != "glm"] + ["minimax-m3"],  # (GLM: not these
                   DETECTED)                                             # alone)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", FAMILIES)
def test_family(name: str, check: Callable[[str], None]) -> None:
    check(name)


def test_seed_oss_thought_is_split_from_the_answer() -> None:
    text = "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!"
    thought, content, calls = read_alike("seed-oss", text)
    assert (thought, content.strip(), calls) == ("I'm thinking about the answer",
                                                 "Hello, world!", [])


def test_seed_oss_calls_as_its_model_writes_them() -> None:
    text = ("<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n"
            "</function>\n</seed:tool_call>\n<seed:tool_call>\n"
            "<function=special_function_with_opt>\n<parameter=arg1>1</parameter>\n"
            "<parameter=arg2>2</parameter>\n</function>\n</seed:tool_call>")
    _, content, calls = read_alike("seed-oss", text, tools=[SPECIAL, OPTIONAL])
    assert calls == [("special_function", {"arg1": 1}),
                     ("special_function_with_opt", {"arg1": 1, "arg2": 2})]
    assert content == ""
    text = ("<seed:tool_call>\n<function=todo_list>\n<parameter=todos>[{\"item\": \"Check "
            "stuff\", \"selected\": false}, {\"item\": \"Prepare stuff\", \"selected\": true}]"
            "</parameter>\n</function>\n</seed:tool_call>")
    _, _, calls = read_alike("seed-oss", text, tools=[TODO])
    assert calls == [("todo_list", {"todos": [{"item": "Check stuff", "selected": False},
                                              {"item": "Prepare stuff", "selected": True}]})]
    text = ("<seed:tool_call>\n<function=edit>\n<parameter=filename>foo.cpp</parameter>\n"
            "<parameter=oldString>def foo(arg = \"14\"):\n    return arg + \"bar\"\n"
            "</parameter>\n<parameter=newString>def foo(arg = \"15\"):\n    pass\n"
            "</parameter>\n</function>\n</seed:tool_call>")
    _, _, calls = read_alike("seed-oss", text, tools=[EDIT])
    assert calls == [("edit", {"filename": "foo.cpp",
                               "oldString": "def foo(arg = \"14\"):\n    return arg + \"bar\"\n",
                               "newString": "def foo(arg = \"15\"):\n    pass\n"})]


def test_minimax_m2_thought_opened_by_its_prompt() -> None:
    """MiniMax M2's generation prompt ends in `<think>\\n`: the output starts inside the
    thought, and a call after it is read from the answer."""
    text = "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?"
    thought, content, _ = read_alike("minimax-m2", text, inside=True)
    assert (thought.strip(), content.strip()) == ("I'm\nthinking", "Hello, world!\nWhat's up?")
    text = ("Let's call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name=\"empty_args\">\n"
            "</invoke>\n</minimax:tool_call>")
    thought, content, calls = read_alike("minimax-m2", text, inside=True, tools=[EMPTY])
    assert (thought.strip(), content, calls) == ("Let's call a tool:", "",
                                                 [("empty_args", {})])
    text = ("\n</think>\n\n<minimax:tool_call>\n<invoke name=\"special_function\">\n<parameter "
            "name=\"arg1\">1</parameter>\n</invoke>\n</minimax:tool_call>")
    _, content, calls = read_alike("minimax-m2", text, inside=True, tools=[SPECIAL])
    assert (content, calls) == ("", [("special_function", {"arg1": 1})])


def test_deepseek_dsml_calls_as_its_model_writes_them() -> None:
    text = ("Let me check the time</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke "
            "name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo"
            "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    thought, content, calls = read_alike("deepseek-v3.2", text, inside=True, tools=[TIME])
    assert (thought, content, calls) == ("Let me check the time", "",
                                         [("get_time", {"city": "Tokyo"})])
    text = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"special_function\">\n<｜DSML｜parameter "
            "name=\"arg1\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
            "<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" "
            "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    _, content, calls = read_alike("deepseek-v4", text, tools=[SPECIAL, TIME])
    assert (content, calls) == ("", [("special_function", {"arg1": 1}),
                                     ("get_time", {"city": "Paris"})])


def test_deepseek_dsml_writes_string_by_the_schema() -> None:
    """`string="true"` for a text value, "false" and JSON for any other: as its template."""
    from tests.unit.chat.formatcases import CALLS, INFO

    body = BY_NAME["deepseek-v3.2"].write_calls(CALLS, INFO)
    assert '<｜DSML｜parameter name="city" string="true">Zürich 東京</｜DSML｜parameter>' in body
    assert '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>' in body
    assert 'name="filters" string="false">{"tags": ["x", {"deep": [1, 2]}]}<' in body


@pytest.mark.parametrize("name", FAMILIES)
def test_a_blocks_markup_alone_stays_text(name: str) -> None:
    """An opening tag with no call after it is not a call (and nothing is lost)."""
    fmt = BY_NAME[name]
    text = f"Write {fmt.starts[0]} to begin."  # type: ignore[attr-defined]
    _, content, end = run(name, text, [text])
    assert not end.calls and content == text


def test_hunyuan_calls_as_its_template_writes_them() -> None:
    text = ("<think:opensource>Paris.</think:opensource>Sure.<tool_calls:opensource>\n"
            "<tool_call:opensource>get_time<tool_sep:opensource>\n"
            "<arg_key:opensource>city</arg_key:opensource>\n"
            "<arg_value:opensource>Paris</arg_value:opensource>\n</tool_call:opensource>\n"
            "<tool_call:opensource>special_function<tool_sep:opensource>\n"
            "<arg_key:opensource>arg1</arg_key:opensource>\n"
            "<arg_value:opensource>1</arg_value:opensource>\n</tool_call:opensource>\n"
            "</tool_calls:opensource>")
    thought, content, calls = read_alike("hunyuan", text, tools=[TIME, SPECIAL])
    assert (thought, content, calls) == ("Paris.", "Sure.", [("get_time", {"city": "Paris"}),
                                                             ("special_function", {"arg1": 1})])


def test_ling_calls_are_glm_calls() -> None:
    """Ling 3.0's outputs (test-chat.cpp) after its thought: GLM's reader takes them."""
    call = ("<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "</tool_call>")
    text = "Let me check the time.\n</think>\nChecking it now.\n" + call + "\nDone."
    thought, content, calls = read_alike("glm", text, inside=True, tools=[TIME])
    assert thought.strip() == "Let me check the time."
    assert content.split() == ["Checking", "it", "now.", "Done."]
    assert calls == [("get_time", {"city": "Paris"})]
    _, _, calls = read_alike("glm", "</think>\n" + call + "\n" + call.replace("Paris", "Oslo"),
                             inside=True, tools=[TIME])
    assert calls == [("get_time", {"city": "Paris"}), ("get_time", {"city": "Oslo"})]


K3_CALL = ("<|open|>tools<|sep|><|open|>call tool=\"special_function\" index=\"1\"<|sep|>"
           "<|open|>argument key=\"arg1\" type=\"number\"<|sep|>1<|close|>argument<|sep|>"
           "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")


def test_kimi_k3_answer_and_thought_out_of_their_sections() -> None:
    """Kimi K3 (test-chat.cpp): the generation prompt opens the thought; the answer's
    `response` section and the message's end are no content."""
    text = ("<|open|>response<|sep|>Use the response tag, then message the handler."
            "<|close|>response<|sep|><|close|>message<|sep|>")
    assert read_alike("kimi-k3", text) == ("", "Use the response tag, then message the "
                                                "handler.", [])
    text = ("I'm thinking about this<|close|>think<|sep|><|open|>response<|sep|>Hello, world!"
            "\nWhat's up?<|close|>response<|sep|><|close|>message<|sep|>")
    assert read_alike("kimi-k3", text, inside=True) == (
        "I'm thinking about this", "Hello, world!\nWhat's up?", [])
    text = "I was still thinking when the budget ran out"
    assert read_alike("kimi-k3", text, inside=True) == (text, "", [])


def test_kimi_k3_calls_as_its_model_writes_them() -> None:
    text = ("I should call it<|close|>think<|sep|><|open|>response<|sep|>On it."
            "<|close|>response<|sep|>" + K3_CALL)
    assert read_alike("kimi-k3", text, inside=True, tools=[SPECIAL]) == (
        "I should call it", "On it.", [("special_function", {"arg1": 1})])
    text = ("<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            "<|open|>call tool=\"special_function\" index=\"1\"<|sep|>"
            "<|open|>argument key=\"arg1\" type=\"number\"<|sep|>1<|close|>argument<|sep|>"
            "<|close|>call<|sep|>"
            "<|open|>call tool=\"special_function_with_opt\" index=\"2\"<|sep|>"
            "<|open|>argument key=\"arg1\" type=\"number\"<|sep|>1<|close|>argument<|sep|>"
            "<|open|>argument key=\"arg2\" type=\"number\"<|sep|>2<|close|>argument<|sep|>"
            "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")
    assert read_alike("kimi-k3", text, tools=[SPECIAL, OPTIONAL]) == (
        "", "", [("special_function", {"arg1": 1}),
                 ("special_function_with_opt", {"arg1": 1, "arg2": 2})])
    text = ("<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            "<|open|>call tool=\"edit\" index=\"1\"<|sep|>"
            "<|open|>argument key=\"filename\" type=\"string\"<|sep|>12<|close|>argument<|sep|>"
            "<|open|>argument key=\"oldString\" type=\"string\"<|sep|>print('hey')\n"
            "<|close|>argument<|sep|>"
            "<|open|>argument key=\"newString\" type=\"string\"<|sep|>)\"<|close|>argument<|sep|>"
            "<|close|>call<|sep|><|close|>tools<|sep|>")
    assert read_alike("kimi-k3", text, tools=[EDIT])[2] == [
        ("edit", {"filename": "12", "oldString": "print('hey')\n", "newString": ")\""})]


class _Vocabulary:
    """The 256 bytes and Kimi K3's three special tokens (and an end token)."""

    SPECIAL = ("<|open|>", "<|close|>", "<|sep|>")
    eos_token_id = 259
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff[open]", b"\xff[close]", b"\xff[sep]",
                                                 b"<eos>"]
    special_token_ids = (256, 257, 258, 259)

    def __call__(self, data: bytes) -> list[int]:
        return list(data)

    def encode(self, text: str) -> list[int]:
        import re

        out: list[int] = []
        for part in re.split(r"(<\|open\|>|<\|close\|>|<\|sep\|>)", text):
            out += [256 + self.SPECIAL.index(part)] if part in self.SPECIAL \
                else list(part.encode())
        return out


def test_kimi_k3_grammars_write_its_special_tokens_as_tokens() -> None:
    """On a vocabulary where `<|open|>`, `<|close|>`, `<|sep|>` are special tokens, the
    forced and steering grammars take the calls written with those tokens (and a value's
    text runs until the model writes `<|close|>`)."""
    import llguidance

    from llmrun.chat.tools import ToolPlan
    from llmrun.engine import constraint
    from tests.unit.chat.formatcases import CALLS, INFO, TOOLS

    vocab = _Vocabulary()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
    special = {m: 256 + i for i, m in enumerate(vocab.SPECIAL)}
    fmt = BY_NAME["kimi-k3"]

    def consumed(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tok, constraint.from_grammar(grammar))
        assert not matcher.is_error(), matcher.get_error()
        ids = vocab.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
            and matcher.is_accepting()

    grammar = fmt.grammar(ToolPlan(INFO, TOOLS, "required"), special)
    assert grammar is not None and "<[256]>" in grammar
    body = fmt.write_calls(CALLS, INFO)
    assert consumed(grammar, body)
    assert consumed(grammar, "<|open|>response<|sep|><|close|>response<|sep|>" + body)
    assert consumed(grammar, "<|close|>response<|sep|>" + body)
    assert not consumed(grammar, body.replace("<|open|>argument key=\"city\" type=\"string\""
                                              "<|sep|>Zürich 東京<|close|>argument<|sep|>", ""))
    steer = fmt.steering(ToolPlan(INFO, TOOLS, "auto"), special)
    assert steer is not None
    assert consumed(steer.grammar, body[len("<|open|>tools<|sep|>"):])


NS = "]<]minimax[>["
M3_TOOLS_EXTRA = [Tool(name="plan", parameters={"type": "object", "properties": {
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "n": {"type": "integer"}, "done": {"type": "boolean"}, "tags": {
            "type": "array", "items": {"type": "string"}}}}},
    "meta": {"type": "object", "properties": {"owner": {"type": "string"},
                                              "score": {"type": "number"}}}},
    "required": ["steps"]})]


@pytest.mark.parametrize("check", [c for c in CHECKS
                                   if c.__name__ != "calls_read_whole_and_streamed_alike"],
                         ids=lambda c: c.__name__)
def test_minimax_m3(check: Callable[[str], None]) -> None:
    check("minimax-m3")


def test_minimax_m3_calls_as_its_model_writes_them() -> None:
    """MiniMax M3 (test-chat.cpp): tags behind its namespace token, thoughts in
    <mm:think>; a call of no arguments; several calls in one block."""
    text = (f"<mm:think>Let me check the time</mm:think>{NS}<tool_call>\n"
            f'{NS}<invoke name="get_time">{NS}<city>Tokyo{NS}</city>{NS}</invoke>\n'
            f"{NS}</tool_call>")
    assert read_alike("minimax-m3", text, tools=[TIME]) == (
        "Let me check the time", "", [("get_time", {"city": "Tokyo"})])
    text = (f"</mm:think>{NS}<tool_call>\n{NS}<invoke name=\"special_function\">"
            f"{NS}<arg1>1{NS}</arg1>{NS}</invoke>\n{NS}<invoke name=\"empty_args\">"
            f"{NS}</invoke>\n{NS}</tool_call>")
    assert read_alike("minimax-m3", text, inside=True, tools=[SPECIAL, EMPTY]) == (
        "", "", [("special_function", {"arg1": 1}), ("empty_args", {})])


def test_minimax_m3_reads_and_writes_trees_by_the_schema() -> None:
    """Objects, lists of objects, booleans and numbers, by the schema (unit and streamed);
    what the template's to_xml writes is what the reader takes back."""
    from llmrun.request import ToolCall
    from tests.unit.chat.formatcases import INFO

    call = ToolCall(id="p", name="plan", arguments={
        "steps": [{"n": 1, "done": True, "tags": ["a", "東京 <b>"]}, {"n": 2, "done": False,
                                                                     "tags": []}],
        "meta": {"owner": "Zoë", "score": -2.5}})
    body = BY_NAME["minimax-m3"].write_calls([call], INFO)
    assert f"{NS}<done>true{NS}</done>" in body and f"{NS}<item>a{NS}</item>" in body
    _, content, calls = read_alike("minimax-m3", "Planning. " + body, tools=M3_TOOLS_EXTRA)
    assert (content.strip(), calls) == ("Planning.", [("plan", call.arguments)])


@pytest.mark.parametrize("body", [
    f"{NS}<city>Tokyo{NS}</town>",                     # tags that do not nest
    f"{NS}<city>Tokyo{NS}</city>stray{NS}<city>x{NS}</city>",  # a key twice
    f"{NS}<city>Tokyo",                                # not closed (not cut)
    "just text",
    f"{NS}<city>" * 200 + "x" + f"{NS}</city>" * 200,  # nested too deep
])
def test_minimax_m3_what_is_no_call_stays_text(body: str) -> None:
    text = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_time\">{body}{NS}</invoke>\n"
            f"{NS}</tool_call>")
    _, _, end = run("minimax-m3", text, [text], tools=[TIME])
    assert not end.calls


DSML_TOOL = Tool(name="f", parameters={"type": "object", "properties": {
    "ref": {"type": "integer"}, "orig": {"type": "number"}, "enabled": {"type": "boolean"},
    "todos": {"type": "array", "items": {"type": "string"}},
    "config": {"type": "object"}, "name": {"type": "string"}}})


@pytest.mark.parametrize(("params", "expected"), [
    ('"ref" string="false">-14<', {"ref": -14}),
    ('"orig" string="false">3.14<', {"orig": 3.14}),
    ('"enabled" string="false">true<', {"enabled": True}),
    ('"todos" string="false">["buy milk","walk dog"]<', {"todos": ["buy milk", "walk dog"]}),
    ('"config" string="false">{"theme":"dark","level":2}<',
     {"config": {"theme": "dark", "level": 2}}),
    ('"ref" string="false">42</｜DSML｜parameter>\n<｜DSML｜parameter name="name" '
     'string="true">foo bar<', {"ref": 42, "name": "foo bar"}),
])
def test_deepseek_dsml_typed_values(params: str, expected: dict[str, object]) -> None:
    """test-chat.cpp's V3.2 values: each read by its schema as it says."""
    text = ("Thinking about it</think>Let me call the function.\n\n<｜DSML｜function_calls>\n"
            f'<｜DSML｜invoke name="f">\n<｜DSML｜parameter name={params}/｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    thought, content, calls = read_alike("deepseek-v3.2", text, inside=True,
                                         tools=[DSML_TOOL])
    assert (thought, content.strip(), calls) == ("Thinking about it",
                                                 "Let me call the function.",
                                                 [("f", expected)])


LING_CALL = ("<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "</tool_call>")


def test_ling_a_call_ends_the_thought_its_prompt_opened() -> None:
    """test-chat.cpp's Ling 3.0 cases: a call before `</think>` ends the thought; after
    it, text and calls are the answer; a marker's text inside a value is the value's."""
    assert read_alike("ling", "I need to check the time first.\n" + LING_CALL, inside=True,
                      tools=[TIME]) == ("I need to check the time first.\n", "",
                                        [("get_time", {"city": "Paris"})])
    thought, content, calls = read_alike(
        "ling", "Let me check the time.\n</think>\nChecking it now.\n" + LING_CALL,
        inside=True, tools=[TIME])
    assert (thought, content.strip(), calls) == ("Let me check the time.\n",
                                                 "Checking it now.",
                                                 [("get_time", {"city": "Paris"})])
    _, content, calls = read_alike("ling", LING_CALL + "\nThe time has been checked.",
                                   tools=[TIME])
    assert (content.strip(), calls) == ("The time has been checked.",
                                        [("get_time", {"city": "Paris"})])
    text = ("check this\n</think>\n<tool_call>get_time\n<arg_key>city</arg_key>\n"
            "<arg_value>contains </think> and <tool_call> strings</arg_value>\n</tool_call>")
    assert read_alike("ling", text, inside=True, tools=[TIME]) == (
        "check this\n", "", [("get_time", {"city": "contains </think> and <tool_call> "
                                                   "strings"})])


def test_ling_thought_without_a_call_is_glms() -> None:
    text = "Hmm, <tool_ca and </thi are no markers.</think>Sunny."
    assert read_alike("ling", text, inside=True) == (
        "Hmm, <tool_ca and </thi are no markers.", "Sunny.", [])
    assert read_alike("ling", "Still thinking <tool_c", inside=True) == (
        "Still thinking <tool_c", "", [])


@pytest.mark.parametrize("template", [
    "ByteDance-Seed-OSS.jinja",
    "MiniMax-M2.jinja",
    "MiniMax-M3.jinja",
    "deepseek-ai-DeepSeek-V3.2.jinja",
    "deepseek-ai-DeepSeek-V4.jinja",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
    "tencent-Hy3.jinja",
    "Kimi-K3.jinja",
    "inclusionai-ling-3.0-flash.jinja",
])
def test_past_calls_written_as_the_template_writes_them(template: str) -> None:
    # (Seed-OSS's template writes a list by Jinja's `string`, Python's repr: its calls
    # write JSON, as its model does, test-chat.cpp's `todos`)
    written_as_its_template_writes(template, lists=template != "ByteDance-Seed-OSS.jinja")


@pytest.mark.parametrize("name", ["deepseek-v3.2", "deepseek-v4"])
def test_deepseek_dsml_calls_end_the_thought(name: str) -> None:
    """llama.cpp's V3.2/V4 parser ends a thought at `</think>` or at the calls' block."""
    block = BY_NAME[name].block  # type: ignore[attr-defined]
    text = (f"Need the time{block[0]}\n<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter "
            f"name=\"city\" string=\"true\">Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
            f"{block[1]}")
    assert read_alike(name, text, inside=True, tools=[TIME]) == (
        "Need the time", "", [("get_time", {"city": "Tokyo"})])
