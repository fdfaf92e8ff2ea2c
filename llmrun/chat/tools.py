"""Tool calling for every dialect: tools into the prompt, calls forced by grammar, calls
spotted and parsed in the output (and kept out of the streamed text).

The format a model calls tools in depends on how it was trained; the chat template says
which, so the family is detected from the template text:

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>    Qwen 2.5/3, Hermes;
             and every template that does not render `tools` itself: llmrun then puts a
             system preamble describing the tools and this format into the prompt
    llama3   {"name": ..., "parameters": {...}}, maybe after <|python_tag|>; or pythonic
             [get_weather(city="Paris")]                                  Llama 3.1-3.3
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}]
             or [TOOL_CALLS]name[ARGS]{...} when the template uses [ARGS]  Mistral, Devstral
    json     a bare {"name": ..., "arguments": {...}} or a list of them   anything else

What the runner does with a request that offers tools (`plan` returns None otherwise):

    plan = tools.plan(req, template)            # family, tools, choice, parallel
    messages, extra = tools.chat_inputs(...)    # history + tools for templates.render
    plan.grammar(special)                       # Lark (llguidance) for "required"/named
    stream = plan.stream()                      # holds markup back, parses calls at the end

`tool_choice="none"` hides the tools entirely; earlier calls and results in the history are
still rendered (natively, or flattened to text in the Hermes format), never dropped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

from llmrun.chat import templates
from llmrun.chat.schema import JSON_OPTIONS, prepare_schema
from llmrun.chat.textstream import partial_match
from llmrun.request import ChatRequest, Message, NamedTool, Tool, ToolCall, ToolChoice

Family = Literal["hermes", "llama3", "mistral", "json"]

# Text that starts a call in each family's output; `lead`: characters that start a call when
# they open the output (JSON-only families).
START_MARKERS: dict[Family, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "llama3": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "json": ("<tool_call>", "<|tool_call|>", "[TOOL_CALLS]", "functools["),
}
LEAD: dict[Family, str] = {"hermes": "", "llama3": "{[", "mistral": "", "json": "{["}
# Markup that is a control token in some vocabularies (rendered as nothing by default): the
# runner asks the engine to render these as text so the parser sees them.
CONTROL_MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]",
                   "[CALL_ID]", "<|tool_call|>", "<|/tool_call|>")


@dataclass(frozen=True)
class TemplateInfo:
    family: Family
    native: bool  # the template renders `tools` itself
    native_calls: bool  # ... and assistant `tool_calls`
    native_results: bool  # ... and `tool` messages
    mistral_args: bool = False  # Mistral's newer `name[ARGS]{...}` form


@lru_cache(maxsize=32)
def inspect_template(source: str | None) -> TemplateInfo:
    """Which tool-call family a chat template belongs to and what it renders itself."""
    text = source or ""
    if not re.search(r"\btools\b|\.Tools\b", text):  # Jinja, or Go (Ollama's templates)
        return TemplateInfo("hermes", native=False, native_calls=False, native_results=False)
    family: Family
    if "<tool_call>" in text:
        family = "hermes"
    elif "[TOOL_CALLS]" in text:
        family = "mistral"
    elif "<|python_tag|>" in text or ("<|start_header_id|>" in text and "parameters" in text):
        family = "llama3"
    else:
        family = "json"
    return TemplateInfo(
        family, native=True,
        native_calls="tool_calls" in text or ".ToolCalls" in text,
        native_results=bool(re.search(r"""['"](tool|ipython)['"]""", text)),
        mistral_args=family == "mistral" and "[ARGS]" in text,
    )


def new_call_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


