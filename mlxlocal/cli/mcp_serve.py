"""`mlxlocal mcp serve`: the local model as an MCP server (tools generate, chat, count_tokens;
resource mlxlocal://models) over stdio or Streamable HTTP. The server is in
mlxlocal/server/mcp_tools.py and mcp_http.py; `mlxlocal serve` mounts the same at /mcp."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from mlxlocal.cli.common import (
    MODEL_HELP,
    duration_option,
    engine_options,
    err,
    fail,
)
from mlxlocal.cli.options import (
    BlockSize,
    KvBlocks,
    KvCacheMemory,
    NoPrefixCache,
)

mcp_app = typer.Typer(name="mcp", help="The Model Context Protocol: serve the local model to MCP clients.",
                      no_args_is_help=True)


class Transport(str, Enum):
    stdio = "stdio"
    http = "http"


def is_loopback_bind(host: str) -> bool:
    from mlxlocal.server.app import _host_name, is_loopback_host

    return is_loopback_host(_host_name(host))


def mcp_banner(config, registry, port: int) -> str:
    from mlxlocal import __version__
    from mlxlocal.server.banner import kv_pool, url_of

    m = registry.models[0]
    return "\n".join([
        f"mlxlocal {__version__} MCP server on {url_of(config.host, port)}/mcp (Streamable HTTP)",
        f"  model    {m.name}",
        f"           {kv_pool(m.engine)}",
        "  tools    generate, chat, count_tokens" + (", embed" if registry.embedders else "")
        + " · resource mlxlocal://models",
        f"  API key  {'on' if config.api_key else 'off'}",
    ])


@mcp_app.command("serve")
def serve(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    embed_model: list[str] = typer.Option([], "--embed-model", help="Embedding model for the embed tool "
                                          "(repeatable): a local directory, a Hugging Face repo id, or minilm"),
    transport: Transport = typer.Option(Transport.stdio, "--transport", help="stdio (a client starts this "
                                        "command) or http (Streamable HTTP at /mcp)"),
    host: str = typer.Option("127.0.0.1", "--host", help="http: address to bind (default: this machine only)"),
    port: int = typer.Option(8765, "--port", help="http: port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLXLOCAL_API_KEY",
                                          help="http: require this key (Authorization: Bearer KEY)"),
    allow_origin: list[str] = typer.Option([], "--allow-origin", help="http: browser origin allowed besides "
                                           "localhost (repeatable; * for any)"),
    allow_host: list[str] = typer.Option([], "--allow-host", help="http: Host name accepted besides loopback "
                                         "names and the bound address (repeatable; * for any)"),
    force_public: bool = typer.Option(False, "--force-public", help="http: bind a non-loopback address "
                                      "without --api-key anyway"),
    mcp_max_sessions: int = typer.Option(256, "--mcp-max-sessions", min=1, help="http: sessions open at "
                                         "once; when full, the least recently used idle one is closed"),
    mcp_session_idle: str = typer.Option("30m", "--mcp-session-idle", help="http: close a session after this "
                                         "time without a request (30s, 5m, 1h; -1 never)"),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Sequences decoded together"),
    kv_cache_memory: KvCacheMemory = None,
    kv_blocks: KvBlocks = None,
    block_size: BlockSize = 16,
    no_prefix_cache: NoPrefixCache = False,
) -> None:
    """Serve the model to MCP clients: tools generate, chat, count_tokens; resource mlxlocal://models."""
    from mlxlocal.server.app import ServerConfig
    from mlxlocal.server.registry import ModelRegistry

    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache)
    options["max_num_seqs"] = max_num_seqs
    registry = ModelRegistry([model], options, float("inf"), embed_specs=list(embed_model))
    if transport is Transport.stdio:
        from mlxlocal.server.mcp_http import run_stdio

        try:
            run_stdio(registry)
        except Exception as e:  # the model failed to load (in the server's lifespan)?
            load_error = _load_error(e)
            if load_error is None:
                raise
            fail(load_error)
        return
    if not is_loopback_bind(host) and not api_key and not force_public:
        fail(f"refusing to serve MCP on {host} without --api-key: anyone who can reach this address could "
             "use the model (give --api-key KEY, or --force-public to do it anyway)", 2)
    if not is_loopback_bind(host) and not api_key:
        err.print(f"[yellow]warning:[/] MCP on {host} without --api-key (--force-public)", highlight=False)
    from mlxlocal.server.banner import run_server
    from mlxlocal.server.mcp_http import standalone_app

    idle = duration_option(mcp_session_idle, "--mcp-session-idle", positive=True)
    config = ServerConfig(models=[model], host=host, port=port, api_key=api_key,
                          allowed_origins=list(allow_origin), allowed_hosts=list(allow_host),
                          engine_options=options, mcp_max_sessions=mcp_max_sessions, mcp_session_idle=idle)
    if not run_server(config, err, app=standalone_app(config, registry), registry=registry, text=mcp_banner):
        raise typer.Exit(1)


def _load_error(e: BaseException) -> str | None:
    """The model's load error inside an exception group (anyio's task groups wrap it)."""
    from mlxlocal.errors import MlxLocalError
    from mlxlocal.server.errors import APIError

    seen = set()
    stack: list[BaseException | None] = [e]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, APIError):
            return cur.message
        if isinstance(cur, MlxLocalError):
            return str(cur)
        stack.extend(getattr(cur, "exceptions", ()) or ())
        stack.extend([cur.__cause__, cur.__context__])
    return None


def register(app: typer.Typer) -> None:
    """Add the `mcp` group to the main Typer app."""
    app.add_typer(mcp_app)

