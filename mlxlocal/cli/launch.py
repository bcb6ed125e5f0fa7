"""`mlxlocal launch CLIENT`: a coding agent (claude, codex, opencode) on a local server.

The logic lives in mlxlocal.agents.launch; this module is the command's options and errors."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from mlxlocal.cli.common import MODEL_HELP, err, fail

DEFAULT_MODEL = "qwen3-8b"

LAUNCH_HELP = """Run a coding agent against a local `mlxlocal serve`: claude (Claude Code), codex
(Codex CLI) or opencode.

Starts the server for --model in the background (or reuses one that already serves it on
--port), waits until it is ready, then runs the client with environment variables and a config
of ours under $MLXLOCAL_HOME/launch (default ~/.cache/mlxlocal/launch); your own config files
are never touched. The server is stopped when the client exits (unless --keep-server).
Arguments after `--` go to the client. --print shows the whole setup as a shell script
without running anything."""


def launch(
    ctx: typer.Context,
    client: str = typer.Argument(..., help="claude | codex | opencode"),
    model: Optional[str] = typer.Option(None, "--model", "-m", envvar="MLXLOCAL_LAUNCH_MODEL",
                                        help=MODEL_HELP + f" (default: {DEFAULT_MODEL}, named and "
                                        "confirmed before a download)"),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name", help="Name the client asks for (default: the alias, or the last "
        "component of a path or repo id)"),
    port: int = typer.Option(8080, "--port", help="Server port (an mlxlocal server already serving the model there is reused)"),
    print_only: bool = typer.Option(False, "--print", help="Print the environment, config and commands; run nothing"),
    keep_server: bool = typer.Option(False, "--keep-server", help="Leave the server running after the client exits"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Key for the server (given to the client; "
                                          "a server launch starts is started with it)"),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds to wait for the server (first use may download the model)"),
) -> None:
    from mlxlocal.agents.launch import (
        LaunchError,
        get_client,
        make_plan,
        render_plan,
        serve_command,
        served_alias,
    )
    from mlxlocal.agents.launch import launch as run_launch

    try:
        spec = get_client(client)
    except LaunchError as e:
        fail(str(e), 2)
    if model is None:
        model = default_model(ask=not print_only)
    alias = served_model_name or served_alias(model)
    extra = list(ctx.args)
    if print_only:
        plan = make_plan(spec, port, alias, api_key)
        cmd = serve_command(model, alias, port) + (["--api-key", api_key] if api_key else [])
        print(render_plan(plan, cmd, extra))
        return
    try:
        code = run_launch(spec.name, model, port, alias=alias, client_args=extra, keep_server=keep_server,
                          api_key=api_key, timeout=timeout,
                          say=lambda m: err.print("[dim]launch:[/] " + escape(m), highlight=False))
    except LaunchError as e:
        fail(str(e), 1)
    raise typer.Exit(code)


def default_model(ask: bool) -> str:
    """DEFAULT_MODEL, named (with its repository and whether it must be downloaded) and, where
    a download is due and someone is at the terminal, confirmed."""
    import sys

    from mlxlocal.source.catalog import find_alias
    from mlxlocal.source.hub import list_cached

    repo = find_alias(DEFAULT_MODEL).repo  # type: ignore[union-attr]  # the catalog has it (tested)
    cached = any(m.repo_id.lower() == repo.lower() and m.has_config for m in list_cached())
    err.print(escape(f"launch: no --model given: using {DEFAULT_MODEL} ({repo}"
                     + (")" if cached else ", not downloaded yet)") + "; --model picks another"),
              highlight=False)
    if ask and not cached and sys.stdin.isatty():
        typer.confirm(f"Download {repo} now?", default=True, abort=True)
    return DEFAULT_MODEL


def register(app: typer.Typer) -> None:
    app.command("launch", help=LAUNCH_HELP,
                context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch)