def tool_dict(tool: Tool) -> dict[str, Any]:
    """A tool the way Hugging Face chat templates (and OpenAI) expect it."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


# -- the plan for one request ---------------------------------------------------------------


@dataclass
class ToolPlan:
    info: TemplateInfo
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool = True
    strict: bool = True  # the client asked for strict schemas (ChatRequest.format_strict)

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    def grammar(self, special: dict[str, int] | None = None) -> str | None:
        """A grammar (llguidance's Lark) forcing a call ("required") or a call of the named
        tool; None for "auto". `special`: see `special_markers`."""
        if isinstance(self.choice, NamedTool):
            chosen = [t for t in self.tools if t.name == self.choice.name]
        elif self.choice == "required":
            chosen = self.tools
        else:
            return None
        return build_grammar(chosen, self.info, self.parallel, strict=self.strict,
                             special=special)

    def stream(self) -> ToolStream:
        return ToolStream(self.info, self.names, self.parallel)


def plan(req: ChatRequest, template: str | None) -> ToolPlan | None:
    """The tool handling `req` needs, or None when it offers no tools (or chose "none")."""
    if req.prompt is not None or not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, NamedTool) and \
            req.tool_choice.name not in {t.name for t in req.tools}:
        raise ValueError(f"tool_choice names the function {req.tool_choice.name!r}, which is "
                         "not among the tools")
    return ToolPlan(inspect_template(template), list(req.tools), req.tool_choice,
                    req.parallel_tool_calls, req.format_strict)


# -- rendering ------------------------------------------------------------------------------


def _mistral_id(call_id: str | None) -> str:
    """Mistral's templates insist on 9 alphanumeric characters."""
    if call_id and re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256((call_id or "").encode()).hexdigest()[:9]


def format_calls(calls: list[ToolCall], info: TemplateInfo) -> str:
    """Calls as the model of this family writes them (for templates that cannot render
    `tool_calls` themselves)."""
    if info.family == "hermes":
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments},
                                         ensure_ascii=False) + "\n</tool_call>" for c in calls)
    if info.family == "llama3":
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments},
                                    ensure_ascii=False) for c in calls)
    objs = [{"name": c.name, "arguments": c.arguments} for c in calls]
    if info.family == "mistral":
        if info.mistral_args:
            return "".join(f"[TOOL_CALLS]{c.name}[ARGS]"
                           + json.dumps(c.arguments, ensure_ascii=False) for c in calls)
        return "[TOOL_CALLS]" + json.dumps(objs, ensure_ascii=False)
    return json.dumps(objs[0] if len(objs) == 1 else objs, ensure_ascii=False)


def _join(*parts: str) -> str:
    return "\n".join(p for p in parts if p)


def history(messages: list[Message], info: TemplateInfo) -> list[dict[str, Any]]:
    """Messages as template variables: Hugging Face style where the template renders tool
    calls and results itself, flattened to Hermes-style text where it does not."""
    out: list[dict[str, Any]] = []
    merging_results = False  # the last message is a user turn made of tool results
    for m in messages:
        is_result = m.role == "tool" and not info.native_results
        if m.role == "assistant" and m.tool_calls:
            if info.native_calls:
                mistral = info.family == "mistral"
                calls = [{"id": _mistral_id(c.id) if mistral else c.id, "type": "function",
                          "function": {"name": c.name, "arguments": c.arguments}}
                         for c in m.tool_calls]
                out.append({"role": "assistant", "content": m.content, "tool_calls": calls})
            else:
                out.append({"role": "assistant",
                            "content": _join(m.content, format_calls(m.tool_calls, info))})
        elif m.role == "tool" and info.native_results:
            d: dict[str, Any] = {"role": "tool", "content": m.content}
            if m.tool_call_id is not None:
                d["tool_call_id"] = (_mistral_id(m.tool_call_id) if info.family == "mistral"
                                     else m.tool_call_id)
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        elif is_result:
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if merging_results:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": m.role, "content": m.content})
        if m.role == "assistant" and m.thinking:
            out[-1]["reasoning_content"] = m.thinking  # what thinking templates read
        merging_results = is_result
    return out


