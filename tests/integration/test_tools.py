"""llmrun.chat.tools: family detection, prompt rendering, grammars, parsing and the stream
filter, without the real model (grammars run on the tiny synthetic model, and are checked
against SmolLM2's vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from llmrun.chat import templates, tools
from llmrun.chat.toolcalls import ToolCheck, parse_calls
from llmrun.chat.tools import TemplateInfo
from llmrun.request import ChatRequest, Message, NamedTool, Options, Tool, ToolCall
from tests.fakes.tinymodel import write_tiny_llama

CHATML = (  # SmolLM2's template: knows nothing of tools
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN = (  # the shape of Qwen 2.5's template
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Return calls in <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}<|im_start|>assistant\n"
)
LLAMA3 = (
    "{{- bos_token }}{%- if tools is not none %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary}."
    "{%- for t in tools %}{{ t | tojson }}{% endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'ipython' or m.role == 'tool' %}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{- '{\"name\": \"' + m.tool_calls[0].function.name + '\", \"parameters\": ' }}"
    "{{- m.tool_calls[0].function.arguments | tojson }}}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
MISTRAL = (
    "{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    "{%- if c.id | length != 9 %}{{ raise_exception('ids must be 9 characters') }}{% endif %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }},"
    " \"id\": \"{{ c.id }}\"}{%- endfor %}]</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{\"call_id\": \"{{ m.tool_call_id }}\", "
    "\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]"
    "{%- else %}{{ m.content }}</s>{%- endif %}{%- endfor %}"
)
MISTRAL_ARGS = MISTRAL.replace("[TOOL_CALLS][", "[TOOL_CALLS]{{ '[ARGS]' }}[")
GENERIC = (
    "{% if tools %}Functions: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)

WEATHER = Tool(name="get_weather", description="Weather in a city", parameters={
    "type": "object",
    "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]})
TIME = Tool(name="get_time", description="The time now")
HERMES = TemplateInfo("hermes", native=False, native_calls=False, native_results=False)


def info(family: str, **kw: Any) -> TemplateInfo:
    return TemplateInfo(family, native=True, native_calls=True,  # type: ignore[arg-type]
                        native_results=True, **kw)


# -- detection ------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "family", "native"), [
    (CHATML, "hermes", False), (None, "hermes", False), (QWEN, "hermes", True),
    (LLAMA3, "llama3", True), (MISTRAL, "mistral", True), (GENERIC, "json", True),
])
def test_detect_family(source: str | None, family: str, native: bool) -> None:
    got = tools.inspect_template(source)
    assert (got.family, got.native) == (family, native)


def test_detect_mistral_variant_and_what_templates_render() -> None:
    assert not tools.inspect_template(MISTRAL).mistral_args
    assert tools.inspect_template(MISTRAL_ARGS).mistral_args
    generic = tools.inspect_template(GENERIC)
    assert not generic.native_calls and not generic.native_results
    llama = tools.inspect_template(LLAMA3)
    assert llama.native_calls and llama.native_results


# -- rendering ------------------------------------------------------------------------------


def job(messages: list[Message], **kw: Any) -> ChatRequest:
    return ChatRequest(model="test", messages=messages, options=Options(), **kw)


def render(source: str, j: ChatRequest, system: str | None = None) -> str:
    plan = tools.plan(j, source)
    messages, extra = tools.chat_inputs(j.messages, system, source, plan)
    return templates.render(source, messages, bos_token="<s>", **extra)


HISTORY = [
    Message(role="user", content="Weather in Paris and Rome?"),
    Message(role="assistant", content="", tool_calls=[
        ToolCall(id="call_1", name="get_weather", arguments={"city": "Paris"}),
        ToolCall(id="call_2", name="get_weather", arguments={"city": "Rome"})]),
    Message(role="tool", content="18 C", tool_call_id="call_1", name="get_weather"),
    Message(role="tool", content="21 C", tool_call_id="call_2", name="get_weather"),
]


def test_preamble_for_templates_without_tools() -> None:
    q = [Message(role="user", content="Weather in Paris?")]
    text = render(CHATML, job(q, tools=[WEATHER, TIME]))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text and '"name": "get_time"' in text
    assert "<tool_call>\n{\"name\": <function-name>" in text
    assert text.count("<|im_start|>system") == 1
    # merged into the first system message, the model's own or the conversation's
    text = render(CHATML, job(q, tools=[WEATHER]), system="Be brief.")
    assert text.startswith("<|im_start|>system\nBe brief.\n# Tools")
    text = render(CHATML, job(q, tools=[WEATHER], tool_choice=NamedTool(name="get_weather")))
    assert "You must call the function get_weather." in text


def test_tool_choice_none_hides_tools_but_keeps_history() -> None:
    text = render(CHATML, job(HISTORY, tools=[WEATHER], tool_choice="none"))
    assert "# Tools" not in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>') in text
    # consecutive results become one user turn
    assert ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n"
            "21 C\n</tool_response><|im_end|>") in text
    assert tools.plan(job(HISTORY, tools=[WEATHER], tool_choice="none"), CHATML) is None


def test_native_templates_get_tools_and_hf_messages() -> None:
    text = render(QWEN, job(HISTORY, tools=[WEATHER]))
    assert text.startswith('<|im_start|>system\n# Tools\n<tools>{"type": "function"')
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            "</tool_call>") in text
    assert "<tool_response>\n21 C\n</tool_response>" in text
    llama = render(LLAMA3, job(HISTORY[:1], tools=[WEATHER]))
    assert '"parameters"' in llama and '"get_weather"' in llama


def test_mistral_ids_are_made_nine_characters() -> None:
    text = render(MISTRAL, job([*HISTORY, Message(role="user", content="thanks")],
                               tools=[WEATHER]))
    ids = [json.loads(part.split("[/TOOL_RESULTS]")[0])["call_id"]
           for part in text.split("[TOOL_RESULTS]")[1:]]
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert ids[0] != ids[1] and f'"id": "{ids[0]}"' in text


def test_plan_rejects_an_unknown_named_tool() -> None:
    with pytest.raises(ValueError, match="not among the tools"):
        tools.plan(job(HISTORY, tools=[WEATHER], tool_choice=NamedTool(name="nope")), CHATML)
    assert tools.plan(job(HISTORY), CHATML) is None
    assert tools.plan(ChatRequest(model="test", messages=[], prompt="raw", tools=[WEATHER]),
                      CHATML) is None


def test_format_calls_per_family() -> None:
    calls = [ToolCall(id="call_1", name="f", arguments={"a": 1})]
    assert tools.format_calls(calls, info("llama3")) == '{"name": "f", "parameters": {"a": 1}}'
    assert tools.format_calls(calls, info("mistral")) == \
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'
    assert tools.format_calls(calls, info("mistral", mistral_args=True)) == \
        '[TOOL_CALLS]f[ARGS]{"a": 1}'
    for family in ("hermes", "llama3", "mistral", "json"):
        i = info(family)
        parsed = parse_calls(tools.format_calls(calls, i), i.family, ToolCheck({"f": None}))
        assert parsed and parsed[0][0].arguments == {"a": 1}


# -- grammars: llguidance, generated on the tiny model and checked on SmolLM2's vocabulary ----

BOUNDED = Tool(name="set_mode", parameters={  # every value has a bounded length
    "type": "object",
    "properties": {"mode": {"enum": ["fast", "slow"]}, "on": {"type": "boolean"},
                   "level": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tag": {"type": "string", "maxLength": 6}},
    "required": ["mode", "on", "level", "tag"], "additionalProperties": False})
EMPTY = Tool(name="ping")
DEFS = Tool(name="move", parameters={
    "type": "object", "properties": {"to": {"$ref": "#/$defs/Dir"}}, "required": ["to"],
    "$defs": {"Dir": {"enum": ["up", "down"]}}, "additionalProperties": False})
FAMILIES = {"hermes": info("hermes"), "llama3": info("llama3"), "mistral": info("mistral"),
            "mistral-args": info("mistral", mistral_args=True), "json": info("json")}


def lltokenizer(model: Any) -> Any:
    """llguidance's view of a vocabulary (its reader calls a llama.cpp function that
    llama-cpp-python marks deprecated once per token: silenced)."""
    import warnings

    from llguidance.llamacpp import lltokenizer_from_vocab

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(model.vocab)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from llmrun.engine.llama import Context, Model

    model = Model(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))
    ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=256, n_threads=1)
    yield model, ctx, lltokenizer(model)
    ctx.close()
    model.close()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path: Any) -> Iterator[Any]:
    """SmolLM2's vocabulary as llguidance sees it (what the runner constrains with)."""
    from llmrun.engine.llama import Model

    model = Model(smollm2_path)
    yield lltokenizer(model)
    model.close()


