"""Go text/template chat templates: the syntax of Ollama's Modelfile TEMPLATE instruction.

Ollama renders prompts with Go's text/template over its own data model (`.System`, `.Messages`,
`.Tools`, ...), so templates written for it cannot go through Jinja. This is a small interpreter
for that language, built for untrusted input: templates only reach fields of the plain values
built here (never Python attributes), output, running time and nesting are bounded, and every
failure is a `TemplateError`. `render` reproduces Ollama's `template.Execute`
(template/template.go), including its fallback for templates that predate `.Messages`.

The package, each module leaning only on those before it: `values` (Go values and how Go
prints them), `funcs` (the built-in functions), `parse` (lexer and parser), `execute` (the
executor); here, Ollama's template data (`.Messages`, `.Tools`, ...) and its execution.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from llmrun.chat import templatelimits
from llmrun.chat.gotemplate.execute import _State
from llmrun.chat.gotemplate.parse import _Action, _Branch, _Field, _Parser, _Pipe, _Var
from llmrun.chat.gotemplate.values import (
    _JSONList,
    _JSONMap,
    _Ordered,
    _PropertyType,
    _Struct,
)
from llmrun.chat.templatelimits import TemplateError

# -- Ollama's template data: what templates see -----------------------------------------------


def _text(value: Any) -> str:
    if isinstance(value, list):  # content parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return "" if value is None else str(value)


def _go_value(v: Any) -> Any:
    """JSON data as Go decodes it into `any`: every number a float64."""
    if isinstance(v, bool) or v is None or isinstance(v, str | float):
        return v
    if isinstance(v, int):
        return float(v)
    if isinstance(v, dict):
        return {str(k): _go_value(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_go_value(x) for x in v]
    return str(v)


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def _property(schema: Any) -> _Struct:
    """api.ToolProperty: only the schema keys Ollama keeps, with its JSON field order."""
    s = schema if isinstance(schema, dict) else {}
    t = s.get("type")
    ptype = _PropertyType([t] if isinstance(t, str) else [str(x) for x in _list(t)])
    props = s.get("properties")
    f = {"AnyOf": [_property(x) for x in _list(s.get("anyOf"))], "Type": ptype,
         "Items": _go_value(s.get("items")), "Description": _text(s.get("description")),
         "Enum": [_go_value(x) for x in _list(s.get("enum"))],
         "Properties": _Ordered((str(k), _property(v)) for k, v in props.items())
         if isinstance(props, dict) else None,
         "Required": [str(x) for x in _list(s.get("required"))]}
    j = _Ordered()
    for key, name, empty in (("anyOf", "AnyOf", []), ("type", "Type", []), ("items", "Items", None),
                             ("description", "Description", ""), ("enum", "Enum", []),
                             ("properties", "Properties", None), ("required", "Required", [])):
        if f[name] is not None and f[name] != empty:  # omitempty
            j[key] = f[name]
    return _Struct("api.ToolProperty", f, j)


def _tool(tool: dict[str, Any]) -> _Struct:
    """Ollama's templateTool. Its function and parameters print as JSON too: they did before
    Ollama 0.14, and templates such as qwen2.5's (`{{ .Function }}`) rely on it."""
    fn = tool.get("function") or {}
    params = fn.get("parameters") or {}
    props = params.get("properties")
    properties = _JSONMap((str(k), _property(v)) for k, v in props.items()) \
        if isinstance(props, dict) else _JSONMap()
    pf = {"Type": _text(params.get("type")), "Defs": _go_value(params.get("$defs")),
          "Items": _go_value(params.get("items")),
          "Required": [str(x) for x in _list(params.get("required"))], "Properties": properties}
    pj = _Ordered(type=pf["Type"])
    for key, name in (("$defs", "Defs"), ("items", "Items"), ("required", "Required")):
        if pf[name] is not None and pf[name] != []:
            pj[key] = pf[name]
    pj["properties"] = properties if isinstance(props, dict) else None
    parameters = _Struct("template.templateToolFunctionParameters", pf, pj, stringer=True)
    name, description = _text(fn.get("name")), _text(fn.get("description"))
    function = _Struct("template.templateToolFunction",
                       {"Name": name, "Description": description, "Parameters": parameters},
                       _Ordered(name=name, description=description, parameters=parameters),
                       stringer=True)
    tf = {"Type": _text(tool.get("type")), "Items": _go_value(tool.get("items")),
          "Function": function}
    tj = _Ordered(type=tf["Type"])
    if tf["Items"] is not None:
        tj["items"] = tf["Items"]
    tj["function"] = function
    return _Struct("template.templateTool", tf, tj, stringer=True)


