"""`mlxlocal generate` (one prompt, streamed) and `mlxlocal chat` (the REPL in mlxlocal.repl)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from mlxlocal.cli.common import (
    agent_limits,
    compaction_policy,
    engine_options,
    err,
    fail,
    human_bytes,
    kernels_mode,
    speculation,
)
from mlxlocal.cli.options import (
    OUTPUT,
    BlockSize,
    DraftModel,
    FrequencyPenalty,
    Kernels,
    KvBits,
    KvBlocks,
    KvCacheMemory,
    KvCompact,
    KvDisk,
    KvDiskDir,
    KvGroupSize,
    MaxSteps,
    MaxTools,
    MinP,
    Model,
    Mtp,
    NoPrefixCache,
    NumDraftTokens,
    PresencePenalty,
    PromptLookup,
    RepetitionPenalty,
    RerankTools,
    Seed,
    System,
    Temp,
    ThinkingBudget,
    ToolEmbedder,
    TopK,
    TopP,
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
    model: Model,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; '-' or omitted reads stdin"),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Maximum tokens to generate"),
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    presence_penalty: PresencePenalty = 0.0,
    seed: Seed = None,
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)",
                                   rich_help_panel=OUTPUT),
    system: System = None,
    no_chat_template: bool = typer.Option(False, "--no-chat-template", help="Encode the prompt as plain text",
                                          rich_help_panel=OUTPUT),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence",
                                    rich_help_panel=OUTPUT),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming",
                                 rich_help_panel=OUTPUT),
    kv_cache_memory: KvCacheMemory = None,
    kv_blocks: KvBlocks = None,
    block_size: BlockSize = 16,
    no_prefix_cache: NoPrefixCache = False,
    kv_bits: KvBits = None,
    kv_group_size: KvGroupSize = 64,
    kv_disk: KvDisk = None,
    kv_disk_dir: KvDiskDir = None,
    kernels: Kernels = None,
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Constrain the output to JSON "
                                               "valid against the JSON schema in this file",
                                               rich_help_panel=OUTPUT),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the output to match this regex",
                                        rich_help_panel=OUTPUT),
    grammar_file: Optional[Path] = typer.Option(None, "--grammar", help="Constrain the output to the GBNF or "
                                                "Lark grammar in this file",
                                                rich_help_panel=OUTPUT),
    draft_model: DraftModel = None,
    prompt_lookup: PromptLookup = False,
    num_draft_tokens: NumDraftTokens = None,
    mtp: Mtp = "auto",
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
    spec = speculation(draft_model, prompt_lookup, num_draft_tokens, options, mtp)
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
        if spec is not None and not spec.applies_to(loaded):
            spec = None  # --mtp auto, and the model has no MTP modules: it decodes as it is
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
        from mlxlocal.source.synthetic import is_trained

        what = ("trained here on synthetic text: it writes that kind of text"
                if is_trained(engine.info.path) else "random weights: the text is gibberish on purpose")
        err.print(f"({what}; the numbers above are the real speed of this model shape)",
                  style="dim", highlight=False, markup=False)


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


def chat(
    model: Model,
    system: System = None,
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Maximum tokens per reply "
                                             "(default: 1024; 128 on a synthetic model's random weights)"),
    thinking_budget: ThinkingBudget = None,
    temp: Temp = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    min_p: MinP = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0,
    frequency_penalty: FrequencyPenalty = 0.0,
    presence_penalty: PresencePenalty = 0.0,
    seed: Seed = None,
    history_file: Optional[Path] = typer.Option(None, "--history-file", help="Input history (default under ~/.local/state/mlxlocal)"),
    kv_cache_memory: KvCacheMemory = None,
    kv_blocks: KvBlocks = None,
    block_size: BlockSize = 16,
    no_prefix_cache: NoPrefixCache = False,
    kv_bits: KvBits = None,
    kv_group_size: KvGroupSize = 64,
    kv_disk: KvDisk = None,
    kv_disk_dir: KvDiskDir = None,
    kernels: Kernels = None,
    mcp: list[Path] = typer.Option([], "--mcp", help="MCP config file (mcpServers, as Claude Desktop / Cursor "
                                   "write it): the model may call its servers' tools; repeatable"),
    max_steps: MaxSteps = 8,
    max_tools: MaxTools = "8",
    tool_embedder: ToolEmbedder = None,
    rerank_tools: RerankTools = False,
    kv_compact: KvCompact = None,
    draft_model: DraftModel = None,
    prompt_lookup: PromptLookup = False,
    num_draft_tokens: NumDraftTokens = None,
    mtp: Mtp = "auto",
) -> None:
    """Chat with a model in the terminal (Markdown streaming, history, /help for commands)."""
    from mlxlocal.repl.chat import DEFAULT_MAX_TOKENS, run_chat

    compact = compaction_policy(kv_compact)
    params = sampling_params(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, temperature=temp,
        top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition_penalty, seed=seed,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        think_budget=thinking_budget,
    )
    options = engine_options(kv_cache_memory, kv_blocks, block_size, no_prefix_cache, kv_bits, kv_group_size,
                             kv_disk, kv_disk_dir)
    kernels_mode(kernels)
    speculation(draft_model, prompt_lookup, num_draft_tokens, options, mtp)  # exits 2 when they clash
    if mcp:
        from mlxlocal.repl.agent import run_agent_chat

        k = agent_limits(max_steps, max_tools)
        raise typer.Exit(run_agent_chat(model, mcp, system=system, params=params, history_file=history_file,
                                        engine_options=options, max_steps=max_steps, max_tools=k,
                                        tool_embedder=tool_embedder, rerank_tools=rerank_tools,
                                        compact=compact))
    raise typer.Exit(run_chat(model, system=system, params=params, history_file=history_file,
                              engine_options=options, compact=compact, max_tokens_given=max_tokens is not None))

def register(app: typer.Typer) -> None:
    """Add `generate` and `chat` to the main Typer app."""
    app.command()(generate)
    app.command()(chat)
