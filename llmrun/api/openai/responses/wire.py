"""The Responses API's request body, and how it becomes the internal request
(`to_request`): input items into messages, tools (namespaces flattened, custom tools as one
string argument) and the tool choice, the text format, reasoning."""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from llmrun.api.dialect import http_status
from llmrun.api.images import from_audio, from_url
from llmrun.api.openai.errors import ApiError
from llmrun.api.openai.wire import LlamaExtras, tool_arguments
from llmrun.request import (
    MAX_THINK_BUDGET,
    ChatRequest,
    EngineError,
    Format,
    Message,
    NamedTool,
    Options,
    PartialCall,
    Think,
    Tool,
    ToolCall,
    ToolChoice,
)

log = logging.getLogger(__name__)

# Built-in tools OpenAI runs on its side; a local daemon has none of them.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                "code_interpreter", "image_generation", "mcp", "local_shell")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")

class ResponsesBody(LlamaExtras):
    """POST /v1/responses (and /v1/responses/input_tokens), in the order of OpenAI's
    reference; unknown fields are accepted and logged (Codex sends several)."""

    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    # llama-server's, as on chat completions: the most tokens a thought may take (-1: no
    # limit; 0: no thought)
    reasoning_budget: int | None = Field(None, ge=-1, le=MAX_THINK_BUDGET)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None

    def to_request(self, earlier: list[dict[str, Any]]) -> tuple[ChatRequest, ToolMap]:
        """The internal request, after the `earlier` turns of `previous_response_id`, and
        how the tools' calls go back to the client."""
        return to_request(self, earlier)


@dataclass
class ToolMap:
    """What the model sees each tool as, and how its calls go back to the client."""

    # the model's name for a tool -> (namespace or None, the client's name, "function"|"custom")
    names: dict[str, tuple[str | None, str, str]] = field(default_factory=dict)

    def item(self, call: ToolCall | PartialCall) -> dict[str, Any]:
        """The output item of a call the model made; of one the token limit cut off, an
        item with status "incomplete" and its arguments (or input) as far as they got."""
        namespace, name, kind = self.names.get(call.name, (None, call.name, "function"))
        call_id = call.id if call.id.startswith("call_") else f"call_{secrets.token_hex(12)}"
        if isinstance(call, PartialCall):
            status, args, written = "incomplete", call.arguments, call.written(cut_strings=True)
            other = ""
        else:
            status, written = "completed", call.arguments
            args = json.dumps(call.arguments, ensure_ascii=False)
            other = json.dumps(call.arguments)
        if kind == "custom":
            text = written.get("input")
            return {"id": f"ctc_{secrets.token_hex(12)}", "type": "custom_tool_call",
                    "status": status, "call_id": call_id, "name": name,
                    "input": text if isinstance(text, str) else other}
        item = {"id": f"fc_{secrets.token_hex(12)}", "type": "function_call",
                "status": status, "call_id": call_id, "name": name, "arguments": args}
        if namespace is not None:
            item["namespace"] = namespace
        return item