def _tool_call(call: dict[str, Any]) -> _Struct:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise TemplateError("tool call arguments are not valid JSON") from None
    if not isinstance(args, dict | None):
        raise TemplateError("tool call arguments must be a JSON object")
    function = _Struct("template.templateToolCallFunction", {
        "Index": fn["index"] if isinstance(fn.get("index"), int) else 0,
        "Name": _text(fn.get("name")),
        "Arguments": _JSONMap((str(k), _go_value(v)) for k, v in (args or {}).items())})
    return _Struct("template.templateToolCall", {"ID": _text(call.get("id")), "Function": function})


def _message(m: dict[str, Any]) -> _Struct:
    calls = [_tool_call(c) for c in _list(m.get("tool_calls"))]
    # the thought arrives as `reasoning_content` (the Hugging Face name) from llmrun's history
    thought = m.get("thinking") or m.get("reasoning_content")
    f = {"Role": m["role"], "Content": m["content"], "Thinking": _text(thought),
         "Images": [], "ToolCalls": calls, "ToolName": _text(m.get("tool_name") or m.get("name")),
         "ToolCallID": _text(m.get("tool_call_id"))}
    json_form = _Ordered(f, Images=None, ToolCalls=calls or None)
    return _Struct("*template.templateMessage", f, json_form)


