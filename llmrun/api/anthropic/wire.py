"""Anthropic's request bodies (fields in Anthropic's documented order), and how one becomes
the internal request (`to_request`): content blocks flattened into `Message`s, tools and the
tool choice, structured output, thinking."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llmrun.api.images import from_media_type, from_url
from llmrun.request import (
    MAX_THINK_BUDGET,
    ChatRequest,
    EngineError,
    Message,
    NamedTool,
    Options,
    Tool,
    ToolCall,
    ToolChoice,
)

log = logging.getLogger(__name__)

BILLING_HEADER = "x-anthropic-billing-header:"


class InMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # `system` is not Anthropic's, but Claude Code sends it inside `messages`: folded in.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class CountBody(BaseModel):
    """`/v1/messages/count_tokens`; unknown fields (Claude Code sends several) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[InMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "adaptive" | "disabled"}

    def to_request(self) -> ChatRequest:
        """The internal request (the service puts the model's own stop strings first)."""
        return to_request(self)


class MessagesBody(CountBody):
    """`/v1/messages`."""

    max_tokens: int = Field(ge=1)
    metadata: dict[str, Any] | None = None
    # structured output: {"format": {"type": "json_schema", "schema": {...}}}; `effort` and
    # the rest are accepted and ignored. `output_format` is the same, from the older beta.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Sampling, as older API versions (and raw clients) send it; newer SDKs no longer do.
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    # llama-server's `grammar` (not Anthropic's): the whole output, a thought included, held
    # to a grammar (Lark or GBNF), as on /v1/chat/completions
    grammar: str | None = None


def _invalid(message: str) -> EngineError:
    return EngineError(message, code="invalid_request")


def _no_documents(model: str, where: str) -> EngineError:
    return _invalid(f"{where}: model '{model}' cannot read documents other than text "
                    "(PDFs, files); send the content as text")


def _image(block: dict[str, Any], where: str) -> str:
    """An image block's image: a `base64` source, or a `url` one (fetched only where
    LLMRUN_IMAGE_URLS allows it); Files API ids are refused (there is no Files API here)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(source, dict) and kind == "base64":
        return from_media_type(source.get("media_type"), source.get("data"), f"{where}.source")
    if isinstance(source, dict) and kind == "url":
        return from_url(source.get("url"), f"{where}.source.url")
    if kind == "file":
        raise _invalid(f"{where}.source: images by file_id are not supported (there is no "
                       "Files API here); send the image as a base64 source")
    raise _invalid(f"{where}.source: expected {{\"type\": \"base64\", \"media_type\": ..., "
                   "\"data\": ...} or {\"type\": \"url\", \"url\": ...}")


def _block_text(block: dict[str, Any], where: str, model: str,
                images: list[str] | None = None) -> str | None:
    """The text a user-side content block carries; None for blocks that are dropped
    (thinking) and for images, which go to `images` (None where images may not be: system
    text, assistant turns, as at Anthropic). Anything that cannot be expressed as text or an
    image is refused, never lost."""
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{where}.text: Field required")
        return text
    if kind in ("thinking", "redacted_thinking"):
        return None
    if kind == "image":
        if images is None:
            raise _invalid(f"{where}: image blocks are allowed only in user messages and in "
                           "tool_result content")
        images.append(_image(block, where))
        return None
    if kind == "document":
        source = block.get("source") or {}
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            title = block.get("title")
            return f"{title}\n\n{source['data']}" if title else source["data"]
        if source.get("type") == "content" and isinstance(source.get("content"), list):
            return _join([_block_text(b, f"{where}.source.content.{i}", model, images) or ""
                          for i, b in enumerate(source["content"])
                          if isinstance(b, dict)])
        raise _no_documents(model, where)
    if kind == "search_result":
        parts = [block.get("title"), block.get("source")]
        parts += [b.get("text") for b in block.get("content") or [] if isinstance(b, dict)]
        return _join([p for p in parts if isinstance(p, str)])
    if kind in ("audio", "input_audio", "sound"):
        raise _invalid(f"{where}: the Messages API has no audio blocks; send sound to "
                       "/v1/chat/completions (an input_audio part) or to "
                       "/v1/audio/transcriptions")
    raise _invalid(f"{where}: content blocks of type {kind!r} are not supported here")


def _join(parts: list[str]) -> str:
    return "\n\n".join(p for p in parts if p)


def _content_text(content: str | list[Any], where: str, model: str,
                  images: list[str] | None = None) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _invalid(f"{where}.{i}: expected a content block object")
        text = _block_text(block, f"{where}.{i}", model, images)
        if text is not None:
            texts.append(text)
    return _join(texts)


def _tool_result(block: dict[str, Any], where: str, model: str,
                 names: dict[str, str]) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _invalid(f"{where}.tool_use_id: Field required")
    content = block.get("content")
    pictures: list[str] = []  # a tool may answer with images (a screenshot)
    text = "" if content is None else _content_text(content, f"{where}.content", model,
                                                    pictures)
    if block.get("is_error"):
        text = f"Error: {text}"
    return Message(role="tool", content=text, tool_call_id=call_id, name=names.get(call_id),
                   images=pictures)


def _tool_use(block: dict[str, Any], where: str) -> ToolCall:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _invalid(f"{where}: a tool_use block needs 'id' and 'name'")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise _invalid(f"{where}.input: must be an object")
    return ToolCall(id=call_id, name=name, arguments=args)


def _without_billing_header(blocks: list[Any]) -> list[Any]:
    """Claude Code 2.1 starts `system` with a text block `x-anthropic-billing-header: ...`
    whose values change on every request. Anthropic's server takes it out of the prompt; left
    in, it would change the prompt's first tokens each turn and defeat the prefix cache."""
    return [b for b in blocks if not (isinstance(b, dict) and b.get("type") == "text"
                                      and str(b.get("text", "")).startswith(BILLING_HEADER))]