def generate(tiny: Any, grammar: str, seed: int) -> tuple[str, bool]:
    """Sample from random weights under `grammar` (llguidance's token mask over the logits):
    (text, ended by end-of-generation)."""
    import llguidance
    import numpy as np
    from llguidance.numpy import (
        allocate_token_bitmask,
        apply_token_bitmask_inplace,
        fill_next_token_bitmask,
    )

    from llmrun.engine.llama import Batch

    model, ctx, tokenizer = tiny
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    rng = np.random.default_rng(seed)
    mask = allocate_token_bitmask(1, tokenizer.vocab_size)
    ctx.seq_rm(0, -1, -1)
    batch = Batch(8)
    out = b""
    token = model.bos
    try:
        for pos in range(250):
            batch.clear()
            batch.add(token, pos, 0, True)
            assert ctx.decode(batch) == 0
            logits = ctx.logits(0).astype(np.float64)[None, :]
            fill_next_token_bitmask(matcher, mask)
            apply_token_bitmask_inplace(logits, mask)
            probs = np.exp(logits[0] - logits[0].max())
            token = int(rng.choice(len(probs), p=probs / probs.sum()))
            assert matcher.consume_token(token), matcher.get_error()
            if model.is_eog(token):
                return out.decode("utf-8", "replace"), True
            out += model.piece(token)
    finally:
        batch.close()
    return out.decode("utf-8", "replace"), False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grammar_output_parses_and_matches_schemas(tiny: Any, family: str) -> None:
    import jsonschema

    i = FAMILIES[family]
    offered = [BOUNDED, EMPTY, DEFS]
    schemas = {t.name: t.parameters for t in offered}
    for parallel in (False, True):
        plan = tools.ToolPlan(i, offered, "required", parallel)
        grammar = plan.grammar()
        assert grammar is not None
        for seed in range(3):
            text, ended = generate(tiny, grammar, seed)
            parsed = parse_calls(text, i.family, ToolCheck.of(offered), truncated=not ended)
            assert parsed is not None, text
            calls, rest = parsed
            assert calls and rest == ""
            if not parallel:
                assert len(calls) == 1 and ended, text
            for call in calls:
                jsonschema.validate(call.arguments, schemas[call.name])