def _collate(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: every system text joined (for `.System`), and consecutive messages of
    one role merged, except tool results."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        m = {**m, "role": _text(m.get("role")).lower(), "content": _text(m.get("content"))}
        if m["role"] == "system":
            system.append(m["content"])
        if out and out[-1]["role"] == m["role"] and m["role"] != "tool":
            out[-1]["content"] += "\n\n" + m["content"]
        else:
            out.append(m)
    return "\n\n".join(system), out


def _tools(tools: list[dict[str, Any]] | None) -> _JSONList:
    out = _JSONList(_tool(t) for t in tools or [])
    out.nil = tools is None
    return out


# -- Ollama's execution -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Template:
    nodes: tuple[Any, ...]
    uses_messages: bool
    through_response: tuple[Any, ...]  # legacy mode's last turn: cut after the first .Response


def _identifiers(nodes: tuple[Any, ...]) -> set[str]:
    """Lower-cased field and variable names, as Ollama's Vars() collects them to pick a mode."""
    names: set[str] = set()

    def pipe(p: _Pipe) -> None:
        for cmd in p.cmds:
            for arg in cmd:
                if isinstance(arg, _Field | _Var):
                    names.update(n.lower() for n in arg.names)
                    names.update([arg.name.lower()] if isinstance(arg, _Var) else [])
                elif isinstance(arg, _Pipe):
                    pipe(arg)

    def walk(ns: tuple[Any, ...]) -> None:
        for n in ns:
            if isinstance(n, _Action | _Branch):
                pipe(n.pipe)
            if isinstance(n, _Branch):
                walk(n.body)
                walk(n.orelse)

    walk(nodes)
    return names


def _through_response(nodes: tuple[Any, ...]) -> tuple[Any, ...]:
    """Ollama's deleteNode: drop everything after the first `.Response` field in a depth-first
    walk (conditions of if/range/with are not searched), so the reply continues from there."""
    cut = False

    def pipe(p: _Pipe) -> _Pipe | None:
        nonlocal cut
        cmds = []
        for cmd in p.cmds:
            args: list[Any] = []
            for arg in cmd:
                if isinstance(arg, _Field) and "Response" in arg.names:
                    cut = True
                    args.append(arg)
                elif not cut:
                    sub = pipe(arg) if isinstance(arg, _Pipe) else arg
                    args += [sub] if sub is not None else []
            if not args:
                return None
            cmds.append(tuple(args))
        return replace(p, cmds=tuple(cmds))

    def walk(ns: tuple[Any, ...]) -> tuple[Any, ...]:
        out: list[Any] = []
        for n in ns:
            if cut:
                break
            if isinstance(n, _Action):
                p = pipe(n.pipe)
                out += [replace(n, pipe=p)] if p is not None else []
            elif isinstance(n, _Branch):
                out.append(replace(n, body=walk(n.body), orelse=walk(n.orelse)))
            else:
                out.append(n)
        return tuple(out)

    return walk(nodes)


@lru_cache(maxsize=32)
def _parse(source: str) -> tuple[Any, ...]:
    return _Parser(source).parse()


@lru_cache(maxsize=32)
def _compile(source: str) -> _Template:
    nodes = _parse(source)
    names = _identifiers(nodes)
    if "messages" not in names and "response" not in names:  # Ollama appends {{ .Response }}
        response = _Pipe((), False, ((_Field(("Response",)),),))
        nodes += (_Action(response, source.count("\n") + 1),)
    return _Template(nodes, "messages" in names, _through_response(nodes))


def _render_legacy(template: _Template, messages: list[dict[str, Any]], extra: dict[str, Any],
                   add_generation_prompt: bool, state: _State) -> None:
    """Templates without .Messages render one exchange (.System, .Prompt, .Response) at a
    time; the last one stops after .Response, so the model writes (or continues) the reply."""
    turn = {"System": "", "Prompt": "", "Response": ""}

    def flush() -> None:
        state.run(template.nodes, {**turn, **extra})
        turn.update(System="", Prompt="", Response="")

    for m in messages:
        if m["role"] == "system":
            if turn["Prompt"] or turn["Response"]:
                flush()
            turn["System"] = m["content"]
        elif m["role"] == "user":
            if turn["Response"]:
                flush()
            turn["Prompt"] = m["content"]
        elif m["role"] == "assistant":
            turn["Response"] = m["content"]
    last = template.through_response if add_generation_prompt else template.nodes
    state.run(last, {**turn, **extra})


def render(source: str, messages: list[dict[str, Any]], *,
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
           think: bool | str | None = None) -> str:
    """Render an Ollama chat template over OpenAI/Hugging Face style messages and tools, as
    Ollama's template.Execute does. `add_generation_prompt=False` only matters to templates
    without .Messages: the last exchange is then rendered whole instead of cut after
    .Response (with .Messages the template alone decides, as in Ollama)."""
    templatelimits.check_size(source)
    template = _compile(source)
    levels = ("high", "medium", "low", "max")
    extra = {"Think": think is True or think in levels,
             "ThinkLevel": "medium" if think is True else think if think in levels else "",
             "IsThinkSet": think is not None}
    state = _State()
    try:
        system, msgs = _collate(messages)
        if template.uses_messages:
            state.run(template.nodes, {
                "System": system, "Messages": [_message(m) for m in msgs], "Tools": _tools(tools),
                "Response": "", **extra})
        else:
            _render_legacy(template, msgs, extra, add_generation_prompt, state)
    except TemplateError:
        raise
    except Exception as exc:  # e.g. RecursionError on absurdly nested data: a request error
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    return "".join(state.out)


def check(source: str) -> None:
    """Raise TemplateError if `source` is too big or does not parse."""
    templatelimits.check_size(source)
    _compile(source)


def execute(source: str, data: dict[str, Any]) -> str:
    """Run a Go template over plain data (dict keys are its fields), with none of Ollama's
    conventions: for tests, and for text other than chat prompts."""
    templatelimits.check_size(source)
    state = _State()
    try:
        state.run(_parse(source), data)
    except TemplateError:
        raise
    except Exception as exc:
        raise TemplateError(f"template failed: {type(exc).__name__}: {exc}") from None
    return "".join(state.out)


_GO_ACTION = re.compile(r"\{\{-?\s*(?:[.$]|/\*|(?:if|range|with|else|end|template|define|block"
                        r"|break|continue)\b(?!\s*\())")


def looks_like_go(source: str) -> bool:
    """Whether a template is Go text/template (Ollama) rather than Jinja (Hugging Face): Go
    actions such as `{{ .X }}`, `{{ if .X }}`, `{{ end }}`, and no Jinja `{% %}` blocks."""
    return "{%" not in source and _GO_ACTION.search(source) is not None
