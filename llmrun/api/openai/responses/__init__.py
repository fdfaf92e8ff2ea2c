"""OpenAI's Responses API (`/v1/responses`): what Codex CLI and the newer OpenAI SDKs speak.

A request's `instructions` and `input` items become the internal `ChatRequest`: messages
(every system and developer text folded into one leading system message, as templates expect
it first), `input_image` parts into `Message.images` (user turns and tool outputs only;
api/images.py), `function_call` / `custom_tool_call` items into assistant tool calls and their
`*_output` items into tool turns; `reasoning` items are dropped (the model's own thought is not
fed back, as with the other dialects). Tools: `function` as is; a `namespace` group's
functions flattened under qualified names (`namespace.name`) and mapped back when called;
`custom` (free-form) tools as functions of one string argument, `input`, returned as
`custom_tool_call` items; built-in tools the daemon cannot run (`web_search`, ...) dropped
with a log line.

The answer is a list of output items (`reasoning`, `message`, `function_call`), whole or as
the Responses event stream, every event numbered (`sequence_number`). With `store` (OpenAI's
default) the response is kept on disk (server/responsestore.py) so that
`previous_response_id` can continue the conversation and `GET`/`DELETE /v1/responses/{id}`
work. Errors take OpenAI's shape.

The modules, each leaning only on those before it: `wire` (the body and `to_request`),
`stream` (answering whole or as events), `routes`; errors are OpenAI's (`openai.errors`).
"""

from __future__ import annotations

from llmrun.api.openai.responses.routes import router
from llmrun.api.openai.responses.wire import ResponsesBody, to_request

__all__ = ["ResponsesBody", "router", "to_request"]
