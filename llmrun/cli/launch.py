"""`llmrun launch claude|codex|opencode`: run a coding agent against the local daemon.

Each agent is pointed at the daemon for this run only: through its environment and command
line (Claude Code, Codex's `-c` overrides) or a config file of llmrun's own (opencode's
`OPENCODE_CONFIG`), never by editing the user's configuration.

An agent's own prompt is long before the user says a word (Claude Code's system prompt and
tool definitions are about 20k tokens), and none of them can put Ollama's `num_ctx` in its
bodies. So launch picks a context (`choose_context`), has the agent send it with every
request (the X-Llmrun-Num-Ctx header), and loads the model with it before the agent starts:
a model too short for the agent, or a machine without the memory, is said plainly here
rather than as "prompt is too long" on the agent's first turn."""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import typer

from llmrun import config
from llmrun.cli._common import connect, err, fail
from llmrun.client import APIError, Client

NUM_CTX_HEADER = "X-Llmrun-Num-Ctx"
# The context each agent needs at least: its own prompt (Claude Code's is about 20k tokens)
# and room for a few turns of files and tool results
NEEDS = {"claude": 32768, "codex": 32768, "opencode": 32768}
# what launch asks for where the model and memory allow: Ollama advises coding agents at
# least 64000 tokens
WANTED = 65536


def trained_context(show: dict[str, object]) -> int | None:
    """The context a model was trained for, from /api/show's model_info (None: unknown, as
    for a remote model)."""
    info = show.get("model_info")
    if isinstance(info, dict):
        for key, value in info.items():
            if str(key).endswith(".context_length") and type(value) is int and value > 0:
                return value
    return None


def choose_context(tool: str, trained: int | None, asked: int | None) -> int:
    """The context to launch `tool` with: `asked` (--context) as given, else WANTED capped
    at the model's trained context; ValueError, saying why, for a model shorter than the
    agent needs."""
    if asked:
        return asked
    need = NEEDS[tool]
    if trained is not None and trained < need:
        raise ValueError(
            f"this model holds at most {trained} tokens, and {TOOLS[tool][0]} needs about "
            f"{need} (its own prompt alone is about 20000 in Claude Code): pick a model with "
            f"a longer context, or pass --context to try anyway")
    return min(trained or WANTED, WANTED)


def claude_env(base_url: str, model: str, num_ctx: int | None = None) -> dict[str, str]:
    keys = config.api_keys()
    headers = {"ANTHROPIC_CUSTOM_HEADERS": f"{NUM_CTX_HEADER}: {num_ctx}"} if num_ctx else {}
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": keys[0] if keys else "llmrun",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        **headers,
        **STABLE_PROMPT_ENV,
    }


# No telemetry or update checks to hosts this machine may not reach, and no attribution
# header: Claude Code puts `x-anthropic-billing-header: ...cch=<changes every request>` at
# the top of the system prompt, which would defeat the prefix cache on every turn (the
# daemon also drops that block, for setups made by hand). Claude Code reads some of these
# only from its settings, so they go in through `--settings` as well as the environment.
STABLE_PROMPT_ENV = {
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
}


def claude_args(extra: list[str]) -> list[str]:
    return ["--settings", json.dumps({"env": STABLE_PROMPT_ENV}), *extra]


def codex_args(base_url: str, model: str, extra: list[str],
               num_ctx: int | None = None) -> tuple[list[str], dict[str, str]]:
    """Codex's command line and environment for a provider that is this daemon, over the
    Responses API (`wire_api = "responses"`); the key, when the daemon wants one, travels in
    LLMRUN_API_KEY, which the provider names."""
    overrides = {
        "model_provider": "llmrun",
        "model": model,
        "model_providers.llmrun.name": "llmrun",
        "model_providers.llmrun.base_url": f"{base_url}/v1",
        "model_providers.llmrun.wire_api": "responses",
    }
    env: dict[str, str] = {}
    keys = config.api_keys()
    if keys:
        overrides["model_providers.llmrun.env_key"] = "LLMRUN_API_KEY"
        env["LLMRUN_API_KEY"] = keys[0]
    args: list[str] = []
    for key, value in overrides.items():
        args += ["-c", f"{key}={json.dumps(value)}"]  # TOML strings: JSON's quoting fits
    if num_ctx:  # a TOML inline table
        args += ["-c", f'model_providers.llmrun.http_headers={{ "{NUM_CTX_HEADER}" = '
                       f'"{num_ctx}" }}']
    return [*args, *extra], env


def opencode_config(base_url: str, model: str, num_ctx: int | None = None
                    ) -> dict[str, object]:
    """opencode's configuration for a provider that is this daemon (OpenAI-compatible)."""
    keys = config.api_keys()
    options: dict[str, object] = {"baseURL": f"{base_url}/v1"}
    if keys:
        options["apiKey"] = keys[0]
    if num_ctx:
        options["headers"] = {NUM_CTX_HEADER: str(num_ctx)}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"llmrun": {"npm": "@ai-sdk/openai-compatible", "name": "llmrun",
                                "options": options, "models": {model: {"name": model}}}},
        "model": f"llmrun/{model}",
    }