def test_grammar_for_a_named_tool(tiny: Any) -> None:
    plan = tools.ToolPlan(HERMES, [BOUNDED, EMPTY], NamedTool(name="set_mode"), False)
    for seed in range(3):
        text, ended = generate(tiny, plan.grammar() or "", seed)
        parsed = parse_calls(text, "hermes", ToolCheck.of([BOUNDED, EMPTY]))
        assert ended and parsed is not None
        assert [c.name for c in parsed[0]] == ["set_mode"]
    assert tools.ToolPlan(HERMES, [BOUNDED], "auto").grammar() is None


def consumed(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the grammar lets a model write `text` whole (and end there)."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar)
    ids = tokenizer.tokenize_str(text)
    # validate_tokens only looks ahead; consuming them moves the matcher to the end
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grammars_compile_for_a_real_vocabulary(smollm2_tokenizer: Any, family: str) -> None:
    """Every family's grammar compiles without warnings; the calls the model is shown in its
    prompt are accepted, and values outside the schema are not (bounds, maxLength, names)."""
    import llguidance

    i = FAMILIES[family]
    ok = [ToolCall(id="a", name="set_mode",
                   arguments={"mode": "fast", "on": True, "level": 150, "tag": "abcdef"}),
          ToolCall(id="b", name="ping", arguments={})]
    for parallel in (False, True):
        grammar = tools.build_grammar([BOUNDED, EMPTY, DEFS], i, parallel)
        assert llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, smollm2_tokenizer) == (False, [])
        assert consumed(smollm2_tokenizer, grammar, tools.format_calls(ok[:1], i))
        assert consumed(smollm2_tokenizer, grammar, tools.format_calls(ok, i)) == parallel
        for bad in ({"level": 151}, {"level": -1}, {"tag": "abcdefg"}, {"mode": "medium"}):
            call = ok[0].model_copy(update={"arguments": {**ok[0].arguments, **bad}})
            assert not consumed(smollm2_tokenizer, grammar, tools.format_calls([call], i))
        other = ok[1].model_copy(update={"name": "pong"})
        assert not consumed(smollm2_tokenizer, grammar, tools.format_calls([other], i))