def _part_text(part: Any, where: str, model: str, images: list[str] | None = None,
               sounds: list[str] | None = None) -> str | None:
    """A part's text; None for a refusal, for an image, which goes to `images`, and for a
    sound, which goes to `sounds` (None where they may not be: instructions, system and
    developer text, the model's own turns; sounds only in user messages)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ApiError(400, "a content part must be an object", where)
    kind = part.get("type")
    if kind in TEXT_PARTS:
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if kind == "input_image":
        if images is None:
            raise ApiError(400, "input_image parts are allowed only in user messages and in "
                                "tool call outputs", where)
        images.append(_image(part, where))
        return None
    if kind == "input_audio" and sounds is not None:
        audio = part.get("input_audio")
        audio = audio if isinstance(audio, dict) else {}
        try:
            sounds.append(from_audio(audio.get("data"), audio.get("format"),
                                     f"{where}.input_audio"))
        except EngineError as exc:
            raise ApiError(http_status(exc), exc.message, f"{where}.input_audio") from None
        return None
    if kind == "input_audio":
        raise ApiError(400, "input_audio parts are allowed only in user messages", where)
    if kind == "input_file":
        raise ApiError(400, f"model '{model}' does not support {kind} parts (it is "
                            "text-only)", where)
    if kind == "refusal":
        return None
    raise ApiError(400, f"content parts of type '{kind}' are not supported", f"{where}.type")


def _image(part: dict[str, Any], where: str) -> str:
    """An `input_image` part's image: `image_url` a data URL (or an http(s) one, fetched only
    where LLMRUN_IMAGE_URLS allows it); a `file_id` is refused (there is no Files API here).
    `detail` is for OpenAI's tiling: the model's projector sizes images itself."""
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise ApiError(400, "input_image by 'file_id' is not supported (there is no Files "
                            "API here); send the image as a data URL in 'image_url'",
                       f"{where}.file_id")
    url = part.get("image_url")
    if isinstance(url, dict):  # Chat Completions' shape, which some clients send here too
        url = url.get("url")
    try:
        return from_url(url, f"{where}.image_url")
    except EngineError as exc:
        raise ApiError(http_status(exc), exc.message, f"{where}.image_url") from None


def _content(content: Any, where: str, model: str, images: list[str] | None = None,
             sounds: list[str] | None = None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, "'content' must be a string or a list of parts", where)
    texts = [_part_text(p, f"{where}[{j}]", model, images, sounds)
             for j, p in enumerate(content)]
    return "\n".join(t for t in texts if t is not None)


def _model_name(name: str, namespace: Any) -> str:
    """The name the model knows a called tool by (a namespace's functions are qualified)."""
    if isinstance(namespace, str) and namespace:
        return f"{namespace}.{name}"
    return name


def to_messages(body: ResponsesBody, earlier: list[dict[str, Any]],
                tools: ToolMap) -> list[Message]:
    """The conversation: `earlier` items (from previous_response_id), then `input`."""
    system: list[str] = [body.instructions] if body.instructions else []
    out: list[Message] = []
    names: dict[str, str] = {}  # call_id -> the model's name of the tool, for tool turns
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    for i, item in enumerate([*earlier, *items]):
        where = f"input[{i - len(earlier)}]" if i >= len(earlier) else "previous_response_id"
        if not isinstance(item, dict):
            raise ApiError(400, "an input item must be an object", where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            pictures: list[str] = []
            sounds: list[str] = []
            user = role == "user"
            text = _content(item.get("content"), f"{where}.content", body.model,
                            pictures if user else None, sounds if user else None)
            if role in ("system", "developer"):
                system.append(text)
            elif role in ("user", "assistant"):
                out.append(Message(role=role, content=text, images=pictures, audio=sounds))
            else:
                raise ApiError(400, f"unknown message role {role!r}", f"{where}.role")
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            call_id = item.get("call_id") or item.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise ApiError(400, f"a {kind} item needs 'name' and 'call_id'", where)
            args = tool_arguments(item.get("arguments", "{}"), f"{where}.arguments") \
                if kind == "function_call" else {"input": str(item.get("input", ""))}
            model_name = _model_name(name, item.get("namespace"))
            names[call_id] = model_name
            call = ToolCall(id=call_id, name=model_name, arguments=args)
            if out and out[-1].role == "assistant":  # one turn: its text, then its calls
                out[-1] = out[-1].model_copy(update={"tool_calls": [*out[-1].tool_calls, call]})
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"a {kind} item needs 'call_id'", f"{where}.call_id")
            output = item.get("output")
            pictures = []  # a tool may answer with images (a screenshot)
            text = output if isinstance(output, str) else \
                _content(output, f"{where}.output", body.model, pictures)
            out.append(Message(role="tool", content=text, tool_call_id=call_id,
                               name=names.get(call_id), images=pictures))
        elif kind == "item_reference":
            raise ApiError(400, "item references are not supported; send the items, or "
                                "previous_response_id", where)
        elif kind == "reasoning" or kind in {f"{t}_call" for t in HOSTED_TOOLS}:
            continue  # a thought, or a hosted tool's run: nothing the model reads back
        else:
            raise ApiError(400, f"input items of type {kind!r} are not supported",
                           f"{where}.type")
    if any(system):
        out.insert(0, Message(role="system", content="\n\n".join(s for s in system if s)))
    return _merged(out)


def _merged(messages: list[Message]) -> list[Message]:
    """Consecutive user messages as one (Codex sends its environment and the task as two,
    and many chat templates insist that roles alternate)."""
    out: list[Message] = []
    for m in messages:
        if out and m.role == "user" and out[-1].role == "user":
            out[-1] = out[-1].model_copy(
                update={"content": "\n\n".join(t for t in (out[-1].content, m.content) if t),
                        "images": [*out[-1].images, *m.images],
                        "audio": [*out[-1].audio, *m.audio]})
        else:
            out.append(m)
    return out


def to_tools(body: ResponsesBody) -> tuple[list[Tool], ToolChoice, ToolMap, bool]:
    """(tools the model sees, tool choice, how calls map back, whether forced ones are
    strict)."""
    tools: list[Tool] = []
    mapping = ToolMap()
    strict: dict[str, bool] = {}
    dropped: list[str] = []

    def add(spec: dict[str, Any], namespace: str | None, where: str) -> None:
        kind = spec.get("type", "function")
        name = spec.get("name")
        if kind in HOSTED_TOOLS:
            dropped.append(kind)
            return
        if kind not in ("function", "custom"):
            raise ApiError(400, f"tools of type {kind!r} are not supported", f"{where}.type")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "a tool needs a 'name'", f"{where}.name")
        model_name = _model_name(name, namespace)
        if kind == "custom":
            text: dict[str, Any] = {"type": "string",
                                    "description": "the tool's whole input, as text"}
            fmt = spec.get("format") or {}
            if fmt.get("type") == "grammar" and fmt.get("syntax") == "regex" and \
                    isinstance(fmt.get("definition"), str):
                text["pattern"] = fmt["definition"]  # enforced whenever calls are
            elif fmt.get("type") == "grammar":
                log.info("responses: custom tool %r: only regex grammars are enforced; "
                         "its %s grammar is not", name, fmt.get("syntax"))
            params: dict[str, Any] = {"type": "object", "required": ["input"],
                                      "properties": {"input": text}}
        else:
            params = spec.get("parameters") or {"type": "object", "properties": {}}
        tools.append(Tool(name=model_name, description=spec.get("description") or "",
                          parameters=params))
        mapping.names[model_name] = (namespace, name, kind)
        strict[model_name] = spec.get("strict") is True

    for i, spec in enumerate(body.tools or []):
        if not isinstance(spec, dict):
            raise ApiError(400, "a tool must be an object", f"tools[{i}]")
        if spec.get("type") == "namespace":
            group = spec.get("name")
            if not isinstance(group, str) or not group:
                raise ApiError(400, "a namespace needs a 'name'", f"tools[{i}].name")
            for j, inner in enumerate(spec.get("tools") or []):
                if not isinstance(inner, dict):
                    raise ApiError(400, "a tool must be an object", f"tools[{i}].tools[{j}]")
                add(inner, group, f"tools[{i}].tools[{j}]")
        else:
            add(spec, None, f"tools[{i}]")
    if dropped:
        log.info("responses: dropping hosted tools the daemon cannot run: %s",
                 ", ".join(sorted(set(dropped))))
    choice = _tool_choice(body.tool_choice, mapping)
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools", "tool_choice")
    forced = [n for n in mapping.names if (isinstance(choice, NamedTool) and n == choice.name)
              or choice == "required"]
    return tools, choice, mapping, all(strict[n] for n in forced)


