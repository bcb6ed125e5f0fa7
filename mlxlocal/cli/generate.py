"""`mlxlocal generate` (one prompt, streamed) and `mlxlocal chat` (the REPL in mlxlocal.repl)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

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
    NUM_DRAFT_HELP,
    PRES_HELP,
    PROMPT_LOOKUP_HELP,
    agent_limits,
    compaction_policy,
    engine_options,
    err,
    fail,
    human_bytes,
    kernels_mode,
    speculation,
)
from mlxlocal.errors import MlxLocalError


def sampling_params(**fields):
    """SamplingParams from the command's options; a bad value exits 2 naming the option's field."""
    from mlxlocal.engine import SamplingParams

    params = SamplingParams(**fields)
    try:
        params.validate()
    except ValueError as e:
        fail(str(e), 2)
    return params


def generate(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; '-' or omitted reads stdin"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum tokens to generate"),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy)"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQ_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRES_HELP),
    seed: Optional[int] = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)"),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt"),
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Encode the prompt as plain text"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=KV_MEMORY_HELP),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pool size in blocks"),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable the radix prefix cache"),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help=KV_BITS_HELP),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help=KV_GROUP_HELP),
    kv_disk: Optional[str] = typer.Option(None, "--kv-disk", help=KV_DISK_HELP),
    kv_disk_dir: Optional[Path] = typer.Option(None, "--kv-disk-dir", help=KV_DISK_DIR_HELP),
    kernels: Optional[str] = typer.Option(None, "--kernels", help=KERNELS_HELP),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Constrain the output to JSON "
                                               "valid against the JSON schema in this file"),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the output to match this regex"),
    grammar_file: Optional[Path] = typer.Option(None, "--grammar", help="Constrain the output to the GBNF or "
                                                "Lark grammar in this file"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help=DRAFT_MODEL_HELP),
    prompt_lookup: bool = typer.Option(False, "--prompt-lookup", help=PROMPT_LOOKUP_HELP),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", help=NUM_DRAFT_HELP),
) -> None:
    """Generate a completion for one prompt, streamed to the terminal."""
    from mlxlocal.engine import KVPrecisionError, open_engine, prompt_encoder
    from mlxlocal.source.loader import load

    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            fail("no prompt: pass --prompt or pipe text on stdin", 2)
        prompt = sys.stdin.read()
    constraint = output_constraint(json_schema, regex, grammar_file)
    params = sampling_params(
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed, stop=list(stop), ignore_eos=ignore_eos,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, grammar=constraint,
    )
    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache, kv_bits, kv_group_size,
                             kv_disk, kv_disk_dir)
    kernels_mode(kernels)
    spec = speculation(draft_model, prompt_lookup, num_draft_tokens, options)
    try:
        loaded = load(model)
        prompts = prompt_encoder(loaded)
        if no_chat_template:
            text = (system + "\n\n" + prompt) if system else prompt
            ids = prompts.encode_text(text)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = prompts.encode_chat(messages)
        if constraint is not None:
            params.grammar = after_reasoning(constraint, prompts, ids, max_tokens)
        # One request: a pool just big enough for it (and a verify step's drafted tokens), unless
        # told otherwise.
        options.setdefault("kv_tokens", len(ids) + max_tokens + (spec.num_draft_tokens if spec else 0))
        engine = open_engine(loaded, **{"max_num_seqs": 1, **options})
        pieces: list[str] = []
        tokens: list[int] = []
        stats = None
        try:
            for chunk in engine.generate(ids, params):
                pieces.append(chunk.text)
                if chunk.token is not None:
                    tokens.append(chunk.token)
                if chunk.stats is not None:
                    stats = chunk.stats
                if not as_json and chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            kv_bits = engine.kv_pool.get("kv_bits")
        finally:
            # The engine thread ends (and clears its MLX stream) before the interpreter does: a
            # live worker stream at exit can abort the process ("terminate called ...": CI once).
            engine.shutdown()
    except KVPrecisionError as e:  # the model's head_dim and --kv-group-size disagree
        fail(str(e), 2)
    except MlxLocalError as e:
        fail(str(e))
    assert stats is not None
    synthetic = engine.info.source == "synthetic"
    if as_json:
        result = {"model": engine.info.name, "text": "".join(pieces), "tokens": tokens, **stats.as_dict(),
                  "acceptance_rate": acceptance_rate(stats) if spec else None, "synthetic": synthetic,
                  "kv_bits": kv_bits}
        print(json.dumps(result))
        return
    sys.stdout.write("\n")
    line = stats_line(stats, engine.context_length) + (spec_line(stats) if spec else "")
    err.print(line, style="dim", highlight=False, markup=False)
    if synthetic:
        err.print("(random weights: the text is gibberish on purpose; the numbers above are the "
                  "real speed of this model shape)", style="dim", highlight=False, markup=False)


def output_constraint(json_schema: Optional[Path], regex: Optional[str], grammar_file: Optional[Path]):
    """The Grammar the options ask for (at most one), or None; a bad file or schema exits 2
    naming the file and the fault, before the model loads."""
    from mlxlocal import grammar

    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar_file))
             if v is not None]
    if len(given) > 1:
        fail(f"{given[0]} and {given[1]}: give at most one output constraint", 2)
    try:
        if regex is not None:
            return grammar.regex(regex, "--regex")
        for path, option in ((json_schema, "--json-schema"), (grammar_file, "--grammar")):
            if path is None:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                fail(f"{option} {path}: cannot read it: {e}", 2)
            if option == "--grammar":
                return grammar.gbnf(text, str(path))
            try:
                schema = json.loads(text)
            except ValueError as e:
                fail(f"{option} {path}: not valid JSON: {e}", 2)
            return grammar.json_schema(schema, str(path))
    except grammar.GrammarError as e:
        fail(str(e), 2)
    return None


def after_reasoning(constraint, prompts, ids: list[int], max_tokens: int):
    """The constraint applied after a thinking model's think block (as the server does)."""
    from mlxlocal.grammar import with_reasoning
    from mlxlocal.grammar.parse import starts_in_reasoning

    opened = starts_in_reasoning(prompts, ids)
    return with_reasoning(constraint, prompts.chat_format, opened, max(1, max_tokens // 2))


def stats_line(stats, context_length: int) -> str:
    """The footer under a reply: every number labelled, and why a "length" finish happened."""
    finish = stats.finish_reason or "unknown"
    why = {"max_tokens": "max tokens", "context": f"context full: {context_length} tokens",
           "kv_cache": "KV cache full: raise --kv-cache-memory"}.get(stats.truncated_by)
    if why:
        finish += f" ({why})"
    if stats.grammar_complete is False:  # cut short: what was printed does not parse
        finish += ", output incomplete: the constraint was not finished"
    disk = f", {stats.disk_tokens} from disk" if stats.disk_tokens else ""
    return (f"prompt {stats.prompt_tokens} tokens ({stats.cached_tokens} cached{disk}), {stats.prefill_tps:.1f} tok/s"
            f" · reply {stats.completion_tokens} tokens, {stats.decode_tps:.1f} tok/s"
            f" · TTFT {stats.ttft_s * 1000:.0f} ms · peak memory {human_bytes(stats.peak_memory_bytes)}"
            f" · finish: {finish}")


def acceptance_rate(stats) -> float | None:
    """Drafted tokens the model accepted, as a share (None: nothing was drafted)."""
    return stats.accepted_tokens / stats.draft_tokens if stats.draft_tokens else None


def spec_line(stats) -> str:
    rate = acceptance_rate(stats)
    return (f" · speculative: {stats.accepted_tokens}/{stats.draft_tokens} drafted tokens accepted"
            + (f" ({rate:.0%})" if rate is not None else ""))


MAX_TOOLS_HELP = ("With more MCP tools than this, the prompt offers the top K for each user turn, the tools "
                  "called before and a search_tools tool that finds more; 0 or all: every tool")
TOOL_EMBEDDER_HELP = ("Embedding model (e.g. minilm) for the tool index's dense stage besides BM25 "
                      "(default: BM25 only)")
THINKING_BUDGET_HELP = ("A think block still open after this many tokens of a reply is closed "
                        "and the model answers (default: no budget)")
RERANK_HELP = ("The chat model itself re-ranks the tool index's top 20 at each user turn (one short "
               "constrained generation per turn)")


def chat(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt"),
    max_tokens: int = typer.Option(1024, "--max-tokens", "-n"),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget",
                                                  help=THINKING_BUDGET_HELP),
    temp: float = typer.Option(0.0, "--temp"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQ_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRES_HELP),
    seed: Optional[int] = typer.Option(None, "--seed"),
    history_file: Optional[Path] = typer.Option(None, "--history-file", help="Input history (default under ~/.local/state/mlxlocal)"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help=KV_MEMORY_HELP),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", help="KV pool size in blocks"),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache", help="Disable the radix prefix cache"),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help=KV_BITS_HELP),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help=KV_GROUP_HELP),
    kv_disk: Optional[str] = typer.Option(None, "--kv-disk", help=KV_DISK_HELP),
    kv_disk_dir: Optional[Path] = typer.Option(None, "--kv-disk-dir", help=KV_DISK_DIR_HELP),
    kernels: Optional[str] = typer.Option(None, "--kernels", help=KERNELS_HELP),
    mcp: list[Path] = typer.Option([], "--mcp", help="MCP config file (mcpServers, as Claude Desktop / Cursor "
                                   "write it): the model may call its servers' tools; repeatable"),
    max_steps: int = typer.Option(8, "--max-steps", help="With --mcp: generations per turn at most"),
    max_tools: str = typer.Option("8", "--max-tools", help="With --mcp: " + MAX_TOOLS_HELP),
    tool_embedder: Optional[str] = typer.Option(None, "--tool-embedder", help="With --mcp: " + TOOL_EMBEDDER_HELP),
    rerank_tools: bool = typer.Option(False, "--rerank-tools", help="With --mcp: " + RERANK_HELP),
    kv_compact: Optional[str] = typer.Option(None, "--kv-compact", help=KV_COMPACT_HELP),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help=DRAFT_MODEL_HELP),
    prompt_lookup: bool = typer.Option(False, "--prompt-lookup", help=PROMPT_LOOKUP_HELP),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", help=NUM_DRAFT_HELP),
) -> None:
    """Chat with a model in the terminal (Markdown streaming, history, /help for commands)."""
    from mlxlocal.repl.chat import run_chat

    compact = compaction_policy(kv_compact)
    params = sampling_params(
        max_tokens=max_tokens, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        think_budget=thinking_budget,
    )
    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache, kv_bits, kv_group_size,
                             kv_disk, kv_disk_dir)
    kernels_mode(kernels)
    speculation(draft_model, prompt_lookup, num_draft_tokens, options)  # exits 2 when they clash
    if mcp:
        from mlxlocal.repl.agent import run_agent_chat

        k = agent_limits(max_steps, max_tools)
        raise typer.Exit(run_agent_chat(model, mcp, system=system, params=params, history_file=history_file,
                                        engine_options=options, max_steps=max_steps, max_tools=k,
                                        tool_embedder=tool_embedder, rerank_tools=rerank_tools,
                                        compact=compact))
    raise typer.Exit(run_chat(model, system=system, params=params, history_file=history_file,
                              engine_options=options, compact=compact))

def register(app: typer.Typer) -> None:
    """Add `generate` and `chat` to the main Typer app."""
    app.command()(generate)
    app.command()(chat)
