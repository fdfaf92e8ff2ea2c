"""Tool calling for every dialect: tools into the prompt, and the grammars that force a
call ("required", a named tool) or steer one the model has begun ("auto"). Reading calls
out of the output is the toolcalls package's.

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
    plan.steering(special)                      # "auto": triggers and the grammar after one
    stream = plan.stream()                      # holds calls back, parses them at the end

`tool_choice="none"` hides the tools entirely; earlier calls and results in the history are
still rendered (natively, or flattened to text: the calls as the template's chat format writes
them, Hermes' by default, the results as Hermes' <tool_response>), never dropped. What a
template renders itself (tools, calls, results, a system turn, arguments as an object or as
JSON text) is found by rendering it (capabilities.py) and kept in its TemplateInfo.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from llmrun.chat import capabilities, templates
from llmrun.chat.toolcalls import ToolCheck, ToolStream, new_call_id  # noqa: F401 (re-export)
from llmrun.request import ChatRequest, Message, NamedTool, Tool, ToolCall, ToolChoice
from llmrun.structured.numbers import bound_numbers
from llmrun.structured.prepare import JSON_OPTIONS, prepare_schema

Family = Literal["hermes", "llama3", "mistral", "json"]

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
    system_role: bool = True  # it renders a system message (Gemma 2's refuses one)
    object_arguments: bool = True  # it reads a call's `arguments` as an object (else as JSON
    # text, as Functionary 3.2's does)


@lru_cache(maxsize=32)
def inspect_template(source: str | None) -> TemplateInfo:
    """Which tool-call family a chat template belongs to and what it renders itself: what
    its text names, where rendering it shows it does (capabilities.py)."""
    text = source or ""
    native = bool(re.search(r"\btools\b|\.Tools\b", text))  # Jinja, or Go (Ollama's)
    family: Family
    if not native or "<tool_call>" in text:
        family = "hermes"
    elif "[TOOL_CALLS]" in text:
        family = "mistral"
    elif "<|python_tag|>" in text or ("<|start_header_id|>" in text and "parameters" in text):
        family = "llama3"
    else:
        family = "json"
    native_calls = "tool_calls" in text or ".ToolCalls" in text
    native_results = bool(re.search(r"""['"](tool|ipython)['"]""", text))
    caps = capabilities.capabilities(source) if source else capabilities.Capabilities()
    if caps.rendered:  # what the text names, and rendering it shows it does
        native, native_calls, native_results = (
            native and caps.tools, native_calls and caps.calls, native_results and caps.results)
    elif not native:  # a template that names no tools and fails a tool conversation
        native_calls = native_results = False
    if "functions" in templates.free_names(text):  # FireFunction: its tools come as text
        native = native or caps.tools
    # Results answer calls: where the calls are written into the assistant's text (Hermes'
    # <tool_call> or the family's), the results go as text beside them (<tool_response>),
    # even where the template would render a `tool` message (SmolLM3's, as a bare user turn)
    native_results = native_results and native_calls
    return TemplateInfo(
        family, native=native, native_calls=native_calls, native_results=native_results,
        mistral_args=family == "mistral" and "[ARGS]" in text,
        system_role=caps.system_role, object_arguments=caps.object_arguments,
    )


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

    def steering(self, special: dict[str, int] | None = None) -> Steering | None:
        """For "auto": what steers a call the model begins (`steering`); else None."""
        if self.choice != "auto":
            return None
        return steering(self.tools, self.info, self.parallel, strict=self.strict,
                        special=special)

    def stream(self) -> ToolStream:
        """The filter that reads this request's calls out of its output (toolcalls/)."""
        only = self.choice.name if isinstance(self.choice, NamedTool) else \
            self.tools[0].name if len(self.tools) == 1 else None
        return ToolStream(self.info.family, ToolCheck.of(self.tools), self.parallel,
                          forced=self.choice != "auto", only=only)


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