def test_grammar_keeps_refs_and_odd_names(smollm2_tokenizer: Any) -> None:
    """Arguments sit at the root of their own `%json`, so `$ref`s resolve as written (`#`
    included); `nullable` is read; names are escaped; a client's `x-guidance` is dropped."""
    tree = Tool(name='t"r\\ee\u00e9', parameters={
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}},
                                         "d": {"$ref": "#/definitions/D"},
                                         "n": {"type": "string", "nullable": True}},
        "definitions": {"D": {"enum": ["up", "down"]}}, "additionalProperties": False,
        "x-guidance": {"whitespace_pattern": "x*"}})
    for i in FAMILIES.values():
        grammar = tools.build_grammar([tree], i, False)
        call = ToolCall(id="a", name=tree.name,
                        arguments={"kids": [{"kids": [], "d": "up"}, {}], "d": "down",
                                   "n": None})
        assert consumed(smollm2_tokenizer, grammar, tools.format_calls([call], i)), grammar
        bad = call.model_copy(update={"arguments": {"kids": [{"d": "left"}]}})
        assert not consumed(smollm2_tokenizer, grammar, tools.format_calls([bad], i))
    with pytest.raises(ValueError, match="NaN"):
        tools.build_grammar([Tool(name="f", parameters={"maximum": float("nan")})], HERMES,
                            False)


def test_grammar_strictness(smollm2_tokenizer: Any) -> None:
    """Strict (the default): a keyword llguidance cannot enforce makes the grammar fail to
    compile (the daemon answers 400 before this); not strict: it is skipped."""
    import llguidance

    uniq = Tool(name="f", parameters={"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})
    strict = tools.build_grammar([uniq], HERMES, False)
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        strict, smollm2_tokenizer)
    assert error and "uniqueItems" in messages[0]
    lenient = tools.ToolPlan(HERMES, [uniq], "required", False, strict=False).grammar()
    assert lenient is not None
    assert not llguidance.LLMatcher.validate_grammar_with_warnings(
        lenient, smollm2_tokenizer)[0]
    j = job([Message(role="user", content="hi")], tools=[uniq], tool_choice="required",
            format_strict=False)
    assert tools.plan(j, CHATML).strict is False  # type: ignore[union-attr]


def test_grammar_writes_only_the_declared_members(smollm2_tokenizer: Any) -> None:
    """A schema that says nothing of undeclared members gets none written (SmolLM2 went on
    inventing them until the token limit); where the schema asks for more, or composes
    with schemas that might declare more, it is kept as written."""
    city = {"city": {"type": "string"}}

    def takes(parameters: dict[str, Any], arguments: dict[str, Any]) -> bool:
        tool = Tool(name="get_weather", parameters=parameters)
        grammar = tools.build_grammar([tool], HERMES, False, strict=False)
        call = ToolCall(id="a", name="get_weather", arguments=arguments)
        return consumed(smollm2_tokenizer, grammar, tools.format_calls([call], HERMES))

    extra = {"city": "Paris", "apikeyUrl": "https://example.com"}
    plain = {"type": "object", "properties": city, "required": ["city"]}
    assert takes(plain, {"city": "Paris"}) and not takes(plain, extra)
    assert not takes({"properties": city}, extra)  # `type` left out
    for more in ({"additionalProperties": True}, {"additionalProperties": {"type": "string"}},
                 {"patternProperties": {"^a": {"type": "string"}}},
                 {"required": ["city", "apikeyUrl"]}):
        assert takes({**plain, **more}, extra), more
    both = {"allOf": [plain, {"properties": {"apikeyUrl": {"type": "string"}}}]}
    assert takes(both, extra)  # (no `properties` of its own, only its parts')
    assert takes({"$ref": "#/$defs/A", "$defs": {"A": plain}}, {"city": "Paris"})


def test_markers_that_are_special_tokens_are_named_by_id(smollm2_tokenizer: Any) -> None:
    """A marker the vocabulary holds as one special token is written as that token: the
    matcher never reads a special token as the characters it renders as."""
    assert tools.special_markers(smollm2_tokenizer) == {}  # SmolLM2 has none of them
    im_start = smollm2_tokenizer.tokenize_str("<|im_start|>", parse_special=True)
    assert len(im_start) == 1 and smollm2_tokenizer.is_special_token(im_start[0])
    grammar = tools.build_grammar([EMPTY], HERMES, False,
                                  special={"<tool_call>": im_start[0]})
    assert f"<[{im_start[0]}]>" in grammar
    text = '<|im_start|>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    import llguidance

    matcher = llguidance.LLMatcher(smollm2_tokenizer, grammar)
    ids = smollm2_tokenizer.tokenize_str(text, parse_special=True)
    assert ids[0] == im_start[0]
    assert matcher.consume_tokens(ids) and matcher.is_accepting()


def test_control_markers_cover_every_start_marker() -> None:
    from llmrun.chat.toolcalls import MARKERS

    for m in MARKERS:
        if m not in ("functools[", "<function="):
            assert m in tools.CONTROL_MARKERS



# -- steering ("auto"): the grammar that starts when the model begins a call ----------------

WEATHER = Tool(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False})


