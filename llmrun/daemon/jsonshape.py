"""The shape of a JSON request body, bounded before any route parses it: at most
MAX_JSON_VALUES values (array items and object members) and MAX_JSON_DEPTH levels of nesting.

Every route of every dialect reads its body with FastAPI: `json.loads` and then pydantic,
both on the event loop, both in C or Rust that holds the GIL for the whole call (so a worker
thread would not free the loop either). Their cost grows with the number of values, and most
with a body that does not validate: pydantic collects an error for every item of a list that
does not fit, and FastAPI turns each into a dict. Measured (pydantic 2.14, FastAPI 0.165, a
busy 2-core machine), per value: ~1 us valid, 3-5 us refused (a number where a message goes),
~9 us where a union tries three list types (`/v1/completions`' `prompt`). A 32 MiB body holds
up to 16 million values: `{"messages": [{}, {}, ...]}` (11 million) held the loop 86 s, every
other request and stream waiting. Through the daemon, beside a heartbeat: 65,000 nulls in
`prompt` held the loop 1.6 s, 21,000 malformed messages (63,000 values) 1.0 s; at 32,768
values the worst body costs about 0.8 s there, well under on an idle machine. A real request
has far fewer (LLMRUN_MAX_MESSAGES is 4096, a schema at most 20,000 values, bounds.py).

The count is taken over the raw bytes before anything is parsed, by a regular expression
that steps over strings whole: a Python loop over its matches, in a worker thread for large
bodies, so the interpreter hands the loop the GIL between matches; the loop over one body
stops at the first bound it passes, so a hostile body costs at most 5 * MAX_JSON_VALUES
steps; each regular-expression call looks at most WINDOW bytes and never backtracks
(possessive), and an unterminated string ends the count (the body is not JSON: the route's
parser refuses it at once), so no input holds the GIL long. A 32 MiB body costs 0.1-1 s of
that thread (0.2 s for one long string, such as an image's base64).
"""

from __future__ import annotations

import re

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrun.daemon.security import send_error

# Array items and object members in one body (see above).
MAX_JSON_VALUES = 32_768
# Nesting levels: depth costs little time (the values bound that), but every parser and
# walker after this one recurses: Python's json stops at its recursion limit (1000), pydantic
# near it. Under that, bounds.py words a schema too deep itself (64 levels) and names it.
MAX_JSON_DEPTH = 512
# Bodies this small are counted inline: at most this many steps, well under a millisecond.
INLINE_BYTES = 16 * 1024
# Bodies that are not JSON: model files (streamed to disk) and OpenAI's audio forms (read by
# api/forms.py with bounds of their own).
EXEMPT_PREFIXES = ("/api/blobs/", "/v1/audio/")

# Bytes one regular-expression call may look at: each call holds the GIL (about 5-30 ns a
# byte here), the loop around them does not.
WINDOW = 256 * 1024

_STRUCTURE = re.compile(rb'["\[\]{},]')
_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)  # never backtracks
_QUOTE, _COMMA = ord('"'), ord(",")
_OPENS = (ord("["), ord("{"))


def _past_string(body: bytes, pos: int) -> int:
    """Where the string whose contents start at `pos` ends (after its closing quote), read a
    window at a time; -1 when it runs to the end of the body (not JSON)."""
    n = len(body)
    while True:
        end = min(n, pos + WINDOW)
        pos = _STRING_REST.match(body, pos, end).end()  # type: ignore[union-attr]
        if pos < end and body[pos] == _QUOTE:
            return pos + 1
        if end == n:
            return -1
        # else the window ended inside the string (or just after a backslash, which the next
        # window reads with the character it escapes)


def refusal(body: bytes, max_values: int = MAX_JSON_VALUES,
            max_depth: int = MAX_JSON_DEPTH) -> tuple[int, str] | None:
    """(status, message) when the body passes a bound, else None. Values are counted as
    commas plus containers opened, never under the items and members of valid JSON. The
    steps are bounded too: valid JSON with N items and members has at most 5N + 3 tokens (a
    key and a value string each, a comma each, a container's two brackets), so a body of
    more (`""""""...`, not JSON) is past the bound whatever its commas say."""
    too_many = (413, f"the JSON body has more than {max_values} values (array items and "
                     "object members)")
    n = len(body)
    pos = values = depth = steps = 0
    max_steps = 5 * max_values + 3
    while pos < n:
        match = _STRUCTURE.search(body, pos, min(n, pos + WINDOW))
        if match is None:
            pos += WINDOW
            continue
        first, pos = body[match.start()], match.end()
        steps += 1
        if first == _QUOTE:
            pos = _past_string(body, pos)
            if pos < 0:
                return None  # not JSON: the route's parser says so, at once
        elif first == _COMMA:
            values += 1
        elif first in _OPENS:
            values += 1
            depth += 1
            if depth > max_depth:
                return 400, f"the JSON body is nested more than {max_depth} levels deep"
        else:
            depth -= 1
        if values > max_values or steps > max_steps:
            return too_many
    return None


class JSONShape:
    """Refuses, in the caller's dialect, a request body over MAX_JSON_VALUES values or
    MAX_JSON_DEPTH levels, before the app parses it; else hands the app the body as it came.
    It sits inside BodyLimit, which bounds the body it buffers."""

    def __init__(self, app: ASGIApp, max_values: int = MAX_JSON_VALUES,
                 max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_values, self.max_depth = max_values, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXEMPT_PREFIXES):
            await self.app(scope, receive, send)
            return
        received: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break  # the client left (or BodyLimit refused): the app sees that as it comes
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = b"".join(chunks)
                if len(body) <= INLINE_BYTES:
                    refused = refusal(body, self.max_values, self.max_depth)
                else:
                    refused = await anyio.to_thread.run_sync(
                        refusal, body, self.max_values, self.max_depth)
                if refused is not None:
                    await send_error(send, scope["path"], *refused, "request_too_large"
                                     if refused[0] == 413 else None)
                    return
                received = [{"type": "http.request", "body": body, "more_body": False}]
                break

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)
