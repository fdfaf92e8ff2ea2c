"""What every chat family's unit tests check, as functions of the family's name (the group
files, test_formats_<group>.py, parametrize them over their families): its calls as it
writes them read whole and streamed alike, cut by the token limit, refused when wrong; its
grammars letting a model write exactly its calls, on a byte-level vocabulary."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import llguidance

from llmrun.chat import formats
from llmrun.chat.formats import BY_NAME, Format
from llmrun.chat.tools import TemplateInfo, ToolPlan
from llmrun.engine import constraint
from llmrun.request import NamedTool, Tool, ToolCall

TEMPLATES = Path(__file__).parents[2] / "fakes" / "templates"

WEATHER = Tool(name="get_weather", parameters={
    "type": "object",
    "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer"}},
    "required": ["city"]})
SEARCH = Tool(name="search", parameters={
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "number"},
                   "exact": {"type": "boolean"},
                   "filters": {"type": "object", "properties": {"tags": {"type": "array"}}}},
    "required": ["query"]})
TOOLS = [WEATHER, SEARCH]
INFO = TemplateInfo("hermes", native=True, native_calls=True, native_results=True)
# (the arguments in their schema's order: the grammars write properties in that order)
CALLS = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京",
                                                         "unit": "celsius", "days": 3}),
         ToolCall(id="b", name="search", arguments={
             "query": "a \"quoted\" line\nand another <b>", "limit": 2.5, "exact": True,
             "filters": {"tags": ["x", {"deep": [1, 2]}]}})]


def detected(template: str) -> str:
    return formats.detect((TEMPLATES / template).read_text()).name


def only_these_are(families: list[str], expected: dict[str, str]) -> None:
    """The corpus templates `expected` names are detected as it says, and no other corpus
    template as any of `families`."""
    for path in sorted(TEMPLATES.glob("*.jinja")):
        name = formats.detect(path.read_text()).name
        if path.name in expected:
            assert name == expected[path.name], path.name
        else:
            assert name not in families, path.name


def written_as_its_template_writes(template: str, lists: bool = True) -> None:
    """The family's write_calls is what its real template renders for a past call (its
    values written as text, a number, a list unless not `lists`)."""
    from llmrun.chat import templates

    source = (TEMPLATES / template).read_text()
    args: dict[str, Any] = {"city": "Zürich 東京", "days": 3}
    if lists:
        args["tags"] = ["a", "b"]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tool = {"type": "function", "function": {"name": "get_weather", "description": "d",
                                             "parameters": WEATHER.parameters}}
    prompt = templates.render(source, messages, tools=[tool])
    body = formats.detect(source).write_calls(
        [ToolCall(id="c1", name="get_weather", arguments=args)], INFO)
    assert body in prompt, (body, prompt)


def run(name: str | Format, text: str, pieces: list[str], truncated: bool = False,
        choice: Any = "auto", inside: bool = False, tools: list[Tool] | None = None,
        template: str | None = "<think>", split: bool = True,
        info: TemplateInfo = INFO) -> tuple[str, str, Any]:
    """(thinking, content, finished) of `text` streamed in `pieces` through the family's
    splitter and reader, as the runner applies them: the thought's splitter where the
    template (`template`: its text, what the family's think_pair reads) thinks, else its
    answer splitter; none unless `split` (`inside`: the prompt opened a thought)."""
    fmt = BY_NAME[name] if isinstance(name, str) else name
    assert "".join(pieces) == text
    pair = fmt.think_pair(template)
    splitter = (fmt.splitter(pair, inside=inside, keep=True) if pair
                else fmt.answer_splitter()) if split else None
    reader = fmt.reader(ToolPlan(info, tools or TOOLS, choice))
    thought, content = [], []
    for piece in [*pieces, None]:
        if splitter is not None:
            t, c = splitter.push(piece) if piece is not None else splitter.finish()
        else:
            t, c = "", piece or ""
        thought.append(t)
        content.append(reader.push(c)[0])
    end = reader.finish(truncated)
    return "".join(thought), "".join(content) + end.text, end


def chunkings(text: str) -> list[list[str]]:
    """`text` whole, in 1-character pieces, and in three random-size chunkings."""
    rng = random.Random(len(text))
    out = [[text], list(text)]
    for _ in range(3):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def read_alike(name: str, text: str, **kw: Any) -> tuple[str, str, list[tuple[str, Any]]]:
    """(thinking, content, calls) of `text`, the same whole and in every chunking."""
    results = []
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces, **kw)
        results.append((thought, content, [(c.name, c.arguments) for c in end.calls]))
    assert all(r == results[0] for r in results), results
    return results[0]


def written(name: str, calls: list[ToolCall]) -> str:
    return "Let me look. " + BY_NAME[name].write_calls(calls, INFO)


# -- the checks ------------------------------------------------------------------------------


def calls_read_whole_and_streamed_alike(name: str) -> None:
    thought, content, calls = read_alike(name, written(name, CALLS))
    assert calls == [(c.name, c.arguments) for c in CALLS]
    assert content.strip() == "Let me look." and thought == ""


def text_after_the_calls_is_content(name: str) -> None:
    _, content, calls = read_alike(name, written(name, CALLS[:1]) + "\nDone.")
    assert calls == [(CALLS[0].name, CALLS[0].arguments)]
    assert content.split() == ["Let", "me", "look.", "Done."]


def text_alone_is_content(name: str) -> None:
    text = "Sunny, 20 °C. Use <b> tags? [link](x) {\"a\": 1}"
    thought, content, calls = read_alike(name, text)
    assert (thought, content, calls) == ("", text, [])


def a_call_cut_by_the_token_limit(name: str) -> None:
    text = written(name, CALLS[:1])
    cut_at = text.index("Zürich") + 3
    for pieces in chunkings(text[:cut_at]):
        _, content, end = run(name, text[:cut_at], pieces, truncated=True)
        assert not end.calls and end.partial is not None, name
        assert end.partial.name == "get_weather"
        assert content.strip() == "Let me look."


def a_call_cut_after_an_argument_keeps_it(name: str) -> None:
    """Cut after its first argument: the partial call holds that argument whole."""
    text = written(name, CALLS[:1])
    cut_at = text.index("celsius") + 2
    _, _, end = run(name, text[:cut_at], [text[:cut_at]], truncated=True)
    assert end.partial is not None and end.partial.name == "get_weather"
    assert '"city": "Zürich 東京"' in end.partial.arguments


def a_further_call_cut_off_is_dropped(name: str) -> None:
    text = written(name, CALLS)
    cut_at = text.index("line")
    for pieces in chunkings(text[:cut_at]):
        _, content, end = run(name, text[:cut_at], pieces, truncated=True)
        assert [c.name for c in end.calls] == ["get_weather"]
        assert content.strip() == "Let me look."


def wrong_calls_stay_text(name: str) -> None:
    """An unknown tool, a required argument missing, a value of the wrong type: no call."""
    for calls in ([ToolCall(id="a", name="get_weather", arguments={"days": 3})],
                  [ToolCall(id="b", name="delete_all", arguments={})],
                  [ToolCall(id="c", name="get_weather", arguments={"city": "X",
                                                                    "days": [1]})]):
        text = written(name, calls)
        _, content, end = run(name, text, [text])
        assert not end.calls, text
        assert content.strip(), text


class _Bytes:
    """A vocabulary of the 256 bytes (and an end token): every text tokenizes one way."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def consumed(grammar: str, text: str) -> bool:
    """Whether the grammar lets a model write `text` whole (and end there)."""
    matcher = llguidance.LLMatcher(BYTES, constraint.from_grammar(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = list(text.encode())
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


def grammars_write_the_family_calls(name: str) -> None:
    """The forced grammar (required, parallel or not) takes the calls as the family writes
    them and nothing else; the steering grammar takes them from its trigger on."""
    fmt = BY_NAME[name]
    single = getattr(fmt, "single", False)  # a family of one call a message
    missing = [ToolCall(id="x", name="get_weather", arguments={"days": 3})]
    for parallel in (True, False):
        grammar = fmt.grammar(ToolPlan(INFO, TOOLS, "required", parallel))
        assert grammar is not None
        assert llguidance.LLMatcher.validate_grammar(constraint.from_grammar(grammar)) == ""
        assert consumed(grammar, fmt.write_calls(CALLS[:1], INFO))
        if not single:
            assert consumed(grammar, fmt.write_calls(CALLS, INFO)) == parallel
        assert not consumed(grammar, fmt.write_calls(missing, INFO))
        assert not consumed(grammar, "Let me look. " + fmt.write_calls(CALLS[:1], INFO))
        steer = fmt.steering(ToolPlan(INFO, TOOLS, "auto", parallel))
        assert steer is not None and fmt.grammar(ToolPlan(INFO, TOOLS, "auto")) is None
        text = written(name, CALLS)
        m = re.search(steer.triggers[0], text)
        assert m is not None and m.start() >= len("Let me look. ")  # not before the call
        assert consumed(steer.grammar, text[m.end():]) == (parallel or single)
        one = written(name, CALLS[:1])
        assert consumed(steer.grammar, one[re.search(steer.triggers[0], one).end():])  # type: ignore[union-attr]
    named = fmt.grammar(ToolPlan(INFO, TOOLS, NamedTool(name="search")))
    assert named is not None
    assert consumed(named, fmt.write_calls(CALLS[1:], INFO))
    assert not consumed(named, fmt.write_calls(CALLS[:1], INFO))


class _MarkerVocabulary:
    """The 256 bytes, a family's markers as special tokens, and an end token: what a real
    vocabulary of the family does to its markers (one token each, never text)."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = tuple(sorted(set(markers), key=len, reverse=True))
        self.tokens = [bytes([i]) for i in range(256)] \
            + [b"\xff" + m.encode() for m in self.markers] + [b"<eos>"]
        self.eos_token_id = len(self.tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = list(range(256, len(self.tokens)))
        self.special = {m: 256 + i for i, m in enumerate(self.markers)}

    def __call__(self, data: bytes) -> list[int]:
        return list(data)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pattern = "(" + "|".join(re.escape(m) for m in self.markers) + ")"
        for part in re.split(pattern, text):
            out += [self.special[part]] if part in self.special else list(part.encode())
        return out


def grammars_write_the_family_markers_as_tokens(name: str) -> None:
    """On a vocabulary where the family's markers are special tokens, its forced grammar
    takes its calls written with those tokens (and refuses one missing a required
    argument), and its steering grammar takes them after the trigger."""
    fmt = BY_NAME[name]
    vocab = _MarkerVocabulary(fmt.markers)
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))

    def takes(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tok, constraint.from_grammar(grammar))
        assert not matcher.is_error(), matcher.get_error()
        ids = vocab.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
            and matcher.is_accepting()

    grammar = fmt.grammar(ToolPlan(INFO, TOOLS, "required"), vocab.special)
    assert grammar is not None and "<[" in grammar
    calls = CALLS[:1] if getattr(fmt, "single", False) else CALLS
    assert takes(grammar, fmt.write_calls(calls, INFO)), grammar
    missing = [ToolCall(id="x", name="get_weather", arguments={"days": 3})]
    assert not takes(grammar, fmt.write_calls(missing, INFO))
    steer = fmt.steering(ToolPlan(INFO, TOOLS, "auto"), vocab.special)
    assert steer is not None
    text = fmt.write_calls(calls, INFO)
    m = re.search(steer.triggers[0], text)
    assert m is not None and takes(steer.grammar, text[m.end():])


CHECKS = [calls_read_whole_and_streamed_alike, text_after_the_calls_is_content,
          text_alone_is_content, a_call_cut_by_the_token_limit,
          a_call_cut_after_an_argument_keeps_it, a_further_call_cut_off_is_dropped,
          wrong_calls_stay_text, grammars_write_the_family_calls,
          grammars_write_the_family_markers_as_tokens]
# (a family whose template writes one call a message: no second call to read or cut)
SINGLE_CHECKS = [c for c in CHECKS if c not in (calls_read_whole_and_streamed_alike,
                                                a_further_call_cut_off_is_dropped)]
