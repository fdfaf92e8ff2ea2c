"""Ollama's request bodies, and how each becomes the internal request (`to_request`) or,
for `/api/create`, a Modelfile (`to_modelfile`)."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal, cast

from pydantic import BaseModel, Field, ValidationError

from llmrun.api.images import from_audio, from_base64, from_data_url
from llmrun.request import (
    ChatRequest,
    EngineError,
    Format,
    KeepAlive,
    Message,
    Options,
    Think,
    Tool,
    ToolCall,
)
from llmrun.store import HOST_PATH_REFUSED, CreateError, refuse_host_paths
from llmrun.store.modelfile import Modelfile, ModelfileError
from llmrun.store.modelfile import parse as modelfile_parse

log = logging.getLogger(__name__)


class OllamaMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    # sound files, base64 (WAV, MP3), as `images` carries pictures. Ollama's API documents
    # no audio field (its docs name `images` alone); `audio` is llmrun's choice
    audio: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class ChatBody(BaseModel):
    model: str
    messages: list[OllamaMessage] = []
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    tools: list[dict[str, Any]] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    truncate: bool | None = None  # when the prompt outgrows num_ctx: drop the oldest turns
    shift: bool | None = None  # when the output fills num_ctx: shift it and go on
    return_progress: bool = False  # stream a long prompt's reading (llama-server's name)
    # llama-server's `grammar` (not Ollama's): the whole output, a thought included, held to
    # a grammar (Lark or GBNF), as on /v1/chat/completions
    grammar: str | None = None

    def to_request(self) -> ChatRequest:
        """The internal request; EngineError (400) for what Ollama would refuse."""
        if isinstance(self.format, str) and self.format not in ("json", ""):
            raise _invalid_format(self.format)
        if self.grammar is not None and self.format:
            raise EngineError("`grammar` and `format` cannot both be given: one constraint "
                              "per request", code="invalid_request")
        return ChatRequest(
            model=self.model,
            messages=[_message(m, i) for i, m in enumerate(self.messages)],
            tools=[_tool(t) for t in self.tools or []],
            options=_with_fit(parse_options(self.options), self.truncate, self.shift),
            stream=self.stream,
            progress=self.stream and self.return_progress,
            keep_alive=self.keep_alive,
            # (a string here is "json": anything else was refused above)
            format=cast(Format, self.format or None),
            format_strict=True,  # Ollama's `format` is enforced: what cannot be is a 400
            logprobs=self.top_logprobs if self.logprobs else None,
            think=_think(self.think),
            think_required=bool(self.think),
            grammar=self.grammar,
        )


class GenerateBody(BaseModel):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    context: list[int] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    shift: bool | None = None  # when the output fills num_ctx: shift it and go on
    return_progress: bool = False  # stream a long prompt's reading (llama-server's name)
    # llama-server's `grammar` (Lark or GBNF), as the OpenAI dialects take it: not Ollama's,
    # which ignores unknown fields, so an Ollama client never sends it by accident
    grammar: str | None = None

    def to_request(self) -> ChatRequest:
        """The internal request; EngineError (400) for what Ollama would refuse."""
        if isinstance(self.format, str) and self.format not in ("json", ""):
            raise _invalid_format(self.format)
        if self.grammar is not None and self.format:
            raise EngineError("give one of 'format' and 'grammar': each constrains the "
                              "whole output", code="invalid_request")
        if self.images and (self.raw or self.suffix):
            # a raw or fill-in-the-middle prompt is tokenized as is: no turn to place them in
            raise EngineError("images need a chat template; raw prompts (`raw`, `suffix`) "
                              "cannot carry images", code="invalid_request")
        messages = []
        if self.system:
            messages.append(Message(role="system", content=self.system))
        pictures = _images(self.images, "images")
        if self.prompt or pictures:  # the images go on the prompt's turn, before its text
            messages.append(Message(role="user", content=self.prompt, images=pictures))
        return ChatRequest(
            model=self.model,
            messages=messages,
            # fill-in-the-middle: the prompt is the text before the gap, the suffix after
            prompt=self.prompt if (self.raw or self.suffix) and self.prompt else None,
            suffix=self.suffix or None,
            context=self.context or None,
            return_context=not self.raw,
            think=_think(self.think),
            think_required=bool(self.think),
            template=self.template or None,
            options=_with_fit(parse_options(self.options), None, self.shift),
            stream=self.stream,
            progress=self.stream and self.return_progress,
            keep_alive=self.keep_alive,
            # (a string here is "json": anything else was refused above)
            format=cast(Format, self.format or None),
            format_strict=True,  # Ollama's `format` is enforced: what cannot be is a 400
            logprobs=self.top_logprobs if self.logprobs else None,
            grammar=self.grammar,
        )


class EmbedBody(BaseModel):
    model: str
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    dimensions: int | None = Field(None, ge=1)


class LegacyEmbedBody(BaseModel):
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class PullBody(BaseModel):
    model: str | None = None
    name: str | None = None  # older clients send `name`
    insecure: bool = False
    stream: bool = True


class ModelBody(BaseModel):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False

    @property
    def target(self) -> str:
        if not (self.model or self.name):
            raise EngineError("missing field 'model'", code="invalid_request")
        return str(self.model or self.name)


class CopyBody(BaseModel):
    source: str
    destination: str


class CreateBody(BaseModel):
    model: str | None = None
    name: str | None = None
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[OllamaMessage] | None = None
    quantize: str | None = None
    stream: bool = True
    modelfile: str | None = None  # pre-0.5 clients sent the Modelfile text

    def to_modelfile(self, allow_remote: bool = False) -> Modelfile:
        return _modelfile_from(self, allow_remote)


def _invalid_format(value: str) -> EngineError:
    return EngineError(f"invalid format {value!r}: use \"json\" or a JSON schema",
                       code="invalid_request")


def parse_options(raw: dict[str, Any] | None) -> Options:
    """Validate request options; unknown names are ignored with a warning, as Ollama does."""
    if not raw:
        return Options()
    known = {k: v for k, v in raw.items() if k in Options.model_fields}
    for k in raw.keys() - known.keys():
        log.warning("ignoring unknown option %r", k)
    try:
        return Options.model_validate(known)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise EngineError(f"invalid options.{field}: {first['msg']}",
                          code="invalid_request") from None


def _with_fit(options: Options, truncate: bool | None, shift: bool | None) -> Options:
    """The request's `truncate` and `shift` fields over its options (and so over the
    Modelfile's PARAMETERs of those names)."""
    fit = {k: v for k, v in (("truncate", truncate), ("shift", shift)) if v is not None}
    return options.model_copy(update=fit) if fit else options