def preamble(p: ToolPlan) -> str:
    """System text describing the tools and the Hermes call format, for templates that do
    not render tools themselves."""
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query." if p.parallel
        else "You may call one function to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
        *(json.dumps(tool_dict(t), ensure_ascii=False) for t in p.tools),
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    if isinstance(p.choice, NamedTool):
        lines += ["", f"You must call the function {p.choice.name}."]
    elif p.choice == "required":
        lines += ["", "You must call at least one function."]
    return "\n".join(lines)


def chat_inputs(messages: list[Message], system: str | None, template: str | None,
                p: ToolPlan | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for `templates.render`."""
    info = p.info if p is not None else inspect_template(template)
    out = templates.with_system(history(messages, info), system)
    if p is None:
        return out, {}
    if info.native:
        return out, {"tools": [tool_dict(t) for t in p.tools]}
    text = preamble(p)
    for i, m in enumerate(out):
        if m["role"] == "system":
            out[i] = {**m, "content": _join(m["content"].rstrip(), text) if m["content"]
                      else text}
            break
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, {}


# -- grammar --------------------------------------------------------------------------------

def special_markers(tokenizer: Any) -> dict[str, int]:
    """The CONTROL_MARKERS that are one special token of the vocabulary of `tokenizer` (an
    llguidance LLTokenizer), with their ids: a grammar must name such a marker by its token,
    because the matcher never takes a special token for the characters it renders as (and
    spelling `<tool_call>` out piece by piece is not what the model was trained to do)."""
    out: dict[str, int] = {}
    for marker in CONTROL_MARKERS:
        ids = tokenizer.tokenize_str(marker, parse_special=True)
        if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
            out[marker] = ids[0]
    return out


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's; ensure_ascii keeps it one line)."""
    return json.dumps(text)


def _arguments_schema(tool: Tool, strict: bool) -> str:
    """The `%json` body for a tool's arguments: its schema (at the root, so its `$ref`s
    resolve as written, `#` included) read as `response_format` schemas are (constraint.py:
    `nullable` rewritten, the layout fixed as json.dumps writes it, which is also how the
    calls in the history look); `lenient` when the client did not ask for strict output (a
    keyword the engine cannot enforce is then skipped, not an error)."""
    params = prepare_schema(tool.parameters or {"type": "object"})
    if params.get("type", "object") == "object" and not params.get("properties") \
            and "additionalProperties" not in params:
        # no parameters declared: `{}` (as with declared ones, nothing undeclared)
        params.update(type="object", properties={}, additionalProperties=False)
    # (prepare_schema dropped any "x-guidance" of the client's: compiler options are not theirs)
    params["x-guidance"] = {**JSON_OPTIONS, "lenient": not strict}
    try:
        return json.dumps(params, allow_nan=False)
    except ValueError:  # NaN or Infinity (Python's json reads them): no JSON schema has them
        raise ValueError(f"tool '{tool.name}': its parameters schema holds a number that is "
                         "not valid JSON (NaN or Infinity)") from None


def build_grammar(chosen: list[Tool], info: TemplateInfo, parallel: bool, *,
                  strict: bool = True, special: dict[str, int] | None = None) -> str:
    """A grammar in llguidance's Lark dialect for one call (or, if `parallel`, one or more)
    of the `chosen` tools, in the family's format, with each tool's arguments constrained by
    its JSON schema (`%json`). The call object around them is fixed text, name first, so
    the name picks the tool before any JSON is parsed and the tools' schemas never mix.

    `strict`: False when the client did not ask for strict schemas (unsupported keywords are
    skipped); `special`: markers that are special tokens (`special_markers`)."""
    if not chosen:
        raise ValueError("no tool to call")
    special = special or {}

    def marker(text: str) -> str:
        return f"<[{special[text]}]>" if text in special else _lit(text)

    key = "parameters" if info.family == "llama3" else "arguments"
    args_only = info.family == "mistral" and info.mistral_args
    rules = []
    for i, tool in enumerate(chosen):
        head = (marker("[TOOL_CALLS]") + " " + _lit(tool.name) + " " + marker("[ARGS]")
                if args_only else
                _lit('{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "' + key
                     + '": '))  # the name as format_calls writes it in the history
        tail = "" if args_only else ' "}"'
        rules.append(f"call{i}: {head} args{i}{tail}")
        rules.append(f"args{i}: %json {_arguments_schema(tool, strict)}")
    call = "call: " + " | ".join(f"call{i}" for i in range(len(chosen)))
    if args_only:  # [TOOL_CALLS]name[ARGS]{...}, the marker before each call
        root = "call+" if parallel else "call"
    elif info.family == "hermes":
        one = f'{marker("<tool_call>")} "\\n" call "\\n" {marker("</tool_call>")}'
        root = f'{one} ("\\n" {one})*' if parallel else one
    elif info.family == "mistral":
        root = marker("[TOOL_CALLS]") + (' "[" call (", " call)* "]"' if parallel
                                         else ' "[" call "]"')
    elif info.family == "llama3":
        root = 'call ("; " call)*' if parallel else "call"
    else:
        root = 'call | "[" call (", " call)* "]"' if parallel else "call"
    return "\n".join([f"start: {root}", call, *rules]) + "\n"


# -- parsing --------------------------------------------------------------------------------

# Deepest bracket nesting a call's JSON may have. Real arguments are a few levels deep; text
# nested deeper is not taken for a call, and never reaches a recursive decoder (Python's json
# raises RecursionError near 1000 levels, which must not escape into the engine thread).
MAX_DEPTH = 100
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def nesting(text: str) -> int:
    """The deepest bracket nesting in `text`, brackets inside strings aside (those of a string
    left unclosed count: erring on the deep side is safe). Linear time, no recursion."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif depth:
            depth -= 1
    return deepest



def _strip_fence(text: str) -> str:
    m = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, re.S)
    return m.group(1) if m else text


def _json_values(text: str, truncated: bool = False) -> list[Any] | None:
    """The JSON values in `text`, separated by whitespace, commas or semicolons; lists are
    flattened. None if anything else is there (`truncated`: except a broken tail after at
    least one whole value, where generation was cut off)."""
    s = _strip_fence(text).strip()
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(s) and s[i] in " \t\r\n,;":
            i += 1
        if i >= len(s):
            break
        try:
            value, i = decoder.raw_decode(s, i)
        except json.JSONDecodeError:
            if truncated and out:
                break
            if truncated and s[i] == "[":  # a list cut short: its whole items
                items = _json_values(s[i + 1:], truncated=True)
                return items
            return None
        out.extend(value if isinstance(value, list) else [value])
    return out or None


def _arguments(value: Any) -> dict[str, Any] | None:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        if nesting(value) > MAX_DEPTH:
            return None
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def _call(obj: Any, names: set[str] | None) -> ToolCall | None:
    """A call from a decoded JSON object; `names`: accept only these functions."""
    if not isinstance(obj, dict):
        return None
    if "name" not in obj and isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"type": "function", "function": {...}}
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args = _arguments(obj.get("arguments", obj.get("parameters")))
    if args is None:
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=args)


def _calls(values: list[Any] | None, names: set[str] | None) -> list[ToolCall] | None:
    if not values:
        return None
    calls = [_call(v, names) for v in values]
    if any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _pythonic(text: str, names: set[str] | None) -> list[ToolCall] | None:
    """`[f(a=1), g(b="x")]` (Llama 3.2+): parsed, never evaluated."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    items = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args:
            return None
        try:
            name = ast.unparse(item.func)
            args = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if not re.fullmatch(r"[\w.]+", name) or (names is not None and name not in names):
            return None
        calls.append(ToolCall(id=new_call_id(), name=name, arguments=args))
    return calls or None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_MISTRAL_ARGS = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([^\s\[]+)\s*)?\[ARGS\]")


def _parse_hermes(text: str, truncated: bool) -> tuple[list[ToolCall], str] | None:
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        rest.append(text[pos:m.start()])
        pos = m.end()
        found = _calls(_json_values(m.group(1), truncated), None)
        if found is None:
            if truncated and calls and m.end() == len(text) and \
                    not m.group(0).endswith("</tool_call>"):
                break  # the last call was cut off
            return None
        calls += found
    rest.append(text[pos:])
    return (calls, "".join(rest).strip()) if calls else None


def _parse_mistral(text: str, truncated: bool) -> tuple[list[ToolCall], str] | None:
    head, *parts = text.split("[TOOL_CALLS]")
    calls: list[ToolCall] = []
    for n, part in enumerate(parts):
        body = part.strip()
        cut = truncated and n == len(parts) - 1  # this part may end mid-call
        if not body:
            continue
        if body[0] in "[{":
            found = _calls(_json_values(body, cut), None)
            if found is None:
                return None
            calls += found
            continue
        pos = 0  # name[ARGS]{...}, maybe several in a row
        decoder = json.JSONDecoder()
        while pos < len(body):
            m = _MISTRAL_ARGS.match(body, pos)
            if m is None:
                if cut and calls:
                    break
                return None
            start = m.end()
            while start < len(body) and body[start].isspace():
                start += 1
            try:
                args, pos = decoder.raw_decode(body, start)
            except json.JSONDecodeError:
                if cut and calls:
                    break
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(id=new_call_id(), name=m.group(1), arguments=args))
            while pos < len(body) and body[pos].isspace():
                pos += 1
    return (calls, head.strip()) if calls else None


