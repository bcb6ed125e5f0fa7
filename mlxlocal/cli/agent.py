"""`mlxlocal run --mcp FILE "task"`: one task through the agent tool loop (mlxlocal.repl.agent),
non-interactive. `mlxlocal chat --mcp FILE` is the interactive one (cli/generate.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from mlxlocal.cli.common import (
    DRAFT_MODEL_HELP,
    KERNELS_HELP,
    KV_BITS_HELP,
    KV_COMPACT_HELP,
    KV_GROUP_HELP,
    KV_MEMORY_HELP,
    MODEL_HELP,
    NUM_DRAFT_HELP,
    PROMPT_LOOKUP_HELP,
    agent_limits,
    compaction_policy,
    engine_options,
    fail,
    kernels_mode,
    speculation,
)
from mlxlocal.cli.generate import MAX_TOOLS_HELP, RERANK_HELP, TOOL_EMBEDDER_HELP, sampling_params


def run(
    task: Optional[str] = typer.Argument(None, help="The task; '-' or omitted reads stdin"),
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    mcp: list[Path] = typer.Option(..., "--mcp", help="MCP config file (mcpServers); repeatable"),
    max_steps: int = typer.Option(8, "--max-steps", help="Generations at most; then the run stops with a note"),
    max_tools: str = typer.Option("8", "--max-tools", help=MAX_TOOLS_HELP),
    tool_embedder: Optional[str] = typer.Option(None, "--tool-embedder", help=TOOL_EMBEDDER_HELP),
    rerank_tools: bool = typer.Option(False, "--rerank-tools", help=RERANK_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the whole transcript as one JSON object: messages, "
                                 "calls, results, policy decisions, token counts per step"),
    yes: bool = typer.Option(False, "--yes", help="Approve the calls the Rule-of-Two policy would ask a human "
                             "about (without it they are stopped); blocked calls stay blocked"),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt"),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n", help="Maximum tokens per generation"),
    temp: float = typer.Option(0.0, "--temp"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=KV_MEMORY_HELP),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pool size in blocks"),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block"),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help=KV_BITS_HELP),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help=KV_GROUP_HELP),
    kernels: Optional[str] = typer.Option(None, "--kernels", help=KERNELS_HELP),
    kv_compact: Optional[str] = typer.Option(None, "--kv-compact", help=KV_COMPACT_HELP),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help=DRAFT_MODEL_HELP),
    prompt_lookup: bool = typer.Option(False, "--prompt-lookup", help=PROMPT_LOOKUP_HELP),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", help=NUM_DRAFT_HELP),
) -> None:
    """Run one task with MCP tools: the model calls tools until it answers (Rule-of-Two policy
    before every call). Exit 0 answered, 1 stopped short, 2 unusable config."""
    from mlxlocal.repl.agent import run_task

    if task is None or task == "-":
        if sys.stdin.isatty():
            fail("no task: pass it as an argument or pipe it on stdin", 2)
        task = sys.stdin.read()
    if not task.strip():
        fail("the task is empty", 2)
    k = agent_limits(max_steps, max_tools)
    compact = compaction_policy(kv_compact)
    params = sampling_params(max_tokens=max_tokens, temperature=temp, top_p=top_p, seed=seed)
    options = engine_options(kv_cache_memory, kv_blocks, block_size, False, kv_bits, kv_group_size)
    kernels_mode(kernels)
    speculation(draft_model, prompt_lookup, num_draft_tokens, options)  # exits 2 when they clash
    raise typer.Exit(run_task(model, mcp, task, system=system, params=params, engine_options=options,
                              max_steps=max_steps, max_tools=k, tool_embedder=tool_embedder, rerank_tools=rerank_tools, as_json=as_json,
                              yes=yes, compact=compact))


def register(app: typer.Typer) -> None:
    """Add `run` to the main Typer app."""
    app.command()(run)
