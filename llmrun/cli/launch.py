"""`llmrun launch claude|codex|opencode`: run a coding agent against the local daemon.

Each agent is pointed at the daemon for this run only: through its environment and command
line (Claude Code, Codex's `-c` overrides) or a config file of llmrun's own (opencode's
`OPENCODE_CONFIG`), never by editing the user's configuration."""

from __future__ import annotations

import json
import os
import shlex
import shutil

import typer

from llmrun import config
from llmrun.cli._common import connect, err, fail


def claude_env(base_url: str, model: str) -> dict[str, str]:
    keys = config.api_keys()
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": keys[0] if keys else "llmrun",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
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


def codex_args(base_url: str, model: str, extra: list[str]) -> tuple[list[str], dict[str, str]]:
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
    return [*args, *extra], env


def opencode_config(base_url: str, model: str) -> dict[str, object]:
    """opencode's configuration for a provider that is this daemon (OpenAI-compatible)."""
    keys = config.api_keys()
    options: dict[str, str] = {"baseURL": f"{base_url}/v1"}
    if keys:
        options["apiKey"] = keys[0]
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
    ) -> None:
        """Run a coding agent on a local model (extra arguments after -- go to the agent)."""
        if tool not in TOOLS:
            fail(f"unknown tool {tool!r}: llmrun can launch: {', '.join(TOOLS)}")
        client = connect()
        base = client.base_url
        env: dict[str, str] = {}
        settings: dict[str, object]
        if tool == "claude":
            env, args = claude_env(base, model), claude_args(ctx.args)
            settings = {"env": STABLE_PROMPT_ENV}
        elif tool == "codex":
            args, env = codex_args(base, model, ctx.args)
            settings = {"args": args}
        else:
            settings = opencode_config(base, model)
            path = config.home() / "launch" / "opencode.json"
            env, args = {"OPENCODE_CONFIG": str(path)}, list(ctx.args)
        if print_config:
            typer.echo(json.dumps(settings, indent=2))
            return
        if tool == "opencode":  # opencode reads its provider from this file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings, indent=2))
            path.chmod(0o600)  # it may hold the key
        name, install = TOOLS[tool]
        if print_env:
            for k, v in env.items():
                typer.echo(f"export {k}={shlex.quote(v)}")
            typer.echo(f"# then: {name} {shlex.join(args)}")
            return
        exe = shutil.which(name)
        if exe is None:
            fail(f"{name} is not installed: {install}")
        _show_env(env)
        err.print(f"[dim]{name} {shlex.join(args)}[/]", markup=True)
        os.execvpe(exe, [exe, *args], {**os.environ, **env})