def parse_calls(text: str, family: Family, names: set[str] | None = None,
                truncated: bool = False) -> tuple[list[ToolCall], str] | None:
    """(calls, other text) from a model's output, or None if it holds no well-formed call.

    `names`: the offered tools. JSON-only families accept only calls of these (otherwise a
    JSON answer that happens to have a "name" key would become a call). `truncated`: the
    output was cut off (length): a broken last call after whole ones is dropped. Text nested
    deeper than MAX_DEPTH holds no call."""
    if nesting(text) > MAX_DEPTH:
        return None
    try:
        return _parse_calls(text, family, names, truncated)
    except RecursionError:  # bounded above; this is the last line of defence
        return None


def _parse_calls(text: str, family: Family, names: set[str] | None,
                 truncated: bool) -> tuple[list[ToolCall], str] | None:
    if family == "hermes":
        return _parse_hermes(text, truncated)
    if family == "mistral":
        return _parse_mistral(text, truncated)
    if family == "llama3":
        body = text.replace("<|python_tag|>", " ").strip()
        calls = _calls(_json_values(body, truncated), names)
        if calls is None and body.startswith("["):
            calls = _pythonic(body, names)
        return (calls, "") if calls else None
    body = text
    for marker in ("<tool_call>", "</tool_call>", "<|tool_call|>", "<|/tool_call|>",
                   "[TOOL_CALLS]"):
        body = body.replace(marker, " ")
    body = body.strip()
    if body.startswith("functools["):
        body = body[len("functools"):]
    calls = _calls(_json_values(body, truncated), names)
    return (calls, "") if calls else None


