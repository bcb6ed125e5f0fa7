"""`mlxlocal run --mcp FILE "task"`: one task through the agent tool loop (mlxlocal.repl.agent),
non-interactive. `mlxlocal chat --mcp FILE` is the interactive one (cli/generate.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from mlxlocal.cli.common import (
    MODEL_HELP,
    agent_limits,
    compaction_policy,
    engine_options,
    fail,
    kernels_mode,
    speculation,
)
from mlxlocal.cli.generate import sampling_params
from mlxlocal.cli.options import (
    OUTPUT,
    TOOLS,
    BlockSize,
    DraftModel,
    Kernels,
    KvBits,
    KvBlocks,
    KvCacheMemory,
    KvCompact,
    KvGroupSize,
    MaxSteps,
    MaxTools,
    Mtp,
    NumDraftTokens,
    PromptLookup,
    RerankTools,
    Seed,
    System,
    Temp,
    ToolEmbedder,
    TopP,
)


def run(
    task: Optional[str] = typer.Argument(None, help="The task; '-' or omitted reads stdin"),
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    mcp: list[Path] = typer.Option(..., "--mcp", help="MCP config file (mcpServers); repeatable",
                                   rich_help_panel=TOOLS),
    max_steps: MaxSteps = 8,
    max_tools: MaxTools = "8",
    tool_embedder: ToolEmbedder = None,
    rerank_tools: RerankTools = False,
    as_json: bool = typer.Option(False, "--json", help="Print the whole transcript as one JSON object: messages, "
                                 "calls, results, policy decisions, token counts per step",
                                 rich_help_panel=OUTPUT),
    yes: bool = typer.Option(False, "--yes", help="Approve the calls the Rule-of-Two policy would ask a human "
                             "about (without it they are stopped); blocked calls stay blocked",
                             rich_help_panel=TOOLS),
    system: System = None,
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n", help="Maximum tokens per generation"),
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = None,
    kv_cache_memory: KvCacheMemory = None,
    kv_blocks: KvBlocks = None,
    block_size: BlockSize = 16,
    kv_bits: KvBits = None,
    kv_group_size: KvGroupSize = 64,
    kernels: Kernels = None,
    kv_compact: KvCompact = None,
    draft_model: DraftModel = None,
    prompt_lookup: PromptLookup = False,
    num_draft_tokens: NumDraftTokens = None,
    mtp: Mtp = "auto",
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
    speculation(draft_model, prompt_lookup, num_draft_tokens, options, mtp)  # exits 2 when they clash
    raise typer.Exit(run_task(model, mcp, task, system=system, params=params, engine_options=options,
                              max_steps=max_steps, max_tools=k, tool_embedder=tool_embedder, rerank_tools=rerank_tools, as_json=as_json,
                              yes=yes, compact=compact))


def register(app: typer.Typer) -> None:
    """Add `run` to the main Typer app."""
    app.command()(run)
