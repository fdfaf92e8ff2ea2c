"""Reading tool calls out of a model's output: the tolerant reader and the stream filter.

Small models do not keep to the format their template asks for (a 0.5B Hermes model wrote
its calls as bare or fenced JSON five times out of five), so one reader, for every family,
accepts what models actually write:

    <tool_call>{"name": ..., "arguments": {...}}</tool_call>   the closing tag may be missing
    [TOOL_CALLS]... / <|python_tag|>... / [f(a=1)]              Mistral, Llama 3 (their families)
    {"name": ..., "arguments": {...}}  or a list of them       bare, or in a ```json, ```tool_call
    {"function": ..., "parameters": ...}                       or ``` fence, text around it
    {"type": "function", "function": {"name": ..., ...}}
    <function=name>{...}</function>

A shape is a call only when its name is one of the request's tools and its arguments
validate against that tool's schema (`ToolCheck`); light repairs are made first (arguments
given as a JSON string, trailing commas). Anything else stays content: an unknown name,
arguments that fail the schema, the JSON a user asked for.

`ToolStream` filters one request's streamed text: what may be the start of a call is held
back until it is plainly not one (released at once) or plainly one (held to the end, then
parsed). What it holds while undecided is a few dozen characters at most.

The modules: check.py (`ToolCheck`), jsontext.py (JSON read without trusting it), reader.py
(`parse_calls`, `cut_call`: a whole output), stream.py (`ToolStream`, `filter_events`:
streamed text). Callers import from here.
"""

from llmrun.chat.toolcalls.check import ToolCheck
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, nesting
from llmrun.chat.toolcalls.reader import MARKERS, MAX_TRIES, cut_call, new_call_id, parse_calls
from llmrun.chat.toolcalls.stream import (
    MAYBE,
    NO,
    YES,
    CallReader,
    Finished,
    ToolStream,
    filter_events,
    shape,
)

__all__ = ["MARKERS", "MAX_DEPTH", "MAX_TRIES", "MAYBE", "NO", "YES", "CallReader", "Finished",
           "ToolCheck", "ToolStream", "cut_call", "filter_events", "nesting", "new_call_id",
           "parse_calls", "shape"]