def to_messages(body: CountBody) -> list[Message]:
    """Anthropic's system and messages as the internal list: one leading system message
    (top-level `system`, then any `system`-role messages, in order), then the turns."""
    model = body.model
    system: list[str] = []
    if isinstance(body.system, list):
        system.append(_content_text(_without_billing_header(body.system), "system", model))
    elif body.system is not None:
        system.append(body.system)
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool turns answering them
    for i, msg in enumerate(body.messages):
        where = f"messages.{i}.content"
        if msg.role == "system":
            system.append(_content_text(msg.content, where, model))
            continue
        if isinstance(msg.content, str):
            out.append(Message(role=msg.role, content=msg.content))
            continue
        texts: list[str] = []
        pictures: list[str] = []
        calls: list[ToolCall] = []
        for j, block in enumerate(msg.content):
            at = f"{where}.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(block, dict):
                raise _invalid(f"{at}: expected a content block object")
            if kind == "tool_use" and msg.role == "assistant":
                call = _tool_use(block, at)
                names[call.id] = call.name
                calls.append(call)
            elif kind == "tool_result" and msg.role == "user":
                if texts or pictures:  # keep the order: what came before the result first
                    out.append(Message(role="user", content=_join(texts), images=pictures))
                    texts, pictures = [], []
                out.append(_tool_result(block, at, model, names))
            elif kind in ("tool_use", "tool_result"):
                raise _invalid(f"{at}: a {kind} block belongs in a "
                               f"{'assistant' if kind == 'tool_use' else 'user'} message")
            else:
                text = _block_text(block, at, model,
                                   pictures if msg.role == "user" else None)
                if text is not None:
                    texts.append(text)
        if msg.role == "assistant":
            out.append(Message(role="assistant", content=_join(texts), tool_calls=calls))
        elif texts or pictures or not any(isinstance(b, dict) and b.get("type") == "tool_result"
                                          for b in msg.content):
            out.append(Message(role="user", content=_join(texts), images=pictures))
    if any(system):
        out.insert(0, Message(role="system", content=_join(system)))
    return out