# -- streaming ------------------------------------------------------------------------------


def _distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls without exact repeats (same function, same arguments): small models, greedy
    ones especially, tend to repeat a call until the token limit."""
    seen: set[str] = set()
    out = []
    for call in calls:
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(call)
    return out


@dataclass
class Finished:
    text: str
    logprobs: list[Any]
    calls: list[ToolCall]


@dataclass
class ToolStream:
    """Filters one request's streamed text: text is released as it comes, except from the
    point where a call may have begun (a start marker, or for JSON-only families a leading
    `{`/`[`); that is held to the end, then parsed. Text that was not a call is released
    then. Logprob entries travel with the text of their tokens."""

    info: TemplateInfo
    names: set[str]
    parallel: bool = True
    _pieces: list[tuple[str, list[Any]]] = field(default_factory=list)
    _capturing: bool = False
    _started: bool = False  # non-blank output seen (matters for JSON-only families)

    @property
    def markers(self) -> tuple[str, ...]:
        return START_MARKERS[self.info.family]

    def _held(self) -> str:
        return "".join(t for t, _ in self._pieces)

    def push(self, text: str, logprobs: list[Any] | None = None) -> tuple[str, list[Any]]:
        """Add generated text; return (text, logprob entries) that can be released now."""
        self._pieces.append((text, list(logprobs or ())))
        if self._capturing:
            return "", []
        held = self._held()
        lead = LEAD[self.info.family]
        if lead and not self._started:
            stripped = held.lstrip()
            if not stripped:
                return "", []
            self._started = True
            if stripped[0] in lead:
                self._capturing = True
                return "", []
        first = min((i for i in (held.find(m) for m in self.markers) if i != -1), default=-1)
        if first != -1:
            self._capturing = True
            return self._release(first)
        return self._release(len(held) - partial_match(held, self.markers))

    def _release(self, n: int) -> tuple[str, list[Any]]:
        out: list[str] = []
        lps: list[Any] = []
        keep: list[tuple[str, list[Any]]] = []
        count = 0
        for text, entries in self._pieces:
            if count >= n and (text or keep):
                keep.append((text, entries))
            elif count + len(text) <= n:
                out.append(text)
                lps += entries
                count += len(text)
            else:
                cut = n - count
                out.append(text[:cut])
                lps += entries
                keep.append((text[cut:], []))
                count = n
        self._pieces = keep
        return "".join(out), lps

    def finish(self, truncated: bool = False) -> Finished:
        """The end of generation (`truncated`: by the token limit): the calls, and whatever
        text is still held."""
        held = self._held()
        lps = [e for _, entries in self._pieces for e in entries]
        self._pieces = []
        if self._capturing:
            parsed = parse_calls(held, self.info.family, self.names, truncated)
            if parsed is not None:
                calls, rest = parsed
                return Finished(rest, lps, _distinct(calls) if self.parallel else calls[:1])
        return Finished(held, lps, [])


def filter_events(streams: dict[str, ToolStream],
                  events: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """Pass runner events through the `streams` of tool-enabled requests.

    Chunk payloads are `{"text", "logprobs"?}` as the engine makes them (a thought's,
    `{"text": "", "thinking"}`, passes: see thinking.py); the parsed calls leave as one chunk
    whose payload is `{"text", "tool_calls", "logprobs"?}`, and the done event's
    finish_reason becomes "tool_calls". A finished request leaves `streams`."""
    out: list[tuple[str, str, Any]] = []
    for event in events:
        rid, kind, payload = event
        stream = streams.get(rid)
        if stream is None or (kind == "chunk" and ("thinking" in payload
                                                   or "prompt_logprobs" in payload)):
            out.append(event)
        elif kind == "chunk":
            lps = payload.get("logprobs")
            text, lps = stream.push(payload["text"], lps)
            if "logprobs" in payload and (text or lps):
                out.append((rid, kind, {"text": text, "logprobs": lps}))
            elif text:
                out.append((rid, kind, {"text": text}))
        elif kind == "done":
            streams.pop(rid, None)
            if payload.get("finish_reason") == "cancel":
                out.append(event)
                continue
            end = stream.finish(truncated=payload.get("finish_reason") == "length")
            if end.calls:
                chunk: dict[str, Any] = {"text": end.text,
                                         "tool_calls": [c.model_dump() for c in end.calls]}
                if end.logprobs:
                    chunk["logprobs"] = end.logprobs
                out.append((rid, "chunk", chunk))
                # "length" too: what was cut off was a further call, dropped; these are whole
                if payload.get("finish_reason") in ("stop", "length"):
                    payload = {**payload, "finish_reason": "tool_calls"}
            elif end.text or end.logprobs:
                out.append((rid, "chunk", {"text": end.text, "logprobs": end.logprobs}
                            if end.logprobs else {"text": end.text}))
            out.append((rid, kind, payload))
        else:
            if kind == "error":
                streams.pop(rid, None)
            out.append(event)
    return out
