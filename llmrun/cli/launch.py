"""`llmrun launch claude`: run Claude Code against the local daemon."""

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


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def launch(
        ctx: typer.Context,
        tool: str = typer.Argument(..., help="The client to launch: claude"),
        model: str = typer.Option("smollm2", "--model", "-m", help="Model to serve it"),
        print_env: bool = typer.Option(False, "--print-env",
                                       help="Print the environment instead of running"),
    ) -> None:
        """Run Claude Code on a local model (extra arguments after -- go to claude)."""
        if tool != "claude":
            fail(f"unknown tool {tool!r}: llmrun can launch: claude")
        client = connect()
        env = claude_env(client.base_url, model)
        if print_env:
            for k, v in env.items():
                typer.echo(f"export {k}={shlex.quote(v)}")
            typer.echo(f"# then: claude {shlex.join(claude_args(ctx.args))}")
            return
        exe = shutil.which("claude")
        if exe is None:
            fail("claude is not installed: npm install -g @anthropic-ai/claude-code")
        args = claude_args(ctx.args)
        for k, v in env.items():
            # the key is the user's secret: shown only when asked for (--print-env)
            shown = "<first of LLMRUN_API_KEYS>" if k == "ANTHROPIC_AUTH_TOKEN" and \
                config.api_keys() else v
            err.print(f"[dim]{k}={shown}[/]", markup=True, highlight=False)
        err.print(f"[dim]claude {shlex.join(args)}[/]", markup=True)
        os.execvpe(exe, [exe, *args], {**os.environ, **env})