def to_tools(body: CountBody) -> tuple[list[Tool], ToolChoice, bool]:
    """(tools, tool choice, parallel calls allowed). Server tools (web search, code
    execution, ... : a `type` other than `custom`) run at Anthropic, not here: ignored."""
    tools: list[Tool] = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") not in (None, "custom"):
            log.info("ignoring server tool %r (%s)", t.get("name"), t.get("type"))
            continue
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _invalid(f"tools.{i}.name: Field required")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise _invalid(f"tools.{i}.input_schema: must be a JSON schema object")
        description = t.get("description")
        tools.append(Tool(name=name, description=description if isinstance(description, str)
                          else "", parameters=schema))
    choice_in = body.tool_choice or {"type": "auto"}
    parallel = not choice_in.get("disable_parallel_tool_use", False)
    kind = choice_in.get("type")
    choice: ToolChoice
    if kind == "auto":
        choice = "auto"
    elif kind == "none":
        choice = "none"
    elif kind == "any":
        if not tools:
            raise _invalid("tool_choice: type 'any' needs at least one tool in 'tools'")
        choice = "required"
    elif kind == "tool":
        name = choice_in.get("name")
        if not any(t.name == name for t in tools):
            raise _invalid(f"tool_choice.name: no tool named {name!r} in 'tools'")
        choice = NamedTool(name=str(name))
    else:
        raise _invalid(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', "
                       f"got {kind!r}")
    return tools, choice, parallel


def to_format(body: MessagesBody) -> dict[str, Any] | None:
    """The JSON schema the answer must follow (structured output), if one was asked for."""
    fmt = (body.output_config or {}).get("format") or body.output_format
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise _invalid("output_config.format: expected {\"type\": \"json_schema\", "
                       "\"schema\": {...}}")
    return fmt["schema"]


def to_request(body: CountBody) -> ChatRequest:
    tools, choice, parallel = to_tools(body)
    options = Options()
    stream = False
    fmt = None
    grammar = None
    if isinstance(body, MessagesBody):
        stream = body.stream
        fmt = to_format(body)
        grammar = body.grammar
        if grammar is not None and fmt is not None:
            raise _invalid("`grammar` and `output_config.format` cannot both be given: one "
                           "constraint per request")
        client_stops = [s for s in body.stop_sequences or [] if s]
        options = Options(
            num_predict=body.max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            stop=client_stops or None,
        )
    # strict: Anthropic's structured outputs promise the schema (forced tool inputs are held
    # to theirs the same way), so a keyword that cannot be enforced is a 400, never skipped
    return ChatRequest(model=body.model, messages=to_messages(body), options=options,
                       stream=stream, format=fmt, grammar=grammar, format_strict=True,
                       tools=tools,
                       stop_adds=True, tool_choice=choice,
                       parallel_tool_calls=parallel, think=to_think(body),
                       think_budget=to_budget(body))


def shows_thinking(body: CountBody) -> bool:
    """`thinking.display: "omitted"` (Claude Code sends it): think, but send no thoughts."""
    return (body.thinking or {}).get("display") != "omitted"


def to_budget(body: CountBody) -> int | None:
    """`thinking.budget_tokens` of enabled thinking: the most tokens the thought takes (the
    runner ends it there). Anthropic's own floor of 1024 and its rule that the budget stays
    below max_tokens are not held to: a small local model may think less, and a budget at
    max_tokens or above only never comes before the length does."""
    thinking = body.thinking or {}
    if thinking.get("type") != "enabled" or "budget_tokens" not in thinking:
        return None
    budget = thinking["budget_tokens"]
    if not isinstance(budget, int) or isinstance(budget, bool) \
            or not 1 <= budget <= MAX_THINK_BUDGET:
        raise _invalid(f"thinking.budget_tokens: expected a whole number of tokens from 1 to "
                       f"{MAX_THINK_BUDGET}, got {budget!r}")
    return budget


def to_think(body: CountBody) -> bool:
    """`thinking` enabled or adaptive turns thinking on for models that can think (others
    just answer: Claude Code asks for it on every request); absent or disabled, off."""
    return (body.thinking or {}).get("type") in ("enabled", "adaptive")