def call_check(req: ChatRequest) -> ToolCheck:
    """What every call reported for `req` passes, wherever it is checked: the ToolCheck its
    plan's stream reads calls with (`ToolPlan.stream`), or, when the runner plans none (no
    tools, tool_choice "none", a raw prompt, a suffix to fill in: engine/host.py), one that
    no call passes. The template only picks how calls are written, not which are calls."""
    try:
        p = plan(req, None) if req.suffix is None else None
    except ValueError:  # a named choice not among the tools: the runner fails the request
        p = None
    return ToolCheck.of(p.tools if p is not None else [])


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


CallWriter = Callable[[list[ToolCall], TemplateInfo], str]


def history(messages: list[Message], info: TemplateInfo,
            write_calls: CallWriter = format_calls) -> list[dict[str, Any]]:
    """Messages as template variables: Hugging Face style where the template renders tool
    calls and results itself; where it does not, calls written into the assistant's text as
    the family writes them (`write_calls`: the chat format's, formats.Format.write_calls)
    and results as Hermes-style <tool_response> text in a user turn."""
    out: list[dict[str, Any]] = []
    merging_results = False  # the last message is a user turn made of tool results
    for m in messages:
        is_result = m.role == "tool" and not info.native_results
        if m.role == "assistant" and m.tool_calls:
            if info.native_calls:
                mistral = info.family == "mistral"
                calls = [{"id": _mistral_id(c.id) if mistral else c.id, "type": "function",
                          "function": {"name": c.name, "arguments": c.arguments
                                       if info.object_arguments else
                                       json.dumps(c.arguments, ensure_ascii=False)}}
                         for c in m.tool_calls]
                out.append({"role": "assistant", "content": m.content, "tool_calls": calls})
            else:
                out.append({"role": "assistant",
                            "content": _join(m.content, write_calls(m.tool_calls, info))})
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
            # what thinking templates read: `reasoning_content` most, `thinking` gpt-oss's
            # (Hugging Face's renderer fills in both from either)
            out[-1] = {"thinking": m.thinking, **out[-1], "reasoning_content": m.thinking}
        merging_results = is_result
    return out


def _fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A leading system message joined to the turn after it, for a template that renders no
    system role (Gemma 2's raises "System role not supported"): what llama.cpp does
    (common/chat.cpp, system_message_not_supported), so the model still reads it. Alone, it
    is dropped, as there."""
    if not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) == 1:
        return []
    first, second = messages[0], messages[1]
    content = second.get("content")
    joined = first["content"] + "\n" + (content if isinstance(content, str) else "")
    return [{**second, "content": joined}, *messages[2:]]


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
                p: ToolPlan | None, write_calls: CallWriter = format_calls,
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for `templates.render` (`write_calls`: see
    `history`; prompttext.variables passes the template's chat format's)."""
    info = p.info if p is not None else inspect_template(template)
    out = templates.with_system(history(messages, info, write_calls), system)
    offered = [tool_dict(t) for t in p.tools] if p is not None else []
    extra = capabilities.context(template, offered) if template else {}
    if p is not None and info.native:
        extra["tools"] = offered
    elif p is not None:
        text = preamble(p)
        for i, m in enumerate(out):
            if m["role"] == "system":
                out[i] = {**m, "content": _join(m["content"].rstrip(), text) if m["content"]
                          else text}
                break
        else:
            out.insert(0, {"role": "system", "content": text})
    return (out if info.system_role else _fold_system(out)), extra


# -- grammar --------------------------------------------------------------------------------

def special_markers(tokenizer: Any, extra: tuple[str, ...] = ()) -> dict[str, int]:
    """The CONTROL_MARKERS (and `extra`: a chat format's) that are one special token of the
    vocabulary of `tokenizer` (an llguidance LLTokenizer), with their ids: a grammar must
    name such a marker by its token, because the matcher never takes a special token for
    the characters it renders as (and spelling `<tool_call>` out piece by piece is not what
    the model was trained to do)."""
    out: dict[str, int] = {}
    for marker in (*CONTROL_MARKERS, *extra):
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
            and not any(k in params for k in _COMPOSING):
        # no parameters declared: `{}` (as with declared ones, nothing undeclared)
        params.update(type="object", properties={}, additionalProperties=False)
    elif _open_object(params):
        # Members the tool does not declare are not written, though a schema that says
        # nothing of them allows them: what is written still validates, and a small model
        # let loose invents members until the token limit (SmolLM2, tool_choice required,
        # 60 tokens, temperature 1, 12 seeds: one call cut off inside an invented
        # "apikeyUrlProviderForAjaxService"; closed, none). llama.cpp's grammars default
        # to the same ("produces faster grammars + reduces hallucinations").
        params["additionalProperties"] = False
    params = bound_numbers(params)  # what the client parses obeys the schema's bounds
    # (prepare_schema dropped any "x-guidance" of the client's: compiler options are not theirs)
    params["x-guidance"] = {**JSON_OPTIONS, "lenient": not strict}
    try:
        return json.dumps(params, allow_nan=False)
    except ValueError:  # NaN or Infinity (Python's json reads them): no JSON schema has them
        raise ValueError(f"tool '{tool.name}': its parameters schema holds a number that is "
                         "not valid JSON (NaN or Infinity)") from None


# Keywords that let an object's members come from elsewhere: closing it would forbid those.
_COMPOSING = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf",
              "anyOf", "oneOf", "$ref", "if", "not", "dependentSchemas", "dependencies")