TOOLS = {"claude": ("claude", "npm install -g @anthropic-ai/claude-code"),
         "codex": ("codex", "npm install -g @openai/codex"),
         "opencode": ("opencode", "npm install -g opencode-ai")}


def _show_env(env: dict[str, str]) -> None:
    secret = {"ANTHROPIC_AUTH_TOKEN", "LLMRUN_API_KEY"}
    for k, v in env.items():
        # the key is the user's secret: shown only when asked for (--print-env)
        shown = "<first of LLMRUN_API_KEYS>" if k in secret and config.api_keys() else v
        err.print(f"[dim]{k}={shown}[/]", markup=True, highlight=False)


def _load(client: Client, tool: str, model: str, num_ctx: int, explicit: bool) -> int:
    """Load `model` with `num_ctx` before the agent starts (the context it gets, which may be
    the agent's least, NEEDS, where memory does not hold more): a model that cannot be
    loaded with what the agent needs fails here, in words."""
    tries = [num_ctx] if explicit or num_ctx <= NEEDS[tool] else [num_ctx, NEEDS[tool]]
    for n in tries:
        try:
            client.load(model, num_ctx=n)
            return n
        except APIError as exc:
            if n == tries[-1]:
                fail(f"model '{model}' cannot be loaded with a context of {n} tokens, which "
                     f"{TOOLS[tool][0]} needs: {exc}")
            err.print(f"[dim]a context of {n} tokens does not fit ({exc}); trying "
                      f"{tries[-1]}[/]", markup=True, highlight=False)
    raise AssertionError("unreachable")


def _pointed(tool: str, base: str, model: str, num_ctx: int, extra: list[str]
             ) -> tuple[dict[str, str], list[str], dict[str, object]]:
    """(environment, command line, configuration) that point `tool` at the daemon."""
    if tool == "claude":
        env = claude_env(base, model, num_ctx)
        return env, claude_args(extra), {"env": {
            **STABLE_PROMPT_ENV, "ANTHROPIC_CUSTOM_HEADERS": env["ANTHROPIC_CUSTOM_HEADERS"]}}
    if tool == "codex":
        args, env = codex_args(base, model, extra, num_ctx)
        return env, args, {"args": args}
    path = config.home() / "launch" / "opencode.json"
    return {"OPENCODE_CONFIG": str(path)}, extra, opencode_config(base, model, num_ctx)


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def launch(
        ctx: typer.Context,
        tool: str = typer.Argument(..., help="The agent to launch: claude, codex or opencode"),
        model: str = typer.Option("smollm2", "--model", "-m", help="Model to serve it"),
        print_env: bool = typer.Option(False, "--print-env",
                                       help="Print the environment and command instead of "
                                            "running"),
        print_config: bool = typer.Option(False, "--print-config",
                                          help="Print the agent's configuration for the "
                                               "daemon instead of running"),
        context: int | None = typer.Option(None, "--context", min=1, max=1 << 24,
                                           help="Context tokens to load the model with "
                                                "(default: 65536, or the model's own if "
                                                "shorter)"),
    ) -> None:
        """Run a coding agent on a local model (extra arguments after -- go to the agent)."""
        if tool not in TOOLS:
            fail(f"unknown tool {tool!r}: llmrun can launch: {', '.join(TOOLS)}")
        client = connect()
        base = client.base_url
        try:
            num_ctx = choose_context(tool, trained_context(client.show(model)), context)
        except (APIError, ValueError) as exc:
            fail(f"model '{model}': {exc}")
        name, install = TOOLS[tool]
        exe = None
        if not (print_config or print_env):
            exe = shutil.which(name)
            if exe is None:
                fail(f"{name} is not installed: {install}")
            num_ctx = _load(client, tool, model, num_ctx, explicit=context is not None)
        env, args, settings = _pointed(tool, base, model, num_ctx, list(ctx.args))
        if print_config:
            typer.echo(json.dumps(settings, indent=2))
            return
        if tool == "opencode":  # opencode reads its provider from this file
            path = Path(env["OPENCODE_CONFIG"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings, indent=2))
            path.chmod(0o600)  # it may hold the key
        if print_env:
            for k, v in env.items():
                typer.echo(f"export {k}={shlex.quote(v)}")
            typer.echo(f"# then: {name} {shlex.join(args)}")
            return
        assert exe is not None
        _show_env(env)
        err.print(f"[dim]{name} {shlex.join(args)}[/]", markup=True)
        os.execvpe(exe, [exe, *args], {**os.environ, **env})
