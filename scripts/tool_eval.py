"""How well a model calls tools through llmrun with tool_choice "auto".

A fixed set of requests, greedy, through the OpenAI-compatible API of a running daemon:
requests that need a tool, requests that need none (one asks for JSON), and multi-turn
requests whose last message is a tool's result. For each model it reports:

- calls recognised when a tool is needed (the right tool; and any tool at all);
- false calls when none is needed;
- arguments valid under the tool's schema, of the calls made;
- the multi-turn requests answered as expected (a further call, or an answer).

Not a CI test: scores depend on the model. Usage:

    llmrun serve &
    python scripts/tool_eval.py smollm2 gemma3 [--url http://127.0.0.1:11434] [--markdown]
                                [--few-shot] [-v]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

try:
    import jsonschema
except ImportError:  # installed with llmrun (chat/toolcalls/ checks calls with it)
    sys.exit("jsonschema is needed: pip install jsonschema")


def tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


S = {"type": "string"}
TOOLS = [
    tool("get_weather", "Get the current weather in a city", {"city": S}, ["city"]),
    tool("read_file", "Read a text file from the project", {"path": S}, ["path"]),
    tool("search_web", "Search the web", {"query": S}, ["query"]),
    tool("send_email", "Send an email", {"to": S, "subject": S, "body": S},
         ["to", "subject", "body"]),
    tool("list_directory", "List the files in a directory", {"path": S}, ["path"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

NEEDS_TOOL = [
    ("What's the weather in Paris right now?", "get_weather"),
    ("Please read the file src/main.py", "read_file"),
    ("Search the web for the latest Python release.", "search_web"),
    ("Send an email to alice@example.com with the subject 'Lunch' saying I'll be late.",
     "send_email"),
    ("What files are in the docs folder?", "list_directory"),
    ("Is it raining in Tokyo?", "get_weather"),
    ("Show me what's in config.yaml.", "read_file"),
    ("Look up online who won the 2022 World Cup.", "search_web"),
]
NEEDS_NONE = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Translate 'good morning' into Spanish.",
    "Give me a JSON object describing a cat, with a name and an age.",
    "Explain what a for loop is in one sentence.",
    "Hi! How are you?",
]


def turn(question: str, name: str, args: dict[str, Any], result: str) -> list[dict]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result}]


# (messages, the tool expected next, or None for an answer)
MULTI_TURN: list[tuple[list[dict], str | None]] = [
    (turn("What's the weather in Paris?", "get_weather", {"city": "Paris"},
          "18 degrees C, cloudy"), None),
    (turn("Search the web for the population of Canada.", "search_web",
          {"query": "population of Canada"}, "Canada has about 40 million people."), None),
    (turn("Read notes.txt and email its text to bob@example.com.", "read_file",
          {"path": "notes.txt"}, "Buy milk and eggs."), "send_email"),
    (turn("List the src folder, then read main.py in it.", "list_directory", {"path": "src"},
          "main.py\nutil.py"), "read_file"),
]


# --few-shot: how a user can steer a small model into a call format it can keep to (a
# fenced JSON object), with a system prompt and four examples before each request
FEW_SHOT_SYSTEM = ("You can call tools. To call one, answer with only a JSON object in a "
                   "```json code block, like the examples. Otherwise answer normally.")


def _fenced(name: str, args: dict[str, Any]) -> str:
    return "```json\n" + json.dumps({"name": name, "arguments": args}) + "\n```"


FEW_SHOT = [
    {"role": "system", "content": FEW_SHOT_SYSTEM},
    {"role": "user", "content": "What's the weather in Rome?"},
    {"role": "assistant", "content": _fenced("get_weather", {"city": "Rome"})},
    {"role": "user", "content": "Please read the file docs/readme.txt"},
    {"role": "assistant", "content": _fenced("read_file", {"path": "docs/readme.txt"})},
    {"role": "user", "content": "Search the web for the Rust 2024 edition."},
    {"role": "assistant", "content": _fenced("search_web", {"query": "Rust 2024 edition"})},
    {"role": "user", "content": "What is 3 times 4?"},
    {"role": "assistant", "content": "3 times 4 is 12."},
]


@dataclass
class Score:
    right: int = 0  # needed: the expected tool was called
    called: int = 0  # needed: some tool was called
    false: int = 0  # not needed: a tool was called anyway
    calls: int = 0  # every call made
    valid: int = 0  # ... whose arguments fit the schema
    multi: int = 0  # multi-turn requests answered as expected
    notes: list[str] = field(default_factory=list)


def _ask(client: httpx.Client, model: str, messages: list[dict],
         few_shot: bool = False) -> tuple[list[Any], str]:
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [*FEW_SHOT, *messages] if few_shot else messages,
        "tools": TOOLS, "temperature": 0, "max_tokens": 160})
    r.raise_for_status()
    message = r.json()["choices"][0]["message"]
    return message.get("tool_calls") or [], message.get("content") or ""


def record(score: Score, calls: list[Any]) -> list[str]:
    names = []
    for call in calls:
        score.calls += 1
        name = call["function"]["name"]
        names.append(name)
        try:
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, SCHEMAS[name])
            score.valid += 1
        except (ValueError, KeyError, jsonschema.ValidationError):
            pass
    return names


def evaluate(client: httpx.Client, model: str, verbose: bool, few_shot: bool) -> Score:
    score = Score()

    def ask(client: httpx.Client, model: str, messages: list[dict]) -> tuple[list[Any], str]:
        return _ask(client, model, messages, few_shot)

    for question, expected in NEEDS_TOOL:
        calls, content = ask(client, model, [{"role": "user", "content": question}])
        names = record(score, calls)
        score.called += bool(names)
        score.right += bool(names) and names[0] == expected
        if verbose:
            print(f"  [tool] {question!r}: {names or repr(content[:80])}", file=sys.stderr)
    for question in NEEDS_NONE:
        calls, content = ask(client, model, [{"role": "user", "content": question}])
        names = record(score, calls)
        score.false += bool(names)
        if verbose:
            print(f"  [none] {question!r}: {names or repr(content[:80])}", file=sys.stderr)
    for messages, expected in MULTI_TURN:
        calls, content = ask(client, model, messages)
        names = record(score, calls)
        score.multi += (names[:1] == [expected]) if expected else not names
        if verbose:
            print(f"  [multi] -> {expected}: {names or repr(content[:80])}", file=sys.stderr)
    return score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--url", default="http://127.0.0.1:11434")
    parser.add_argument("--markdown", action="store_true", help="a table row per model")
    parser.add_argument("--few-shot", action="store_true",
                        help="a system prompt and four examples (three fenced-JSON calls) first")
    parser.add_argument("-v", "--verbose", action="store_true", help="each answer, on stderr")
    args = parser.parse_args()
    try:
        httpx.get(args.url + "/api/version", timeout=10).raise_for_status()
    except httpx.HTTPError as exc:
        sys.exit(f"no llmrun daemon answers at {args.url} ({exc}): start `llmrun serve`")
    with httpx.Client(base_url=args.url, timeout=600) as client:
        if args.markdown:
            print("| model | right tool when one is needed | any call when needed | false "
                  "calls when none is | valid arguments | multi-turn as expected |")
            print("|---|---|---|---|---|---|")
        for model in args.models:
            s = evaluate(client, model, args.verbose, args.few_shot)
            n, k, m = len(NEEDS_TOOL), len(NEEDS_NONE), len(MULTI_TURN)
            if args.markdown:
                print(f"| {model} | {s.right}/{n} | {s.called}/{n} | {s.false}/{k} | "
                      f"{s.valid}/{s.calls} | {s.multi}/{m} |")
            else:
                print(f"{model}: right tool {s.right}/{n}, any call {s.called}/{n}, false calls "
                      f"{s.false}/{k}, valid arguments {s.valid}/{s.calls}, multi-turn "
                      f"{s.multi}/{m}")


if __name__ == "__main__":
    main()