def _open_object(params: dict[str, Any]) -> bool:
    """Whether `params` is an object schema with declared members that says nothing of
    others (nor composes with schemas that might declare them), its required members among
    the declared."""
    props = params.get("properties")
    required = params.get("required", [])
    return params.get("type", "object") == "object" and isinstance(props, dict) \
        and bool(props) and not any(k in params for k in _COMPOSING) \
        and isinstance(required, list) and all(r in props for r in required)


def _args_rules(chosen: list[Tool], strict: bool) -> list[str]:
    """Lark rules `args{i}`: tool i's arguments, by its schema."""
    return [f"args{i}: %json {_arguments_schema(tool, strict)}"
            for i, tool in enumerate(chosen)]


def _call_rules(chosen: list[Tool], info: TemplateInfo, strict: bool,
                marker: Callable[[str], str]) -> list[str]:
    """Lark rules `call` (one call of one of `chosen`, as the family writes it and as
    format_calls writes the history's) and `args{i}` (_args_rules)."""
    key = "parameters" if info.family == "llama3" else "arguments"
    args_only = info.family == "mistral" and info.mistral_args
    rules = []
    for i, tool in enumerate(chosen):
        head = (marker("[TOOL_CALLS]") + " " + _lit(tool.name) + " " + marker("[ARGS]")
                if args_only else
                _lit('{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "' + key
                     + '": '))
        tail = "" if args_only else ' "}"'
        rules.append(f"call{i}: {head} args{i}{tail}")
    return ["call: " + " | ".join(f"call{i}" for i in range(len(chosen))), *rules,
            *_args_rules(chosen, strict)]


def _marker_writer(special: dict[str, int] | None) -> Callable[[str], str]:
    """A marker in a grammar: its special token where it is one, else its characters."""
    special = special or {}
    return lambda text: f"<[{special[text]}]>" if text in special else _lit(text)


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
    marker = _marker_writer(special)
    rules = _call_rules(chosen, info, strict, marker)
    if info.family == "mistral" and info.mistral_args:  # the marker before each call
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
    return "\n".join([f"start: {root}", *rules]) + "\n"


# -- steering a call the model began ("auto") -----------------------------------------------

# Between the parts of a call the model writes: bounded whitespace (never empty: llguidance's
# lexemes must not match nothing), as prepare.JSON_OPTIONS bounds it inside the arguments.
_WS = "[ \\t\\n]{0,20}"
# The marker each family begins its calls with; the grammar takes over right after it.
FAMILY_MARKER: dict[str, str] = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]",
                                 "llama3": "<|python_tag|>"}