def _tool_choice(raw: str | dict[str, Any] | None, mapping: ToolMap) -> ToolChoice:
    if raw is None or raw in ("auto", "none", "required"):
        return raw or "auto"  # type: ignore[return-value]
    if isinstance(raw, str):
        raise ApiError(400, f"unknown tool_choice {raw!r}", "tool_choice")
    kind = raw.get("type")
    if kind in ("function", "custom"):
        name = _model_name(str(raw.get("name", "")), raw.get("namespace"))
        if name not in mapping.names:
            raise ApiError(400, f"tool_choice names the tool '{name}', which is not in "
                                "'tools'", "tool_choice")
        return NamedTool(name=name)
    if kind == "allowed_tools":
        return "required" if raw.get("mode") == "required" else "auto"
    return "auto"  # a hosted tool: the daemon runs none of them


def to_format(body: ResponsesBody) -> tuple[Format, bool]:
    fmt = (body.text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None, True
    if fmt["type"] == "json_object":
        return "json", True
    if fmt["type"] == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "text.format of type 'json_schema' needs 'schema'",
                           "text.format.schema")
        return schema, fmt.get("strict") is True
    raise ApiError(400, f"unknown text.format type {fmt['type']!r}", "text.format.type")


def to_think(body: ResponsesBody) -> Think:
    effort = (body.reasoning or {}).get("effort")
    if effort in ("none", "minimal"):
        return False
    return effort if effort in ("low", "medium", "high") else None


def to_request(body: ResponsesBody, earlier: list[dict[str, Any]]) -> tuple[ChatRequest, ToolMap]:
    tools, choice, mapping, strict = to_tools(body)
    fmt, fmt_strict = to_format(body)
    values: dict[str, Any] = {  # (each checked by Options)
        "temperature": body.temperature, "top_p": body.top_p,
        "num_predict": body.max_output_tokens, "seed": body.seed,
        "num_ctx": body.num_ctx, "top_k": body.top_k, "min_p": body.min_p,
        "repeat_penalty": body.repeat_penalty, "typical_p": body.typical_p,
        "repeat_last_n": body.repeat_last_n}
    req = ChatRequest(
        model=body.model, messages=to_messages(body, earlier, mapping),
        options=Options(**{k: v for k, v in values.items() if v is not None}),
        stream=bool(body.stream), keep_alive=body.keep_alive, format=fmt,
        format_strict=fmt_strict and strict, grammar=body.grammar, tools=tools,
        tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls is not False,
        think=to_think(body),
        think_budget=None if body.reasoning_budget is None or body.reasoning_budget < 0
        else body.reasoning_budget)
    return req, mapping