def _think(value: bool | str | None) -> Think:
    """Ollama's `think`: true/false, or an effort level for models that take one."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("low", "medium", "high"):
        return value  # type: ignore[return-value]
    raise EngineError(f"invalid think value {value!r}: use true, false, \"low\", \"medium\" "
                      "or \"high\"", code="invalid_request")


def _tool(spec: dict[str, Any]) -> Tool:
    fn = spec.get("function", spec)
    if not isinstance(fn, dict) or not fn.get("name"):
        raise EngineError("invalid field 'tools': each tool needs function.name",
                          code="invalid_request")
    return Tool(name=fn["name"], description=fn.get("description") or "",
                parameters=fn.get("parameters") or {"type": "object", "properties": {}})


def _images(raw: list[str] | None, where: str) -> list[str]:
    """Ollama's `images`: base64 image files (a data: URL is taken too, as some clients send
    one). Any role may carry them, as in Ollama."""
    return [from_data_url(x, f"{where}[{k}]") if x[:5].lower() == "data:"
            else from_base64(x, f"{where}[{k}]") for k, x in enumerate(raw or [])]


def _message(m: OllamaMessage, at: int) -> Message:
    """Ollama's message -> internal: assistant tool_calls carry arguments as objects; a tool
    result names its function in `tool_name`."""
    calls = []
    for i, call in enumerate(m.tool_calls or []):
        fn = call.get("function", {})
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"value": args}
        calls.append(ToolCall(id=call.get("id") or f"call_{i}", name=fn.get("name", ""),
                              arguments=args if isinstance(args, dict) else {"value": args}))
    return Message(role=m.role, content=m.content, tool_calls=calls,
                   images=_images(m.images, f"messages[{at}].images"),
                   audio=[from_audio(x, None, f"messages[{at}].audio[{k}]")
                          for k, x in enumerate(m.audio or [])],
                   name=m.tool_name if m.role == "tool" else None,
                   thinking=m.thinking if m.role == "assistant" else None)


def _modelfile_from(body: CreateBody, allow_remote: bool = False) -> Modelfile:
    """The Modelfile a create body describes. Over HTTP, FROM/`files`/ADAPTER name uploaded
    blobs or models only (or, with `allow_remote`, a remote server's URL): anything else is
    refused with one message, whatever is on disk."""
    if body.modelfile and not (body.from_ or body.files):
        try:
            mf = modelfile_parse(body.modelfile)
        except ModelfileError as exc:
            raise CreateError(str(exc)) from None
        refuse_host_paths(mf, allow_remote)
        return mf
    if any(not d.startswith(("sha256:", "sha256-")) for d in
           [*(body.files or {}).values(), *(body.adapters or {}).values()]):
        raise CreateError(HOST_PATH_REFUSED)  # Ollama's clients send digests here, never paths
    extra: list[str] = []
    if body.files:
        # a model and its vision projector, which the store tells apart by their headers
        ggufs = [d for f, d in body.files.items() if f.lower().endswith(".gguf")]
        if not 1 <= len(ggufs) <= 2:
            raise CreateError("'files' must name one .gguf blob: the model's (and, for a "
                              "vision model, its projector's beside it)")
        source, *extra = ggufs
    elif body.from_:
        source = body.from_
    else:
        raise CreateError("give 'from' (a model name) or 'files' (an uploaded GGUF blob)")
    params = dict(body.parameters or {})
    unknown = sorted(set(params) - set(Options.model_fields))
    if unknown:
        raise CreateError(f"unknown parameter(s): {', '.join(unknown)}")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    licenses = [body.license] if isinstance(body.license, str) else list(body.license or [])
    mf = Modelfile(
        from_=source, extra_from=extra, parameters=params, template=body.template,
        system=body.system,
        adapters=list((body.adapters or {}).values()),  # uploaded blobs: sha256:<hex>
        messages=[Message(role=m.role, content=m.content) for m in body.messages or []
                  if m.role != "tool"],
        license=licenses)
    refuse_host_paths(mf, allow_remote)
    return mf