@dataclass(frozen=True)
class Steering:
    """How a call is steered in "auto" mode (llama-server's lazy grammar): nothing is
    constrained until the output matches one of `triggers` (regular expressions over the
    generated text); from the end of that match on, the output follows `grammar`."""

    triggers: list[str]
    grammar: str


def steering(chosen: list[Tool], info: TemplateInfo, parallel: bool, *, strict: bool = True,
             special: dict[str, int] | None = None) -> Steering:
    """The triggers and grammar for `chosen` tools. A call has begun when a JSON object
    names one of them and goes on to its arguments (`{"name": "get_weather", "arguments":`,
    or `"function"` / `"parameters"`; bare, fenced or in a list): the grammar starts at the
    name and goes on with that call, maybe more calls, then maybe the brace, bracket or
    fence the call was written in. Or when the family's marker opens a line (for Hermes'
    `<tool_call>`, followed by a JSON object naming a tool): the grammar starts after the
    marker, in the family's format. Both start points share one grammar (after a marker
    come a newline, `{` or `[`; after the quote, a tool's name). Requiring the name and
    what follows it keeps a model that echoes the tool list, or JSON the user asked for,
    unconstrained."""
    if not chosen:
        raise ValueError("no tool to call")
    marker = _marker_writer(special)
    rules = _args_rules(chosen, strict)
    sep = f'/{_WS},{_WS}"(arguments|parameters)"{_WS}:{_WS}/'
    for i, tool in enumerate(chosen):
        rules.append(f"named{i}: {_lit(json.dumps(tool.name, ensure_ascii=False)[1:])} {sep} "
                     f"args{i} /{_WS}\\}}/")
    rules.append("named: " + " | ".join(f"named{i}" for i in range(len(chosen))))
    # a whole call, its layout as the model likes it: the name picks the tool's rule
    rules.append(f'flexcall: /\\{{{_WS}"(name|function)"{_WS}:{_WS}"/ named')
    more = f" (/[ \\t\\n]{{1,20}}|{_WS},{_WS}/ flexcall)*" if parallel else ""
    alternatives = [f"named{more} /{_WS}\\}}/? /{_WS}\\]/? /{_WS}```/?"]
    names = "(?:" + "|".join(re.escape(json.dumps(t.name, ensure_ascii=False)[1:-1])
                             for t in chosen) + ")"
    named_object = r'\{\s*"(?:name|function)"\s*:\s*"'
    triggers = [named_object + f'(?={names}"' + r'\s*,\s*"(?:arguments|parameters)"\s*:)']
    family = FAMILY_MARKER.get(info.family)
    if family is not None:
        # Lazy.feed's text starts with a newline: the output's start opens a line
        trigger = r"\n[ \t]*" + re.escape(family)
        if info.family == "hermes":
            trigger += r"(?=\s*" + named_object + names + '")'
            close = marker("</tool_call>")
            one = f'{marker("<tool_call>")} "\\n"? flexcall "\\n"? {close}'
            alternatives.append(f'"\\n"? flexcall "\\n"? {close}'
                                + (f' ("\\n" {one})*' if parallel else ""))
        elif info.mistral_args:  # [TOOL_CALLS]name[ARGS]{...}, the marker before each
            again = f' ({marker("[TOOL_CALLS]")} plain)*' if parallel else ""
            rules.append("plain: " + " | ".join(
                f'{_lit(t.name)} {marker("[ARGS]")} args{i}' for i, t in enumerate(chosen)))
            alternatives.append(f"plain{again}")
        elif info.family == "mistral":
            alternatives.append(f'"[" flexcall (/{_WS},{_WS}/ flexcall)* "]"' if parallel
                                else '"[" flexcall "]"')
        else:  # llama3
            alternatives.append('flexcall ("; " flexcall)*' if parallel else "flexcall")
        triggers.insert(0, trigger)
    root = "start: " + " | ".join(f"({a})" for a in alternatives)
    return Steering(triggers, "\n".join([root, *rules]) + "\n")