def lazy_run(tok: Any, plan: tools.ToolPlan, text: str,
             think: tuple[bytes, bytes] | None = None) -> tuple[Any, int, bool]:
    """Write `text` token by token (SmolLM2's tokens) as the batcher would under a Lazy
    constraint: (its matcher or None, the tokens that went by before it started, whether
    the grammar allowed all of the rest)."""
    from llmrun.engine import constraint

    steer = plan.steering()
    assert steer is not None
    lazy = constraint.Lazy(tok, constraint.from_grammar(steer.grammar), steer.triggers, think)
    ids = tok.tokenize_str(text)
    for n, token in enumerate(ids):
        found = lazy.feed(tok.decode_bytes([token]))
        if found is not None:
            return found, n + 1, all(found.consume_token(t) for t in ids[n + 1:])
        if lazy.over:
            return None, n + 1, False
    return None, len(ids), True


@pytest.mark.parametrize("family", ["hermes", "json", "llama3", "mistral"])
def test_steering_grammars_compile_and_start_at_their_triggers(
        smollm2_tokenizer: Any, family: str) -> None:
    import llguidance

    i = FAMILIES[family]
    for parallel in (False, True):
        steer = tools.ToolPlan(i, [WEATHER, BOUNDED, EMPTY], "auto", parallel).steering()
        assert steer is not None
        ok, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            steer.grammar, smollm2_tokenizer)
        assert not ok and not messages, messages
    assert tools.ToolPlan(i, [WEATHER], "required").steering() is None


@pytest.mark.parametrize("text", [
    'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}}',
    '[{"function": "get_weather", "parameters": {"city": "Paris"}}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
])
def test_steering_follows_a_call_the_model_began(smollm2_tokenizer: Any, text: str) -> None:
    """A call begun in any accepted shape: the grammar takes over at its trigger, accepts
    what the model writes of a valid call, and refuses what the schema forbids."""
    plan = tools.ToolPlan(HERMES, [WEATHER, EMPTY], "auto")
    matcher, _, allowed = lazy_run(smollm2_tokenizer, plan, text)
    assert matcher is not None and allowed and matcher.is_accepting()
    for bad in ('"Paris", "extra": 1', '"' + "P" * 30 + '"', "3"):
        matcher, _, allowed = lazy_run(smollm2_tokenizer, plan, text.replace('"Paris"', bad))
        assert matcher is not None and not allowed  # the grammar would not have let it


def test_steering_leaves_other_text_alone(smollm2_tokenizer: Any) -> None:
    plan = tools.ToolPlan(HERMES, [WEATHER], "auto")
    for text in ['{"name": "Alice", "age": 3}', "```python\nprint('get_weather')\n```",
                 'The tool is called "get_weather".', '{"name": "get_weathers"}',
                 # a model echoing the tool list of its prompt (Gemma 3 270M does)
                 'calls go within <tool_call></tool_call> tags:\n<tool_call>\n{"type": '
                 '"function", "function": {"name": "get_weather", "description": "x"}}',
                 '{"name": "get_weather", "description": "Current weather"}']:
        matcher, _, _ = lazy_run(smollm2_tokenizer, plan, text)
        assert matcher is None, text
    # inside a thought, a call-shaped text is still free; after it, steered
    think = (b"<think>", b"</think>")
    text = ('<think>maybe {"name": "get_weather", "arguments": 1}</think><tool_call>'
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    matcher, n, allowed = lazy_run(smollm2_tokenizer, plan, text, think)
    assert matcher is not None and allowed and matcher.is_accepting()
    assert n > len(smollm2_tokenizer.tokenize_str(text[:60]))


@pytest.mark.parametrize(("family", "text"), [
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
    ("mistral_args", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    ("json", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_steering_in_each_family(smollm2_tokenizer: Any, family: str, text: str) -> None:
    i = info("mistral", mistral_args=True) if family == "mistral_args" else FAMILIES[family]
    plan = tools.ToolPlan(i, [WEATHER, EMPTY], "auto")
    matcher, _, allowed = lazy_run(smollm2_tokenizer, plan, text)
    assert matcher is not None and allowed and matcher.is_accepting(), text
    matcher, _, allowed = lazy_run(smollm2_tokenizer, plan, text.replace('"Oslo"', "7"))
    assert not allowed
